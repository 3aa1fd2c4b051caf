"""When batching hurts: texts of different lengths, item-count against token-aware batching, live.

    python benchmarks/padperf.py --out results/padperf/cpu.json      # ~12 min on 2 cores (2 rounds)
    python benchmarks/padperf.py --smoke --seconds 2 --warmup 1 --users 64 --rounds 1 --out /tmp/padperf.json

``minilm`` (its limit: 256 tokens) on texts of the built-in words, one token each, plus [CLS]
and [SEP]: lengths lognormal with median ``--median`` words and p99 ``--p99`` (clipped to the
limit), the long-tailed mix of an embedding workload. Side by side in one run, the load
generator on the same cores as the server. Rows:

1. Saturated (closed loops of ``--users``): ``tokens`` (a budget of ``--budget`` padded tokens,
   texts of a length together) against ``thread`` (an item count, max batch ``--max-batch``):
   items/s (goal >= 1.5), and each one's padding waste, (padded - real) / padded, from the
   server's counters (goal for ``tokens`` <= 15 %). ``naive`` beside them: whether batching
   by count beat one at a time on this mix.
2. Poisson at 70 % of ``thread``'s saturated rate: p99 latency tokens / thread (goal <= 0.7).
3. Every text the mix's mean length: tokens / thread items/s, saturated (goal >= 0.95: no loss
   where nothing differs).
4. Served ``tokens`` against the model called directly as sentence-transformers' ``encode``
   does (the same texts sorted by length, batches of ``--max-batch``): items/s (goal >= 0.8).

Every ratio is the median of ``--rounds`` rounds, the order reversed every other round (the
machine's speed drifts within minutes); the rounds' own values are printed beside it.
``--smoke`` judges what was measured (rows, finite values, every request answered), not goals;
its offline passes take 100 texts instead of 2000.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import numpy as np
from genperf import Checks, per, row, write_results  # (benchmarks/ is the script's folder: on the path)

import labserver
from labserver import analysis
from labserver.experiments.runs import machine_info
from labserver.load.lengths import ConstantLength, LognormalLength
from labserver.load.prompts import TokenPrompts
from labserver.loadgen import run_load_sync
from labserver.models import load_model, on_fresh_thread

LIMIT = 256  # minilm's max_seq_length: a text's words + [CLS] + [SEP] at most this


def servers(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {"thread": {"max_batch_size": args.max_batch},
            "tokens": {"max_batch_size": None, "max_batch_tokens": args.budget},
            "naive": {}}


def measure(model: Any, name: str, knobs: dict[str, Any], payload: Any, args: argparse.Namespace,
            **how: Any) -> dict[str, Any]:
    """One server, one load: answered items/s, p99, the padding its counters saw, and the answer count."""
    with labserver.serve(name, model, max_queue=100_000, **knobs) as h:
        run_load_sync(h.url, payload=payload, users=8, duration_s=1.0, progress=False)  # warm
        before = h.stats()
        result = run_load_sync(h.url, payload=payload, duration_s=args.seconds + args.warmup, warmup_s=args.warmup,
                               timeout_s=120, progress=False, seed=args.seed, max_in_flight=4096, **how)
        after = h.stats()
    s = analysis.summarize(result.records, meta=result.meta)
    real = after["tokens_computed"] - before["tokens_computed"]
    padded = after["tokens_padded"] - before["tokens_padded"]
    ok = result.records[(result.records["status"] == 200) & ~result.records["warmup"]]
    return {"items_per_s": float(s["throughput_rps"]), "p99_ms": float(s["p99_ms"]), "p50_ms": float(s["p50_ms"]),
            "n_ok": int(s["n_ok"]), "n": int(s["count"]), "errors": int(s["count"] - s["n_ok"]),
            "waste": per(padded - real, padded), "real_tokens": int(real), "padded_tokens": int(padded),
            "mean_batch": float(ok["batch_size"].mean()) if len(ok) else math.nan}


def offline(model: Any, payload: Any, args: argparse.Namespace, threads: int | None = None) -> dict[str, Any]:
    """sentence-transformers' ``encode``: sort by length, batches of max_batch, the model called directly
    (with ``threads`` torch threads for the call, then torch's default again)."""
    import torch
    texts = payload.take(100 if args.smoke else 2000, np.random.default_rng(args.seed))  # (smoke: one short pass)
    lengths = model.count_tokens(texts)
    ordered = [t for _, t in sorted(zip(lengths, texts, strict=True), key=lambda p: p[0])]

    def run() -> tuple[int, float]:  # whole passes over every length, at least one and for at least --seconds
        model(ordered[:args.max_batch])  # warm
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < args.seconds:
            for k in range(0, len(ordered), args.max_batch):
                model(ordered[k:k + args.max_batch])
            n += len(ordered)
        return n, time.perf_counter() - t0

    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        n, seconds = on_fresh_thread(run)  # a thread that ends with it, as a server's model thread does
    finally:
        torch.set_num_threads(default)
    return {"items_per_s": n / seconds, "items": n, "threads": threads or default}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--median", type=float, default=20.0, help="words of the median text")
    ap.add_argument("--p99", type=float, default=250.0, help="words of the 99th percentile text (before clipping)")
    ap.add_argument("--max-batch", type=int, default=32, help="thread's item cap, and the offline batch")
    ap.add_argument("--budget", type=int, default=2048, help="tokens: padded tokens per batch")
    ap.add_argument("--users", type=int, default=256, help="saturated runs: closed-loop users")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run (after --warmup)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds sent before the measured ones, left out")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, order reversed every other; ratios are medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the goals")
    ap.add_argument("--out", default="results/padperf/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    started = time.perf_counter()
    model = load_model(args.model, device="cpu")
    lengths = LognormalLength.from_p99(args.median, args.p99, lo=1, hi=LIMIT - 2)
    mixed = TokenPrompts(lengths)
    same = TokenPrompts(ConstantLength(round(lengths.mean())))
    kinds = servers(args)
    m: dict[str, Any] = {"lengths": {"median": args.median, "p99": args.p99, "sigma": lengths.sigma,
                                     "mean_words": lengths.mean()}, "rounds": []}
    rate = math.nan
    for i in range(args.rounds):
        r: dict[str, Any] = {}
        flip = (lambda names: names) if i % 2 == 0 else (lambda names: names[::-1])  # drift lands on both sides
        for name in flip(("thread", "tokens", "naive")):
            print(f"round {i + 1}: saturated, long-tailed: {name} ...", file=sys.stderr)
            r[f"{name}@sat"] = measure(model, name, kinds[name], mixed, args, users=args.users)
        if i == 0:  # one schedule for every round: 70 % of thread's first saturated rate
            rate = 0.7 * r["thread@sat"]["items_per_s"]
            if not rate > 0:  # (NaN: nothing answered in the window)
                print(f"thread answered nothing in its {args.seconds:g} s saturated window (a busy machine?): "
                      "nothing to set the Poisson rate by; try a longer --seconds", file=sys.stderr)
                return 1
        for name in flip(("thread", "tokens")):
            print(f"round {i + 1}: Poisson at {rate:.1f}/s (70 % of thread's): {name} ...", file=sys.stderr)
            r[f"{name}@70"] = measure(model, name, kinds[name], mixed, args, rate_per_s=rate)
        for name in flip(("thread", "tokens")):
            print(f"round {i + 1}: saturated, every text {same.lengths.mean():.0f} words: {name} ...", file=sys.stderr)
            r[f"{name}@same"] = measure(model, name, kinds[name], same, args, users=args.users)
        print(f"round {i + 1}: offline, sorted by length ...", file=sys.stderr)
        r["offline"] = offline(model, mixed, args)
        r["offline_1thread"] = offline(model, mixed, args, threads=1)
        m["rounds"].append(r)
    m["rate_70"] = rate
    rounds = m["rounds"]

    def med(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in rounds)

    def ratio(a: str, b: str, field: str = "items_per_s") -> tuple[float, str]:
        """The median over rounds of a / b, and the rounds' values."""
        values = [per(r[a][field], r[b][field]) for r in rounds]
        return statistics.median(values), "; rounds " + ", ".join(f"{v:.3f}" for v in values)

    rows = []
    x, spread = ratio("tokens@sat", "thread@sat")
    rows.append(row("1 token-aware/item-count items/s", x, ">= 1.5", x >= 1.5,
                    f"{med('tokens@sat', 'items_per_s'):.1f} vs {med('thread@sat', 'items_per_s'):.1f}/s, both "
                    f"saturated ({args.users} users); tokens: budget {args.budget}, mean batch "
                    f"{med('tokens@sat', 'mean_batch'):.1f}; thread: max batch {args.max_batch}{spread}"))
    waste = med("tokens@sat", "waste")
    rows.append(row("1 padding waste, token-aware", waste, "<= 0.15", waste <= 0.15,
                    f"item-count's {med('thread@sat', 'waste'):.1%}; (padded - real) / padded tokens, from the "
                    f"server's counters"))
    x, spread = ratio("thread@sat", "naive@sat")
    rows.append(row("1 item-count/naive items/s (info)", x, "(info)", None,
                    f"{med('thread@sat', 'items_per_s'):.1f} vs {med('naive@sat', 'items_per_s'):.1f}/s: batching "
                    f"by count on this mix {'beat' if x > 1 else 'lost to'} one at a time{spread}"))
    x, spread = ratio("tokens@70", "thread@70", "p99_ms")
    rows.append(row("2 p99 latency token-aware/item-count at 70 %", x, "<= 0.7", x <= 0.7,
                    f"{med('tokens@70', 'p99_ms'):.0f} vs {med('thread@70', 'p99_ms'):.0f} ms (p50 "
                    f"{med('tokens@70', 'p50_ms'):.0f} vs {med('thread@70', 'p50_ms'):.0f}), Poisson at {rate:.1f}/s; "
                    f"{min(r['tokens@70']['n_ok'] for r in rounds)}+ answers each{spread}"))
    x, spread = ratio("tokens@same", "thread@same")
    rows.append(row("3 same lengths: token-aware/item-count items/s", x, ">= 0.95", x >= 0.95,
                    f"{med('tokens@same', 'items_per_s'):.1f} vs {med('thread@same', 'items_per_s'):.1f}/s, every "
                    f"text {same.lengths.mean():.0f} words{spread}"))
    x, spread = ratio("tokens@sat", "offline")
    rows.append(row("4 served token-aware / offline sorted encode", x, ">= 0.8", x >= 0.8,
                    f"{med('tokens@sat', 'items_per_s'):.1f} vs {med('offline', 'items_per_s'):.1f}/s (sorted by "
                    f"length, batches of {args.max_batch}, {rounds[0]['offline']['threads']} torch threads); the "
                    f"load generator and the server share the cores{spread}"))
    x, spread = ratio("tokens@sat", "offline_1thread")
    rows.append(row("4 served token-aware / offline with 1 torch thread", x, "(info)", None,
                    f"{med('tokens@sat', 'items_per_s'):.1f} vs {med('offline_1thread', 'items_per_s'):.1f}/s: the "
                    f"model's share of the 2 cores when served{spread}"))
    seconds = time.perf_counter() - started
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "runs": m, "rows": rows, "seconds": seconds}
    write_results(args.out, numbers, rows, f"({seconds:.0f} s, live: server and load generator on the same cores)",
                  width=52)
    if args.smoke:
        check = Checks()
        for r in rows:
            if r["goal"] != "(info)":
                check.positive(r["value"], r["target"])
        for key, run in ((k, v) for r in rounds for k, v in r.items()):
            if "errors" in run:
                check(run["errors"] == 0 and run["n_ok"] > 0, f"{key}: {run['errors']} errors, {run['n_ok']} answers")
        return check.verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
