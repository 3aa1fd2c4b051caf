"""Model folders from the command line: ``labserver tiny-model`` and ``labserver prepare``.

``tiny-model`` writes a tiny random-weight GPT-2, Llama, Qwen2, Qwen3 or Mistral folder,
offline (``labserver.models.folders``; transformers loads it as any model folder).
``prepare`` converts the embedded generator's GGUF into its cached folder now
(``labserver.models.smollm2``), so the first server start need not: ``make install`` runs it.
Both only parse flags and say what was written and how to serve it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_prepare", "add_tiny_model", "cmd_prepare", "cmd_tiny_model"]


def add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="convert the embedded generator (smollm2) to its cached folder now, once")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    import json
    import time

    from ..models import ModelLoadError
    from ..models.smollm2 import CONVERSION_RECORD, NAME, folder

    start = time.perf_counter()
    try:
        path = folder()
    except ModelLoadError as e:
        print(f"labserver: {e}")
        return 1
    record = json.loads((path / CONVERSION_RECORD).read_text())
    print(f"{NAME}: {path} ({time.perf_counter() - start:.1f} s; converted {record['converted_at']} from "
          f"{record['source']}, sha256 {record['source_sha256'][:12]}..., transformers {record['transformers']})")
    return 0


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
