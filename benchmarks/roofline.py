"""Decode's roofline on this machine: what a step must read and compute, what the machine can do, where the time goes.

    python benchmarks/roofline.py --out results/roofline/cpu.json      # ~3 min on 2 cores, smollm2
    python benchmarks/roofline.py --smoke --out /tmp/roofline.json     # gpt2-tiny-random, seconds

A decode step of ``b`` sequences reads every weight once (the embedding table only as the
output head, which multiplies every position by the whole vocabulary) and each sequence's
keys and values, and does about two FLOPs per weight per sequence. This script measures, in
one run, on the model labserver serves (``--model``, default ``smollm2``):

1. **the machine**: memory bandwidth (the median over ``--repeats`` of summing a float32 tensor of
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
5. **the same matrix-vector products alone**, on the model's own weights in two layouts (as stored,
   ``linear(x, W)``; transposed once, ``x @ W.T`` contiguous), the layers' and the output head's, GB/s read.

INFO throughout: it states a floor, it sets no goal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labserver.models import Chunk, load_model  # noqa: E402

SLICES = {  # op name -> slice (ops not named: "other ops")
    "aten::mm": "matmuls", "aten::addmm": "matmuls", "aten::bmm": "matmuls",
    "aten::scaled_dot_product_attention": "attention", "aten::_scaled_dot_product_flash_attention_for_cpu":
    "attention", "aten::softmax": "attention", "aten::_softmax": "attention", "aten::index_select": "KV gather/write",
    "aten::index": "KV gather/write", "aten::index_put_": "KV gather/write", "aten::_index_put_impl_": "KV gather/write",
    "aten::gather": "KV gather/write", "aten::scatter_": "KV gather/write", "aten::copy_": "copies",
    "aten::cat": "copies", "aten::contiguous": "copies", "aten::clone": "copies",
    "aten::mul": "elementwise and norms", "aten::add": "elementwise and norms", "aten::rsqrt": "elementwise and norms",
    "aten::pow": "elementwise and norms", "aten::mean": "elementwise and norms", "aten::silu": "elementwise and norms",
    "aten::neg": "elementwise and norms", "aten::add_": "elementwise and norms", "aten::mul_": "elementwise and norms",
    "aten::div": "elementwise and norms", "aten::sub": "elementwise and norms", "aten::sin": "elementwise and norms",
    "aten::cos": "elementwise and norms", "aten::layer_norm": "elementwise and norms",
    "aten::native_layer_norm": "elementwise and norms", "aten::gelu": "elementwise and norms",
    "aten::tanh": "elementwise and norms", "aten::embedding": "elementwise and norms",
    "aten::rms_norm": "elementwise and norms", "aten::_fused_rms_norm": "elementwise and norms",
    **{f"aten::{v}": "views and wrappers" for v in ("transpose", "as_strided", "t", "view", "reshape", "expand",
                                                     "slice", "select", "unsqueeze", "squeeze", "permute", "empty",
                                                     "linear", "matmul", "_unsafe_view", "empty_strided",
                                                     "alias", "detach", "narrow", "flatten", "split", "chunk",
                                                     "unbind", "resize_", "to", "_to_copy", "lift_fresh")},
    "aten::argmax": "sampling", "aten::topk": "sampling", "aten::sort": "sampling", "aten::multinomial": "sampling",
    "aten::log_softmax": "sampling", "aten::max": "sampling",
}


def median_s(fn: Any, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine(args: argparse.Namespace) -> dict[str, float]:
    n = args.bandwidth_mb * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    read_s = median_s(lambda: a.sum(), args.repeats)
    copy_s = median_s(lambda: b.copy_(a), args.repeats)
    out: dict[str, float] = {"read_gb_s": n * 4 / read_s / 1e9, "copy_gb_s": 2 * n * 4 / copy_s / 1e9,
                             "threads": torch.get_num_threads()}
    del a, b
    k = args.matmul_n
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x, y = torch.randn(k, k).to(dtype), torch.randn(k, k).to(dtype)
        out[f"matmul_{name}_gflop_s"] = 2 * k**3 / median_s(lambda x=x, y=y: x @ y, args.repeats) / 1e9
    return out


def weights(gen: Any) -> dict[str, int]:
    """Bytes and parameters one decode step reads: every weight once; the embedding table as the output head."""
    hf = gen.hf_model
    params = {id(p): p for p in hf.parameters()}  # (tied weights counted once)
    total = sum(p.numel() * p.element_size() for p in params.values())
    n = sum(p.numel() for p in params.values())
    emb = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    # an untied embedding is read a row per sequence, not whole: leave it out of the bytes a step reads
    read = total if tied else total - emb.numel() * emb.element_size()
    cfg = hf.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    return {"bytes_read": read, "params": n, "matmul_params": n - (0 if tied else emb.numel()),
            "head_params": head.numel(), "vocab": head.shape[0], "width": head.shape[1], "layers": int(layers),
            "tied": int(tied)}


def decode_chunks(gen: Any, b: int, context: int) -> list[Chunk]:
    """``b`` sequences of ``context`` tokens prefilled in the model's pool; their decode chunks."""
    per = -(-(context + 8) // 16)
    gen.allocate_kv(b * per, 16)
    chunks = []
    for i in range(b):
        table = tuple(range(i * per, (i + 1) * per))
        ids = [(7 * i + k) % 1000 + 10 for k in range(context)]
        last = gen.forward([Chunk(i + 1, ids, 0, table)])[0]
        chunks.append(Chunk(i + 1, [int(last)], context, table, decode=True))
    return chunks


def step_ms(gen: Any, chunks: list[Chunk], steps: int) -> float:
    times = []
    for k in range(steps + 3):
        t = time.perf_counter()
        gen.forward(chunks)  # (the same position again: its KV rewritten, the cost a step has)
        if k >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def profile_step(gen: Any, chunks: list[Chunk], vocab: int, steps: int) -> dict[str, float]:
    """One sequence's decode step, ``steps`` times under the profiler: ms a step by slice, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    gen.forward(chunks)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            gen.forward(chunks)
        wall_ms = (time.perf_counter() - t) * 1000 / steps
    slices: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.key_averages(group_by_input_shape=True):
        name = SLICES.get(e.key, "other ops")
        if name == "matmuls" and str(vocab) in str(e.input_shapes):
            name = "output head (logits)"
        slices[name] += e.self_cpu_time_total / 1000 / steps
        by_op[e.key] += e.self_cpu_time_total / 1000 / steps
        calls[e.key] += e.count // steps
    ops = sum(slices.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": wall_ms, "ops_ms": ops, **{k: round(v, 4) for k, v in sorted(slices.items())},
            "between ops (Python, dispatch)": max(0.0, wall_ms - ops),
            "top_ops": [(k, round(v, 4), calls[k]) for k, v in top], "op_calls": sum(calls.values())}


def layouts(gen: Any, repeats: int) -> dict[str, float]:
    """One sequence's matrix-vector products over the model's own weights, in two layouts, GB/s read: as
    ``linear(x, W)`` (W as stored, [out, in]) and as ``x @ Wt`` (its transpose made contiguous once); the
    layers' weights are cycled through, so they come from memory, as in a step."""
    import torch.nn.functional as F

    hf = gen.hf_model
    head = hf.get_output_embeddings().weight.detach()
    layers = [m.weight.detach() for m in hf.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head]
    flipped = [w.t().contiguous() for w in layers]
    xs = {n: torch.randn(1, n) for n in {w.shape[1] for w in layers} | {head.shape[1]}}
    layer_mb = sum(w.numel() * w.element_size() for w in layers) / 1e6
    head_mb = head.numel() * head.element_size() / 1e6
    out = {}
    with torch.inference_mode():
        out["layers_linear_gb_s"] = layer_mb / 1e3 / median_s(lambda: [F.linear(xs[w.shape[1]], w) for w in layers],
                                                             repeats)
        out["layers_transposed_gb_s"] = layer_mb / 1e3 / median_s(lambda: [xs[w.shape[0]] @ w for w in flipped],
                                                                 repeats)
        flipped_head = head.t().contiguous()
        x = xs[head.shape[1]]
        out["head_linear_gb_s"] = head_mb / 1e3 / median_s(lambda: F.linear(x, head), repeats)
        out["head_transposed_gb_s"] = head_mb / 1e3 / median_s(lambda: x @ flipped_head, repeats)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
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
    gen = load_model(args.model, device="cpu", kind="generate")
    m = machine(args)
    w = weights(gen)
    kv = gen.kv_bytes_per_token
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        chunks = decode_chunks(gen, b, args.context)
        bytes_read = w["bytes_read"] + b * args.context * kv
        # two FLOPs per weight per sequence, and attention's QK and AV: 4 x context x width per layer per sequence
        flops = 2 * b * w["matmul_params"] + 4 * b * args.context * w["layers"] * w["width"]
        mem_ms = bytes_read / (m["read_gb_s"] * 1e9) * 1000
        flop_ms = flops / (m["matmul_fp32_gflop_s"] * 1e9) * 1000
        measured = step_ms(gen, chunks, args.steps)
        floor = max(mem_ms, flop_ms)
        rows.append({"sequences": b, "bytes_read_mb": bytes_read / 1e6, "gflop": flops / 1e9, "memory_floor_ms": mem_ms,
                     "compute_floor_ms": flop_ms, "floor_ms": floor, "bound": "memory" if mem_ms >= flop_ms else
                     "compute", "measured_ms": measured, "measured_over_floor": measured / floor,
                     "tokens_per_s": b / measured * 1000, "floor_tokens_per_s": b / floor * 1000})
        gen.release([c.sid for c in chunks])
    one = decode_chunks(gen, 1, args.context)
    prof = profile_step(gen, one, w["vocab"], args.steps)
    lay = layouts(gen, args.repeats)
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
    print(f"\nthe same matrix-vector products alone (GB/s read): the layers' weights as linear(x, W) "
          f"{lay['layers_linear_gb_s']:.1f}, as x @ W.T made contiguous {lay['layers_transposed_gb_s']:.1f}; "
          f"the output head {lay['head_linear_gb_s']:.1f} and {lay['head_transposed_gb_s']:.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "context": args.context, "machine": m,
                                              "weights": w, "kv_bytes_per_token": kv, "rows": rows,
                                              "profile_one": prof, "layouts": lay}, indent=1))
    measured_all = all(r["measured_ms"] > 0 and r["floor_ms"] > 0 for r in rows) and prof["wall_ms"] > 0
    return 0 if measured_all else 1


if __name__ == "__main__":
    sys.exit(main())
