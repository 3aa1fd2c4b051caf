"""``labserver`` on the command line: thin argument parsing over the package."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .config import DEFAULT_MODEL, DEFAULT_STRATEGY, ServerConfig
from .engine import Limits
from .strategies import STRATEGIES

_LIMITS = Limits()
_CONFIG = ServerConfig()


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="minilm (embedded default), bert-base-random, synthetic:BASE+PER_ITEM, echo, "
                        "or a Hugging Face id / local folder (default: %(default)s)")
    p.add_argument("--task", default=None, help="pipeline task for a hub id or folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="(default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: float16 on GPU, float32 on CPU")


def add_strategy_args(p: argparse.ArgumentParser, with_strategy: bool = True) -> None:
    if with_strategy:
        p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=list(STRATEGIES),
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


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(
        max_batch_size=args.max_batch or None,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        timeout_ms=args.timeout_ms,
        idle_dispatch=not args.no_idle_dispatch,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from .launch import PortInUse, run_forever

    config = ServerConfig(
        strategy=args.strategy, model=args.model, device=args.device, dtype=args.dtype, task=args.task,
        limits=limits_from(args), host=args.host, port=args.port, debug=args.debug,
        max_body_bytes=args.max_body_bytes, max_inputs=args.max_inputs, max_chars=args.max_chars,
        log_level=args.log_level,
    )
    print(f"labserver: {config.strategy} serving {config.model} on http://{config.host}:{config.port} "
          f"(Ctrl-C to stop)", file=sys.stderr)
    try:
        run_forever(config)
    except PortInUse as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labserver", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model with one strategy until Ctrl-C")
    add_model_args(p)
    add_strategy_args(p)
    p.add_argument("--host", default=_CONFIG.host, help="(default: %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=_CONFIG.port, help="(default: %(default)s; 0 = any free)")
    p.add_argument("--max-body-bytes", type=int, default=_CONFIG.max_body_bytes)
    p.add_argument("--max-inputs", type=int, default=_CONFIG.max_inputs)
    p.add_argument("--max-chars", type=int, default=_CONFIG.max_chars)
    p.add_argument("--debug", action="store_true", help="tracebacks in error responses (never when shared)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
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
