"""Load-test records in: stacking runs, the rows every figure counts, batches and phases.

Input is the load generator's per-request frame (one row per request: ``i``,
``scheduled_s``, ``sent_s``, ``done_s``, ``status``, ``error``, ``latency_ms``,
``send_latency_ms``, ``late_ms``, ``warmup``, ``input_chars`` and the server's
split ``queue_ms``, ``compute_ms``, ``batch_size``, ``batch_id``, ``dispatch``,
``server_ms``, ``request_id``, NaN where a server sent none; see
``labserver.load.results``). Several runs live in one frame told apart by ``label``
and offered ``rate`` columns (``combine``).

One definition of each thing every figure uses: ``measured`` (all but warm-up),
``ok`` (a 2xx answer with no error: a stream that broke off after its 200 is not ok),
``window_s`` (the denominator of every rate).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["RUN_KEYS", "batch_size_counts", "batches", "combine", "measured", "ok", "request_phases", "run_keys",
           "unpack", "window_s"]

RUN_KEYS = ("label", "rate")  # the columns that tell runs apart in a combined frame


# ---------------------------------------------------------------- records in


def unpack(run: Any) -> tuple[pd.DataFrame, dict]:
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
        frame, meta = unpack(run)
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


def ok(rows: pd.DataFrame) -> pd.Series:
    """Which rows are answers: a 2xx status and no error (a generation's stream can break after its 200)."""
    answered = rows["status"].between(200, 299)
    return answered & rows["error"].fillna("").eq("") if "error" in rows.columns else answered


def run_keys(records: pd.DataFrame) -> list[str]:
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


def dispatch_estimate_s(rows: pd.DataFrame) -> pd.Series:
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
    keys = [batched[key] for key in run_keys(rows)] + [batched["batch_id"]]
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
    ``dispatch_estimate_s``) and ``end_s = start_s + compute_ms``. Sorted by
    ``start_s``; empty when the server sent no batch ids.
    """
    rows = measured(records).reset_index(drop=True)  # the estimate below joins on the index
    keys = run_keys(rows)
    columns = [*keys, "batch_id", "size", "seen", "dispatch", "compute_ms", "start_s", "end_s"]
    if "batch_id" not in rows.columns or rows["batch_id"].isna().all():
        return pd.DataFrame(columns=columns)
    rows = rows[rows["batch_id"].notna()].assign(_start_s=dispatch_estimate_s(rows))
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
    out = rows[[*run_keys(rows), "i", "scheduled_s", "sent_s", "done_s", "status"]].copy()
    if "queue_ms" not in rows.columns:
        for name in ("enqueue_s", "dispatch_s", "compute_end_s"):
            out[name] = np.nan
    else:
        # clipped to done_s: the headers are estimates and must not draw past the answer
        dispatch_s = np.minimum(dispatch_estimate_s(rows), rows["done_s"])
        out["enqueue_s"] = np.maximum(dispatch_s - rows["queue_ms"] / 1000.0, rows["sent_s"])
        out["dispatch_s"] = dispatch_s
        out["compute_end_s"] = np.minimum(dispatch_s + rows["compute_ms"] / 1000.0, rows["done_s"])
    order = ["scheduled_s", "sent_s", "enqueue_s", "dispatch_s", "compute_end_s", "done_s", "status"]
    return out[[*run_keys(rows), "i", *order]].reset_index(drop=True)
