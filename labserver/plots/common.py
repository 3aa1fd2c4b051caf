"""What every plot helper shares: how records come in, colours per label, axes manners.

Every helper in ``labserver.plots`` takes records (one frame with a ``label`` column, or
``{label: frame}``) or a frame derived from them, draws into ``ax`` (a new figure when
``ax`` is None, via ``axes``) and returns the Axes. Nothing changes global matplotlib
state (no rcParams, no styles). Runs keep one colour per label across helpers: the n-th
label in order of first appearance takes the n-th colour of the current property cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .. import analysis

__all__ = ["Records", "get_ax", "busiest_runs", "label_colors", "empty", "frame_of", "label_groups", "legend", "ok_values",
           "one_run", "plain_log_ticks", "styled_legend", "time_scale"]

Records = pd.DataFrame | Mapping[str, Any]  # a combined frame, or {label: frame | (frame, meta)}


def get_ax(ax: Axes | None) -> Axes:
    if ax is None:
        _, ax = plt.subplots(layout="constrained")
    return ax


def frame_of(records: Records) -> pd.DataFrame:
    return analysis.combine(records) if isinstance(records, Mapping) else records


def label_groups(frame: pd.DataFrame, by: str | None) -> list[tuple[Any, pd.DataFrame]]:
    """``(label, rows)`` in order of first appearance; one unlabelled group without ``by``."""
    if by is None or by not in frame.columns:
        return [(None, frame)]
    return [(label, frame[frame[by] == label]) for label in pd.unique(frame[by])]


def label_colors(labels: Sequence[Any]) -> dict[Any, Any]:
    # read, never set: the caller's (or notebook's) property cycle decides the colours
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return {label: cycle[n % len(cycle)] for n, label in enumerate(labels)}


def legend(ax: Axes, **kwargs: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, **kwargs)


def styled_legend(ax: Axes, styles: dict[str, str], **kwargs: Any) -> None:
    """The labelled lines (colour: label), then one grey key line per line style."""
    handles, names = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="0.3", linestyle=style) for style in styles.values()]
    ax.legend(handles, [*names, *styles], fontsize="small", **kwargs)


def time_scale(span_s: float) -> tuple[float, str]:
    """(factor, unit) for a time axis of this span: ms under 2 s, else s."""
    return (1000.0, "ms") if span_s < 2.0 else (1.0, "s")


def empty(ax: Axes, message: str) -> Axes:
    ax.text(0.5, 0.5, message, ha="center", va="center", color="0.4", transform=ax.transAxes)
    return ax


def plain_log_ticks(axis: Any) -> None:
    """Label a log-scaled ms axis 10, 20, 50, 100 rather than 10¹, 2×10¹, ...

    Call after the data are drawn: a narrow range gets 1-2-5 ticks, a wide one
    (over three decades) only powers of ten, so labels never crowd.
    """
    low, high = sorted(axis.get_view_interval())
    wide = low <= 0 or high / low > 1000.0
    axis.set_major_locator(LogLocator(base=10.0, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def ok_values(rows: pd.DataFrame, column: str = "latency_ms") -> np.ndarray:
    """The sorted values of ``column`` over the answers (``analysis.ok``: 2xx and no error), warm-up left out."""
    rows = analysis.measured(rows)
    return np.sort(rows.loc[analysis.ok(rows), column].dropna().to_numpy(dtype=float))


def busiest_runs(frame: pd.DataFrame, rate: float | None) -> pd.DataFrame:
    """One run per label: the one offered ``rate`` where there is one, else the label's highest."""
    if "rate" not in frame.columns or frame["rate"].isna().all():
        return frame
    parts = []
    for _, rows in label_groups(frame, "label"):
        chosen = rate if rate is not None and (rows["rate"] == rate).any() else rows["rate"].max()
        parts.append(rows[rows["rate"].isna()] if pd.isna(chosen) else rows[rows["rate"] == chosen])
    return pd.concat(parts)


def one_run(frame: pd.DataFrame, label: Any, rate: float | None) -> pd.DataFrame:
    """The rows of one run: the given (or first) label, then the given (or first) rate."""
    if "label" in frame.columns and len(frame):
        frame = frame[frame["label"] == (frame["label"].iloc[0] if label is None else label)]
    if "rate" in frame.columns and len(frame):
        wanted = frame["rate"].iloc[0] if rate is None else rate
        frame = frame[frame["rate"].isna()] if pd.isna(wanted) else frame[frame["rate"] == wanted]
    return frame
