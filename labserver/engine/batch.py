"""The batch engine: encoder requests become items, one model call answers a batch of them.

A request's texts become ``Item``s on the queue. The worker asks the strategy for the
next batch (``Strategy.collect``), drops items whose client left or whose deadline
passed (``EngineBase.live``), runs the model (inline on the event loop, or on the
model thread) and resolves each item's future with its output or its error. A batch
that raises is split and retried (``labserver.engine.modelthread``), so one bad input
fails alone. Every batch is recorded (``BatchRecord``).

The model is any callable from a list of texts to a list of outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..models import Model
from ..strategies import BatchCost, Strategy
from .base import Counters, EngineBase, ShuttingDown
from .counters import count, sizes, tally
from .ending import FinishReason
from .modelthread import WorkerDied, isolating_steps, let_loop_run, run_isolating, settle

__all__ = ["BatchCounters", "BatchEngine", "BatchRecord", "Item", "expected_wait_ms"]


def expected_wait_ms(cost: Any, ahead: int, cap: float, busy_ms: float) -> float:
    """Until the last of ``ahead`` waiting items is answered: what is left of the batch in the model,
    then the batches of up to ``cap`` that carry them, each costed as big as those waiting make it
    (those who come meanwhile fill the last one before it leaves); 0 while the cost is unknown.

    >>> cost = BatchCost(); cost.add(1, 10.0); cost.add(4, 16.0)   # 8 ms + 2 ms per item
    >>> expected_wait_ms(cost, 9, 4, busy_ms=5.0)  # 5 + three batches of 4 at 16 ms
    53.0
    """
    if not cost.points:
        return 0.0
    if not math.isfinite(cap):
        return busy_ms + cost(ahead)
    return busy_ms + math.ceil(ahead / cap) * cost(min(int(cap), ahead))


@dataclass
class BatchRecord:
    batch_id: int
    size: int
    reason: str  # why it left: full, deadline, idle, timeout, single, ...
    dispatched_s: float  # clock time the batch went to the model, s
    queue_wait_ms: float  # mean over its items of enqueue -> dispatch, ms
    compute_ms: float = math.nan  # model time, retries included, ms
    failed: int = 0  # items that got a model error
    calls: int = 0  # model calls it took (1 unless a failure made us split it)
    tokens: int = 0  # tokens its texts hold, as the model counts them (0: a model that cannot count)
    padded_tokens: int = 0  # tokens the model computes: the longest text's x the count (padding included)

    @property
    def padding(self) -> float:
        """The share of the computed tokens that were padding: (padded - real) / padded (0 when not counted)."""
        return (self.padded_tokens - self.tokens) / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(eq=False)
class Item:
    text: str
    future: asyncio.Future[Any]
    enqueued_s: float  # clock time it joined the queue, s
    deadline_s: float = math.inf  # clock time after which it must not be computed, s
    request_id: str = ""
    batch: BatchRecord | None = None  # set when dispatched
    priority: int = 0  # its class: a lower value is served first
    tenant: str = ""
    tokens: int = 0  # tokens the model computes for this text (special tokens included); 0: not counted

    @property
    def queue_ms(self) -> float:
        return math.nan if self.batch is None else (self.batch.dispatched_s - self.enqueued_s) * 1000


@dataclass
class BatchCounters(Counters):
    batches: int = count("Batches dispatched to the model")
    items_computed: int = count("Items run through the model")
    model_calls: int = count("Model calls (more than batches when a failed batch was split and retried)")
    batch_size_histogram: Counter[int] = sizes("Items per batch")
    dispatch_reasons: Counter[str] = tally("Batches by why they left (full, deadline, idle, ...)", "reason")
    tokens_computed: int = count("Tokens of the texts computed, as the model counts them (0: a model that cannot)")
    tokens_padded: int = count("Tokens computed with padding: per batch, its longest text's tokens x its size")


class BatchEngine(EngineBase):
    """An encoder strategy, a model callable, the queue and the batch worker."""

    def __init__(self, strategy: Strategy, model: Model, *, clock: Callable[[], float] = time.perf_counter,
                 queue: Any = None, history: int | None = 20_000) -> None:
        """``clock`` and ``queue`` are replaced on a virtual clock (``labserver.engine.virtual.simulate``), which
        keeps every batch (``history=None``)."""
        super().__init__(strategy, model, BatchCounters(), clock=clock, queue=queue)
        self.counters: BatchCounters
        self.batches: deque[BatchRecord] = deque(maxlen=history)  # the most recent batches
        self._ids = itertools.count(1)
        self.cost = BatchCost()  # model ms of a batch of n, fitted to the batches run: what admit="deadline" expects
        self.busy_until_s = 0.0  # when the batch in the model is expected to be done

    def submit(self, texts: list[str], request_id: str = "", *, priority: int = 0, tenant: str = "") -> list[Item]:
        """Queue one request's texts, all or nothing. Raises Overloaded/ShuttingDown/WorkerDied."""
        self.admit_or_refuse(len(texts))
        loop = asyncio.get_running_loop()
        now = self.clock()
        deadline = self.deadline_s(now)
        tokens = self.model.count_tokens(texts)  # the model's own count: token budgets and padding need it
        items = [Item(t, loop.create_future(), now, deadline, request_id, priority=priority, tenant=tenant,
                      tokens=n) for t, n in zip(texts, tokens, strict=True)]
        self.queue.put(items)
        return items

    async def _work(self) -> None:
        while True:
            batch, reason = await self.strategy.collect(self.queue, self.clock)
            batch, reason = self.strategy.fit(batch, reason, self.queue)  # over the token budget: the rest waits
            now = self.clock()  # one reading for the expiry check and the dispatch time
            live = self.live(batch, now, "deadline passed while queued")
            if live:
                await self._compute(live, reason, now)
                if self._thread is None:
                    await let_loop_run()

    async def _compute(self, items: list[Item], reason: str, now: float) -> None:
        record = BatchRecord(
            batch_id=next(self._ids),
            size=len(items),
            reason=reason,
            dispatched_s=now,
            queue_wait_ms=sum(now - i.enqueued_s for i in items) / len(items) * 1000,
            tokens=sum(i.tokens for i in items),
            padded_tokens=max(i.tokens for i in items) * len(items),
        )
        self.busy_until_s = now + self.cost(len(items)) / 1000
        for item in items:
            item.batch = record
            if item.deadline_s < now:  # live() (same clock reading) makes this impossible; count, don't assume
                self.counters.computed_after_deadline += 1
        self.in_flight = items
        texts = [i.text for i in items]
        try:
            if self._thread is not None:
                results, calls = await self._thread.submit(run_isolating, self.model, texts)
            else:  # blocks the event loop (the point), one model call at a time
                steps = isolating_steps(self.model, texts)
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        results, calls = done.value
                        break
                    await let_loop_run()
        except asyncio.CancelledError:
            self.end_all(items, FinishReason.ABORT, ShuttingDown("server stopped during compute"))
            raise
        except BaseException as e:  # not a model error (those come back as results): the worker dies
            self.end_all(items, FinishReason.ERROR, e if isinstance(e, WorkerDied) else
                         WorkerDied(f"{type(e).__name__}: {e}"))
            raise
        finally:
            self.in_flight = []
        record.compute_ms = (self.clock() - now) * 1000
        record.calls = calls
        self._account(record)
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Exception):
                record.failed += 1
                self.counters.items_failed += 1
                settle(item.future, None, result)
            else:
                settle(item.future, result, None)

    def _account(self, record: BatchRecord) -> None:
        c = self.counters
        c.batches += 1
        c.model_calls += record.calls
        c.items_computed += record.size
        c.batch_size_histogram[record.size] += 1
        c.dispatch_reasons[record.reason] += 1
        c.tokens_computed += record.tokens
        c.tokens_padded += record.padded_tokens
        self.batches.append(record)
        self.cost.add(record.size, record.compute_ms)
        self.strategy.observe(record.size, record.compute_ms)

    def expected_ms(self, n: int) -> float:
        """The batch in the model, then everyone waiting and these ``n`` in full batches (first come, first
        served), at the cost fitted so far: when ``n`` more texts would be answered, from now."""
        return expected_wait_ms(self.cost, len(self.queue) + n, self.strategy.batch_cap,
                                max(0.0, self.busy_until_s - self.clock()) * 1000 if self.in_flight else 0.0)

    def batch_log(self, last: int | None = None) -> list[dict[str, Any]]:
        batches = list(self.batches)[-last:] if last else list(self.batches)
        return [{**vars(b), "padding": b.padding} for b in batches]
