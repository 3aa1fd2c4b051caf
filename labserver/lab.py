"""What the notebooks share: quick-mode parameters, a device check, and experiments in one call.

The notebooks in ``notebooks/`` import everything reusable and define nothing
(STYLE.md: a cell sets parameters, calls the package, and plots). What they need
beyond ``serve``, ``run_load_sync`` and the plots lives here:

* ``quick_mode`` / ``pick``: every notebook shrinks its parameters when the
  environment variable ``LABSERVER_QUICK=1`` is set (the test suite does);
* ``gpu_available`` / ``device_label``: whether torch sees a CUDA GPU;
* ``serve_and_load``: start each strategy in turn, warm it up, load it at several
  offered rates, stop it, and keep the records, the server's event-loop lag and
  the /health probes in one clock (``Runs``);
* ``time_batches``: the model alone, timed at several batch sizes;
* ``sim_frames``: virtual-clock runs (``labserver.virtual``) as frames the plots take;
* two pictures that only the notebooks draw, with the same manners as
  ``labserver.plots`` (``ax=None`` in, the Axes out, no global state).

This module is not used by the server, the load generator or the CLI.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from . import analysis, theory
from .arrivals import WORDS, PayloadLike, WordTexts
from .launch import ServerHandle, serve_each
from .loadgen import LoadResult, run_load_sync
from .plots import _axes
from .virtual import SimRun

__all__ = [
    "QUICK_ENV",
    "Runs",
    "brief",
    "device_label",
    "gpu_available",
    "lag_in_run_clock",
    "lag_sawtooth",
    "latency_over_time",
    "load_rates",
    "masked_texts",
    "pick",
    "quick_mode",
    "serve_and_load",
    "setup_notebook",
    "sim_frames",
    "theory_vs_measured",
    "time_batches",
    "warm_up",
]

logger = logging.getLogger(__name__)

QUICK_ENV = "LABSERVER_QUICK"
T = TypeVar("T")

LAG_COLUMNS = ["label", "rate", "t_s", "lag_ms"]
PROBE_COLUMNS = ["label", "rate", "t_s", "latency_ms", "status", "error"]
BRIEF_COLUMNS = ("label", "rate", "count", "throughput_rps", "goodput_rps", "p50_ms", "p99_ms", "mean_ms",
                 "mean_batch_size", "n_503", "n_504", "n_500", "late_frac")


# ---------------------------------------------------------------- the notebook's setting


def quick_mode() -> bool:
    """True when ``LABSERVER_QUICK`` is set to 1 (or true/yes/on): shrink every run."""
    return os.environ.get(QUICK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def pick(full: T, quick: T) -> T:
    """``quick`` in quick mode, else ``full``: one parameter, both sizes, side by side.

    ``DURATION_S = pick(full=20.0, quick=3.0)`` reads as what it is in both modes.
    """
    return quick if quick_mode() else full


def setup_notebook() -> None:
    """Quieten what would clutter a notebook's saved outputs; call once, first.

    Turns off Hugging Face download/loading progress bars (only for libraries not
    yet imported, which is why this goes first), tqdm's complaint that a kernel
    without ipywidgets cannot draw widget bars, and the load generator's per-run
    warnings on stderr: those stay on each result (``Runs.warnings``) and in the
    ``late_frac`` column of the summaries, where a notebook shows them.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message="IProgress not found")
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)


