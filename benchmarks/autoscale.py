"""Replicas that follow the load: fixed 1, fixed MAX and autoscaled MIN:MAX on one traffic step; cold starts.

    python benchmarks/autoscale.py --out results/autoscale/cpu.json      # ~10 min on 2 cores
    python benchmarks/autoscale.py --smoke --short --out /tmp/autoscale.json

Rows (``labserver.experiments.autoscale``):

1. **Simulated**, cluster scale: the step r, 3r, r through Ray Serve's rule (``routing.Autoscaler``)
   on 1 to 64 replicas (2 s a request, 4 at once a replica), cold starts of 2 s and 30 s: the
   waits in the step, the replicas reached, the replica-seconds.
2. **Live** on Ray Serve, replicas of ``synthetic-gen`` (sleeps: a replica's capacity is its
   batch, not the 2 shared cores), the same step for each of fixed 1, fixed 2 and autoscaled
   1:2 (delays of seconds): TTFT p50/p99 in windows, replicas over time, replica-seconds,
   requests lost (goal 0), replicas reached (goal 2), cost and latency against the fixed ones.
3. Cold starts, from the autoscaler's decision to the new replica's first token, in parts
   (actor, model load, compile, until its first token): the synthetic model's from row 2, and
   ``smollm2``'s from a burst on an autoscaled 1:2 (``--compile``: compiled replicas).
4. The live step's own arrivals through the same rule on the virtual clock, a replica's
   service time from the model's sleeps and the cold start measured in 3: replica-seconds and
   replicas reached, simulated against live.

``--smoke`` judges what was measured (rows, finite values, every request counted), not the goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import threading
import time
from typing import Any

from genperf import Checks, per, row, write_results  # (benchmarks/ is the script's folder: on the path)

import httpx

import labserver
from labserver.experiments.autoscale import StepConfig, cluster_step, run_step, simulate_step
from labserver.experiments.runs import machine_info
from labserver.replicas import ray_session


def simulated_rows() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    runs = {cold: cluster_step(cold) for cold in (2.0, 30.0)}
    m = {f"{cold:g}": {"reached": r.reached, "replica_seconds": r.replica_seconds, "lost": r.lost,
                       "wait_p50_s": r.wait_quantile(0.5, 120, 420), "wait_p99_s": r.wait_quantile(0.99, 120, 420),
                       "wait_p99_first_60_s": r.wait_quantile(0.99, 120, 180), "requests": len(r.arrivals_s),
                       "decisions": len(r.decisions)} for cold, r in runs.items()}
    fast, slow = m["2"], m["30"]
    rows = [row("1 simulated 1:64, cold start 2 s: replicas reached", fast["reached"], "64", fast["reached"] == 64,
                f"{fast['requests']} requests, {fast['decisions']} decisions, lost {fast['lost']}"),
            row("1 simulated 1:64, cold start 30 s: replicas reached", slow["reached"], "64", slow["reached"] == 64,
                f"{slow['requests']} requests, {slow['decisions']} decisions, lost {slow['lost']}"),
            row("1 simulated 1:64: p99 wait in the step's first 60 s, 30 s / 2 s cold start",
                per(slow["wait_p99_first_60_s"], fast["wait_p99_first_60_s"]), "(info)", None,
                f"{slow['wait_p99_first_60_s']:.1f} vs {fast['wait_p99_first_60_s']:.1f} s (whole step p99 "
                f"{slow['wait_p99_s']:.1f} vs {fast['wait_p99_s']:.1f} s, p50 {slow['wait_p50_s']:.2f} vs "
                f"{fast['wait_p50_s']:.2f} s)"),
            row("1 simulated 1:64: replica-seconds, 30 s / 2 s cold start",
                per(slow["replica_seconds"], fast["replica_seconds"]), "(info)", None,
                f"{slow['replica_seconds']:,.0f} vs {fast['replica_seconds']:,.0f} replica-seconds")]
    return m, rows


def timeline_text(run: Any) -> str:
    """The replicas over time, compact: t: running (+ starting, - stopping)."""
    parts = []
    for r in run.timeline.itertuples():
        extra = (f"+{r.starting}" if r.starting else "") + (f"-{r.stopping}" if r.stopping else "")
        parts.append(f"{max(r.t_s, 0.0):.1f}s {r.running}{extra}")
    return ", ".join(parts)


def cold_parts(cold: dict[str, Any]) -> str:
    compile_s = "not compiled" if cold["compile_s"] is None else f"compile {cold['compile_s']:.1f}"
    return (f"actor {cold['actor_s']:.1f} + load {cold['load_s']:.2f} + {compile_s} + until its first token "
            f"{cold['serving_s']:.1f} s")


def live_rows(cfg: StepConfig, m: dict[str, Any]) -> list[dict[str, Any]]:
    rows, windows = [], cfg.windows()
    fixed1, fixed2, auto = m["fixed 1"], m["fixed 2"], m["autoscaled 1:2"]
    for name, s in m["summaries"].items():
        ttft = "; ".join(f"{w} {s[f'ttft_p50_ms {w}']:.0f}/{s[f'ttft_p99_ms {w}']:.0f}" for w in windows)
        rows.append(row(f"2 live {name}: requests lost", s["lost"], "0", s["lost"] == 0,
                        f"of {s['requests']}; TTFT p50/p99 ms: {ttft}"))
        rows.append(row(f"2 live {name}: replica-seconds", s["replica_seconds"], "(info)", None,
                        f"reached {s['reached']}; replicas over time: {m['timelines'][name]}"))
    s = m["summaries"]["autoscaled 1:2"]
    ups = [d for d in s["decisions"] if d["new"] > d["old"]]
    rows.append(row("autoscaled 1:2: requests lost", s["lost"], "0", s["lost"] == 0, f"of {s['requests']}"))
    up_at = ", ".join(f"{d['t_s']:.1f}" for d in ups) or "never"
    rows.append(row("autoscaled 1:2: replicas reached", s["reached"], "2", s["reached"] == 2,
                    f"decided up at {up_at} s (the step began at "
                    f"{cfg.before_s:g} s); decisions {[(round(d['t_s'], 1), d['old'], d['new']) for d in s['decisions']]}"))
    step = windows["step, first 15 s"]
    cost, late = per(auto.replica_seconds, fixed2.replica_seconds), per(auto.ttft_ms(0.99, step), fixed1.ttft_ms(0.99, step))
    rows.append(row("autoscaled 1:2 / fixed 2: replica-seconds", cost, "< 1", cost < 1,
                    f"{auto.replica_seconds:.0f} vs {fixed2.replica_seconds:.0f} (fixed 1: {fixed1.replica_seconds:.0f})"))
    rows.append(row("autoscaled 1:2 / fixed 1: p99 TTFT, step's first 15 s", late, "< 1", late < 1,
                    f"{auto.ttft_ms(0.99, step):.0f} vs {fixed1.ttft_ms(0.99, step):.0f} ms (fixed 2: "
                    f"{fixed2.ttft_ms(0.99, step):.0f} ms)"))
    rest = windows["step, rest"]
    rows.append(row("autoscaled 1:2 / fixed 2: p99 TTFT, rest of the step", per(auto.ttft_ms(0.99, rest),
                    fixed2.ttft_ms(0.99, rest)), "(info)", None,
                    f"{auto.ttft_ms(0.99, rest):.0f} vs {fixed2.ttft_ms(0.99, rest):.0f} ms: once both replicas run"))
    return rows


def cold_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for model, cold in m["cold"].items():
        ok = cold is not None and cold.get("first_token_s") is not None
        rows.append(row(f"3 cold start {model}: decision to first token, s", cold["first_token_s"] if ok else math.nan,
                        "(info)", None, cold_parts(cold) if ok else "no replica was added"))
    return rows


def sim_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    sim, live = m["sim"], m["summaries"]["autoscaled 1:2"]
    ratio = per(sim["replica_seconds"], live["replica_seconds"])
    return [row("4 simulated / live autoscaled 1:2: replica-seconds", ratio, "1+-0.25", abs(ratio - 1) <= 0.25,
                f"{sim['replica_seconds']:.0f} vs {live['replica_seconds']:.0f}; simulated with a cold start of "
                f"{sim['cold_start_s']:.1f} s; decisions {sim['decisions']}"),
            row("4 simulated / live autoscaled 1:2: replicas reached", sim["reached"], str(live["reached"]),
                sim["reached"] == live["reached"], f"simulated p99 wait in the step's first 15 s "
                f"{sim['wait_p99_s']:.1f} s")]


def smollm2_cold_start(args: argparse.Namespace) -> dict[str, Any] | None:
    """A burst on autoscaled smollm2 1:2 until the added replica makes its first token; its cold start's parts."""
    print("live: smollm2 cold start ...", file=sys.stderr)
    rule = StepConfig(target_ongoing=2).autoscaler(1, 2)
    with labserver.serve("gen-continuous", "smollm2", autoscale=rule, max_batch_size=2, max_new_tokens=64,
                         compile=args.compile, graceful_shutdown_s=120) as h:
        def ask(i: int) -> None:
            httpx.post(h.url + "/generate", json={"prompt": f"Tell me about the number {i}.", "max_new_tokens": 48,
                                                  "ignore_eos": True}, timeout=600)

        end = time.monotonic() + 300
        while time.monotonic() < end:  # bursts of 8 until the autoscaler's new replica has answered
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            colds = list(h.stats()["scaling"]["cold_starts"].values())
            if len(colds) > 1 and all(c["first_token_s"] is not None for c in colds):
                return max(colds, key=lambda c: c["decided_s"])  # (the later decision: the autoscaler's)
    return None


