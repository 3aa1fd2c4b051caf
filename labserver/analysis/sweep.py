"""The highest offered rate that meets a latency SLO: a ramp, then bisection, over the summaries."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from .records import combine, unpack
from .summary import summary_row, tidy_counts

logger = logging.getLogger(__name__)

__all__ = ["SweepResult", "sweep"]



@dataclass
class SweepResult:
    best_rate: float | None  # highest probed rate that met the SLO, req/s; None if none did
    probes: pd.DataFrame  # one row per probe in order: step, phase, rate, passed + summary columns
    records: pd.DataFrame  # every probe's records, label "sweep" and rate of the probe


def sweep(
    run_at_rate: Callable[[float], Any],
    slo_p99_ms: float,
    start_rate: float,
    *,
    factor: float = 2.0,
    rel_tol: float = 0.05,
    max_error_frac: float = 0.01,
    max_probes: int = 20,
    min_rate: float | None = None,
    max_rate: float | None = None,
    metric: str = "p99_ms",
) -> SweepResult:
    """Find the highest offered rate whose p99 latency meets ``slo_p99_ms``.

    As perf_analyzer's binary search: from ``start_rate`` multiply the rate by
    ``factor`` while probes pass (or divide while they fail) until one passing
    and one failing rate bracket the answer, then bisect until the bracket is
    within ``rel_tol`` of the passing end. A probe passes when it got at least
    one 2xx, its p99 is within the SLO and at most ``max_error_frac`` of its
    requests failed (a server that sheds load with 503s must not pass on the few
    it answered fast). ``run_at_rate(rate)`` returns records, ``(records, meta)``
    or an object with ``.records``. Bisection assumes latency grows with load;
    noisy runs near the knee can make the answer wander by a step. ``metric`` is the
    summary entry held to the SLO: ``p99_ms`` (end to end), or for generation
    ``ttft_p99_ms`` (time to first token).
    """
    if not (start_rate > 0 and factor > 1 and rel_tol > 0 and max_probes >= 1):
        raise ValueError("sweep needs start_rate > 0, factor > 1, rel_tol > 0 and max_probes >= 1")
    summaries: list[dict] = []
    frames: list[tuple[str, float, pd.DataFrame]] = []

    def probe(rate: float, phase: str) -> bool:
        frame, meta = unpack(run_at_rate(rate))
        summary = summary_row(frame)
        if metric not in summary:
            raise ValueError(f"sweep metric {metric!r} is not in a summary of these records")
        passed = bool(
            summary["n_ok"] > 0 and summary[metric] <= slo_p99_ms and summary["error_frac"] <= max_error_frac
        )
        logger.info("sweep probe %d (%s): %.3g req/s %s %.1f ms -> %s", len(summaries) + 1, phase, rate, metric,
                    summary[metric], "pass" if passed else "fail")
        summaries.append({"step": len(summaries) + 1, "phase": phase, "rate": rate, "passed": passed, **summary})
        frames.append(("sweep", rate, frame))
        return passed

    lo = hi = None  # highest passing and lowest failing rate so far
    rate = start_rate
    while lo is None or hi is None:  # ramp: up while passing, down while failing
        if len(summaries) >= max_probes:
            break
        if probe(rate, "ramp"):
            lo = rate
            if max_rate is not None and rate >= max_rate:
                logger.info("sweep reached max_rate %.3g req/s without missing the SLO", max_rate)
                break
            rate = rate * factor if max_rate is None else min(rate * factor, max_rate)
        else:
            hi = rate
            if min_rate is not None and rate <= min_rate:
                logger.info("sweep reached min_rate %.3g req/s without meeting the SLO", min_rate)
                break
            rate = rate / factor if min_rate is None else max(rate / factor, min_rate)
    while lo is not None and hi is not None and hi - lo > rel_tol * lo and len(summaries) < max_probes:
        mid = (lo + hi) / 2.0
        if probe(mid, "bisect"):
            lo = mid
        else:
            hi = mid
    probes = tidy_counts(pd.DataFrame(summaries))
    return SweepResult(best_rate=lo, probes=probes, records=combine(frames))
