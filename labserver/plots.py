"""Matplotlib pictures of load-test results, drawn over ``labserver.analysis`` frames.

Every helper takes records (one frame with a ``label`` column, or ``{label:
frame}``) or a frame derived from them, draws into ``ax`` (a new figure when
``ax`` is None) and returns the Axes. Nothing here changes global matplotlib
state (no rcParams, no styles) and nothing here knows of servers or clients.
Runs keep one colour per label across helpers: the n-th label in order of first
appearance takes the n-th colour of the current property cycle.

``overview`` gathers the pictures in one figure for ``labserver compare``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from . import analysis

__all__ = [
    "batch_gantt",
    "batch_size_hist",
    "latency_cdf",
    "latency_vs_throughput",
    "loop_lag",
    "overview",
    "request_timeline",
]

logger = logging.getLogger(__name__)

Records = pd.DataFrame | Mapping[str, Any]  # a combined frame, or {label: frame | (frame, meta)}

MARKERS = {50.0: "o", 90.0: "s", 99.0: "v", 99.9: "D"}  # percentile marks on the CDF
# request timeline: (phase, start column, end column, colour)
PHASES = [
    ("late send", "scheduled_s", "sent_s", "0.55"),
    ("send + parse", "sent_s", "enqueue_s", "0.85"),
    ("queue", "enqueue_s", "dispatch_s", "tab:orange"),
    ("compute", "dispatch_s", "compute_end_s", "tab:blue"),
    ("reply", "compute_end_s", "done_s", "0.85"),
]


# ---------------------------------------------------------------- shared bits


def _axes(ax: Axes | None) -> Axes:
    if ax is None:
        _, ax = plt.subplots(layout="constrained")
    return ax


def _frame(records: Records) -> pd.DataFrame:
    return analysis.combine(records) if isinstance(records, Mapping) else records


def _groups(frame: pd.DataFrame, by: str | None) -> list[tuple[Any, pd.DataFrame]]:
    """``(label, rows)`` in order of first appearance; one unlabelled group without ``by``."""
    if by is None or by not in frame.columns:
        return [(None, frame)]
    return [(label, frame[frame[by] == label]) for label in pd.unique(frame[by])]


def _colors(labels: Sequence[Any]) -> dict[Any, Any]:
    # read, never set: the caller's (or notebook's) property cycle decides the colours
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return {label: cycle[n % len(cycle)] for n, label in enumerate(labels)}


def _legend(ax: Axes, **kwargs: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, **kwargs)


def _empty(ax: Axes, message: str) -> Axes:
    ax.text(0.5, 0.5, message, ha="center", va="center", color="0.4", transform=ax.transAxes)
    return ax


def _plain_log_ticks(axis: Any) -> None:
    """Label a log-scaled ms axis 10, 20, 50, 100 rather than 10¹, 2×10¹, ...

    Call after the data are drawn: a narrow range gets 1-2-5 ticks, a wide one
    (over three decades) only powers of ten, so labels never crowd.
    """
    low, high = sorted(axis.get_view_interval())
    wide = low <= 0 or high / low > 1000.0
    axis.set_major_locator(LogLocator(base=10.0, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _ok_latency(rows: pd.DataFrame, column: str = "latency_ms") -> np.ndarray:
    rows = analysis.measured(rows)
    ok = rows["status"].between(200, 299)
    return np.sort(rows.loc[ok, column].dropna().to_numpy(dtype=float))


# ---------------------------------------------------------------- latency


def latency_cdf(
    records: Records,
    ax: Axes | None = None,
    *,
    by: str | None = "label",
    marks: Sequence[float] = (50.0, 99.0),
    tail: bool = False,
    column: str = "latency_ms",
) -> Axes:
    """Cumulative distribution of 2xx latency, one line per label, log-scaled ms.

    ``marks`` puts a marker at those percentiles (same method as the summaries).
    With ``tail=True`` the y axis shows the fraction *slower* than x on a log
    scale instead, which spreads out the p99–p99.9 region a linear CDF squashes.
    ``column`` names another ms column to draw (``labserver.genplots`` draws
    ``ttft_ms`` and ``tpot_ms`` this way, then relabels the axes).
    """
    ax = _axes(ax)
    groups = _groups(_frame(records), by)
    colors = _colors([label for label, _ in groups])
    for label, rows in groups:
        latency = _ok_latency(rows, column)
        if latency.size == 0:
            continue
        below = np.arange(1, latency.size + 1) / latency.size
        x, y = (latency[:-1], 1.0 - below[:-1]) if tail else (latency, below)  # 1 − F hits 0 at the end
        name = "_nolegend_" if label is None else str(label)
        ax.plot(x, y, drawstyle="steps-post", color=colors[label], label=name)
        for q in marks:
            value = np.percentile(latency, q, method=analysis.PERCENTILE_METHOD)
            y_mark = 1.0 - q / 100.0 if tail else q / 100.0
            ax.scatter([value], [y_mark], marker=MARKERS.get(q, "o"), color=colors[label], edgecolor="black", zorder=3)
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    if tail:
        ax.set_yscale("log")
        ax.set_ylabel("fraction of 2xx requests slower")
    else:
        ax.set_ylim(0.0, 1.02)
        ax.set_ylabel("fraction of 2xx requests")
    ax.set_xlabel("latency from scheduled send (ms, log scale)")
    ax.set_title("Latency distribution")
    ax.grid(True, which="major", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    # marks in black, once, however many labels share them
    handles += [Line2D([], [], linestyle="", marker=MARKERS.get(q, "o"), color="0.3") for q in marks]
    names += [f"p{q:g}" for q in marks]
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
    ax = _axes(ax)
    frame = _frame(data)
    table = frame if "p99_ms" in frame.columns else analysis.summarize_runs(frame, slo_ms=slo_ms)
    groups = _groups(table, by)
    colors = _colors([label for label, _ in groups])
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
    _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("achieved throughput (2xx responses/s)")
    ax.set_ylabel("latency from scheduled send (ms, log scale)")
    ax.set_title("Latency vs throughput (labels: offered rate)" if annotate_rates else "Latency vs throughput")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax, fontsize="small")
    return ax


# ---------------------------------------------------------------- batches


def batch_size_hist(
    records: Records,
    ax: Axes | None = None,
    *,
    by: str | None = "label",
    weight: str = "batches",
    stacked: bool = False,
) -> Axes:
    """How many batches (``weight="batches"``) or requests (``"requests"``) had each size.

    One bar per label and size, side by side (or ``stacked``), one bin per
    integer size from 1 to the largest seen; each batch counts once.
    """
    if weight not in ("batches", "requests"):
        raise ValueError(f'weight must be "batches" or "requests", got {weight!r}')
    ax = _axes(ax)
    groups = _groups(_frame(records), by)
    colors = _colors([label for label, _ in groups])
    counts = [(label, analysis.batch_size_counts(rows)) for label, rows in groups]
    counts = [(label, c * c.index if weight == "requests" else c) for label, c in counts if len(c)]
    if not counts:
        return _empty(ax, "no batch sizes in these records")
    sizes = np.arange(1, max(int(c.index.max()) for _, c in counts) + 1)
    width = 0.8 if stacked else 0.8 / len(counts)
    bottom = np.zeros(sizes.size)
    for n, (label, c) in enumerate(counts):
        heights = c.reindex(sizes, fill_value=0).to_numpy(dtype=float)
        offset = 0.0 if stacked else (n - (len(counts) - 1) / 2) * width
        name = "_nolegend_" if label is None else str(label)
        ax.bar(sizes + offset, heights, width, bottom=bottom if stacked else None, color=colors[label], label=name)
        if stacked:
            bottom += heights
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("batch size (requests per model call)")
    ax.set_ylabel(weight)
    ax.set_title("Batch sizes")
    _legend(ax, fontsize="small")
    return ax


def _busiest_runs(frame: pd.DataFrame, rate: float | None) -> pd.DataFrame:
    """One run per label: the one offered ``rate`` where there is one, else the label's highest."""
    if "rate" not in frame.columns or frame["rate"].isna().all():
        return frame
    parts = []
    for _, rows in _groups(frame, "label"):
        chosen = rate if rate is not None and (rows["rate"] == rate).any() else rows["rate"].max()
        parts.append(rows[rows["rate"].isna()] if pd.isna(chosen) else rows[rows["rate"] == chosen])
    return pd.concat(parts)


