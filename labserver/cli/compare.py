"""``labserver compare`` (every strategy of a task under the same load: a table, a results
folder, plots) and ``labserver plot`` (redraw a results folder from its saved records).

Only flags and progress lines: the runs, the table and the plots are
``labserver.experiments.compare``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_compare", "add_plot", "cmd_compare", "cmd_plot"]


def add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="the main job: every strategy, same load, table + results/ + plots")
    p.add_argument("--task", default="encode", choices=["encode", "generate"],
                   help="encode: the encoder strategies on minilm; generate: the gen-* strategies on smollm2")
    p.add_argument("--quick", action="store_true", help="about 2 minutes instead of about 7 (encode)")
    p.add_argument("--strategies", help="comma-separated (default: every strategy of the task)")
    p.add_argument("--model", default=None, help="(default: minilm, the embedded model)")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--rates", help="comma-separated offered req/s (default: 50,100,150,250,350, quick: 50,250; "
                                   "generate: 0.2,0.6,1.5, quick: 0.5,2)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run")
    p.add_argument("--max-batch", type=int, default=None, help="(default: 64)")
    p.add_argument("--slo-ms", type=float, default=None, help="goodput SLO (default: 500; generate: TTFT, 2000)")
    p.add_argument("--out", help="results folder (default: results/compare-<time>)")
    p.set_defaults(func=cmd_compare)


def add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="redraw the plots of a results folder from its saved records")
    p.add_argument("results_dir")
    p.set_defaults(func=cmd_plot)


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_compare(args: argparse.Namespace) -> int:
    from datetime import datetime

    from ..experiments import compare as cx  # the module

    out = Path(args.out) if args.out else Path("results") / datetime.now().strftime("compare-%Y%m%d-%H%M%S")
    generate = args.task == "generate"
    kind = cx.GenCompareConfig if generate else cx.CompareConfig
    given = dict(strategies=args.strategies.split(",") if args.strategies else None, model=args.model,
                 device=args.device, rates=_rates(args.rates) if args.rates else None, duration_s=args.duration,
                 max_batch_size=args.max_batch, **{"ttft_slo_ms" if generate else "slo_ms": args.slo_ms})
    overrides = {k: v for k, v in given.items() if v is not None}
    cfg = kind.quick(**overrides) if args.quick else kind(**overrides)
    what = f", outputs of {cfg.min_tokens}-{cfg.max_tokens} tokens" if isinstance(cfg, cx.GenCompareConfig) else ""
    print(f"labserver compare --task {cfg.task}: {', '.join(cfg.strategies)} on {cfg.model}, rates "
          f"{list(cfg.rates)} req/s, {cfg.duration_s:g}+{cfg.warmup_s:g} s each{what} -> {out}", file=sys.stderr)

    def progress(name: str, rate: float, result: Any) -> None:
        s = result.summary()
        line = f"  {name:>14} @ {rate:>5g}/s: ok {s['n_ok']:.0f}/{s['count']:.0f}, "
        if generate:
            line += (f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms, "
                     f"{s['token_throughput_tps']:.1f} tokens/s")
        else:
            line += f"p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms"
        print(line, file=sys.stderr)

    runs, summary = cx.compare(cfg, out, on_run=progress)
    print(cx.table(summary, cfg.task))
    for w in runs.warnings:
        print(f"warning: {w}", file=sys.stderr)
    files = "records.csv.gz, tokens.csv.gz, steps.csv.gz" if generate else "records.csv.gz, lag.csv.gz"
    print(f"wrote {out}/: {files}, summary.json, summary.csv, machine.json and PNG plots", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..experiments.compare import draw

    for path in draw(args.results_dir):
        print(path)
    return 0
