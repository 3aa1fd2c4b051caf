"""Prefill here, decode there: disaggregated against colocated serving, live on this machine and simulated beyond it.

    python benchmarks/disagg.py --out results/disagg/cpu.json              # ~20 min on 2 cores
    python benchmarks/disagg.py --smoke --out /tmp/disagg.json             # a synthetic model, ~2 min

**Live** (``labserver.experiments.disagg``), one arrangement after the other on the same
machine, each loaded with the same requests: ``--requests`` Poisson arrivals at ``--rate``
of a workload mixing long prompts with short answers (``--long-prompt`` tokens answered in
``--short-answer``) and short prompts with long answers (``--short-prompt``, ``--long-answer``),
greedy, ``/generate`` streams:

- colocated: 2 replicas of ``--model`` on Ray Serve, each doing both phases, one torch
  thread each, the operating system placing them on the 2 cores;
- disaggregated: 1 prefill replica pinned to core 0 and 1 decode replica pinned to core 1,
  one torch thread each, the KV handed over through Ray.

Reported, whatever way they come out: p99 inter-token latency (ITL), p50 time to first token
(TTFT), goodput under the SLO (``--ttft-slo`` and ``--tpot-slo``: requests a second whose
first token and mean time per output token both met it), output tokens a second at
saturation (a closed loop of ``--users`` users after the open-loop run), and the transfer's
share of a handed-over request's TTFT (the ingress's ``ttft_split_ms``).

**Simulated** (``labserver.routing.pd_search.best_split``, a virtual clock): for a
prefill-heavy and a decode-heavy workload at 8 and 32 instances, the P:D split with the
most goodput against colocated serving, under costs measured here (``--model`` alone, one
thread: ``experiments.disagg.measured_costs``) and under GPU-class costs that are assumed,
not measured (``routing.pd.PDCosts``' defaults); the SLO of each is set from its costs
(TTFT 5x an unloaded prefill of the workload's mean prompt, TPOT 3x an unloaded decode step).
Then the prefill-heavy workload again under GPU-class costs with a decode instance's batch
capped at 64, 8, 4 and 2 sequences (as a KV pool holding long contexts caps it).

    python benchmarks/disagg.py --skip-live --out results/disagg/simulated.json   # the simulation alone, ~2 min
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
from genperf import Checks, RunClock, exit_status, per, row, write_results

from labserver.analysis.tokens import itl_ms
from labserver.experiments.disagg import ARRANGEMENTS, LiveConfig, measured_costs, run
from labserver.experiments.runs import machine_info
from labserver.models import load_model
from labserver.routing.pd import DECODE_HEAVY, PREFILL_HEAVY, PDCosts
from labserver.routing.pd_search import SLO, best_split

FULL = dict(model="smollm2", requests=300, rate=1.0, users=8, closed_requests=64, long_prompt=512, short_answer=16,
            short_prompt=32, long_answer=128, ttft_slo=3000.0, tpot_slo=60.0, instances="8,32", sim_requests=0)
SMOKE = dict(model="synthetic-gen:300+20?per_token=1&per_seq=2&kv_bytes=46080", requests=16, rate=2.0, users=2,
             closed_requests=6, long_prompt=64, short_answer=4, short_prompt=8, long_answer=16, ttft_slo=3000.0,
             tpot_slo=200.0, instances="4", sim_requests=800)


def live(args: argparse.Namespace) -> dict[str, Any]:
    cfg = LiveConfig(model=args.model, long_prompt=args.long_prompt, short_answer=args.short_answer,
                     short_prompt=args.short_prompt, long_answer=args.long_answer, rate=args.rate,
                     requests=args.requests, users=args.users, closed_requests=args.closed_requests,
                     ttft_slo_ms=args.ttft_slo, tpot_slo_ms=args.tpot_slo, seed=args.seed)
    out = {}
    for name in ARRANGEMENTS:
        print(f"{name}: {cfg.requests} requests at {cfg.rate}/s, then {cfg.users} users ...", file=sys.stderr)
        r = run(name, cfg)
        ok = r.records[r.records["status"] == 200]
        gaps = itl_ms(r.tokens, ok["i"])
        long_answers = ok[ok["flow"] == "long-answer"]
        out[name] = {"summary": r.summary.to_dict(), "by_flow": {k: v.to_dict() for k, v in r.by_flow.items()},
                     "saturated": None if r.saturated is None else r.saturated.to_dict(),
                     "counted": r.counted, "ttft_split_ms": r.ttft_split_ms, "seconds": r.seconds,
                     "itl_p999_ms": float(np.percentile(gaps, 99.9)) if gaps.size else float("nan"),
                     "itl_max_ms": float(gaps.max()) if gaps.size else float("nan"),
                     "long_answer_itl_p99_ms": float(np.percentile(itl_ms(r.tokens, long_answers["i"]), 99))
                     if len(long_answers) else float("nan"),
                     "replicas": {k: {f: v.get(f) for f in ("role", "cores", "threads", "prefill_calls", "decode_calls",
                                                             "kv_handed_in", "kv_handed_out", "kv_handed_expired",
                                                             "tokens_generated")}
                                  for k, v in r.replicas.items()}}
        print(f"  {r.seconds:.0f} s; p50 TTFT {r.summary['ttft_p50_ms']:.0f} ms, p99 ITL "
              f"{r.summary['itl_p99_ms']:.1f} ms", file=sys.stderr)
    return out


def live_rows(m: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    d, c = m["disaggregated"], m["colocated"]
    ds, cs = d["summary"], c["summary"]
    rows = []

    def pair(name: str, a: float, b: float, unit: str, detail: str = "") -> None:
        rows.append(row(f"live, {name}: disaggregated / colocated", per(a, b), "(info)", None,
                        f"{a:.1f} vs {b:.1f} {unit}{detail}"))

    n = int(ds["count"])
    pair(f"p99 ITL ({n} requests)", ds["itl_p99_ms"], cs["itl_p99_ms"], "ms",
         f"; p99.9 {d['itl_p999_ms']:.0f} vs {c['itl_p999_ms']:.0f}, max {d['itl_max_ms']:.0f} vs "
         f"{c['itl_max_ms']:.0f} ms")
    pair("p99 ITL of the long answers", d["long_answer_itl_p99_ms"], c["long_answer_itl_p99_ms"], "ms")
    pair("p50 TTFT", ds["ttft_p50_ms"], cs["ttft_p50_ms"], "ms", "; long prompts "
         f"{d['by_flow']['long-prompt']['ttft_p50_ms']:.0f} vs {c['by_flow']['long-prompt']['ttft_p50_ms']:.0f}, "
         f"long answers {d['by_flow']['long-answer']['ttft_p50_ms']:.0f} vs "
         f"{c['by_flow']['long-answer']['ttft_p50_ms']:.0f} ms")
    pair(f"goodput (TTFT <= {args.ttft_slo:g} ms and TPOT <= {args.tpot_slo:g} ms)", ds["gen_goodput_rps"],
         cs["gen_goodput_rps"], "requests/s", f" at {args.rate:g} offered")
    pair("p50 TPOT", ds["tpot_p50_ms"], cs["tpot_p50_ms"], "ms")
    if d["saturated"] and c["saturated"]:
        pair(f"output tokens/s at saturation ({args.users} users)", d["saturated"]["token_throughput_tps"],
             c["saturated"]["token_throughput_tps"], "tokens/s")
    split = d["ttft_split_ms"]
    total = sum(split.values())
    counted = d["counted"]
    mb = counted["kv_transfer_bytes"] / max(counted["kv_transfers"], 1) / 2**20
    rows.append(row("live, disaggregated: the transfer's share of a handed-over request's TTFT",
                    split["transfer"] / total if total else float("nan"), "(info)", None,
                    f"{split['transfer']:.0f} of {total:.0f} ms (queue {split['queue']:.0f}, prefill "
                    f"{split['prefill']:.0f}, decode admission {split['decode']:.0f}); {mb:.1f} MiB a hand-over at "
                    f"{counted['kv_transfer_bytes'] / 2**20 / max(counted['kv_transfer_ms'] / 1000, 1e-9):.0f} MiB/s"))
    return rows


def search(args: argparse.Namespace, label: str, workload: Any, c: PDCosts, n: int) -> dict[str, Any]:
    """The best split of ``n`` instances against colocation, the SLO set from ``c`` (5x an unloaded prefill of the
    workload's mean prompt, 3x an unloaded decode step)."""
    mean_prompt = float(np.mean(workload.sample(4000, np.random.default_rng(0))[0]))
    slo = SLO(5 * c.prefill_ms(mean_prompt), 3 * c.decode_step_ms(1))
    print(f"simulated: {label}, {workload.name}, {n} instances ...", file=sys.stderr)
    report = best_split(n, workload, c, slo, n_requests=args.sim_requests or None)
    colo = max((r for r in report.rows if r.decode == 0), key=lambda r: r.goodput)  # (the better scheduler)
    return {"costs": vars(c), "slo": vars(slo), "best": vars(report.best), "colocated": vars(colo),
            "rows": [vars(r) for r in report.rows], "seconds": report.seconds}


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    gen = load_model(args.model, device="cpu", kind="generate")
    costs = {"measured here": measured_costs(gen, threads=1, max_batch=16),
             "GPU-class, assumed": PDCosts()}
    sizes = [int(x) for x in args.instances.split(",")]
    out = {f"{label} | {w.name} | {n}": search(args, label, w, c, n)
           for label, c in costs.items() for w in (PREFILL_HEAVY, DECODE_HEAVY) for n in sizes}
    # where the difference from Anyscale's runs comes from: a decode instance's batch, capped (as a KV pool
    # holding long contexts caps it), makes each request's decode cost more of an instance
    for cap in (64, 8, 4, 2):
        label = f"GPU-class, assumed, a decode batch of at most {cap}"
        out[f"{label} | {PREFILL_HEAVY.name} | {sizes[0]}"] = search(args, label, PREFILL_HEAVY,
                                                                      PDCosts(max_batch=cap), sizes[0])
    return out


def placement(live: dict[str, Any]) -> str:
    """Where each arrangement's replicas ran, as they reported it: role, cores, torch threads."""
    return "; ".join(f"{name}: " + ", ".join(f"{r['role']} on cores {r['cores']} with {r['threads']} torch "
                                             f"thread{'' if r['threads'] == 1 else 's'}"
                                             for r in sorted(m["replicas"].values(), key=lambda r: str(r["cores"])))
                     for name, m in live.items())


def sim_rows(sims: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, s in sims.items():
        label, workload, n = key.split(" | ")
        best, colo, slo = s["best"], s["colocated"], s["slo"]
        rows.append(row(f"simulated, {label}, {workload}, {n} instances: best P:D / colocated, goodput",
                        per(best["goodput"], colo["goodput"]), "(info)", None,
                        f"{best['label']} {best['goodput']:.2f} vs {colo['label']} {colo['goodput']:.2f} requests/s "
                        f"(TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.0f} ms, 90 % of requests)"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in FULL.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-live", action="store_true", help="the simulation only")
    ap.add_argument("--smoke", action="store_true", help="tiny; exit on checks of what was measured")
    ap.add_argument("--out", default="results/disagg/cpu.json")
    args = ap.parse_args()
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    clock = RunClock()
    numbers: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    rows = []
    if not args.skip_live:
        numbers["live"] = live(args)
        rows += live_rows(numbers["live"], args)
    numbers["simulated"] = simulated(args)
    rows += sim_rows(numbers["simulated"])
    footer = (clock.line() + "\n"
              + ("no live run (--skip-live). " if args.skip_live else
                 f"live: {args.model} on gen-continuous, greedy, {args.requests} requests at {args.rate:g}/s, half "
                 f"{args.long_prompt}-token prompts answered in {args.short_answer} tokens, half "
                 f"{args.short_prompt}-token prompts answered in {args.long_answer}; colocated first, then "
                 f"disaggregated. Placement: {placement(numbers['live'])}.\n") +
              f"simulated: a virtual clock (labserver.routing.pd), costs measured here from {args.model} alone on one "
              "thread (batches 1-16) or assumed; goodput = the highest rate at which 90 % of requests meet the SLO.")
    numbers["rows"] = rows
    write_results(args.out, numbers, rows, footer, width=100, result_last=True)
    return exit_status(args, numbers, rows, smoke_checks)


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    for name, m in numbers.get("live", {}).items():
        check(m["summary"]["n_ok"] == m["summary"]["count"] > 0, f"{name}: requests failed")
        check(m["summary"]["output_tokens"] > 0, f"{name}: no tokens")
        check(all(r["threads"] == 1 and len(r["cores"]) == 1 for r in m["replicas"].values()),
              f"{name}: a replica not pinned to one core with one thread: {m['replicas']}")
    if "live" in numbers:
        d = numbers["live"]["disaggregated"]["counted"]
        check(d["kv_transfers"] > 0 and d["kv_transfer_bytes"] > 0, "nothing was handed over")
    for key, s in numbers["simulated"].items():
        check(s["best"]["goodput"] > 0, f"{key}: no goodput")
    return check


if __name__ == "__main__":
    sys.exit(main())
