"""When batching hurts: texts of different lengths, item-count against token-aware batching, live.

    python benchmarks/padperf.py --out results/padperf/cpu.json                # ~10 min on 2 cores
    python benchmarks/padperf.py --smoke --seconds 3 --out /tmp/padperf.json   # smoke: ~2 min

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

``--smoke`` judges what was measured (rows, finite values, every request answered), not goals.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import numpy as np
from genperf import Checks, per, row, write_results  # (benchmarks/ is the script's folder: on the path)

import labserver
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
        result = run_load_sync(h.url, payload=payload, duration_s=args.seconds, warmup_s=args.warmup,
                               timeout_s=120, progress=False, seed=args.seed, max_in_flight=4096, **how)
        after = h.stats()
    r = result.records
    kept = r[~r["warmup"]]
    ok = kept[kept["status"] == 200]
    real = after["tokens_computed"] - before["tokens_computed"]
    padded = after["tokens_padded"] - before["tokens_padded"]
    return {"items_per_s": len(ok) / args.seconds, "p99_ms": float(ok["latency_ms"].quantile(0.99)) if len(ok) else
            math.nan, "p50_ms": float(ok["latency_ms"].median()) if len(ok) else math.nan, "n_ok": len(ok),
            "n": len(kept), "errors": int((kept["status"] != 200).sum()), "waste": per(padded - real, padded),
            "real_tokens": int(real), "padded_tokens": int(padded),
            "mean_batch": float(ok["batch_size"].mean()) if len(ok) else math.nan}


def offline(model: Any, payload: Any, args: argparse.Namespace) -> dict[str, Any]:
    """sentence-transformers' ``encode``: sort by length, batches of max_batch, the model called directly."""
    texts = payload.take(4000, np.random.default_rng(args.seed))
    lengths = model.count_tokens(texts)
    ordered = [t for _, t in sorted(zip(lengths, texts, strict=True), key=lambda p: p[0])]

    def run() -> tuple[int, float]:
        model(ordered[:args.max_batch])  # warm
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            for k in range(0, len(ordered), args.max_batch):
                model(ordered[k:k + args.max_batch])
                n += len(ordered[k:k + args.max_batch])
                if time.perf_counter() - t0 >= args.seconds:
                    break
        return n, time.perf_counter() - t0

    n, seconds = on_fresh_thread(run)  # a thread that ends with it, as a server's model thread does
    return {"items_per_s": n / seconds, "items": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--median", type=float, default=20.0, help="words of the median text")
    ap.add_argument("--p99", type=float, default=250.0, help="words of the 99th percentile text (before clipping)")
    ap.add_argument("--max-batch", type=int, default=32, help="thread's item cap, and the offline batch")
    ap.add_argument("--budget", type=int, default=2048, help="tokens: padded tokens per batch")
    ap.add_argument("--users", type=int, default=256, help="saturated runs: closed-loop users")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds left out at each run's start")
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
                                     "mean_words": lengths.mean()}}
    for name in ("thread", "tokens", "naive"):
        print(f"saturated, long-tailed: {name} ...", file=sys.stderr)
        m[f"{name}@sat"] = measure(model, name, kinds[name], mixed, args, users=args.users)
    rate = 0.7 * m["thread@sat"]["items_per_s"]
    m["rate_70"] = rate
    for name in ("thread", "tokens"):
        print(f"Poisson at {rate:.1f}/s (70 % of thread's): {name} ...", file=sys.stderr)
        m[f"{name}@70"] = measure(model, name, kinds[name], mixed, args, rate_per_s=rate)
    for name in ("thread", "tokens"):
        print(f"saturated, every text {same.lengths.mean():.0f} words: {name} ...", file=sys.stderr)
        m[f"{name}@same"] = measure(model, name, kinds[name], same, args, users=args.users)
    print("offline, sorted by length ...", file=sys.stderr)
    m["offline"] = offline(model, mixed, args)

    t, c, n = m["tokens@sat"], m["thread@sat"], m["naive@sat"]
    rows = []
    x = per(t["items_per_s"], c["items_per_s"])
    rows.append(row("1 token-aware/item-count items/s", x, ">= 1.5", x >= 1.5,
                    f"{t['items_per_s']:.1f} vs {c['items_per_s']:.1f}/s, both saturated ({args.users} users); "
                    f"tokens: budget {args.budget}, mean batch {t['mean_batch']:.1f}; thread: max batch "
                    f"{args.max_batch}, mean {c['mean_batch']:.1f}"))
    rows.append(row("1 padding waste, token-aware", t["waste"], "<= 0.15", t["waste"] <= 0.15,
                    f"item-count's {c['waste']:.1%}; naive's {n['waste']:.1%} (one text: none); (padded - real) / "
                    f"padded tokens, from the server's counters"))
    y = per(c["items_per_s"], n["items_per_s"])
    rows.append(row("1 item-count/naive items/s (info)", y, "(info)", None,
                    f"{c['items_per_s']:.1f} vs {n['items_per_s']:.1f}/s: batching by count on this mix "
                    f"{'beat' if y > 1 else 'lost to'} one at a time"))
    lo, hi = m["tokens@70"], m["thread@70"]
    x = per(lo["p99_ms"], hi["p99_ms"])
    rows.append(row("2 p99 latency token-aware/item-count at 70 %", x, "<= 0.7", x <= 0.7,
                    f"{lo['p99_ms']:.0f} vs {hi['p99_ms']:.0f} ms (p50 {lo['p50_ms']:.0f} vs {hi['p50_ms']:.0f}), "
                    f"Poisson at {rate:.1f}/s; {lo['n_ok']} and {hi['n_ok']} answers"))
    s, cs = m["tokens@same"], m["thread@same"]
    x = per(s["items_per_s"], cs["items_per_s"])
    rows.append(row("3 same lengths: token-aware/item-count items/s", x, ">= 0.95", x >= 0.95,
                    f"{s['items_per_s']:.1f} vs {cs['items_per_s']:.1f}/s, every text "
                    f"{same.lengths.mean():.0f} words; waste {s['waste']:.1%} and {cs['waste']:.1%}"))
    x = per(t["items_per_s"], m["offline"]["items_per_s"])
    rows.append(row("4 served token-aware / offline sorted encode", x, ">= 0.8", x >= 0.8,
                    f"{t['items_per_s']:.1f} vs {m['offline']['items_per_s']:.1f}/s (sorted by length, batches "
                    f"of {args.max_batch}); the load generator shares the cores"))
    seconds = time.perf_counter() - started
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "runs": m, "rows": rows, "seconds": seconds}
    write_results(args.out, numbers, rows, f"({seconds:.0f} s, live: server and load generator on the same cores)",
                  width=52)
    if args.smoke:
        check = Checks()
        for r in rows:
            if r["goal"] != "(info)":
                check.positive(r["value"], r["target"])
        for key, run in m.items():
            if isinstance(run, dict) and "errors" in run:
                check(run["errors"] == 0 and run["n_ok"] > 0, f"{key}: {run['errors']} errors, {run['n_ok']} answers")
        return check.verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
