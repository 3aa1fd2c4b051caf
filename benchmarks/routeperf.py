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

``--smoke`` judges what was measured (every row, finite values, every request counted),
not the goals.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from genperf import Checks, per, row  # (benchmarks/ is the script's folder: on the path)

from labserver.analysis.theory import supermarket_mean_time
from labserver.experiments.runs import machine_info
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
                    f"{stale['mean']:.2f} vs {m['stale']['pow2@4']['mean']:.2f} (random {m['stale']['random@4']['mean']:.2f}); "
                    f"fresh: {fresh['mean']:.2f} vs {m['stale']['pow2@0']['mean']:.2f}; 16 replicas at 0.8, probed every 4"))
    rr, p2 = m["slow"]["round-robin"], m["slow"]["pow2"]
    rows.append(row("3 simulated one replica at half speed: pow2 / round-robin p99", per(p2["p99"], rr["p99"]),
                    "(info)", None, f"{p2['p99']:.1f} vs {rr['p99']:.1f} service times; 8 replicas at 0.7 of the total"))
    blind, aware, hashed = m["cache"]["pow2"], m["cache"]["prefix-aware"], m["cache"]["prefix-hash"]
    rows.append(row("4 simulated cache affinity: prefix-aware / pow2 hit rate", per(aware["hit_rate"], blind["hit_rate"]),
                    "(info)", None, f"{aware['hit_rate']:.3f} vs {blind['hit_rate']:.3f} (prefix-hash "
                    f"{hashed['hit_rate']:.3f}); 32 prefixes, 8 replicas caching 4 each"))
    rows.append(row("4 simulated cache affinity: prefix-aware / pow2 mean time", per(aware["mean"], blind["mean"]),
                    "(info)", None, f"{aware['mean']:.2f} vs {blind['mean']:.2f} (prefix-hash {hashed['mean']:.2f})"))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000, help="per run of row 1 (a quarter in 2-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="exit on checks of what was measured, not on the goals")
    ap.add_argument("--out", default="results/routeperf/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    started = time.perf_counter()
    m = measure(args)
    rows = rows_of(m)
    seconds = time.perf_counter() - started
    numbers = {"machine": machine_info("cpu"), "args": vars(args), "runs": m, "rows": rows, "seconds": seconds}
    lines = [f"$ python {' '.join(sys.argv)}", "", f"{'target':<60}{'value':>8}  {'goal':<9}{'result':<7}detail"]
    lines += [f"{r['target']:<60}{r['value']:>8.3f}  {r['goal']:<9}{r['result']:<7}{r['detail']}" for r in rows]
    lines.append(f"({seconds:.0f} s; simulated: no server, no model; times in mean service times)")
    print("\n".join(lines[2:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(numbers, indent=1, default=str))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    if args.smoke:
        return smoke_checks(m, rows).verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
