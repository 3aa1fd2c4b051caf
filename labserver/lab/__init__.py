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
* ``claim``, ``compare``, ``versus``, ``say``: a sentence about the numbers, checked against
  them (with a margin larger than the run's noise) and printed with them; a reading of a run
  rendered from its numbers;
* ``capacity``, ``time_batches``, ``padded_cost``: the model alone, timed
  (``labserver.experiments.modeltime``, re-exported);
* ``brief``, ``lag_sawtooth``: what a notebook prints and draws of a run; ``show_source``: the code a
  lesson teaches, printed as the code has it (``labserver.lab.source``; a test checks that a
  committed notebook's printed source is still the code's);
* ``simulated_serving``, ``md1_replay_ms``, ``sim_frames``: the virtual clock's runs for the
  notebooks (``labserver.experiments.simulated``, re-exported); ``masked_texts``: fill-mask
  inputs (``labserver.load.prompts``).

This module is not used by the server, the load generator or the CLI.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence

import pandas as pd

from ..analysis.trust import MIN_P99_SAMPLES, trusted
from ..experiments.modeltime import Capacity, PaddedCost, capacity, padded_cost, time_batches
from ..experiments.runs import Runs, lag_in_run_clock, load_rates, serve_and_load, warm_up
from ..experiments.simulated import A100_BERT_BASE_MS, cost_from_table, md1_replay_ms, sim_frames, simulated_serving
from ..load.prompts import masked_texts
from ..models.base import device_label
from .mode import QUICK_ENV, pick, quick_mode
from .claims import NOISE, Baseline, Claim, baseline, claim, compare, pct, saturated, say, spread, versus
from .source import show_source

__all__ = [
    "MIN_P99_SAMPLES",
    "PaddedCost",
    "QUICK_ENV",
    "Baseline",
    "Claim",
    "Runs",
    "baseline",
    "brief",
    "claim",
    "compare",
    "NOISE",
    "pct",
    "saturated",
    "say",
    "show_source",
    "spread",
    "versus",
    "capacity",
    "Capacity",
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
    "padded_cost",
    "time_batches",
    "warm_up",
]

logger = logging.getLogger(__name__)


BRIEF_COLUMNS = ("label", "rate", "count", "throughput_rps", "goodput_rps", "p50_ms", "p99_ms", "mean_ms",
                 "mean_batch_size", "n_503", "n_504", "n_500", "late_frac")


# ---------------------------------------------------------------- the notebook's setting


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

    The trust rules of ``labserver.analysis.trust`` apply: a tail percentile over too few
    answers (a p99 under ``MIN_P99_SAMPLES``) is left empty, as the plots leave it out, and a
    note says so. How late the load generator's sends were is said once, in the table:
    ``late_p99_ms`` beside ``late_frac``, and a ``late_matters`` column only when some run's
    lateness was large beside its latency.
    """
    wanted = list(columns) + [c for c in ("late_frac", "late_p99_ms") if c not in columns]
    if "late_matters" in summary.columns and summary["late_matters"].fillna(False).astype(bool).any():
        wanted.append("late_matters")
    view = trusted(summary)[[c for c in wanted if c in summary.columns]].copy()
    floats = view.select_dtypes("float").columns
    view[floats] = view[floats].round(digits)
    if "late_frac" in view.columns:
        view["late_frac"] = summary["late_frac"].round(3)
    blanked = [c for c in view.columns if c in summary.columns and view[c].isna().sum() > summary[c].isna().sum()]
    if blanked:
        print(f"({', '.join(blanked)} left out where fewer than {MIN_P99_SAMPLES} answers back a p99: "
              "see max or p90)")
    return view
