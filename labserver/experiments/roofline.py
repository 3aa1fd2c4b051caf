"""Decode's roofline: what one step must read and compute, what this machine can do, and where the time goes.

A decode step of ``b`` sequences reads every weight once (the embedding table only as the
output head, which multiplies every position by the whole vocabulary) and each sequence's
keys and values, and does about two FLOPs per weight per sequence. One sequence's step is
therefore bound by memory: its floor is the bytes it reads over the machine's read
bandwidth. These are the measurements ``benchmarks/roofline.py`` and ``benchmarks/onestream.py``
print and notebook 9 draws:

- ``machine``: read and copy bandwidth, matmul throughput (the best of a few repeats);
- ``weights`` and ``bytes_read``: what a step reads (a model's projections as it holds them:
  float weights, or 4-bit blocks); ``floors``: what that and its FLOPs allow on a machine;
- ``decode_chunks`` and ``step_ms``: the model's own ``forward`` on decode chunks over its
  paged pool (the call a server's engine makes), timed;
- ``profile_step``: one step under ``torch.profiler``, its self CPU time by slice (``SLICES``),
  and the Python and dispatch between ops that no op accounts for;
- ``layouts``: the same products over a model's weights in three layouts (oneDNN's among them);
- ``read_bandwidth``: a plain sum over a large tensor, every round's figure (a floor judged in a run is drawn from
  the median of them, not the best: what the machine gave that run, not its peak);
- ``dense_step_ms``: transformers' own model with its dense cache, one decode step of a batch (the reference a
  paged step is held against).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from ..models import Chunk

__all__ = ["SLICES", "best_s", "bytes_read", "decode_chunks", "dense_step_ms", "floors", "layouts", "machine",
           "median_s", "profile_step", "read_bandwidth", "step_ms", "weights"]

SLICES = {  # op name -> slice (ops not named: "other ops")
    "aten::mm": "matmuls", "aten::addmm": "matmuls", "aten::bmm": "matmuls", "mkldnn::_linear_pointwise": "matmuls",
    "labserver::onednn_linear": "matmuls",
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
    return statistics.median(_times(fn, repeats))


def best_s(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` (STREAM's convention for a machine's peak): a floor is what the machine gave
    at best. On a shared 2-core machine, one sum over 1 GiB read at 31 and at 54 GB/s within seconds."""
    return min(_times(fn, repeats))


def _times(fn: Any, repeats: int) -> list[float]:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def machine(bandwidth_mb: int = 1024, repeats: int = 7, matmul_n: int = 2048) -> dict[str, float]:
    """This machine's read and copy bandwidth (a float32 tensor of ``bandwidth_mb``, far larger than the caches)
    and matmul throughput (square float32 and bfloat16 matmuls of ``matmul_n``), with torch's own threads: the
    best of ``repeats`` each, so that a floor drawn from them is one the machine can reach."""
    n = bandwidth_mb * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    read_s = best_s(lambda: a.sum(), repeats)
    copy_s = best_s(lambda: b.copy_(a), repeats)
    out: dict[str, float] = {"read_gb_s": n * 4 / read_s / 1e9, "copy_gb_s": 2 * n * 4 / copy_s / 1e9,
                             "threads": torch.get_num_threads()}
    del a, b
    k = matmul_n
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x, y = torch.randn(k, k).to(dtype), torch.randn(k, k).to(dtype)
        out[f"matmul_{name}_gflop_s"] = 2 * k**3 / best_s(lambda x=x, y=y: x @ y, repeats) / 1e9
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


def floors(w: dict[str, int], kv_bytes_per_token: int, b: int, context: int, box: dict[str, float],
           weight_bytes: int | None = None) -> dict[str, Any]:
    """The floors under a decode step of ``b`` sequences at ``context`` tokens each, on the machine ``box``
    (``machine()``): the bytes it reads (``weight_bytes``, else ``w``'s, and every sequence's KV) over the read
    bandwidth, and its FLOPs (two per weight per sequence, and attention's QK and AV: 4 x context x width per
    layer per sequence) over float32 matmul throughput. The larger is the floor, and names what bounds the step."""
    read = (w["bytes_read"] if weight_bytes is None else weight_bytes) + b * context * kv_bytes_per_token
    flops = 2 * b * w["matmul_params"] + 4 * b * context * w["layers"] * w["width"]
    mem_ms = read / (box["read_gb_s"] * 1e9) * 1000
    flop_ms = flops / (box["matmul_fp32_gflop_s"] * 1e9) * 1000
    return {"sequences": b, "bytes_read_mb": read / 1e6, "gflop": flops / 1e9, "memory_floor_ms": mem_ms,
            "compute_floor_ms": flop_ms, "floor_ms": max(mem_ms, flop_ms),
            "bound": "memory" if mem_ms >= flop_ms else "compute"}


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


