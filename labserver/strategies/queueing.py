"""Who waits and who is refused when there is more work than capacity: queue disciplines and the door.

- **queue disciplines** (``Limits.queue``): which waiting request an encoder batch takes
  next, and which are shed. The waiting line keeps one FIFO per priority class (a lower
  ``priority`` is served first, as vLLM's); a discipline picks within the best class.
  ``fifo`` (the default), ``lifo``, ``adaptive-lifo`` (newest first while a queue stands,
  first come first served otherwise: Facebook's "Fail at Scale") and ``codel`` (while a
  queue stands, a request that waited longer than ``codel_target_ms`` is shed with 503).
  A queue *stands* when it has not been empty for ``codel_interval_ms``: CoDel's notion,
  with its defaults of 5 and 100 ms.
- **the door** (``Limits.admit``): who may queue at all. ``all`` (the default), or
  ``deadline``: refused at once (503) when the work ahead would answer it past ``timeout_ms``,
  at the batch cost the engine fits as it runs (``BatchCost``; the ``slo`` strategy reads it too).

Generation orders its waiting by a scheduling policy instead (``labserver.strategies.scheduling``).
Nothing here knows the engine, nor imports the rest of the package (a rule reads its knobs from
the strategy's ``Limits``, passed in): a rule sees the waiting (each with ``enqueued_s``,
``priority``, ``tenant``), and the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar

from ..registry import make, registrar

__all__ = ["DISCIPLINES", "DOORS", "AdaptiveLIFO", "BatchCost", "CoDel", "DeadlineDoor", "Discipline", "Door", "FIFO", "LIFO",
           "make_discipline", "make_door", "priority_of", "tenant_of"]


def priority_of(item: Any) -> int:
    return int(getattr(item, "priority", 0))


def tenant_of(item: Any) -> str:
    return str(getattr(item, "tenant", ""))


# -- encoder queue disciplines ------------------------------------------------------------

DISCIPLINES: dict[str, type[Discipline]] = {}


_discipline = registrar(DISCIPLINES, "queue discipline")


class Discipline:
    """Which request of a class's line goes next (``pick``), and who is shed now (``shed``)."""

    name: ClassVar[str] = ""
    orders_generation: ClassVar[bool] = False  # a generation queue may use it too (its order is scheduling=)

    def __init__(self, limits: Any = None) -> None:
        """``limits``: the strategy's (its codel_* knobs); None: CoDel's defaults, 5 and 100 ms."""
        self.target_s = getattr(limits, "codel_target_ms", 5.0) / 1000
        self.interval_s = getattr(limits, "codel_interval_ms", 100.0) / 1000

    def standing(self, now: float, last_empty_s: float) -> bool:
        """A queue stands when it has not been empty for a whole interval."""
        return now - last_empty_s >= self.interval_s

    def pick(self, line: Sequence[Any], standing: bool) -> int:
        """The index, in arrival order, of the request that goes next."""
        return 0

    def shed(self, line: Sequence[Any], now: float, standing: bool) -> list[Any]:
        """Requests to refuse now (503, ``x-reason`` = this discipline's name)."""
        return []


@_discipline
class FIFO(Discipline):
    """First come, first served: under overload everyone is answered late."""

    name = "fifo"
    orders_generation = True


@_discipline
class LIFO(Discipline):
    """Newest first: the fresh are answered in time, the old wait on (their deadline answers them)."""

    name = "lifo"

    def pick(self, line: Sequence[Any], standing: bool) -> int:
        return len(line) - 1


@_discipline
class AdaptiveLIFO(Discipline):
    """Newest first while a queue stands (the old would be late anyway), first come first served otherwise."""

    name = "adaptive-lifo"

    def pick(self, line: Sequence[Any], standing: bool) -> int:
        return len(line) - 1 if standing else 0


@_discipline
class CoDel(Discipline):
    """Controlled delay on queue time: while a queue stands, shed whoever waited past the target."""

    name = "codel"
    orders_generation = True  # it only sheds: the order stays scheduling='s

    def shed(self, line: Sequence[Any], now: float, standing: bool) -> list[Any]:
        if not standing:
            return []  # everyone here came since the queue was last empty: none waited a whole interval
        shed = []
        for item in line:  # in arrival order: the ones past the target are a prefix
            if now - item.enqueued_s <= self.target_s:
                break
            shed.append(item)
        return shed


def make_discipline(limits: Any) -> Discipline:
    return make(DISCIPLINES, "queue discipline", limits.queue, limits)  # type: ignore[no-any-return]


# -- the door: who may queue at all ----------------------------------------------------------

DOORS: dict[str, type[Door]] = {}
_door = registrar(DOORS, "admission rule")


@_door
class Door:
    """``admit="all"``: every request may queue (``max_queue`` aside, which the engine keeps)."""

    name: ClassVar[str] = "all"
    needs_timeout: ClassVar[bool] = False  # it keeps a deadline: Limits asks for timeout_ms

    def __init__(self, limits: Any) -> None:
        self.limits = limits

    def refuses(self, expected_ms: Any) -> float | None:
        """The wait it expects (``expected_ms()``, ms) when that refuses the request now (503), else None."""
        return None


@_door
class DeadlineDoor(Door):
    """``admit="deadline"``: refused at once when the work ahead would answer it past ``timeout_ms``."""

    name = "deadline"
    needs_timeout = True

    def refuses(self, expected_ms: Any) -> float | None:
        wait_ms = float(expected_ms())
        return wait_ms if wait_ms > self.limits.timeout_ms else None


def make_door(limits: Any) -> Door:
    return make(DOORS, "admission rule", limits.admit, limits)  # type: ignore[no-any-return]


class BatchCost:
    """Model time of a batch of n, ``a + b * n`` ms, fitted by least squares to the last batches.

    Until two sizes have been seen it assumes all of it scales with n (mean ms per item
    * n): that overestimates large batches, so a rule built on it waits less, never more.
    """

    def __init__(self, window: int = 128) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, n: int, ms: float) -> None:
        if n > 0 and math.isfinite(ms):
            self.points.append((n, ms))

    def __call__(self, n: int) -> float:
        if not self.points:
            return 0.0
        ns = [p[0] for p in self.points]
        ys = [p[1] for p in self.points]
        mean_n, mean_y = sum(ns) / len(ns), sum(ys) / len(ys)
        var = sum((x - mean_n) ** 2 for x in ns)
        if var == 0:
            return mean_y / mean_n * n
        b = max(0.0, sum((x - mean_n) * (y - mean_y) for x, y in zip(ns, ys, strict=True)) / var)
        a = max(0.0, mean_y - b * mean_n)
        return a + b * n
