"""Matplotlib pictures of generative serving: token latency, token throughput, the step log.

Drawn over the frames of a generation load test: records (one row per request,
with ``ttft_ms``, ``tpot_ms``, ``n_tokens``), tokens (one row per received token),
a ``summarize_runs`` summary, and the server's step log (one row per model call,
``labserver.engine.CallRecord``). Manners as in ``labserver.plots.common``, whose
helpers this reuses: each function draws into ``ax`` (a new figure when None) and
returns the Axes; nothing changes global matplotlib state; the n-th label takes
the n-th colour of the property cycle, in every picture.

``step_gantt`` is the teaching picture: one lane per batch slot, a bar per step a
sequence was in, so request-level batching's idle tail and continuous batching's
full lanes can be told apart at a glance. This module computes nothing a summary
should report; it only draws.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .. import analysis
from .common import (Records, busiest_runs, empty, frame_of, get_ax, label_colors, label_groups, legend, one_run,
                     plain_log_ticks, styled_legend, time_scale)
from .kv import NO_STEPS, kv_tokens
from .requests import latency_cdf

__all__ = [
    "generation_overview",
    "itl_cdf",
    "step_gantt",
    "token_throughput_vs_rate",
    "tpot_cdf",
    "ttft_cdf",
    "ttft_vs_rate",
]

# step_gantt: what a sequence was doing in a model call -> (legend name, face colour, hatch)
STATES = {
    "held": ("waiting, in KV cache", "0.85", None),  # drawn first, under the rest
    "decode": ("decode", "#4a6fa5", None),
    "prefill": ("prefill", "#f0a030", None),
    "idle": ("idle: done, still computed", "#f6d2d2", "////"),
    "verify": ("decode, verifying guesses", "#3a9a6a", None),  # speculative decoding: 1 to k + 1 tokens at once
}
IDLE_HATCH_COLOR = "#c0504d"
PREEMPT_COLOR = "#b22222"  # a cross where a sequence was preempted (its blocks taken back)
MAX_HATCHED = 2000  # more idle bars than this are drawn pale but plain


# ---------------------------------------------------------------- token latency


def _token_cdf(records: Records, ax: Axes | None, column: str, xlabel: str, title: str, ylabel: str | None,
               **options: Any) -> Axes:
    ax = get_ax(ax)
    frame = frame_of(records)
    if column not in frame.columns or "status" not in frame.columns:
        return empty(ax, f"no {column} in these records")
    rows = analysis.measured(frame)
    if rows.loc[analysis.ok(rows), column].notna().sum() == 0:
        return empty(ax, f"no {column} of an answered request")
    latency_cdf(frame, ax, column=column, **options)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    if ylabel:
        ax.set_ylabel(ylabel)
    return ax


def ttft_cdf(records: Records, ax: Axes | None = None, *, by: str | None = "label",
             marks: Sequence[float] = (50.0, 99.0), tail: bool = False) -> Axes:
    """CDF of time to first token of answered requests, one line per label, p50/p99 marked.

    TTFT is measured from the scheduled send, so it holds queueing and the prefill.
    """
    return _token_cdf(records, ax, "ttft_ms", "time to first token (ms, log scale)",
                      "Time to first token", None, by=by, marks=marks, tail=tail)


def tpot_cdf(records: Records, ax: Axes | None = None, *, by: str | None = "label",
             marks: Sequence[float] = (50.0, 99.0), tail: bool = False) -> Axes:
    """CDF of each answered request's mean time per output token after the first."""
    return _token_cdf(records, ax, "tpot_ms", "time per output token (ms, log scale)",
                      "Time per output token", None, by=by, marks=marks, tail=tail)


def itl_cdf(tokens: Records, ax: Axes | None = None, *, records: Records | None = None, by: str | None = "label",
            marks: Sequence[float] = (50.0, 99.0), tail: bool = False) -> Axes:
    """CDF of inter-token latency: every gap between two tokens of one stream.

    Where TPOT averages a request's gaps, this keeps them: a stall while others
    are prefilled shows as a tail here. With ``records``, only the tokens of
    measured (not warm-up) answered requests count.
    """
    frame = frame_of(tokens)
    keys = [key for key in analysis.RUN_KEYS if key in frame.columns]
    if records is not None and len(frame):
        rows = analysis.measured(frame_of(records))
        answered = rows.loc[analysis.ok(rows), [*keys, "i"]]
        frame = frame.merge(answered.drop_duplicates(), on=[*keys, "i"])
    if frame.empty:
        return empty(get_ax(ax), "no token timings")
    ordered = frame.sort_values("k", kind="stable")  # gaps aligned back by index: labels keep their order
    gaps = frame[keys].assign(itl_ms=ordered.groupby([*keys, "i"], dropna=False)["t_s"].diff() * 1000.0, status=200)
    return _token_cdf(gaps, ax, "itl_ms", "gap between tokens (ms, log scale)",
                      "Inter-token latency", "fraction of gaps", by=by, marks=marks, tail=tail)


