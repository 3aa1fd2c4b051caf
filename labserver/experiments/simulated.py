"""Serving on the virtual clock, for the notebooks: a cost table as a cost function, strategies at several
rates, a measured run replayed through an exact queue, and runs as the frames the plots take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..engine.virtual import SimRun

__all__ = ["A100_BERT_BASE_MS", "cost_from_table", "md1_replay_ms", "sim_frames", "simulated_serving"]


# A GPU's cost curve for a model of the guide's size, to simulate what this CPU cannot show:
# BERT-Base, sequence length 128, FP16, TensorRT, average latency (ms) per batch size on an
# NVIDIA A100 (40 GB), from the "Inference performance: NVIDIA A100" table of the README of
# NVIDIA/TensorRT's demo/BERT. An optimised engine: eager PyTorch adds a per-call overhead.
A100_BERT_BASE_MS = {1: 0.67, 2: 0.83, 4: 1.02, 8: 1.38, 12: 1.87, 16: 2.18, 24: 3.34, 32: 4.10, 64: 8.05,
                     128: 16.14}


def cost_from_table(table: Mapping[int, float]) -> Any:
    """A batch cost function (size -> ms) through a table's points, linear in between and past the ends."""
    sizes = np.array(sorted(table), dtype=float)
    ms = np.array([table[int(k)] for k in sizes], dtype=float)

    def cost_ms(n: int) -> float:
        if n <= sizes[-1]:
            return float(np.interp(n, sizes, ms))
        slope = (ms[-1] - ms[-2]) / (sizes[-1] - sizes[-2])
        return float(ms[-1] + slope * (n - sizes[-1]))

    return cost_ms


def simulated_serving(cost_ms: Any, strategies: Sequence[str], rates: Sequence[float], *, n: int = 3000,
                      max_batch_size: int = 32, max_wait_ms: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """Each strategy's rule on a virtual clock over a cost curve, at each offered Poisson rate.

    No HTTP and no client: only the model's time (``cost_ms(batch size)``) and the rule. One
    row per (strategy, rate): ``throughput_rps`` (requests over the span from the first
    arrival to the last answer), latency ``p50_ms``/``p99_ms``/``mean_ms`` and ``mean_batch``.
    """
    from ..engine.virtual import simulate
    from ..strategies import Limits, make_strategy

    rows = []
    for rate in rates:
        arrivals = np.cumsum(np.random.default_rng([seed, round(rate * 1000)]).exponential(1 / rate, n))
        for name in strategies:
            run = simulate(make_strategy(name, Limits(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)),
                           arrivals.tolist(), cost_ms)
            end_s = max(b.dispatched_s + b.compute_ms / 1000 for b in run.batches)
            lat = np.asarray(run.latencies_ms)
            rows.append({"label": name, "rate": float(rate), "throughput_rps": n / (end_s - arrivals[0]),
                         "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                         "mean_ms": float(lat.mean()), "mean_batch": float(np.mean(run.sizes))})
    return pd.DataFrame(rows)


def md1_replay_ms(records: pd.DataFrame, service_ms: float | Sequence[float]) -> np.ndarray:
    """The latency each request of a naive run would have had on an exact single-server queue.

    The run's own scheduled send times are replayed through the ``naive`` rule on a virtual
    clock, each request served in ``service_ms`` (one number: M/D/1; one per request, in
    schedule order: that request's own service time): the queueing of *these* arrivals
    with no noise, to hold the measurement against (the Pollaczek-Khinchine mean averages
    over all arrival sequences; one run of a few hundred requests can sit well off it).
    Rows in the order of ``scheduled_s``; warm-up rows included.
    """
    from ..engine.virtual import simulate
    from ..strategies import make_strategy

    scheduled = np.sort(records["scheduled_s"].to_numpy(dtype=float))
    costs = iter(np.broadcast_to(np.asarray(service_ms, dtype=float), scheduled.shape).tolist())
    return np.asarray(simulate(make_strategy("naive"), scheduled.tolist(), lambda n: next(costs)).latencies_ms)


def sim_frames(runs: Mapping[str, SimRun], arrivals_s: Sequence[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Virtual-clock runs as two frames: ``(batches, items)``.

    ``batches`` has ``label, batch_id, size, dispatch, start_s, end_s, compute_ms``
    (what ``plots.batch_gantt`` draws); ``items`` has ``label, arrival_s,
    latency_ms, batch_id``, one row per arrival. Items leave in arrival order (one
    FIFO queue), so the k-th latency belongs to the k-th arrival.
    """
    arrivals = np.sort(np.asarray(arrivals_s, dtype=float))
    batch_rows, item_rows = [], []
    for label, run in runs.items():
        ids = np.repeat([b.batch_id for b in run.batches], [b.size for b in run.batches])
        for b in run.batches:
            batch_rows.append({"label": label, "batch_id": b.batch_id, "size": b.size, "dispatch": b.reason,
                               "start_s": b.dispatched_s, "end_s": b.dispatched_s + b.compute_ms / 1000,
                               "compute_ms": b.compute_ms})
        item_rows.append(pd.DataFrame({"label": label, "arrival_s": arrivals[: len(run.latencies_ms)],
                                       "latency_ms": run.latencies_ms, "batch_id": ids}))
    return pd.DataFrame(batch_rows), pd.concat(item_rows, ignore_index=True)
