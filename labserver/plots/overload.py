"""Under overload: goodput against offered load, the queue standing and shedding, tokens per tenant.

The frames are plain: a summary with a load and a goodput column per label (``goodput_vs_load``);
requests with an arrival time, a time they left the queue (dispatched, refused or shed), a
status and a reason (``queue_over_time``: live records or a virtual run's ``SimRun.frame()``);
tokens served per key over time (``tokens_over_time``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from .common import Records, empty, frame_of, get_ax, label_colors, label_groups, legend

__all__ = ["goodput_vs_load", "padding_vs_load", "queue_length", "queue_over_time", "tokens_over_time"]


def goodput_vs_load(summary: pd.DataFrame, ax: Axes | None = None, *, x: str = "load", y: str = "goodput_share",
                    by: str | None = "label", capacity: float | None = 1.0, title: str = "") -> Axes:
    """Goodput (answers within their target) against offered load, one line per label (discipline).

    With both axes in multiples of capacity, the ideal is ``min(load, 1)``: everything in time up
    to capacity, then capacity's worth of answers in time however much more is offered (drawn
    dashed when ``capacity`` is given). FIFO's collapse past 1 is the lesson.
    """
    ax = get_ax(ax)
    if not _lines(ax, summary, x, y, by):
        return empty(ax, f"no {x} / {y} columns to draw")
    if capacity is not None:
        top = float(summary[x].max())
        grid = np.linspace(0.0, max(top, 1.0), 100)
        ax.plot(grid, np.minimum(grid, capacity), "--", color="0.5", linewidth=1, label="ideal: min(load, capacity)")
    return _against_load(ax, x, "goodput (multiples of capacity)" if y == "goodput_share" else y,
                         title or "Goodput against offered load")


def padding_vs_load(summary: pd.DataFrame, ax: Axes | None = None, *, x: str = "load", y: str = "padding",
                    by: str | None = "label", title: str = "") -> Axes:
    """The share of computed tokens that were padding against offered load, one line per label (strategy).

    A rule that batches by count pads more as load grows (bigger batches: a longer longest); one that
    groups texts by length pads less as load grows (more waiting to choose from).
    """
    ax = get_ax(ax)
    if not _lines(ax, summary, x, y, by):
        return empty(ax, f"no {x} / {y} columns to draw")
    ax.set_ylim(0, 1)
    return _against_load(ax, x, "padding: (padded - real) / padded tokens" if y == "padding" else y,
                         title or "Padding against offered load")


def _against_load(ax: Axes, x: str, ylabel: str, title: str) -> Axes:
    """The axes both pictures against load share: from zero, labelled, a light grid, a legend."""
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered load (multiples of capacity)" if x == "load" else x)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    legend(ax, fontsize="small")
    return ax


def _lines(ax: Axes, summary: pd.DataFrame, x: str, y: str, by: str | None) -> bool:
    """One line of ``y`` against ``x`` per label; False when the columns are not there."""
    if x not in summary.columns or y not in summary.columns:
        return False
    groups = label_groups(summary, by)
    colors = label_colors([label for label, _ in groups])
    for label, rows in groups:
        rows = rows.sort_values(x)
        ax.plot(rows[x], rows[y], "-o", color=colors[label], label="_nolegend_" if label is None else str(label))
    return True


def queue_length(arrival_s: np.ndarray, left_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The number waiting over time, as steps: +1 at each arrival, -1 when it left the queue.

    >>> t, n = queue_length(np.array([0.0, 0.1, 0.2]), np.array([0.15, 0.3, 0.25]))
    >>> list(zip(t.tolist(), n.tolist()))
    [(0.0, 1), (0.1, 2), (0.15, 1), (0.2, 2), (0.25, 1), (0.3, 0)]
    """
    keep = np.isfinite(arrival_s) & np.isfinite(left_s)
    times = np.concatenate([arrival_s[keep], left_s[keep]])
    steps = np.concatenate([np.ones(int(keep.sum()), dtype=int), -np.ones(int(keep.sum()), dtype=int)])
    order = np.lexsort((steps, times))  # at one instant, leaving before arriving
    return times[order], np.cumsum(steps[order])


def _left_queue_s(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(arrival, left) per request: a virtual run's own, or a live run's scheduled send and dispatch."""
    if {"arrival_s", "left_s"} <= set(frame.columns):
        return frame["arrival_s"].to_numpy(dtype=float), frame["left_s"].to_numpy(dtype=float)
    arrival = frame["scheduled_s"].to_numpy(dtype=float)
    left = (frame["sent_s"] + frame["queue_ms"].fillna(0.0) / 1000.0).to_numpy(dtype=float, copy=True)
    refused = (frame["status"] != 200).to_numpy()
    left[refused] = frame.loc[refused, "done_s"].to_numpy(dtype=float)  # refused or shed: gone then
    return arrival, left


def queue_over_time(requests: Records, ax: Axes | None = None, *, by: str | None = "label",
                    title: str = "") -> Axes:
    """How many wait over time, one line per label; each request shed or refused (503) is a red mark.

    ``requests`` has ``arrival_s``, ``left_s`` (when it left the queue), ``status`` and ``reason``
    (a virtual run's frame, ``left_s = done_s`` less the compute), or live records (their
    scheduled send, the server's ``x-queue-ms``, and ``done_s`` for those refused).
    """
    ax = get_ax(ax)
    frame = frame_of(requests)
    if frame.empty or "status" not in frame.columns:
        return empty(ax, "no requests")
    groups = label_groups(frame, by)
    colors = label_colors([label for label, _ in groups])
    for label, rows in groups:
        arrival, left = _left_queue_s(rows)
        t, n = queue_length(arrival, left)
        ax.step(t, n, where="post", color=colors[label], label="_nolegend_" if label is None else str(label))
        refused = (rows["status"] == 503).to_numpy()
        if refused.any():
            at = left[refused]
            level = np.interp(at, t, n) if len(t) else np.zeros_like(at)
            ax.scatter(at, level, marker="x", color="tab:red", s=12, zorder=3,
                       label="_nolegend_" if ax.get_legend_handles_labels()[1].count("refused (503)") else
                       "refused (503)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests waiting")
    ax.set_title(title or "Queue length over time")
    ax.grid(True, alpha=0.3)
    legend(ax, fontsize="small")
    return ax


def tokens_over_time(frame: pd.DataFrame, ax: Axes | None = None, *, key: str = "tenant", time: str = "t_s",
                     value: str = "tokens", title: str = "") -> Axes:
    """Tokens served per second to each ``key`` (a tenant, a class) over time: a fair share as it happens."""
    ax = get_ax(ax)
    if frame.empty or not {key, time, value} <= set(frame.columns):
        return empty(ax, f"no {value} by {key} over {time}")
    colors = label_colors(list(pd.unique(frame[key])))
    for name, rows in frame.groupby(key, sort=False):
        rows = rows.sort_values(time)
        ax.plot(rows[time], rows[value], drawstyle="steps-post", color=colors[name], label=str(name))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{value} per second")
    ax.set_title(title or f"{value.capitalize()} served per {key}")
    ax.grid(True, alpha=0.3)
    legend(ax, fontsize="small", title=key)
    return ax
