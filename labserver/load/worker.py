"""How a load plan goes out: the sending loop of one generator (``Worker``).

``labserver.loadgen`` decides what to send (a ``Plan`` per process, ``labserver.load.plan``)
and turns the rows that come back into records. This module only sends on time and writes
down what happened, one tuple per request (``ROW_FIELDS``), as cheaply as it can (a mix's
requests also carry their flow's ``x-priority`` / ``x-tenant`` headers): at 1000
requests/s every microsecond of bookkeeping is a tenth of a percent of a core. A generation
request (mode "generate", or an OpenAI completions/chat API) also carries its token arrival
times in the row, as a list. ``run_here`` sends one plan in this process; the event loop it
runs on is chosen in ``labserver.load.loops``, and several plans from spawned processes are
``labserver.load.processes``'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ..wire import allow_open_files
from .apis import is_generative, openai_body
from .clients import CLIENTS, RequestFailed, StreamClient
from .lengths import iter_lengths
from .loops import RESERVED_FDS, run_on_fresh_loop, spin_s, timer_late_fraction
from .mix import Mix
from .openai_sse import OpenAIAnswer
from .payloads import Inputs, input_chars, iter_payloads, next_request
from .plan import HEADER_COLUMNS, PROBE_FIELDS, PROBES_IN_FLIGHT, ROW_FIELDS, Plan
from .sse import Answer

logger = logging.getLogger(__name__)

# besides its own two names, the ones that lived here before the plan and the loop had modules
# of their own (results.py, tests and benchmarks import them from here)
__all__ = ["PROBE_FIELDS", "ROW_FIELDS", "Plan", "Worker", "run_here", "run_on_fresh_loop", "timer_late_fraction"]

_NO_HEADERS = (None,) * len(HEADER_COLUMNS)
_NO_GEN = (math.nan, None, None, "", None)  # GEN_FIELDS of a row without a generation answer
_TIMING_COLUMNS = ("queue_ms", "server_ms")  # taken from a generation answer's "timing" when there


class _Counter:
    value = 0  # same face as multiprocessing's RawValue, for the in-process case


class Worker:
    """Sends one ``Plan`` on the running loop and keeps a row per request."""

    def __init__(self, plan: Plan, counter) -> None:
        self.plan, self.counter = plan, counter
        self.rows: list[tuple] = []
        self.probes: list[tuple] = []
        self.gen = is_generative(plan.api, plan.mode)
        # a mix: each flow's headers (x-priority, x-tenant), sent with each of its requests
        self.flow_headers = [f.headers() or None for f in plan.flows]
        self.flow_k: list[int] = []  # open loop: each request's flow (-1: no mix)
        self.chars: list[int] = []  # open loop: each request's input_chars
        if plan.users:
            self.bodies = []
        else:  # built before the run: json.dumps is not free at 1000 requests/s
            sizes = plan.new_tokens if self.gen else [None] * len(plan.texts)
            self.flow_k = plan.flow.tolist() if plan.flow is not None else [-1] * len(plan.texts)
            self.bodies = [self._body(t, n, k) for t, n, k in zip(plan.texts, sizes, self.flow_k)]
            self.chars = [input_chars(t) for t in plan.texts]
        self.t0 = 0.0
        self.spin_s = 0.0

    def _body(self, text: Inputs, new_tokens: int | None = None, flow_k: int = -1) -> bytes:
        if self.plan.api != "labserver":
            priority = self.plan.flows[flow_k].priority if flow_k >= 0 else None  # vLLM's body field
            return openai_body(self.plan.api, self.plan.model, text, new_tokens, stream=self.plan.stream,
                               ignore_eos=self.plan.ignore_eos, priority=priority)
        if self.gen:
            return json.dumps({"prompt": text, "max_new_tokens": int(new_tokens), "stream": self.plan.stream,
                               "ignore_eos": self.plan.ignore_eos}).encode()
        if self.plan.mode == "json":  # a list of texts (texts_per_request > 1) goes as it is
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
        return kind(url, method=method, content_type=content_type, timeout_s=self.plan.timeout_s,
                    headers=self.plan.headers, **extra)

    async def run(self, t0: float) -> dict[str, Any]:
        allow_open_files(self.plan.sockets() + RESERVED_FDS)
        self.t0 = t0
        self.spin_s = spin_s(asyncio.get_running_loop(), self.plan.mean_gap_s())
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
                    new_tokens: int | None = None, flow_k: int = -1) -> float:
        sent = time.perf_counter() - self.t0
        status, headers, error, answer = 0, None, "", None
        extra = self.flow_headers[flow_k] if flow_k >= 0 else None
        try:
            if new_tokens is None:
                status, headers = await client.request(body, extra)
            else:
                answer = await client.request(body, extra)
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
                self.rows.append((i, self.plan.worker, scheduled_s, sent, done, status, error, chars, flow_k, *hdr,
                                  *_NO_GEN))
            else:
                self.rows.append(self._gen_row(i, scheduled_s, sent, done, error, chars, flow_k, new_tokens,
                                               answer))
            self.counter.value += 1
        return done

    def _gen_row(self, i: int, scheduled_s: float, sent: float, done: float, error: str, chars: int, flow_k: int,
                 new_tokens: int, answer: Answer | OpenAIAnswer | None) -> tuple:
        if answer is None:  # no response at all
            return (i, self.plan.worker, scheduled_s, sent, done, 0, error, chars, flow_k, *_NO_HEADERS,
                    math.nan, 0, new_tokens, "", None)
        kind, first_s, n_tokens, finish = answer.outcome(done, self.t0)
        if error == "disconnect" and answer.event_stream:  # dropped after the headers: the stream broke off
            error = "stream_incomplete"
        error = error or kind  # a transport failure (timeout, ...) names the row before the stream's state
        fields = {col: answer.headers.get(h) for col, h in HEADER_COLUMNS.items()}
        timing = answer.timing()
        fields.update({col: timing[col] for col in _TIMING_COLUMNS if timing.get(col) is not None})
        token_s = [t - self.t0 for t in answer.token_s]
        return (i, self.plan.worker, scheduled_s, sent, done, answer.status, error, chars, flow_k, *fields.values(),
                first_s, n_tokens, new_tokens, finish, token_s)

    async def _open(self, client) -> None:
        p = self.plan
        limit = asyncio.Semaphore(p.max_in_flight)
        tasks: set[asyncio.Task] = set()
        asked = p.new_tokens.tolist() if self.gen else [None] * len(p.texts)

        async def one(k: int) -> None:
            try:
                await self._send(client, int(p.index[k]), float(p.scheduled_s[k]), self.bodies[k],
                                 self.chars[k], asked[k], self.flow_k[k])
            finally:
                limit.release()

        for k, s in enumerate(p.scheduled_s.tolist()):
            await self._until(s)
            if limit.locked() and p.overflow == "error":
                gen = (math.nan, 0, asked[k], "", None) if self.gen else _NO_GEN
                self.rows.append((int(p.index[k]), p.worker, s, math.nan, math.nan, 0, "client_overflow",
                                  self.chars[k], self.flow_k[k], *_NO_HEADERS, *gen))
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
        # a mix: each request's flow drawn as it goes, and a flow's own texts and lengths where it has them
        draw = _FlowDraw(p, texts, sizes) if p.flows else None

        async def user() -> None:
            next_s = 0.0
            while next_s < p.duration_s and left[0] > 0:
                left[0] -= 1
                await self._until(next_s)
                if draw is None:
                    k, text, n = -1, next_request(texts, p.texts_per_request), next(sizes) if sizes else None
                else:
                    k, text, n = draw.next()
                done = await self._send(client, -1, next_s, self._body(text, n, k), input_chars(text), n, k)
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
                if len(tasks) >= PROBES_IN_FLIGHT:
                    self.probes.append((t_s, math.nan, 0, "client_overflow"))
                    continue
                task = asyncio.create_task(one(t_s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in list(tasks):
                task.cancel()  # probes still out when the load ends are dropped
            await client.aclose()


class _FlowDraw:
    """A closed loop's flows, drawn request by request (seeded per process), with their texts and lengths."""

    def __init__(self, p: Plan, texts, sizes) -> None:
        mix = Mix(p.flows)
        self.per_request = p.texts_per_request
        self.rng = mix.rng([p.seed, p.worker])
        self.shares = mix.shares
        self.texts = [iter_payloads(f.payload, seed=[p.seed, 1, p.worker, k]) if f.payload is not None else texts
                      for k, f in enumerate(p.flows)]
        self.sizes = [iter_lengths(f.new_tokens, seed=[p.seed, 2, p.worker, k]) if sizes and f.new_tokens is not None
                      else sizes for k, f in enumerate(p.flows)]

    def next(self) -> tuple[int, Inputs, int | None]:
        k = int(self.rng.choice(len(self.shares), p=self.shares))
        sizes = self.sizes[k]
        return k, next_request(self.texts[k], self.per_request), next(sizes) if sizes else None


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
