"""The queue, the worker and the records: everything a strategy needs except its rule.

A request's texts become ``Item``s on one ``ItemQueue``. One worker coroutine asks
the strategy for the next batch (``Strategy.collect``), drops items whose client
left or whose deadline passed, runs the model (inline on the event loop, or on a
dedicated thread), and resolves each item's future with its output or its error.

Nothing here knows HTTP, Starlette or torch: the model is any callable from a list
of texts to a list of outputs, and outcomes are plain results or exceptions that
the server maps to status codes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .runner import (ModelFn, ModelThread, WorkerDied, _let_loop_run, _settle, isolating_steps,
                     run_isolating)

if TYPE_CHECKING:
    from .strategies import Strategy

logger = logging.getLogger(__name__)

__all__ = ["BatchRecord", "Engine", "Expired", "Item", "ItemQueue", "Limits", "ModelFn", "Overloaded",
           "ShuttingDown", "WorkerDied", "run_isolating"]


class Overloaded(Exception):
    """The queue is at max_queue: reject now (503) rather than wait forever."""


class Expired(Exception):
    """The request's deadline passed before its batch was dispatched (504)."""


class ShuttingDown(Exception):
    """The server is stopping and this item was not computed (503)."""


@dataclass
class Limits:
    max_batch_size: int | None = 32  # items per model call; None = no cap (the guide's pseudo-code)
    max_wait_ms: float = 1.0  # how long a batch may wait for company, ms
    max_queue: int | None = None  # queued items before new requests get 503; None = unbounded
    timeout_ms: float | None = None  # per-request deadline from arrival, ms; None = none
    idle_dispatch: bool = True  # dispatch at once when nothing else is queued (deadline, thread)
    target_ms: float = 100.0  # slo: the latency target (an SLO), ms; a batch may spend part of it waiting
    # generation only (gen-* strategies): max_batch_size caps the sequences running together
    max_kv_tokens: int | None = None  # KV-cache tokens the running sequences may reserve (prompt + max_new_tokens each)
    prefill: str = "eager"  # gen-continuous: "eager" admits all that fit at every step; "budget" at most max_prefill_tokens
    max_prefill_tokens: int = 512  # prompt tokens prefilled between two decode steps under prefill="budget"

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {self.max_batch_size}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 or None, got {self.max_queue}")
        if self.timeout_ms is not None and self.timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0 or None, got {self.timeout_ms}")
        if self.target_ms <= 0:
            raise ValueError(f"target_ms must be > 0, got {self.target_ms}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1 or None, got {self.max_kv_tokens}")
        if self.prefill not in ("eager", "budget"):
            raise ValueError(f"prefill must be 'eager' or 'budget', got {self.prefill!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")

    @property
    def cap(self) -> float:
        return math.inf if self.max_batch_size is None else self.max_batch_size


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


@dataclass(eq=False)
class Item:
    text: str
    future: asyncio.Future[Any]
    enqueued_s: float  # clock time it joined the queue, s
    deadline_s: float = math.inf  # clock time after which it must not be computed, s
    request_id: str = ""
    batch: BatchRecord | None = None  # set when dispatched

    @property
    def queue_ms(self) -> float:
        return math.nan if self.batch is None else (self.batch.dispatched_s - self.enqueued_s) * 1000


class ItemQueue:
    """A FIFO of items with ``get(timeout_s)``: the one waiting primitive strategies use.

    Items whose future is already done (client gone, request timed out) are skipped
    and counted, never handed out.
    """

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[bool] | None = None
        self.skipped = 0  # dead items dropped before compute

    def __len__(self) -> int:
        return len(self._items)

    def put(self, items: list[Item]) -> None:
        self._items.extend(items)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def empty(self) -> bool:
        self._prune()
        return not self._items

    def _prune(self) -> None:
        while self._items and self._items[0].future.done():
            self._items.popleft()
            self.skipped += 1

    def drain(self) -> list[Item]:
        items, self._items = list(self._items), deque()
        return items

    def putback(self, item: Item) -> None:
        """Return an item just taken to the head of the queue (it did not fit; it goes first next time)."""
        self._items.appendleft(item)

    async def get(self, timeout_s: float | None = None) -> Item | None:
        """The next live item; None if none arrived within timeout_s (None = wait forever)."""
        loop = asyncio.get_running_loop()
        end_s = None if timeout_s is None else loop.time() + timeout_s
        while True:
            self._prune()
            if self._items:
                return self._items.popleft()
            remaining = None if end_s is None else end_s - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            self._waiter = loop.create_future()
            timer = None if remaining is None else loop.call_later(remaining, _wake, self._waiter)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()


def _wake(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


@dataclass
class Counters:
    batches: int = 0
    items_computed: int = 0
    items_failed: int = 0  # model errors, per item
    expired: int = 0  # deadline passed while queued: answered 504, never computed
    rejected_overload: int = 0  # 503 at submit
    skipped_dead: int = 0  # client gone / timed out while queued: never computed
    computed_after_deadline: int = 0  # must stay 0: counted, not assumed
    model_calls: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)


