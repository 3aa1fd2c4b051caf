"""The two ways to install (pip + pyproject, conda + environment.yml) list the same packages."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PYPI = {"pytorch": "torch", "prometheus_client": "prometheus-client"}
NOT_PACKAGES = {"python", "pip"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_packages() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {_name(r) for r in reqs}


def conda_packages() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    names = set()
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            if item.startswith("-e"):
                continue
            raw = re.split(r"[<>=!~ ]", item.strip(), maxsplit=1)[0].lower()
            names.add(_name(CONDA_TO_PYPI.get(raw, raw)))
    return names - NOT_PACKAGES


def test_environment_yml_matches_pyproject() -> None:
    assert conda_packages() == pyproject_packages()


def test_environment_installs_the_project_itself() -> None:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["name"] == "labserver"
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e ." in pip


def test_torch_is_pinned_exactly_for_pip() -> None:
    """A looser spec can pull several GB of CUDA packages on a CPU-only machine; conda installs it with pip too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(item.split("#")[0].strip() == "torch==2.13.0" for item in pip)
    assert not any(str(d).startswith("pytorch") for d in env["dependencies"])
