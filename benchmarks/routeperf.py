"""Routing across replicas, simulated: each policy on N FIFO replicas on one virtual clock, against queueing theory.

    python benchmarks/routeperf.py --out results/routeperf/cpu.json            # ~1 min on one core
    python benchmarks/routeperf.py --requests 20000 --smoke --out /tmp/routeperf.json   # smoke: seconds

Everything here is **simulated** (``labserver.routing.simulate_cluster``): Poisson arrivals,
replicas serving one request at a time, times in mean service times. The policies are the
objects a live router runs. Rows:

1. 64 replicas, exponential service, load 0.9 per replica: mean time in the system of
   ``random`` and ``pow2`` against the supermarket model's limits (10 and 2.61 service
   times); goal: within 10 %. ``least-loaded`` and ``round-robin`` beside them.
2. Stale loads: 16 replicas at 0.8, queue lengths refreshed every 4 service times (a
   router's cache between probes): ``least-loaded`` herds onto one replica; ``pow2`` does not.
3. One replica of 8 at half speed, load 0.7 of the total: p99 of ``pow2`` against
   ``round-robin`` (which sends the slow one 1/8 of the traffic, more than it can serve).
4. Cache affinity: 8 replicas at 0.7, 32 shared prefixes, each replica caching its last 4,
   a hit saving 80 % of a request's service: ``prefix-aware`` against ``pow2`` (hit rate,
   mean time) and ``prefix-hash``.

Then **live**, on Ray Serve (``labserver.serve(..., replicas=N, router=...)``, one local Ray
for the whole run), replicas of ``synthetic-gen`` whose costs are sleeps (so 2 cores do not
hide what routing does), open-loop Poisson load from the load generator:

5. Cache affinity: 4 replicas of ``gen-paged --prefix-cache``, a prefill costing
   ``--per-token`` ms a prompt token, multi-turn sessions (``Sessions``: each turn resends the
   conversation): ``prefix-aware`` / ``pow2`` p50 TTFT (goal <= 0.5), prefix-cache hit rate
   (>= 2x) and output tokens/s (>= 1.0).
6. One of 4 replicas at half speed (its decode step twice as long): ``pow2`` /
   ``round-robin`` p99 TTFT (goal <= 0.5).
7. The Ray hop: one replica through Ray against the same server direct (tokens/s, p50
   TTFT), printed as it is; and ``gpt2-random`` on 2 replicas against one direct server on
   this machine's cores (CPU-bound: two replicas share the same two cores).

``--smoke`` judges what was measured (every row, finite values, every request counted,
answers named by replicas), not the goals; ``--no-live`` runs the simulation only.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from genperf import Checks, per, row, write_results  # (benchmarks/ is the script's folder: on the path)

import labserver
from labserver import analysis
from labserver.analysis.theory import supermarket_mean_time
from labserver.experiments.runs import machine_info
from labserver.load.payloads import Sessions, WordTexts
from labserver.loadgen import run_load_sync
from labserver.routing import simulate_cluster


def sim(name: str, n: int, **how: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = simulate_cluster(name, requests=n, **how)
    return {**result.summary(), "requests": n, "counted": sum(result.counts), "seconds": time.perf_counter() - t0}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    n, seed = args.requests, args.seed
    return {
        "theory": {p: sim(p, n, replicas=64, load=0.9, seed=seed)
                   for p in ("random", "pow2", "least-loaded", "round-robin")},
        "stale": {f"{p}@{s:g}": sim(p, n // 4, replicas=16, load=0.8, stale=s, seed=seed)
                  for p in ("least-loaded", "pow2", "random") for s in (0.0, 4.0)},
        "slow": {p: sim(p, n // 4, replicas=8, load=0.7, speeds=[0.5] + [1.0] * 7, seed=seed)
                 for p in ("round-robin", "pow2", "least-loaded")},
        "cache": {p: sim(p, max(n // 20, 2000), replicas=8, load=0.7, groups=32, cache_slots=4, seed=seed)
                  for p in ("pow2", "prefix-aware", "prefix-hash")},
    }


def rows_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for policy, choices in (("random", 1), ("pow2", 2)):
        got, theory = m["theory"][policy]["mean"], supermarket_mean_time(0.9, choices)
        rows.append(row(f"1 simulated {policy}: mean time / supermarket limit", per(got, theory), "1 +- 0.1",
                        abs(got / theory - 1) <= 0.1, f"{got:.2f} vs {theory:.2f} service times; 64 replicas at 0.9"))
    for policy in ("least-loaded", "round-robin"):
        rows.append(row(f"1 simulated {policy}: mean time", m["theory"][policy]["mean"], "(info)", None,
                        f"p99 {m['theory'][policy]['p99']:.2f}; 64 replicas at 0.9"))
    fresh, stale = m["stale"]["least-loaded@0"], m["stale"]["least-loaded@4"]
    rows.append(row("2 simulated stale loads: least-loaded / pow2 mean time", per(stale["mean"],
                    m["stale"]["pow2@4"]["mean"]), "(info)", None,
                    f"{stale['mean']:.2f} vs {m['stale']['pow2@4']['mean']:.2f} "
                    f"(random {m['stale']['random@4']['mean']:.2f}); fresh: {fresh['mean']:.2f} vs "
                    f"{m['stale']['pow2@0']['mean']:.2f}; 16 replicas at 0.8, probed every 4"))
    rr, p2 = m["slow"]["round-robin"], m["slow"]["pow2"]
    rows.append(row("3 simulated one replica at half speed: pow2 / round-robin p99", per(p2["p99"], rr["p99"]),
                    "(info)", None,
                    f"{p2['p99']:.1f} vs {rr['p99']:.1f} service times; 8 replicas at 0.7 of the total"))
    blind, aware, hashed = m["cache"]["pow2"], m["cache"]["prefix-aware"], m["cache"]["prefix-hash"]
    rows.append(row("4 simulated cache affinity: prefix-aware / pow2 hit rate",
                    per(aware["hit_rate"], blind["hit_rate"]),
                    "(info)", None, f"{aware['hit_rate']:.3f} vs {blind['hit_rate']:.3f} (prefix-hash "
                    f"{hashed['hit_rate']:.3f}); 32 prefixes, 8 replicas caching 4 each"))
    rows.append(row("4 simulated cache affinity: prefix-aware / pow2 mean time", per(aware["mean"], blind["mean"]),
                    "(info)", None, f"{aware['mean']:.2f} vs {blind['mean']:.2f} (prefix-hash {hashed['mean']:.2f})"))
    return rows


# -- live, on Ray Serve ------------------------------------------------------------------------------

def load(url: str, args: argparse.Namespace, payload: Any, rate: float, tokens: int, seconds: float) -> Any:
    return run_load_sync(url, mode="generate", payload=payload, new_tokens=tokens, stream=True, ignore_eos=True,
                         rate_per_s=rate, duration_s=seconds, seed=args.seed, timeout_s=120, progress=False)


def reading(result: Any, handle: Any = None) -> dict[str, Any]:
    """A run's TTFT, tokens/s, errors and requests per replica; with a handle, the replicas' prefix-cache hits."""
    s = analysis.summarize(result.records, tokens=result.tokens)
    records = result.records
    out = {"requests": int(s["count"]), "errors": int(s["count"] - s["n_ok"]),
           "ttft_p50_ms": float(s.get("ttft_p50_ms", math.nan)), "ttft_p99_ms": float(s.get("ttft_p99_ms", math.nan)),
           "tps": float(s.get("token_throughput_tps", math.nan)),
           "per_replica": {str(k): int(v) for k, v in records["replica"].dropna().value_counts().items()}}
    if handle is not None:
        replicas = handle.stats().get("replicas", {})
        prompt = sum(r.get("prompt_tokens", 0) for r in replicas.values())
        out["hit_rate"] = sum(r.get("cached_tokens", 0) for r in replicas.values()) / prompt if prompt else 0.0
        out["replicas_seen"] = len(replicas)
    return out


def routed(router: str, args: argparse.Namespace, strategy: str, model: str, payload: Any, rate: float, tokens: int,
           seconds: float, **options: Any) -> dict[str, Any]:
    print(f"live: {router} ...", file=sys.stderr)
    with labserver.serve(strategy, model, replicas=4, router=router, **options) as h:
        return reading(load(h.url, args, payload, rate, tokens, seconds), h)


def live(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from labserver.replicas import free_port

    # one Ray and one Serve for every run (each run deploys and removes only its app)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)  # logical CPUs
    serve.start(http_options={"host": "127.0.0.1", "port": free_port("127.0.0.1")})
    try:
        s, m = args.seconds, {}
        sessions = Sessions(sessions=args.sessions, turns=6, first_words=200, turn_words=20, answer_words=40)
        cached = f"synthetic-gen:5+10?per_token={args.per_token}"
        m["cache"] = {r: routed(r, args, "gen-paged", cached, sessions, args.rate, 8, s, prefix_cache=True,
                                max_batch_size=8, max_kv_tokens=32768, max_new_tokens=64)
                      for r in ("pow2", "prefix-aware")}
        texts = WordTexts(dist="uniform", min_words=8, max_words=24)
        slow = ["synthetic-gen:20+100"] + ["synthetic-gen:20+50"] * 3
        m["slow"] = {r: routed(r, args, "gen-continuous", "synthetic-gen:20+50", texts, args.slow_rate, 16, s,
                               replica_models=slow, max_batch_size=2, max_new_tokens=64)
                     for r in ("round-robin", "pow2")}
        m["hop"] = hop(args, texts)
        return m
    finally:
        serve.shutdown()
        ray.shutdown()


def hop(args: argparse.Namespace, texts: Any) -> dict[str, Any]:
    """One replica through Ray against the same server direct; then gpt2 on 2 replicas against 1 direct."""
    out: dict[str, Any] = {}
    how = {"max_batch_size": 8, "max_new_tokens": 64}
    for name, replicas in (("direct", None), ("ray x1", 1)):
        print(f"live: hop, {name} ...", file=sys.stderr)
        with labserver.serve("gen-continuous", "synthetic-gen:20+10", replicas=replicas, **how) as h:
            out[name] = reading(load(h.url, args, texts, args.hop_rate, 16, args.seconds))
    gpt2 = "gpt2-tiny-random" if args.smoke else "gpt2-random"
    for name, replicas in (("gpt2 direct", None), ("gpt2 ray x2", 2)):
        print(f"live: {name} ...", file=sys.stderr)
        with labserver.serve("gen-continuous", gpt2, replicas=replicas, **how) as h:
            r = run_load_sync(h.url, mode="generate", payload=texts, new_tokens=32, stream=True, ignore_eos=True,
                              users=16, duration_s=args.seconds, seed=args.seed, timeout_s=300, progress=False)
            out[name] = reading(r)
    return out


def live_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    blind, aware = m["cache"]["pow2"], m["cache"]["prefix-aware"]
    rows = [row("5 live cache affinity: prefix-aware / pow2 p50 TTFT", per(aware["ttft_p50_ms"], blind["ttft_p50_ms"]),
                "<= 0.5", per(aware["ttft_p50_ms"], blind["ttft_p50_ms"]) <= 0.5,
                f"{aware['ttft_p50_ms']:.0f} vs {blind['ttft_p50_ms']:.0f} ms; {aware['requests']} and "
                f"{blind['requests']} requests, six-turn sessions over 4 replicas"),
            row("5 live cache affinity: prefix-aware / pow2 hit rate", per(aware["hit_rate"], blind["hit_rate"]),
                ">= 2", per(aware["hit_rate"], blind["hit_rate"]) >= 2,
                f"{aware['hit_rate']:.3f} vs {blind['hit_rate']:.3f} of prompt tokens from the replicas' caches"),
            row("5 live cache affinity: prefix-aware / pow2 tokens/s", per(aware["tps"], blind["tps"]), ">= 1.0",
                per(aware["tps"], blind["tps"]) >= 1.0, f"{aware['tps']:.1f} vs {blind['tps']:.1f} tokens/s")]
    rr, p2 = m["slow"]["round-robin"], m["slow"]["pow2"]
    rows.append(row("6 live one replica at half speed: pow2 / round-robin p99 TTFT",
                    per(p2["ttft_p99_ms"], rr["ttft_p99_ms"]), "<= 0.5",
                    per(p2["ttft_p99_ms"], rr["ttft_p99_ms"]) <= 0.5,
                    f"{p2['ttft_p99_ms']:.0f} vs {rr['ttft_p99_ms']:.0f} ms; {p2['requests']} and {rr['requests']} "
                    f"requests; per replica {p2['per_replica']} vs {rr['per_replica']}"))
    h = m["hop"]
    rows.append(row("7 live the Ray hop: one replica via Ray / direct, tokens/s", per(h["ray x1"]["tps"],
                    h["direct"]["tps"]), "(info)", None,
                    f"p50 TTFT {h['ray x1']['ttft_p50_ms']:.0f} vs {h['direct']['ttft_p50_ms']:.0f} ms"))
    rows.append(row("7 live gpt2 on 2 replicas / 1 direct, tokens/s (same 2 cores)",
                    per(h["gpt2 ray x2"]["tps"], h["gpt2 direct"]["tps"]), "(info)", None,
                    f"{h['gpt2 ray x2']['tps']:.1f} vs {h['gpt2 direct']['tps']:.1f} tokens/s, 16 users: CPU-bound"))
    return rows


def smoke_checks(m: dict[str, Any], rows: list[dict[str, Any]]) -> Checks:
    check = Checks()
    check.rows(rows, ["1 simulated random", "1 simulated pow2", "2 simulated stale", "3 simulated one replica",
                      "4 simulated cache affinity: prefix-aware / pow2 hit rate"])
    for group in m.values():
        for name, r in group.items():
            check(r["counted"] == r["requests"], f"{name}: {r['counted']} requests routed of {r['requests']}")
            check(math.isfinite(r["mean"]) and r["mean"] > 0, f"{name}: mean time {r['mean']}")
    for name, r in m["cache"].items():
        check(0 <= r["hit_rate"] <= 1, f"{name}: hit rate {r['hit_rate']}")
    return check


def live_checks(check: Checks, m: dict[str, Any]) -> None:
    for part in ("cache", "slow"):
        for router, r in m[part].items():
            check(r["requests"] > 0 and r["errors"] == 0,
                  f"{part} {router}: {r['requests']} requests, {r['errors']} errors")
            check(len(r["per_replica"]) >= 2, f"{part} {router}: answers named by {r['per_replica']}")
            check(r.get("replicas_seen") == 4, f"{part} {router}: /stats listed {r.get('replicas_seen')} replicas")
    check(m["cache"]["prefix-aware"]["hit_rate"] > 0, "prefix-aware: no prompt token came from a cache")
    for name, r in m["hop"].items():
        check(r["requests"] > 0 and r["errors"] == 0 and r["tps"] > 0, f"hop {name}: {r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000, help="per run of row 1 (a quarter in 2-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-live", dest="live", action="store_false", help="the simulation only (no Ray)")
    ap.add_argument("--seconds", type=float, default=60.0, help="live: seconds of load per run")
    ap.add_argument("--rate", type=float, default=4.0, help="live 5: requests/s (sessions' turns)")
    ap.add_argument("--sessions", type=int, default=16, help="live 5: conversations side by side (6 turns each)")
    ap.add_argument("--per-token", type=float, default=1.0, help="live 5: prefill ms per prompt token")
    ap.add_argument("--slow-rate", type=float, default=6.0, help="live 6: requests/s")
    ap.add_argument("--hop-rate", type=float, default=8.0, help="live 7: requests/s")
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the goals")
    ap.add_argument("--out", default="results/routeperf/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    started = time.perf_counter()
    m = measure(args)
    rows = rows_of(m)
    if args.live:
        m["live"] = live(args)
        rows += live_rows(m["live"])
    seconds = time.perf_counter() - started
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "runs": m, "rows": rows, "seconds": seconds}
    write_results(args.out, numbers, rows,
                  f"({seconds:.0f} s; rows 1-4 simulated (times in mean service times), 5-7 live on Ray Serve)")
    if args.smoke:
        check = smoke_checks({k: v for k, v in m.items() if k != "live"}, rows)
        if args.live:
            live_checks(check, m["live"])
        return check.verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