def layouts(gen: Any, repeats: int, rows: int = 1) -> dict[str, float]:
    """``rows`` sequences' products with the model's own weights in three layouts, ms each (the median of
    ``repeats``): ``linear`` (``linear(x, W)``, W as transformers stores it, ``[out, in]``), ``transposed``
    (``x @ Wt``, its transpose made contiguous once) and ``onednn`` (W reordered once into oneDNN's own layout for
    ``ONEDNN_ROWS`` rows, float32 on a CPU only, and bfloat16 on a CPU that multiplies it natively: what ``Dense``
    multiplies with there) and, for float16 on a CPU, ``widened`` (a float32 copy in oneDNN's layout, its inputs
    widened and its outputs rounded back: what ``Dense`` multiplies ``WIDE_ROWS`` or more rows with); for the
    layers' weights, cycled through so they come from memory as in a step, and for the output head. Also the MB
    each reads (as stored)."""
    import torch.nn.functional as F

    from ..models.linear import onednn_linear, onednn_packs, onednn_weight, out_in, widens

    hf = gen.hf_model
    head = hf.get_output_embeddings().weight.detach()
    layers = [out_in(m) for m in hf.modules() if getattr(m, "weight", None) is not None and m.weight.dim() == 2
              and (isinstance(m, torch.nn.Linear) or getattr(m, "nf", None)) and m.weight is not head]
    xs = {n: torch.randn(rows, n, dtype=head.dtype) for n in {w.shape[1] for w in layers} | {head.shape[1]}}
    out = {"layers_mb": sum(w.numel() * w.element_size() for w in layers) / 1e6,
           "head_mb": head.numel() * head.element_size() / 1e6, "rows": rows}
    kinds: dict[str, Any] = {"linear": (lambda w: w, lambda x, w: F.linear(x, w)),
                             "transposed": (lambda w: w.t().contiguous(), lambda x, w: x @ w)}
    if onednn_packs(head):
        kinds["onednn"] = (onednn_weight, onednn_linear)
    elif widens(head):
        kinds["widened"] = (lambda w: onednn_weight(w.float()), lambda x, w: onednn_linear(x.float(), w).half())
    with torch.inference_mode():
        for kind, (lay, mul) in kinds.items():
            held = [(lay(w), xs[w.shape[1]]) for w in layers]
            out[f"layers_{kind}_ms"] = 1000 * median_s(lambda: [mul(x, w) for w, x in held], repeats)
            w, x = lay(head), xs[head.shape[1]]
            out[f"head_{kind}_ms"] = 1000 * median_s(lambda: mul(x, w), repeats)
    return out


def bytes_read(gen: Any) -> int:
    """Bytes one decode step of ``gen`` reads in weights: ``weights``'s, with the projections as the model holds
    them (``LlamaGen.projection_bytes``: 4-bit blocks and their scales, where it multiplies by those)."""
    total = weights(gen)["bytes_read"]
    held = getattr(gen, "projection_bytes", None)
    if held is None:
        return int(total)
    stored = sum(m.weight.numel() * m.weight.element_size() for m in gen.hf_model.modules()
                 if isinstance(m, torch.nn.Linear) and m is not gen.hf_model.get_output_embeddings())
    return int(total - stored + held())


def read_bandwidth(mb: int = 1024, rounds: int = 9) -> list[float]:
    """GB/s of a plain ``sum`` over a float32 tensor of ``mb`` MiB (far larger than any cache), once a round, with
    torch's own threads: every round's figure, in order (a first, unmeasured sum touches the pages)."""
    a = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    return [a.numel() * 4 / t / 1e9 for t in _times(lambda: a.sum(), rounds)]


def dense_step_ms(gen: Any, batch: int, context: int, steps: int = 20) -> float:
    """transformers' own model under ``gen`` with its dense cache (``DynamicCache``: each sequence's keys and values
    side by side, read in place): the median ms of one decode step of ``batch`` sequences at ``context`` tokens."""
    model, dev = gen.hf_model, gen.hf_model.device
    ids = torch.randint(1000, 20000, (batch, context), generator=torch.Generator().manual_seed(0)).to(dev)
    named = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # (5.24's name)
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache, token = getattr(out, named), out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{named: cache})
            cache, token = getattr(out, named), out.logits[:, -1].argmax(-1, keepdim=True)
            if dev.type == "cuda":  # (a GPU's step ends when its kernels do, not when they are launched)
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)
