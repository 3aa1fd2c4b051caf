"""Summaries of load-test records: percentiles, throughput, goodput, batches, sweeps.

Input is the load generator's per-request frame (one row per request: ``i``,
``scheduled_s``, ``sent_s``, ``done_s``, ``status``, ``error``, ``latency_ms``,
``send_latency_ms``, ``late_ms``, ``warmup``, ``input_chars`` and the server's
split ``queue_ms``, ``compute_ms``, ``batch_size``, ``batch_id``, ``dispatch``,
``server_ms``, ``request_id``, NaN where a server sent none). Several runs live in
one frame told apart by ``label`` and offered ``rate`` columns (``combine``).
Generation runs add TTFT/TPOT/ITL columns, summarised by ``labserver.genanalysis``.

Conventions, the same in every function:

* warm-up rows (``warmup`` true) are left out of everything;
* latency means ``latency_ms``, measured from the *scheduled* send time, so a
  client that fell behind cannot hide the server's queueing (no coordinated
  omission); percentiles are over successful (2xx, no error) responses only, with
  numpy's ``"linear"`` method (the pandas ``quantile`` default, so a notebook that
  recomputes one by hand gets the same number);
* the measured window runs from the first scheduled send to the last completion,
  so requests still draining after the sender stopped count against the time
  they took (see ``window_s``).

Queueing-theory predictions live in ``labserver.theory`` and are re-exported
here. Nothing in this module knows of HTTP or matplotlib.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from .genanalysis import combine_tokens, gen_summary, has_generation, itl_ms, tokens_of_run
from .theory import (
    capacity_rps,
    md1_mean_response_ms,
    mg1_mean_response_ms,
    mm1_mean_response_ms,
    mm1_response_quantile_ms,
    utilization,
)

__all__ = [
    "PERCENTILES",
    "PERCENTILE_METHOD",
    "SweepResult",
    "batch_size_counts",
    "batches",
    "capacity_rps",
    "combine",
    "combine_tokens",
    "itl_ms",
    "md1_mean_response_ms",
    "measured",
    "mg1_mean_response_ms",
    "mm1_mean_response_ms",
    "mm1_response_quantile_ms",
    "request_phases",
    "summarize",
    "summarize_runs",
    "sweep",
    "utilization",
    "window_s",
]

logger = logging.getLogger(__name__)

PERCENTILES: dict[str, float] = {"p50_ms": 50.0, "p90_ms": 90.0, "p99_ms": 99.0, "p999_ms": 99.9}
PERCENTILE_METHOD = "linear"
# error columns present even when zero, so frames of different runs line up
ALWAYS_COUNTED = (500, 503, 504)
RUN_KEYS = ("label", "rate")  # the columns that tell runs apart in a combined frame


# ---------------------------------------------------------------- records in


def _unpack(run: Any) -> tuple[pd.DataFrame, dict]:
    """A run as the load generator may hand it over: a frame, ``(frame, meta)``, or
    an object with ``.records`` (and ``.meta``)."""
    if isinstance(run, pd.DataFrame):
        return run, {}
    if isinstance(run, tuple) and len(run) == 2 and isinstance(run[0], pd.DataFrame):
        return run[0], dict(run[1] or {})
    if isinstance(getattr(run, "records", None), pd.DataFrame):
        return run.records, dict(getattr(run, "meta", None) or {})
    raise TypeError(f"expected a records DataFrame, (frame, meta) or an object with .records, got {type(run).__name__}")


def combine(runs: Mapping[str, Any] | Iterable[tuple[str, float | None, Any]]) -> pd.DataFrame:
    """Stack several runs into one frame with ``label`` and ``rate`` columns.

    ``runs`` is ``{label: run}`` or ``[(label, rate, run), ...]``; a run is a
    frame, ``(frame, meta)`` or an object with ``.records``. A missing rate is
    taken from ``meta["target_rate"]``, else kept from a ``rate`` column the frame
    already has (a combined sweep), else NaN (closed loop).
    """
    items = [(label, None, run) for label, run in runs.items()] if isinstance(runs, Mapping) else list(runs)
    frames = []
    for label, rate, run in items:
        frame, meta = _unpack(run)
        if rate is None:
            rate = meta.get("target_rate")
        if rate is None and "rate" in frame.columns:
            frames.append(frame.assign(label=label))
        else:
            frames.append(frame.assign(label=label, rate=np.nan if rate is None else float(rate)))
    if not frames:
        return pd.DataFrame(columns=list(RUN_KEYS))
    return pd.concat(frames, ignore_index=True)


def measured(records: pd.DataFrame) -> pd.DataFrame:
    """The rows every summary counts: all but warm-up."""
    if "warmup" not in records.columns:
        return records
    return records[~records["warmup"].eq(True)]


def _ok(rows: pd.DataFrame) -> pd.Series:
    ok = rows["status"].between(200, 299)  # and no error: a generation's stream can break after its 200
    return ok & rows["error"].fillna("").eq("") if "error" in rows.columns else ok


def _run_keys(records: pd.DataFrame) -> list[str]:
    return [key for key in RUN_KEYS if key in records.columns]


def window_s(records: pd.DataFrame, duration_s: float | None = None) -> float:
    """Length of the measured window in seconds, the denominator of every rate.

    ``duration_s`` when given; otherwise from the first scheduled send to the last
    completion (``done_s``) of the non-warm-up rows. Ending at the last completion
    rather than the last send keeps an overloaded server honest: the backlog it
    drains after the sender stops is time it spent, so throughput comes out at
    what it can really sustain instead of the offered rate.
    """
    if duration_s is not None:
        return float(duration_s)
    rows = measured(records)
    if rows.empty:
        return math.nan
    end = rows["done_s"].max()
    if pd.isna(end):  # nothing completed: fall back to the sending span
        end = rows["scheduled_s"].max()
    span = float(end - rows["scheduled_s"].min())
    return span if span > 0 else math.nan


# ---------------------------------------------------------------- batches


def _dispatch_estimate_s(rows: pd.DataFrame) -> pd.Series:
    """When each request's batch left the queue, in the client's clock (s).

    Per request ``sent_s + queue_ms`` falls short of the true dispatch by the
    request's transit and parse time (queue_ms starts at enqueue on the server),
    so within one batch the latest estimate is the closest: all of the batch
    share it. Requests without a batch id keep their own estimate.
    """
    own = rows["sent_s"] + rows["queue_ms"] / 1000.0
    if "batch_id" not in rows.columns or rows["batch_id"].isna().all():
        return own
    has_batch = rows["batch_id"].notna().to_numpy()
    batched = rows[has_batch]
    keys = [batched[key] for key in _run_keys(rows)] + [batched["batch_id"]]
    # dropna=False: a closed-loop run's rate is NaN and must still group
    shared = own[has_batch].groupby(keys, dropna=False).transform("max")
    values = own.to_numpy(dtype=float, copy=True)
    values[has_batch] = shared.to_numpy(dtype=float)
    return pd.Series(values, index=rows.index)


def batches(records: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct batch seen in (non-warm-up) records.

    Columns: the run keys present (``label``, ``rate``), ``batch_id``, ``size``
    (the server's batch size header), ``seen`` (how many of its requests these
    records hold; fewer than ``size`` when other clients shared the batch),
    ``dispatch`` (reason), ``compute_ms``, ``start_s`` (dispatch estimate, see
    ``_dispatch_estimate_s``) and ``end_s = start_s + compute_ms``. Sorted by
    ``start_s``; empty when the server sent no batch ids.
    """
    rows = measured(records).reset_index(drop=True)  # the estimate below joins on the index
    keys = _run_keys(rows)
    columns = [*keys, "batch_id", "size", "seen", "dispatch", "compute_ms", "start_s", "end_s"]
    if "batch_id" not in rows.columns or rows["batch_id"].isna().all():
        return pd.DataFrame(columns=columns)
    rows = rows[rows["batch_id"].notna()].assign(_start_s=_dispatch_estimate_s(rows))
    table = rows.groupby([*keys, "batch_id"], sort=False, dropna=False).agg(
        size=("batch_size", "max"),
        seen=("batch_id", "size"),
        dispatch=("dispatch", "first"),
        compute_ms=("compute_ms", "max"),
        start_s=("_start_s", "max"),
    )
    table = table.reset_index()
    table["end_s"] = table["start_s"] + table["compute_ms"] / 1000.0
    return table[columns].sort_values("start_s", kind="stable", ignore_index=True)


