"""Generation experiments: start each gen-* strategy, load it at a few offered rates, keep everything.

``run_gen`` is what notebook 7 calls and ``compare`` is ``labserver compare --task
generate``: every strategy in turn on one generative model, the same open-loop
schedule (Poisson arrivals, prompts and output lengths drawn from one seed) at
every offered rate, and for each run the client's records (TTFT, TPOT, end to
end), every token's arrival (``tokens``: ITL) and the server's step log
(``steps``: who was in each prefill and decode step, KV tokens). ``write`` saves
them as CSV beside a summary and the pictures of ``labserver.genplots``; ``draw``
redraws those from the files.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from . import analysis, genplots
from .arrivals import PayloadLike, WordTexts
from .genanalysis import combine_tokens
from .launch import ServerHandle, serve_each
from .lengths import LengthsLike, UniformLength
from .loadgen import LoadResult, run_load_sync

logger = logging.getLogger(__name__)

__all__ = ["GEN_STRATEGIES", "GenCompareConfig", "GenRuns", "compare", "draw", "run_gen", "steps_frame", "write"]

GEN_STRATEGIES = ("gen-naive", "gen-static", "gen-continuous", "gen-hf-cb")
STEP_COLUMNS = ["label", "rate", "step", "kind", "start_s", "end_s", "seqs", "idle", "kv_tokens", "kv_reserved"]


@dataclass
class GenCompareConfig:
    strategies: Sequence[str] = GEN_STRATEGIES
    model: str = "gpt2-random"
    device: str = "auto"
    # offered requests/s; on 2 CPU cores naive carries ~0.15, static ~0.35, continuous ~0.65 (benchmarks/genperf.py)
    rates: Sequence[float] = (0.15, 0.3, 0.6)
    duration_s: float = 60.0  # measured part of each run, s
    warmup_s: float = 5.0  # sent before it, left out of the summaries, s
    max_batch_size: int = 16  # sequences decoded together
    max_kv_tokens: int | None = None
    max_queue: int = 256
    timeout_ms: float | None = 30_000.0  # no first token by then: 504 (an overloaded run ends instead of queueing)
    min_tokens: int = 16  # output lengths: uniform in [min_tokens, max_tokens]
    max_tokens: int = 256
    min_words: int = 8  # prompts: seeded sentences of 8-24 words (about 10-30 tokens)
    max_words: int = 24
    ttft_slo_ms: float = 2000.0  # goodput: a request is good with TTFT and TPOT within these
    tpot_slo_ms: float = 250.0
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> GenCompareConfig:
        """A few minutes on 2 CPU cores: the small model, two rates, short outputs, short runs."""
        base: dict[str, Any] = dict(model="gpt2-tiny-random", rates=(5.0, 20.0), duration_s=5.0, warmup_s=1.0,
                                    min_tokens=8, max_tokens=64, ttft_slo_ms=500.0, tpot_slo_ms=50.0)
        return cls(**{**base, **overrides})

    def payload(self) -> WordTexts:
        return WordTexts(min_words=self.min_words, max_words=self.max_words, dist="uniform")

    def lengths(self) -> UniformLength:
        return UniformLength(self.min_tokens, self.max_tokens)


@dataclass
class GenRuns:
    """Several generation runs told apart by ``label`` and offered ``rate``."""

    records: pd.DataFrame  # one row per request (analysis.combine)
    tokens: pd.DataFrame  # label, rate, i, k, t_s: every token's arrival at the client
    steps: pd.DataFrame  # label, rate and the server's StepRecord fields (gen-hf-cb has none)
    warnings: list[str] = field(default_factory=list)

    def summary(self, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> pd.DataFrame:
        return analysis.summarize_runs(self.records, tokens=self.tokens, ttft_slo_ms=ttft_slo_ms,
                                       tpot_slo_ms=tpot_slo_ms)

    def idle_share(self) -> pd.DataFrame:
        """Per run: the share of decode work spent on sequences already finished (gen-static's waste)."""
        decode = self.steps[self.steps["kind"] == "decode"]
        if decode.empty:
            return pd.DataFrame(columns=["label", "rate", "idle_share"])
        sizes = decode.assign(work=decode["seqs"].map(len), idle_n=decode["idle"].map(len))
        table = sizes.groupby(["label", "rate"], sort=False)[["work", "idle_n"]].sum().reset_index()
        return table.assign(idle_share=table["idle_n"] / table["work"])[["label", "rate", "idle_share"]]


def steps_frame(handle: ServerHandle, since_s: float, label: str, rate: float) -> pd.DataFrame:
    """The server's steps that began at or after ``since_s`` (its clock), with run keys."""
    rows = [s for s in handle.steps() if s["start_s"] >= since_s]
    frame = pd.DataFrame(rows, columns=STEP_COLUMNS[2:])
    return frame.assign(label=label, rate=float(rate))[STEP_COLUMNS]


def load_rates(handle: ServerHandle, rates: Sequence[float], *, label: str, duration_s: float, warmup_s: float,
               payload: PayloadLike, new_tokens: LengthsLike, seed: int = 0,
               on_run: Callable[[str, float, LoadResult], None] | None = None, **options: Any) -> GenRuns:
    """Load one running generation server at each offered rate in turn (open loop, Poisson)."""
    runs, steps, warnings = [], [], []
    for rate in rates:
        since = time.perf_counter()
        # the schedule (arrivals, prompts, lengths) depends only on (seed, rate): every server, in any
        # list of rates, gets the same requests at the same rate
        result = run_load_sync(handle.url, mode="generate", arrival="poisson", rate_per_s=rate,
                               duration_s=duration_s + warmup_s, warmup_s=warmup_s, payload=payload,
                               new_tokens=new_tokens, seed=seed + round(rate * 1000),
                               **{"progress": False, **options})
        runs.append((label, rate, result))
        steps.append(steps_frame(handle, since, label, rate))
        warnings += [f"{label} @ {rate:g}/s: {w}" for w in result.warnings]
        if on_run is not None:
            on_run(label, rate, result)
    return GenRuns(analysis.combine(runs), combine_tokens(runs), pd.concat(steps, ignore_index=True), warnings)


def run_gen(strategies: Sequence[str] | Mapping[str, Mapping[str, Any]], model: Any, rates: Sequence[float], *,
            duration_s: float, warmup_s: float = 0.0, payload: PayloadLike | None = None,
            new_tokens: LengthsLike = 64, seed: int = 0, load_options: Mapping[str, Any] | None = None,
            on_run: Callable[[str, float, LoadResult], None] | None = None, **knobs: Any) -> GenRuns:
    """Start each strategy in turn, warm it up, load it at every rate, stop it.

    ``strategies`` is a list of names or ``{label: options}`` (options include
    ``strategy``; the rest go to ``labserver.serve`` for that server only, beside
    ``knobs``). ``model`` is a spec or, better, an object from
    ``labserver.genmodels.load_gen_model``, so it loads once for all of them.
    ``load_options`` go to the load generator (``timeout_s``, ``stream`` ...).
    """
    payload = payload if payload is not None else WordTexts(min_words=8, max_words=24, dist="uniform")
    parts = []
    for label, handle in serve_each(strategies, model, **knobs):
        # a few requests first: the first calls of a fresh model (and of transformers' manager) are slow
        run_load_sync(handle.url, mode="generate", arrival="constant", rate_per_s=2, max_requests=4, payload=payload,
                      new_tokens=8, process=False, progress=False, timeout_s=600)
        parts.append(load_rates(handle, rates, label=label, duration_s=duration_s, warmup_s=warmup_s,
                                payload=payload, new_tokens=new_tokens, seed=seed, on_run=on_run,
                                **dict(load_options or {})))
    return GenRuns(pd.concat([p.records for p in parts], ignore_index=True),
                   pd.concat([p.tokens for p in parts], ignore_index=True),
                   pd.concat([p.steps for p in parts], ignore_index=True),
                   [w for p in parts for w in p.warnings])


def compare(cfg: GenCompareConfig | None = None, out: str | Path | None = None,
            on_run: Callable[[str, float, LoadResult], None] | None = None) -> tuple[GenRuns, pd.DataFrame]:
    """``labserver compare --task generate``: every gen-* strategy at every rate; write ``out`` when given."""
    from .genmodels import load_gen_model

    cfg = cfg or GenCompareConfig()
    model = load_gen_model(cfg.model, device=cfg.device)
    runs = run_gen(cfg.strategies, model, cfg.rates, duration_s=cfg.duration_s, warmup_s=cfg.warmup_s,
                   payload=cfg.payload(), new_tokens=cfg.lengths(), seed=cfg.seed, on_run=on_run,
                   load_options={"timeout_s": 1800.0}, max_batch_size=cfg.max_batch_size,
                   max_kv_tokens=cfg.max_kv_tokens, max_queue=cfg.max_queue, timeout_ms=cfg.timeout_ms,
                   max_new_tokens=max(cfg.max_tokens, 1))
    summary = runs.summary(cfg.ttft_slo_ms, cfg.tpot_slo_ms)
    summary = summary.merge(runs.idle_share(), on=["label", "rate"], how="left")
    if out is not None:
        write(runs, summary, cfg, Path(out))
    return runs, summary


def write(runs: GenRuns, summary: pd.DataFrame, cfg: GenCompareConfig, out: Path) -> Path:
    from .experiment import machine_info

    out.mkdir(parents=True, exist_ok=True)
    runs.records.to_csv(out / "records.csv", index=False)
    runs.tokens.to_csv(out / "tokens.csv", index=False)
    steps = runs.steps.assign(seqs=runs.steps["seqs"].map(_ids), idle=runs.steps["idle"].map(_ids))
    steps.to_csv(out / "steps.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    doc = {"task": "generate", "config": asdict(cfg), "machine": machine_info(cfg.device),
           "warnings": runs.warnings, "summary": json.loads(summary.to_json(orient="records"))}
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "machine.json").write_text(json.dumps(doc["machine"], indent=1))
    draw(out)
    return out


