"""Experiments that join the parts: start a strategy, load it, keep what happened.

``compare`` is the main job (``labserver compare``): every strategy in turn on one
model, the same open-loop schedule at a few offered rates against each, then a
summary table, per-request records, event-loop lag, plots and a description of
the machine under ``results/<run>/``. ``draw`` redraws the plots from those files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from . import analysis, plots
from .arrivals import WordTexts
from .launch import ServerHandle, serve
from .loadgen import RECORD_COLUMNS, LoadResult, run_load_sync

logger = logging.getLogger(__name__)

ALL_STRATEGIES = ("naive", "per-fetch", "deadline", "thread", "adaptive")


@dataclass
class CompareConfig:
    strategies: Sequence[str] = ALL_STRATEGIES
    model: str = "minilm"
    device: str = "auto"
    rates: Sequence[float] = (25, 100, 200, 300)  # offered req/s; naive tops out near 120 on 2 CPU cores
    duration_s: float = 12.0  # measured part of each run, s
    warmup_s: float = 2.0  # sent before it and left out of the summaries, s
    arrival: str = "poisson"
    max_batch_size: int = 64
    max_wait_ms: float = 1.0  # the guide's 1 ms
    max_queue: int = 512  # circuit breaker: past this, 503 at once
    timeout_ms: float = 5000.0  # per-request deadline: 504 after it
    slo_ms: float = 500.0  # goodput counts answers within this
    min_words: int = 8  # request texts: seeded sentences of this many words...
    max_words: int = 24  # ...to this many (about 10-30 tokens)
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> CompareConfig:
        """About a minute on 2 CPU cores: two rates, short runs."""
        base: dict[str, Any] = dict(rates=(25, 200), duration_s=4.0, warmup_s=1.0)
        return cls(**{**base, **overrides})


@dataclass
class CompareResult:
    config: CompareConfig
    records: pd.DataFrame  # every request, with label (strategy) and rate columns
    summary: pd.DataFrame  # one row per (strategy, rate)
    lag: pd.DataFrame  # label, rate, t_s, lag_ms: the server's event-loop lag during each run
    warnings: list[str] = field(default_factory=list)
    out: Path | None = None


def machine_info(device: str = "auto") -> dict[str, Any]:
    """What the numbers were measured on: enough to tell two machines apart."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["cpu_affinity"] = len(psutil.Process().cpu_affinity() or [])
    except (ImportError, AttributeError):
        pass
    for pkg in ("torch", "transformers", "starlette", "uvicorn", "httpx", "labserver"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    info["device_requested"] = device
    return info


def lag_frame(handle: ServerHandle, since_s: float, until_s: float) -> pd.DataFrame:
    """The server's lag samples between two perf_counter readings, with t_s from since_s."""
    t0 = handle.runtime.lag.t0_s
    rows = [(t + t0 - since_s, lag) for t, lag in handle.loop_lag() if since_s <= t + t0 <= until_s]
    return pd.DataFrame(rows, columns=["t_s", "lag_ms"])


def load_once(handle: ServerHandle, cfg: CompareConfig, rate: float) -> tuple[LoadResult, pd.DataFrame]:
    payload = WordTexts(min_words=cfg.min_words, max_words=cfg.max_words)
    since = time.perf_counter()
    result = run_load_sync(
        handle.url, arrival=cfg.arrival, rate_per_s=rate, duration_s=cfg.duration_s + cfg.warmup_s,
        warmup_s=cfg.warmup_s, payload=payload, seed=cfg.seed, timeout_s=cfg.timeout_ms / 1000 + 30,
    )
    return result, lag_frame(handle, since, time.perf_counter())


def compare(cfg: CompareConfig | None = None, out: str | Path | None = None,
            on_run: Callable[[str, float, LoadResult], None] | None = None) -> CompareResult:
    """Run every strategy at every rate; write ``out`` (a results folder) when given."""
    cfg = cfg or CompareConfig()
    runs: list[tuple[str, float, LoadResult]] = []
    lags, warnings = [], []
    for name in cfg.strategies:
        with serve(name, cfg.model, device=cfg.device, max_batch_size=cfg.max_batch_size,
                   max_wait_ms=cfg.max_wait_ms, max_queue=cfg.max_queue, timeout_ms=cfg.timeout_ms) as h:
            # a few requests first: the first calls of a fresh model are slow (allocations, lazy init)
            run_load_sync(h.url, arrival="constant", rate_per_s=20, max_requests=10, progress=False)
            for rate in cfg.rates:
                result, lag = load_once(h, cfg, rate)
                runs.append((name, rate, result))
                lags.append(lag.assign(label=name, rate=rate))
                warnings += [f"{name} @ {rate:g}/s: {w}" for w in result.warnings]
                if on_run is not None:
                    on_run(name, rate, result)
    records = analysis.combine(runs)
    summary = analysis.summarize_runs(records, slo_ms=cfg.slo_ms)
    lag = pd.concat(lags, ignore_index=True) if lags else pd.DataFrame(columns=["label", "rate", "t_s", "lag_ms"])
    result = CompareResult(cfg, records, summary, lag, warnings)
    if out is not None:
        result.out = write(result, Path(out))
    return result


def write(result: CompareResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    result.records.to_csv(out / "records.csv", index=False)
    result.lag.to_csv(out / "lag.csv", index=False)
    result.summary.to_csv(out / "summary.csv", index=False)
    doc = {
        "config": asdict(result.config),
        "machine": machine_info(result.config.device),
        "warnings": result.warnings,
        "summary": json.loads(result.summary.to_json(orient="records")),
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "machine.json").write_text(json.dumps(doc["machine"], indent=1))
    draw(out)
    return out


def read(out: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    out = Path(out)
    # empty cells are missing numbers, but empty strings in text columns (error, dispatch)
    numeric = [c for c, dtype in RECORD_COLUMNS.items() if dtype != "str"] + ["rate"]
    records = pd.read_csv(out / "records.csv", keep_default_na=False, na_values={c: [""] for c in numeric})
    lag_path = out / "lag.csv"
    lag = pd.read_csv(lag_path) if lag_path.exists() else pd.DataFrame(columns=["label", "rate", "t_s", "lag_ms"])
    doc = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return records, lag, doc


def draw(out: str | Path) -> list[Path]:
    """(Re)draw every plot of a results folder from its saved records."""
    out = Path(out)
    records, lag, doc = read(out)
    slo_ms = (doc.get("config") or {}).get("slo_ms")
    summary = analysis.summarize_runs(records, slo_ms=slo_ms)
    top_rate = float(records["rate"].max()) if "rate" in records and len(records) else None
    written = []
    pictures: dict[str, Callable[[Any], Any]] = {
        "latency_cdf": lambda ax: plots.latency_cdf(records[records["rate"] == top_rate], ax),
        "latency_vs_throughput": lambda ax: plots.latency_vs_throughput(summary, ax, slo_ms=slo_ms),
        "batch_sizes": lambda ax: plots.batch_size_hist(records[records["rate"] == top_rate], ax),
        "batch_gantt": lambda ax: plots.batch_gantt(records[records["rate"] == top_rate], ax),
        "loop_lag": lambda ax: plots.loop_lag(lag[lag["rate"] == top_rate] if len(lag) else lag, ax),
    }
    from matplotlib.figure import Figure

    for name, draw_one in pictures.items():
        fig = Figure(figsize=(7.5, 4.5), layout="constrained")
        draw_one(fig.add_subplot())
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    fig = plots.overview(records, summary=summary, lag=lag if len(lag) else None, slo_ms=slo_ms,
                         title=f"labserver compare — {out.name}")
    fig.savefig(out / "overview.png", dpi=90)
    written.append(out / "overview.png")
    return written


def table(summary: pd.DataFrame) -> str:
    cols = [c for c in ("label", "rate", "throughput_rps", "p50_ms", "p99_ms", "goodput_rps", "mean_batch_size",
                        "n_503", "n_504", "n_500", "late_frac") if c in summary]
    view = summary[cols].rename(columns={"label": "strategy", "rate": "offered/s"})
    return view.to_string(index=False, float_format=lambda x: f"{x:.4g}" if not math.isnan(x) else "-")
