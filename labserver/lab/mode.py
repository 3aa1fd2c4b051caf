"""Quick mode: every notebook shrinks its parameters when ``LABSERVER_QUICK=1`` (the tests set it)."""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["QUICK_ENV", "pick", "quick_mode"]

QUICK_ENV = "LABSERVER_QUICK"
T = TypeVar("T")


def quick_mode() -> bool:
    """True when ``LABSERVER_QUICK`` is set to 1 (or true/yes/on): shrink every run."""
    return os.environ.get(QUICK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def pick(full: T, quick: T) -> T:
    """``quick`` in quick mode, else ``full``: one parameter, both sizes, side by side.

    ``DURATION_S = pick(full=20.0, quick=3.0)`` reads as what it is in both modes.
    """
    return quick if quick_mode() else full