def _ids(ids: Sequence[int]) -> str:
    return " ".join(str(i) for i in ids)


def _parse_ids(text: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split()) if isinstance(text, str) else ()


def read(out: str | Path) -> tuple[GenRuns, dict[str, Any]]:
    from .experiment import read as read_records

    out = Path(out)
    records, _, doc = read_records(out)
    tokens = pd.read_csv(out / "tokens.csv") if (out / "tokens.csv").exists() else pd.DataFrame()
    steps = pd.read_csv(out / "steps.csv", keep_default_na=False) if (out / "steps.csv").exists() \
        else pd.DataFrame(columns=STEP_COLUMNS)
    steps["seqs"], steps["idle"] = steps["seqs"].map(_parse_ids), steps["idle"].map(_parse_ids)
    return GenRuns(records, tokens, steps, doc.get("warnings", [])), doc


def draw(out: str | Path) -> list[Path]:
    """(Re)draw the pictures of a generation results folder from its saved files."""
    from matplotlib.figure import Figure

    out = Path(out)
    runs, doc = read(out)
    cfg = doc.get("config") or {}
    summary = runs.summary(cfg.get("ttft_slo_ms"), cfg.get("tpot_slo_ms"))
    top = float(runs.records["rate"].max()) if len(runs.records) else math.nan
    at_top = runs.records[runs.records["rate"] == top]
    steps_top = runs.steps[runs.steps["rate"] == top] if len(runs.steps) else runs.steps
    pictures: dict[str, Callable[[Any], Any]] = {
        "ttft_cdf": lambda ax: genplots.ttft_cdf(at_top, ax),
        "tpot_cdf": lambda ax: genplots.tpot_cdf(at_top, ax),
        "token_throughput": lambda ax: genplots.token_throughput_vs_rate(summary, ax),
        "ttft_vs_rate": lambda ax: genplots.ttft_vs_rate(summary, ax, slo_ms=cfg.get("ttft_slo_ms")),
        "kv_tokens": lambda ax: genplots.kv_tokens(steps_top, ax, capacity=cfg.get("max_kv_tokens")),
    }
    for label in pd.unique(runs.records["label"]):
        pictures[f"steps_{label}"] = (lambda lab: lambda ax: genplots.step_gantt(steps_top, ax, label=lab))(label)
    written = []
    for name, draw_one in pictures.items():
        fig = Figure(figsize=(7.5, 4.5), layout="constrained")
        draw_one(fig.add_subplot())
        fig.savefig(out / f"{name}.png", dpi=110)
        written.append(out / f"{name}.png")
    fig = genplots.generation_overview(runs.records, summary, runs.steps, runs.tokens,
                                       slo_ms=cfg.get("ttft_slo_ms"), title=f"labserver compare --task generate "
                                                                           f"— {out.name}")
    fig.savefig(out / "overview.png", dpi=90)
    return [*written, out / "overview.png"]


def table(summary: pd.DataFrame) -> str:
    cols = [c for c in ("label", "rate", "throughput_rps", "token_throughput_tps", "ttft_p50_ms", "ttft_p99_ms",
                        "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "gen_goodput_rps", "idle_share", "n_503")
            if c in summary]
    view = summary[cols].rename(columns={"label": "strategy", "rate": "offered/s"})
    return view.to_string(index=False, float_format=lambda x: f"{x:.4g}" if not math.isnan(x) else "-")
