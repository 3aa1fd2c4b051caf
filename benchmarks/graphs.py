"""Decode on a GPU: eager steps against the same steps replayed from CUDA graphs (``--cuda-graphs``).

    python benchmarks/graphs.py --device cuda --out results/gpu/graphs.json    # ~2 min on one H100
    python benchmarks/graphs.py --smoke --out /tmp/graphs.json                  # CPU: the padded steps, uncaptured

On a GPU one decode step is a few hundred small kernels, each launched by the CPU from
Python; at a few sequences the GPU waits for the launches. ``labserver.models.graphs``
captures each padded step shape once and replays it with one launch. For each model this
measures, in one run on one device:

1. the model's own ``forward`` on decode chunks (the call the engine makes: plan, copy in,
   compute, choose the tokens, back on the host), eager and from graphs, at ``--batches``
   sequences of ``--context`` tokens: the median of ``--steps`` after warm-up;
2. the memory floor of that step (bytes read: weights and KV, over this device's read
   bandwidth, measured by a sum over ``--bandwidth-mb``);
3. transformers' own model with its dense cache, one decode step of the largest batch at the same
   context (synchronised: a GPU's time, not its launch's), the reference ``servedperf.py`` uses;
4. greedy answers of ``--tokens`` tokens for the largest batch, eager and from graphs: how many
   tokens agree (a padded bucket multiplies other shapes, so a near-tie may part).

``--shape-of DIR`` adds a model of that folder's config with random weights (the SmolLM2-135M
shape, where its weights cannot travel). Goals: graphed / eager step < 1 at one sequence, and the
graphed step of the largest batch <= 0.8x transformers' dense-cache step (``servedperf.py``'s goal).
``--smoke`` runs the padded steps uncaptured on the CPU and judges only that it measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from genperf import Checks, row, write_results  # noqa: E402
from onestream import greedy_answers  # noqa: E402

from labserver.experiments.roofline import bytes_read, decode_chunks, dense_step_ms, step_ms  # noqa: E402
from labserver.experiments.runs import machine_info  # noqa: E402
from labserver.models import load_model  # noqa: E402
from labserver.models.folders import random_of_shape  # noqa: E402
from labserver.models.graphs import use_cuda_graphs  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def read_gb_s(device: str, mb: int) -> float:
    """The best of 7 sums over ``mb`` MB of float32 on ``device``: its read bandwidth, GB/s."""
    x = torch.ones(mb * 250_000, device=device)
    best = float("inf")
    for _ in range(7):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return mb / 1e3 / best


def greedy(gen: Any, b: int, context: int, tokens: int) -> list[list[int]]:
    """``b`` prompts of ``context`` tokens, ``tokens`` greedy tokens each, decoded together."""
    return greedy_answers(gen, [[(11 * i + k) % 900 + 50 for k in range(context)] for i in range(b)], tokens)


def measure(spec: str, label: str, args: argparse.Namespace, batches: list[int], bandwidth: float) -> dict[str, Any]:
    gen = load_model(spec, device=args.device, kind="generate")
    top = max(batches)
    m: dict[str, Any] = {"model": label, "dtype": str(gen.kv.dtype), "weight_mb": bytes_read(gen) / 1e6}
    for b in batches:
        m[f"floor_ms_{b}"] = (bytes_read(gen) + b * args.context * gen.kv_bytes_per_token) / (bandwidth * 1e9) * 1e3
        m[f"eager_ms_{b}"] = step_ms(gen, decode_chunks(gen, b, args.context), args.steps)
    m["dense_ms"] = dense_step_ms(gen, top, args.context, 30)
    eager = greedy(gen, top, args.context, args.tokens)
    try:
        graphs = use_cuda_graphs(gen, top, capture=None if args.device.startswith("cuda") else False)
        for b in batches:
            t = time.perf_counter()
            chunks = decode_chunks(gen, b, args.context)
            gen.forward(chunks)  # (its bucket captured here)
            m[f"first_step_s_{b}"] = time.perf_counter() - t
            m[f"graphs_ms_{b}"] = step_ms(gen, chunks, args.steps)
        replayed = greedy(gen, top, args.context, args.tokens)
        m["tokens"] = top * args.tokens
        m["tokens_equal"] = sum(x == y for a, c in zip(eager, replayed, strict=True) for x, y in zip(a, c, strict=True))
        m["answers_equal"] = sum(a == c for a, c in zip(eager, replayed, strict=True))
        m["buckets"] = sorted(graphs.steps)
    except Exception as e:  # a capture that fails is a result too: said, the eager rows kept
        m["graphs_error"] = f"{type(e).__name__}: {e}"
        print(f"{label}: graphs failed: {m['graphs_error']}", file=sys.stderr)
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="gpt2-random")
    p.add_argument("--shape-of", help="a model folder whose config (with random weights) is measured too")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--bandwidth-mb", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="gpt2-tiny-random on the CPU, uncaptured; checks only")
    p.add_argument("--out", default="results/gpu/graphs.json")
    args = p.parse_args()
    if args.smoke:
        args.device, args.models, args.batches, args.steps, args.tokens, args.bandwidth_mb = \
            "cpu", "gpt2-tiny-random", "1,4", 3, 8, 64
    started = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = read_gb_s(args.device, args.bandwidth_mb)
    numbers: dict[str, Any] = {"machine": machine_info(args.device), "args": vars(args), "read_gb_s": bandwidth,
                               "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        specs = [(s, s) for s in args.models.split(",") if s]
        if args.shape_of:
            label = f"{Path(args.shape_of).name} shape, random weights"
            specs.append((str(random_of_shape(args.shape_of, Path(tmp) / "shape")), label))
        for spec, label in specs:
            print(f"{label} ...", file=sys.stderr)
            numbers["models"].append(measure(spec, label, args, batches, bandwidth))
    rows, check, top = [], Checks(), max(batches)
    for m in numbers["models"]:
        name = m["model"]
        for b in batches:
            rows.append(row(f"{name}: floor / eager step, {b} seq", m[f"floor_ms_{b}"] / m[f"eager_ms_{b}"], "(info)",
                            None, f"{m[f'floor_ms_{b}']:.3f} vs {m[f'eager_ms_{b}']:.2f} ms ({m['dtype']}, "
                                  f"{m['weight_mb']:.0f} MB of weights at {bandwidth:.0f} GB/s)"))
            check.positive(m[f"eager_ms_{b}"], f"{name} eager step of {b}")
        if "graphs_error" in m:
            rows.append(row(f"{name}: graphs", float("nan"), "runs", False, m["graphs_error"][:200]))
            continue
        for b in batches:
            ratio = m[f"graphs_ms_{b}"] / m[f"eager_ms_{b}"]
            rows.append(row(f"{name}: graphed / eager step, {b} seq", ratio, "< 1" if b == 1 else "(info)",
                            ratio < 1 if b == 1 else None,
                            f"{m[f'graphs_ms_{b}']:.2f} vs {m[f'eager_ms_{b}']:.2f} ms; floor "
                            f"{m[f'floor_ms_{b}']:.3f} ms; first step (capture) {m[f'first_step_s_{b}']:.2f} s"))
            check.positive(m[f"graphs_ms_{b}"], f"{name} graphed step of {b}")
        ratio = m[f"graphs_ms_{top}"] / m["dense_ms"]
        rows.append(row(f"{name}: graphed step of {top} / transformers' dense", ratio, "<= 0.8", ratio <= 0.8,
                        f"{m[f'graphs_ms_{top}']:.2f} vs {m['dense_ms']:.2f} ms at a context of {args.context}; "
                        f"eager {m[f'eager_ms_{top}'] / m['dense_ms']:.3f}x"))
        rows.append(row(f"{name}: greedy tokens equal, graphed vs eager", m["tokens_equal"] / m["tokens"], "(info)",
                        None, f"{m['tokens_equal']} of {m['tokens']} tokens, {m['answers_equal']} of {top} answers "
                              f"whole; buckets {m['buckets']}"))
    footer = (f"({(time.perf_counter() - started) / 60:.1f} min on {numbers['machine'].get('cuda') or args.device}; "
              "steps: the model's forward on decode chunks, host to host)")
    write_results(args.out, numbers, rows, footer, width=66)
    if args.smoke:
        check.rows(rows, ["gpt2-tiny-random: floor / eager step", "gpt2-tiny-random: graphed / eager step",
                          "gpt2-tiny-random: graphed step of", "gpt2-tiny-random: greedy tokens equal"])
        for m in numbers["models"]:
            check(m.get("tokens_equal") == m.get("tokens"), f"{m['model']}: padded greedy tokens differ")
        return check.verdict()
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
