"""Every notebook in notebooks/ runs top to bottom, in quick mode, without an error.

Each is executed from an in-memory copy (the committed file and its outputs stay as
they are) by a fresh "python3" kernel that is this virtual environment's Python, with
``LABSERVER_QUICK=1`` so that it finishes in about a minute on two cores. The kernel's
own warnings do not matter here; a cell that raises does.
"""

from __future__ import annotations

import doctest
import os
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # quick cells take seconds; this only stops a hung one
DEF = re.compile(r"^\s*(async\s+)?def\s", re.MULTILINE)
QUICK_BUDGET_S = 90  # what a notebook should take in quick mode on 2 cores (reported, not enforced)


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # "python" = this venv's
    env["LABSERVER_QUICK"] = "1"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # inline PNGs, never a GUI window
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time; make sure of it
    return env


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 6, f"expected the six walkthroughs in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    before = path.read_bytes()
    nb = nbformat.reads(before.decode("utf-8"), as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name}: expected one cell tagged 'parameters'"
    assert not any(c.cell_type == "code" and DEF.search(c.source) for c in nb.cells), \
        f"{path.name}: notebooks import reusable code from labserver, they do not define it"
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False, record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},  # run from notebooks/, as Jupyter would
    )
    started = time.perf_counter()
    client.execute(env=kernel_env())  # raises CellExecutionError naming the cell on any error
    took_s = time.perf_counter() - started
    print(f"{path.name}: {took_s:.1f} s in quick mode (budget {QUICK_BUDGET_S} s on 2 cores)")
    assert path.read_bytes() == before, "executing must not touch the committed notebook"


def test_lab_doctests() -> None:
    """labserver.lab serves the notebooks; its docstring examples are checked with them."""
    from labserver import lab

    assert doctest.testmod(lab).failed == 0


def outputs_text(nb: nbformat.NotebookNode) -> list[str]:
    """Every line a committed notebook printed (streams and plain-text results)."""
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            lines += ("".join(text) if isinstance(text, list) else text).splitlines()
    return lines


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_states_its_claims_against_its_numbers(path: Path) -> None:
    """Each lesson checks its words with lab.claim, and the committed run shows every verdict with its reason.

    A claim that did not hold in the committed (full-mode) run must say why it may not; a
    committed notebook is never a quick-mode run.
    """
    nb = nbformat.reads(path.read_text(), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "lab.claim(" in code, f"{path.name} checks none of its statements with lab.claim"
    lines = outputs_text(nb)
    assert any(line.startswith(("✔ holds here", "✘ DOES NOT HOLD here")) for line in lines), \
        f"{path.name} is committed without its claims' output: execute it in full mode"
    assert not any("[quick mode: small samples]" in line for line in lines), \
        f"{path.name} was committed from a quick-mode run"
    unexplained = [line for line in lines if line.startswith("✘ DOES NOT HOLD here")
                   and not re.search(r"why it may not: \S", line)]
    assert not unexplained, f"{path.name}: claims that failed with no reason given: {unexplained}"
