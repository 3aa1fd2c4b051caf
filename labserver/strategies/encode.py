"""Encoder rules: when does a batch leave? Each ``collect(queue, clock)`` takes items with one
waiting primitive, ``await queue.get(timeout_s)`` (None on timeout), plus ``queue.empty()``,
and returns the batch and why it left. One model call answers it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from .base import Batch, Clock, Limits, Queue, Strategy, register
from .queueing import BatchCost

__all__ = ["SLO", "Adaptive", "Deadline", "Naive", "PerFetch", "Thread", "Tokens"]



@register
class Naive(Strategy):
    """The guide's first server: one request at a time, model on the event loop."""

    name = "naive"
    batch_cap = 1  # one request at a time, whatever max_batch_size says

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


@register
class Tokens(Thread):
    """Batches by tokens, as text-embeddings-inference does, with texts of a length together.

    A batch costs its longest text's tokens x its size: one long text among short ones makes
    every short one pay for the long one's length in padding. This rule collects as the thread
    rule does (until nothing else is queued, the deadline, or enough waiting to fill a batch),
    then picks an *anchor*: the oldest waiting text once it has waited ``age_bound_ms``, else the
    shortest. Its companions are the waiting texts nearest its length, while the padded cost
    (longest x count) stays within ``max_batch_tokens``, the count within ``max_batch_size`` and the
    padding within ``max_padding`` of the batch (a text that would pad more waits for its own kind).
    Short texts go first and long ones gather until they go together; none starves, since a
    text past the bound anchors the next batch unless an older one does. A text over the budget
    goes alone.
    """

    name = "tokens"
    default_batch_tokens: ClassVar[int] = 2048  # without max_batch_tokens; TEI's GPU default is 16384
    age_bound_ms: ClassVar[float] = 100.0  # a text waiting this long anchors the next batch (oldest first)
    max_padding: ClassVar[float] = 0.1  # a companion joins only if the batch's padding stays within this share

    @property
    def batch_tokens(self) -> float:
        budget = self.limits.max_batch_tokens
        return self.default_batch_tokens if budget is None else budget

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        cap, budget = self.limits.cap, self.batch_tokens
        pool = [await queue.get()]  # taken while collecting; pool[0] is the queue's next: the oldest under fifo
        due_s = clock() + self.limits.max_wait_ms / 1000
        reason = "full"
        while True:
            waiting = queue.waiting()
            if self.limits.idle_dispatch and not waiting:
                reason = "idle"
                break
            if len(pool) + len(waiting) >= cap or sum(i.tokens for i in pool + waiting) >= budget:
                break
            remaining_s = due_s - clock()
            item = await queue.get(remaining_s) if remaining_s > 0 else None
            if item is None:
                reason = "deadline"
                break
            pool.append(item)
        waiting = queue.waiting()
        batch = self.group(pool + waiting, clock())
        chosen = {id(i) for i in batch}
        queue.take([i for i in waiting if id(i) in chosen])
        for item in reversed(pool):  # taken but not chosen: back to the head, the oldest first
            if id(item) not in chosen:
                queue.putback(item)
        return batch, reason

    def group(self, candidates: list[Any], now: float) -> list[Any]:
        """The anchor (the first candidate, the oldest, once it waited ``age_bound_ms``; else the shortest, the
        older on a tie), then the others nearest its length, the older first on a tie, while the batch keeps
        within both limits and its padding within ``max_padding`` of the tokens it computes."""
        oldest = candidates[0]
        overdue = (now - oldest.enqueued_s) * 1000 >= self.age_bound_ms
        anchor = oldest if overdue else min(candidates, key=lambda i: i.tokens)
        batch, longest, real = [anchor], anchor.tokens, anchor.tokens
        others = [i for i in candidates if i is not anchor]
        for item in sorted(others, key=lambda i: abs(i.tokens - anchor.tokens)):  # (a stable sort: age breaks ties)
            if len(batch) >= self.limits.cap:
                break
            padded = max(longest, item.tokens) * (len(batch) + 1)
            if padded <= self.batch_tokens and padded - real - item.tokens <= self.max_padding * padded:
                batch.append(item)
                longest, real = max(longest, item.tokens), real + item.tokens
        return batch
