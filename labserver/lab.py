"""What the notebooks share: quick-mode parameters, a device check, and experiments in one call.

The notebooks in ``notebooks/`` import everything reusable and define nothing
(STYLE.md: a cell sets parameters, calls the package, and plots). What they need
beyond ``serve``, ``run_load_sync`` and the plots lives here:

* ``quick_mode`` / ``pick``: every notebook shrinks its parameters when the
  environment variable ``LABSERVER_QUICK=1`` is set (the test suite does);
* ``gpu_available`` / ``device_label``: whether torch sees a CUDA GPU;
* ``serve_and_load`` / ``load_rates`` / ``Runs``: the experiment driver of
  ``labserver.experiments.runs``, re-exported: start each strategy in turn, warm it
  up, load it at several offered rates, stop it, and keep the records, tokens, step
  log, the server's event-loop lag and the /health probes in one clock;
* ``claim``: a sentence about the numbers, checked against them and printed with them;
* ``brief``, ``lag_sawtooth``: what a notebook prints and draws of a run;
* ``time_batches``: the model alone, timed at several batch sizes;
* ``sim_frames``: virtual-clock runs (``labserver.engine.virtual``) as frames the plots take.

This module is not used by the server, the load generator or the CLI.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from .engine.virtual import SimRun
from .experiments.runs import Runs, lag_in_run_clock, load_rates, serve_and_load, warm_up
from .load.arrivals import WORDS, WordTexts

__all__ = [
    "MIN_P99_SAMPLES",
    "QUICK_ENV",
    "Claim",
    "Runs",
    "brief",
    "claim",
    "device_label",
    "gpu_available",
    "lag_in_run_clock",
    "lag_sawtooth",
    "load_rates",
    "masked_texts",
    "md1_replay_ms",
    "A100_BERT_BASE_MS",
    "cost_from_table",
    "simulated_serving",
    "pick",
    "quick_mode",
    "serve_and_load",
    "setup_notebook",
    "sim_frames",
    "time_batches",
    "warm_up",
]

logger = logging.getLogger(__name__)

QUICK_ENV = "LABSERVER_QUICK"
T = TypeVar("T")

MIN_P99_SAMPLES = 300  # answers below which a p99 is not reported (it would be one or two requests)
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
    from .models.base import pick_device

    dev = pick_device(device)
    import torch

    if dev.startswith("cuda"):
        return f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    threads = torch.get_num_threads()
    return f"{dev} ({threads} thread{'' if threads == 1 else 's'})"


# ---------------------------------------------------------------- what the runs showed


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


def brief(summary: pd.DataFrame, columns: Sequence[str] = BRIEF_COLUMNS, digits: int = 1) -> pd.DataFrame:
    """The columns of a summary worth reading in a notebook, rounded; absent ones skipped.

    A p99 over fewer than ``MIN_P99_SAMPLES`` answers says little (its one or two slowest
    requests): such cells are left empty, and a note says so. The share of late sends
    (``late_frac``) is always shown when the summary has it.
    """
    wanted = list(columns) + (["late_frac"] if "late_frac" not in columns else [])
    view = summary[[c for c in wanted if c in summary.columns]].copy()
    floats = view.select_dtypes("float").columns
    view[floats] = view[floats].round(digits)
    if "late_frac" in view.columns:
        view["late_frac"] = summary["late_frac"].round(3)
    tails = [c for c in view.columns if "p99" in c and not c.startswith("itl")]  # ITL pools every gap
    if tails and "n_ok" in summary.columns:
        few = summary["n_ok"] < MIN_P99_SAMPLES
        if few.any():
            view.loc[few, tails] = np.nan
            print(f"(p99 left out of {int(few.sum())} row(s) with fewer than {MIN_P99_SAMPLES} answers: "
                  "see their max or p90)")
    return view


# ---------------------------------------------------------------- claims: words that hold on the output


@dataclass
class Claim:
    """One sentence a notebook states about its own numbers, checked against them."""

    statement: str  # what the lesson says, in words
    holds: bool  # whether the numbers just measured bear it out
    evidence: str  # the numbers, as measured
    why_it_may_not: str = ""  # what can make it fail here (small samples, a busy machine, ...)

    def __str__(self) -> str:
        if self.holds:
            return f"✔ holds here: {self.statement} ({self.evidence})"
        why = f" — why it may not: {self.why_it_may_not}" if self.why_it_may_not else ""
        return f"✘ DOES NOT HOLD here: {self.statement} ({self.evidence}){why}"

    def _ipython_display_(self) -> None:
        """Printed once by ``claim``; a cell that ends with it shows nothing more."""


def claim(statement: str, holds: bool, evidence: str, why_it_may_not: str = "") -> Claim:
    """State a claim, check it against numbers just measured, and print it with them.

    ``claim("continuous's p99 TTFT is under half of static's", ratio <= 0.5, f"{c:.0f} vs {s:.0f} ms")``
    prints a mark (holds / does not hold here), the statement and its evidence. A notebook's
    markdown then only repeats what such a line (or a printed table) showed, so a re-run with
    other numbers cannot leave its words behind. A claim that does not hold goes to stderr
    (shown in red in Jupyter), with ``why_it_may_not``; in quick mode every claim is marked
    as such, since tiny runs say little. Nothing is raised: the lesson goes on.
    """
    result = Claim(statement, bool(holds), evidence, why_it_may_not)
    text = str(result) + (" [quick mode: small samples]" if quick_mode() else "")
    print(text, file=sys.stdout if result.holds else sys.stderr)
    return result


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

# A GPU's cost curve for a model of the guide's size, to simulate what this CPU cannot show:
# BERT-Base, sequence length 128, FP16, TensorRT, average latency (ms) per batch size on an
# NVIDIA A100 (40 GB), from the "Inference performance: NVIDIA A100" table of the README of
# NVIDIA/TensorRT's demo/BERT. An optimised engine: eager PyTorch adds a per-call overhead.
A100_BERT_BASE_MS = {1: 0.67, 2: 0.83, 4: 1.02, 8: 1.38, 12: 1.87, 16: 2.18, 24: 3.34, 32: 4.10, 64: 8.05,
                     128: 16.14}


def cost_from_table(table: Mapping[int, float]) -> Any:
    """A batch cost function (size -> ms) through a table's points, linear in between and past the ends."""
    sizes = np.array(sorted(table), dtype=float)
    ms = np.array([table[int(k)] for k in sizes], dtype=float)

    def cost_ms(n: int) -> float:
        if n <= sizes[-1]:
            return float(np.interp(n, sizes, ms))
        slope = (ms[-1] - ms[-2]) / (sizes[-1] - sizes[-2])
        return float(ms[-1] + slope * (n - sizes[-1]))

    return cost_ms


