"""Replicas that follow a traffic step, live on this machine and on a virtual clock: what ``benchmarks/autoscale.py``
and notebook 16 share.

One traffic step (``StepConfig``: ``rate`` for ``before_s``, ``factor`` x that for ``step_s``,
``rate`` again for ``after_s``; ``load.arrivals.traffic_step``) is sent open-loop to one
deployment at a time on Ray Serve: a fixed count of replicas, or ``(MIN, MAX)`` autoscaled
(``routing.Autoscaler``, delays of seconds so that a short run shows a whole cycle). ``run_step``
returns a ``StepRun``: the records, the replicas over time and the autoscaler's decisions (the
ingress's ``/stats`` ``scaling``, on the records' clock), each new replica's cold start in parts,
the replica-seconds held and the requests lost (not answered whole).

``simulate_step`` runs the same arrivals through the same rule on the virtual clock
(``routing.simulate_scaling``), with a replica's service time and cold start as measured, so
the simulation can be checked against the live run; ``cluster_step`` is the step at cluster
scale (1 to 64 replicas), which only the simulation can show here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..load.arrivals import Steps, traffic_step
from ..routing import Autoscaler, ScalingResult, simulate_scaling

__all__ = ["StepConfig", "StepRun", "cluster_step", "run_step", "simulate_step", "waiting"]


@dataclass(frozen=True)
class StepConfig:
    """The step, the replicas' model and the autoscaler's settings of one comparison."""

    model: str = "synthetic-gen:20+50"  # sleeps: a replica's capacity is its batch, not the shared cores
    strategy: str = "gen-continuous"
    max_batch_size: int = 2  # a replica's slots: 2 x 16 tokens x 50 ms, ~2.4 requests/s a replica
    new_tokens: int = 16
    rate: float = 1.2  # requests/s before and after the step (half a replica); 3x in it (1.5 replicas)
    factor: float = 3.0
    before_s: float = 20.0
    step_s: float = 45.0
    after_s: float = 35.0
    target_ongoing: float = 2.0  # a replica's batch
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 10.0
    look_back_s: float = 3.0
    metrics_interval_s: float = 0.5
    seed: int = 0

    def arrival(self) -> Steps:
        return traffic_step(self.rate, self.before_s, self.step_s, self.after_s, self.factor)

    @property
    def duration_s(self) -> float:
        return self.before_s + self.step_s + self.after_s

    def autoscaler(self, low: int, high: int) -> Autoscaler:
        return Autoscaler(low, high, target_ongoing=self.target_ongoing, upscale_delay_s=self.upscale_delay_s,
                          downscale_delay_s=self.downscale_delay_s, look_back_s=self.look_back_s,
                          metrics_interval_s=self.metrics_interval_s)

    def windows(self) -> dict[str, tuple[float, float]]:
        """Where TTFT is read: before the step, its first 15 s (a cold start's queue), the rest of it, after it."""
        a, b = self.before_s, self.before_s + self.step_s
        return {"before": (0.0, a), "step, first 15 s": (a, a + 15), "step, rest": (a + 15, b),
                "after": (b, self.duration_s)}


@dataclass
class StepRun:
    """One deployment under the step; times in seconds on the records' clock (0 = the first scheduled send)."""

    name: str
    records: pd.DataFrame = field(repr=False)
    timeline: pd.DataFrame = field(repr=False)  # t_s, target, running, starting, stopping, held
    decisions: list[dict[str, Any]]
    cold_starts: dict[str, dict[str, float | None]]
    end_s: float  # the last answer
    lost: int  # requests not answered whole (an error, or fewer tokens than asked)

    @property
    def replica_seconds(self) -> float:
        """Replicas held (starting, running or stopping) integrated from 0 to ``end_s``."""
        t = np.clip(np.append(self.timeline["t_s"].to_numpy(), self.end_s), 0.0, self.end_s)
        return float(np.sum(np.diff(t) * self.timeline["held"].to_numpy()))

    @property
    def reached(self) -> int:
        return int(self.timeline["running"].max())

    def ttft_ms(self, q: float, window: tuple[float, float]) -> float:
        r = self.records
        keep = (r["scheduled_s"] >= window[0]) & (r["scheduled_s"] < window[1]) & (r["status"] == 200)
        return float(np.quantile(r.loc[keep, "ttft_ms"], q)) if keep.any() else math.nan

    def summary(self, windows: dict[str, tuple[float, float]]) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "requests": len(self.records), "lost": self.lost,
                               "replica_seconds": self.replica_seconds, "reached": self.reached,
                               "decisions": self.decisions, "cold_starts": self.cold_starts}
        for label, window in windows.items():
            out[f"ttft_p50_ms {label}"] = self.ttft_ms(0.5, window)
            out[f"ttft_p99_ms {label}"] = self.ttft_ms(0.99, window)
        return out


