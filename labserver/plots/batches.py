"""Pictures of batches: how big they were, when they ran, and all the pictures on one page.

Drawn over the load generator's records (the server's batch headers) or an
``analysis.batches`` frame; the manners of ``labserver.plots.common``.
"""

from __future__ import annotations


import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .. import analysis
from .common import Records, get_ax, busiest_runs, empty, frame_of, label_colors, label_groups, legend, one_run
from .requests import latency_cdf, latency_vs_throughput, loop_lag, request_timeline

__all__ = ["batch_gantt", "batch_size_hist", "overview"]


def batch_size_hist(
    records: Records,
    ax: Axes | None = None,
    *,
    by: str | None = "label",
    weight: str = "batches",
    stacked: bool = False,
) -> Axes:
    """How many batches (``weight="batches"``) or requests (``"requests"``) had each size,
    or, with ``"share"``, each label's share of its requests served in batches up to each size.

    One bar per label and size, side by side (or ``stacked``), one bin per
    integer size from 1 to the largest seen; each batch counts once. ``"share"`` draws one
    cumulative step line per label instead, all on the 0-1 scale: a rule that made 1,000
    batches of one (a step at 1) does not flatten one that made 40 batches of 25, and the
    median batch a request rode in is where a line crosses 0.5.
    """
    if weight not in ("batches", "requests", "share"):
        raise ValueError(f'weight must be "batches", "requests" or "share", got {weight!r}')
    ax = get_ax(ax)
    groups = label_groups(frame_of(records), by)
    colors = label_colors([label for label, _ in groups])
    counts = [(label, analysis.batch_size_counts(rows)) for label, rows in groups]
    counts = [(label, c * c.index if weight != "batches" else c) for label, c in counts if len(c)]
    if weight == "share":
        counts = [(label, c / c.sum()) for label, c in counts]
    if not counts:
        return empty(ax, "no batch sizes in these records")
    sizes = np.arange(1, max(int(c.index.max()) for _, c in counts) + 1)
    if weight == "share":
        for label, c in counts:
            shares = np.cumsum(c.reindex(sizes, fill_value=0).to_numpy(dtype=float))
            ax.step(np.r_[0, sizes], np.r_[0.0, shares], where="post", color=colors[label],
                    label="_nolegend_" if label is None else str(label))
        ax.axhline(0.5, color="0.6", linestyle=":", linewidth=1)
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("batch size (requests per model call)")
        ax.set_ylabel("share of requests in batches up to this size")
        ax.set_title("Batch sizes")
        legend(ax, fontsize="small")
        return ax
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
    legend(ax, fontsize="small")
    return ax


def batch_gantt(
    data: Records,
    ax: Axes | None = None,
    *,
    cmap: str = "viridis",
    colorbar: bool = True,
    color: str = "size",
) -> Axes:
    """Every batch as a bar over its compute time, one lane per run; height by size, colour by ``color``.

    ``data`` is records, an ``analysis.batches`` frame or an ``analysis.batch_frame`` (the server's
    batch log). Gaps in a lane are an idle model; short, pale bars are a model working on small
    batches. ``color="padding"`` colours each bar by the share of its computed tokens that were
    padding (0: every text as long as the longest; a batch log or a virtual run has it).
    """
    ax = get_ax(ax)
    frame = frame_of(data)
    table = frame if {"start_s", "size"} <= set(frame.columns) else analysis.batches(frame)
    table = table[table["start_s"].notna() & table["end_s"].notna() & table["size"].notna()]
    if table.empty:
        return empty(ax, "no batch timings in these records")
    if color not in ("size", "padding"):
        raise ValueError(f"color must be 'size' or 'padding', got {color!r}")
    if color == "padding" and "padding" not in table.columns:
        return empty(ax, "no padding in these batches: draw the server's batch log (analysis.batch_frame)")
    keys = [key for key in analysis.RUN_KEYS if key in table.columns and table[key].notna().any()]
    runs = list(table.groupby(keys, sort=False, dropna=False)) if keys else [((), table)]
    if keys:  # lanes by label as given, then rate ascending (the table itself is in time order)
        rank = {label: n for n, label in enumerate(pd.unique(frame["label"]))} if "label" in keys else {}
        runs.sort(key=lambda run: tuple(
            rank[k] if key == "label" else (np.inf if pd.isna(k) else k) for key, k in zip(keys, run[0])))
    largest = max(int(table["size"].max()), 2)  # a 1..1 colour scale is degenerate
    norm = Normalize(vmin=1, vmax=largest) if color == "size" else Normalize(vmin=0.0, vmax=1.0)
    colours = colormaps[cmap]
    names = []
    for lane, (key, rows) in enumerate(runs):
        bottom = len(runs) - 1 - lane - 0.4  # first run on top
        size = rows["size"].to_numpy(dtype=float)
        shade = size if color == "size" else rows["padding"].to_numpy(dtype=float)
        ax.barh(bottom, (rows["end_s"] - rows["start_s"]).to_numpy(dtype=float), left=rows["start_s"].to_numpy(),
                height=0.8 * size / largest, align="edge", color=colours(norm(shade)), edgecolor="none")
        key = key if isinstance(key, tuple) else (key,)
        names.append(" @ ".join(f"{k:g}/s" if isinstance(k, float) else str(k) for k in key if pd.notna(k)) or "run")
    ax.set_yticks(np.arange(len(runs))[::-1], names)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("time since run start (s)")
    ax.set_title("Batches over time (height: size; colour: " + ("size)" if color == "size" else "padding share)"))
    if colorbar:
        ax.figure.colorbar(ScalarMappable(norm=norm, cmap=colours), ax=ax,
                           label="batch size" if color == "size" else "padding: (padded - real) / padded tokens")
    return ax


