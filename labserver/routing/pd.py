"""Prefill and decode on separate instances (DistServe, Splitwise) or together, on a virtual clock.

Prefill reads a whole prompt in one forward pass: compute-bound, its cost grows with the
prompt. Decode makes one token per pass for every running sequence: memory-bound, a step
costs about the same for 1 or 64 sequences. *Colocated*, they get in each other's way:
under vLLM v0's ``"prefill-first"`` a long prompt stops every decoding sequence for its
whole prefill (their inter-token latency, ITL, jumps); under ``"chunked"`` prefill (vLLM
v1, Sarathi) each step carries all decodes plus a slice of prompt tokens, so the stall is
spread thin over slower steps. *Disaggregated*, P instances only prefill, D only decode,
and each prompt's KV cache crosses a link: no interference, one more hop, and P:D to
choose (``pd_search.best_split``).

Cost model (``PDCosts``, ms, the same for every instance): a prefill call of T prompt
tokens costs ``prefill_fixed_ms + prefill_ms_per_token * T`` (waiting prompts batched first
come first served up to ``max_prefill_tokens``; a longer one alone); a decode step of n <=
``max_batch`` sequences ``step_ms + step_ms_per_seq * n``; a chunked step adds
``prefill_ms_per_token * T_chunk`` to that (one forward pass, so no ``prefill_fixed_ms``); a
KV transfer ``link_latency_ms + kv_bytes_per_token * T * 8 / link_gbps`` (bits over Gb/s).

What the simulations assume:

- Poisson arrivals at ``rate`` req/s, lengths from the workload, all drawn from ``seed``; the
  gaps are unit exponentials over ``rate``, so every rate and every split sees the same
  requests in the same order (common random numbers: goodput's search is steadier).
- Routing (``route``), every tier: ``"least-loaded"`` (fewest requests held: queued,
  running or on their way; ties go round) or ``"round-robin"``. Colocated and prefill
  instances are chosen at arrival; a decode instance when the prefill ends.
- Colocated: the first token is made at the end of the (last) prefill slice, each later one
  at the end of a decode step; batch room (``max_batch``) is needed to start a prefill.
- Disaggregated: the prefill instance makes the first token, but the client sees it (as
  behind vLLM's P/D proxy) only when a decode instance admits the request, at a step
  boundary with room: TTFT = queue + prefill + transfer + decode_wait, each recorded. With
  ``shared_link`` (default) transfers out of one prefill instance take turns on its link (a
  NIC each); else each has a link to itself. A prefill instance is free when its call ends.
- TPOT = (finish - first token) / (output - 1), the mean ITL (0 for one-token answers);
  ``max_itl``: a request's longest gap between two tokens (where a prefill stall shows).
  The first ``warmup`` share of requests (by arrival) is left out, while the cluster fills.

Pure Python. k identical decode steps are one event (cut short when a request arrives):
a few events a request, ~9 us each (70 ms for 8,192 requests), whatever the output lengths.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

__all__ = ["DECODE_HEAVY", "LINKS", "MIXED", "PDCosts", "PDResult", "PREFILL_HEAVY", "Role", "Workload",
           "draw", "simulate_colocated", "simulate_disaggregated"]

from .pdload import DECODE_HEAVY, LINKS, MIXED, PREFILL_HEAVY, PDCosts, Workload

CALL, STEPS, END, KV = 0, 1, 0, 1  # a node runs a prefill call or k token steps; events: they end, or KV lands


class Role(Enum):
    """What one instance does: both phases colocated (prefill-first or chunked), or one of them."""

    PREFILL_FIRST = "prefill-first"  # colocated: a waiting prompt is prefilled before the next token step
    CHUNKED = "chunked"  # colocated: prompts sliced into the token steps, a token budget a step
    PREFILL = "prefill"  # disaggregated: prefills only, its KV sent on
    DECODE = "decode"  # disaggregated: decodes only, from the KV it received


class _Node:
    """One instance, in its ``Role``."""

    __slots__ = ("kind", "tier", "idx", "waiting", "running", "counter", "itl", "stall", "busy", "phase", "t0", "d",
                 "k", "batch", "version", "started", "link_free")

    def __init__(self, kind: Role, tier: int, idx: int) -> None:
        self.kind, self.tier, self.idx, self.link_free = kind, tier, idx, 0.0  # (link: when it is free next)
        self.waiting: deque[int] = deque()  # prompts to prefill, or (decode) transferred requests to admit
        self.running: list[tuple[int, int]] = []  # heap of (counter value at which it is done, request)
        self.counter = 0  # token steps run so far: a running sequence's progress without touching it
        self.itl: list[float] = []  # per token-step run: the ITL of its first step (its duration + stall)
        self.stall = 0.0  # prefill calls since the last token step: decoding sequences waited that long
        self.busy, self.phase, self.t0, self.d, self.k = False, CALL, 0.0, 0.0, 0
        self.batch: list[int] = []  # prompts whose prefill ends with this call/step
        self.version, self.started = 0, 0  # END events of older versions are void; (chunked) prompts begun


class _Cluster:
    """The event loop: arrivals in order, merged with a heap of node and transfer events."""

    def __init__(self, costs: PDCosts, arrival: list[float], prompt: list[int], output: list[int], *,
                 route: str = "least-loaded", shared_link: bool = True) -> None:
        if route not in ("least-loaded", "round-robin"):
            raise ValueError(f"route must be 'least-loaded' or 'round-robin', got {route!r}")
        if costs.decode_step_ms(0) <= 0 or costs.max_batch < 1 or costs.chunk_tokens < 1:
            raise ValueError(f"need step_ms > 0, max_batch >= 1 and chunk_tokens >= 1: {costs}")
        self.c, self.arrival, self.prompt, self.output = costs, arrival, prompt, output
        self.route, self.shared_link = route, shared_link
        n = len(arrival)
        self.rec = {"arrival": arrival, **{k: [0.0] * n for k in ("started", "made", "moved", "first", "finish")}}
        self.rec["max_itl"] = [0.0] * n
        self.join, self.s0, self.done = [0] * n, [0.0] * n, [0] * n  # decode start, its stall then, prefilled
        self.events: list[tuple[float, int, int, int, int, int]] = []  # (time, seq, END/KV, a, b, version)
        self.seq = 0  # (events at one time in the order pushed)

    def run(self, front: list[Role], back: list[Role]) -> None:
        self.nodes = [[_Node(k, 0, i) for i, k in enumerate(front)], [_Node(k, 1, i) for i, k in enumerate(back)]]
        self.held, self.next = [[0] * len(front), [0] * len(back)], [0, 0]
        arrival, events, i, n = self.arrival, self.events, 0, len(self.arrival)
        while i < n or events:
            if i < n and (not events or arrival[i] <= events[0][0]):
                self.enqueue(self.nodes[0][self.pick(0)], i, arrival[i])
                i += 1
                continue
            now, _, kind, a, b, version = heapq.heappop(events)
            if kind == KV:
                self.rec["moved"][a] = now
                self.enqueue(self.nodes[1][b], a, now)
            elif version == self.nodes[a][b].version:
                self.end(self.nodes[a][b], now)

    def push(self, t: float, kind: int, a: int, b: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b, version))

    def pick(self, tier: int) -> int:
        held, start = self.held[tier], self.next[tier]
        self.next[tier] = (start + 1) % len(held)
        if self.route == "round-robin":
            i = start
        else:  # the least loaded; among equals, the first from a pointer that goes round
            m = min(held)
            i = held.index(m, start) if m in held[start:] else held.index(m)
        held[i] += 1
        return i

    def enqueue(self, node: _Node, r: int, now: float) -> None:
        node.waiting.append(r)
        if not node.busy:  # plans once every event of this instant is in: an empty call of 0 ms
            self.start(node, now, CALL, 0.0, 1, [])
        elif node.phase == STEPS and node.k > 1 and len(node.running) + node.started < self.c.max_batch:
            j = max(1, math.ceil((now - node.t0) / node.d - 1e-9))  # it can join at the next step boundary
            if j < node.k:
                node.k = j
                node.version += 1
                self.push(node.t0 + j * node.d, END, node.tier, node.idx, node.version)

    def plan(self, node: _Node, now: float) -> None:
        """At a step boundary: what the node runs next (or it idles)."""
        c, kind, waiting, running = self.c, node.kind, node.waiting, node.running
        if waiting and (kind is Role.PREFILL or (kind is Role.PREFILL_FIRST and len(running) < c.max_batch)):
            limit = c.max_batch - len(running) if kind is Role.PREFILL_FIRST else len(waiting)
            batch = [waiting.popleft()]
            tokens = self.prompt[batch[0]]  # the first always goes, however long
            while waiting and len(batch) < limit and tokens + self.prompt[waiting[0]] <= c.max_prefill_tokens:
                batch.append(waiting.popleft())
                tokens += self.prompt[batch[-1]]
            for r in batch:
                self.rec["started"][r] = now
            return self.start(node, now, CALL, c.prefill_ms(tokens), 1, batch)
        if kind is Role.DECODE:
            while waiting and len(running) < c.max_batch:
                r = waiting.popleft()
                self.rec["first"][r] = now
                self.enter(node, r, now)
        elif kind is Role.CHUNKED and waiting and len(running) < c.max_batch:
            budget, slots, batch = c.chunk_tokens, c.max_batch - len(running), []
            for r in waiting:  # first come first served; a prompt may be sliced over several steps
                if budget <= 0 or slots <= 0:
                    break
                if not self.done[r]:
                    self.rec["started"][r] = now
                    node.started += 1
                take = min(self.prompt[r] - self.done[r], budget)
                self.done[r] += take
                budget, slots = budget - take, slots - 1
                if self.done[r] == self.prompt[r]:
                    batch.append(r)
            for _ in batch:
                waiting.popleft()
            tokens = c.chunk_tokens - budget
            d = c.decode_step_ms(len(running)) + c.prefill_ms_per_token * tokens
            return self.start(node, now, STEPS, d, 1, batch)
        if running:
            return self.start(node, now, STEPS, c.decode_step_ms(len(running)), running[0][0] - node.counter, [])
        node.busy = False

    def start(self, node: _Node, now: float, phase: int, d: float, k: int, batch: list[int]) -> None:
        node.busy, node.phase, node.t0, node.d, node.k, node.batch = True, phase, now, d, k, batch
        if phase == STEPS:
            node.itl.append(d + node.stall)
            node.stall = 0.0
        node.version += 1
        self.push(now + k * d, END, node.tier, node.idx, node.version)

    def end(self, node: _Node, now: float) -> None:
        if node.phase == CALL:
            node.stall += node.d
        else:
            node.counter += node.k
            while node.running and node.running[0][0] <= node.counter:
                self.finish(node, heapq.heappop(node.running)[1], now)
            node.started -= len(node.batch)
        for r in node.batch:  # prompts whose prefill ended here
            self.rec["made"][r] = now
            if node.kind is Role.PREFILL:
                self.send(node, r, now)
            else:
                self.rec["moved"][r] = self.rec["first"][r] = now
                self.enter(node, r, now)
        self.plan(node, now)

    def enter(self, node: _Node, r: int, now: float) -> None:
        """Request ``r`` has its first token: it decodes here from the next step on (or is done)."""
        if self.output[r] <= 1:
            return self.finish(node, r, now)
        heapq.heappush(node.running, (node.counter + self.output[r] - 1, r))
        self.join[r], self.s0[r] = len(node.itl), node.stall

    def finish(self, node: _Node, r: int, now: float) -> None:
        self.rec["finish"][r] = now
        self.held[node.tier][node.idx] -= 1
        if self.output[r] > 1:
            itl, i = node.itl, self.join[r]
            self.rec["max_itl"][r] = max(itl[i] - self.s0[r], max(itl[i + 1:], default=0.0))

    def send(self, node: _Node, r: int, now: float) -> None:
        """KV of ``r`` from prefill ``node`` to a decode instance chosen now."""
        self.held[0][node.idx] -= 1
        node.link_free = (max(now, node.link_free) if self.shared_link else now) + self.c.transfer_ms(self.prompt[r])
        self.push(node.link_free, KV, r, self.pick(1))


@dataclass
class PDResult:
    """Per request (after the warm-up share), ms: TTFT and its parts, TPOT, the longest ITL, finish time."""

    label: str
    rate: float
    instances: int
    arrival: np.ndarray = field(repr=False)
    prompt: np.ndarray = field(repr=False)
    output: np.ndarray = field(repr=False)
    ttft: np.ndarray = field(repr=False)
    tpot: np.ndarray = field(repr=False)
    max_itl: np.ndarray = field(repr=False)
    finish: np.ndarray = field(repr=False)
    queue: np.ndarray = field(repr=False)  # arrival -> its prefill starts
    prefill: np.ndarray = field(repr=False)  # prefill start -> first token made
    transfer: np.ndarray = field(repr=False)  # first token made -> KV on the decode instance (0 colocated)
    decode_wait: np.ndarray = field(repr=False)  # KV there -> admitted to a decode batch (0 colocated)

    def slo_attainment(self, ttft_slo_ms: float, tpot_slo_ms: float) -> float:
        """The share of requests that meet both the TTFT and the TPOT objective."""
        return float(np.mean((self.ttft <= ttft_slo_ms) & (self.tpot <= tpot_slo_ms)))

    def quantile(self, metric: str, q: float) -> float:
        """``metric``: ttft, tpot, max_itl, queue, prefill, transfer, decode_wait (or any per-request array)."""
        return float(np.quantile(getattr(self, metric), q))

    def p50(self, metric: str) -> float:
        return self.quantile(metric, 0.5)

    def p99(self, metric: str) -> float:
        return self.quantile(metric, 0.99)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens of these requests over the time from the first's arrival to the last's finish."""
        span = float(self.finish.max() - self.arrival.min())
        return float(self.output.sum()) / span * 1000 if span > 0 else 0.0

    def summary(self) -> dict[str, float | str | int]:
        return {"label": self.label, "rate": self.rate, "instances": self.instances, "tokens_per_s": self.tokens_per_s,
                **{f"{m}_p{q}": self.quantile(m, q / 100) for m in ("ttft", "tpot", "max_itl") for q in (50, 99)}}