def _one_run(frame: pd.DataFrame, label: Any, rate: float | None) -> pd.DataFrame:
    """The rows of one run: the given (or first) label, then the given (or first) rate."""
    if "label" in frame.columns and len(frame):
        frame = frame[frame["label"] == (frame["label"].iloc[0] if label is None else label)]
    if "rate" in frame.columns and len(frame):
        wanted = frame["rate"].iloc[0] if rate is None else rate
        frame = frame[frame["rate"].isna()] if pd.isna(wanted) else frame[frame["rate"] == wanted]
    return frame


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
    ax = _axes(ax)
    run = _one_run(_frame(records), label, rate)
    phases = analysis.request_phases(run).sort_values("scheduled_s", kind="stable")
    phases = phases.iloc[start : start + n].reset_index(drop=True)
    if phases.empty:
        return _empty(ax, "no requests to show")
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
    _legend(ax, fontsize="small", loc="lower left")
    return ax


def batch_gantt(
    data: Records,
    ax: Axes | None = None,
    *,
    cmap: str = "viridis",
    colorbar: bool = True,
) -> Axes:
    """Every batch as a bar over its compute time, one lane per run; height and colour by size.

    ``data`` is records or an ``analysis.batches`` frame. Gaps in a lane are an
    idle model; short, pale bars are a model working on small batches.
    """
    ax = _axes(ax)
    frame = _frame(data)
    table = frame if {"start_s", "size"} <= set(frame.columns) else analysis.batches(frame)
    table = table[table["start_s"].notna() & table["end_s"].notna() & table["size"].notna()]
    if table.empty:
        return _empty(ax, "no batch timings in these records")
    keys = [key for key in analysis.RUN_KEYS if key in table.columns and table[key].notna().any()]
    runs = list(table.groupby(keys, sort=False, dropna=False)) if keys else [((), table)]
    if keys:  # lanes by label as given, then rate ascending (the table itself is in time order)
        rank = {label: n for n, label in enumerate(pd.unique(frame["label"]))} if "label" in keys else {}
        runs.sort(key=lambda run: tuple(
            rank[k] if key == "label" else (np.inf if pd.isna(k) else k) for key, k in zip(keys, run[0])))
    largest = max(int(table["size"].max()), 2)  # a 1..1 colour scale is degenerate
    norm, colours = Normalize(vmin=1, vmax=largest), colormaps[cmap]
    names = []
    for lane, (key, rows) in enumerate(runs):
        bottom = len(runs) - 1 - lane - 0.4  # first run on top
        size = rows["size"].to_numpy(dtype=float)
        ax.barh(bottom, (rows["end_s"] - rows["start_s"]).to_numpy(dtype=float), left=rows["start_s"].to_numpy(),
                height=0.8 * size / largest, align="edge", color=colours(norm(size)), edgecolor="none")
        key = key if isinstance(key, tuple) else (key,)
        names.append(" @ ".join(f"{k:g}/s" if isinstance(k, float) else str(k) for k in key if pd.notna(k)) or "run")
    ax.set_yticks(np.arange(len(runs))[::-1], names)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("time since run start (s)")
    ax.set_title("Batches over time (height, colour: size)")
    if colorbar:
        ax.figure.colorbar(ScalarMappable(norm=norm, cmap=colours), ax=ax, label="batch size")
    return ax


