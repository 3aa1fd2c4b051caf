"""Small hand-written fakes shared by the tests."""

from __future__ import annotations

import threading
from typing import Any

from labserver.models import POISON, ModelError


class GateModel:
    """A model whose calls block until the test opens the gate: events, not sleeps.

    ``entered`` is set when a call starts; ``computed`` lists every text that reached
    the model, so a test can prove what was *not* computed.
    """

    name = "gate"
    max_chars = None

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.computed: list[str] = []
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> list[Any]:
        self.calls.append(list(texts))
        self.entered.set()
        if not self.gate.wait(30):
            raise RuntimeError("test never opened the gate")
        if any(POISON in t for t in texts):
            raise ModelError("poisoned input")
        self.computed.extend(texts)
        return [{"text": t} for t in texts]

    def check(self, text: str) -> None:
        pass


class Crash(BaseException):
    """Not an Exception: kills whatever runs the model (as a hard fault would)."""


class CrashModel:
    name = "crash"
    max_chars = None

    def __call__(self, texts: list[str]) -> list[Any]:
        if any("__crash__" in t for t in texts):
            raise Crash("simulated worker crash")
        return [{"text": t} for t in texts]

    def check(self, text: str) -> None:
        pass
