"""What every engine shares: the queue, the lifecycle, the door, the counters, dropping the gone.

An engine joins one strategy, one model and one queue with a worker coroutine. Two
kinds exist and neither inherits from the other: ``BatchEngine`` (encoders: one model
call answers a batch) and ``StepEngine`` (generation: one model call per token). Both
stand on ``EngineBase``, which holds what does not depend on the kind of work:

- the queue (``ItemQueue``): a FIFO with ``get(timeout_s)``, the one waiting primitive
  strategies use, which never hands out a request whose future is already done;
- the lifecycle: ``start`` (the worker, and the model thread for offloading strategies),
  ``drain`` (stop taking requests, finish what is queued for a grace period, answer
  the rest 503), ``stop``, and what happens when the worker dies (every waiter: 503);
- the door (``admit_or_refuse``): 503 when dead, stopping or full, counted;
- ``live``: at dispatch, a request whose client left is skipped and one whose deadline
  passed is answered 504, counted, never computed;
- ``Counters``: the outcomes every engine counts, each named once where it is counted
  (``labserver.engine.counters``); ``metrics()`` is everything an engine reports, which
  ``/stats`` and ``/metrics`` show under those names whatever the engine.

Nothing here knows HTTP, Starlette or torch; outcomes are plain results or exceptions
that the server maps to status codes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..strategies import Strategy
from .counters import Metric, count, gauge, metrics_of, tally
from .line import Line
from .modelthread import ModelThread, WorkerDied, settle
from .ending import FinishReason

logger = logging.getLogger(__name__)

__all__ = ["Counters", "EngineBase", "Expired", "ItemQueue", "Overloaded", "Refusal", "ReplicaLost", "ShuttingDown",
           "WorkerDied"]


class Refusal(Exception):
    """A request answered without being computed; ``reason`` travels in the ``x-reason`` header."""

    reason = "refused"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class Overloaded(Refusal):
    """Refused now (503) rather than answered late: the queue is full (``queue-full``), the discipline
    shed it (``codel``), or its deadline cannot be met (``deadline``)."""

    reason = "queue-full"


class Expired(Refusal):
    """The request's deadline passed before it was computed (504)."""

    reason = "expired"


class ShuttingDown(Refusal):
    """The server is stopping and this request was not (fully) computed (503)."""

    reason = "shutting-down"


class ReplicaLost(WorkerDied):
    """Behind a router: the replica generating this request is gone, the others are not (503, Retry-After: another
    replica, or Ray's replacement, takes the retry)."""


class Waiter(Protocol):
    """A queued request: an encoder item or a generation sequence."""

    future: Any  # done once answered, failed, or abandoned by its client
    deadline_s: float  # clock time after which it must not be computed, s