def run_step(cfg: StepConfig, replicas: int | tuple[int, int], name: str | None = None,
             router: str = "pow2") -> StepRun:
    """Deploy ``replicas`` (N fixed, or (MIN, MAX) autoscaled) on the Ray this process runs (``ray_session``), send
    the step, read back what the ingress saw; the app is removed at the end."""
    import labserver
    from labserver.load.payloads import WordTexts
    from labserver.loadgen import run_load_sync

    scaled = {"autoscale": cfg.autoscaler(*replicas)} if isinstance(replicas, tuple) else {"replicas": replicas}
    name = name or (f"autoscaled {replicas[0]}:{replicas[1]}" if isinstance(replicas, tuple) else f"fixed {replicas}")
    with labserver.serve(cfg.strategy, cfg.model, router=router, max_batch_size=cfg.max_batch_size,
                         max_new_tokens=max(cfg.new_tokens, 64), graceful_shutdown_s=120, **scaled) as h:
        result = run_load_sync(h.url, mode="generate", payload=WordTexts(dist="uniform", min_words=8, max_words=24),
                               new_tokens=cfg.new_tokens, stream=True, ignore_eos=True, arrival=cfg.arrival(),
                               duration_s=cfg.duration_s, seed=cfg.seed, timeout_s=300, progress=False)
        time.sleep(1.0)  # (one more reading of the controller by the ingress: REPORT_S is 0.5 s)
        scaling = h.stats()["scaling"]
    t0 = float(result.meta["t0_unix_s"])
    records = result.records
    rows = pd.DataFrame(scaling["timeline"])
    rows["t_s"] -= t0
    rows["held"] = rows["running"] + rows["starting"] + rows["stopping"]
    whole = (records["status"] == 200) & (records["n_tokens"] == cfg.new_tokens)
    decisions = [{**d, "t_s": d["t_s"] - t0} for d in scaling["decisions"]]
    return StepRun(name, records, rows, decisions, scaling["cold_starts"], float(records["done_s"].max()),
                   int((~whole).sum()))


def waiting(records: pd.DataFrame, times_s: np.ndarray) -> np.ndarray:
    """Requests sent and not yet given a first token at each of ``times_s``: the queue a client sees."""
    sent = np.sort(records["scheduled_s"].to_numpy())
    first = np.sort(records["first_token_s"].fillna(records["done_s"]).to_numpy())
    return np.searchsorted(sent, times_s, side="right") - np.searchsorted(first, times_s, side="right")


def simulate_step(cfg: StepConfig, live: StepRun, low: int, high: int, cold_start_s: float) -> ScalingResult:
    """The live run's own arrivals through the same rule on the virtual clock: a request served for the prefill and
    decode steps ``cfg.model`` sleeps, ``max_batch_size`` at once a replica, a new one ready ``cold_start_s`` after
    its decision."""
    from ..models.synthetic import parse_synthetic_gen

    model = parse_synthetic_gen(cfg.model)
    service_s = (model.prefill_ms + cfg.new_tokens * model.step_ms) / 1000
    return simulate_scaling(cfg.autoscaler(low, high), np.sort(live.records["scheduled_s"].to_numpy()),
                            service_s=service_s, slots=cfg.max_batch_size, cold_start_s=cold_start_s, tick_s=0.1,
                            until_s=live.end_s)


def cluster_step(cold_start_s: float, replicas: int = 64, service_s: float = 2.0, slots: int = 4,
                 seed: int = 0) -> ScalingResult:
    """The step at cluster scale, simulated: 1 to ``replicas`` replicas, the step's 3r needing all of them at the
    target (2 ongoing a replica); 120 s before, 300 s in it, 300 s after; Ray's delays shortened to 10 s up and
    60 s down."""
    rate = replicas * 2 / service_s / 3  # r: 3r keeps every replica at its target of 2 ongoing
    arrivals = traffic_step(rate, 120, 300, 300).times(duration_s=720, seed=seed)
    rule = Autoscaler(1, replicas, target_ongoing=2, upscale_delay_s=10, downscale_delay_s=60, look_back_s=10,
                      metrics_interval_s=1)
    return simulate_scaling(rule, arrivals, service_s=service_s, slots=slots, cold_start_s=cold_start_s,
                            until_s=900)
