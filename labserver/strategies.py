"""Serving strategies: the rule that decides when a batch leaves, swappable by name.

A strategy is one small class. ``collect`` takes items from a queue that offers a
single waiting primitive, ``await queue.get(timeout_s)`` (None on timeout), plus
``queue.empty()``, and a clock (seconds); it returns the batch and why it left.
Everything else (dropping dead items, running the model, answering) is the
engine's, so a strategy is testable on a virtual clock without HTTP or torch
(see ``labserver.virtual``).

``offload = True`` runs the model on a dedicated thread instead of the event loop.

Adding a strategy: subclass ``Strategy``, set ``name``, write ``collect``, and
decorate it with ``@register``. Nothing else changes: the server, the CLI and the
notebooks look strategies up in ``STRATEGIES``.

Generation strategies (``gen-*``, ``labserver.genstrategies``) register the same way
into ``GEN_STRATEGIES``; ``make_strategy`` finds a name in either.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

from .engine import Limits

if TYPE_CHECKING:
    from .engine import Item


class Queue(Protocol):
    async def get(self, timeout_s: float | None = None) -> Item | None: ...

    def empty(self) -> bool: ...

    def putback(self, item: Item) -> None: ...


Clock = Callable[[], float]
Batch = tuple[list["Item"], str]  # (items, dispatch reason)

STRATEGIES: dict[str, type[Strategy]] = {}  # encoders: one model call answers a batch of requests
GEN_STRATEGIES: dict[str, type[Strategy]] = {}  # generation: one model call per output token


def register(cls: type[Strategy]) -> type[Strategy]:
    registry = GEN_STRATEGIES if cls.kind == "generate" else STRATEGIES
    taken = STRATEGIES.get(cls.name) or GEN_STRATEGIES.get(cls.name)
    if taken is not None:
        raise ValueError(f"strategy name {cls.name!r} is taken by {taken.__qualname__}")
    registry[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    """Every registered name, encoders first: what the CLI offers."""
    return [*STRATEGIES, *GEN_STRATEGIES]


class Strategy:
    name: ClassVar[str] = ""
    offload: ClassVar[bool] = False  # True: the model runs on its own thread, the loop stays free
    kind: ClassVar[str] = "encode"  # "encode" | "generate": which engine and which endpoint serve it
    summary: ClassVar[str] = ""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        raise NotImplementedError

    def observe(self, size: int, compute_ms: float) -> None:
        """Called after every batch with its size and model time; a rule that learns costs uses it."""


def make_strategy(name: str | type[Strategy] | Strategy, limits: Limits | None = None) -> Strategy:
    """A strategy from its name (or class, or an instance, returned as is)."""
    if isinstance(name, Strategy):
        return name
    if isinstance(name, type):
        return name(limits)
    cls = STRATEGIES.get(name) or GEN_STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(strategy_names())}")
    return cls(limits)


@register
class Naive(Strategy):
    """The guide's first server: one request at a time, model on the event loop."""

    name = "naive"
    summary = "one item per model call, on the event loop"

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        item = await queue.get()
        assert item is not None  # get() without a timeout only returns an item
        return [item], "single"


@register
class PerFetch(Strategy):
    """The guide's dynamic-batching pseudo-code: a timeout that restarts on every fetch.

    A trickle of arrivals closer together than max_wait keeps the batch open far past
    max_wait (the flaw the guide points out), and an empty queue still costs max_wait.
    ``max_batch_size`` adds the cap the guide says is missing; None reproduces the guide.
    """

    name = "per-fetch"
    summary = "wait max_wait after each fetch (the guide's pseudo-code), on the event loop"

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        first = await queue.get()
        assert first is not None
        batch = [first]
        while len(batch) < self.limits.cap:
            item = await queue.get(self.limits.max_wait_ms / 1000)
            if item is None:
                return batch, "timeout"
            batch.append(item)
        return batch, "full"