def draw(workload: Workload, rate: float, n_requests: int, seed: int) -> tuple[list[float], list[int], list[int]]:
    """Arrival times (ms), prompt and output lengths: the same requests at every rate for one seed."""
    if rate <= 0 or n_requests < 1:
        raise ValueError(f"need rate > 0 and n_requests >= 1, got {rate}, {n_requests}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.standard_exponential(n_requests)) * (1000.0 / rate)
    prompts, outputs = workload.sample(n_requests, rng)
    return arrivals.tolist(), prompts.tolist(), outputs.tolist()


def _result(cluster: _Cluster, label: str, rate: float, instances: int, warmup: float) -> PDResult:
    a = {k: np.asarray(v, float) for k, v in cluster.rec.items()}
    out = np.asarray(cluster.output, float)
    tpot = np.where(out > 1, (a["finish"] - a["first"]) / np.maximum(out - 1, 1), 0.0)
    keep = slice(int(warmup * len(out)), None)
    return PDResult(label, rate, instances, a["arrival"][keep], np.asarray(cluster.prompt)[keep], out[keep],
                    (a["first"] - a["arrival"])[keep], tpot[keep], a["max_itl"][keep], a["finish"][keep],
                    (a["started"] - a["arrival"])[keep], (a["made"] - a["started"])[keep],
                    (a["moved"] - a["made"])[keep], (a["first"] - a["moved"])[keep])


def simulate_colocated(instances: int, rate: float, workload: Workload, costs: PDCosts = PDCosts(), *,
                       policy: str = "prefill-first", route: str = "least-loaded", n_requests: int = 2000,
                       warmup: float = 0.1, seed: int = 0) -> PDResult:
    """``instances`` that each prefill and decode, scheduling ``policy``: "prefill-first" or "chunked"."""
    if policy not in ("prefill-first", "chunked"):
        raise ValueError(f"policy must be 'prefill-first' or 'chunked', got {policy!r}")
    cluster = _Cluster(costs, *draw(workload, rate, n_requests, seed), route=route)
    cluster.run([Role(policy)] * instances, [])
    return _result(cluster, f"colocated {policy}", rate, instances, warmup)


def simulate_disaggregated(prefill: int, decode: int, rate: float, workload: Workload, costs: PDCosts = PDCosts(),
                           *, route: str = "least-loaded", shared_link: bool = True, n_requests: int = 2000,
                           warmup: float = 0.1, seed: int = 0) -> PDResult:
    """``prefill`` instances that only prefill, ``decode`` that only decode, KV over the link between."""
    if prefill < 1 or decode < 1:
        raise ValueError(f"need at least one prefill and one decode instance, got {prefill}:{decode}")
    cluster = _Cluster(costs, *draw(workload, rate, n_requests, seed), route=route, shared_link=shared_link)
    cluster.run([Role.PREFILL] * prefill, [Role.DECODE] * decode)
    return _result(cluster, f"disaggregated {prefill}P:{decode}D", rate, prefill + decode, warmup)