def live(cfg: StepConfig, args: argparse.Namespace) -> dict[str, Any]:
    m: dict[str, Any] = {}
    with ray_session(num_cpus=4):
        for replicas in (1, 2, (1, 2)):
            print(f"live: {replicas} ...", file=sys.stderr)
            run = run_step(cfg, replicas)
            m[run.name] = run
        auto = m["autoscaled 1:2"]
        added = [c for r, c in auto.cold_starts.items() if c["first_token_s"] is not None]
        m["cold"] = {"synthetic-gen": max(added, key=lambda c: c["decided_s"]) if len(added) > 1 else None}
        m["cold"]["smollm2" + (" compiled" if args.compile else "")] = smollm2_cold_start(args) if args.smollm2 else None
    ups = [d for d in auto.decisions if d["new"] > d["old"]]
    cold = m["cold"]["synthetic-gen"]["first_token_s"] if m["cold"]["synthetic-gen"] else 5.0
    sim = simulate_step(cfg, auto, 1, 2, cold)
    step = cfg.windows()["step, first 15 s"]
    m["sim"] = {"replica_seconds": sim.replica_seconds, "reached": sim.reached, "cold_start_s": cold,
                "wait_p99_s": sim.wait_quantile(0.99, *step), "lost": sim.lost,
                "decisions": [(round(d.t_s, 1), d.old, d.new) for d in sim.decisions], "live_ups": len(ups)}
    m["summaries"] = {name: m[name].summary(cfg.windows()) for name in ("fixed 1", "fixed 2", "autoscaled 1:2")}
    m["timelines"] = {name: timeline_text(m[name]) for name in ("fixed 1", "fixed 2", "autoscaled 1:2")}
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="a step of 10 + 20 + 15 s (smoke runs)")
    ap.add_argument("--no-smollm2", dest="smollm2", action="store_false", help="skip smollm2's cold start")
    ap.add_argument("--compile", action="store_true", help="smollm2's replicas compiled (their cold start too)")
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the goals")
    ap.add_argument("--out", default="results/autoscale/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    cfg = StepConfig()
    if args.short:
        cfg = dataclasses.replace(cfg, before_s=10, step_s=20, after_s=15)
    started = time.perf_counter()
    sims, rows = simulated_rows()
    m = live(cfg, args)
    rows += live_rows(cfg, m) + cold_rows(m) + sim_rows(m)
    seconds = time.perf_counter() - started
    runs = {k: v for k, v in m.items() if k in ("summaries", "timelines", "cold", "sim")}
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "config": dataclasses.asdict(cfg),
               "simulated": sims, "live": runs, "rows": rows, "seconds": seconds}
    write_results(args.out, numbers, rows, f"({seconds:.0f} s; rows 1 and 4 simulated, 2 and 3 live on Ray Serve, "
                                           f"step {cfg.rate:g}/s for {cfg.before_s:g} s, {cfg.factor:g}x for "
                                           f"{cfg.step_s:g} s, then {cfg.after_s:g} s)", width=80, result_last=True)
    if args.smoke:
        check = Checks()
        check.rows([r for r in rows if not r["target"].startswith("3 ")],
                   ["1 simulated", "2 live fixed 1", "2 live fixed 2", "2 live autoscaled 1:2",
                    "autoscaled 1:2: requests lost", "autoscaled 1:2: replicas reached", "4 simulated"])
        for name, s in m["summaries"].items():
            check(s["requests"] > 0, f"{name}: no request")
        return check.verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
