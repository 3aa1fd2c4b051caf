"""How a load plan goes out: the sending loop of one generator, in this process or in
several spawned ones.

``labserver.loadgen`` decides what to send (a ``Plan`` per process: request numbers,
scheduled times, payloads, or closed-loop users) and turns the rows that come back
into records. This module only sends on time and writes down what happened, one
tuple per request (``ROW_FIELDS``), as cheaply as it can: at 1000 requests/s every
microsecond of bookkeeping is a tenth of a percent of a core. A generation request
(mode "generate", or an OpenAI completions/chat API) also carries its token arrival
times in the row, as a list.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import multiprocessing
import queue
import selectors
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import wire
from .apis import is_generative, openai_body
from .arrivals import iter_payloads
from .clients import CLIENTS, RequestFailed, StreamClient
from .lengths import iter_lengths
from .openai_sse import OpenAIAnswer
from .sse import Answer

logger = logging.getLogger(__name__)

# Event-loop timers on epoll are only ms-accurate: asyncio's wake late by up to 1 ms,
# uvloop's by up to 1 ms either side. On those loops the scheduler sleeps until this much
# before a send and yields (busy, but still serving responses) for the rest.
_SPIN_S = {"asyncio": 0.001, "uvloop": 0.002}
_SELECT_SPIN_S = 0.001  # select() wakes on time when the machine is idle; this covers a busy one
_SELECT_MAX_RATE = 1000.0  # requests/s per process; above it uvloop's faster I/O wins (measured)
_SELECT_FD_LIMIT = 1024  # select() cannot watch descriptors numbered past FD_SETSIZE
_PROBES_IN_FLIGHT = 64  # outstanding probes allowed; later ones are recorded as overflow
_RESERVED_FDS = 64  # a spawned worker's own descriptors (pipes, the loop's self-pipe, ...)
_START_MARGIN_S = 0.05  # between "all processes ready" and their common start

# server header -> record column (loadgen parses them; missing ones stay None here)
HEADER_COLUMNS = {
    "queue_ms": wire.HEADER_QUEUE_MS, "compute_ms": wire.HEADER_COMPUTE_MS,
    "batch_size": wire.HEADER_BATCH_SIZE, "batch_id": wire.HEADER_BATCH_ID,
    "dispatch": wire.HEADER_DISPATCH, "server_ms": wire.HEADER_SERVER_MS,
    "request_id": wire.HEADER_REQUEST_ID,
}
# what a generation answer adds (None/NaN for other modes); token_s is a list of client-clock
# times (s from the run's start), one per token event, that loadgen turns into its tokens frame
GEN_FIELDS = ("first_token_s", "n_tokens", "max_new_tokens", "finish_reason", "token_s")
ROW_FIELDS = ("i", "process", "scheduled_s", "sent_s", "done_s", "status", "error", "input_chars",
              *HEADER_COLUMNS, *GEN_FIELDS)
PROBE_FIELDS = ("t_s", "latency_ms", "status", "error")
_NO_HEADERS = (None,) * len(HEADER_COLUMNS)
_NO_GEN = (math.nan, None, None, "", None)
_TIMING_COLUMNS = ("queue_ms", "server_ms")  # taken from a generation answer's "timing" when there


def run_on_fresh_loop(make_coro, sockets: int | None = None, rate_per_s: float = 0.0):
    """Run ``make_coro()`` on a new event loop chosen for sending on time (``loop_factory``)."""
    with asyncio.Runner(loop_factory=loop_factory(sockets, rate_per_s)) as runner:
        return runner.run(make_coro())


def timer_late_fraction(rate_per_s: float = 100.0, duration_s: float = 1.5) -> float:
    """How often a bare timer loop (no HTTP; select() and a 1 ms spin, as a generator process
    waits) wakes more than 1 ms late on this machine right now: the noise no generator beats."""

    async def ticks() -> float:
        t0, late = time.perf_counter(), 0
        n = int(rate_per_s * duration_s)
        for k in range(n):
            target = t0 + k / rate_per_s
            if (delay := target - time.perf_counter() - _SELECT_SPIN_S) > 0:
                await asyncio.sleep(delay)
            while time.perf_counter() < target:
                await asyncio.sleep(0)
            late += time.perf_counter() - target > 1e-3
        return late / n

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())) as runner:
        return runner.run(ticks())


def loop_factory(sockets: int | None = None, rate_per_s: float = 0.0):
    """The event loop for a generator.

    select() when at most ``sockets`` sockets will be open in a process whose file
    descriptors we know are few (a spawned worker) and the rate is moderate: its timeout
    has µs resolution, so the busy-wait before each send can be short (``_spin_s``) and
    the cores stay with the server (a CPU model wants them all). Otherwise uvloop: faster
    at I/O, but its timers are ms-coarse, so ``Worker`` busy-waits the last 2 ms before
    each send, which above ~1000 requests/s is a core's worth of spinning either way.
    """
    few_fds = sockets is not None and sockets + _RESERVED_FDS < _SELECT_FD_LIMIT
    if few_fds and rate_per_s <= _SELECT_MAX_RATE:
        return lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        import uvloop  # absent on Windows
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def _spin_s(loop: asyncio.AbstractEventLoop, mean_gap_s: float) -> float:
    if isinstance(getattr(loop, "_selector", None), selectors.SelectSelector):
        # µs timers: spin only to ride out a late wake-up, for at most a quarter of the time
        return min(_SELECT_SPIN_S, mean_gap_s / 4)
    return _SPIN_S.get(type(loop).__module__.split(".")[0], max(_SPIN_S.values()))


@dataclass
class Plan:
    """What one generator process sends; picklable, so it can travel to a spawned process."""

    worker: int
    url: str
    mode: str
    client: str
    timeout_s: float
    max_in_flight: int
    overflow: str
    drain_s: float | None
    index: np.ndarray  # open loop: global request numbers, and their
    scheduled_s: np.ndarray  # send times, and
    texts: list[str]  # payloads (closed loop: a pool to cycle, or empty to use payload)
    users: int = 0  # closed loop from here on
    think_s: float = 0.0
    duration_s: float = math.inf
    max_requests: int | None = None
    payload: Any = None
    seed: int = 0
    probe_url: str | None = None
    probe_interval_s: float | None = None
    new_tokens: np.ndarray | None = None  # mode "generate", open loop: max_new_tokens per request
    lengths: Any = None  # mode "generate", closed loop: a Lengths to draw from as it goes
    stream: bool = True  # generation: ask for server-sent events
    ignore_eos: bool = True  # generation: ask for exactly max_new_tokens
    api: str = "labserver"  # or "openai-completions", "openai-chat", "openai-embeddings" (labserver.load.apis)
    model: str = ""  # OpenAI APIs: the model name every request names

    def mean_gap_s(self) -> float:
        s = self.scheduled_s
        return float(s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else math.inf

    def rate_per_s(self) -> float:
        return 1.0 / self.mean_gap_s() if self.mean_gap_s() > 0 else math.inf


class _Counter:
    value = 0  # same face as multiprocessing's RawValue, for the in-process case


class Worker:
    """Sends one ``Plan`` on the running loop and keeps a row per request."""

    def __init__(self, plan: Plan, counter) -> None:
        self.plan, self.counter = plan, counter
        self.rows: list[tuple] = []
        self.probes: list[tuple] = []
        self.gen = is_generative(plan.api, plan.mode)
        if plan.users:
            self.bodies = []
        else:  # built before the run: json.dumps is not free at 1000 requests/s
            sizes = plan.new_tokens if self.gen else [None] * len(plan.texts)
            self.bodies = [self._body(t, n) for t, n in zip(plan.texts, sizes)]
        self.t0 = 0.0
        self.spin_s = 0.0

    def _body(self, text: str, new_tokens: int | None = None) -> bytes:
        if self.plan.api != "labserver":
            return openai_body(self.plan.api, self.plan.model, text, new_tokens, stream=self.plan.stream,
                               ignore_eos=self.plan.ignore_eos)
        if self.gen:
            return json.dumps({"prompt": text, "max_new_tokens": int(new_tokens), "stream": self.plan.stream,
                               "ignore_eos": self.plan.ignore_eos}).encode()
        if self.plan.mode == "json":
            return json.dumps({"inputs": text}).encode()
        return text.encode()

    def _client(self, url: str, method: str):
        kind = StreamClient if self.gen and method == "POST" else CLIENTS[self.plan.client]
        content_type = None if method == "GET" else (
            "text/plain; charset=utf-8" if self.plan.mode == "text" and self.plan.api == "labserver"
            else "application/json")
        extra: dict[str, Any] = {"max_connections": self.plan.max_in_flight} if self.plan.client == "httpx" else {}
        if kind is StreamClient and self.plan.api != "labserver":
            extra["answer"] = OpenAIAnswer
        return kind(url, method=method, content_type=content_type, timeout_s=self.plan.timeout_s, **extra)

    async def run(self, t0: float) -> dict[str, Any]:
        self.t0 = t0
        self.spin_s = _spin_s(asyncio.get_running_loop(), self.plan.mean_gap_s())
        client = self._client(self.plan.url, "POST")
        probing = None
        if self.plan.probe_url:
            probing = asyncio.create_task(self._probe(self._client(self.plan.probe_url, "GET")))
        try:
            await (self._closed(client) if self.plan.users else self._open(client))
        finally:
            if probing:
                probing.cancel()
                await asyncio.gather(probing, return_exceptions=True)
            await client.aclose()
        t0_unix_s = time.time() - (time.perf_counter() - t0)  # time zero of the records, for joining logs
        return {"worker": self.plan.worker, "rows": self.rows, "probes": self.probes, "t0_unix_s": t0_unix_s}

    async def _until(self, t_s: float, spin: bool = True) -> None:
        target = self.t0 + t_s
        delay = target - time.perf_counter() - (self.spin_s if spin else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        while (left := target - time.perf_counter()) > 0:
            # the last stretch: yield to let responses in meanwhile (unlike a blocking sleep)
            await asyncio.sleep(0 if spin else left)

    async def _send(self, client, i: int, scheduled_s: float, body: bytes, chars: int,
                    new_tokens: int | None = None) -> float:
        sent = time.perf_counter() - self.t0
        status, headers, error, answer = 0, None, "", None
        try:
            if new_tokens is None:
                status, headers = await client.request(body)
            else:
                answer = await client.request(body)
        except RequestFailed as exc:
            error = exc.kind
            answer = exc.partial
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        except Exception as exc:  # one odd request fails alone, loudly
            logger.exception("request %d failed unexpectedly", i)
            error = type(exc).__name__.lower()
        finally:
            done = time.perf_counter() - self.t0
            if new_tokens is None:
                hdr = [headers.get(h) for h in HEADER_COLUMNS.values()] if headers else _NO_HEADERS
                self.rows.append((i, self.plan.worker, scheduled_s, sent, done, status, error, chars, *hdr,
                                  *_NO_GEN))
            else:
                self.rows.append(self._gen_row(i, scheduled_s, sent, done, error, chars, new_tokens, answer))
            self.counter.value += 1
        return done

    def _gen_row(self, i: int, scheduled_s: float, sent: float, done: float, error: str, chars: int,
                 new_tokens: int, answer: Answer | OpenAIAnswer | None) -> tuple:
        if answer is None:  # no response at all
            return (i, self.plan.worker, scheduled_s, sent, done, 0, error, chars, *_NO_HEADERS,
                    math.nan, 0, new_tokens, "", None)
        kind, first_s, n_tokens, finish = answer.outcome(done, self.t0)
        if error == "disconnect" and answer.event_stream:  # dropped after the headers: the stream broke off
            error = "stream_incomplete"
        error = error or kind  # a transport failure (timeout, ...) names the row before the stream's state
        fields = {col: answer.headers.get(h) for col, h in HEADER_COLUMNS.items()}
        timing = answer.timing()
        fields.update({col: timing[col] for col in _TIMING_COLUMNS if timing.get(col) is not None})
        token_s = [t - self.t0 for t in answer.token_s]
        return (i, self.plan.worker, scheduled_s, sent, done, answer.status, error, chars, *fields.values(),
                first_s, n_tokens, new_tokens, finish, token_s)

    async def _open(self, client) -> None:
        p = self.plan
        limit = asyncio.Semaphore(p.max_in_flight)
        tasks: set[asyncio.Task] = set()
        asked = p.new_tokens.tolist() if self.gen else [None] * len(p.texts)

        async def one(k: int) -> None:
            try:
                await self._send(client, int(p.index[k]), float(p.scheduled_s[k]), self.bodies[k],
                                 len(p.texts[k]), asked[k])
            finally:
                limit.release()

        for k, s in enumerate(p.scheduled_s.tolist()):
            await self._until(s)
            if limit.locked() and p.overflow == "error":
                gen = (math.nan, 0, asked[k], "", None) if self.gen else _NO_GEN
                self.rows.append((int(p.index[k]), p.worker, s, math.nan, math.nan, 0, "client_overflow",
                                  len(p.texts[k]), *_NO_HEADERS, *gen))
                self.counter.value += 1
                continue
            await limit.acquire()  # returns at once unless overflow == "wait" and we are full
            task = asyncio.create_task(one(k))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=p.drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _closed(self, client) -> None:
        p = self.plan
        texts = iter_payloads(p.texts or p.payload, seed=[p.seed, 1, p.worker])
        sizes = iter_lengths(p.lengths, seed=[p.seed, 2, p.worker]) if self.gen else None
        left = [math.inf if p.max_requests is None else p.max_requests]

        async def user() -> None:
            next_s = 0.0
            while next_s < p.duration_s and left[0] > 0:
                left[0] -= 1
                await self._until(next_s)
                text, n = next(texts), next(sizes) if sizes else None
                done = await self._send(client, -1, next_s, self._body(text, n), len(text), n)
                next_s = done + p.think_s

        await asyncio.gather(*(user() for _ in range(p.users)))

    async def _probe(self, client) -> None:
        tasks: set[asyncio.Task] = set()

        async def one(t_s: float) -> None:
            status, error = 0, ""
            try:
                status, _ = await client.request()
            except RequestFailed as exc:
                error = exc.kind
            except Exception as exc:  # a probe must never take the run down
                error = type(exc).__name__.lower()
            self.probes.append((t_s, (time.perf_counter() - self.t0 - t_s) * 1e3, status, error))

        try:
            for k in range(2**62):  # fired on time whatever the answers do, like the load itself
                t_s = k * self.plan.probe_interval_s
                await self._until(t_s, spin=False)
                if len(tasks) >= _PROBES_IN_FLIGHT:
                    self.probes.append((t_s, math.nan, 0, "client_overflow"))
                    continue
                task = asyncio.create_task(one(t_s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in list(tasks):
                task.cancel()  # probes still out when the load ends are dropped
            await client.aclose()


async def run_here(plan: Plan, on_count: Callable[[int], None]) -> dict[str, Any]:
    counter = _Counter()
    worker = Worker(plan, counter)
    job = asyncio.ensure_future(worker.run(time.perf_counter()))
    try:
        while not job.done():
            await asyncio.wait([job], timeout=0.5)
            on_count(counter.value)
    finally:
        job.cancel()  # a no-op once done; stops the run if our caller was cancelled
    return job.result()


# --- process mode ---------------------------------------------------------------------

def _child_main(plan: Plan, counter, inbox, start_at, barrier) -> None:
    """Entry point of a spawned generator process."""
    try:
        worker = Worker(plan, counter)
        gc.freeze()  # the imports (pandas, numpy) out of full collections: no pauses of tens of ms mid-run
        # All processes meet here once set up (the spawn and imports take a while); one of
        # them picks a common start just ahead, in wall-clock time, which all processes share.
        if barrier.wait(timeout=120) == 0:
            start_at.value = time.time() + _START_MARGIN_S
        barrier.wait(timeout=10)
        t0 = time.perf_counter() + (start_at.value - time.time())
        sockets = plan.max_in_flight + (_PROBES_IN_FLIGHT if plan.probe_url else 0)
        out = run_on_fresh_loop(lambda: worker.run(t0), sockets=sockets, rate_per_s=plan.rate_per_s())
        inbox.put(("done", plan.worker, out))
    except BaseException:
        inbox.put(("error", plan.worker, traceback.format_exc()))


async def run_in_processes(plans: list[Plan], on_count: Callable[[int], None]) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads or CUDA
    inbox, barrier, start_at = ctx.Queue(), ctx.Barrier(len(plans)), ctx.RawValue("d", 0.0)
    counters = [ctx.RawValue("q", 0) for _ in plans]
    procs = [ctx.Process(target=_child_main, args=(plan, c, inbox, start_at, barrier), daemon=True,
                         name=f"labserver-loadgen-{plan.worker}") for plan, c in zip(plans, counters)]
    for proc in procs:
        proc.start()
    outs: dict[int, Any] = {}
    try:
        while len(outs) < len(procs):
            try:
                kind, w, payload = await asyncio.to_thread(inbox.get, True, 0.25)
            except queue.Empty:
                on_count(sum(c.value for c in counters))
                gone = [f"{p.name} (exit code {p.exitcode})" for plan, p in zip(plans, procs)
                        if plan.worker not in outs and p.exitcode is not None]
                if gone and inbox.empty():
                    raise RuntimeError(
                        f"load generator process(es) {', '.join(gone)} exited without a result. A spawned "
                        "process re-imports your __main__: a script needs an `if __name__ == '__main__':` "
                        "guard, and code fed on stdin cannot be re-imported; there, use process=False")
                continue
            if kind == "error":
                raise RuntimeError(f"load generator process {w} failed:\n{payload}")
            outs[w] = payload
    finally:
        for proc in procs:
            if len(outs) < len(procs):
                proc.terminate()  # only after an error or a cancellation: ours to stop
            proc.join(timeout=10)
    on_count(sum(c.value for c in counters))
    return [outs[w] for w in sorted(outs)]
