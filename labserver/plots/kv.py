"""Matplotlib pictures of KV-cache memory: tokens held and reserved, blocks by state, where TTFT went.

Drawn over the server's step log (``labserver.engine.CallRecord``: after each model call,
the KV tokens held, the blocks used, cached and free, who was preempted) and over
request frames with ``queue_ms`` and ``ttft_ms``. Manners as in ``labserver.plots.common``:
``ax=None`` in, the Axes out, nothing global changed, the n-th label the n-th colour.
This module computes nothing a summary should report; it only draws.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from .. import analysis
from .common import Records, empty, frame_of, get_ax, label_colors, label_groups, one_run, styled_legend, time_scale

__all__ = ["NO_STEPS", "kv_blocks", "kv_tokens", "ttft_split"]

NO_STEPS = "no step log for this run\n(gen-hf-cb: the steps happen inside transformers)"
BLOCK_STATES = {  # column -> (legend name, colour), stacked from the bottom
    "blocks_used": ("used: in a running sequence's table", "#4a6fa5"),
    "blocks_cached": ("cached: kept for the prefix cache", "#9dc3e6"),
    "blocks_free": ("free", "0.9"),
}
PREEMPT_COLOR = "#b22222"


def kv_tokens(steps: Records, ax: Axes | None = None, *, capacity: float | None = None,
              by: str | None = "label") -> Axes:
    """KV-cache tokens held (solid) and reserved (dashed) after each step, one colour per label.

    Reserved is prompt + ``max_new_tokens`` of every running sequence, what a reserving
    rule budgets against; the gap to the solid line is room promised but not (yet) used.
    ``capacity`` draws the budget (``max_kv_tokens``).
    """
    ax = get_ax(ax)
    frame = frame_of(steps)
    if frame.empty or "kv_tokens" not in frame.columns:
        return empty(ax, NO_STEPS)
    keys = [key for key in analysis.RUN_KEYS if key in frame.columns and frame[key].notna().any()]
    runs = list(frame.groupby(keys, sort=False, dropna=False)) if keys else [((), frame)]
    label_key = by if by in keys else None
    colors = label_colors([lab for lab, _ in label_groups(frame, label_key)])
    scale, unit = time_scale(max(float((rows["end_s"] - rows["start_s"].min()).max()) for _, rows in runs))
    for key, rows in runs:
        key = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        rows = rows.sort_values("step", kind="stable")
        t = (rows["end_s"].to_numpy(dtype=float) - float(rows["start_s"].min())) * scale
        name = " @ ".join(f"{v:g}/s" if k == "rate" else str(v) for k, v in key.items() if pd.notna(v)) or "_nolegend_"
        color = colors[key.get(label_key)]
        ax.plot(t, rows["kv_tokens"], drawstyle="steps-post", color=color, label=name)
        if "kv_reserved" in rows.columns:
            ax.plot(t, rows["kv_reserved"], drawstyle="steps-post", linestyle="--", color=color, label="_nolegend_")
    if capacity is not None:
        ax.axhline(capacity, color="0.3", linestyle=":", label=f"capacity {capacity:g}")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"time since first step ({unit})")
    ax.set_ylabel("KV-cache tokens")
    ax.set_title("KV cache")
    ax.grid(True, alpha=0.3)
    styled_legend(ax, {"in use": "-", "reserved": "--"}, loc="upper right")
    return ax


def _count(value: Any) -> int:
    """How many sequence ids a step-log cell holds (a tuple, or "3 4 7" back from CSV)."""
    if isinstance(value, str):
        return len(value.replace("(", " ").replace(")", " ").replace(",", " ").split())
    return 0 if value is None or (isinstance(value, float) and np.isnan(value)) else len(value)


def kv_blocks(steps: Records, ax: Axes | None = None, *, label: Any = None, rate: float | None = None,
              legend: bool = True) -> Axes:
    """One run's KV blocks after each step, stacked: used, cached (prefix cache), free; preemptions marked.

    The stack's height is the pool. Under a reserving rule much of it stays free while
    the queue waits (promised, not used); under paging "used" climbs to the top, and each
    red tick at the top is a step that had to preempt to find a block. Draws the given
    (or first) ``label`` and ``rate``; no title: the caller knows which run it is.
    """
    ax = get_ax(ax)
    run = frame_of(steps)
    if len(run) and "step" in run.columns:
        run = one_run(run, label, rate).sort_values("step", kind="stable")
    if run.empty or "blocks_used" not in run.columns:
        return empty(ax, NO_STEPS)
    t0 = float(run["start_s"].min())
    scale, unit = time_scale(float(run["end_s"].max()) - t0)
    t = (run["end_s"].to_numpy(dtype=float) - t0) * scale
    layers = [run[column].to_numpy(dtype=float) for column in BLOCK_STATES]
    ax.stackplot(t, *layers, step="post", colors=[color for _, color in BLOCK_STATES.values()],
                 labels=[name for name, _ in BLOCK_STATES.values()])
    total = float(np.max(np.sum(layers, axis=0)))
    if "preempted" in run.columns:
        counts = run["preempted"].map(_count).to_numpy()
        hit = counts > 0
        if hit.any():
            x = (run["start_s"].to_numpy(dtype=float)[hit] - t0) * scale
            ax.plot(x, np.full(len(x), total), "|", markersize=12, color=PREEMPT_COLOR,
                    label=f"preemption ({int(counts.sum())} sequences)")
    ax.set_xlim(0, float(t.max()) if len(t) else 1.0)
    ax.set_ylim(0, total * (1.3 if legend else 1.02))
    ax.set_xlabel(f"time since first step ({unit})")
    ax.set_ylabel("KV blocks")
    if legend:
        ax.legend(loc="upper left", ncols=2, fontsize="x-small", frameon=False)
    return ax


def ttft_split(requests: Records, ax: Axes | None = None, *, by: str | None = "label", stat: str = "median") -> Axes:
    """Time to first token split in two, one bar per label: waiting in the queue, then the rest.

    ``queue_ms`` is the server's time from enqueue to the start of the request's prefill;
    the rest of ``ttft_ms`` is its prefill (with a prefix cache, only the part not cached;
    chunked, spread over several steps) and, measured by a client, the way there and back.
    ``stat`` is ``"median"`` or ``"mean"``, taken of each part over answered requests.
    """
    ax = get_ax(ax)
    frame = frame_of(requests)
    if frame.empty or not {"queue_ms", "ttft_ms"} <= set(frame.columns):
        return empty(ax, "no queue_ms and ttft_ms in these requests")
    if "status" in frame.columns:
        frame = analysis.measured(frame)
        frame = frame[analysis.ok(frame)]
    groups = [(lab, rows.dropna(subset=["queue_ms", "ttft_ms"])) for lab, rows in label_groups(frame, by)]
    groups = [(lab, rows) for lab, rows in groups if len(rows)]
    if not groups:
        return empty(ax, "no answered request with both times")
    take = np.median if stat == "median" else np.mean
    names = [str(lab) if lab is not None else "" for lab, _ in groups]
    queue = np.array([take(rows["queue_ms"]) for _, rows in groups])
    rest = np.array([take(rows["ttft_ms"] - rows["queue_ms"]) for _, rows in groups])
    y = np.arange(len(groups))
    ax.barh(y, queue, color="0.7", label="waiting in the queue")
    ax.barh(y, rest, left=queue, color="#f0a030", label="prefill (and the way there and back)")
    for i, (q, r) in enumerate(zip(queue, rest, strict=True)):
        ax.text(q + r, i, f" {q + r:,.0f} ms", va="center", fontsize="small")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlim(0, float((queue + rest).max()) * 1.25 or 1.0)
    ax.set_xlabel(f"time to first token, {stat} of each part (ms)")
    ax.set_title("Where time to first token went")
    ax.legend(loc="lower right", fontsize="small")
    return ax
