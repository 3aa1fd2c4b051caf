"""Every performance ratio of the project's targets, measured side by side in one run.

    python benchmarks/perf.py                 # labserver's own ratios (~4 min on 2 cores)
    python benchmarks/perf.py --peers         # + LitServe and Ray Serve baselines (~3 min more)
    python benchmarks/perf.py --device cuda --model bert-base-random   # the GPU target

Absolute numbers move with the machine's load; the ratios are what this prints, each
against its target, PASS or FAIL, and writes as JSON (``--out``). All load is closed
loop from labserver's own generator (in its own process) unless said otherwise; the
payload is one 16-token sentence per request, as in the issue's measurements.

Peers (LitServe, Ray Serve) run from a separate virtual environment
(benchmarks/.peers, see benchmarks/README.md): they are baselines, never dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import labserver
from labserver import analysis
from labserver.loadgen import run_load_sync

HERE = Path(__file__).resolve().parent
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today."  # 16 tokens
PAYLOAD = SENTENCE  # replaced for bert-base-random in main()
PEERS_PY = HERE / ".peers" / "bin" / "python"


def closed(url: str, users: int, duration_s: float, mode: str = "text") -> dict[str, float]:
    result = run_load_sync(url, users=users, duration_s=duration_s + 2, warmup_s=2, payload=PAYLOAD,
                           mode=mode, progress=False, timeout_s=120)
    s = analysis.summarize(result.records)
    return {"throughput_rps": float(s["throughput_rps"]), "p50_ms": float(s["p50_ms"]),
            "p99_ms": float(s["p99_ms"]), "errors": int(s["count"] - s["n_ok"])}


def text_for(model_spec: str) -> str:
    return SENTENCE.replace("lazy", "[MASK]") if model_spec == "bert-base-random" else SENTENCE  # fill-mask needs one


def offline(model_spec: str, device: str, batch: int, seconds: float) -> float:
    """Items/s of the model called directly, no server: the pipeline's own limit."""
    model = labserver.load_model(model_spec, device=device)
    texts = [text_for(model_spec)] * batch
    for _ in range(3):
        model(texts)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model(texts)
        n += batch
    return n / (time.perf_counter() - t0)


def with_server(strategy: str, model: str, device: str, fn: Any, **knobs: Any) -> Any:
    with labserver.serve(strategy, model, device=device, **knobs) as h:
        closed(h.url, 8, 1.0)  # warm up the model and the connections
        return fn(h.url)


