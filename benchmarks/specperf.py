"""Speculative decoding on the real model: when guessing pays, and when it costs, side by side in one run.

    python benchmarks/specperf.py --out results/specperf/cpu.json     # ~12 min on 2 cores
    python benchmarks/specperf.py --smoke --out /tmp/specperf.json    # gpt2-tiny-random, ~1 min

``smollm2`` (float32, exact) served by ``gen-continuous`` in this process, greedy chat
answers (``/v1/chat/completions``, temperature 0, ending at the model's own EOS or
``--max-tokens``), on two workloads: **input-grounded** (``labserver.load.grounded``:
rewrite, correct, quote or summarise a given text, so the answer copies its prompt) and
**open-ended chat** (``labserver.load.prompts.QUESTIONS``). Each row compares a server with
speculation against the same server without, over ``--rounds`` in alternating order
(each ratio the median of its rounds, every round printed):

1. **1 stream**: ``--requests`` prompts sent one at a time, the same prompts to both; output
   tokens per second of request time (per stream); the acceptance rate and the mean
   tokens a verification made, from ``/stats``; and whether the answers were the same;
2. **saturation**: ``--streams`` closed-loop users for ``--duration`` s after ``--warmup``;
   output tokens/s in the window, plain against the rule that turns speculation off while
   more than ``--disable-batch-size`` requests run or wait, and against speculation
   always on (reported as measured);
3. **a draft model** (``--draft``, the same weights in 4-bit blocks by default) at 1 stream on
   the input-grounded workload: what it cost (its milliseconds per verification) and gained;
4. **the verify step's cost**: one sequence's step of k + 1 tokens against its step of one,
   the price a rejected guess pays (the virtual clock's and notebook 13's ``verify_cost``).

Goals: ngram at 1 stream on input-grounded >= 1.5x plain, on open-ended chat >= 0.9x; the
rule at saturation >= 0.95x. ``--smoke`` runs everything tiny and judges only what was measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import numpy as np
from genperf import Checks, RunClock, exit_status, per, row, write_results

from labserver.experiments.runs import machine_info
from labserver.experiments.speculative import acceptance, closed_loop, one_at_a_time, spec_options, verify_cost
from labserver.load.grounded import GroundedTasks
from labserver.load.prompts import QUESTIONS, Questions
from labserver.models import load_model

FULL = dict(model="smollm2", draft="smollm2-q4", requests=12, rounds=2, streams=16, warmup=5.0, duration=25.0,
            max_tokens=160, disable_batch_size=4)
SMOKE = dict(model="gpt2-tiny-random", draft="gpt2-tiny-random", requests=3, rounds=1, streams=4, warmup=0.5,
             duration=2.0, max_tokens=24, disable_batch_size=2)
GOALS = {("ngram", "input-grounded", "1"): 1.5, ("ngram", "open-ended chat", "1"): 0.9, "rule": 0.95}


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    rng = np.random.default_rng(args.seed)
    return {"input-grounded": GroundedTasks().take(args.requests, rng),
            "open-ended chat": Questions(QUESTIONS).take(args.requests, rng)}


def options(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    return spec_options(kind, draft=args.draft, off_above=args.disable_batch_size)


def rounds(fn: Any, kinds: tuple[str, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for i in range(args.rounds):
        r = {}
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            print(f"round {i + 1}/{args.rounds}: {kind} ...", file=sys.stderr)
            r[kind] = fn(kind)
            print(f"  {r[kind]['tps']:.1f} tokens/s", file=sys.stderr)
        out.append(r)
    return out


def ratio_row(name: str, runs: list[dict[str, Any]], kind: str, goal: float | None, extra: str = "") -> dict[str, Any]:
    ratios = [per(r[kind]["tps"], r["plain"]["tps"]) for r in runs]
    value = statistics.median(ratios)
    a, b = (statistics.median(r[k]["tps"] for r in runs) for k in (kind, "plain"))
    spread = f"; spread {max(ratios) - min(ratios):.3f}" if len(ratios) > 1 else ""
    return row(name, value, "(info)" if goal is None else f">= {goal:g}", None if goal is None else value >= goal,
               f"{a:.4g} vs {b:.4g} tokens/s; {acceptance(runs[-1][kind])}; rounds "
               + ", ".join(f"{x:.3f}" for x in ratios) + spread + extra)


def same_answers(runs: list[dict[str, Any]], kind: str) -> tuple[int, int]:
    pairs = [(a, b) for r in runs for a, b in zip(r[kind]["answers"], r["plain"]["answers"], strict=True)]
    return sum(a == b for a, b in pairs), len(pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in FULL:
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(FULL[name]) if FULL[name] is not None else str)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny; exit on checks of what was measured, not on goals")
    ap.add_argument("--out", default="results/specperf/cpu.json")
    args = ap.parse_args()
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    clock = RunClock()
    gen = load_model(args.model, device="cpu", kind="generate")
    texts = workloads(args)
    numbers: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    numbers["verify"] = verify_cost(gen, 4)
    print(f"verify step of 5 / step of 1: {numbers['verify']['ratio']:.2f}", file=sys.stderr)
    for workload, prompts in texts.items():
        numbers[f"1 stream, {workload}"] = rounds(
            lambda kind, p=prompts: one_at_a_time(gen, p, args.max_tokens, **options(kind, args)), ("plain", "ngram"),
            args)
    numbers["1 stream, draft"] = rounds(
        lambda kind: one_at_a_time(gen, texts["input-grounded"], args.max_tokens, **options(kind, args)),
        ("plain", "draft"), args)
    numbers["saturated"] = rounds(
        lambda kind: closed_loop(gen, texts["input-grounded"], args.streams, args.max_tokens, warmup_s=args.warmup,
                                 duration_s=args.duration, seed=args.seed, **options(kind, args)),
        ("plain", "rule", "ngram"), args)
    rows = []
    for workload in texts:
        runs = numbers[f"1 stream, {workload}"]
        same, of = same_answers(runs, "ngram")
        rows.append(ratio_row(f"ngram, {workload}, 1 stream: ngram / plain output tokens/s per stream", runs, "ngram",
                              GOALS[("ngram", workload, "1")], f"; answers equal to plain's: {same} of {of}"))
    draft = numbers["1 stream, draft"]
    d = draft[-1]["draft"]
    same, of = same_answers(draft, "draft")
    rows.append(ratio_row(f"draft, input-grounded, 1 stream: {args.draft} draft / plain output tokens/s per stream",
                          draft, "draft", None, f"; drafting {d['spec_draft_ms'] / max(d['spec_drafts'], 1):.1f} ms "
                          f"and verifying {d['spec_verify_ms'] / max(d['spec_drafts'], 1):.1f} ms a verification; "
                          f"answers equal to plain's: {same} of {of}"))
    sat = numbers["saturated"]
    n = args.streams
    rows.append(ratio_row(f"ngram, input-grounded, {n} streams: off above {args.disable_batch_size} / plain output "
                          "tokens/s", sat, "rule", GOALS["rule"]))
    rows.append(ratio_row(f"ngram, input-grounded, {n} streams: always on / plain output tokens/s", sat, "ngram", None))
    v = numbers["verify"]
    rows.append(row("any proposer, a verify step, 1 stream: 5 tokens / 1 token, ms", v["ratio"], "(info)", None,
                    f"{v['verify_ms']:.2f} vs {v['one_ms']:.2f} ms at a context of 160: what a rejected guess costs"))
    footer = (clock.line() + "\n"
              f"{args.model} float32 on gen-continuous, greedy chat answers of at most {args.max_tokens} tokens; ngram: "
              "prompt lookup, k = 4, suffixes of 2 to 4 tokens; 1 stream: the same prompts one at a time to each "
              "server; saturation: closed-loop users for the window.")
    numbers["rows"] = rows
    write_results(args.out, numbers, rows, footer, width=96, result_last=True)
    return exit_status(args, numbers, rows, smoke_checks)


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    for key in ("1 stream, input-grounded", "1 stream, open-ended chat", "1 stream, draft", "saturated"):
        for r in numbers[key]:
            for kind, m in r.items():
                check(m["tps"] > 0, f"{key}, {kind}: no tokens")
                if kind != "plain":
                    check(m["spec_accepted_tokens"] <= m["spec_proposed_tokens"], f"{key}, {kind}: counters")
    check(numbers["1 stream, draft"][0]["draft"]["spec_proposed_tokens"] > 0, "the draft proposed nothing")
    return check


if __name__ == "__main__":
    sys.exit(main())
