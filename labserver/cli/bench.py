"""``labserver bench`` (one load run) and ``labserver sweep`` (the highest offered rate whose
p99 meets an SLO), each against a URL or a strategy started here for the run.

The load's flags are the shared group of ``args`` (``add_load_args``, ``load_options``);
sending is ``labserver.loadgen``'s, the summary and the bisection ``labserver.analysis``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import default_model
from .args import add_load_args, limits_from, load_options, wants_generation

__all__ = ["add_bench", "add_sweep", "cmd_bench", "cmd_sweep"]


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="one load run against a URL or a strategy started here")
    add_load_args(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--rate", type=float, help="open loop: offered req/s")
    shape.add_argument("--concurrency", type=int, help="closed loop: this many users")
    p.set_defaults(func=cmd_bench)


def add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="the highest offered rate whose p99 meets an SLO (bisection)")
    add_load_args(p)
    p.add_argument("--slo-p99-ms", type=float, required=True)
    p.add_argument("--start-rate", type=float, default=20.0, help="(default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.05, help="relative bracket to stop at (default: 5%%)")
    p.set_defaults(func=cmd_sweep, concurrency=None, rate=None)


def _summarize(args: argparse.Namespace, result: Any) -> Any:
    from .. import analysis

    return analysis.summarize(result.records, slo_ms=args.slo_ms, meta=result.meta, tokens=result.tokens,
                              ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms)


_FLOW_COLUMNS = ("flow", "priority", "tenant", "share_of_requests", "n_ok", "error_frac", "p50_ms", "p99_ms",
                 "ttft_p99_ms", "tpot_p99_ms", "goodput_rps", "gen_goodput_rps", "good_frac", "gen_good_frac",
                 "tokens_per_s", "share_of_tokens")


def _flow_table(args: argparse.Namespace, result: Any) -> str:
    """Each flow of a mix under its own targets, one line each."""
    table = result.flow_summary(slo_ms=args.slo_ms, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms)
    cols = [c for c in _FLOW_COLUMNS if c in table.columns and (c == "flow" or table[c].notna().any())]
    return "\nper flow:\n" + table[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}")


def _target(args: argparse.Namespace) -> tuple[str, Any]:
    """The URL to load: --url as given, or a server started here for --strategy."""
    if args.url:
        return args.url, None
    from ..launch import serve

    handle = serve(args.strategy, args.model or default_model(args.strategy), device=args.device, dtype=args.dtype,
                   task=args.task, **vars(limits_from(args)))
    return handle.url, handle


def cmd_bench(args: argparse.Namespace) -> int:
    from ..loadgen import run_load_sync

    if not args.concurrency and not args.rate:
        raise ValueError("give --rate R (open loop) or --concurrency C (closed loop)")
    url, handle = _target(args)
    try:
        result = run_load_sync(url, **load_options(args))
    finally:
        if handle is not None:
            handle.stop()
    summary = _summarize(args, result)
    print(summary.to_string(float_format=lambda x: f"{x:.4g}"))
    if result.meta.get("mix"):
        print(_flow_table(args, result))
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.out:
        written = result.save(args.out, summary.to_dict())
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .. import analysis
    from ..loadgen import run_load_sync

    url, handle = _target(args)
    opts = load_options(args)
    opts.pop("users", None)

    metric = "ttft_p99_ms" if wants_generation(args) else "p99_ms"  # generation: the SLO is on the first token

    def at_rate(rate: float) -> Any:
        result = run_load_sync(url, **{**opts, "arrival": args.arrival, "rate_per_s": rate})
        print(f"  {rate:8.2f}/s: {metric} {_summarize(args, result)[metric]:.1f} ms", file=sys.stderr)
        return result.records, result.meta

    try:
        found = analysis.sweep(at_rate, args.slo_p99_ms, args.start_rate, rel_tol=args.tolerance, metric=metric)
    finally:
        if handle is not None:
            handle.stop()
    cols = [c for c in ("step", "phase", "rate", "passed", "throughput_rps", "p50_ms", "p99_ms", "ttft_p99_ms",
                        "token_throughput_tps", "error_frac") if c in found.probes]
    print(found.probes[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    best = "none" if found.best_rate is None else f"{found.best_rate:.2f} req/s"
    print(f"highest rate meeting {metric} <= {args.slo_p99_ms:g} ms: {best}")
    if args.out:
        found.probes.to_csv(args.out, index=False)
    return 0