def batch_size_counts(records: pd.DataFrame) -> pd.Series:
    """Number of batches of each size (index: size, int), each batch counted once.

    With batch ids each distinct batch counts once. Without them (an older or
    foreign server) the count is estimated as ``requests of size s / s``: exact
    when these records hold every request of every batch.
    """
    rows = measured(records)
    if "batch_size" not in rows.columns or rows["batch_size"].isna().all():
        return pd.Series(dtype="int64", name="batches")
    if "batch_id" in rows.columns and rows["batch_id"].notna().any():
        sizes = batches(rows)["size"].dropna()
        counts = sizes.astype("int64").value_counts()
    else:
        per_request = rows["batch_size"].dropna().astype("int64").value_counts()
        counts = (per_request / per_request.index).round().astype("int64")
    counts = counts.sort_index()
    counts.index.name = "size"
    return counts.rename("batches")


def request_phases(records: pd.DataFrame) -> pd.DataFrame:
    """Each request's life as time stamps in the client's clock (s), for timelines.

    Columns: ``i`` (and run keys), ``scheduled_s``, ``sent_s``, ``enqueue_s``,
    ``dispatch_s``, ``compute_end_s``, ``done_s``, ``status``. Between them: late
    send, transit and parsing, queue wait, compute, the way back. The server-side
    stamps are NaN without the server's headers. One clock cannot split network
    time between the way there and back: the dispatch estimate puts all of it on
    the way back for the last request to reach its batch.
    """
    rows = measured(records).reset_index(drop=True)
    out = rows[[*_run_keys(rows), "i", "scheduled_s", "sent_s", "done_s", "status"]].copy()
    if "queue_ms" not in rows.columns:
        for name in ("enqueue_s", "dispatch_s", "compute_end_s"):
            out[name] = np.nan
    else:
        # clipped to done_s: the headers are estimates and must not draw past the answer
        dispatch_s = np.minimum(_dispatch_estimate_s(rows), rows["done_s"])
        out["enqueue_s"] = np.maximum(dispatch_s - rows["queue_ms"] / 1000.0, rows["sent_s"])
        out["dispatch_s"] = dispatch_s
        out["compute_end_s"] = np.minimum(dispatch_s + rows["compute_ms"] / 1000.0, rows["done_s"])
    order = ["scheduled_s", "sent_s", "enqueue_s", "dispatch_s", "compute_end_s", "done_s", "status"]
    return out[[*_run_keys(rows), "i", *order]].reset_index(drop=True)


