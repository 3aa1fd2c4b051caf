"""``labserver serve``: one strategy serving one model until Ctrl-C.

The flags only a server takes (where it listens, what it accepts) are here; the model
and the strategy's limits are the shared groups of ``args``. Running the server is
``labserver.launch``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import CACHE_ISOLATION, ServerConfig, default_model
from ..strategies import describe, strategy_names
from .args import add_model_args, add_strategy_args, limits_from

__all__ = ["add_serve", "cmd_serve"]

_CONFIG = ServerConfig()


def add_serve(sub: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:15} {describe(name)}" for name in strategy_names())
    p = sub.add_parser("serve", help="serve a model with one strategy until Ctrl-C",
                       epilog=f"strategies:\n{listing}", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_strategy_args(p)
    p.add_argument("--host", default=_CONFIG.host, help="(default: %(default)s; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=_CONFIG.port, help="(default: %(default)s; 0 = any free)")
    p.add_argument("--max-body-bytes", type=int, default=_CONFIG.max_body_bytes)
    p.add_argument("--max-inputs", type=int, default=_CONFIG.max_inputs)
    p.add_argument("--max-prompts", type=int, default=_CONFIG.max_prompts,
                   help="/v1 generation: prompts x n sequences one request may ask for (default: %(default)s)")
    p.add_argument("--max-chars", type=int, default=_CONFIG.max_chars)
    p.add_argument("--max-new-tokens", type=int, default=_CONFIG.max_new_tokens,
                   help="/generate: the most tokens one request may ask for (default: %(default)s)")
    p.add_argument("--read-timeout", type=float, default=_CONFIG.read_timeout_s, metavar="S",
                   help="a request's headers and body must arrive within S seconds, else the connection "
                        "is closed (default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=_CONFIG.max_connections,
                   help="open connections; one more gets a 503 and is closed (default: %(default)s)")
    p.add_argument("--drain-grace", type=float, default=_CONFIG.drain_grace_s, metavar="S",
                   help="on Ctrl-C or SIGTERM, finish queued and running work for up to S seconds, then answer "
                        "503 shutting_down (default: %(default)s)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="ask every request but GET /health for Authorization: Bearer KEY (repeat for several; "
                        "default: $LABSERVER_API_KEY, comma-separated, else none)")
    p.add_argument("--cache-isolation", choices=CACHE_ISOLATION, default=_CONFIG.cache_isolation,
                   help="with --prefix-cache, whose cached blocks a request may reuse: none = any request's with "
                        "the same cache_salt, or any unsalted one's (its cached_tokens and time to first token can "
                        "tell a client what others sent); tenant = only its own tenant's (x-tenant), with the same "
                        "cache_salt (default: %(default)s; docs/security.md)")
    p.add_argument("--debug", action="store_true", help="tracebacks in error responses (never when shared)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--replicas", type=replica_count, default=None, metavar="N|MIN:MAX",
                   help="N copies on Ray Serve behind one URL (a gen-* strategy; needs labserver[ray]); MIN:MAX: as "
                        "many as Ray Serve's autoscaler decides (docs/replicas.md)")
    scale = p.add_argument_group("autoscaling (with --replicas MIN:MAX; Ray Serve's autoscaling_config)")
    scale.add_argument("--target-ongoing", type=float, default=None, metavar="R",
                       help="requests a replica should hold, queued and running (default: --max-batch)")
    scale.add_argument("--upscale-delay", type=float, default=30.0, metavar="S",
                       help="add replicas once more have been wanted for S seconds (default: %(default)s)")
    scale.add_argument("--downscale-delay", type=float, default=600.0, metavar="S",
                       help="remove replicas once fewer have been wanted for S seconds (default: %(default)s)")
    scale.add_argument("--look-back", type=float, default=30.0, metavar="S",
                       help="average the ongoing requests over the last S seconds (default: %(default)s)")
    scale.add_argument("--metrics-interval", type=float, default=10.0, metavar="S",
                       help="replicas and handles report their ongoing requests every S seconds "
                            "(default: %(default)s)")
    scale.add_argument("--graceful-shutdown", type=float, default=60.0, metavar="S",
                       help="a replica scaled down finishes what it holds for up to S seconds (default: %(default)s)")
    p.add_argument("--disaggregate", default=None, metavar="P:D", type=pools,
                   help="instead of --replicas: P prefill and D decode replicas on Ray Serve, the KV handed over "
                        "between them (gen-continuous or gen-paged; docs/replicas.md)")
    p.add_argument("--pin-cores", action="store_true",
                   help="with --replicas or --disaggregate: each replica on its own share of this machine's CPUs "
                        "(prefill replicas first), one torch thread per core")
    p.add_argument("--router", default="pow2", help="with --replicas (within each pool with --disaggregate): random, "
                                                    "round-robin, pow2 (Ray's default), least-loaded, prefix-hash, "
                                                    "prefix-aware")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas or --disaggregate: join this Ray cluster (never stopped here) instead of a "
                        "local Ray")
    p.set_defaults(func=cmd_serve)


def replica_count(text: str) -> int | tuple[int, int]:
    """``--replicas N`` -> N; ``--replicas MIN:MAX`` -> (MIN, MAX), autoscaled."""
    low, sep, high = text.partition(":")
    if not sep and low.isdigit() and int(low) >= 1:
        return int(low)
    if sep and low.isdigit() and high.isdigit() and int(low) <= int(high) and int(high) >= 1:
        return int(low), int(high)
    raise argparse.ArgumentTypeError(f"{text!r}: give N (at least 1) or MIN:MAX with MIN <= MAX (e.g. 1:4)")


def autoscaler_of(args: argparse.Namespace, max_batch_size: int | None) -> Any:
    """``--replicas MIN:MAX`` and the autoscaling flags as an ``Autoscaler`` (None for ``--replicas N``)."""
    if not isinstance(args.replicas, tuple):
        return None
    from ..routing.autoscale import Autoscaler

    return Autoscaler(*args.replicas, target_ongoing=args.target_ongoing or float(max_batch_size or 2),
                      upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
                      look_back_s=args.look_back, metrics_interval_s=args.metrics_interval)


def pools(text: str) -> tuple[int, int]:
    """``--disaggregate P:D`` -> (P, D), each at least 1."""
    p, sep, d = text.partition(":")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give P:D, prefill and decode replicas, each at least 1 (e.g. 1:1)")
    return int(p), int(d)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..launch import PortInUse, run_forever

    config = ServerConfig(
        strategy=args.strategy, model=args.model or default_model(args.strategy), device=args.device,
        dtype=args.dtype, task=args.task,
        limits=limits_from(args), host=args.host, port=args.port, debug=args.debug,
        max_body_bytes=args.max_body_bytes, max_inputs=args.max_inputs, max_prompts=args.max_prompts,
        max_chars=args.max_chars, max_new_tokens=args.max_new_tokens, log_level=args.log_level,
        read_timeout_s=args.read_timeout, max_connections=args.max_connections, drain_grace_s=args.drain_grace,
        api_keys=tuple(args.api_key or ()), cache_isolation=args.cache_isolation,
    )
    if args.replicas is not None and args.disaggregate is not None:
        print("labserver: --disaggregate P:D replaces --replicas N (P prefill + D decode replicas); give one",
              file=sys.stderr)
        return 2
    if args.replicas is not None or args.disaggregate is not None:
        return serve_replicas_until_stopped(config, args)
    print(f"labserver: {config.strategy} serving {config.model} on http://{config.host}:{config.port} "
          f"(Ctrl-C to stop)", file=sys.stderr)
    try:
        run_forever(config)
    except PortInUse as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2
    return 0


def serve_replicas_until_stopped(config: ServerConfig, args: argparse.Namespace) -> int:
    """``--replicas N``: deploy, say where, wait for Ctrl-C or SIGTERM, then remove what was started."""
    import signal
    import threading

    from ..replicas import serve_replicas

    stop = threading.Event()
    try:
        autoscale = autoscaler_of(args, config.limits.max_batch_size)
        handle = serve_replicas(config, None if autoscale else args.replicas, args.router,
                                ray_address=args.ray_address, disaggregate=args.disaggregate,
                                pin_cores=args.pin_cores, autoscale=autoscale, graceful_shutdown_s=args.graceful_shutdown)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):  # (after ray.init, which installs handlers of its own)
        signal.signal(sig, lambda *_: stop.set())
    try:
        pools = (f"{args.disaggregate[0]} prefill + {args.disaggregate[1]} decode" if args.disaggregate else
                 f"{args.replicas[0]}:{args.replicas[1]} autoscaled" if autoscale else f"x{args.replicas}")
        print(f"labserver: {config.strategy} serving {config.model} {pools} replicas (router "
              f"{args.router}) on {handle.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        handle.stop()
    return 0
