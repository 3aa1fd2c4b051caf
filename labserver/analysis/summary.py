"""One summary of a load run: one name and one formula per figure.

``summarize(records)`` (one run) and ``summarize_runs(records)`` (one row per label
and rate of a combined frame) are the only summaries: the CLI, ``compare``, the
notebooks and ``LoadResult.summary`` all print these entries. Conventions, the same
everywhere:

* warm-up rows are left out (``records.measured``);
* latency means ``latency_ms``, measured from the *scheduled* send time, so a client
  that fell behind cannot hide the server's queueing (no coordinated omission);
  percentiles are over answers only (``records.ok``), with numpy's ``"linear"``
  method (the pandas ``quantile`` default);
* every rate is per second of ``records.window_s``: from the first scheduled send to
  the last completion, so a backlog drained after the sender stopped counts.

Generation runs add the entries of ``labserver.analysis.tokens.gen_summary``.
Nothing here knows of HTTP or matplotlib.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from .records import RUN_KEYS, batch_size_counts, batches, measured, ok, window_s
from .tokens import gen_summary, has_generation, tokens_of_run
from .trust import late_matters

__all__ = ["ALWAYS_COUNTED", "PERCENTILES", "PERCENTILE_METHOD", "summarize", "summarize_runs", "summary_row",
           "tidy_counts"]

logger = logging.getLogger(__name__)

PERCENTILES: dict[str, float] = {"p50_ms": 50.0, "p90_ms": 90.0, "p99_ms": 99.0, "p999_ms": 99.9}
PERCENTILE_METHOD = "linear"
# error columns present even when zero, so frames of different runs line up
ALWAYS_COUNTED = (500, 503, 504)


def summary_row(records: pd.DataFrame, slo_ms: float | None = None, duration_s: float | None = None,
                late_threshold_ms: float = 1.0, gen: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One run's summary as a dict: the entries ``summarize`` documents (without ``meta``'s)."""
    rows = measured(records)
    answers = rows[ok(rows)]
    count, n_ok = len(rows), len(answers)
    window = window_s(rows, duration_s)
    out: dict[str, Any] = {"count": count, "n_ok": n_ok, "window_s": window}
    out["throughput_rps"] = n_ok / window if window > 0 else math.nan

    latency = answers["latency_ms"].dropna().to_numpy(dtype=float)
    for name, q in PERCENTILES.items():
        out[name] = float(np.percentile(latency, q, method=PERCENTILE_METHOD)) if latency.size else math.nan
    out["mean_ms"] = float(latency.mean()) if latency.size else math.nan
    out["max_ms"] = float(latency.max()) if latency.size else math.nan

    failed = rows.loc[~ok(rows), "status"].fillna(0).astype("int64")
    failed = failed.where(~failed.between(200, 299), 0)  # a 2xx that broke off: no (whole) answer
    out["error_frac"] = (count - n_ok) / count if count else math.nan
    out["n_err"] = int((failed == 0).sum())  # no HTTP response at all
    for status in sorted({*ALWAYS_COUNTED, *failed[failed != 0].unique().tolist()}):
        out[f"n_{status}"] = int((failed == status).sum())
    kinds = rows["error"].fillna("") if "error" in rows.columns else pd.Series(dtype=str)
    for kind, n in kinds[kinds != ""].value_counts().sort_index().items():  # client_overflow, timeout, ...
        out[f"err_{kind}"] = int(n)
    out["n_warmup"] = len(records) - count

    out["slo_ms"] = math.nan if slo_ms is None else float(slo_ms)
    if slo_ms is None or not window > 0:
        out["goodput_rps"] = math.nan
    else:
        out["goodput_rps"] = int((latency <= slo_ms).sum()) / window

    sizes = batch_size_counts(rows)
    out["n_batches"] = int(sizes.sum())
    out["mean_batch_size"] = float((sizes.index * sizes).sum() / sizes.sum()) if sizes.sum() else math.nan
    out["max_batch_size"] = int(sizes.index.max()) if len(sizes) else math.nan
    table = batches(rows)
    if not table.empty:  # each batch's reason once, like its size
        for reason, n in table["dispatch"].dropna().value_counts().sort_index().items():
            out[f"dispatch_{reason}"] = int(n)
    for column in ("queue_ms", "compute_ms", "server_ms"):
        values = answers[column].dropna() if column in answers.columns else ()
        out[f"mean_{column}"] = float(values.mean()) if len(values) else math.nan

    late = rows["late_ms"].dropna() if "late_ms" in rows.columns else pd.Series(dtype=float)
    out["late_frac"] = float((late > late_threshold_ms).mean()) if len(late) else math.nan
    out["max_late_ms"] = float(late.max()) if len(late) else math.nan
    out["late_p99_ms"] = float(np.percentile(late, 99, method=PERCENTILE_METHOD)) if len(late) else math.nan
    out["late_matters"] = bool(len(late)) and late_matters(float(late.clip(lower=0).mean()), out["p50_ms"])
    if has_generation(rows):
        out.update(gen_summary(rows, answers, window, **(gen or {})))
    return out