def simulated_serving(cost_ms: Any, strategies: Sequence[str], rates: Sequence[float], *, n: int = 3000,
                      max_batch_size: int = 32, max_wait_ms: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """Each strategy's rule on a virtual clock over a cost curve, at each offered Poisson rate.

    No HTTP and no client: only the model's time (``cost_ms(batch size)``) and the rule. One
    row per (strategy, rate): ``throughput_rps`` (requests over the span from the first
    arrival to the last answer), latency ``p50_ms``/``p99_ms``/``mean_ms`` and ``mean_batch``.
    """
    from .engine.virtual import simulate
    from .strategies import Limits, make_strategy

    rows = []
    for rate in rates:
        arrivals = np.cumsum(np.random.default_rng([seed, round(rate * 1000)]).exponential(1 / rate, n))
        for name in strategies:
            run = simulate(make_strategy(name, Limits(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)),
                           arrivals.tolist(), cost_ms)
            end_s = max(b.dispatched_s + b.compute_ms / 1000 for b in run.batches)
            lat = np.asarray(run.latencies_ms)
            rows.append({"label": name, "rate": float(rate), "throughput_rps": n / (end_s - arrivals[0]),
                         "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                         "mean_ms": float(lat.mean()), "mean_batch": float(np.mean(run.sizes))})
    return pd.DataFrame(rows)


def md1_replay_ms(records: pd.DataFrame, service_ms: float | Sequence[float]) -> np.ndarray:
    """The latency each request of a naive run would have had on an exact single-server queue.

    The run's own scheduled send times are replayed through the ``naive`` rule on a virtual
    clock, each request served in ``service_ms`` (one number: M/D/1; one per request, in
    schedule order: that request's own service time): the queueing of *these* arrivals
    with no noise, to hold the measurement against (the Pollaczek-Khinchine mean averages
    over all arrival sequences; one run of a few hundred requests can sit well off it).
    Rows in the order of ``scheduled_s``; warm-up rows included.
    """
    from .engine.virtual import simulate
    from .strategies import make_strategy

    scheduled = np.sort(records["scheduled_s"].to_numpy(dtype=float))
    costs = iter(np.broadcast_to(np.asarray(service_ms, dtype=float), scheduled.shape).tolist())
    return np.asarray(simulate(make_strategy("naive"), scheduled.tolist(), lambda n: next(costs)).latencies_ms)


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