def overview(
    records_by_label: Records,
    *,
    summary: pd.DataFrame | None = None,
    lag: Records | None = None,
    probes: pd.DataFrame | None = None,
    slo_ms: float | None = None,
    rate: float | None = None,
    cdf_rate: float | None = None,
    n_requests: int = 40,
    title: str | None = None,
    figsize: tuple[float, float] = (15.0, 9.0),
) -> Figure:
    """One figure of the pictures above, for saving, each panel titled with the rate it shows.

    Latency against throughput over every run; the latency CDF and the event-loop lag of
    the runs offered ``cdf_rate``; batch sizes, the request timeline (first label) and the
    batch Gantt of the runs offered ``rate``. Either rate defaults to each label's highest.
    The Figure is not registered with pyplot (nothing to close, nothing shown twice): save
    it with ``fig.savefig``, or leave it as a notebook cell's value.
    """
    frame = frame_of(records_by_label)
    fig = Figure(figsize=figsize, layout="constrained")
    grid = fig.add_gridspec(2, 3)
    shown = busiest_runs(frame, cdf_rate)
    _at(latency_cdf(shown, fig.add_subplot(grid[0, 0])), "Latency", shown)
    table = summary if summary is not None else analysis.summarize_runs(frame, slo_ms=slo_ms)
    latency_vs_throughput(table, fig.add_subplot(grid[0, 1]), slo_ms=slo_ms)
    busiest = busiest_runs(frame, rate)
    _at(batch_size_hist(busiest, fig.add_subplot(grid[0, 2]), weight="share"), "Batch sizes", busiest)
    first = one_run(busiest, None, None)
    ax = request_timeline(first, fig.add_subplot(grid[1, 0]), n=n_requests)
    if "label" in first.columns and len(first):
        _at(ax, f"Where each request's time went: {first['label'].iloc[0]}", first)
    _at(batch_gantt(busiest, fig.add_subplot(grid[1, 1] if lag is not None else grid[1, 1:])), "Batches", busiest)
    if lag is not None:
        lag_frame = frame_of(lag)
        if "rate" in lag_frame.columns and len(shown) and "rate" in shown.columns:
            lag_frame = lag_frame[lag_frame["rate"].isin(pd.unique(shown["rate"]))]
        _at(loop_lag(lag_frame, fig.add_subplot(grid[1, 2]), probes=probes), "Event-loop lag", shown)
    if title:
        fig.suptitle(title)
    return fig


def _at(ax: Axes, what: str, rows: pd.DataFrame) -> Axes:
    """Title a panel with the offered rate(s) of the runs it shows."""
    rates = sorted(pd.unique(rows["rate"].dropna())) if "rate" in rows.columns and len(rows) else []
    ax.set_title(f"{what} @ {', '.join(f'{r:g}' for r in rates)}/s" if rates else what)
    return ax