def summarize(
    records: pd.DataFrame,
    slo_ms: float | None = None,
    duration_s: float | None = None,
    meta: Mapping[str, Any] | None = None,
    late_threshold_ms: float = 1.0,
    *,
    tokens: pd.DataFrame | None = None,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> pd.Series:
    """One run's summary as a Series (the columns of ``summarize_runs``).

    ``slo_ms`` enables goodput (2xx answered within it, per second);
    ``duration_s`` overrides the measured window (``window_s``); ``meta`` (the
    load generator's) adds ``offered_rps`` and ``concurrency``; a request counts as
    sent late when more than ``late_threshold_ms`` behind its schedule.

    Entries: ``count`` (non-warm-up requests), ``n_ok`` (2xx), ``window_s``,
    ``throughput_rps`` (2xx per second of window); ``p50_ms`` ``p90_ms``
    ``p99_ms`` ``p999_ms`` ``mean_ms`` ``max_ms`` (latency of answers); ``error_frac``
    (share not answered), ``n_err`` (no response), ``n_<status>`` (always 500, 503,
    504, and any other seen), ``err_<kind>`` (rows by the load generator's error kind:
    ``client_overflow`` for requests it could not send, ``stream_incomplete``, ``timeout``
    ...), ``n_warmup`` (rows left out); ``slo_ms``, ``goodput_rps``; ``n_batches``,
    ``mean_batch_size``, ``max_batch_size`` (each batch once),
    ``dispatch_<reason>`` (batches per reason); ``mean_queue_ms``,
    ``mean_compute_ms``, ``mean_server_ms`` (over 2xx requests); ``late_frac``,
    ``max_late_ms``, ``late_p99_ms`` (the load generator falling behind its schedule) and
    ``late_matters`` (whether that lateness is large beside the latency measured:
    ``labserver.analysis.trust``). Generation
    records add ``gen_summary``'s entries (ITL from ``tokens``, the run's tokens
    frame; ``gen_goodput_rps`` under ``ttft_slo_ms`` and/or ``tpot_slo_ms``).
    """
    gen = dict(tokens=tokens, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    out = summary_row(records, slo_ms, duration_s, late_threshold_ms, gen)
    if meta is not None:
        target = meta.get("target_rate")
        offered = math.nan if target is None else float(target)
        out = {"offered_rps": offered, "concurrency": meta.get("concurrency"), **out}
    return pd.Series(out, name="summary")


def tidy_counts(table: pd.DataFrame) -> pd.DataFrame:
    """Zero-fill the counts only some runs have and keep each kind together, sorted."""
    statuses = sorted((c for c in table.columns if re.fullmatch(r"n_\d+", c)), key=lambda c: int(c[2:]))
    kinds = sorted(c for c in table.columns if c.startswith("err_"))
    reasons = sorted(c for c in table.columns if c.startswith("dispatch_"))
    for column in statuses + kinds + reasons:
        table[column] = table[column].fillna(0).astype("int64")
    rest = [c for c in table.columns if c not in statuses and c not in kinds and c not in reasons]
    at_errors, at_batches = rest.index("n_err") + 1, rest.index("max_batch_size") + 1
    return table[rest[:at_errors] + statuses + kinds + rest[at_errors:at_batches] + reasons + rest[at_batches:]]


def summarize_runs(
    records: pd.DataFrame,
    slo_ms: float | None = None,
    duration_s: float | None = None,
    by: Iterable[str] = RUN_KEYS,
    late_threshold_ms: float = 1.0,
    *,
    tokens: pd.DataFrame | None = None,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> pd.DataFrame:
    """One summary row per run of a combined frame, keyed by ``by`` (label, rate).

    Rows keep the labels' order of first appearance, rates ascending within a
    label. Count columns that only some runs have (``n_<status>``,
    ``dispatch_<reason>``) are zero in the others. ``tokens``, ``ttft_slo_ms``
    and ``tpot_slo_ms`` as in ``summarize``; ``tokens`` of several runs must carry
    the same keys (``combine_tokens``).
    """
    keys = [key for key in by if key in records.columns]
    slos = dict(ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    if not keys:
        gen = dict(tokens=tokens, **slos)
        return tidy_counts(pd.DataFrame([summary_row(records, slo_ms, duration_s, late_threshold_ms, gen)]))
    groups = records.groupby(keys, sort=False, dropna=False)
    table = pd.DataFrame(
        [
            {**dict(zip(keys, key)), **summary_row(group, slo_ms, duration_s, late_threshold_ms,
                                                dict(tokens=tokens_of_run(tokens, keys, key, groups.ngroups), **slos))}
            for key, group in groups
        ]
    )
    table = tidy_counts(table)
    if "rate" in keys:
        table = table.sort_values("rate", kind="stable")
    if "label" in keys:
        order = {label: n for n, label in enumerate(pd.unique(records["label"]))}
        table = table.sort_values("label", key=lambda s: s.map(order), kind="stable")
    return table.reset_index(drop=True)
