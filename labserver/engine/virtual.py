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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..models.synthetic import SyntheticGen
from ..strategies import Strategy
from .batch import BatchRecord, Item
from .step import Seq, StepEngine


class EndOfArrivals(Exception):
    """The script ran out while the strategy waited for a first item: the run is over."""


class _NeverDone:
    """Stands in for an item's future: a virtual client never leaves."""

    def done(self) -> bool:
        return False


class VirtualQueue:
    """Scripted arrivals; ``get`` advances the virtual clock instead of sleeping."""

    def __init__(self, arrivals_s: Iterable[float]) -> None:
        self.now_s = 0.0
        self._future: Any = _NeverDone()
        self._pending = sorted(arrivals_s)  # a heap: closed loops add arrivals as they go
        self._queued: deque[Item] = deque()
        self._n = 0

    def __len__(self) -> int:
        return len(self._queued)

    def clock(self) -> float:
        return self.now_s

    def _admit(self) -> None:
        while self._pending and self._pending[0] <= self.now_s:
            t = heapq.heappop(self._pending)
            self._queued.append(Item(f"#{self._n}", self._future, enqueued_s=t))
            self._n += 1

    def add(self, t_s: float) -> None:
        """One more arrival at virtual time t_s (a closed-loop client coming back)."""
        heapq.heappush(self._pending, t_s)

    def empty(self) -> bool:
        self._admit()
        return not self._queued

    def waiting(self) -> list[Any]:
        self._admit()
        return list(self._queued)

    def take(self, items: list[Any]) -> None:
        chosen = {id(item) for item in items}
        self._queued = deque(item for item in self._queued if id(item) not in chosen)

    async def get(self, timeout_s: float | None = None) -> Item | None:
        self._admit()
        if self._queued:
            return self._queued.popleft()
        next_s = self._pending[0] if self._pending else math.inf
        if timeout_s is None and next_s == math.inf:
            raise EndOfArrivals
        if timeout_s is None or next_s <= self.now_s + timeout_s:
            self.now_s = next_s
            self._admit()
            return self._queued.popleft()
        self.now_s += max(timeout_s, 0.0)
        return None


@dataclass
class SimRun:
    batches: list[BatchRecord] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # arrival -> batch done, per item

    @property
    def sizes(self) -> list[int]:
        return [b.size for b in self.batches]


def simulate(
    strategy: Strategy, arrivals_s: Iterable[float], service_ms: Callable[[int], float]
) -> SimRun:
    """Every batch the strategy would form for these arrivals, on one worker."""
    return _run(strategy, VirtualQueue(arrivals_s), service_ms, lambda q, end_s, n: None, math.inf)


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

    return _run(strategy, VirtualQueue([0.0] * users), service_ms, answered, duration_s)


def _run(strategy: Strategy, q: VirtualQueue, service_ms: Callable[[int], float],
         answered: Callable[[VirtualQueue, float, int], None], duration_s: float) -> SimRun:
    async def main() -> SimRun:
        run = SimRun()
        while q.now_s < duration_s:
            try:
                items, reason = await strategy.collect(q, q.clock)
            except EndOfArrivals:
                return run
            start = q.now_s
            cost = service_ms(len(items))
            q.now_s += cost / 1000
            waits = [start - i.enqueued_s for i in items]
            run.batches.append(
                BatchRecord(len(run.batches) + 1, len(items), reason, start, sum(waits) / len(waits) * 1000, cost)
            )
            run.latencies_ms.extend((q.now_s - i.enqueued_s) * 1000 for i in items)
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
    """Scripted generation requests: (arrival_s, prompt_tokens, max_new_tokens[, shared_prefix_tokens]) each.

    Every prompt has its own tokens, except that the first ``shared_prefix_tokens`` of those
    that give it are the same for all of them (what a prefix cache can share).
    """

    def __init__(self, requests: Iterable[tuple[float, ...]], eos_prob: float = 0.0) -> None:
        requests = sorted(requests)
        super().__init__([r[0] for r in requests])
        self._shapes = deque((int(r[1]), int(r[2]), int(r[3]) if len(r) > 3 else 0) for r in requests)
        self.eos_prob = eos_prob
        self.seqs: list[Any] = []  # every sequence created, in arrival order

    def advance(self, seconds: float) -> None:
        """The synthetic model's sleep: the clock moves by the cost of the call."""
        self.now_s += seconds

    def _admit(self) -> None:
        while self._pending and self._pending[0] <= self.now_s:
            t = heapq.heappop(self._pending)
            prompt, new, shared = self._shapes.popleft()
            sid = len(self.seqs) + 1
            ids = [1 + i for i in range(min(shared, prompt))]
            ids += [1 + (sid * 100_003 + i) % 49_999 for i in range(prompt - len(ids))]  # its own words
            seq = Seq(sid, ids, new, _VirtualFuture(self.clock), enqueued_s=t, eos_prob=self.eos_prob, eos_seed=sid)
            self.seqs.append(seq)
            self._queued.append(seq)

    def putback(self, item: Any) -> None:
        self._queued.appendleft(item)


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
                 step_ms: float = 10.0, per_token_ms: float = 0.0, per_seq_ms: float = 0.0) -> GenSimRun:
    """Every step a generation strategy would run for these requests, on one worker.

    ``requests`` are (arrival_s, prompt_tokens, max_new_tokens), optionally with a fourth,
    shared_prefix_tokens; the model is ``synthetic-gen`` (a prefill call costs
    ``prefill_ms + per_token_ms * tokens``, a decode step ``step_ms + per_seq_ms * sequences``),
    charged to the virtual clock. It is the engine's own step loop (``StepEngine.step_loop``)
    and scheduler with the strategy's own rules (admission, composition, preemption, who
    leaves), KV blocks and ``Limits`` (``eos_prob`` included), run until every request is answered.
    """
    q = GenVirtualQueue(requests, eos_prob=strategy.limits.eos_prob)
    model = SyntheticGen(prefill_ms, step_ms, per_token_ms=per_token_ms, per_seq_ms=per_seq_ms, sleep=q.advance)
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
