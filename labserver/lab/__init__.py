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
* ``capacity``: the model alone, its throughput with the conditions it depended on;
* ``brief``, ``lag_sawtooth``: what a notebook prints and draws of a run;
* ``time_batches``: the model alone, timed at several batch sizes;
* ``sim_frames``: virtual-clock runs (``labserver.engine.virtual``) as frames the plots take.

This module is not used by the server, the load generator or the CLI.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..analysis.trust import MIN_P99_SAMPLES, trusted
from ..engine.virtual import SimRun
from ..experiments.runs import Runs, lag_in_run_clock, load_rates, serve_and_load, warm_up
from ..load.arrivals import WORDS, WordTexts
from .mode import QUICK_ENV, pick, quick_mode
from .claims import NOISE, Claim, claim, compare, pct, saturated, say, spread, versus

__all__ = [
    "MIN_P99_SAMPLES",
    "PaddedCost",
    "QUICK_ENV",
    "Claim",
    "Runs",
    "brief",
    "claim",
    "compare",
    "NOISE",
    "saturated",
    "say",
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


def device_label(device: str = "auto") -> str:
    """A short description of where a model would run: ``cpu (2 threads)``, ``cuda (NVIDIA ...)``."""
    from ..models.base import pick_device

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


@dataclass
class Capacity:
    """What a model sustains alone (no server, no client), with the conditions it depended on."""

    items_per_s: float
    ms_per_call: float
    batch: int
    device: str  # "cpu (2 threads)", "cuda (NVIDIA H100 ...)"
    tokens: str  # the texts' length in tokens: "9-17 tokens (median 12)"
    calls: int  # timed calls; the median is kept
    spread: float  # relative spread of those calls, (max - min) / median

    def __str__(self) -> str:
        return (f"{self.items_per_s:.1f} texts/s alone ({self.ms_per_call:.1f} ms per call): batch {self.batch}, "
                f"{self.device}, texts of {self.tokens}, median of {self.calls} calls (spread {pct(self.spread)})")


def capacity(model: Any, texts: Sequence[str], *, batch: int = 1, calls: int = 20, warm: int = 3) -> Capacity:
    """The model's standalone capacity at ``batch`` texts per call, printed with its conditions.

    One definition for every lesson that needs a capacity: the median of ``calls`` timed calls
    over consecutive batches of ``texts`` (after ``warm`` untimed ones). A served capacity is
    lower by what the server, the event loop and the load generator take from the same cores;
    notebooks that serve the model say by how much.
    """
    pool = list(texts)
    for k in range(warm):
        model(pool[k * batch % len(pool):][:batch] or pool[:batch])
    took = []
    for k in range(calls):
        start = k * batch % len(pool)
        chunk = (pool[start:] + pool)[:batch]
        t = time.perf_counter()
        model(chunk)
        took.append((time.perf_counter() - t) * 1000)
    ms = float(np.median(took))
    tokenizer = getattr(model, "tokenizer", None) or getattr(getattr(model, "pipe", None), "tokenizer", None)
    if tokenizer is not None:
        lengths = np.array([len(tokenizer(text)["input_ids"]) for text in pool])
        tokens = f"{lengths.min()}-{lengths.max()} tokens (median {np.median(lengths):.0f})"
    else:
        words = np.array([len(text.split()) for text in pool])
        tokens = f"{words.min()}-{words.max()} words (median {np.median(words):.0f})"
    dev = getattr(model, "device", None) or getattr(getattr(model, "pipe", None), "device", None)  # (fill-mask)
    return Capacity(items_per_s=batch * 1000 / ms, ms_per_call=ms, batch=batch,
                    device=device_label(str(dev)) if dev is not None else device_label("cpu"), tokens=tokens,
                    calls=calls, spread=spread(took))


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


@dataclass(frozen=True)
class PaddedCost:
    """A model's measured cost of a padded batch: ``n`` texts padded to ``longest`` tokens.

    ``table`` holds the timings (columns ``size``, ``tokens``, ``ms``: the median of the calls);
    ``a + b * n * longest + c * n * longest**2`` is fitted to them by least squares on relative errors
    (the last term: attention, quadratic in the length), the cost the virtual clock charges a batch.
    """

    a: float
    b: float
    c: float
    table: pd.DataFrame

    def __call__(self, n: int, longest: int) -> float:
        return self.a + self.b * n * longest + self.c * n * longest**2

    def worst_error(self) -> float:
        """The largest relative gap between the fit and a timing."""
        fit = np.array([self(n, t) for n, t in zip(self.table["size"], self.table["tokens"])])
        return float(np.max(np.abs(fit - self.table["ms"]) / self.table["ms"]))

    def __str__(self) -> str:
        return (f"cost(n, longest) = {self.a:.2f} + {self.b * 1000:.3f} n*longest us + {self.c * 1e6:.3f} "
                f"n*longest^2 ns (ms; fitted to {len(self.table)} timings, worst gap {pct(self.worst_error())})")


def padded_cost(model: Any, sizes: Sequence[int] = (1, 8, 32), lengths: Sequence[int] = (8, 32, 128, 256), *,
                repeats: int = 3) -> PaddedCost:
    """Time ``model`` on batches of ``n`` texts of exactly ``tokens`` tokens each (built-in words, one token each,
    plus the model's two special tokens), at every pair, and fit ``PaddedCost`` to the timings."""
    rows = []
    model([WORDS[0]])  # warm
    for tokens in lengths:
        text = " ".join(WORDS[k % len(WORDS)] for k in range(max(1, tokens - 2)))
        for n in sizes:
            took = []
            for _ in range(repeats):
                t = time.perf_counter()
                model([text] * n)
                took.append((time.perf_counter() - t) * 1000)
            rows.append({"size": n, "tokens": tokens, "ms": float(np.median(took))})
    table = pd.DataFrame(rows)
    x = np.column_stack([np.ones(len(table)), table["size"] * table["tokens"], table["size"] * table["tokens"] ** 2])
    ms = table["ms"].to_numpy()
    # relative errors (each row over its own time): a plain fit would serve the big batches and miss the small
    a, b, c = np.linalg.lstsq(x / ms[:, None], np.ones(len(ms)), rcond=None)[0]
    return PaddedCost(max(0.0, float(a)), max(0.0, float(b)), max(0.0, float(c)), table)


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
    from ..engine.virtual import simulate
    from ..strategies import Limits, make_strategy

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
    from ..engine.virtual import simulate
    from ..strategies import make_strategy

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
