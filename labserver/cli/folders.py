"""``labserver tiny-model``: write a tiny random-weight GPT-2, Llama, Qwen2, Qwen3 or Mistral folder, offline.

The folder is ``labserver.models.folders``'s (transformers loads it as any model folder);
this only parses the flags and says what was written and how to serve it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_tiny_model", "cmd_tiny_model"]


def add_tiny_model(sub: argparse._SubParsersAction) -> None:
    from ..models.folders import DTYPE_BYTES, FAMILIES

    p = sub.add_parser("tiny-model",
                       help="write a tiny random-weight model folder (gpt2, llama, qwen2, qwen3, mistral), offline")
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: gpt2 as many as --heads, the others 2)")
    p.add_argument("--vocab-size", type=int, default=1024, help="(default: %(default)s)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32", help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same weights (default: %(default)s)")
    p.set_defaults(func=cmd_tiny_model)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    import json

    from ..models.folders import kv_bytes_per_token, parameter_count, write_tiny

    folder = write_tiny(args.family, args.folder, layers=args.layers, hidden=args.hidden, heads=args.heads,
                        kv_heads=args.kv_heads, vocab_size=args.vocab_size, dtype=args.dtype, seed=args.seed)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    print(f"wrote {folder}: {args.family}, {parameter_count(folder):,} parameters, "
          f"{kv_bytes_per_token(config):,} KV bytes per token ({config['dtype']})")
    print(f"serve it: labserver serve --strategy gen-paged --model {folder}")
    return 0