def wrk_rps(url: str, connections: int, seconds: float) -> float | None:
    if shutil.which("wrk") is None:
        return None
    script = HERE / "post.lua"
    script.write_text(f'wrk.method = "POST"\nwrk.body = "{PAYLOAD}"\n'
                      'wrk.headers["Content-Type"] = "text/plain"\n')
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", "-s", str(script), url + "/"],
                         capture_output=True, text=True, check=True).stdout
    script.unlink()
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def peer(kind: str, port: int, users: int, duration_s: float) -> dict[str, Any] | None:
    if not PEERS_PY.exists():
        return None
    script = HERE / "peers" / f"{kind}_server.py"
    # its log goes to a file: a pipe nobody reads fills up and freezes a server that logs every request
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"labserver-peer-{kind}.log", "w")
    proc = subprocess.Popen([str(PEERS_PY), "-u", str(script), str(port)], stdout=log,
                            stderr=subprocess.STDOUT, text=True, cwd=HERE / "peers")
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                if httpx.post(url + "/predict", json={"inputs": "warm"}, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise RuntimeError(f"{kind} did not come up")
        closed(url + "/predict", users, 2.0, mode="json")  # warm at full concurrency: peers start lazily
        out: dict[str, Any] = closed(url + "/predict", users, duration_s, mode="json")
        out["memory_mb"] = _tree_rss_mb(proc.pid)
        return out
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        if kind == "ray":
            subprocess.run([str(PEERS_PY.parent / "ray"), "stop", "--force"], capture_output=True)


def _tree_rss_mb(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    if any("ray" in " ".join(p.cmdline()) for p in procs):
        procs = [p for p in psutil.process_iter() if "ray" in " ".join(p.cmdline())]
    return round(sum(p.memory_info().rss for p in procs) / 2**20)


def row(name: str, value: float | None, target: str, passed: bool | None, detail: str) -> dict[str, Any]:
    return {"target": name, "value": value, "goal": target, "result": "SKIP" if passed is None else
            ("PASS" if passed else "FAIL"), "detail": detail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per load run")
    ap.add_argument("--peers", action="store_true", help="also run LitServe and Ray Serve baselines")
    ap.add_argument("--out", default=None, help="write every number as JSON here")
    args = ap.parse_args()
    d, dev, model = args.duration, args.device, args.model
    global PAYLOAD
    PAYLOAD = text_for(model)
    best = dict(strategy="adaptive", max_batch_size=64)
    guide = dict(strategy="per-fetch", max_batch_size=None, max_wait_ms=1.0)
    numbers: dict[str, Any] = {"machine": __import__("labserver.experiment").experiment.machine_info(dev)}
    rows = []

    print("offline pipeline ...", file=sys.stderr)
    numbers["offline_bs64"] = offline(model, dev, 64, d)
    numbers["offline_bs1"] = offline(model, dev, 1, d / 2)

    def measure(cfg: dict[str, Any], users: list[int]) -> dict[int, dict[str, float]]:
        knobs = {k: v for k, v in cfg.items() if k != "strategy"}
        print(f"{cfg['strategy']} {knobs} users={users} ...", file=sys.stderr)
        return with_server(cfg["strategy"], model, dev, lambda url: {u: closed(url, u, d) for u in users}, **knobs)

    numbers["best"] = measure(best, [1, 64, 128])
    numbers["guide"] = measure(guide, [1, 64])
    numbers["naive"] = measure(dict(strategy="naive"), [1])

    # offline again: the machine's speed drifts over minutes, so the baseline brackets the served runs
    numbers["offline_bs64_after"] = offline(model, dev, 64, d)
    offline64 = (numbers["offline_bs64"] + numbers["offline_bs64_after"]) / 2
    b, g = numbers["best"], numbers["guide"]
    # saturated: 64 and 128 clients both keep a 64-cap model busy; the better of the two is its plateau
    sat_users = max((64, 128), key=lambda u: b[u]["throughput_rps"])
    eff = b[sat_users]["throughput_rps"] / offline64
    rows.append(row("1 efficiency: best saturated / offline bs64", eff, ">= 0.95", eff >= 0.95,
                    f"{b[sat_users]['throughput_rps']:.0f}/s at {sat_users} clients vs {offline64:.0f} items/s "
                    f"(offline before/after {numbers['offline_bs64']:.0f}/{numbers['offline_bs64_after']:.0f})"))
    idle = b[1]["p50_ms"] - numbers["naive"][1]["p50_ms"]
    rows.append(row("2 idle: best p50 - naive p50 at 1 client (ms)", idle, "<= 1 ms", idle <= 1.0,
                    f"{b[1]['p50_ms']:.2f} vs {numbers['naive'][1]['p50_ms']:.2f} ms; "
                    f"guide per-fetch {g[1]['p50_ms']:.2f} ms"))
    r50 = b[64]["p50_ms"] / g[64]["p50_ms"]
    r99 = b[64]["p99_ms"] / g[64]["p99_ms"]
    rows.append(row("3 load: best/guide p50 at 64 clients", r50, "<= 0.8", r50 <= 0.8,
                    f"{b[64]['p50_ms']:.0f} vs {g[64]['p50_ms']:.0f} ms"))
    rows.append(row("3 load: best/guide p99 at 64 clients", r99, "<= 0.8", r99 <= 0.8,
                    f"{b[64]['p99_ms']:.0f} vs {g[64]['p99_ms']:.0f} ms; throughput "
                    f"{b[64]['throughput_rps']:.0f} vs {g[64]['throughput_rps']:.0f}/s"))

    if args.peers:
        numbers["best_json"] = with_server(  # same JSON body as the peers get
            best["strategy"], model, dev, lambda url: closed(url + "/predict", 64, d, mode="json"), max_batch_size=64)
        for kind, port in (("litserve", 18931), ("ray", 18932)):
            print(f"peer {kind} ...", file=sys.stderr)
            numbers[kind] = peer(kind, port, 64, d)
            p, mine = numbers[kind], numbers["best_json"]
            if p is None:
                rows.append(row(f"4 peers: best / {kind} throughput", None, ">= 1.2", None, "not installed"))
                continue
            ratio = mine["throughput_rps"] / p["throughput_rps"]
            rows.append(row(f"4 peers: best / {kind} throughput", ratio, ">= 1.2, p99 no worse",
                            ratio >= 1.2 and mine["p99_ms"] <= p["p99_ms"],
                            f"{mine['throughput_rps']:.0f} vs {p['throughput_rps']:.0f}/s; p99 "
                            f"{mine['p99_ms']:.0f} vs {p['p99_ms']:.0f} ms; {kind} memory {p['memory_mb']} MB"))

    # 5: the generator is not the bottleneck
    capacity = b[sat_users]["throughput_rps"]
    target_rate = 2 * capacity
    print(f"generator ceiling at {target_rate:.0f}/s against echo ...", file=sys.stderr)
    with labserver.serve("thread", "echo", max_batch_size=64) as h:
        res = run_load_sync(h.url, arrival="poisson", rate_per_s=target_rate, duration_s=d, warmup_s=1,
                            payload=SENTENCE, progress=False)
    late = float(res.meta.get("late_fraction", float("nan")))
    achieved = float(res.meta.get("achieved_send_rate_per_s", float("nan")))
    numbers["generator"] = {"rate": target_rate, "achieved": achieved, "late_fraction": late}
    rows.append(row("5 generator: late sends at 2x best capacity", late, "< 1 %", late < 0.01,
                    f"{achieved:.0f}/s sent of {target_rate:.0f}/s scheduled"))
    wrk, ours = with_server(best["strategy"], model, dev, lambda url: (wrk_rps(url, 64, d), closed(url, 64, d)),
                            max_batch_size=64)
    if wrk is None:
        rows.append(row("5 generator: labserver / wrk throughput", None, "within 10 %", None, "wrk not installed"))
    else:
        agree = ours["throughput_rps"] / wrk
        rows.append(row("5 generator: labserver / wrk throughput", agree, "0.9 .. 1.1", 0.9 <= agree <= 1.1,
                        f"{ours['throughput_rps']:.0f} vs wrk {wrk:.0f}/s at 64 connections"))

    numbers["rows"] = rows
    width = max(len(r["target"]) for r in rows)
    print(f"\n{'target':<{width}}  {'value':>8}  {'goal':<22} result  detail")
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.3f}"
        print(f"{r['target']:<{width}}  {value:>8}  {r['goal']:<22} {r['result']:<6}  {r['detail']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(numbers, indent=1, default=str))
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