@register
class Deadline(Strategy):
    """One deadline per batch, fixed when its first item is taken.

    Leaves when full, when the deadline passes, or, with ``idle_dispatch`` (the
    default), as soon as nothing else is queued: no waiting when nobody is coming.
    With idle dispatch the batch is simply "everything queued, up to the cap";
    the deadline then only matters with ``idle_dispatch=False``.
    """

    name = "deadline"
    summary = "one deadline from the first item; dispatch when full, due or idle; on the event loop"

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        first = await queue.get()
        assert first is not None
        batch = [first]
        due_s = clock() + self.limits.max_wait_ms / 1000
        while len(batch) < self.limits.cap:
            if self.limits.idle_dispatch and queue.empty():
                return batch, "idle"
            remaining_s = due_s - clock()
            item = await queue.get(remaining_s) if remaining_s > 0 else None
            if item is None:
                return batch, "deadline"
            batch.append(item)
        return batch, "full"


@register
class Thread(Deadline):
    """The deadline rule, with the model on a dedicated thread: the event loop never blocks.

    ``max_batch_size=1`` gives plain per-request offloading.
    """

    name = "thread"
    offload = True
    summary = "the deadline rule, model on a dedicated worker thread"


@register
class Adaptive(Thread):
    """The thread strategy, but "idle" waits for the clients it just answered to come back.

    Idle dispatch alone splits a closed loop badly: when a batch of 60 is answered, its
    clients send their next requests over the next ~10 ms, the first few find the model
    idle and leave at once as a small batch, and the rest wait a whole small batch
    behind them (58, 6, 58, 6, ... with 64 clients on 2 cores, and a batch of 6 costs a
    third of a batch of 58). This rule expects back as many items as the last batch
    carried, plus those already queued when the model became free: in a closed loop,
    every active client, however the last rounds were split. While fewer are queued and
    they keep arriving (no gap longer than ``max_wait_ms``, the guide's per-fetch
    timeout) it keeps collecting, up to the cap and at most ``hold_ms`` after the batch
    could first have left (a free model and a first item). With one client the last batch had one item and nothing was queued, so
    nothing waits. Open traffic (arrivals that do not wait for answers) pays at most a
    gap per batch when the expected company does not come. With ``idle_dispatch`` off
    it expects nobody: a batch leaves full, at a gap, or at ``hold_ms``.

    (Expecting the last batch's clients only when few queued while it ran looks like a
    way to spare open traffic that gap, but it keeps a split closed loop split: after
    the small batch, the big group is already queued, looks like open traffic, and
    leaves without the small group again. Measured, then removed.)
    """

    name = "adaptive"
    summary = "thread, but wait (gaps < max_wait_ms, at most hold_ms) for the clients just answered"
    hold_ms: ClassVar[float] = 50.0  # the one deadline: the longest a batch that could leave waits for company

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__(limits)
        self.last = 0  # the last batch's size: clients that may be on their way back

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        cap = self.limits.cap
        batch: list[Item] = []
        while len(batch) < cap and not queue.empty():  # already waiting when the model became free
            item = await queue.get(0)
            if item is not None:
                batch.append(item)
        expected = min(cap, self.last + len(batch))  # the last batch's clients are on their way back
        if not batch:
            first = await queue.get()
            assert first is not None
            batch.append(first)
        due_s = clock() + self.hold_ms / 1000
        reason = "full"
        while len(batch) < cap:
            if self.limits.idle_dispatch and queue.empty() and len(batch) >= expected:
                reason = "idle"
                break
            remaining_s = due_s - clock()
            item = await queue.get(min(remaining_s, self.limits.max_wait_ms / 1000)) if remaining_s > 0 else None
            if item is None:
                reason = "deadline" if clock() >= due_s else "gap"
                break
            batch.append(item)
        self.last = len(batch)
        return batch, reason