# ---------------------------------------------------------------- summaries


def _summary(records: pd.DataFrame, slo_ms: float | None, duration_s: float | None, late_threshold_ms: float,
             gen: Mapping[str, Any] | None = None) -> dict:
    rows = measured(records)
    ok = rows[_ok(rows)]
    count, n_ok = len(rows), len(ok)
    window = window_s(rows, duration_s)
    out: dict[str, Any] = {"count": count, "n_ok": n_ok, "window_s": window}
    out["throughput_rps"] = n_ok / window if window > 0 else math.nan

    latency = ok["latency_ms"].dropna().to_numpy(dtype=float)
    for name, q in PERCENTILES.items():
        out[name] = float(np.percentile(latency, q, method=PERCENTILE_METHOD)) if latency.size else math.nan
    out["mean_ms"] = float(latency.mean()) if latency.size else math.nan
    out["max_ms"] = float(latency.max()) if latency.size else math.nan

    failed = rows.loc[~_ok(rows), "status"].fillna(0).astype("int64")
    failed = failed.where(~failed.between(200, 299), 0)  # a 2xx that broke off: no (whole) answer
    out["error_frac"] = (count - n_ok) / count if count else math.nan
    out["n_err"] = int((failed == 0).sum())  # no HTTP response at all
    for status in sorted({*ALWAYS_COUNTED, *failed[failed != 0].unique().tolist()}):
        out[f"n_{status}"] = int((failed == status).sum())

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
        values = ok[column].dropna() if column in ok.columns else ()
        out[f"mean_{column}"] = float(values.mean()) if len(values) else math.nan

    late = rows["late_ms"].dropna() if "late_ms" in rows.columns else pd.Series(dtype=float)
    out["late_frac"] = float((late > late_threshold_ms).mean()) if len(late) else math.nan
    out["max_late_ms"] = float(late.max()) if len(late) else math.nan
    if has_generation(rows):
        out.update(gen_summary(rows, ok, window, **(gen or {})))
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
    ``p99_ms`` ``p999_ms`` ``mean_ms`` ``max_ms`` (2xx latency); ``error_frac``
    (non-2xx share), ``n_err`` (no response), ``n_<status>`` (always 500, 503,
    504, and any other seen); ``slo_ms``, ``goodput_rps``; ``n_batches``,
    ``mean_batch_size``, ``max_batch_size`` (each batch once),
    ``dispatch_<reason>`` (batches per reason); ``mean_queue_ms``,
    ``mean_compute_ms``, ``mean_server_ms`` (over 2xx requests); ``late_frac``,
    ``max_late_ms`` (the load generator falling behind its schedule). Generation
    records add ``gen_summary``'s entries (ITL from ``tokens``, the run's tokens
    frame; ``gen_goodput_rps`` under ``ttft_slo_ms`` and/or ``tpot_slo_ms``).
    """
    gen = dict(tokens=tokens, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)
    out = _summary(records, slo_ms, duration_s, late_threshold_ms, gen)
    if meta is not None:
        target = meta.get("target_rate")
        offered = math.nan if target is None else float(target)
        out = {"offered_rps": offered, "concurrency": meta.get("concurrency"), **out}
    return pd.Series(out, name="summary")


def _tidy_counts(table: pd.DataFrame) -> pd.DataFrame:
    """Zero-fill the counts only some runs have and keep each kind together, sorted."""
    statuses = sorted((c for c in table.columns if re.fullmatch(r"n_\d+", c)), key=lambda c: int(c[2:]))
    reasons = sorted(c for c in table.columns if c.startswith("dispatch_"))
    for column in statuses + reasons:
        table[column] = table[column].fillna(0).astype("int64")
    rest = [c for c in table.columns if c not in statuses and c not in reasons]
    at_errors, at_batches = rest.index("n_err") + 1, rest.index("max_batch_size") + 1
    return table[rest[:at_errors] + statuses + rest[at_errors:at_batches] + reasons + rest[at_batches:]]


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
        return _tidy_counts(pd.DataFrame([_summary(records, slo_ms, duration_s, late_threshold_ms, gen)]))
    groups = records.groupby(keys, sort=False, dropna=False)
    table = pd.DataFrame(
        [
            {**dict(zip(keys, key)), **_summary(group, slo_ms, duration_s, late_threshold_ms,
                                                dict(tokens=tokens_of_run(tokens, keys, key, groups.ngroups), **slos))}
            for key, group in groups
        ]
    )
    table = _tidy_counts(table)
    if "rate" in keys:
        table = table.sort_values("rate", kind="stable")
    if "label" in keys:
        order = {label: n for n, label in enumerate(pd.unique(records["label"]))}
        table = table.sort_values("label", key=lambda s: s.map(order), kind="stable")
    return table.reset_index(drop=True)


# ---------------------------------------------------------------- sweeps (their own module)

from .sweep import SweepResult, sweep  # noqa: E402  (sweep builds on the summaries above)