# ---------------------------------------------------------------- against offered rate


def _by_rate(summary: pd.DataFrame, columns: Sequence[str], by: str | None) -> list[tuple[Any, pd.DataFrame]]:
    if "rate" not in summary.columns or not set(columns) <= set(summary.columns):
        return []
    rows = summary[summary["rate"].notna()]
    return [(label, part.sort_values("rate")) for label, part in label_groups(rows, by) if len(part)]


def token_throughput_vs_rate(summary: pd.DataFrame, ax: Axes | None = None, *, limit_tps: float | None = None,
                             by: str | None = "label") -> Axes:
    """Output tokens/s of answered requests against offered rate, one line per label.

    ``limit_tps`` (dashed) is what the model sustains offline, e.g. one full
    batch decoding back to back: a strategy that flattens below it wastes steps.
    """
    ax = get_ax(ax)
    groups = _by_rate(summary, ["token_throughput_tps"], by)
    if not groups:
        return empty(ax, "no token throughput per offered rate")
    colors = label_colors([label for label, _ in label_groups(summary, by)])
    for label, rows in groups:
        name = "_nolegend_" if label is None else str(label)
        ax.plot(rows["rate"].to_numpy(dtype=float), rows["token_throughput_tps"].to_numpy(dtype=float), "-o",
                color=colors[label], label=name)
    if limit_tps is not None:
        ax.axhline(limit_tps, color="0.3", linestyle="--", label=f"offline limit {limit_tps:g} tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("output tokens/s (answers)")
    ax.set_title("Token throughput vs offered rate")
    ax.grid(True, alpha=0.3)
    legend(ax, fontsize="small")
    return ax


def ttft_vs_rate(summary: pd.DataFrame, ax: Axes | None = None, *, slo_ms: float | None = None,
                 by: str | None = "label") -> Axes:
    """p99 (solid) and p50 (dashed) time to first token against offered rate, log ms."""
    ax = get_ax(ax)
    groups = _by_rate(analysis.trusted(summary), ["ttft_p50_ms", "ttft_p99_ms"], by)
    if not groups:
        return empty(ax, "no TTFT percentiles per offered rate")
    colors = label_colors([label for label, _ in label_groups(summary, by)])
    for label, rows in groups:
        x = rows["rate"].to_numpy(dtype=float)
        ax.plot(x, rows["ttft_p99_ms"], "-o", color=colors[label], label="_nolegend_" if label is None else str(label))
        ax.plot(x, rows["ttft_p50_ms"], "--", marker="o", markerfacecolor="white", color=colors[label],
                label="_nolegend_")
    if slo_ms is not None:
        ax.axhline(slo_ms, color="0.3", linestyle=":", label=f"SLO {slo_ms:g} ms")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title("TTFT vs offered rate")
    ax.grid(True, which="major", alpha=0.3)
    styled_legend(ax, {"p99": "-", "p50": "--"})
    return ax


# ---------------------------------------------------------------- the step log


def _ids(value: Any) -> tuple[int, ...]:
    """Sequence ids as the engine keeps them (a tuple) or as CSV gives them back ("3 4 7")."""
    if isinstance(value, str):
        return tuple(int(x) for x in re.findall(r"-?\d+", value))
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ()
    return tuple(int(x) for x in value)


def _slots(steps: pd.DataFrame) -> dict[str, list[tuple[float, float, int]]]:
    """``{state: [(start_s, end_s, lane), ...]}``: each sequence's consecutive steps in one state merged,
    under them (``held``) its whole stay, first step to last, and ``preempted``: where a stay was cut.

    A sequence takes the lowest lane free when it first appears and holds it until its
    last step, as it holds its KV cache; a preempted one gives its lane back, and when it
    is recomputed later that is a new stay (maybe on another lane).
    """
    starts, ends = steps["start_s"].to_numpy(dtype=float), steps["end_s"].to_numpy(dtype=float)
    column = {name: steps[name].map(_ids) if name in steps.columns else pd.Series([()] * len(steps))
              for name in ("seqs", "idle", "decoding", "preempted", "verifying")}
    visits: dict[tuple[int, int], list[tuple[int, str]]] = {}  # (sid, stay) -> [(step position, state)], in order
    stay: dict[int, int] = {}
    cuts: list[tuple[int, tuple[int, int]]] = []  # (step position, the stay it ended)
    for j, (seqs, idle, decoding, preempted, verifying) in enumerate(zip(*column.values(), strict=True)):
        for sid in preempted:  # taken out just before this call
            if (sid, stay.get(sid, 0)) in visits:
                cuts.append((j, (sid, stay.get(sid, 0))))
            stay[sid] = stay.get(sid, 0) + 1
        for sid in seqs:
            state = ("idle" if sid in idle else "verify" if sid in verifying else "decode" if sid in decoding
                     else "prefill")
            visits.setdefault((sid, stay.get(sid, 0)), []).append((j, state))
    lane_of: dict[tuple[int, int], int] = {}
    free: list[int] = []  # lanes given back, lowest first
    held: list[tuple[int, int]] = []  # (last step position, lane), soonest released first
    lanes = 0
    for key, seen in sorted(visits.items(), key=lambda item: item[1][0][0]):  # stable: call order within a step
        while held and held[0][0] < seen[0][0]:
            heapq.heappush(free, heapq.heappop(held)[1])
        if not free:
            free.append(lanes)
            lanes += 1
        lane_of[key] = heapq.heappop(free)
        heapq.heappush(held, (seen[-1][0], lane_of[key]))
    out: dict[str, list[tuple[float, float, int]]] = {state: [] for state in (*STATES, "preempted")}
    for key, seen in visits.items():
        out["held"].append((starts[seen[0][0]], ends[seen[-1][0]], lane_of[key]))
        begin = 0
        for n in range(1, len(seen) + 1):
            if n == len(seen) or seen[n][1] != seen[begin][1] or seen[n][0] != seen[n - 1][0] + 1:
                out[seen[begin][1]].append((starts[seen[begin][0]], ends[seen[n - 1][0]], lane_of[key]))
                begin = n
    out["preempted"] = [(starts[j], starts[j], lane_of[key]) for j, key in cuts]
    return out


def step_gantt(steps: Records, ax: Axes | None = None, *, max_steps: int | None = None, t0_s: float | None = None,
               label: Any = None, rate: float | None = None, legend: bool = True) -> Axes:
    """Every sequence's life in the batch: one lane per slot, a bar over each step it was in.

    Dark bars are decode steps (green where the step verified its guesses: speculative
    decoding), amber its prefill (or a piece of it, or its recompute),
    pale hatched ones steps it was computed in although already finished (request-level
    batching keeps it until the batch's longest member is done), grey ones calls it sat
    out while holding its KV cache (others' prefill stalls it); a red cross marks a
    preemption (it left its lane, to be recomputed later). A freed lane goes to the next
    sequence, so how full the lanes stay is how full the batch was. Draws one run
    (the given or first ``label`` and ``rate``), its first ``max_steps`` calls,
    with time from ``t0_s`` (default: the run's first step). No title: the caller
    knows which run it is.
    """
    ax = get_ax(ax)
    run = frame_of(steps)
    if len(run) and {"step", "seqs"} <= set(run.columns):
        run = one_run(run, label, rate).sort_values("step", kind="stable").iloc[:max_steps]
    if run.empty or "seqs" not in run.columns:
        ax.set_xticks([])
        ax.set_yticks([])
        return empty(ax, NO_STEPS)
    if "idle" not in run.columns:
        run = run.assign(idle="")
    t0 = float(run["start_s"].min()) if t0_s is None else t0_s
    scale, unit = time_scale(float(run["end_s"].max()) - t0)
    slots = _slots(run)
    decode = run["decoding"].map(lambda v: len(_ids(v))) > 0
    in_decode = run.loc[decode, "seqs"].map(lambda v: len(_ids(v))).sum()
    idle_share = run.loc[decode, "idle"].map(lambda v: len(_ids(v))).sum() / in_decode if in_decode else 0.0
    for state, (name, color, hatch) in STATES.items():
        if state == "verify" and not slots[state]:  # (no speculation: no entry in the legend)
            continue
        x0, x1, y = np.asarray(slots[state], dtype=float).reshape(-1, 3).T
        x0, x1 = (x0 - t0) * scale, (x1 - t0) * scale
        corners = [(x0, y - 0.4), (x0, y + 0.4), (x1, y + 0.4), (x1, y - 0.4)]
        verts = np.stack([np.stack(corner, axis=-1) for corner in corners], axis=1)  # (bars, 4, 2)
        if state == "idle":
            name = f"{name} ({idle_share:.0%})"
        hatch = hatch if len(verts) <= MAX_HATCHED else None  # hatching costs ~0.4 ms a bar to render
        ax.add_collection(PolyCollection(verts, facecolors=color, edgecolors=IDLE_HATCH_COLOR if hatch else "none",
                                         linewidths=0.0, hatch=hatch, label=name), autolim=False)
    if slots["preempted"]:
        x, _, lane = np.asarray(slots["preempted"], dtype=float).T
        ax.scatter((x - t0) * scale, lane, marker="x", s=30, color=PREEMPT_COLOR, zorder=3,
                   label=f"preempted ({len(x)})")
    lanes = 1 + max((lane for *_, lane in slots["held"]), default=0)
    ax.set_xlim(min(0.0, (float(run["start_s"].min()) - t0) * scale), (float(run["end_s"].max()) - t0) * scale)
    # lane 0 at the bottom, so the filled height is the batch size; room above the lanes for the legend
    ax.set_ylim(-0.6, lanes / 0.84 - 0.6 if legend else lanes - 0.4)
    ax.set_yticks(range(lanes) if lanes <= 10 else [t for t in MaxNLocator(integer=True).tick_values(0, lanes - 1)
                                                    if 0 <= t < lanes])
    ax.set_xlabel(f"time since first step ({unit})")
    ax.set_ylabel("batch slot (lane)")
    if legend:
        handles, names = ax.get_legend_handles_labels()  # "waiting" last: it is the background
        ax.legend(handles[1:] + handles[:1], names[1:] + names[:1], loc="upper left", ncols=2, fontsize="x-small",
                  frameon=False)
    return ax


# ---------------------------------------------------------------- all together


def _run_name(label: Any, rate: Any) -> str:
    return " @ ".join(part for part in (None if label is None else str(label),
                                        None if rate is None or pd.isna(rate) else f"{rate:g}/s") if part)


def generation_overview(
    records: Records,
    summary: pd.DataFrame | None = None,
    steps: Records | None = None,
    tokens: Records | None = None,
    *,
    rate: float | None = None,
    limit_tps: float | None = None,
    slo_ms: float | None = None,
    kv_capacity: float | None = None,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """One figure of a generation sweep, for saving.

    Top row, over every rate: token throughput and TTFT against offered rate;
    over the run each label was offered ``rate`` (by default its highest): TTFT,
    TPOT and, with ``tokens``, inter-token latency CDFs. With ``steps``, a bottom
    row of those runs' step Gantts side by side and their KV-cache tokens. Not
    registered with pyplot: save it with ``fig.savefig``.
    """
    frame = frame_of(records)
    busiest = busiest_runs(frame, rate) if len(frame) else frame
    table = summary if summary is not None else analysis.summarize_runs(frame) if len(frame) else pd.DataFrame()
    step_frame = None if steps is None else frame_of(steps)
    runs: list[tuple[Any, Any]] = [(None, None)]  # (label, rate) of each Gantt
    if "label" in busiest.columns and len(busiest) and (step_frame is None or "label" in step_frame.columns):
        runs = [(lab, rows["rate"].iloc[0] if "rate" in rows.columns else None)
                for lab, rows in label_groups(busiest, "label")]
    ncols = 5 if tokens is not None else 4
    width = max(15.0, 3.8 * max(ncols, len(runs) + 1))
    fig = Figure(figsize=figsize or (width, 4.5 if step_frame is None else 9.0), layout="constrained")
    outer = fig.add_gridspec(1 if step_frame is None else 2, 1)
    top = outer[0].subgridspec(1, ncols)
    suffix = f" at {rate:g}/s" if rate is not None else " (highest rate)" if len(busiest) < len(frame) else ""
    axes = [ttft_cdf(busiest, fig.add_subplot(top[0, 0])), tpot_cdf(busiest, fig.add_subplot(top[0, 1]))]
    if tokens is not None:
        axes.append(itl_cdf(tokens, fig.add_subplot(top[0, 2]), records=busiest))
    for ax in axes:
        ax.set_title(ax.get_title() + suffix)
    token_throughput_vs_rate(table, fig.add_subplot(top[0, ncols - 2]), limit_tps=limit_tps)
    ttft_vs_rate(table, fig.add_subplot(top[0, ncols - 1]), slo_ms=slo_ms)
    if step_frame is not None:
        bottom = outer[1].subgridspec(1, len(runs) + 1)
        chosen = []
        for n, (lab, run_rate) in enumerate(runs):
            rows = step_frame if lab is None else step_frame[step_frame["label"] == lab]
            if run_rate is not None and pd.notna(run_rate) and "rate" in rows.columns:
                rows = rows[rows["rate"] == run_rate]
            chosen += [rows] if len(rows) else []
            step_gantt(rows, fig.add_subplot(bottom[0, n])).set_title(f"Steps: {_run_name(lab, run_rate)}".rstrip(": "))
        kv_tokens(pd.concat(chosen) if chosen else pd.DataFrame(), fig.add_subplot(bottom[0, -1]), capacity=kv_capacity)
    if title:
        fig.suptitle(title)
    return fig
