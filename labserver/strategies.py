"""Serving strategies: the rule that decides who is computed next, swappable by name, one registry.

- encoders (``kind = "encode"``): ``collect(queue, clock)`` takes items from a queue with
  one waiting primitive, ``await queue.get(timeout_s)`` (None on timeout), plus
  ``queue.empty()``, and returns the batch and why it left. One model call answers it.
- generation (``kind = "generate"``, ``gen-*``): ``admit(queue, running, clock)`` returns
  the sequences that join the running batch at this step boundary (one model call per token).

The rest (dropping the gone, running the model, answering) is the engine's, so a rule
is testable on a virtual clock without HTTP or torch (``labserver.engine.virtual``).
``offload = True`` runs the model on a dedicated thread instead of the event loop.
Adding a strategy: subclass ``Strategy`` (or ``GenStrategy``), set ``name``, write
``collect`` (or ``admit``), decorate it with ``@register``. Nothing else changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

# -- what a rule sees ----------------------------------------------------------------------


class Queue(Protocol):
    async def get(self, timeout_s: float | None = None) -> Any: ...

    def empty(self) -> bool: ...

    def putback(self, item: Any) -> None: ...


class Running(Protocol):
    """The sequences being decoded, as an admission rule sees them."""

    def __len__(self) -> int: ...

    @property
    def reserved(self) -> int: ...


Clock = Callable[[], float]
Batch = tuple[list[Any], str]  # (items, dispatch reason)
Admission = tuple[list[Any], str]  # (sequences to prefill now, why)


@dataclass
class Limits:
    max_batch_size: int | None = 32  # items per model call (gen-*: sequences running together); None = no cap
    max_wait_ms: float = 1.0  # how long a batch may wait for company, ms
    max_queue: int | None = None  # queued requests before new ones get 503; None = unbounded
    timeout_ms: float | None = None  # per-request deadline from arrival, ms; None = none
    idle_dispatch: bool = True  # dispatch at once when nothing else is queued (deadline, thread)
    target_ms: float = 100.0  # slo: the latency target (an SLO), ms; a batch may spend part of it waiting
    # generation only (gen-* strategies)
    max_kv_tokens: int | None = None  # KV-cache tokens the running sequences may reserve (prompt + max_new_tokens each)
    prefill: str = "eager"  # gen-continuous: "eager" admits all that fit at every step; "budget" at most max_prefill_tokens
    max_prefill_tokens: int = 512  # prompt tokens prefilled between two decode steps under prefill="budget"

    def __post_init__(self) -> None:
        for name, ok, rule in (
            ("max_batch_size", self.max_batch_size is None or self.max_batch_size >= 1, ">= 1 or None"),
            ("max_wait_ms", self.max_wait_ms >= 0, ">= 0"),
            ("max_queue", self.max_queue is None or self.max_queue >= 1, ">= 1 or None"),
            ("timeout_ms", self.timeout_ms is None or self.timeout_ms > 0, "> 0 or None"),
            ("target_ms", self.target_ms > 0, "> 0"),
            ("max_kv_tokens", self.max_kv_tokens is None or self.max_kv_tokens >= 1, ">= 1 or None"),
            ("prefill", self.prefill in ("eager", "budget"), "'eager' or 'budget'"),
            ("max_prefill_tokens", self.max_prefill_tokens >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def cap(self) -> float:
        return math.inf if self.max_batch_size is None else self.max_batch_size


# -- the registry ---------------------------------------------------------------------------

STRATEGIES: dict[str, type[Strategy]] = {}  # every rule by name, encoders and gen-*


def register(cls: type[Strategy]) -> type[Strategy]:
    taken = STRATEGIES.get(cls.name)
    if taken is not None:
        raise ValueError(f"strategy name {cls.name!r} is taken by {taken.__qualname__}")
    STRATEGIES[cls.name] = cls
    return cls


def strategy_names(kind: str | None = None) -> list[str]:
    """Registered names (of one kind, "encode" or "generate", or all): what the CLI offers."""
    return [name for name, cls in STRATEGIES.items() if kind is None or cls.kind == kind]


def describe(name: str) -> str:
    """A strategy's one-line description: the first line of its docstring."""
    doc = (STRATEGIES[name].__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def make_strategy(name: str | type[Strategy] | Strategy, limits: Limits | None = None) -> Strategy:
    """A strategy from its name (or class, or an instance, returned as is)."""
    if isinstance(name, Strategy):
        return name
    if isinstance(name, type):
        return name(limits)
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return cls(limits)


class Strategy:
    name: ClassVar[str] = ""
    offload: ClassVar[bool] = False  # True: the model runs on its own thread, the loop stays free
    kind: ClassVar[str] = "encode"  # "encode" | "generate": which engine and which endpoint serve it

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        raise NotImplementedError

    def observe(self, size: int, compute_ms: float) -> None:
        """Called after every batch with its size and model time; a rule that learns costs uses it."""


# -- encoders: when does a batch leave? -----------------------------------------------------


@register
class Naive(Strategy):
    """The guide's first server: one request at a time, model on the event loop."""

    name = "naive"

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        return [await queue.get()], "single"  # get() without a timeout only returns an item


@register
class PerFetch(Strategy):
    """The guide's dynamic-batching pseudo-code: a timeout that restarts on every fetch.

    A trickle of arrivals closer together than max_wait keeps the batch open far past
    max_wait (the flaw the guide points out), and an empty queue still costs max_wait.
    ``max_batch_size`` adds the cap the guide says is missing; None reproduces the guide.
    """

    name = "per-fetch"

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        batch = [await queue.get()]
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

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        batch = [await queue.get()]
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


async def _take_queued(queue: Queue, cap: float) -> list[Any]:
    """Everything already waiting, up to ``cap``, without waiting; else wait for one."""
    batch: list[Any] = []
    while len(batch) < cap and not queue.empty():
        item = await queue.get(0)
        if item is not None:
            batch.append(item)
    return batch


@register
class Adaptive(Thread):
    """The thread strategy, but "idle" waits for the clients it just answered to come back.

    Idle dispatch alone splits a closed loop badly: when a batch of 60 is answered, the
    first few clients back find the model idle and leave as a small batch, and the rest
    wait behind it (58, 6, 58, 6, ... with 64 clients on 2 cores). This rule expects back
    as many items as the last batch carried, plus those queued when the model became
    free, and keeps collecting while they arrive (no gap over ``max_wait_ms``), up to the
    cap and at most ``hold_ms`` after the batch could first have left. With one client
    nothing waits; open traffic pays at most a gap per batch when the company does not come.
    """

    name = "adaptive"
    hold_ms: ClassVar[float] = 50.0  # the one deadline: the longest a batch that could leave waits for company

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__(limits)
        self.last = 0  # the last batch's size: clients that may be on their way back

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        cap = self.limits.cap
        batch = await _take_queued(queue, cap)  # already waiting when the model became free
        expected = min(cap, self.last + len(batch))  # the last batch's clients are on their way back
        if not batch:
            batch.append(await queue.get())
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


@register
class SLO(Thread):
    """Spend the latency target's headroom on bigger batches (Clipper's and BentoML's idea).

    Hold a batch while its *oldest* item can still make ``headroom * target_ms`` if one
    more item joined; leave when

        oldest's age + expected wait for the next arrival + cost(n + 1) > headroom * target_ms

    with ``cost`` fitted to the batches this server ran (``BatchCost``) and the wait from
    the arrival gaps it has seen; also when full. A model already late gets everything
    queued at once (under overload this is the thread rule). The other half of the target
    is left for what no rule controls. The price: at light load a lone request waits
    until the next arrival is not expected in time.
    """

    name = "slo"
    headroom: ClassVar[float] = 0.5  # the share of target_ms a batch may spend (waiting + computing)
    gap_alpha: ClassVar[float] = 0.05  # weight of the newest arrival gap in the running mean

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__(limits)
        self.cost = BatchCost()
        self.gap_s = math.inf  # mean arrival gap, s: unknown until two items were seen
        self.last_arrival_s: float | None = None

    def observe(self, size: int, compute_ms: float) -> None:
        self.cost.add(size, compute_ms)

    def _arrived(self, item: Any) -> None:  # an item: .enqueued_s, the clock time it was queued
        if self.last_arrival_s is not None and item.enqueued_s >= self.last_arrival_s:
            gap = item.enqueued_s - self.last_arrival_s
            self.gap_s = gap if math.isinf(self.gap_s) else self.gap_s + self.gap_alpha * (gap - self.gap_s)
        self.last_arrival_s = item.enqueued_s

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        cap = self.limits.cap
        budget_s = self.headroom * self.limits.target_ms / 1000
        batch = await _take_queued(queue, cap) or [await queue.get()]
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


# -- generation: who joins the running batch at this step boundary? -------------------------


class GenStrategy(Strategy):
    """A generation rule; ``admit`` waits only when nothing is running.

    Caps: ``max_batch_size`` sequences running together, ``max_kv_tokens`` KV-cache tokens
    reserved by them (prompt + ``max_new_tokens`` each: admission never has to evict).
    First come, first served: a sequence that does not fit goes back to the head of the
    queue (``putback``) and nobody overtakes it, so none starves.
    """

    kind = "generate"
    offload = True  # every generation strategy keeps the model off the event loop
    holds_finished: ClassVar[bool] = False  # True: finished sequences wait for the whole batch
    scheduler: ClassVar[str] = "labserver"  # "transformers": the steps happen in transformers' own manager

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        raise NotImplementedError

    def fits(self, seq: Any, running: Running, joining: list[Any]) -> bool:
        if len(running) + len(joining) >= self.limits.cap:
            return False
        budget = self.limits.max_kv_tokens
        return budget is None or running.reserved + sum(s.reserve for s in joining) + seq.reserve <= budget


@register
class GenNaive(GenStrategy):
    """One request at a time, start to finish."""

    name = "gen-naive"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"
        return [await queue.get()], "single"


@register
class GenStatic(GenStrategy):
    """Request-level batching: the deadline rule forms a batch, which runs until its longest member ends.

    Nobody joins a batch in flight; a member that finished early keeps its slot, is
    computed as padding (as ``model.generate`` computes a batch's finished rows) and is
    answered with the batch. That idle tail is the waste.
    """

    name = "gen-static"
    holds_finished = True

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"  # nobody joins a batch in flight
        batch = [await queue.get()]
        due_s = clock() + self.limits.max_wait_ms / 1000
        while len(batch) < self.limits.cap:
            if self.limits.idle_dispatch and queue.empty():
                return batch, "idle"
            remaining_s = due_s - clock()
            seq = await queue.get(remaining_s) if remaining_s > 0 else None
            if seq is None:
                return batch, "deadline"
            if not self.fits(seq, running, batch):
                queue.putback(seq)
                return batch, "kv-full"
            batch.append(seq)
        return batch, "full"


@register
class GenContinuous(GenStrategy):
    """Iteration-level scheduling (Orca, OSDI '22): join at every step boundary, leave as soon as done.

    ``prefill="budget"`` caps the prompt tokens prefilled between two decode steps
    (``max_prefill_tokens``), so a burst of new prompts stalls the running streams for
    a bounded time instead of all at once.
    """

    name = "gen-continuous"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        joining = [] if len(running) else [await queue.get()]  # nothing to decode: wait for work
        budget = self.limits.max_prefill_tokens if self.limits.prefill == "budget" else math.inf
        prompt_tokens = sum(len(s.prompt_ids) for s in joining)
        while not queue.empty():
            seq = await queue.get(0)
            if seq is None:
                break
            over_budget = joining and prompt_tokens + len(seq.prompt_ids) > budget
            if over_budget or not self.fits(seq, running, joining):
                queue.putback(seq)  # first in line next time: nobody overtakes it
                break
            joining.append(seq)
            prompt_tokens += len(seq.prompt_ids)
        return joining, "join" if len(running) else "start"


@register
class GenHFContinuous(GenStrategy):
    """transformers' ContinuousBatchingManager (its own thread, scheduler and paged cache), fed from our queue.

    labserver keeps the queue, so 503, 504 and leaving clients work as for the others; at
    most ``max_batch_size`` requests are handed over at once, ``max_kv_tokens`` sizes its
    cache (``labserver.engine.hfcb``). There is no step log: the steps happen inside it.
    """

    name = "gen-hf-cb"
    scheduler = "transformers"
