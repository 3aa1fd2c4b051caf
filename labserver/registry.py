"""Every registry of rules in one shape: a table by name, a decorator that refuses a taken name, a maker.

Strategies, prefill rules, admission doors, queue disciplines and scheduling policies are
each a class with a ``name``, kept in a ``dict`` of their own; ``registrar(table, "what")``
is the decorator that adds one (a second class under a taken name is an error, not a silent
replacement), and ``make(table, "what", name, limits)`` builds one by name, or says which
names there are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["make", "registrar"]

T = TypeVar("T", bound=type)


def registrar(table: dict[str, Any], what: str) -> Callable[[T], T]:
    def register(cls: T) -> T:
        taken = table.get(cls.name)
        if taken is not None:
            raise ValueError(f"{what} name {cls.name!r} is taken by {taken.__qualname__}")
        table[cls.name] = cls
        return cls

    return register


def make(table: dict[str, Any], what: str, name: str, *args: Any) -> Any:
    cls = table.get(name)
    if cls is None:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(table)}")
    return cls(*args)
