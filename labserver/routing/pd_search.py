"""DistServe's placement search, simplified: which P:D split of N instances serves the most requests within an SLO.

*Goodput* (DistServe, OSDI'24) is the highest request rate at which at least ``attainment``
(90 %) of requests meet both objectives: time to first token within ``ttft_ms`` and time
per output token within ``tpot_ms``. Throughput past that rate is not worth having: the
requests are served, but too late. ``goodput`` finds it by search over the rate on the
virtual clock of ``pd``: from a start, doubling (or halving) until the answer flips, then
bisecting (geometrically) until the bracket is within ``rel_tol``. The rate it returns was
probed and passed; ``upper``, a step above, was probed and failed. Divided by the number
of instances it is what one GPU is worth (per-instance goodput, the paper's figure).

``best_split`` runs that search for every P:D with P + D = N (a coarser grid past N = 32,
see ``default_splits``) and for the colocated baseline under both schedulers, and sorts
the rows. What decides the answer: how fast a decode step grows with its batch against
what a long prefill costs, the workload's prompt and answer lengths, and the SLO (a tight
TPOT beside long prompts is where colocation suffers: every prefill, chunked or not,
lengthens the steps of the decodes beside it). DistServe and Anyscale report decode-heavy
workloads wanting more decode instances than prefill ones (1:2, 1:3 and beyond);
``benchmarks/disagg.py`` and notebook 14 print what this model finds for given costs.

The search costs about ``probes x configurations`` simulations (10-60 ms each). For speed,
``capacity`` guesses each configuration's throughput from the costs alone, and the search
starts at half of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .pd import PDCosts, PDResult, Workload, simulate_colocated, simulate_disaggregated

__all__ = ["SLO", "Goodput", "SplitReport", "SplitRow", "best_split", "capacity", "default_splits", "goodput"]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives, ms: time to first token, and time per output token after it."""

    ttft_ms: float
    tpot_ms: float


@dataclass
class Goodput:
    """The highest rate probed that met the SLO (req/s), and the lowest probed above it that did not."""

    rate: float
    upper: float
    instances: int
    attained: float  # the share of requests that met the SLO at ``rate``
    probes: list[tuple[float, float]] = field(repr=False)  # (rate, attainment), in the order probed

    @property
    def per_instance(self) -> float:
        return self.rate / self.instances


def goodput(simulate: Callable[[float], PDResult], slo: SLO | tuple[float, float], *, attainment: float = 0.9,
            instances: int = 1, start: float = 1.0, rel_tol: float = 0.05, max_probes: int = 40) -> Goodput:
    """The highest rate (req/s) at which ``simulate(rate)`` meets ``slo`` for ``attainment`` of its requests.

    ``simulate`` should draw the same requests at every rate (``pd``'s simulations do, for one
    seed), so attainment falls with the rate about monotonically. A rate ``start / 1000`` that
    still fails gives goodput 0.
    """
    ttft, tpot = (slo.ttft_ms, slo.tpot_ms) if isinstance(slo, SLO) else slo
    probes: list[tuple[float, float]] = []

    def met(rate: float) -> bool:
        probes.append((rate, simulate(rate).slo_attainment(ttft, tpot)))
        return probes[-1][1] >= attainment

    if met(start):
        lo, hi = start, start * 2
        while met(hi) and len(probes) < max_probes:
            lo, hi = hi, hi * 2
    else:
        lo, hi = start / 2, start
        while not met(lo):
            if lo < start / 1000 or len(probes) >= max_probes:
                return Goodput(0.0, lo, instances, 0.0, probes)
            lo, hi = lo / 2, lo
    while hi > lo * (1 + rel_tol) and len(probes) < max_probes:
        mid = (lo * hi) ** 0.5
        if met(mid):
            lo = mid
        else:
            hi = mid
    return Goodput(lo, hi, instances, dict(probes)[lo], probes)


