"""Under overload, who goes first: queue disciplines, deadline admission, priorities and fair shares, live.

    python benchmarks/overload.py --out results/overload/cpu.json              # ~20 min on 2 cores
    python benchmarks/overload.py --smoke --seconds 3 --out /tmp/overload.json  # smoke: ~2 min

Side by side in one run, the load generator on the same cores as the server. Rows:

1. Encoders (``--encoder-models``: a ``synthetic`` model whose cost is a sleep, then ``minilm``):
   capacity is measured first (a saturated closed loop on ``thread``, max batch ``--max-batch``),
   the unloaded p99 at a fifth of it; the target is 5x that p99. Then each discipline gets the
   same Poisson schedule: twice the capacity for ``--seconds``, then half of it for
   ``--recovery`` seconds. Goodput = answers within the target per second of the overload,
   over capacity. ``fifo`` (no cap: the plain queue), ``fifo+cap`` (``max_queue`` = as many as can wait
   and still be answered within the target: capacity x target, less the batch of their own), ``codel`` (target: the time left for queueing), ``adaptive-lifo`` and
   ``deadline`` admission (both with ``timeout_ms`` = the target). Goal: the best >= 0.8. Then
   how long each took, after the overload ended, to be back at the unloaded p99 (the first 2 s
   bin from which on every bin's p99 is within 1.5x of it).
2. Generation (``synthetic-gen``: a 20 ms prefill, a 10 ms decode step, 16 lanes): 20 %
   interactive (priority 0, 16 tokens) and 80 % batch (priority 1, 64 tokens) at 1.5x the
   capacity measured for that mix. Interactive p99 TTFT with ``--scheduling priority`` against its
   unloaded value (goal <= 2x), ``fcfs`` beside it; every batch request still answered.
3. Two tenants in closed loops, one with 10x the users of the other, both always waiting (8 lanes,
   8 and 80 users): the light tenant's share of the tokens served with ``--scheduling fair``
   (goal >= 0.45) and with ``fcfs`` (about its share of the users).

``--smoke`` judges what was measured (rows, finite values, every request one outcome), not goals;
it warms each server for 0.3 s instead of 1 s and takes the unloaded p99 of 100 answers instead of 300.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from typing import Any

import numpy as np
import pandas as pd
from genperf import Checks, per, row, write_results  # (benchmarks/ is the script's folder: on the path)

import labserver
from labserver import analysis
from labserver.experiments.runs import machine_info
from labserver.load.mix import Flow, Mix
from labserver.load.payloads import WordTexts
from labserver.loadgen import run_load, run_load_sync

TEXTS = WordTexts(min_words=6, max_words=14, dist="uniform")
PROMPTS = WordTexts(min_words=8, max_words=24, dist="uniform")
BIN_S = 2.0  # recovery: p99 per bin of this many seconds (300 answers at 150/s)
WARM = argparse.Namespace(seconds=1.0, light_answers=300)  # warm-up loads; answers at a fifth of capacity


def poisson(rate: float, seconds: float, start_s: float, rng: np.random.Generator) -> np.ndarray:
    n = rng.poisson(rate * seconds)
    return np.sort(start_s + rng.uniform(0.0, seconds, n))


def load(url: str, **how: Any) -> Any:
    return run_load_sync(url, payload=TEXTS, timeout_s=120, progress=False, max_in_flight=4096, **how)


# ---------------------------------------------------------------- 1. encoders


def encoder_capacity(model: str, args: argparse.Namespace) -> dict[str, float]:
    """Saturated throughput (closed loop, 4 batches' worth of users) and the p99 at a fifth of it."""
    with labserver.serve("thread", model, max_batch_size=args.max_batch) as h:
        load(h.url, users=4 * args.max_batch, duration_s=WARM.seconds)  # warm
        sat = analysis.summarize(load(h.url, users=4 * args.max_batch, duration_s=args.probe_s).records)
        capacity = float(sat["throughput_rps"])
        light = analysis.summarize(load(h.url, rate_per_s=capacity / 5, duration_s=max(args.probe_s, WARM.light_answers / (capacity / 5)),
                                        seed=args.seed).records)
    return {"capacity_rps": capacity, "unloaded_p99_ms": float(light["p99_ms"]), "unloaded_n": int(light["n_ok"])}


ARGS = argparse.Namespace(max_batch=16)  # (set from the command line in main)
DISCIPLINES = {  # name -> Limits knobs, given the target (ms) and the capacity (req/s)
    "fifo": lambda target, cap: {},
    "fifo+cap": lambda target, cap: {"max_queue": max(1, int(cap * target / 1000) - ARGS.max_batch)},
    "codel": lambda target, cap: {"queue": "codel", "codel_target_ms": target / 2},
    "adaptive-lifo": lambda target, cap: {"queue": "adaptive-lifo", "timeout_ms": target},
    "deadline": lambda target, cap: {"admit": "deadline", "timeout_ms": target},
}


def recovery_s(records: pd.DataFrame, end_s: float, p99_ms: float) -> float:
    """Seconds after ``end_s`` until the p99 of every later bin (by scheduled send) is within 1.5x ``p99_ms``."""
    after = records[(records["scheduled_s"] >= end_s) & (records["status"] == 200)]
    if after.empty:
        return math.nan
    bins = ((after["scheduled_s"] - end_s) // BIN_S).astype(int)
    p99 = after.groupby(bins)["latency_ms"].quantile(0.99)
    bad = p99[p99 > 1.5 * p99_ms]
    if bad.empty:
        return 0.0
    last = int(bad.index.max())
    return (last + 1) * BIN_S if last + 1 <= int(p99.index.max()) else math.nan  # nan: never back in this run


def encoder_rows(model: str, args: argparse.Namespace) -> dict[str, Any]:
    cap = encoder_capacity(model, args)
    target = 5 * cap["unloaded_p99_ms"]
    rng = np.random.default_rng(args.seed)
    times = np.concatenate([poisson(2 * cap["capacity_rps"], args.seconds, 0.0, rng),
                            poisson(cap["capacity_rps"] / 2, args.recovery, args.seconds, rng)])
    runs = {}
    for name, knobs in DISCIPLINES.items():
        print(f"encoder {model}: {name} ...", file=sys.stderr)
        with labserver.serve("thread", model, max_batch_size=args.max_batch, **knobs(target, cap["capacity_rps"])) as h:
            load(h.url, users=args.max_batch, duration_s=WARM.seconds)  # warm (and teach deadline admission the cost)
            result = load(h.url, arrival=times.tolist(), max_requests=len(times))
            stats = h.stats()
        r = result.records
        during = r[r["scheduled_s"] < args.seconds]
        good = ((during["status"] == 200) & (during["latency_ms"] <= target) & (during["done_s"] <= args.seconds)).sum()
        runs[name] = {"goodput_share": float(good / args.seconds / cap["capacity_rps"]),
                      "answered_share": float((during["status"] == 200).mean()),
                      "p99_ms": float(during.loc[during["status"] == 200, "latency_ms"].quantile(0.99)),
                      "recovery_s": recovery_s(r, args.seconds, cap["unloaded_p99_ms"]),
                      "requests": len(r), "outcomes": {str(k): int(v) for k, v in r["status"].value_counts().items()},
                      "reasons": {str(k): int(v) for k, v in r["reason"].value_counts().items() if k},
                      "server_statuses": stats["statuses"], "shed": stats.get("shed", {}),
                      "refused_deadline": stats.get("refused_deadline", 0)}
    return {**cap, "target_ms": target, "runs": runs}


# ---------------------------------------------------------------- 2. priorities on generation

GEN_MODEL = "synthetic-gen:20+10"
INTERACTIVE, BATCH = 16, 64


def gen_mix(ttft_ms: float | None = None) -> Mix:
    return Mix((Flow("interactive", 0.2, priority=0, ttft_slo_ms=ttft_ms, new_tokens=INTERACTIVE),
                Flow("batch", 0.8, priority=1, new_tokens=BATCH)))


def gen_load(url: str, **how: Any) -> Any:
    return run_load_sync(url, mode="generate", payload=PROMPTS, stream=True, ignore_eos=True, timeout_s=600,
                         progress=False, max_in_flight=8192, **how)


def flow_row(result: Any, mix: Mix, flow: str) -> dict[str, Any]:
    table = analysis.summarize_flows(result.records, mix, result.tokens)
    r = table[table["flow"] == flow].iloc[0]
    return {"ttft_p99_ms": float(r["ttft_p99_ms"]), "ttft_p50_ms": float(r["ttft_p50_ms"]), "count": int(r["count"]),
            "n_ok": int(r["n_ok"])}


def priority_rows(args: argparse.Namespace) -> dict[str, Any]:
    mix = gen_mix()
    with labserver.serve("gen-continuous", GEN_MODEL, max_batch_size=16) as h:
        sat = gen_load(h.url, users=48, duration_s=args.probe_s, mix=mix, seed=args.seed)
        capacity = float(analysis.summarize(sat.records)["throughput_rps"])
        solo = gen_load(h.url, rate_per_s=args.unloaded_rate, max_requests=args.interactive,
                        mix=Mix((Flow("interactive", 1.0, priority=0, new_tokens=INTERACTIVE),)), seed=args.seed)
    unloaded = flow_row(solo, Mix((Flow("interactive", 1.0, priority=0, new_tokens=INTERACTIVE),)), "interactive")
    n = int(args.interactive / 0.2)
    runs = {}
    for scheduling in ("fcfs", "priority"):
        print(f"generation: {scheduling} at 1.5x ...", file=sys.stderr)
        with labserver.serve("gen-continuous", GEN_MODEL, max_batch_size=16, scheduling=scheduling) as h:
            result = gen_load(h.url, rate_per_s=1.5 * capacity, max_requests=n, mix=mix, seed=args.seed)
            stats = h.stats()
        runs[scheduling] = {"interactive": flow_row(result, mix, "interactive"), "batch": flow_row(result, mix, "batch"),
                            "displaced": stats.get("preempted_for_priority", 0)}
    return {"capacity_rps": capacity, "unloaded": unloaded, "runs": runs}


# ---------------------------------------------------------------- 3. fair shares


async def two_tenants(url: str, args: argparse.Namespace) -> tuple[Any, Any]:
    how = dict(mode="generate", payload=PROMPTS, new_tokens=32, stream=True, ignore_eos=True, timeout_s=600,
               progress=False, duration_s=args.fair_s)
    heavy = run_load(url, users=80, mix=Mix((Flow("heavy", 1.0, tenant="heavy"),)), seed=args.seed, **how)
    light = run_load(url, users=8, mix=Mix((Flow("light", 1.0, tenant="light"),)), seed=args.seed + 1, **how)
    return await asyncio.gather(heavy, light)


def fair_rows(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for scheduling in ("fcfs", "fair"):
        print(f"tenants: {scheduling} ...", file=sys.stderr)
        with labserver.serve("gen-continuous", GEN_MODEL, max_batch_size=8, scheduling=scheduling) as h:
            heavy, light = asyncio.run(two_tenants(h.url, args))
        # tokens served while both were sending: two generators, two clocks, met on the wall clock
        runs = {"heavy": heavy, "light": light}
        t0 = {name: res.meta["t0_unix_s"] for name, res in runs.items()}
        start = max(t0.values())
        end = min(t0[name] + res.records["scheduled_s"].max() for name, res in runs.items())
        served = {name: int(res.tokens["t_s"].add(t0[name]).between(start, end).sum()) for name, res in runs.items()}
        out[scheduling] = {"light_share": per(served["light"], served["light"] + served["heavy"]), "tokens": served,
                           "requests": {"heavy": len(heavy.records), "light": len(light.records)}}
    return out


# ---------------------------------------------------------------- the table


def rows_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for model, e in m["encoders"].items():
        runs = e["runs"]
        best = max((k for k in runs if k != "fifo"), key=lambda k: runs[k]["goodput_share"])
        detail = "; ".join(f"{k} {v['goodput_share']:.2f}" for k, v in runs.items())
        rows.append(row(f"1 {model}: best goodput / capacity at 2x ({best})", runs[best]["goodput_share"], ">= 0.8",
                        runs[best]["goodput_share"] >= 0.8,
                        f"{detail}; capacity {e['capacity_rps']:.0f}/s, target {e['target_ms']:.0f} ms"))
        rows.append(row(f"1 {model}: fifo goodput / capacity at 2x", runs["fifo"]["goodput_share"], "printed", None,
                        f"p99 {runs['fifo']['p99_ms']:.0f} ms against a target of {e['target_ms']:.0f} ms"))
        back = row(f"1 {model}: recovery of {best} (s after the overload)", runs[best]["recovery_s"], "printed",
                   None, "; ".join(f"{k} {v['recovery_s']:.0f} s" for k, v in runs.items()) + " (nan: not back "
                   "within the run)")
        if not math.isfinite(back["value"]):
            back["result"] = "SKIP"  # not back at the unloaded p99 before the run ended: no figure to give
        rows.append(back)
    p = m["priority"]
    ratio = per(p["runs"]["priority"]["interactive"]["ttft_p99_ms"], p["unloaded"]["ttft_p99_ms"])
    rows.append(row("2 priority: interactive p99 TTFT / unloaded, at 1.5x", ratio, "<= 2", ratio <= 2,
                    f"{p['runs']['priority']['interactive']['ttft_p99_ms']:.0f} vs {p['unloaded']['ttft_p99_ms']:.0f} ms; "
                    f"fcfs {p['runs']['fcfs']['interactive']['ttft_p99_ms']:.0f} ms; "
                    f"{p['runs']['priority']['interactive']['count']} interactive"))
    batch = p["runs"]["priority"]["batch"]
    rows.append(row("2 priority: batch requests answered (share)", per(batch["n_ok"], batch["count"]), "= 1",
                    batch["n_ok"] == batch["count"], f"{batch['n_ok']} of {batch['count']}, "
                                                     f"{p['runs']['priority']['displaced']} displaced"))
    f = m["fair"]
    rows.append(row("3 fair: light tenant's share of tokens (10x users beside it)", f["fair"]["light_share"],
                    ">= 0.45", f["fair"]["light_share"] >= 0.45, f"fcfs {f['fcfs']['light_share']:.3f}"))
    return rows


def smoke_checks(m: dict[str, Any], rows: list[dict[str, Any]]) -> Checks:
    check = Checks()
    check.rows(rows, ["1 ", "2 priority", "3 fair"])
    for model, e in m["encoders"].items():
        check.positive(e["capacity_rps"], f"{model} capacity")
        for name, run in e["runs"].items():
            answered = sum(run["outcomes"].values())
            check(answered == run["requests"], f"{model} {name}: {answered} outcomes for {run['requests']} requests")
            check(set(run["outcomes"]) <= {"200", "503", "504"}, f"{model} {name}: outcomes {run['outcomes']}")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder-models", default="synthetic:20+2,minilm", help="comma-separated")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0, help="encoders: seconds at twice the capacity")
    ap.add_argument("--recovery", type=float, default=20.0, help="encoders: seconds at half the capacity after")
    ap.add_argument("--probe-s", type=float, default=15.0, help="capacity probes: seconds")
    ap.add_argument("--interactive", type=int, default=320, help="generation: interactive requests at 1.5x")
    ap.add_argument("--unloaded-rate", type=float, default=20.0, help="generation: interactive-only rate, req/s")
    ap.add_argument("--fair-s", type=float, default=30.0, help="tenants: seconds of closed loops")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the goals")
    ap.add_argument("--out", default="results/overload/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    ARGS.max_batch = args.max_batch
    if args.smoke:  # what is not a measurement, shorter
        WARM.seconds, WARM.light_answers = 0.3, 100
    started = time.perf_counter()
    m = {"encoders": {model: encoder_rows(model, args) for model in args.encoder_models.split(",")},
         "priority": priority_rows(args), "fair": fair_rows(args)}
    rows = rows_of(m)
    seconds = time.perf_counter() - started
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "runs": m, "rows": rows, "seconds": seconds}
    write_results(args.out, numbers, rows, f"({seconds:.0f} s, live: server and load generator on the same cores)",
                  width=64)
    if args.smoke:
        return smoke_checks(m, rows).verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
