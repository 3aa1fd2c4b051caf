"""Across replicas: where each request went (the ``replica`` column: the ``x-replica`` header)."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from .common import Records, empty, frame_of, get_ax

__all__ = ["replica_load"]


def replica_load(requests: Records, ax: Axes | None = None, *, bin_s: float = 5.0, title: str = "") -> Axes:
    """Requests sent to each replica per second, over the run (``bin_s`` bins): load skew as it happens.

    One line per replica, from the records' ``replica`` column (requests a server answered with
    an ``x-replica`` header; others are left out) and their scheduled send time.
    """
    ax = get_ax(ax)
    frame = frame_of(requests)
    if "replica" not in frame.columns or frame["replica"].dropna().empty:
        return empty(ax, "no replica named in these requests (x-replica)")
    frame = frame.dropna(subset=["replica"])
    edges = np.arange(0.0, float(frame["scheduled_s"].max()) + bin_s, bin_s)
    for replica, rows in sorted(frame.groupby("replica"), key=lambda kv: -len(kv[1])):
        counts, _ = np.histogram(rows["scheduled_s"], bins=edges)
        ax.plot(edges[:-1] + bin_s / 2, counts / bin_s, marker=".", label=f"{replica} ({len(rows)})")
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel("requests per second")
    ax.set_title(title or "requests routed to each replica")
    ax.legend(fontsize="small", title="replica (requests)")
    return ax