class BatchCost:
    """Model time of a batch of n, ``a + b * n`` ms, fitted by least squares to the last batches.

    Until two batch sizes have been seen it cannot tell the fixed part from the per-item
    part and assumes all of it scales with n (``cost(n) = mean ms per item * n``): that
    overestimates large batches, so a rule built on it waits less, never more.
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


@register
class SLO(Thread):
    """Spend the latency target's headroom on bigger batches (Clipper's and BentoML's idea).

    Every other rule dispatches as soon as it may (idle, a gap, a short deadline), which
    under steady traffic means many small batches, each paying the model's fixed cost
    (on 2 CPU cores a batch of 1 costs ~4 batch-of-16 items). This one holds a batch
    while its *oldest* item can still make ``headroom * target_ms`` if one more item joined:
    it leaves when

        oldest's age + expected wait for the next arrival + cost(n + 1) > headroom * target_ms

    with ``cost`` fitted to the batches this server ran (``BatchCost``) and the wait from
    the arrival gaps it has seen. Also full (the cap) as always. A model that is already
    late (its oldest item past the budget when the model frees up) gets everything
    queued at once: under overload this is the thread rule. With ``idle_dispatch`` off it
    always expects company: a batch leaves full or at the budget. The other half of the target
    is left for what no rule controls: the batch that is running when a request
    arrives, stalls, the HTTP round trip.

    The price is latency at light load: a lone request waits until the next arrival is
    not expected in time, so p50 sits near the budget when traffic is steady but slow.
    Use it when you have a target and want fewer, bigger batches under it, not the lowest
    idle latency.

    What it does not buy, measured: capacity. Under open traffic the other rules already
    take everything queued when the model frees up; holding for company pays the fixed
    cost less often but adds the wait it saves. On a virtual clock with this machine's
    MiniLM cost (17 + 3.9 n ms) it carries 1-2 % more than ``thread`` or the guide within a
    p99 target; live, within the noise (``benchmarks/perf.py --slo``, README Performance).
    """

    name = "slo"
    summary = "thread, but hold a batch while its oldest item can still make headroom x target_ms"
    headroom: ClassVar[float] = 0.5  # the share of target_ms a batch may spend (waiting + computing)
    gap_alpha: ClassVar[float] = 0.05  # weight of the newest arrival gap in the running mean

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__(limits)
        self.cost = BatchCost()
        self.gap_s = math.inf  # mean arrival gap, s: unknown until two items were seen
        self.last_arrival_s: float | None = None

    def observe(self, size: int, compute_ms: float) -> None:
        self.cost.add(size, compute_ms)

    def _arrived(self, item: Item) -> None:
        if self.last_arrival_s is not None and item.enqueued_s >= self.last_arrival_s:
            gap = item.enqueued_s - self.last_arrival_s
            self.gap_s = gap if math.isinf(self.gap_s) else self.gap_s + self.gap_alpha * (gap - self.gap_s)
        self.last_arrival_s = item.enqueued_s

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        cap = self.limits.cap
        budget_s = self.headroom * self.limits.target_ms / 1000
        batch: list[Item] = []
        while len(batch) < cap and not queue.empty():  # already waiting when the model became free
            item = await queue.get(0)
            if item is not None:
                batch.append(item)
        if not batch:
            first = await queue.get()
            assert first is not None
            batch.append(first)
        for item in batch:
            self._arrived(item)
        while len(batch) < cap:
            # the latest moment one more item can join and the oldest still make the budget
            leave_s = batch[0].enqueued_s + budget_s - self.cost(len(batch) + 1) / 1000
            now = clock()
            expected = not self.limits.idle_dispatch or now + self.gap_s <= leave_s  # (no gap seen yet: inf)
            if not expected:  # the next one is not expected in time: waiting only costs
                return batch, "slo"
            item = await queue.get(leave_s - now)
            if item is None:
                return batch, "slo"
            batch.append(item)
            self._arrived(item)
        return batch, "full"


from . import genstrategies as _genstrategies  # noqa: E402,F401  (registers the gen-* strategies)
