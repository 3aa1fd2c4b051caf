"""Run a strategy's batching rule on a virtual clock: deterministic, instant, no HTTP, no torch.

``simulate(strategy, arrivals_s, service_ms)`` feeds scripted arrival times to the
strategy's own ``collect`` and charges ``service_ms(batch_size)`` of virtual time
per batch, exactly as a single worker would. ``simulate_closed(strategy, users,
service_ms, reply_ms)`` is the closed loop instead: every answered client sends
again as soon as its reply arrives, and replies go out one after another. They are
what the strategy tests use, and a notebook can use them to show a rule's behaviour
before measuring it for real.

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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models.synthetic import SyntheticGen
from ..strategies import BatchCost, Limits, Strategy
from ..strategies.overload import Discipline, Door, make_door
from .batch import BatchRecord, Item, expected_wait_ms
from .line import Line
from .step import Seq, StepEngine


class EndOfArrivals(Exception):
    """The script ran out while the strategy waited for a first item: the run is over."""


class _NeverDone:
    """Stands in for an item's future: a virtual client never leaves."""

    def done(self) -> bool:
        return False


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


class VirtualQueue:
    """Scripted arrivals; ``get`` advances the virtual clock instead of sleeping.

    The waiting wait in the engine's own ``Line`` (priority classes, the strategy's discipline
    and its sheds); with ``limits``, the engine's door applies too: ``max_queue`` and
    its ``door`` (``admit="deadline"``) refuse at arrival (503), and a request whose ``timeout_ms`` passes
    while it waits leaves at that moment (504). Every arrival's fate is in ``outcomes``.
    """

    def __init__(self, arrivals_s: Iterable[float], *, classes: Sequence[int] | None = None,
                 tokens: Sequence[int] | None = None, limits: Limits | None = None,
                 discipline: Discipline | None = None, batch_cap: float = math.inf, door: Door | None = None) -> None:
        self.now_s = 0.0
        self._future: Any = _NeverDone()
        times = sorted(arrivals_s)
        self._pending = [(t, k) for k, t in enumerate(times)]  # a heap: closed loops add arrivals as they go
        self._classes = list(classes) if classes is not None else []
        self._tokens = list(tokens) if tokens is not None else []  # each arrival's tokens, in time order
        self.limits = limits
        self.door = door or (make_door(limits) if limits else Door(None))  # who may queue at all (admit=)
        self.line = Line(discipline, self._shed)
        self.outcomes: list[Outcome] = []
        self.cost = BatchCost()  # what admit="deadline" expects a batch to cost, fitted as the engine fits it
        self.busy_until_s = 0.0  # the batch in the model is expected to be done then
        self.batch_cap = batch_cap  # the most one batch carries (the strategy's)

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
        busy_ms = max(0.0, self.busy_until_s - t) * 1000
        expected = lambda: expected_wait_ms(self.cost, len(self.line) + 1, self.batch_cap, busy_ms)  # noqa: E731
        if self.door.refuses(expected) is not None:
            self._refuse(outcome, 503, "deadline", t)
            return False
        return True

    def _expire(self, until_s: float) -> None:
        """Requests whose deadline passed by ``until_s`` leave the line then: the client's 504."""
        expired: list[Item] = []
        self.line.remove_if(lambda item: item.deadline_s <= until_s and not expired.append(item))
        for item in expired:
            self._refuse(self.outcomes[int(item.request_id)], 504, "expired", item.deadline_s)

    def _admit(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            t, k = heapq.heappop(self._pending)
            self._expire(t)
            priority = self._classes[k] if k < len(self._classes) else 0
            timeout_ms = self.limits.timeout_ms if self.limits is not None else None
            item = Item(f"#{len(self.outcomes)}", self._future, enqueued_s=t, request_id=str(len(self.outcomes)),
                        deadline_s=t + timeout_ms / 1000 if timeout_ms is not None else math.inf, priority=priority,
                        tokens=self._tokens[k] if k < len(self._tokens) else 0)
            outcome = Outcome(t, priority)
            self.outcomes.append(outcome)
            if self._door(item, outcome):
                self.line.put(item)
        self._expire(self.now_s)

    def add(self, t_s: float) -> None:
        """One more arrival at virtual time t_s (a closed-loop client coming back)."""
        heapq.heappush(self._pending, (t_s, len(self.outcomes) + len(self._pending)))

    def empty(self) -> bool:
        self._admit()
        return not len(self.line)

    def waiting(self) -> list[Any]:
        self._admit()
        return list(self.line)

    def take(self, items: list[Any]) -> None:
        self.line.take(items)

    def putback(self, item: Any) -> None:
        self.line.putback(item)

    async def get(self, timeout_s: float | None = None) -> Item | None:
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
    q = VirtualQueue(arrivals_s, classes=classes, tokens=tokens, limits=strategy.limits, door=strategy.door,
                     discipline=strategy.discipline, batch_cap=strategy.batch_cap)
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

    q = VirtualQueue([0.0] * users, limits=strategy.limits, door=strategy.door, discipline=strategy.discipline,
                     batch_cap=strategy.batch_cap)
    return _run(strategy, q, service_ms, answered, duration_s)


def _run(strategy: Strategy, q: VirtualQueue, service_ms: Callable[..., float],
         answered: Callable[[VirtualQueue, float, int], None], duration_s: float, by_tokens: bool = False) -> SimRun:
    async def main() -> SimRun:
        run = SimRun(outcomes=q.outcomes)  # (the same list: filled as they go)
        while q.now_s < duration_s:
            try:
                items, reason = await strategy.collect(q, q.clock)
            except EndOfArrivals:
                return run
            items, reason = strategy.fit(items, reason, q)  # the engine's token budget
            start = q.now_s
            items = [i for i in items if i.deadline_s >= start]  # (the line lets none past its deadline through)
            if not items:
                continue
            longest = max(i.tokens for i in items)
            cost = service_ms(len(items), longest) if by_tokens else service_ms(len(items))
            q.busy_until_s = start + q.cost(len(items)) / 1000  # the engine's expectation, before it learns this one
            q.now_s += cost / 1000
            waits = [start - i.enqueued_s for i in items]
            run.batches.append(
                BatchRecord(len(run.batches) + 1, len(items), reason, start, sum(waits) / len(waits) * 1000, cost,
                            tokens=sum(i.tokens for i in items), padded_tokens=longest * len(items))
            )
            run.latencies_ms.extend((q.now_s - i.enqueued_s) * 1000 for i in items)
            for i in items:
                if i.request_id:  # answered past its deadline: its client had a 504 at the deadline
                    outcome = q.outcomes[int(i.request_id)]
                    outcome.done_s, outcome.left_s = q.now_s, start
                    if q.now_s > i.deadline_s:
                        q._refuse(outcome, 504, "expired", i.deadline_s)
            q.cost.add(len(items), cost)
            strategy.observe(len(items), cost)
            answered(q, q.now_s, len(items))
        return run

    # Nothing in the virtual queue ever suspends, so the coroutine runs to its end on the
    # first send: no event loop needed, which also makes this safe inside a Jupyter kernel.
    coro = main()
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError(f"strategy {strategy.name!r} awaited something other than the virtual queue")


# -- generation -------------------------------------------------------------------------


class _VirtualFuture:
    """Stands in for a sequence's future on the virtual clock: remembers when it was settled."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.settled_s = math.nan
        self.error: BaseException | None = None

    def done(self) -> bool:
        return not math.isnan(self.settled_s)

    def set_result(self, _: Any) -> None:
        self.settled_s = self._clock()

    def set_exception(self, error: BaseException) -> None:
        self.settled_s, self.error = self._clock(), error

    def cancel(self) -> bool:
        self.set_exception(RuntimeError("cancelled"))
        return True

    def add_done_callback(self, _: Any) -> None:
        pass


class GenVirtualQueue(VirtualQueue):
    """Scripted generation requests: (arrival_s, prompt_tokens, max_new_tokens[, shared_prefix_tokens
    [, priority[, tenant]]]) each.

    Every prompt has its own tokens, except that the first ``shared_prefix_tokens`` of those
    that give it are the same for all of them (what a prefix cache can share). ``priority``
    (lower first) and ``tenant`` are what the ``x-priority`` and ``x-tenant`` headers carry.
    """

    def __init__(self, requests: Iterable[tuple[Any, ...]], eos_prob: float = 0.0) -> None:
        requests = sorted(requests, key=lambda r: r[0])
        super().__init__([r[0] for r in requests])
        self._shapes = deque((int(r[1]), int(r[2]), int(r[3]) if len(r) > 3 else 0, int(r[4]) if len(r) > 4 else 0,
                              str(r[5]) if len(r) > 5 else "") for r in requests)
        self.eos_prob = eos_prob
        self.seqs: list[Any] = []  # every sequence created, in arrival order

    def advance(self, seconds: float) -> None:
        """The synthetic model's sleep: the clock moves by the cost of the call."""
        self.now_s += seconds

    def _admit(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            t, _ = heapq.heappop(self._pending)
            prompt, new, shared, priority, tenant = self._shapes.popleft()
            sid = len(self.seqs) + 1
            ids = [1 + i for i in range(min(shared, prompt))]
            ids += [1 + (sid * 100_003 + i) % 49_999 for i in range(prompt - len(ids))]  # its own words
            seq = Seq(sid, ids, new, _VirtualFuture(self.clock), enqueued_s=t, eos_prob=self.eos_prob, eos_seed=sid,
                      priority=priority, tenant=tenant)
            self.seqs.append(seq)
            self.line.put(seq)


@dataclass
class GenSimRun:
    steps: list[Any]  # StepRecord per model call
    seqs: list[Any]  # Seq per request: enqueued_s, admitted_s, first_token_s, finished_s, future.settled_s
    stats: dict[str, Any] = field(default_factory=dict)  # the engine's /stats at the end (preemptions, kv_blocks ...)

    def frames(self) -> tuple[Any, Any]:
        """(steps, requests) as DataFrames; requests have ttft_ms, queue_ms, answered_ms (arrival -> answer)."""
        import pandas as pd

        steps = pd.DataFrame([vars(s) for s in self.steps])
        rows = [{"sid": s.sid, "arrival_s": s.enqueued_s, "prompt_tokens": len(s.prompt_ids),
                 "max_new_tokens": s.max_new_tokens, "tokens": len(s.tokens), "cached_tokens": s.cached_tokens,
                 "preemptions": s.preemptions, "queue_ms": (s.admitted_s - s.enqueued_s) * 1000,
                 "ttft_ms": (s.first_token_s - s.enqueued_s) * 1000,
                 "finished_ms": (s.finished_s - s.enqueued_s) * 1000,
                 "answered_ms": (s.future.settled_s - s.enqueued_s) * 1000} for s in self.seqs]
        return steps, pd.DataFrame(rows)


def simulate_gen(strategy: Strategy, requests: Iterable[tuple[float, ...]], *, prefill_ms: float = 20.0,
                 step_ms: float = 10.0, per_token_ms: float = 0.0, per_seq_ms: float = 0.0,
                 kv_bytes_per_token: int = 0) -> GenSimRun:
    """Every step a generation strategy would run for these requests, on one worker.

    ``requests`` are (arrival_s, prompt_tokens, max_new_tokens), optionally with a fourth,
    shared_prefix_tokens; the model is ``synthetic-gen`` (a prefill call costs
    ``prefill_ms + per_token_ms * tokens``, a decode step ``step_ms + per_seq_ms * sequences``),
    charged to the virtual clock; ``kv_bytes_per_token`` (a real model's, from its config) lets
    ``Limits.kv_memory_mb`` size the pool. It is the engine's own step loop (``StepEngine.step_loop``)
    and scheduler with the strategy's own rules (admission, composition, preemption, who
    leaves), KV blocks and ``Limits`` (``eos_prob`` included), run until every request is answered.
    """
    q = GenVirtualQueue(requests, eos_prob=strategy.limits.eos_prob)
    model = SyntheticGen(prefill_ms, step_ms, per_token_ms=per_token_ms, per_seq_ms=per_seq_ms, sleep=q.advance,
                         kv_bytes_per_token=kv_bytes_per_token)
    engine = StepEngine(strategy, model, clock=q.clock, queue=q)  # type: ignore[arg-type]
    engine.accepting = True
    coro = engine.step_loop()
    try:
        while True:
            coro.send(None)  # only a bare yield can come back: the loop never awaits a real future
    except EndOfArrivals:
        pass
    finally:
        coro.close()
    return GenSimRun(list(engine.steps), q.seqs, engine.stats())
