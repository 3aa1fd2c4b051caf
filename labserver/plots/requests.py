"""Pictures of requests: latency distributions, latency against load, where each request's time went.

Drawn over the load generator's records (``labserver.analysis`` frames); the manners of
``labserver.plots.common`` (``ax=None`` in, the Axes out, no global state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from .. import analysis
from .common import Records, get_ax, empty, frame_of, label_colors, label_groups, legend, ok_values, one_run, plain_log_ticks

__all__ = ["latency_cdf", "latency_over_time", "latency_vs_throughput", "loop_lag", "request_timeline",
           "theory_vs_measured"]

logger = logging.getLogger(__name__)

MARKERS = {50.0: "o", 90.0: "s", 99.0: "v", 99.9: "D"}  # percentile marks on the CDF
# request timeline: (phase, start column, end column, colour)
PHASES = [
    ("late send", "scheduled_s", "sent_s", "0.55"),
    ("send + parse", "sent_s", "enqueue_s", "0.85"),
    ("queue", "enqueue_s", "dispatch_s", "tab:orange"),
    ("compute", "dispatch_s", "compute_end_s", "tab:blue"),
    ("reply", "compute_end_s", "done_s", "0.85"),
]


def latency_cdf(
    records: Records,
    ax: Axes | None = None,
    *,
    by: str | None = "label",
    marks: Sequence[float] = (50.0, 99.0),
    tail: bool = False,
    column: str = "latency_ms",
) -> Axes:
    """Cumulative distribution of the latency of answers (2xx, no error), one line per label, log-scaled ms.

    ``marks`` puts a marker at those percentiles (same method as the summaries); a tail mark
    (p90 and up) is drawn only where enough answers back it (``analysis.trust``).
    With ``tail=True`` the y axis shows the fraction *slower* than x on a log
    scale instead, which spreads out the p99–p99.9 region a linear CDF squashes.
    ``column`` names another ms column to draw (``labserver.plots.tokens`` draws
    ``ttft_ms`` and ``tpot_ms`` this way, then relabels the axes).
    """
    ax = get_ax(ax)
    groups = label_groups(frame_of(records), by)
    colors = label_colors([label for label, _ in groups])
    drawn: set[float] = set()
    for label, rows in groups:
        latency = ok_values(rows, column)
        if latency.size == 0:
            continue
        below = np.arange(1, latency.size + 1) / latency.size
        x, y = (latency[:-1], 1.0 - below[:-1]) if tail else (latency, below)  # 1 − F hits 0 at the end
        name = "_nolegend_" if label is None else str(label)
        ax.plot(x, y, drawstyle="steps-post", color=colors[label], label=name)
        for q in marks:
            if q >= 90 and not analysis.enough(q, latency.size):
                continue  # a tail mark from too few answers would be one or two requests
            value = np.percentile(latency, q, method=analysis.PERCENTILE_METHOD)
            y_mark = 1.0 - q / 100.0 if tail else q / 100.0
            drawn.add(q)
            ax.scatter([value], [y_mark], marker=MARKERS.get(q, "o"), color=colors[label], edgecolor="black", zorder=3)
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    if tail:
        ax.set_yscale("log")
        ax.set_ylabel("fraction of answers slower")
    else:
        ax.set_ylim(0.0, 1.02)
        ax.set_ylabel("fraction of answers")
    ax.set_xlabel("latency from scheduled send (ms, log scale)")
    ax.set_title("Latency distribution")
    ax.grid(True, which="major", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    # marks in black, once, however many labels share them
    handles += [Line2D([], [], linestyle="", marker=MARKERS.get(q, "o"), color="0.3") for q in marks if q in drawn]
    names += [f"p{q:g}" for q in marks if q in drawn]
    if handles:
        ax.legend(handles, names, loc="lower right" if not tail else "lower left", fontsize="small")
    return ax


def latency_vs_throughput(
    data: Records,
    ax: Axes | None = None,
    *,
    slo_ms: float | None = None,
    by: str | None = "label",
    annotate_rates: bool = True,
) -> Axes:
    """p99 (solid) and p50 (dashed) latency against achieved throughput, one colour per label.

    ``data`` is a ``summarize_runs`` frame, or records to summarise. Each marker
    is one offered rate (annotated with it): where the line turns upward the
    server has reached what it can sustain, and more offered load only queues.
    """
    ax = get_ax(ax)
    frame = frame_of(data)
    table = analysis.trusted(frame if "p99_ms" in frame.columns else analysis.summarize_runs(frame, slo_ms=slo_ms))
    groups = label_groups(table, by)
    colors = label_colors([label for label, _ in groups])
    for label, rows in groups:
        rows = rows[rows["n_ok"] > 0]
        rows = rows.sort_values("rate") if "rate" in rows.columns else rows
        prefix = "" if label is None else f"{label} "
        x = rows["throughput_rps"].to_numpy(dtype=float)
        ax.plot(x, rows["p99_ms"], "-o", color=colors[label], label=f"{prefix}p99")
        ax.plot(x, rows["p50_ms"], "--", marker="o", markerfacecolor="white", color=colors[label], label=f"{prefix}p50")
        if annotate_rates and "rate" in rows.columns:
            for x_rps, y_ms, rate in zip(x, rows["p99_ms"], rows["rate"]):
                if pd.notna(rate):
                    ax.annotate(f"{rate:g}/s", (x_rps, y_ms), xytext=(3, 3), textcoords="offset points",
                                fontsize="x-small", color="0.35")
    if slo_ms is not None:
        ax.axhline(slo_ms, color="0.3", linestyle=":", label=f"SLO {slo_ms:g} ms")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("achieved throughput (answers/s)")
    ax.set_ylabel("latency from scheduled send (ms, log scale)")
    ax.set_title("Latency vs throughput (labels: offered rate)" if annotate_rates else "Latency vs throughput")
    ax.grid(True, which="major", alpha=0.3)
    legend(ax, fontsize="small")
    return ax


def request_timeline(
    records: Records,
    ax: Axes | None = None,
    *,
    n: int = 40,
    start: int = 0,
    label: Any = None,
    rate: float | None = None,
) -> Axes:
    """Where each request's time went, one horizontal bar per request in schedule order.

    Segments: late send (the client's own delay), send + parse, queue wait,
    compute, reply. Shows requests ``start`` to ``start + n`` of one run (the
    first label and rate unless given). Requests without the server's headers get
    one grey bar; failed ones a red cross at their end.
    """
    ax = get_ax(ax)
    run = one_run(frame_of(records), label, rate)
    phases = analysis.request_phases(run).sort_values("scheduled_s", kind="stable")
    phases = phases.iloc[start : start + n].reset_index(drop=True)
    if phases.empty:
        return empty(ax, "no requests to show")
    y = phases.index.to_numpy()
    split = phases["dispatch_s"].notna().to_numpy()
    for name, begin, end, color in PHASES:
        width = (phases[end] - phases[begin]).to_numpy(dtype=float)
        keep = split & np.isfinite(width) & (width > 0)
        if keep.any():
            ax.barh(y[keep], width[keep], left=phases[begin].to_numpy(dtype=float)[keep], height=0.8,
                    color=color, label=name)
    total = (phases["done_s"] - phases["scheduled_s"]).to_numpy(dtype=float)
    keep = ~split & np.isfinite(total)
    if keep.any():
        ax.barh(y[keep], total[keep], left=phases["scheduled_s"].to_numpy(dtype=float)[keep], height=0.8,
                color="0.7", hatch="//", label="total (no server split)")
    failed = ~phases["status"].between(200, 299).to_numpy()
    if failed.any():
        end = phases["done_s"].fillna(phases["scheduled_s"]).to_numpy(dtype=float)
        ax.scatter(end[failed], y[failed], marker="x", color="tab:red", zorder=3, label="failed")
    ax.set_ylim(y.max() + 0.6, -0.6)  # earliest request on top
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("request (schedule order)")
    ax.set_title("Where each request's time went")
    legend(ax, fontsize="small", loc="lower left")
    return ax


def loop_lag(
    lag: Records,
    ax: Axes | None = None,
    *,
    probes: pd.DataFrame | None = None,
    by: str | None = "label",
) -> Axes:
    """Event-loop lag over time (one line per label), and optionally probe latency.

    ``lag`` has ``t_s`` and ``lag_ms`` (the server's samples); ``probes`` has
    ``t_s``, ``latency_ms`` and ``status`` (a client pinging a cheap route while
    the load runs). Both are in ms on one axis: when compute blocks the loop, a
    probe waits about as long as the lag. Their ``t_s`` must share a clock.
    """
    ax = get_ax(ax)
    groups = label_groups(frame_of(lag), by)
    colors = label_colors([label for label, _ in groups])
    for label, rows in groups:
        rows = rows.sort_values("t_s")
        name = "event-loop lag" if label is None else f"{label} loop lag"
        ax.plot(rows["t_s"], rows["lag_ms"], color=colors[label], linewidth=1.0, label=name)
    if probes is not None and len(probes):
        probes = probes.sort_values("t_s")
        ok = probes["status"].between(200, 299)
        ax.plot(probes.loc[ok, "t_s"], probes.loc[ok, "latency_ms"], linestyle="none", marker=".",
                color="0.25", label="probe latency")
        if (~ok).any():
            failed_ms = probes.loc[~ok, "latency_ms"].fillna(0.0)
            ax.scatter(probes.loc[~ok, "t_s"], failed_ms, marker="x", color="tab:red", zorder=3, label="probe failed")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("delay (ms)")
    ax.set_title("Event-loop lag" if probes is None else "Event-loop lag and probe latency")
    ax.grid(True, alpha=0.3)
    legend(ax, fontsize="small")
    return ax



def theory_vs_measured(
    summary: pd.DataFrame,
    service_ms: float,
    ax: Any = None,
    *,
    cv2: float = 0.0,
    label: str = "measured",
    color: str | None = None,
    percentiles: bool = True,
    measured: bool = True,
) -> Any:
    """Measured mean latency per offered rate (dots) over the Pollaczek–Khinchine mean (line).

    ``summary`` is a ``summarize_runs`` frame with ``rate``; the line is the M/G/1
    mean time in system for ``service_ms`` and ``cv2`` (0: M/D/1), drawn up to just
    short of capacity (the dotted vertical line, 1000 / service_ms req/s). With
    ``percentiles`` the runs' p50–p99 range is drawn as a bar behind each dot;
    ``measured=False`` draws the prediction only (a second curve over the same dots).
    """
    ax = get_ax(ax)
    right = ax.get_xlim()[1] if ax.has_data() else 0.0  # a second call only widens the view
    rows = analysis.trusted(summary).sort_values("rate")
    capacity = analysis.capacity_rps(service_ms)
    top = max(float(rows["rate"].max()), 0.0)
    grid = np.linspace(0.0, min(capacity * 0.985, max(top * 1.1, capacity * 0.9)), 200)
    name = "M/D/1" if cv2 == 0 else f"M/G/1 (cv²={cv2:.2g})"
    line = ax.plot(grid, analysis.mg1_mean_response_ms(grid, service_ms, cv2), color=color,
                   linestyle="-" if measured else "--", label=f"{name} mean, D={service_ms:.3g} ms")[0]
    color = line.get_color()
    if measured and percentiles:
        ax.vlines(rows["rate"], rows["p50_ms"], rows["p99_ms"], color=color, alpha=0.3, linewidth=6,
                  label=f"{label} p50–p99")
    if measured:
        ax.plot(rows["rate"], rows["mean_ms"], "o", color=color, markeredgecolor="black", label=f"{label} mean")
    ax.axvline(capacity, color="0.4", linestyle=":", linewidth=1)
    ax.annotate(f"capacity {capacity:.3g}/s", (capacity, 0.98), xycoords=("data", "axes fraction"),
                ha="right", va="top", rotation=90, fontsize="small", color="0.35")
    ax.set_xlim(0, max(right, max(capacity, top) * 1.05))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    return ax


OUTCOMES = [  # (name, test on status, colour)
    ("200 ok", lambda s: s.between(200, 299), "tab:blue"),
    ("503 rejected", lambda s: s == 503, "tab:orange"),
    ("504 timed out", lambda s: s == 504, "tab:red"),
    ("other", lambda s: ~s.between(200, 299) & ~s.isin([503, 504]), "0.3"),
]


def latency_over_time(records: pd.DataFrame, ax: Any = None, *, logy: bool = False,
                      title: str | None = None) -> Any:
    """Each request as a dot: when it was scheduled (x) and how long its answer took (y).

    Colour is the outcome (200, 503, 504, other). A queue that grows shows as a
    rising ramp of blue; a circuit breaker as a flat band of blue with orange (503,
    answered at once) or red (504, answered at the deadline) beside it.
    """
    ax = get_ax(ax)
    rows = analysis.measured(records)
    status = rows["status"].fillna(0).astype("int64")
    for name, test, colour in OUTCOMES:
        part = rows[test(status).to_numpy()]
        if len(part):
            ax.plot(part["scheduled_s"], part["latency_ms"], ".", markersize=3, color=colour,
                    label=f"{name} ({len(part)})")
    if logy:
        ax.set_yscale("log")
        # 1-2-5 ticks in plain numbers (not 3×10²), whatever the range
        ax.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("scheduled send (s from start)")
    ax.set_ylabel("latency (ms)")
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(fontsize="small", loc="best", markerscale=3)
    return ax
