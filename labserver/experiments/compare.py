"""``labserver compare``, the main job: every strategy, the same load, a table, files and plots.

``compare(cfg)`` starts every strategy in turn on one model (loaded once), loads it
with the same open-loop schedule at a few offered rates (``experiments.runs``), and
writes under ``out``: per-request records, the summary (CSV and JSON, with the config
and the machine), the server's event-loop lag and, for generation, every token's
arrival and the step log, then the plots. ``draw(out)`` redraws the plots from those
files. ``CompareConfig`` is the encoder job (``--task encode``, on the embedded
model); ``GenCompareConfig`` the generation job (``--task generate``, on smollm2).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from .. import analysis, plots
from ..load.arrivals import WordTexts
from ..load.lengths import UniformLength
from ..load.results import RECORD_COLUMNS, LoadResult
from ..models import load_model
from .runs import Runs, machine_info, serve_and_load

logger = logging.getLogger(__name__)

__all__ = ["CompareConfig", "GenCompareConfig", "compare", "draw", "read", "save_table", "table", "table_path", "write"]


@dataclass
class CompareConfig:
    """The encoder job: the encoder strategies on the embedded model."""

    task: ClassVar[str] = "encode"
    strategies: Sequence[str] = ("naive", "per-fetch", "deadline", "thread", "adaptive")
    model: str = "minilm"
    device: str = "auto"
    # offered req/s, around each strategy's knee on 2 CPU cores: naive's is near 100, the batching rules' near 250
    rates: Sequence[float] = (50, 100, 150, 250, 350)
    duration_s: float = 12.0  # measured part of each run, s
    warmup_s: float = 2.0  # sent before it and left out of the summaries, s
    max_batch_size: int = 64
    max_wait_ms: float = 1.0  # the guide's 1 ms
    max_queue: int = 256  # circuit breaker: past this, 503 at once
    # The client must not stand between the load and the server. A strategy that computes on
    # the event loop cannot even read the requests it would turn away while a batch runs, so at
    # 350/s they pile up unread, ~2,000 by a run's end on 2 cores (measured): a window of 512
    # held the rest back (client_overflow) and the server saw a gentler load than asked.
    # Three processes keep each under select()'s 1,024 descriptors, whose timers send on time.
    max_in_flight: int = 2850
    load_processes: int = 3
    timeout_ms: float | None = 5000.0  # per-request deadline: 504 after it
    slo_ms: float = 500.0  # goodput counts answers within this
    min_words: int = 8  # request texts: seeded sentences of this many words...
    max_words: int = 24  # ...to this many (about 10-30 tokens)
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """About a minute on 2 CPU cores: two rates, short runs."""
        return cls(**{"rates": (50, 250), "duration_s": 4.0, "warmup_s": 1.0, **overrides})

    def payload(self) -> WordTexts:
        return WordTexts(min_words=self.min_words, max_words=self.max_words)

    def server_options(self) -> dict[str, Any]:
        return {"device": self.device, "max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms,
                "max_queue": self.max_queue, "timeout_ms": self.timeout_ms}

    def load_options(self) -> dict[str, Any]:
        return {"timeout_s": (self.timeout_ms or 60_000) / 1000 + 30, "max_in_flight": self.max_in_flight,
                "processes": self.load_processes}

    def lesson_rates(self, rates: Sequence[float]) -> dict[str, float]:
        """The offered rate each picture is drawn at: where its lesson shows.

        The latency CDF and the loop lag at the middle rate (past naive's knee, below the
        batching rules'), batch sizes and the batch Gantt at the second highest (busy, so
        batches form, but not yet drowning in 503s).
        """
        ordered = sorted(rates)
        middle, busy = ordered[len(ordered) // 2], ordered[-2] if len(ordered) > 1 else ordered[-1]
        return {"latency_cdf": middle, "loop_lag": middle, "batch_sizes": busy, "batch_gantt": busy}

    def summarize(self, runs: Runs) -> pd.DataFrame:
        return runs.summary(self.slo_ms)


@dataclass
class GenCompareConfig(CompareConfig):
    """The generation job: the gen-* strategies on smollm2, the embedded generator (every gen-* default)."""

    task: ClassVar[str] = "generate"
    strategies: Sequence[str] = ("gen-naive", "gen-static", "gen-continuous", "gen-hf-cb")
    model: str = "smollm2"
    # offered requests/s, answers of 136 tokens on average: on 2 CPU cores from under one stream's pace (gen-naive's
    #   capacity) to past a static batch's (results/realmodel: smollm2's tokens/s at 1 and 16 streams)
    rates: Sequence[float] = (0.2, 0.6, 1.5)
    duration_s: float = 60.0
    warmup_s: float = 5.0
    max_batch_size: int = 16  # sequences decoded together
    max_kv_tokens: int | None = None
    max_queue: int = 256
    timeout_ms: float | None = 30_000.0  # no first token by then: 504 (an overloaded run ends instead of queueing)
    min_tokens: int = 16  # output lengths: uniform in [min_tokens, max_tokens]
    max_tokens: int = 256
    ttft_slo_ms: float = 2000.0  # goodput: a request is good with TTFT and TPOT within these
    tpot_slo_ms: float = 250.0

    @classmethod
    def quick(cls, **overrides: Any) -> GenCompareConfig:
        """A few minutes on 2 CPU cores: two rates, short outputs, short runs (still smollm2)."""
        return cls(**{"rates": (0.5, 2.0), "duration_s": 10.0, "warmup_s": 1.0, "min_tokens": 8, "max_tokens": 32,
                      "ttft_slo_ms": 2000.0, "tpot_slo_ms": 250.0, **overrides})

    def payload(self) -> WordTexts:
        return WordTexts(min_words=self.min_words, max_words=self.max_words, dist="uniform")

    def lengths(self) -> UniformLength:
        return UniformLength(self.min_tokens, self.max_tokens)

    def server_options(self) -> dict[str, Any]:
        return {"device": self.device, "max_batch_size": self.max_batch_size, "max_kv_tokens": self.max_kv_tokens,
                "max_queue": self.max_queue, "timeout_ms": self.timeout_ms, "max_new_tokens": max(self.max_tokens, 1)}

    def load_options(self) -> dict[str, Any]:
        return {"timeout_s": 1800.0}

    def summarize(self, runs: Runs) -> pd.DataFrame:
        summary = runs.summary(ttft_slo_ms=self.ttft_slo_ms, tpot_slo_ms=self.tpot_slo_ms)
        return summary.merge(runs.idle_share(), on=["label", "rate"], how="left")


def compare(cfg: CompareConfig | None = None, out: str | Path | None = None,
            on_run: Callable[[str, float, LoadResult], None] | None = None) -> tuple[Runs, pd.DataFrame]:
    """Run every strategy at every rate; write ``out`` (a results folder) when given.

    ``on_run(label, rate, result)`` is called after each run (the CLI prints progress with it).
    """
    cfg = cfg or CompareConfig()
    generate = cfg.task == "generate"
    model = load_model(cfg.model, device=cfg.device, kind=cfg.task)
    runs = serve_and_load(cfg.strategies, model, cfg.rates, duration_s=cfg.duration_s, warmup_s=cfg.warmup_s,
                          payload=cfg.payload(), seed=cfg.seed, mode="generate" if generate else "text",
                          new_tokens=cfg.lengths() if isinstance(cfg, GenCompareConfig) else 64,
                          load_options=cfg.load_options(), on_run=on_run, **cfg.server_options())
    summary = cfg.summarize(runs)
    if out is not None:
        write(runs, summary, cfg, Path(out))
    return runs, summary


def write(runs: Runs, summary: pd.DataFrame, cfg: CompareConfig, out: Path) -> Path:
    """Save a comparison: its tables gzipped (``records.csv.gz`` ...), its summary, machine and plots."""
    out.mkdir(parents=True, exist_ok=True)
    save_table(runs.records, out / "records.csv")
    save_table(runs.lag, out / "lag.csv")
    if cfg.task == "generate":
        save_table(runs.tokens, out / "tokens.csv")
        steps = runs.steps.assign(**{c: runs.steps[c].map(_ids) for c in _ID_COLUMNS if c in runs.steps})
        save_table(steps, out / "steps.csv")
    summary.to_csv(out / "summary.csv", index=False)
    doc = {"task": cfg.task, "config": asdict(cfg), "machine": machine_info(cfg.device),
           "warnings": runs.warnings, "summary": json.loads(summary.to_json(orient="records"))}
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "machine.json").write_text(json.dumps(doc["machine"], indent=1))
    draw(out)
    return out


def save_table(table: pd.DataFrame, path: Path) -> Path:
    """``path`` + ``.gz``: a run's table to the microsecond (times in s to 6 places, in ms to 3), gzipped.

    A 16-run comparison's records are ~60,000 rows; written at full float precision they
    took 12 MB, to the microsecond and gzipped about 2.4 MB. No figure it is read back for
    (a percentile, a plot) moves by more than a microsecond.
    """
    places = {c: 6 if c.endswith("_s") else 3 for c in table.select_dtypes("float").columns
              if c.endswith(("_s", "_ms"))}
    target = path.with_name(path.name + ".gz")
    table.round(places).to_csv(target, index=False, compression={"method": "gzip", "mtime": 0})
    return target


def table_path(out: Path, name: str) -> Path | None:
    """``out/name.csv.gz``, else a plain ``out/name.csv`` (as older results folders hold it), else None."""
    for path in (out / f"{name}.csv.gz", out / f"{name}.csv"):
        if path.exists():
            return path
    return None


_ID_COLUMNS = ("seqs", "idle", "decoding")  # a step's sequence ids, written "3 5 8"


def _ids(ids: Sequence[int]) -> str:
    return " ".join(str(i) for i in ids)


def _parse_ids(text: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split()) if isinstance(text, str) else ()


def read(out: str | Path) -> tuple[Runs, dict[str, Any]]:
    """A results folder back as ``Runs`` and its ``summary.json`` document."""
    out = Path(out)
    # empty cells are missing numbers, but empty strings in text columns (error, dispatch)
    numeric = [c for c, dtype in RECORD_COLUMNS.items() if dtype != "str"] + ["rate"]
    where = table_path(out, "records")
    if where is None:
        raise FileNotFoundError(f"{out} holds no records.csv.gz (or records.csv): not a results folder")
    records = pd.read_csv(where, keep_default_na=False, na_values={c: [""] for c in numeric})
    runs = Runs(records)
    if (where := table_path(out, "lag")) is not None:
        runs.lag = pd.read_csv(where)
    if (where := table_path(out, "tokens")) is not None:
        runs.tokens = pd.read_csv(where)
    if (where := table_path(out, "steps")) is not None:
        steps = pd.read_csv(where, keep_default_na=False)
        runs.steps = steps.assign(**{c: steps[c].map(_parse_ids) for c in _ID_COLUMNS if c in steps})
    doc = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return runs, doc


def draw(out: str | Path) -> list[Path]:
    """(Re)draw every plot of a results folder from its saved files."""
    from matplotlib.figure import Figure

    out = Path(out)
    runs, doc = read(out)
    cfg = doc.get("config") or {}
    generate = doc.get("task") == "generate" or len(runs.tokens) > 0
    records = runs.records
    top = float(records["rate"].max()) if len(records) else math.nan
    at_top = records[records["rate"] == top]
    run_name = out.name
    if generate:
        summary = runs.summary(ttft_slo_ms=cfg.get("ttft_slo_ms"), tpot_slo_ms=cfg.get("tpot_slo_ms"))
        steps_top = runs.steps[runs.steps["rate"] == top] if len(runs.steps) else runs.steps
        pictures: dict[str, Callable[[Any], Any]] = {
            "ttft_cdf": lambda ax: plots.ttft_cdf(at_top, ax),
            "tpot_cdf": lambda ax: plots.tpot_cdf(at_top, ax),
            "token_throughput": lambda ax: plots.token_throughput_vs_rate(summary, ax),
            "ttft_vs_rate": lambda ax: plots.ttft_vs_rate(summary, ax, slo_ms=cfg.get("ttft_slo_ms")),
            "kv_tokens": lambda ax: plots.kv_tokens(steps_top, ax, capacity=cfg.get("max_kv_tokens")),
        }
        for label in pd.unique(records["label"]):
            pictures[f"steps_{label}"] = (lambda lab: lambda ax: plots.step_gantt(steps_top, ax, label=lab))(label)
        overview = plots.generation_overview(records, summary, runs.steps, runs.tokens, slo_ms=cfg.get("ttft_slo_ms"),
                                             title=f"labserver compare --task generate — {out.name}")
    else:
        slo_ms = cfg.get("slo_ms")
        summary = runs.summary(slo_ms)
        lag = runs.lag
        at = CompareConfig.lesson_rates(CompareConfig(), pd.unique(records["rate"]).tolist()) if len(records) else {}

        def at_rate(frame: pd.DataFrame, picture: str) -> pd.DataFrame:
            return frame[frame["rate"] == at[picture]] if len(frame) else frame

        def titled(ax: Any, what: str, picture: str) -> Any:
            ax.set_title(f"{what}, {at[picture]:g} req/s offered ({run_name})")
            return ax

        pictures = {
            "latency_cdf": lambda ax: titled(plots.latency_cdf(at_rate(records, "latency_cdf"), ax),
                                             "Latency", "latency_cdf"),
            "latency_vs_throughput": lambda ax: plots.latency_vs_throughput(summary, ax, slo_ms=slo_ms).set_title(
                f"Latency vs throughput, every offered rate ({run_name})"),
            "batch_sizes": lambda ax: titled(plots.batch_size_hist(at_rate(records, "batch_sizes"), ax, weight="share"),
                                             "Batch sizes", "batch_sizes"),
            "batch_gantt": lambda ax: titled(plots.batch_gantt(at_rate(records, "batch_gantt"), ax),
                                             "Batches over time", "batch_gantt"),
            "loop_lag": lambda ax: titled(plots.loop_lag(at_rate(lag, "loop_lag"), ax), "Event-loop lag", "loop_lag"),
        }
        overview = plots.overview(records, summary=summary, lag=lag if len(lag) else None, slo_ms=slo_ms,
                                  rate=at.get("batch_gantt"), cdf_rate=at.get("latency_cdf"),
                                  title=f"labserver compare — {run_name}")
    written = []
    for name, draw_one in pictures.items():
        fig = Figure(figsize=(7.5, 4.5), layout="constrained")
        draw_one(fig.add_subplot())
        fig.savefig(out / f"{name}.png", dpi=110)
        written.append(out / f"{name}.png")
    overview.savefig(out / "overview.png", dpi=90)
    return [*written, out / "overview.png"]


TABLE_COLUMNS = {
    "encode": ("label", "rate", "throughput_rps", "p50_ms", "p99_ms", "goodput_rps", "mean_batch_size", "n_503",
               "n_504", "n_500", "err_client_overflow", "late_frac", "late_p99_ms"),
    "generate": ("label", "rate", "throughput_rps", "token_throughput_tps", "ttft_p50_ms", "ttft_p99_ms",
                 "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "gen_goodput_rps", "idle_share", "n_503", "late_frac", "late_p99_ms"),
}


def table(summary: pd.DataFrame, task: str = "encode") -> str:
    """The summary's columns worth printing, as text."""
    cols = [c for c in TABLE_COLUMNS[task] if c in summary]
    if "late_matters" in summary and summary["late_matters"].fillna(False).astype(bool).any():
        cols.append("late_matters")  # only where some run's late sends were large beside its latency
    view = analysis.trusted(summary)[cols].rename(columns={"label": "strategy", "rate": "offered/s", "err_client_overflow": "unsent"})
    return view.to_string(index=False, float_format=lambda x: f"{x:.4g}" if not math.isnan(x) else "-")
