"""Who goes first among waiting generation requests: the scheduling policies (``Limits.scheduling``).

At a step boundary, the order in which the waiting are considered, and whom a newcomer may
displace. ``fcfs`` (priority classes, then arrival), ``priority`` (the same, and a newcomer
that does not fit preempts a running sequence of a lower class: recomputed later, as memory
preemption does), ``fair`` (a virtual token counter per tenant, weighted prefill and decode
tokens served, the least served first: Sheng et al., OSDI 2024) and ``slo`` (earliest TTFT
deadline first among those that can still make theirs, and no admission that would push a
decode step past the tightest TPOT target running).

Nothing here knows the engine: a policy reads its knobs from the strategy's ``Limits`` and
sees the waiting (each with ``enqueued_s``, ``priority``, ``tenant``), the running, and the
clock. The encoders' queue disciplines are ``labserver.strategies.queueing``.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from .queueing import priority_of, tenant_of
from ..registry import make, registrar

__all__ = ["SCHEDULING", "FCFS", "Fair", "Priority", "SLOAware", "SchedulingPolicy", "make_scheduling"]


SCHEDULING: dict[str, type[SchedulingPolicy]] = {}


_scheduling = registrar(SCHEDULING, "scheduling policy")


class SchedulingPolicy:
    """The order the waiting are considered in (``arrange``), whom a newcomer displaces (``displace``),
    and what a sequence was served (``served``, for rules that keep accounts)."""

    name: ClassVar[str] = ""

    def __init__(self, limits: Any) -> None:
        self.limits = limits

    def arrange(self, waiting: list[Any], running: Iterable[Any], now: float) -> list[Any]:
        """Priority classes first (lower value first), arrival order within one (the line's own order)."""
        return sorted(waiting, key=priority_of)  # stable: arrival order within a class

    def displace(self, newcomer: Any, running: Sequence[Any]) -> Any | None:
        """A running sequence the newcomer may preempt when it does not fit; None: it waits."""
        return None

    def served(self, seq: Any, prompt_tokens: int, decode_tokens: int) -> None:
        """Tokens just computed for ``seq``."""

    def observe_step(self, batch: int, ms: float) -> None:
        """A decode step of ``batch`` sequences took ``ms``."""

    def fits(self, seq: Any, running: Sequence[Any], joining: Sequence[Any]) -> bool:
        """A policy's own condition for joining, beside the strategy's memory rule."""
        return True


@_scheduling
class FCFS(SchedulingPolicy):
    """First come, first served within a priority class; a lower class waits while a higher one does."""

    name = "fcfs"


@_scheduling
class Priority(SchedulingPolicy):
    """vLLM's priority scheduling: a newcomer that does not fit preempts the newest running sequence of
    a lower class (a higher value); it is recomputed later, losing and repeating no token."""

    name = "priority"

    def displace(self, newcomer: Any, running: Sequence[Any]) -> Any | None:
        lower = [s for s in running if priority_of(s) > priority_of(newcomer) and not s.finished]
        if not lower:
            return None
        worst = max(priority_of(s) for s in lower)
        return [s for s in lower if priority_of(s) == worst][-1]  # the lowest class's newest: least work lost


@_scheduling
class Fair(SchedulingPolicy):
    """Fair shares across tenants by a virtual token counter (Sheng et al., OSDI 2024).

    Each tenant's counter adds the tokens served to it, prompt tokens at ``prefill_weight``
    and generated ones at ``decode_weight``; the waiting are considered least-served tenant
    first (arrival order within a tenant). A tenant that comes back after having nothing
    waiting or running starts at the lowest counter among the active ones, so idleness
    banks no credit. Priority classes still come first.
    """

    name = "fair"
    prefill_weight: ClassVar[float] = 1.0
    decode_weight: ClassVar[float] = 2.0
    max_idle_tenants: ClassVar[int] = 10_000  # idle tenants' counters kept above the floor, at most

    def __init__(self, limits: Any) -> None:
        super().__init__(limits)
        self.counter: defaultdict[str, float] = defaultdict(float)
        self.active: set[str] = set()
        self._sweep_at = 64  # idle counters beyond which the next step boundary forgets what it can

    def arrange(self, waiting: list[Any], running: Iterable[Any], now: float) -> list[Any]:
        active = {tenant_of(s) for s in running} | {tenant_of(s) for s in waiting}
        floor = min((self.counter[t] for t in self.active & active), default=None)
        for tenant in active - self.active:  # back from idle: no credit for the time away
            if floor is not None:
                self.counter[tenant] = max(self.counter[tenant], floor)
        self.active = active
        if floor is not None and len(self.counter) > self._sweep_at + len(active):  # (amortized: a sweep reads all)
            self._forget(active, floor)
            self._sweep_at = 2 * (len(self.counter) - len(active)) + 64
        return sorted(waiting, key=lambda s: (priority_of(s), self.counter[tenant_of(s)]))

    def _forget(self, active: set[str], floor: float) -> None:
        """Drop the idle tenants whose counter is at or below the floor: back, each would start at the floor
        anyway, so forgetting them changes no order (every client-chosen ``x-tenant`` would otherwise be kept
        forever). Past ``max_idle_tenants`` idle ones above the floor, the longest known go too: one of those,
        back, starts at the floor, a bounded credit for a tenant nobody has heard from in that long. (After a
        step boundary where no tenant stayed active there is no floor: a forgotten tenant then starts at 0, as a
        new one does, where a remembered one would keep its counter.)"""
        for tenant in [t for t, c in self.counter.items() if c <= floor and t not in active]:
            del self.counter[tenant]
        excess = len(self.counter) - len(active) - self.max_idle_tenants
        if excess > 0:
            for tenant in [t for t in self.counter if t not in active][:excess]:
                del self.counter[tenant]

    def served(self, seq: Any, prompt_tokens: int, decode_tokens: int) -> None:
        self.counter[tenant_of(seq)] += self.prefill_weight * prompt_tokens + self.decode_weight * decode_tokens


@_scheduling
class SLOAware(SchedulingPolicy):
    """Earliest TTFT deadline first among those that can still make theirs; those that cannot go after.

    A request's deadline is its arrival plus its class's TTFT target (``ttft_targets_ms``;
    a class without one has none). One does not join when the decode step it would make
    is expected (from the steps measured so far, ``a + b * batch``) to take longer than the
    tightest TPOT target of the sequences then running (``tpot_targets_ms``).
    """

    name = "slo"

    def __init__(self, limits: Any) -> None:
        super().__init__(limits)
        self.steps: deque[tuple[int, float]] = deque(maxlen=256)  # (batch, ms) of recent decode steps

    def deadline(self, seq: Any) -> float:
        target = (self.limits.ttft_targets_ms or {}).get(priority_of(seq))
        return seq.enqueued_s + target / 1000 if target is not None else math.inf

    def arrange(self, waiting: list[Any], running: Iterable[Any], now: float) -> list[Any]:
        can = sorted((s for s in waiting if self.deadline(s) >= now), key=self.deadline)
        missed = [s for s in waiting if self.deadline(s) < now]
        return can + missed

    def observe_step(self, batch: int, ms: float) -> None:
        if batch > 0 and math.isfinite(ms):
            self.steps.append((batch, ms))

    def step_ms(self, batch: int) -> float:
        """Expected decode-step time for ``batch`` sequences, least squares over the recent steps."""
        if len(self.steps) < 2:
            return 0.0
        ns = [n for n, _ in self.steps]
        ys = [y for _, y in self.steps]
        mean_n, mean_y = sum(ns) / len(ns), sum(ys) / len(ys)
        var = sum((n - mean_n) ** 2 for n in ns)
        slope = max(0.0, sum((n - mean_n) * (y - mean_y) for n, y in zip(ns, ys, strict=True)) / var) if var else 0.0
        return mean_y + slope * (batch - mean_n)

    def fits(self, seq: Any, running: Sequence[Any], joining: Sequence[Any]) -> bool:
        targets = self.limits.tpot_targets_ms or {}
        tight = [targets[priority_of(s)] for s in (*running, *joining, seq) if priority_of(s) in targets]
        if not tight:
            return True
        return self.step_ms(len(running) + len(joining) + 1) <= min(tight)


def make_scheduling(limits: Any) -> SchedulingPolicy:
    return make(SCHEDULING, "scheduling policy", limits.scheduling, limits)  # type: ignore[no-any-return]
