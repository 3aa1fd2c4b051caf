"""Served generation against the same engine offline, in alternating rounds, with a per-token cost breakdown.

    python benchmarks/servedperf.py --out results/servedperf/cpu.json     # gpt2-random, 3 rounds: ~8 min on 2 cores
    python benchmarks/servedperf.py --model gpt2-tiny-random --rounds 1 --warmup 2 --duration 4 --smoke \\
        --out /tmp/servedperf.json                                         # smoke: ~1 min

The question: how much of the model's speed does serving keep? One model is loaded once
and measured two ways, in alternating order (offline first in odd rounds, served first in
even ones), ``--rounds`` times:

- **offline**: ``genperf.offline_engine`` (the reference, unchanged: our model's prefill and
  decode called directly in a loop, ``--max-batch`` sequences always running, an endless
  supply of ``genperf.workload``), for ``--duration`` seconds after ``--warmup`` (uncounted, as the
  served window's: it starts with every sequence young, its calls cheaper than in the steady
  state): tokens/s.
- **served**: ``gen-continuous`` with ``--max-batch``, 2 x max_batch closed-loop users
  streaming from ``/generate`` (``genperf``'s workload: prompts of 8-24 words, answers of
  16..256 tokens with ``ignore_eos``); tokens/s counted in ``--duration`` seconds after
  ``--warmup`` (``genperf.measure``'s window).

During each, ``GPT2Gen.costs`` times every model call's parts: attention (``PagedKV.attend``:
K/V written to their slots, gathered, attended over), the matmuls (with their layer norms
and GELU) and the rest (embeddings, logits, planning, choosing tokens), per generated token.
The breakdown, and the CPU use beside it (cores by thread: the
model thread, its OpenMP team, the server's event loop, the rest of the machine: the load
generator and anything else), count the measured window only, not the ramp or the drain.
A mean decode call of max_batch sequences is set beside transformers' own GPT-2 with its dense
cache (``DynamicCache``): the median of 30 decode steps of max_batch sequences at the served
mix's mean context length, the reference for what a step should cost.

From the step log (``CallRecord.model_s``: when the model thread began and ended each call), how long
the model thread waits between two served calls, and for what: the call handed over until the
thread begins it, the result handed back until the loop resumes, and the loop's own work in
between (applying what was made, planning the next call).

Targets: served / offline tokens/s >= 0.95 (median of the rounds, spread printed); the served
decode call of max_batch <= 0.8x the dense-cache step. ``--smoke`` judges what was measured
(rows present and finite, the served runs answered without errors, their tokens counted alike
by client and server, the breakdowns' parts summing to no more than the calls), never a speed.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import genperf  # (benchmarks/ is the script's folder: on the path)
from genperf import Checks, check_run, exit_status, measure, offline_engine, per, row, save_json, server, workload

from labserver.experiments import roofline
from labserver.experiments.runs import machine_info
from labserver.models import load_model, on_fresh_thread
from labserver.models.gpt2 import Costs
from labserver.models.graphs import use_cuda_graphs

CONT = "gen-continuous"


def costs_of(costs: Costs) -> dict[str, Any]:
    """A run's breakdown: ms per token by part, and the mean decode call."""
    return {**{f"{k}_ms_per_token": v for k, v in costs.per_token_ms().items()},
            "decode_call_ms": 1000 * per(costs.decode_s, costs.decode_calls),
            "decode_rows": per(costs.decode_tokens, costs.decode_calls), "calls": costs.calls,
            "tokens": costs.tokens, "parts_s": costs.attention_s + costs.matmul_s, "total_s": costs.total_s}