def capacity(costs: PDCosts, workload: Workload, prefill: int, decode: int = 0) -> float:
    """A rough throughput bound (req/s): P prefill and D decode instances, or (``decode=0``) P colocated ones.

    A prefill instance fills its token budget with mean-length prompts; a decode instance runs
    full batches of ``max_batch``; a colocated one splits its time between the two.
    """
    prompt, output = (float(x.mean()) for x in workload.sample(4096, np.random.default_rng(0)))
    per_call = max(1, int(costs.max_prefill_tokens // prompt))
    prefills = per_call / costs.prefill_ms(per_call * prompt) * 1000  # req/s of one prefill instance
    decodes = costs.max_batch / costs.decode_step_ms(costs.max_batch) * 1000 / max(output - 1, 1)
    if decode == 0:
        return prefill / (1 / prefills + 1 / decodes)
    return min(prefill * prefills, decode * decodes)


@dataclass
class SplitRow:
    label: str  # "2P:6D", or "colocated prefill-first" / "colocated chunked"
    prefill: int  # prefill instances (colocated: all of them)
    decode: int  # decode instances (colocated: 0)
    goodput: float  # req/s of the whole cluster
    per_instance: float
    upper: float  # the rate a step above that failed


@dataclass
class SplitReport:
    workload: str
    instances: int
    slo: SLO
    rows: list[SplitRow]  # every configuration, the most goodput first
    seconds: float  # how long the search took

    @property
    def best(self) -> SplitRow:
        """The disaggregated split with the most goodput."""
        return next(r for r in self.rows if r.decode)

    def colocated(self, policy: str = "chunked") -> SplitRow:
        return next(r for r in self.rows if r.label == f"colocated {policy}")

    def table(self, top: int = 6) -> str:
        """The best ``top`` splits and both colocated baselines, one line each."""
        shown = [r for r in self.rows if r.decode][:top] + [r for r in self.rows if not r.decode]
        shown.sort(key=lambda r: -r.goodput)
        lines = [f"{self.workload}, N={self.instances}, SLO TTFT<={self.slo.ttft_ms:g} ms & TPOT<="
                 f"{self.slo.tpot_ms:g} ms (90%), searched in {self.seconds:.1f} s",
                 f"{'configuration':<24} {'goodput req/s':>13} {'per instance':>12}"]
        lines += [f"{r.label:<24} {r.goodput:>13.2f} {r.per_instance:>12.3f}" for r in shown]
        return "\n".join(lines)


def default_splits(instances: int) -> list[int]:
    """Prefill counts to try: all of 1..N-1 up to N = 32; past it, every one near either end, a few between."""
    if instances <= 32:
        return list(range(1, instances))
    step = max(2, instances // 8)
    return sorted({p for p in range(1, instances) if p <= 6 or p >= instances - 6 or p % step == 0})


def best_split(instances: int, workload: Workload, costs: PDCosts, slo: SLO, *,
               splits: Sequence[int] | None = None, policies: Sequence[str] = ("prefill-first", "chunked"),
               n_requests: int | None = None, attainment: float = 0.9, rel_tol: float = 0.05,
               warmup: float = 0.1, route: str = "least-loaded", shared_link: bool = True,
               seed: int = 0) -> SplitReport:
    """Goodput of every P:D split of ``instances`` (P in ``splits``, default ``default_splits``) and of colocation.

    ``n_requests`` per simulation, default ``max(2000, 4 * instances * max_batch)``: four
    times the cluster's decode slots, so batches live through a few generations of requests
    before the run ends. A finite run cannot overload for long: its goodput reads 5-8 % high
    against runs four times as long (which rank the configurations the same way).
    """
    began = time.perf_counter()
    n = n_requests or max(2000, 4 * instances * costs.max_batch)
    common = dict(n_requests=n, warmup=warmup, route=route, seed=seed)
    rows = []

    def search(sim: Callable[[float], PDResult], p: int, d: int) -> Goodput:
        return goodput(sim, slo, attainment=attainment, instances=instances, rel_tol=rel_tol,
                       start=max(capacity(costs, workload, p, d) / 2, 1e-3))

    for p in (default_splits(instances) if splits is None else splits):
        d = instances - p
        if not 1 <= p < instances:
            raise ValueError(f"a split needs 1 <= P < {instances}, got P={p}")
        g = search(lambda rate: simulate_disaggregated(p, d, rate, workload, costs, shared_link=shared_link,
                                                       **common), p, d)
        rows.append(SplitRow(f"{p}P:{d}D", p, d, g.rate, g.per_instance, g.upper))
    for policy in policies:
        g = search(lambda rate: simulate_colocated(instances, rate, workload, costs, policy=policy, **common),
                   instances, 0)
        rows.append(SplitRow(f"colocated {policy}", instances, 0, g.rate, g.per_instance, g.upper))
    rows.sort(key=lambda r: (-r.goodput, r.label))
    return SplitReport(workload.name, instances, slo, rows, time.perf_counter() - began)
