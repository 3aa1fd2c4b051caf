"""What the prefill/decode simulations are given: the costs of a forward pass and a KV transfer, and the workload.

``PDCosts``: milliseconds per prefill call, per decode step and per transfer over a link
(``LINKS``: rough one-way figures for NVLink, RDMA and TCP), straight lines through
measurements with ``PDCosts.from_measured``. ``Workload``: prompt and output lengths drawn
uniform or log-normal, or a mixture (``PREFILL_HEAVY``, ``DECODE_HEAVY``, ``MIXED``).
``labserver.routing.pd`` runs them on a virtual clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["DECODE_HEAVY", "LINKS", "MIXED", "PDCosts", "PREFILL_HEAVY", "Workload"]

# (Gb/s, ms a transfer), rough one-way figures: NVLink 4 in one H100 node (~450 GB/s each way), an InfiniBand
# HDR / RoCE NIC between nodes, plain 10 GbE sockets. The fixed part stands for setup and handshakes.
LINKS: dict[str, tuple[float, float]] = {"nvlink": (3600.0, 0.01), "rdma": (200.0, 0.02), "tcp": (10.0, 0.1)}


@dataclass(frozen=True)
class PDCosts:
    """What a forward pass and a KV transfer cost (ms). Defaults: a small model on one GPU, over RDMA."""

    prefill_fixed_ms: float = 5.0
    prefill_ms_per_token: float = 0.05
    step_ms: float = 8.0
    step_ms_per_seq: float = 0.1
    max_batch: int = 64  # sequences decoding at once on an instance (its KV memory)
    max_prefill_tokens: int = 2048  # prompt tokens in one prefill call
    chunk_tokens: int = 512  # prompt tokens in one chunked step
    kv_bytes_per_token: float = 50_000.0
    link_gbps: float = LINKS["rdma"][0]
    link_latency_ms: float = LINKS["rdma"][1]

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_fixed_ms + self.prefill_ms_per_token * tokens

    def decode_step_ms(self, sequences: int) -> float:
        return self.step_ms + self.step_ms_per_seq * sequences

    def transfer_ms(self, tokens: int) -> float:
        return self.link_latency_ms + self.kv_bytes_per_token * tokens * 8 / (self.link_gbps * 1e9) * 1000

    def with_link(self, link: str | float, latency_ms: float | None = None) -> PDCosts:
        """The same costs over a named link (``LINKS``: nvlink, rdma, tcp) or one of ``link`` Gb/s."""
        gbps, lat = LINKS[link] if isinstance(link, str) else (float(link), self.link_latency_ms)
        return replace(self, link_gbps=gbps, link_latency_ms=lat if latency_ms is None else latency_ms)

    @classmethod
    def from_measured(cls, prefill: list[tuple[float, float]], steps: list[tuple[float, float]],
                      **rest: float) -> PDCosts:
        """Straight lines through measurements: ``prefill`` (prompt tokens, ms), ``steps`` (batch size, ms)."""
        (per_token, fixed), (per_seq, step) = (np.polyfit(*np.asarray(xy, float).T, 1) for xy in (prefill, steps))
        return cls(prefill_fixed_ms=max(float(fixed), 0.0), prefill_ms_per_token=max(float(per_token), 0.0),
                   step_ms=max(float(step), 0.0), step_ms_per_seq=max(float(per_seq), 0.0), **rest)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths (tokens), each a (mean, spread) pair, or a mixture of workloads.

    ``dist="uniform"``: uniform on mean +- spread; ``"lognormal"``: that mean, coefficient of
    variation ``spread`` (a long right tail). ``parts``: (weight, workload) pairs, each request
    drawn from one part; a mixture's own lengths are then unused. Lengths are at least 1.
    """

    name: str
    prompt: tuple[float, float] = (512.0, 0.0)
    output: tuple[float, float] = (128.0, 0.0)
    dist: str = "uniform"
    parts: tuple[tuple[float, Workload], ...] = ()

    @classmethod
    def uniform(cls, name: str, prompt: tuple[int, int], output: tuple[int, int]) -> Workload:  # (lo, hi) each
        return cls(name, ((prompt[0] + prompt[1]) / 2, (prompt[1] - prompt[0]) / 2),
                   ((output[0] + output[1]) / 2, (output[1] - output[0]) / 2))

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) lengths, int arrays."""
        if self.parts:
            weights = np.array([w for w, _ in self.parts], float)
            which = rng.choice(len(self.parts), size=n, p=weights / weights.sum())
            prompts, outputs = np.empty(n, np.int64), np.empty(n, np.int64)
            for i, (_, part) in enumerate(self.parts):
                pick = which == i
                prompts[pick], outputs[pick] = part.sample(int(pick.sum()), rng)
            return prompts, outputs
        return self._lengths(self.prompt, n, rng), self._lengths(self.output, n, rng)

    def _lengths(self, spec: tuple[float, float], n: int, rng: np.random.Generator) -> np.ndarray:
        mean, spread = spec
        if self.dist == "uniform":
            x = rng.integers(round(mean - spread), round(mean + spread) + 1, n)
        elif self.dist == "lognormal":
            sigma = math.sqrt(math.log1p(spread ** 2))
            x = np.rint(rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n))
        else:
            raise ValueError(f"dist must be 'uniform' or 'lognormal', got {self.dist!r}")
        return np.maximum(x, 1).astype(np.int64)


PREFILL_HEAVY = Workload.uniform("prefill-heavy", prompt=(1500, 3000), output=(20, 100))  # summarising documents
DECODE_HEAVY = Workload.uniform("decode-heavy", prompt=(100, 400), output=(300, 800))  # writing, reasoning
MIXED = Workload("mixed", parts=((0.5, PREFILL_HEAVY), (0.5, DECODE_HEAVY)))  # both kinds on one cluster
