"""Shared fixtures."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .fakes import GateModel


@pytest.fixture
def gate() -> Iterator[GateModel]:
    m = GateModel()
    yield m
    m.gate.set()  # never leave a thread blocked behind a failed test


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random folder of each family (labserver.models.folders), and Llama's multi-head twin."""
    from labserver.models.folders import FAMILIES, write_tiny

    root = tmp_path_factory.mktemp("tiny")
    made = {family: write_tiny(family, root / family) for family in FAMILIES}
    made["llama-mha"] = write_tiny("llama", root / "llama-mha", kv_heads=8)  # the multi-head twin
    return made


@pytest.fixture
def untouched_rcparams() -> Iterator[None]:
    """A plot may style its own figure, never the session's matplotlib defaults (every plot test uses it)."""
    import matplotlib
    import matplotlib.pyplot as plt

    before = copy.deepcopy(dict(matplotlib.rcParams))
    yield
    plt.close("all")
    assert dict(matplotlib.rcParams) == before


@pytest.fixture
def ax(untouched_rcparams: None) -> Any:
    """A fresh axes to draw on."""
    import matplotlib.pyplot as plt

    return plt.subplots()[1]


@pytest.fixture(autouse=True)
def no_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LABSERVER_API_KEY in the developer's shell would key every server these tests start."""
    monkeypatch.delenv("LABSERVER_API_KEY", raising=False)
