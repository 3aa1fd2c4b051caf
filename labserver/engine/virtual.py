"""Run a strategy's batching rule on a virtual clock: deterministic, instant, no HTTP, no torch.

``simulate(strategy, arrivals_s, service_ms)`` feeds scripted arrival times to the
strategy's own ``collect`` and charges ``service_ms(batch_size)`` of virtual time
per batch, exactly as a single worker would. ``simulate_closed(strategy, users,
service_ms, reply_ms)`` is the closed loop instead: every answered client sends
again as soon as its reply arrives, and replies go out one after another. Both run the
engine's own worker (``BatchEngine``) over a virtual queue. They are what the strategy
tests use, and a notebook can use them to show a rule's behaviour before measuring it for
real. Generation: ``labserver.engine.gensim.simulate_gen``.

>>> from labserver.strategies import Limits, make_strategy
>>> s = make_strategy("per-fetch", Limits(max_batch_size=None, max_wait_ms=1.0))
>>> run = simulate(s, arrivals_s=[0.0, 0.0009, 0.0018, 0.0027], service_ms=lambda n: 5.0)
>>> [(b.size, b.reason) for b in run.batches]
[(4, 'timeout')]
>>> round(run.batches[0].dispatched_s * 1000, 1)  # the 1 ms timeout restarted 3 times
3.7
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..strategies import Strategy
from ..strategies.queueing import Door
from .batch import BatchEngine, BatchRecord, Item, expected_wait_ms
from .line import Line

__all__ = ["EndOfArrivals", "Outcome", "SimRun", "VirtualFuture", "VirtualQueue", "drive", "simulate", "simulate_closed"]


class EndOfArrivals(Exception):
    """The script ran out while the strategy waited for a first item: the run is over."""


@dataclass
class Outcome:
    """What became of one arrival on the virtual clock."""

    arrival_s: float
    priority: int = 0
    status: int = 200  # 200 answered, 503 refused at the door or shed, 504 deadline passed while queued
    reason: str = ""  # for 503/504: queue-full, deadline, codel, expired
    done_s: float = math.nan  # answered, refused or expired at this virtual time
    left_s: float = math.nan  # it left the queue: dispatched to the model, refused, shed or expired

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.arrival_s) * 1000


class VirtualFuture:
    """Stands in for a request's future on the virtual clock: remembers when it was settled (and tells ``then``)."""

    def __init__(self, clock: Callable[[], float], then: Callable[[BaseException | None], None] | None = None) -> None:
        self._clock, self._then = clock, then
        self.settled_s = math.nan
        self.error: BaseException | None = None

    def done(self) -> bool:
        return not math.isnan(self.settled_s)

    def set_result(self, _: Any) -> None:
        self.settled_s = self._clock()
        if self._then is not None:
            self._then(None)

    def set_exception(self, error: BaseException) -> None:
        self.settled_s, self.error = self._clock(), error
        if self._then is not None:
            self._then(error)

    def cancel(self) -> bool:
        self.set_exception(RuntimeError("cancelled"))
        return True

    def add_done_callback(self, _: Any) -> None:
        pass