# ---------------------------------------------------------------- the event loop


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
    ax = _axes(ax)
    groups = _groups(_frame(lag), by)
    colors = _colors([label for label, _ in groups])
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
    _legend(ax, fontsize="small")
    return ax


# ---------------------------------------------------------------- all together


def overview(
    records_by_label: Records,
    *,
    summary: pd.DataFrame | None = None,
    lag: Records | None = None,
    probes: pd.DataFrame | None = None,
    slo_ms: float | None = None,
    rate: float | None = None,
    n_requests: int = 40,
    title: str | None = None,
    figsize: tuple[float, float] = (15.0, 9.0),
) -> Figure:
    """One figure of the pictures above, for saving: CDF, latency vs throughput and
    batch sizes over every run; the request timeline (first label) and batch
    Gantt (every label) of the runs offered ``rate``, by default each label's
    highest rate, where queues are longest; the event-loop lag when given.

    The Figure is not registered with pyplot (nothing to close, nothing shown
    twice): save it with ``fig.savefig``, or leave it as a notebook cell's value.
    """
    frame = _frame(records_by_label)
    fig = Figure(figsize=figsize, layout="constrained")
    grid = fig.add_gridspec(2, 3)
    latency_cdf(frame, fig.add_subplot(grid[0, 0]))
    table = summary if summary is not None else analysis.summarize_runs(frame, slo_ms=slo_ms)
    latency_vs_throughput(table, fig.add_subplot(grid[0, 1]), slo_ms=slo_ms)
    batch_size_hist(frame, fig.add_subplot(grid[0, 2]))
    busiest = _busiest_runs(frame, rate)
    first = _one_run(busiest, None, None)
    ax = request_timeline(first, fig.add_subplot(grid[1, 0]), n=n_requests)
    if "label" in first.columns and len(first):
        at = f" @ {first['rate'].iloc[0]:g}/s" if "rate" in first.columns and first["rate"].notna().any() else ""
        ax.set_title(f"Where each request's time went: {first['label'].iloc[0]}{at}")
    batch_gantt(busiest, fig.add_subplot(grid[1, 1] if lag is not None else grid[1, 1:]))
    if lag is not None:
        loop_lag(lag, fig.add_subplot(grid[1, 2]), probes=probes)
    if title:
        fig.suptitle(title)
    return fig
