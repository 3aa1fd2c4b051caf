"""Summaries of generation runs: time to first token, time per output token, inter-token
gaps, token throughput and goodput under TTFT/TPOT SLOs.

The definitions are those of vLLM's serving benchmark, measured from the *scheduled*
send (see ``labserver.load.results`` for the columns): TTFT per request, TPOT per
request ``(e2e - ttft) / (output tokens - 1)``, ITL every gap between two token
events of one request, pooled over requests; a request is good when its TTFT and
its TPOT are within their SLOs (a request of one token has no TPOT and cannot miss
that one), and goodput is good requests per second of window. Percentiles follow
``labserver.analysis.summary``: answers only (2xx, no error), numpy's ``"linear"``.

``labserver.analysis.summary`` calls ``gen_summary`` when records have generation
columns; this module holds the arithmetic and nothing of HTTP or plotting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["GEN_PERCENTILES", "combine_tokens", "decode_calls", "gen_summary", "has_generation", "itl_ms",
           "tokens_of_run"]

GEN_PERCENTILES: dict[str, tuple[float, ...]] = {"ttft": (50.0, 90.0, 99.0), "tpot": (50.0, 99.0),
                                                 "itl": (50.0, 99.0)}
_METHOD = "linear"  # as summary.PERCENTILE_METHOD


def decode_calls(steps: pd.DataFrame) -> pd.DataFrame:
    """The decode steps of a step log (``StepEngine.step_log``, ``GenSimRun.frames``): the calls in which every
    sequence computed one token of its answer (no prompt, no piece of one)."""
    def count(v: Any) -> int:
        return len(v.split()) if isinstance(v, str) else len(v)

    if steps.empty:
        return steps
    return steps[steps["decoding"].map(count) == steps["seqs"].map(count)]


def has_generation(records: pd.DataFrame) -> bool:
    """Whether these records come from a generation run (any ``n_tokens`` recorded)."""
    return "n_tokens" in records.columns and bool(records["n_tokens"].notna().any())


def itl_ms(tokens: pd.DataFrame, ids: Iterable[int] | None = None) -> np.ndarray:
    """Every inter-token gap (ms) of the requests ``ids`` (default all), pooled.

    Token events that came in one socket read share a time, so a gap of 0 means
    "arrived together", not "made together".
    """
    if ids is not None:
        tokens = tokens[tokens["i"].isin(pd.Index(ids))]
    tokens = tokens.sort_values(["i", "k"], kind="stable")
    return (tokens.groupby("i", sort=False)["t_s"].diff().dropna() * 1e3).to_numpy(dtype=float)


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q, method=_METHOD)) if values.size else math.nan


def gen_summary(rows: pd.DataFrame, ok: pd.DataFrame, window_s: float, *, tokens: pd.DataFrame | None = None,
                ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> dict[str, Any]:
    """The generation entries of one run's summary.

    ``rows`` are its measured requests, ``ok`` those answered without error (2xx),
    ``window_s`` the denominator of every rate; ``tokens`` (optional) its tokens frame.

    Entries: ``ttft_p50_ms`` ``ttft_p90_ms`` ``ttft_p99_ms``; ``tpot_p50_ms``
    ``tpot_p99_ms``; ``itl_p50_ms`` ``itl_p99_ms`` (only with ``tokens``);
    ``output_tokens`` (sum of ``n_tokens`` over ``ok``), ``token_throughput_tps``
    (those per second of window), ``mean_tokens_per_s_per_request`` (the mean of
    each request's ``n_tokens`` over its latency from the schedule); ``ttft_slo_ms``,
    ``tpot_slo_ms`` and ``gen_goodput_rps`` (NaN unless an SLO is given).
    """
    out: dict[str, Any] = {}
    ttft = ok["ttft_ms"].dropna().to_numpy(dtype=float)
    tpot = ok["tpot_ms"].dropna().to_numpy(dtype=float)
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in GEN_PERCENTILES[name]:
            out[f"{name}_p{q:g}_ms"] = _percentile(values, q)
    if tokens is not None:
        gaps = itl_ms(tokens, ok["i"])
        for q in GEN_PERCENTILES["itl"]:
            out[f"itl_p{q:g}_ms"] = _percentile(gaps, q)

    n_tokens = ok["n_tokens"].fillna(0).to_numpy(dtype=float)
    out["output_tokens"] = int(n_tokens.sum())
    rate_ok = bool(window_s > 0)  # False for NaN too
    out["token_throughput_tps"] = n_tokens.sum() / window_s if rate_ok else math.nan
    latency_s = ok["latency_ms"].to_numpy(dtype=float) / 1e3
    keep = (n_tokens > 0) & (latency_s > 0)
    out["mean_tokens_per_s_per_request"] = float((n_tokens[keep] / latency_s[keep]).mean()) if keep.any() else math.nan

    out["ttft_slo_ms"] = math.nan if ttft_slo_ms is None else float(ttft_slo_ms)
    out["tpot_slo_ms"] = math.nan if tpot_slo_ms is None else float(tpot_slo_ms)
    if (ttft_slo_ms is None and tpot_slo_ms is None) or not rate_ok:
        out["gen_goodput_rps"] = math.nan
    else:
        good = np.ones(len(ok), dtype=bool)
        if ttft_slo_ms is not None:
            good &= (ok["ttft_ms"] <= ttft_slo_ms).to_numpy(dtype=bool)  # NaN: no first token, not good
        if tpot_slo_ms is not None:
            good &= (ok["tpot_ms"].isna() | (ok["tpot_ms"] <= tpot_slo_ms)).to_numpy(dtype=bool)
        out["gen_goodput_rps"] = int(good.sum()) / window_s
    return out


def tokens_of_run(tokens: pd.DataFrame | None, keys: Sequence[str], key: Any, n_runs: int) -> pd.DataFrame | None:
    """The rows of a combined tokens frame that belong to the run ``key`` (values of ``keys``)."""
    if tokens is None or not keys:
        return tokens
    key = key if isinstance(key, tuple) else (key,)
    missing = [k for k in keys if k not in tokens.columns]
    if missing:
        if n_runs == 1:
            return tokens
        raise ValueError(f"the tokens frame has no {missing} column(s) to tell these {n_runs} runs apart; "
                         "stack the runs' tokens with combine_tokens, as the records with combine")
    mask = np.ones(len(tokens), dtype=bool)
    for k, value in zip(keys, key):
        column = tokens[k]
        mask &= (column.isna() if pd.isna(value) else column == value).to_numpy(dtype=bool)
    return tokens[mask]


def combine_tokens(runs: Mapping[str, Any] | Iterable[tuple[str, float | None, Any]]) -> pd.DataFrame:
    """Stack several runs' tokens frames with ``label`` and ``rate`` columns, as
    ``analysis.combine`` stacks their records (same arguments; a run is a LoadResult
    or anything with ``.tokens`` and ``.meta``)."""
    items = [(label, None, run) for label, run in runs.items()] if isinstance(runs, Mapping) else list(runs)
    frames = []
    for label, rate, run in items:
        if rate is None:
            rate = (getattr(run, "meta", None) or {}).get("target_rate")
        frames.append(run.tokens.assign(label=label, rate=np.nan if rate is None else float(rate)))
    if not frames:
        return pd.DataFrame(columns=["i", "k", "t_s", "label", "rate"])
    return pd.concat(frames, ignore_index=True)