class ItemQueue:
    """The waiting line with ``get(timeout_s)``: the one waiting primitive strategies use.

    Requests wait in a ``Line`` (one FIFO per priority class, the strategy's discipline
    within it). Requests whose future is already done (client gone, timed out) are skipped
    and counted (``on_skip``), never handed out; those the discipline sheds are answered
    503 (``on_shed``). A rule that chooses among the waiting (shortest first, by tenant)
    reads ``waiting()`` and ``take``s the ones it picked.
    """

    def __init__(self, on_skip: Callable[[Any], None] = lambda item: None, discipline: Any = None,
                 on_shed: Callable[[Any, str], None] = lambda item, why: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.line = Line(discipline, on_shed, clock())
        self.clock = clock
        self._waiter: asyncio.Future[bool] | None = None
        self._on_skip = on_skip  # a dead request dropped from the queue, never computed

    def __len__(self) -> int:
        return len(self.line)

    def put(self, items: list[Any]) -> None:
        for item in items:
            self.line.put(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def empty(self) -> bool:
        self._prune()
        return not len(self.line)

    def _prune(self, everywhere: bool = False) -> None:
        """Drop the gone (counted): from the ends of each class, where the next pick comes from, or
        ``everywhere``; then let the discipline shed."""
        dead = lambda item: item.future.done()  # noqa: E731
        for item in self.line.remove_if(dead) if everywhere else self.line.prune_ends(dead):
            self._on_skip(item)
        self.line.shed(self.clock())

    def waiting(self) -> list[Any]:
        """The live requests, the best class first, arrival order within one (the dead dropped and counted)."""
        self._prune(everywhere=True)
        return list(self.line)

    def take(self, items: list[Any]) -> None:
        """Remove these (read from ``waiting()``) from the queue: they were admitted."""
        self.line.take(items)
        self.line.mark(self.clock())

    def drain(self) -> list[Any]:
        return self.line.drain()

    def putback(self, item: Any) -> None:
        """Return a request just taken to the head of its class (it did not fit; it goes first next time)."""
        self.line.putback(item)

    async def get(self, timeout_s: float | None = None) -> Any:
        """The next live request; None if none arrived within timeout_s (None = wait forever)."""
        loop = asyncio.get_running_loop()
        end_s = None if timeout_s is None else loop.time() + timeout_s
        while True:
            self._prune()
            item = self.line.pop(self.clock())
            if item is not None and item.future.done():  # gone from the middle of a class: skip it
                self._on_skip(item)
                continue
            if item is not None:
                return item
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
    """Outcomes every engine counts (per item for encoders, per sequence for generation)."""

    rejected_overload: int = count("Requests refused at the door (503)")
    expired_in_queue: int = count("Requests whose deadline passed while queued (504, never computed)")
    skipped_client_gone: int = count("Requests dropped unrun: their client left while they were queued")
    items_failed: int = count("Items (generation: sequences) the model failed on")
    computed_after_deadline: int = count("Requests computed after their deadline: must stay 0")
    shed: Counter[str] = tally("Requests shed from the queue by its discipline (503), by discipline", "reason")
    refused_deadline: int = count("Requests refused at the door: their deadline could not be met (503)")


class EngineBase:
    """One strategy, one model, one queue and the worker that joins them (see the module docstring)."""

    counters: Counters

    def __init__(self, strategy: Strategy, model: Any, counters: Counters, *,
                 clock: Callable[[], float] = time.perf_counter, queue: Any = None) -> None:
        """``clock`` and ``queue`` are replaced only on a virtual clock (``labserver.engine.virtual``)."""
        self.strategy = strategy
        self.limits = strategy.limits
        self.model = model
        self.clock = clock
        self.counters = counters
        self.queue = queue if queue is not None else ItemQueue(self._skipped, strategy.discipline, self._shed, clock)
        self.in_flight: list[Any] = []  # requests in the model now: what drain waits for and a dying worker fails
        self.dead: BaseException | None = None  # why the worker stopped, if it did
        self.accepting = False
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

    async def _work(self) -> None:
        raise NotImplementedError

    async def ready(self) -> None:
        """Return once the engine can serve, after ``start`` (here at once); raise ModelLoadError if it never will."""

    def _skipped(self, item: Any) -> None:
        """A queued request whose client left, dropped unrun."""
        self.counters.skipped_client_gone += 1
        self.end(item, FinishReason.ABORT)

    def _shed(self, item: Any, why: str) -> None:
        """The discipline refused a waiting request: 503 now, with its reason."""
        self.counters.shed[why] += 1
        self.end(item, FinishReason.SHED, Overloaded(f"shed by the {why} queue discipline: it waited too long "
                                                      "while a queue stood; retry later", why))

    @property
    def kind(self) -> str:
        """"encode" or "generate": which routes this engine answers (its strategy's kind)."""
        return self.strategy.kind

    @property
    def healthy(self) -> bool:
        return self.accepting and self.dead is None

    async def drain(self, grace_s: float = 10.0) -> None:
        """Stop taking requests; finish what is queued for up to grace_s, then answer the rest 503.

        Work in the model is not cut short here (``cut_short`` is each engine's call).
        """
        self.accepting = False
        end_s = self.clock() + grace_s
        while (len(self.queue) or self.in_flight) and self.clock() < end_s and self.dead is None:
            await asyncio.sleep(0.005)
        self.end_all(self.queue.drain(), FinishReason.ABORT, ShuttingDown("server is shutting down; retry elsewhere"))
        self.cut_short()

    def cut_short(self) -> None:
        """After a drain: what to do with work still in the model (a batch finishes; generation overrides)."""

    async def stop(self, in_flight_timeout_s: float = 60.0) -> None:
        """Drain with no grace, let the work in flight finish, then end the worker."""
        await self.drain(0)
        end_s = self.clock() + in_flight_timeout_s
        while self.in_flight and self.clock() < end_s and self.dead is None:
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
        self.end_all(self.queue.drain() + self.in_flight, FinishReason.ERROR, WorkerDied(str(err)))

    def end(self, item: Any, reason: FinishReason, error: BaseException | None = None) -> None:
        """A request ends unanswered (``reason``: why; ``error``: what its client gets). An encoder item's future is
        settled; a generation engine's ``end`` is where every sequence ends, answered or not (``GenEngine.end``)."""
        settle(item.future, None, error)

    def end_all(self, items: list[Any], reason: FinishReason, error: BaseException) -> None:
        for item in items:
            self.end(item, reason, error)

    async def call(self, fn: Callable[..., Any], *args: Any, taken_s: float = 0.0) -> Any:
        """Run fn on the model thread (inline when there is none: the model on the loop, or a virtual clock);
        ``taken_s``: wait at most that long for the thread to take it first (``ModelThread.submit``)."""
        if self._thread is not None:
            return await self._thread.submit(fn, *args, taken_s=taken_s)
        return fn(*args)

    # -- the door and the dispatch -------------------------------------------------------
    def admit_or_refuse(self, n: int) -> None:
        """Raise WorkerDied, ShuttingDown or Overloaded (counted) unless ``n`` more may queue."""
        if self.dead is not None:
            raise WorkerDied("the model worker is gone")
        if not self.accepting:
            raise ShuttingDown("server is not accepting requests")
        max_queue = self.limits.max_queue
        if max_queue is not None and len(self.queue) + n > max_queue:
            self.counters.rejected_overload += n
            raise Overloaded(f"queue is full ({len(self.queue)} of {max_queue} waiting); retry later")
        wait_ms = self.strategy.door.refuses(lambda: self.expected_ms(n))  # (admit=: the strategy's door)
        if wait_ms is not None:
            self.counters.refused_deadline += n
            raise Overloaded(f"expected to be answered in {wait_ms:.0f} ms, past timeout_ms="
                             f"{self.limits.timeout_ms:g}: refused now rather than answered late", "deadline")

    def expected_ms(self, n: int) -> float:
        """How long ``n`` more requests would take to be answered, from the work ahead of them (0: unknown)."""
        return 0.0

    def deadline_s(self, now: float) -> float:
        timeout_ms = self.limits.timeout_ms
        return now + timeout_ms / 1000 if timeout_ms is not None else math.inf

    def live(self, waiting: list[Waiter], now: float, why_expired: str) -> list[Any]:
        """The requests still wanted at dispatch: a client gone is skipped, a deadline passed answered 504."""
        keep = []
        for w in waiting:
            if w.future.done():
                self._skipped(w)
            elif w.deadline_s < now:
                self.counters.expired_in_queue += 1
                self.end(w, FinishReason.EXPIRED, Expired(why_expired))
            else:
                keep.append(w)
        return keep

    # -- what /stats and /metrics show --------------------------------------------------
    def metrics(self) -> list[Metric]:
        """Everything this engine reports: its state now, then its counters (each named once)."""
        return [gauge("queue_depth", "Requests waiting in the queue", len(self.queue), peer="vllm:num_requests_waiting"),
                gauge("computing", "Requests in the model now", len(self.in_flight)),
                *metrics_of(self.counters)]

    def stats(self) -> dict[str, Any]:
        """What ``GET /stats`` shows of the engine: who it is, then every metric by its name."""
        return {"strategy": self.strategy.name, "limits": vars(self.limits).copy(), "healthy": self.healthy,
                **{m.name: m.shown() for m in self.metrics()}}

    def by_replica(self) -> dict[str, list[Metric]]:
        """Behind a router: each replica's ``metrics()``, by replica id (``/metrics`` labels them)."""
        return {}

    def batch_log(self, last: int | None = None) -> list[dict[str, Any]]:
        """The most recent batches as dicts, oldest first (an engine that forms batches keeps them)."""
        return []

    def step_log(self, last: int | None = None) -> list[dict[str, Any]]:
        """The most recent generation steps as dicts, oldest first (an engine that runs steps keeps them)."""
        return []