class Engine:
    """One strategy, one model, one queue and the worker that joins them."""

    def __init__(
        self,
        strategy: Strategy,
        model: ModelFn,
        *,
        clock: Callable[[], float] = time.perf_counter,
        history: int = 20_000,
    ) -> None:
        self.strategy = strategy
        self.limits = strategy.limits
        self.model = model
        self.clock = clock
        self.queue = ItemQueue()
        self.counters = Counters()
        self.batches: deque[BatchRecord] = deque(maxlen=history)  # the most recent batches
        self.computing: list[Item] = []  # the batch in the model right now
        self.dead: BaseException | None = None  # why the worker stopped, if it did
        self.accepting = False
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._thread: ModelThread | None = None

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.strategy.offload:
            self._thread = ModelThread(loop, self._died)
        self._task = loop.create_task(self._work(), name=f"labserver-{self.strategy.name}")
        self._task.add_done_callback(self._task_done)
        self.accepting = True

    @property
    def healthy(self) -> bool:
        return self.accepting and self.dead is None

    async def drain(self, grace_s: float = 10.0) -> None:
        """Stop taking requests; finish what is queued for up to grace_s, then answer the rest 503.

        The batch already in the model is never cut short: it finishes (see ``stop``).
        """
        self.accepting = False
        end_s = self.clock() + grace_s
        while (len(self.queue) or self.computing) and self.clock() < end_s and self.dead is None:
            await asyncio.sleep(0.005)
        self._fail(self.queue.drain(), ShuttingDown("server is shutting down; retry elsewhere"))

    async def stop(self, batch_timeout_s: float = 60.0) -> None:
        """Drain with no grace, let the batch in flight finish, then end the worker."""
        await self.drain(0)
        end_s = self.clock() + batch_timeout_s
        while self.computing and self.clock() < end_s and self.dead is None:
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # its end (cancelled, or the fault that killed it) is already handled
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self.dead is not None:
            return
        err = task.exception() or RuntimeError("worker returned")
        self._died(WorkerDied(f"worker stopped: {type(err).__name__}: {err}"))

    def _died(self, err: BaseException) -> None:
        if self.dead is None:
            logger.critical("labserver worker is gone; answering 503 from now on: %s", err)
        self.dead = err
        self._fail_all(WorkerDied(str(err)))

    def _fail_all(self, err: Exception) -> None:
        self._fail(self.queue.drain() + self.computing, err)

    @staticmethod
    def _fail(items: list[Item], err: BaseException) -> None:
        for item in items:
            _settle(item.future, None, err)

    # -- the request side --------------------------------------------------------------
    def submit(self, texts: list[str], request_id: str = "") -> list[Item]:
        """Queue one request's texts, all or nothing. Raises Overloaded/ShuttingDown/WorkerDied."""
        if self.dead is not None:
            raise WorkerDied("the model worker is gone")
        if not self.accepting:
            raise ShuttingDown("server is not accepting requests")
        limits = self.limits
        if limits.max_queue is not None and len(self.queue) + len(texts) > limits.max_queue:
            self.counters.rejected_overload += len(texts)
            raise Overloaded(f"queue is full ({len(self.queue)} of {limits.max_queue} waiting)")
        loop = asyncio.get_running_loop()
        now = self.clock()
        deadline = now + limits.timeout_ms / 1000 if limits.timeout_ms is not None else math.inf
        items = [Item(t, loop.create_future(), now, deadline, request_id) for t in texts]
        self.queue.put(items)
        return items

    # -- the worker --------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            batch, reason = await self.strategy.collect(self.queue, self.clock)
            now = self.clock()  # one reading for the expiry check and the dispatch time
            live = self._prune(batch, now)
            if live:
                await self._compute(live, reason, now)
                if self._thread is None:
                    await _let_loop_run()

    def _prune(self, batch: list[Item], now: float) -> list[Item]:
        live = []
        for item in batch:
            if item.future.done():
                self.counters.skipped_dead += 1
            elif item.deadline_s < now:
                self.counters.expired += 1
                item.future.set_exception(Expired("deadline passed while queued"))
            else:
                live.append(item)
        return live

    async def _compute(self, items: list[Item], reason: str, now: float) -> None:
        record = BatchRecord(
            batch_id=next(self._ids),
            size=len(items),
            reason=reason,
            dispatched_s=now,
            queue_wait_ms=sum(now - i.enqueued_s for i in items) / len(items) * 1000,
        )
        for item in items:
            item.batch = record
            if item.deadline_s < now:  # _prune (same clock reading) makes this impossible; count, don't assume
                self.counters.computed_after_deadline += 1
        self.computing = items
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
                    await _let_loop_run()
        except asyncio.CancelledError:
            self._fail(items, ShuttingDown("server stopped during compute"))
            raise
        except BaseException as e:  # not a model error (those come back as results): the worker dies
            self._fail(items, e if isinstance(e, WorkerDied) else WorkerDied(f"{type(e).__name__}: {e}"))
            raise
        finally:
            self.computing = []
        record.compute_ms = (self.clock() - now) * 1000
        record.calls = calls
        self._account(record)
        for item, result in zip(items, results, strict=True):
            if isinstance(result, Exception):
                record.failed += 1
                self.counters.items_failed += 1
                _settle(item.future, None, result)
            else:
                _settle(item.future, result, None)

    def _account(self, record: BatchRecord) -> None:
        c = self.counters
        c.batches += 1
        c.model_calls += record.calls
        c.items_computed += record.size
        c.batch_sizes[record.size] += 1
        c.reasons[record.reason] += 1
        self.batches.append(record)
        self.strategy.observe(record.size, record.compute_ms)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "strategy": self.strategy.name,
            "limits": vars(self.limits).copy(),
            "queue_depth": len(self.queue),
            "computing": len(self.computing),
            "healthy": self.healthy,
            "batches": c.batches,
            "model_calls": c.model_calls,
            "items_computed": c.items_computed,
            "items_failed": c.items_failed,
            "expired_in_queue": c.expired,
            "skipped_client_gone": c.skipped_dead + self.queue.skipped,
            "rejected_overload": c.rejected_overload,
            "computed_after_deadline": c.computed_after_deadline,
            "batch_size_histogram": {str(k): v for k, v in sorted(c.batch_sizes.items())},
            "dispatch_reasons": dict(c.reasons),
        }