def gpu_available() -> bool:
    """Whether torch sees a CUDA GPU (False when torch is not installed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_label(device: str = "auto") -> str:
    """A short description of where a model would run: ``cpu (2 threads)``, ``cuda (NVIDIA ...)``."""
    from .models import pick_device

    dev = pick_device(device)
    import torch

    if dev.startswith("cuda"):
        return f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    threads = torch.get_num_threads()
    return f"{dev} ({threads} thread{'' if threads == 1 else 's'})"


# ---------------------------------------------------------------- loading servers


@dataclass
class Runs:
    """Several load runs told apart by ``label`` and offered ``rate``, all in one frame each.

    ``records`` is the load generator's per-request frame (``analysis.combine``);
    ``lag`` the server's event-loop lag samples and ``probes`` the /health probes,
    both with ``t_s`` in the clock of their run's records (seconds from its start).
    """

    records: pd.DataFrame
    lag: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=LAG_COLUMNS))
    probes: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PROBE_COLUMNS))
    warnings: list[str] = field(default_factory=list)  # the load generator's, "label @ rate: ..."

    def summary(self, slo_ms: float | None = None) -> pd.DataFrame:
        """``analysis.summarize_runs`` over the records: one row per (label, rate)."""
        return analysis.summarize_runs(self.records, slo_ms=slo_ms)

    def run(self, label: str, rate: float | None = None) -> Runs:
        """The rows of one label (and one rate, or all of that label's rates)."""

        def keep(frame: pd.DataFrame) -> pd.DataFrame:
            rows = frame[frame["label"] == label]
            return rows if rate is None else rows[np.isclose(rows["rate"].astype(float), rate)]

        return Runs(keep(self.records), keep(self.lag), keep(self.probes),
                    [w for w in self.warnings if w.startswith(f"{label} @")])

    @staticmethod
    def concat(parts: Iterable[Runs]) -> Runs:
        parts = list(parts)
        frames = [p.records for p in parts if len(p.records)]
        lags = [p.lag for p in parts if len(p.lag)]
        probes = [p.probes for p in parts if len(p.probes)]
        return Runs(
            pd.concat(frames, ignore_index=True) if frames else analysis.combine({}),
            pd.concat(lags, ignore_index=True) if lags else pd.DataFrame(columns=LAG_COLUMNS),
            pd.concat(probes, ignore_index=True) if probes else pd.DataFrame(columns=PROBE_COLUMNS),
            [w for p in parts for w in p.warnings],
        )


def lag_in_run_clock(handle: ServerHandle, result: LoadResult) -> pd.DataFrame:
    """The server's event-loop lag samples during one load run, with ``t_s`` in that run's clock.

    The server stamps its samples with ``time.perf_counter`` from its own start;
    the load generator's records and probes count from its start (``meta["t0_unix_s"]``).
    Both are turned into wall-clock time, so lag and probe latency can share an axis.
    Works for a server on its own thread and for one attached to this loop.
    """
    monitor = handle.runtime.lag
    to_unix_s = time.time() - time.perf_counter()  # perf_counter -> unix, read now
    t0_unix_s = float(result.meta.get("t0_unix_s", math.nan))
    end_s = float(result.meta.get("elapsed_s", math.inf)) + 0.5
    rows = [(t + monitor.t0_s + to_unix_s - t0_unix_s, lag) for t, lag in handle.loop_lag()]
    frame = pd.DataFrame(rows, columns=["t_s", "lag_ms"])
    return frame[(frame["t_s"] >= -0.2) & (frame["t_s"] <= end_s)].reset_index(drop=True)


def lag_sawtooth(lag: pd.DataFrame, min_ms: float = 1.0) -> pd.DataFrame:
    """Lag samples with the start of each stall added, for drawing what the loop went through.

    A sample ``(t_s, lag_ms)`` is taken when the loop's timer finally fires: the loop
    was stuck from ``t_s - lag_ms/1000`` to ``t_s``. Joining the samples with lines
    would draw back-to-back stalls as one flat plateau; adding a zero at each stall's
    start draws the sawtooth instead (how late a timer would be at each moment).
    Stalls under ``min_ms`` are timer noise and get no extra point.
    """
    stalls = lag[lag["lag_ms"] > min_ms]
    starts = stalls.assign(t_s=stalls["t_s"] - stalls["lag_ms"] / 1000, lag_ms=0.0)
    return pd.concat([lag, starts]).sort_values("t_s", kind="stable").reset_index(drop=True)


def warm_up(url: str, n: int = 10, payload: PayloadLike = "warm up") -> None:
    """Send ``n`` requests one after another and forget them: a fresh model's first calls are slow."""
    if n > 0:
        run_load_sync(url, users=1, max_requests=n, payload=payload, process=False, progress=False)


def load_rates(
    handle: ServerHandle,
    rates: Sequence[float],
    *,
    label: str,
    duration_s: float,
    warmup_s: float = 0.0,
    payload: PayloadLike = "hello world",
    arrival: str = "poisson",
    seed: int = 0,
    **load_options: Any,
) -> Runs:
    """Load a running server at each offered rate in turn (open loop); one ``Runs``.

    Each run lasts ``warmup_s + duration_s``; requests scheduled in the first
    ``warmup_s`` are recorded but left out of the summaries. The k-th rate's
    schedule is drawn with ``seed + k``: independent draws across rates, and the
    same schedules for every server given the same rates. ``load_options`` go to
    ``run_load_sync`` (``process``, ``probe_interval_s``, ``timeout_s`` ...).
    """
    parts = []
    options = {"progress": False, **load_options}
    for k, rate in enumerate(rates):
        result = run_load_sync(handle.url, arrival=arrival, rate_per_s=rate, duration_s=duration_s + warmup_s,
                               warmup_s=warmup_s, payload=payload, seed=seed + k, **options)
        records = analysis.combine([(label, rate, result)])
        lag = lag_in_run_clock(handle, result).assign(label=label, rate=float(rate))
        probes = result.probes.assign(label=label, rate=float(rate))
        parts.append(Runs(records, lag[LAG_COLUMNS], probes[PROBE_COLUMNS],
                          [f"{label} @ {rate:g}/s: {w}" for w in result.warnings]))
    return Runs.concat(parts)


def serve_and_load(
    strategies: Sequence[str] | Mapping[str, Mapping[str, Any]],
    model: Any,
    rates: Sequence[float],
    *,
    duration_s: float,
    warmup_s: float = 0.0,
    payload: PayloadLike = "hello world",
    arrival: str = "poisson",
    warm_requests: int = 10,
    load_options: Mapping[str, Any] | None = None,
    **knobs: Any,
) -> Runs:
    """Start each strategy in turn, warm it up, load it at every rate, stop it.

    ``strategies`` is a list of strategy names, or ``{label: options}`` where the
    options (``strategy`` among them, else the label is the strategy's name) are
    added to ``knobs`` for that server only, e.g.
    ``{"deadline, 5 ms": {"strategy": "deadline", "max_wait_ms": 5}}``. ``model``
    is a spec or, better, an object from ``labserver.load_model`` so it loads once
    for all of them. ``arrival`` ("poisson" or "constant") and ``rates`` make each
    run's schedule (see ``load_rates``); ``knobs`` go to ``labserver.serve`` (max_batch_size,
    max_wait_ms, max_queue, timeout_ms, device, ...); ``load_options`` to the
    load generator.
    """
    parts = []
    for label, handle in serve_each(strategies, model, **knobs):
        warm_up(handle.url, warm_requests, payload)
        parts.append(load_rates(handle, rates, label=label, duration_s=duration_s, warmup_s=warmup_s,
                                payload=payload, arrival=arrival, **dict(load_options or {})))
    return Runs.concat(parts)


def brief(summary: pd.DataFrame, columns: Sequence[str] = BRIEF_COLUMNS, digits: int = 1) -> pd.DataFrame:
    """The columns of a summary worth reading in a notebook, rounded; absent ones skipped."""
    view = summary[[c for c in columns if c in summary.columns]].copy()
    floats = view.select_dtypes("float").columns
    view[floats] = view[floats].round(digits)
    if "late_frac" in view.columns:
        view["late_frac"] = summary["late_frac"].round(3)
    return view


# ---------------------------------------------------------------- the model alone


def masked_texts(n: int, *, mask: str = "[MASK]", min_words: int = 6, max_words: int = 16,
                 seed: int = 0) -> list[str]:
    """``n`` seeded sentences from the built-in word list, each with one ``mask`` token.

    Fill-mask models (``bert-base-random``, the guide's task) refuse a text without one.

    >>> masked_texts(2, min_words=3, max_words=3)[0].count("[MASK]")
    1
    """
    rng = np.random.default_rng(seed)
    texts = WordTexts(dist="uniform", min_words=min_words, max_words=max_words).take(n, rng)
    out = []
    for text in texts:
        words = text.split()
        words[int(rng.integers(len(words)))] = mask
        out.append(" ".join(words))
    return out


def time_batches(model: Any, sizes: Sequence[int], texts: Sequence[str], *, repeats: int = 3,
                 warm: int = 2) -> pd.DataFrame:
    """Time ``model`` on its own (no server) at each batch size: the cost batching works with.

    Each size is called ``repeats`` times on the first ``size`` texts (cycled when
    too few); columns ``size``, ``ms`` (median per call), ``ms_per_item`` and
    ``items_per_s``. ``warm`` untimed calls first: a fresh model's first calls are slow.
    """
    pool = list(texts) or list(WORDS[:8])
    for _ in range(warm):
        model(pool[:1])
    rows = []
    for size in sizes:
        batch = [pool[k % len(pool)] for k in range(size)]
        took = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(batch)
            took.append((time.perf_counter() - t) * 1000)
        ms = float(np.median(took))
        rows.append({"size": size, "ms": ms, "ms_per_item": ms / size, "items_per_s": size * 1000 / ms})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- virtual clock


def sim_frames(runs: Mapping[str, SimRun], arrivals_s: Sequence[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Virtual-clock runs as two frames: ``(batches, items)``.

    ``batches`` has ``label, batch_id, size, dispatch, start_s, end_s, compute_ms``
    (what ``plots.batch_gantt`` draws); ``items`` has ``label, arrival_s,
    latency_ms, batch_id``, one row per arrival. Items leave in arrival order (one
    FIFO queue), so the k-th latency belongs to the k-th arrival.
    """
    arrivals = np.sort(np.asarray(arrivals_s, dtype=float))
    batch_rows, item_rows = [], []
    for label, run in runs.items():
        ids = np.repeat([b.batch_id for b in run.batches], [b.size for b in run.batches])
        for b in run.batches:
            batch_rows.append({"label": label, "batch_id": b.batch_id, "size": b.size, "dispatch": b.reason,
                               "start_s": b.dispatched_s, "end_s": b.dispatched_s + b.compute_ms / 1000,
                               "compute_ms": b.compute_ms})
        item_rows.append(pd.DataFrame({"label": label, "arrival_s": arrivals[: len(run.latencies_ms)],
                                       "latency_ms": run.latencies_ms, "batch_id": ids}))
    return pd.DataFrame(batch_rows), pd.concat(item_rows, ignore_index=True)


# ---------------------------------------------------------------- two notebook pictures


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
    ax = _axes(ax)
    right = ax.get_xlim()[1] if ax.has_data() else 0.0  # a second call only widens the view
    rows = summary.sort_values("rate")
    capacity = theory.capacity_rps(service_ms)
    top = max(float(rows["rate"].max()), 0.0)
    grid = np.linspace(0.0, min(capacity * 0.985, max(top * 1.1, capacity * 0.9)), 200)
    name = "M/D/1" if cv2 == 0 else f"M/G/1 (cv²={cv2:.2g})"
    line = ax.plot(grid, theory.mg1_mean_response_ms(grid, service_ms, cv2), color=color,
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
    ax = _axes(ax)
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
