"""Shared fixtures."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .fakes import GateModel


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n`` (``make test``), each worker's torch (and every process it starts) computes on one
    thread: two workers with a team of two threads each would oversubscribe two cores, and an OpenMP team
    whose workers wait for a core makes every small op wait for them (a step ten times slower)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


RAY_TESTS = ("tests/test_replicas.py", "tests/test_replicas_cli.py", "tests/test_replicas_autoscale.py", "tests/test_disagg.py", "test_notebook_runs[10_replicas", "test_notebook_runs[14_prefill", "test_notebook_runs[16_replicas")
TIMED = ("tests/test_queueing_theory.py", "test_compiled_steps_of_one_sequence",  # live latencies within 10 %,
         "test_notebook_runs[09_kv")  # and torch.compile, which takes both cores for ~20 s: never side by side


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n`` (``make test``), the tests that start a local Ray run one after another on one
    worker: two Ray instances at once would double the processes each starts on two cores. So do the
    queueing-theory tests and the test that compiles a step (``TIMED``).

    The long ones go first: the two groups (each runs whole on one worker), then the other notebooks, then the
    rest. A group handed out last keeps one worker busy long after the other has run out of tests."""
    for item in items:
        if any(part in item.nodeid for part in RAY_TESTS):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif any(part in item.nodeid for part in TIMED):
            item.add_marker(pytest.mark.xdist_group("timed"))

    def rank(item: pytest.Item) -> int:
        if any(part in item.nodeid for part in RAY_TESTS):
            return 0
        if any(part in item.nodeid for part in TIMED):
            return 1
        return 2 if "test_notebook_runs[" in item.nodeid else 3

    items.sort(key=rank)  # (stable: each group keeps its order)


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