class VirtualQueue:
    """Scripted arrivals; ``get`` advances the virtual clock instead of sleeping.

    The waiting wait in the engine's own ``Line`` (priority classes, the strategy's discipline
    and its sheds); with a ``strategy``, the engine's door applies too: ``max_queue`` and its
    ``door`` (``admit="deadline"``) refuse at arrival (503), and a request whose ``timeout_ms``
    passes while it waits leaves at that moment (504). Every arrival's fate is in ``outcomes``.
    """

    def __init__(self, arrivals_s: Iterable[float], strategy: Strategy | None = None, *,
                 classes: Sequence[int] | None = None, tokens: Sequence[int] | None = None) -> None:
        self.now_s = 0.0
        self.over = False  # the run's time is up: the next batch is not collected
        self.engine: Any = None  # the worker whose cost and busy time the door reads (BatchEngine)
        self.latencies_ms: list[float] = []  # arrival -> answer, per item answered
        self._pending = [(t, k) for k, t in enumerate(sorted(arrivals_s))]  # a heap: closed loops add as they go
        self._classes = list(classes) if classes is not None else []
        self._tokens = list(tokens) if tokens is not None else []  # each arrival's tokens, in time order
        self.limits = strategy.limits if strategy else None
        self.door = strategy.door if strategy else Door(None)  # who may queue at all (admit=)
        self.line = Line(strategy.discipline if strategy else None, self._shed)
        self.outcomes: list[Outcome] = []
        self.batch_cap = strategy.batch_cap if strategy else math.inf  # the most one batch carries
        self._soonest_s = math.inf  # no deadline in the line passes before this: _expire need not scan it

    def __len__(self) -> int:
        return len(self.line)

    def clock(self) -> float:
        return self.now_s

    def _shed(self, item: Item, why: str) -> None:
        self._refuse(self.outcomes[int(item.request_id)], 503, why, self.now_s)

    def _refuse(self, outcome: Outcome, status: int, reason: str, at_s: float) -> None:
        outcome.status, outcome.reason, outcome.done_s = status, reason, at_s
        if math.isnan(outcome.left_s):
            outcome.left_s = at_s

    def _door(self, item: Item, outcome: Outcome) -> bool:
        """The engine's ``admit_or_refuse`` at the item's arrival time."""
        lim = self.limits
        if lim is None:
            return True
        t = item.enqueued_s
        if lim.max_queue is not None and len(self.line) + 1 > lim.max_queue:
            self._refuse(outcome, 503, "queue-full", t)
            return False
        busy_ms = max(0.0, self.engine.busy_until_s - t) * 1000
        expected = lambda: expected_wait_ms(self.engine.cost, len(self.line) + 1, self.batch_cap, busy_ms)  # noqa: E731
        if self.door.refuses(expected) is not None:
            self._refuse(outcome, 503, "deadline", t)
            return False
        return True

    def _expire(self, until_s: float) -> None:
        """Requests whose deadline passed by ``until_s`` leave the line then: the client's 504."""
        if until_s < self._soonest_s:  # (without timeouts, always: a scan per arrival made a backlog quadratic)
            return
        for item in self.line.remove_if(lambda item: item.deadline_s <= until_s):
            self._refuse(self.outcomes[int(item.request_id)], 504, "expired", item.deadline_s)
        self._soonest_s = min((item.deadline_s for item in self.line), default=math.inf)

    def _admit(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            t, k = heapq.heappop(self._pending)
            self._expire(t)
            priority = self._classes[k] if k < len(self._classes) else 0
            timeout_ms = self.limits.timeout_ms if self.limits is not None else None
            n = len(self.outcomes)
            item = Item(f"#{n}", None, enqueued_s=t, request_id=str(n), priority=priority, tokens=self.tokens_of(k),
                        deadline_s=t + timeout_ms / 1000 if timeout_ms is not None else math.inf)
            item.future = VirtualFuture(self.clock, lambda error, i=item, n=n: self.settled(i, n, error))
            outcome = Outcome(t, priority)
            self.outcomes.append(outcome)
            if self._door(item, outcome):
                self.line.put(item)
                self._soonest_s = min(self._soonest_s, item.deadline_s)
        self._expire(self.now_s)

    def tokens_of(self, k: int | str) -> int:
        """Arrival ``k``'s tokens (or the item's whose text is ``"#k"``), 0 when none were given."""
        k = int(k[1:]) if isinstance(k, str) else k
        return self._tokens[k] if k < len(self._tokens) else 0

    def settled(self, item: Any, k: int, error: BaseException | None) -> None:
        """The worker answered it now (or found its deadline passed: error): a client whose deadline passed had a
        504 then."""
        outcome = self.outcomes[k]
        if error is not None:  # (the service never fails)
            self._refuse(outcome, 504, "expired", item.deadline_s)
            return
        outcome.done_s, outcome.left_s = self.now_s, item.batch.dispatched_s
        self.latencies_ms.append((self.now_s - item.enqueued_s) * 1000)
        if self.now_s > item.deadline_s:
            self._refuse(outcome, 504, "expired", item.deadline_s)

    def add(self, t_s: float) -> None:
        """One more arrival at virtual time t_s (a closed-loop client coming back)."""
        heapq.heappush(self._pending, (t_s, len(self.outcomes) + len(self._pending)))

    def empty(self) -> bool:
        if self.over:
            raise EndOfArrivals
        self._admit()
        return not len(self.line)

    def waiting(self) -> list[Any]:
        self._admit()
        return list(self.line)

    def take(self, items: list[Any]) -> None:
        self.line.take(items)

    def putback(self, item: Any) -> None:
        self.line.putback(item)
        self._soonest_s = min(self._soonest_s, getattr(item, "deadline_s", math.inf))

    async def get(self, timeout_s: float | None = None) -> Item | None:
        if self.over:
            raise EndOfArrivals
        end_s = math.inf if timeout_s is None else self.now_s + max(timeout_s, 0.0)
        while True:
            self._admit()
            item = self.line.pop(self.now_s)
            if item is not None:
                return item
            next_s = self._pending[0][0] if self._pending else math.inf
            if next_s == math.inf and end_s == math.inf:
                raise EndOfArrivals
            if next_s > end_s:
                self.now_s = end_s
                self._admit()
                return None
            self.now_s = next_s  # (an arrival refused at the door wakes nobody: wait on)


@dataclass
class SimRun:
    batches: list[BatchRecord] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # arrival -> batch done, per item answered
    outcomes: list[Outcome] = field(default_factory=list)  # every arrival: answered, refused, shed or expired

    @property
    def sizes(self) -> list[int]:
        return [b.size for b in self.batches]

    @property
    def end_s(self) -> float:
        """Virtual time the last batch finished (0 with none): a backlog's answers / end_s is the rule's capacity."""
        if not self.batches:
            return 0.0
        last = self.batches[-1]
        return last.dispatched_s + last.compute_ms / 1000

    def frame(self) -> Any:
        """Every arrival as a row: arrival_s, priority, status, reason, done_s, left_s, latency_ms."""
        import pandas as pd

        return pd.DataFrame([{**vars(o), "latency_ms": o.latency_ms} for o in self.outcomes])


def simulate(
    strategy: Strategy, arrivals_s: Iterable[float], service_ms: Callable[..., float], *,
    classes: Sequence[int] | None = None, tokens: Sequence[int] | None = None,
) -> SimRun:
    """Every batch the strategy would form for these arrivals, on one worker.

    The strategy's ``Limits`` apply as in the engine: its queue discipline and priority
    classes (``classes``: each arrival's priority, in time order), ``max_queue``,
    ``timeout_ms`` (504 once passed while waiting), ``admit="deadline"`` and the token
    budget. With ``tokens`` (each arrival's tokens, in time order) a batch costs
    ``service_ms(n, longest)``, padding included, and records its real and padded tokens;
    without, ``service_ms(n)``.
    """
    q = VirtualQueue(arrivals_s, strategy, classes=classes, tokens=tokens)
    return _run(strategy, q, service_ms, lambda q, end_s, n: None, math.inf, by_tokens=tokens is not None)


def simulate_closed(
    strategy: Strategy,
    users: int,
    service_ms: Callable[[int], float],
    reply_ms: float = 0.0,
    rtt_ms: float = 0.2,
    duration_s: float = 10.0,
) -> SimRun:
    """``users`` clients in a closed loop for ``duration_s`` of virtual time, all sending at 0.

    The k-th answer of a batch (k = 0, 1, ...) is back at the server as its client's next
    request ``rtt_ms + k * reply_ms`` after the batch ends: ``reply_ms=0.15`` is a server
    writing one reply every 0.15 ms, so a batch of 64 comes back over ~10 ms.
    """

    def answered(q: VirtualQueue, end_s: float, n: int) -> None:
        for k in range(n):
            q.add(end_s + (rtt_ms + k * reply_ms) / 1000)

    q = VirtualQueue([0.0] * users, strategy)
    return _run(strategy, q, service_ms, answered, duration_s)


@dataclass
class _Service:
    """The model on the virtual clock: a batch costs ``service_ms`` of it, then the closed loop's clients return."""

    q: VirtualQueue
    service_ms: Callable[..., float]
    by_tokens: bool
    answered: Callable[[VirtualQueue, float, int], None]
    duration_s: float
    name: str = "virtual"
    max_chars: int | None = None

    def check(self, text: str) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [self.q.tokens_of(t) for t in texts]

    def __call__(self, texts: list[str]) -> list[Any]:
        n = len(texts)
        cost = self.service_ms(n, max(self.count_tokens(texts))) if self.by_tokens else self.service_ms(n)
        self.q.now_s += cost / 1000
        self.answered(self.q, self.q.now_s, n)
        self.q.over = self.q.now_s >= self.duration_s  # (checked between batches, as a run's end)
        return [None] * n


def _run(strategy: Strategy, q: VirtualQueue, service_ms: Callable[..., float],
         answered: Callable[[VirtualQueue, float, int], None], duration_s: float, by_tokens: bool = False) -> SimRun:
    """The engine's own worker (``BatchEngine``) over the virtual queue, the model charged to the virtual clock."""
    run = SimRun(outcomes=q.outcomes)  # (the same list: filled as they go)
    engine = BatchEngine(strategy, _Service(q, service_ms, by_tokens, answered, duration_s), clock=q.clock, queue=q,
                         history=None)
    q.engine, q.latencies_ms = engine, run.latencies_ms
    drive(engine._work())
    run.batches = list(engine.batches)
    return run


def drive(worker: Any) -> None:
    """An engine's worker coroutine, run until the script's arrivals are all served. Nothing in a virtual
    queue suspends, so only bare yields come back and sends of None drive it: no event loop (which also
    makes this safe inside a Jupyter kernel)."""
    try:
        while True:
            worker.send(None)
    except EndOfArrivals:
        pass
    finally:
        worker.close()