def usage() -> dict[str, Any]:
    """CPU seconds so far: this process's threads by name, the machine's busy time, and page faults."""
    tick, names = os.sysconf("SC_CLK_TCK"), {t.native_id: t.name for t in threading.enumerate()}
    threads: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (ended meanwhile)
            continue
        name = names.get(int(tid), "")
        group = ("model thread" if name in ("labserver-model", "labserver-fresh")
                 else "server loop" if name.startswith("labserver-")
                 else "other threads" if not name else "benchmark")  # unnamed: OpenMP's
        threads[group] = threads.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return {"t": time.perf_counter(), "threads": threads, "machine": (sum(cpu) - cpu[3] - cpu[4]) / tick,
            "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "system": resource.getrusage(resource.RUSAGE_SELF).ru_stime}


def per_second(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Cores used (CPU s per s) between two usage() snapshots: by thread group, the rest of the machine, faults/s."""
    dt = b["t"] - a["t"]
    cores = {k: (v - a["threads"].get(k, 0.0)) / dt for k, v in b["threads"].items()}
    cores["rest of the machine"] = (b["machine"] - a["machine"]) / dt - sum(cores.values())  # client, others
    return {"cores": {k: round(v, 3) for k, v in cores.items()}, "faults_per_s": (b["faults"] - a["faults"]) / dt,
            "kernel_cores": (b["system"] - a["system"]) / dt}


def offline(gen: Any, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    """The reference, on a thread that ends with it (as the server's model thread does: one OpenMP team at a time),
    counted after the same ``--warmup`` as the served window (``offline_engine`` says why), its costs and CPU use
    over the counted part only."""
    at: dict[str, Any] = {}

    def warmed() -> None:
        at.update(usage=usage(), costs=replace(gen.costs))

    def run() -> dict[str, Any]:  # (usage read on the thread: its CPU time is gone from /proc when it ends)
        result = offline_engine(gen, work, args.max_batch, args.duration, args.warmup, warmed)
        return {**result, **per_second(at["usage"], usage())}

    gen.costs = Costs()
    try:
        result = on_fresh_thread(run)
        return {**result, "warmup_s": args.warmup, **costs_of(gen.costs - at["costs"])}
    finally:
        gen.costs = None


class Sampler(threading.Thread):
    """Snapshots of the model's costs and the CPU use, four a second, to cut the measured window out of afterwards
    (the load generator starts in its own process: its window is known only when it is done)."""

    def __init__(self, gen: Any) -> None:
        super().__init__(name="servedperf-sampler", daemon=True)
        self.gen, self.stop, self.samples = gen, threading.Event(), []

    def run(self) -> None:
        self.gen.costs = Costs()
        while True:
            self.samples.append((time.time(), replace(self.gen.costs), usage()))
            if self.stop.wait(0.25):
                break
        self.gen.costs = None

    def between(self, a_unix: float, b_unix: float) -> dict[str, Any]:
        """Costs and CPU use between the samples nearest two wall-clock times."""
        first = min(self.samples, key=lambda x: abs(x[0] - a_unix))
        last = min(self.samples, key=lambda x: abs(x[0] - b_unix))
        return {**costs_of(last[1] - first[1]), **per_second(first[2], last[2])}


def served(gen: Any, args: argparse.Namespace) -> dict[str, Any]:
    with server(CONT, gen, args) as h:
        sampler = Sampler(gen)
        sampler.start()
        try:
            m = measure(h, args, users=2 * args.max_batch)
        finally:
            sampler.stop.set()
            sampler.join()
        a_s, b_s = m["window_s"]
        context = [s["kv_tokens"] / len(s["seqs"]) for s in h.steps() if s["seqs"] and len(s["decoding"]) == len(s["seqs"])]
        return {**m, **sampler.between(m["t0_unix_s"] + a_s, m["t0_unix_s"] + b_s),
                "mean_context": statistics.mean(context) if context else float("nan")}


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check.rows(numbers["rows"], ["1 served/offline tokens/s", "2 served decode call", "3 attention ms per token",
                                 "3 matmul ms per token", "3 other ms per token", "4 page faults per s",
                                 "5 cores: model thread", "6 model thread idle"])
    check(len(numbers["rounds"]) == args.rounds, f"{len(numbers['rounds'])} rounds recorded of {args.rounds}")
    for i, r in enumerate(numbers["rounds"], 1):
        check_run(check, f"round {i} served", r["served"])
        check.positive(r["offline"]["tps"], f"round {i}: offline tokens/s")
        for where in ("served", "offline"):
            m = r[where]
            check.positive(m["tokens"], f"round {i} {where}: tokens the timed calls chose")
            check(m["parts_s"] <= m["total_s"] * 1.001,
                  f"round {i} {where}: attention + matmuls ({m['parts_s']:.3f} s) "
                  f"exceed the calls' own time ({m['total_s']:.3f} s)")
            check(abs(m["decode_rows"] - args.max_batch) < 0.5 * args.max_batch,
                  f"round {i} {where}: decode calls held {m['decode_rows']:.1f} sequences, not about {args.max_batch}")
            check(m.get("cores", {}).get("model thread", 0.0) > 0.2,
                  f"round {i} {where}: the model thread used {m.get('cores', {}).get('model thread', 0.0):.2f} "
                  "cores while measured (it should be busy)")
        m = r["served"]
        parts = m["to_model_ms"] + m["to_loop_ms"] + m["loop_ms"]
        check(m["model_idle_ms"] > 0 and abs(parts - m["model_idle_ms"]) <= 0.01 * m["model_idle_ms"] + 1e-6
              and 0 < m["model_busy"] < 1,
              f"round {i} served: the model thread idle {m['model_idle_ms']:.3f} ms a call, its parts add to "
              f"{parts:.3f}; busy {m['model_busy']:.3f} (from the step log's model_s)")
        check(r["served"]["tokens"] >= r["served"]["tokens_server"] * 0.2,
              f"round {i}: the model chose {r['served']['tokens']} tokens while timed, the server sent "
              f"{r['served']['tokens_server']}")
    check.positive(numbers["dense"]["step_ms"], "transformers' dense decode step (ms)")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; ratios are their median")
    ap.add_argument("--warmup", type=float, default=15.0, help="served: seconds before the window")
    ap.add_argument("--duration", type=float, default=50.0, help="seconds measured, served and offline")
    ap.add_argument("--tokens", default="16:256", help="asked output lengths, uniform in LO:HI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", action="store_true", help="decode steps replayed from CUDA graphs, offline and "
                    "served (labserver.models.graphs; a GPU only)")
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the targets")
    ap.add_argument("--out", default="results/servedperf/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    lo, _, hi = args.tokens.partition(":")
    genperf.LENGTHS = genperf.UniformLength(int(lo), int(hi or lo))
    args.timeout = 3 * (args.warmup + args.duration) + 300
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)
    started = time.perf_counter()
    numbers: dict[str, Any] = {"machine": machine_info(args.device), "args": vars(args)}

    gen = load_model(args.model, device=args.device, kind="generate")
    if args.cuda_graphs:
        use_cuda_graphs(gen, args.max_batch)
    work = workload(gen, 512, args.seed)
    rounds = []
    for i in range(args.rounds):
        r: dict[str, Any] = {}
        for where in (("offline", "served") if i % 2 == 0 else ("served", "offline")):
            print(f"round {i + 1}/{args.rounds}: {where} ...", file=sys.stderr)
            r[where] = offline(gen, work, args) if where == "offline" else served(gen, args)
        r["ratio"] = per(r["served"]["tps"], r["offline"]["tps"])
        print(f"  served {r['served']['tps']:.1f} vs offline {r['offline']['tps']:.1f} tokens/s: {r['ratio']:.3f}",
              file=sys.stderr)
        rounds.append(r)
    numbers["rounds"] = rounds
    context = round(statistics.median(r["served"]["mean_context"] for r in rounds))
    numbers["dense"] = {"context": context, "step_ms": on_fresh_thread(roofline.dense_step_ms, gen, args.max_batch, context, 30)}

    def med(where: str, key: str) -> float:
        return statistics.median(r[where][key] for r in rounds)

    ratios = sorted(r["ratio"] for r in rounds)
    tps = (med("served", "tps"), med("offline", "tps"))
    rows = [row("1 served/offline tokens/s", statistics.median(ratios), ">= 0.95", statistics.median(ratios) >= 0.95,
                f"{tps[0]:.1f} vs {tps[1]:.1f} tokens/s (medians of {args.rounds}); rounds "
                + ", ".join(f"{x:.3f}" for x in ratios)),
            row(f"2 served decode call of {args.max_batch} / transformers' dense-cache step",
                per(med("served", "decode_call_ms"), numbers["dense"]["step_ms"]), "<= 0.8",
                per(med("served", "decode_call_ms"), numbers["dense"]["step_ms"]) <= 0.8,
                f"{med('served', 'decode_call_ms'):.1f} vs {numbers['dense']['step_ms']:.1f} ms at a context of "
                f"{context} tokens; offline's call {med('offline', 'decode_call_ms'):.1f} ms")]
    for part in ("attention", "matmul", "other", "total"):
        a, b = med("served", f"{part}_ms_per_token"), med("offline", f"{part}_ms_per_token")
        rows.append(row(f"3 {part} ms per token, served/offline", per(a, b), "(info)", None, f"{a:.2f} vs {b:.2f} ms"))
    for what, key in (("page faults per s", "faults_per_s"), ("cores in the kernel", "kernel_cores")):
        a, b = med("served", key), med("offline", key)
        rows.append(row(f"4 {what}, served (offline)", a, "(info)", None, f"offline {b:.3g}; this process"))
    for group in ("model thread", "other threads", "server loop", "rest of the machine"):
        a = statistics.median(r["served"]["cores"].get(group, 0.0) for r in rounds)
        b = statistics.median(r["offline"]["cores"].get(group, 0.0) for r in rounds)
        rows.append(row(f"5 cores: {group}, served (offline)", a, "(info)", None, f"offline {b:.2f}"))
    idle = med("served", "model_idle_ms")
    rows.append(row("6 model thread idle between calls, served, ms", idle, "(info)", None,
                    f"busy {med('served', 'model_busy'):.3f} of the time; a call waits "
                    f"{med('served', 'to_model_ms'):.2f} ms to begin, its result {med('served', 'to_loop_ms'):.2f} ms "
                    "to reach the loop, which works "
                    f"{med('served', 'loop_ms'):.2f} ms before handing over the next (its applying and planning)"))
    numbers["rows"] = rows
    numbers["seconds"] = time.perf_counter() - started

    lines = [f"$ python {' '.join(sys.argv)}", "", f"{'target':<58}{'value':>8}  {'goal':<8}{'result':<8}detail"]
    lines += [f"{r['target']:<58}{r['value']:>8.3f}  {r['goal']:<8}{r['result']:<8}{r['detail']}" for r in rows]
    lines.append(f"({numbers['seconds'] / 60:.1f} min)")
    print("\n".join(lines[2:]))
    out = save_json(args.out, numbers)
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.txt')}", file=sys.stderr)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    sys.exit(main())
