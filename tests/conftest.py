"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .fakes import GateModel


@pytest.fixture
def gate() -> Iterator[GateModel]:
    m = GateModel()
    yield m
    m.gate.set()  # never leave a thread blocked behind a failed test
