"""Decode's roofline on this machine: what a step must read and compute, what the machine can do, where the time goes.

    python benchmarks/roofline.py --out results/roofline/cpu.json      # ~3 min on 2 cores, smollm2
    python benchmarks/roofline.py --smoke --out /tmp/roofline.json     # gpt2-tiny-random, seconds

A decode step of ``b`` sequences reads every weight once (the embedding table only as the
output head, which multiplies every position by the whole vocabulary) and each sequence's
keys and values, and does about two FLOPs per weight per sequence. This script measures, in
one run, on the model labserver serves (``--model``, default ``smollm2``):

1. **the machine**: memory bandwidth (the best of ``--repeats`` of summing a float32 tensor of
   ``--bandwidth-mb``, far larger than the caches: reading, as a decode step reads its weights; and
   of copying it, read + write) and matmul throughput (float32 and bfloat16 square matmuls of
   ``--matmul-n``), with torch's own threads;
2. **the floors** of a decode step at 1, 16 and 32 sequences, each at a context of ``--context``
   tokens: bytes read (weights + KV) / read bandwidth, FLOPs / matmul throughput; the floor is the
   larger, and what bounds the step (memory or compute) is the one that set it;
3. **the measured step**: the model's own ``forward`` on decode chunks over its paged pool (the call a
   server's engine makes), the median of ``--steps`` after warm-up, and the step's share of its floor;
4. **where one step goes** (1 sequence, ``torch.profiler``): the self CPU time of every op, by slice:
   matmuls in the layers, the output head (the matmul whose output is the vocabulary), attention and the
   KV pool's gathers and writes, norms and other elementwise ops, views and op wrappers, sampling; and
   the rest of the wall time, the Python and dispatch between ops, which no op accounts for; and the
   rate at which the matmuls read the weights, beside the machine's read bandwidth;
5. **the same products alone**, on the model's own weights in three layouts (as stored,
   ``linear(x, W)``; transposed once, ``x @ W.T`` contiguous; oneDNN's own, reordered once, which
   labserver multiplies float32 with on a CPU; for a float16 model, ``widened``: its float32 copy in
   oneDNN's layout, which labserver multiplies several rows with), the layers' and the output head's,
   at one row and at 32 rows: ms each, and GB/s read at one row.

INFO throughout: it states a floor, it sets no goal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labserver.experiments.roofline import (  # noqa: E402
    decode_chunks, floors, layouts, machine, profile_step, step_ms, weights)
from labserver.models import load_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="a generative model, NAME:DTYPE for another dtype (smollm2:float16)")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--context", type=int, default=64, help="tokens each sequence holds at the step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bandwidth-mb", type=int, default=1024)
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="tiny: gpt2-tiny-random, small tensors; says only "
                                                         "whether every figure was measured")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.model, args.batches, args.steps, args.repeats = "gpt2-tiny-random", "1,4", 3, 2
        args.bandwidth_mb, args.matmul_n, args.context = 64, 256, 16
    name, _, dtype = args.model.partition(":")  # (NAME:DTYPE: smollm2:float16)
    gen = load_model(name, device="cpu", kind="generate", dtype=dtype or "auto")
    m = machine(args.bandwidth_mb, args.repeats, args.matmul_n)
    w = weights(gen)
    kv = gen.kv_bytes_per_token
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        chunks = decode_chunks(gen, b, args.context)
        r = floors(w, kv, b, args.context, m)
        measured = step_ms(gen, chunks, args.steps)
        rows.append({**r, "measured_ms": measured, "measured_over_floor": measured / r["floor_ms"],
                     "tokens_per_s": b / measured * 1000, "floor_tokens_per_s": b / r["floor_ms"] * 1000})
        gen.release([c.sid for c in chunks])
    one = decode_chunks(gen, 1, args.context)
    prof = profile_step(gen, one, w["vocab"], args.steps)
    lay = {rows: layouts(gen, args.repeats, rows) for rows in (1, 32)}
    print(f"model {args.model}: {w['params'] / 1e6:.1f} M parameters, {w['bytes_read'] / 1e6:.0f} MB read a step "
          f"(the output head {w['head_params'] / 1e6:.1f} M of them, vocabulary {w['vocab']:,}), KV {kv:,} bytes a "
          f"token")
    print(f"machine: read {m['read_gb_s']:.1f} GB/s, copy {m['copy_gb_s']:.1f} GB/s, matmul fp32 "
          f"{m['matmul_fp32_gflop_s']:.0f} GFLOP/s, bf16 {m['matmul_bf16_gflop_s']:.0f} GFLOP/s "
          f"({m['threads']:.0f} threads)\n")
    print("| sequences | bytes read | memory floor | compute floor | bound | measured step | measured / floor |"
          " tokens/s | at the floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequences']} | {r['bytes_read_mb']:.0f} MB | {r['memory_floor_ms']:.2f} ms | "
              f"{r['compute_floor_ms']:.2f} ms | {r['bound']} | {r['measured_ms']:.2f} ms | "
              f"**{r['measured_over_floor']:.2f}** ({r['measured_ms']:.2f} vs {r['floor_ms']:.2f} ms) | "
              f"{r['tokens_per_s']:.1f} | {r['floor_tokens_per_s']:.1f} |")
    print(f"\none decode step of 1 sequence, by slice (torch.profiler, self CPU time, mean of {args.steps}): "
          f"{prof['wall_ms']:.2f} ms wall")
    print("| slice | ms | share |\n|---|---|---|")
    for k, v in prof.items():
        if k not in ("wall_ms", "ops_ms", "top_ops", "op_calls"):
            print(f"| {k} | {v:.2f} | {v / prof['wall_ms']:.0%} |")
    mm_ms = prof.get("matmuls", 0.0) + prof.get("output head (logits)", 0.0)
    print(f"\nthe matmuls of one sequence's step read the weights at {w['bytes_read'] / mm_ms / 1e6:.1f} GB/s "
          f"({w['bytes_read'] / 1e6:.0f} MB in {mm_ms:.2f} ms), against {m['read_gb_s']:.1f} GB/s for a sum")
    print(f"{prof['op_calls']} op calls a step; the costliest ops (self CPU ms a step, calls):")
    print(", ".join(f"{k} {v:.2f} ({n})" for k, v, n in prof["top_ops"]))
    one, many = lay[1], lay[32]
    print("\nthe same products alone, ms (GB/s read at one row), on the layers' weights and on the output head:")
    print("| layout | layers, 1 row | head, 1 row | layers, 32 rows | head, 32 rows |\n|---|---|---|---|---|")
    for kind in ("linear", "transposed", "onednn", "widened"):
        if f"layers_{kind}_ms" in one:
            print(f"| {kind} | {one[f'layers_{kind}_ms']:.2f} ({one['layers_mb'] / one[f'layers_{kind}_ms']:.1f}) | "
                  f"{one[f'head_{kind}_ms']:.2f} ({one['head_mb'] / one[f'head_{kind}_ms']:.1f}) | "
                  f"{many[f'layers_{kind}_ms']:.2f} | {many[f'head_{kind}_ms']:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "context": args.context, "machine": m,
                                              "weights": w, "kv_bytes_per_token": kv, "rows": rows,
                                              "profile_one": prof, "layouts": lay}, indent=1))
    measured_all = all(r["measured_ms"] > 0 and r["floor_ms"] > 0 for r in rows) and prof["wall_ms"] > 0
    return 0 if measured_all else 1


if __name__ == "__main__":
    sys.exit(main())
