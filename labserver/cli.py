"""``labserver`` on the command line: thin argument parsing over the package."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import DEFAULT_STRATEGY, ServerConfig, default_model
from .strategies import Limits, describe, strategy_names

_LIMITS = Limits()
_CONFIG = ServerConfig()


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="minilm (embedded default), bert-base-random, synthetic:BASE+PER_ITEM, echo, "
                        "or a Hugging Face id / local folder; for gen-* strategies: gpt2-random (their "
                        "default), gpt2-tiny-random, synthetic-gen:PREFILL+STEP")
    p.add_argument("--task", default=None, help="pipeline task for a hub id or folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="(default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: float16 on GPU, float32 on CPU")


def add_strategy_args(p: argparse.ArgumentParser, with_strategy: bool = True) -> None:
    if with_strategy:
        p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=strategy_names(),
                       help="(default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=_LIMITS.max_batch_size,
                   help="items per model call; 0 = no cap (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=_LIMITS.max_wait_ms, help="(default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="queued items before new requests get 503 (default: unbounded)")
    p.add_argument("--timeout-ms", type=float, default=None,
                   help="per-request deadline; 504 after it (default: none)")
    p.add_argument("--no-idle-dispatch", action="store_true",
                   help="deadline/thread: wait for the deadline even when nothing else is queued")
    p.add_argument("--target-ms", type=float, default=_LIMITS.target_ms,
                   help="slo: the latency target; a batch may spend half of it waiting (default: %(default)s)")
    p.add_argument("--max-kv-tokens", type=int, default=None,
                   help="gen-*: KV-cache tokens the running sequences may hold (default: max-batch x the model's "
                        "context)")
    p.add_argument("--kv-block-tokens", type=int, default=_LIMITS.kv_block_tokens,
                   help="gen-*: tokens per KV block, the unit memory is taken in (default: %(default)s)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="gen-*: prompts that begin alike share their KV blocks")
    p.add_argument("--prefill", default=_LIMITS.prefill, choices=["eager", "budget", "chunked"],
                   help="gen-continuous, gen-paged: prefill all that fit at every step, at most "
                        "--max-prefill-tokens, or in pieces inside each step (--max-step-tokens)")
    p.add_argument("--max-prefill-tokens", type=int, default=_LIMITS.max_prefill_tokens,
                   help="with --prefill budget (default: %(default)s)")
    p.add_argument("--max-step-tokens", type=int, default=_LIMITS.max_step_tokens,
                   help="with --prefill chunked: tokens per step, decodes first (default: %(default)s)")
    p.add_argument("--eos-prob", type=float, default=_LIMITS.eos_prob,
                   help="gen-*: a stand-in for a trained model's EOS: each token ends its answer with this "
                        "probability (random weights never choose EOS; default: %(default)s)")


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(
        max_batch_size=args.max_batch or None,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        timeout_ms=args.timeout_ms,
        idle_dispatch=not args.no_idle_dispatch,
        target_ms=args.target_ms,
        max_kv_tokens=args.max_kv_tokens,
        kv_block_tokens=args.kv_block_tokens,
        prefix_cache=args.prefix_cache,
        prefill=args.prefill,
        max_prefill_tokens=args.max_prefill_tokens,
        max_step_tokens=args.max_step_tokens,
        eos_prob=args.eos_prob,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from .launch import PortInUse, run_forever

    config = ServerConfig(
        strategy=args.strategy, model=args.model or default_model(args.strategy), device=args.device,
        dtype=args.dtype, task=args.task,
        limits=limits_from(args), host=args.host, port=args.port, debug=args.debug,
        max_body_bytes=args.max_body_bytes, max_inputs=args.max_inputs, max_chars=args.max_chars,
        max_new_tokens=args.max_new_tokens, log_level=args.log_level,
    )
    print(f"labserver: {config.strategy} serving {config.model} on http://{config.host}:{config.port} "
          f"(Ctrl-C to stop)", file=sys.stderr)
    try:
        run_forever(config)
    except PortInUse as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2
    return 0


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_compare(args: argparse.Namespace) -> int:
    from datetime import datetime

    from .experiments import compare as cx  # the module

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
    files = "records.csv, tokens.csv, steps.csv" if generate else "records.csv, lag.csv"
    print(f"wrote {out}/: {files}, summary.json, summary.csv, machine.json and PNG plots", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .experiments.compare import draw

    for path in draw(args.results_dir):
        print(path)
    return 0


def _generative(args: argparse.Namespace) -> bool:
    from .load.apis import is_generative

    return is_generative(args.api, args.mode)


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    from .load.lengths import parse_lengths

    if args.mode is None:
        args.mode = "generate" if (args.strategy or "").startswith("gen-") else "text"
    opts: dict[str, Any] = dict(duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                                mode=args.mode, api=args.api, processes=args.processes,
                                allow_remote=args.allow_remote)
    if args.url and args.api != "labserver":
        opts["model"] = args.model  # the name to send (None: ask the server's /v1/models)
    if args.concurrency:
        opts["users"] = args.concurrency
    else:
        arrival = f"gamma:{args.burstiness}" if args.arrival == "gamma" else args.arrival
        opts.update(arrival=arrival, rate_per_s=args.rate)
        if args.max_concurrency:  # open loop, at most this many outstanding: later sends wait (and count as late)
            opts.update(max_in_flight=args.max_concurrency, overflow="wait")
    if args.payload_file:
        from .load.arrivals import FileLines

        opts["payload"] = FileLines(args.payload_file)
    elif args.prompt_tokens or args.shared_prefix:
        from .load.prompts import TokenPrompts

        opts["payload"] = TokenPrompts(parse_lengths(args.prompt_tokens or "32"), prefix_tokens=args.shared_prefix,
                                       tokenizer=args.tokenizer)
    else:
        from .load.arrivals import WordTexts

        opts["payload"] = WordTexts(min_words=8, max_words=24)
    if _generative(args):
        opts.update(new_tokens=parse_lengths(args.new_tokens), stream=not args.no_stream, timeout_s=600.0,
                    ignore_eos=not args.no_ignore_eos)
    return opts


def _summarize(args: argparse.Namespace, result: Any) -> Any:
    from . import analysis

    return analysis.summarize(result.records, slo_ms=args.slo_ms, meta=result.meta, tokens=result.tokens,
                              ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms)


def _target(args: argparse.Namespace) -> tuple[str, Any]:
    """The URL to load: --url as given, or a server started here for --strategy."""
    if args.url:
        return args.url, None
    from .launch import serve

    handle = serve(args.strategy, args.model or default_model(args.strategy), device=args.device, dtype=args.dtype, task=args.task,
                   **vars(limits_from(args)))
    return handle.url, handle


def cmd_bench(args: argparse.Namespace) -> int:
    from .loadgen import run_load_sync

    if not args.concurrency and not args.rate:
        raise ValueError("give --rate R (open loop) or --concurrency C (closed loop)")
    url, handle = _target(args)
    try:
        result = run_load_sync(url, **_load_options(args))
    finally:
        if handle is not None:
            handle.stop()
    summary = _summarize(args, result)
    print(summary.to_string(float_format=lambda x: f"{x:.4g}"))
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.out:
        written = result.save(args.out, summary.to_dict())
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from . import analysis
    from .loadgen import run_load_sync

    url, handle = _target(args)
    opts = _load_options(args)
    opts.pop("users", None)

    metric = "ttft_p99_ms" if _generative(args) else "p99_ms"  # generation: the SLO is on the first token

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


def add_load_args(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="load this server (loopback only unless --allow-remote)")
    target.add_argument("--strategy", choices=strategy_names(), help="start this strategy here and load it")
    add_model_args(p)
    add_strategy_args(p, with_strategy=False)
    p.add_argument("--api", default="labserver", choices=["labserver", "openai-completions", "openai-chat",
                                                          "openai-embeddings"],
                   help="labserver's own routes (--mode), or the OpenAI API any LLM server speaks (vLLM, TGI, "
                        "SGLang, Ollama, llama.cpp, transformers serve, labserver's /v1); with --url, --model "
                        "names the model to send (default: the server's first in GET /v1/models)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "constant", "gamma"],
                   help="(default: %(default)s)")
    p.add_argument("--burstiness", type=float, default=0.5,
                   help="--arrival gamma: the gamma shape (1 = Poisson, < 1 burstier) (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: at most this many requests outstanding; later sends wait for one to end "
                        "(latency still counts from the schedule)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds left out of the summary (default: %(default)s)")
    p.add_argument("--mode", default=None, choices=["text", "json", "generate"],
                   help="POST / text, /predict JSON, or /generate (default: text; generate for gen-* strategies)")
    p.add_argument("--new-tokens", default="uniform:16:256",
                   help="generate: tokens each request asks for: N, uniform:LO:HI, geometric:MEAN[:LO:HI] or "
                        "replay:FILE (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="generate: one JSON answer instead of a token stream")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="generate: let EOS end an answer early (default: ask for exactly --new-tokens)")
    p.add_argument("--prompt-tokens", default=None,
                   help="prompts of this many tokens: N, uniform:LO:HI, geometric:MEAN[:LO:HI] or replay:FILE "
                        "(words of the built-in list, one token each in the bundled vocabulary)")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="every prompt starts with the same prefix of this many tokens (then --prompt-tokens own)")
    p.add_argument("--tokenizer", default=None,
                   help="a local tokenizer folder: --prompt-tokens counted exactly by it")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="generate: goodput needs TTFT within this")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="generate: goodput needs TPOT within this")
    p.add_argument("--payload-file", help="send the lines of this file (default: seeded 8-24 word sentences)")
    p.add_argument("--processes", type=int, default=1, help="load generator processes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ms", type=float, default=None, help="goodput: answers within this count")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url (mind whose it is)")
    p.add_argument("--out", help="write the result: x.csv (records + x.csv.json with the summary), x.json "
                                 "(summary, meta, warnings), x.parquet, or a folder")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labserver", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    listing = "\n".join(f"  {name:15} {describe(name)}" for name in strategy_names())
    p = sub.add_parser("serve", help="serve a model with one strategy until Ctrl-C",
                       epilog=f"strategies:\n{listing}", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_strategy_args(p)
    p.add_argument("--host", default=_CONFIG.host, help="(default: %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=_CONFIG.port, help="(default: %(default)s; 0 = any free)")
    p.add_argument("--max-body-bytes", type=int, default=_CONFIG.max_body_bytes)
    p.add_argument("--max-inputs", type=int, default=_CONFIG.max_inputs)
    p.add_argument("--max-chars", type=int, default=_CONFIG.max_chars)
    p.add_argument("--max-new-tokens", type=int, default=_CONFIG.max_new_tokens,
                   help="/generate: the most tokens one request may ask for (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="tracebacks in error responses (never when shared)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("compare", help="the main job: every strategy, same load, table + results/ + plots")
    p.add_argument("--task", default="encode", choices=["encode", "generate"],
                   help="encode: the encoder strategies on minilm; generate: the gen-* strategies on gpt2-random")
    p.add_argument("--quick", action="store_true", help="about a minute instead of about five")
    p.add_argument("--strategies", help="comma-separated (default: every strategy of the task)")
    p.add_argument("--model", default=None, help="(default: minilm, the embedded model)")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--rates", help="comma-separated offered req/s (default: 25,100,200,300; quick: 25,200)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run")
    p.add_argument("--max-batch", type=int, default=None, help="(default: 64)")
    p.add_argument("--slo-ms", type=float, default=None, help="goodput SLO (default: 500; generate: TTFT, 2000)")
    p.add_argument("--out", help="results folder (default: results/compare-<time>)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bench", help="one load run against a URL or a strategy started here")
    add_load_args(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--rate", type=float, help="open loop: offered req/s")
    shape.add_argument("--concurrency", type=int, help="closed loop: this many users")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("sweep", help="the highest offered rate whose p99 meets an SLO (bisection)")
    add_load_args(p)
    p.add_argument("--slo-p99-ms", type=float, required=True)
    p.add_argument("--start-rate", type=float, default=20.0, help="(default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.05, help="relative bracket to stop at (default: 5%%)")
    p.set_defaults(func=cmd_sweep, concurrency=None, rate=None)

    p = sub.add_parser("plot", help="redraw the plots of a results folder from its saved records")
    p.add_argument("results_dir")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
