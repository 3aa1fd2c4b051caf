"""labserver's numbers cross-checked by code no one here wrote, and labserver beside a real peer.

    python benchmarks/crosscheck.py --out results/crosscheck/cpu.json          # ~30 minutes on 2 cores
    python benchmarks/crosscheck.py --model gpt2-tiny-random --requests 60 --skip-requests 10 --rate 4 \\
        --pairs 1 --door-seconds 4 --door-users 8 --out /tmp/cc.json              # small: ~3 minutes
    python benchmarks/crosscheck.py --model gpt2-tiny-random --pairs 1 --door-seconds 2 --door-users 4 \\
        --skip guidellm,peer --smoke --out /tmp/cc.json                          # smoke: the /v1 door only

Three parts, each printed as rows with a goal and PASS/FAIL (INFO where there is none):

1. **labserver's generator against guidellm** on one labserver ``gen-continuous`` server
   (``--model``, default gpt2-random) and one workload: Poisson arrivals at ``--rate``,
   prompts of ``--prompt-tokens`` tokens, ``--output-tokens`` tokens out with ``ignore_eos``,
   streamed from ``/v1/completions``, ``--requests`` requests. guidellm (its own venv under
   ``benchmarks/.peers/guidellm``, installed here on first use with torch pinned beside it)
   is given the Poisson send times as a trace (its ``replay`` profile, ``trace_synthetic``
   data) and labserver's generator replays the same times, so both measure the very same
   load. (guidellm 0.8.1's own ``poisson`` profile is not used: each of its worker
   processes draws from a generator with the same seed, so its gaps repeat in runs of ten,
   and a worker that starts before the shared offset is set sends at once.) ``--pairs``
   pairs, the order alternating (guidellm first, then labserver first, ...); the first
   ``--skip-requests`` of each run are left out on both sides (guidellm's first requests
   wait for its start-up); each ratio (labserver / guidellm) is the median over the
   pairs; goal: within 5 %.
   Like with like: guidellm times TTFT from its actual send (its dispatch delay, reported
   beside, is not in it), so labserver's TTFT here is also taken from the actual send
   (``first_token_s - sent_s``; from the schedule too, as INFO); guidellm's "ITL" is per
   request (last token - first token) / (tokens - 1), averaged over requests, computed
   the same way from labserver's token times; its "TPOT" counts the first token
   ((last token - send) / tokens), so it is compared to that formula (INFO), not to
   labserver's TPOT; output tokens/s is total output tokens / (last answer - first send)
   from each tool's own per-request times. And a referee: the server's own mean ITL in
   each run, from its step log (a token is made when the step that computed it ends), so
   a difference between the tools shows whether a tool read late or the server ran slower
   while that tool loaded it (on two shared cores, a client's own CPU use slows the server).
2. **A real peer**: ``transformers serve`` (transformers' own OpenAI-compatible server,
   ``--continuous-batching``, its own venv ``benchmarks/.peers/hfserve``) on the same
   GPT-2-shaped random weights saved to ``benchmarks/.peers/gpt2-random``, beside
   labserver ``gen-continuous``, both loaded by labserver's generator with the same
   Poisson schedule through ``/v1/completions``: tokens/s and p99 TTFT as ratios (INFO).
   If it cannot run here, its row keeps the error.
3. **The /v1 door's cost**: tokens/s through ``/v1/completions`` vs ``/generate`` on one
   ``gen-continuous`` server at saturation (``--door-users`` closed-loop users), alternating,
   ``--pairs`` pairs; goal >= 0.95.

Wrap it in the machine's CPU lock when others share it: ``flock -x /tmp/labserver-cpu.lock ...``.

``--smoke`` judges a run by what it measured, not by the goals: every row of each part run
there with a finite value (a part that could not run fails it); both tools counting the
same requests, all answered; at the door, every request answered with the tokens it asked,
and the tokens the client counted equal to those the server's ``/stats`` says it made. It
exits 0 when those hold, else 1 with each failed check on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from labserver.analysis import ok
from labserver.experiments.peers import (
    PeerUnavailable,
    free_port,
    peer_venv,
    running,
    save_for_peer,
    transformers_serve,
)
from labserver.experiments.runs import machine_info
from labserver.load.arrivals import Poisson
from labserver.load.prompts import TokenPrompts
from labserver.loadgen import LoadResult, run_load_sync

from genperf import Checks  # a smoke run's checks (benchmarks/ is the script's folder: on the path)

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / ".peers"
PARTS = {"guidellm": ["1 labserver / guidellm TTFT p50", "1 labserver / guidellm TTFT p99",
                      "1 labserver / guidellm mean ITL", "1 labserver / guidellm output tokens/s",
                      "1 labserver's mean ITL / the server's own", "1 guidellm's mean ITL / the server's own",
                      "1 the server's own mean ITL", "1 labserver / guidellm TPOT", "1 labserver TTFT p99"],
         "peer": ["2 labserver / transformers serve output tokens/s", "2 labserver / transformers serve TTFT p99"],
         "door": ["3 /v1/completions / /generate tokens/s"]}  # each part's rows (target prefixes)


def row(name: str, value: float, goal: str, passed: bool | None, detail: str) -> dict[str, Any]:
    result = "INFO" if passed is None else "PASS" if passed else "FAIL"
    return {"target": name, "value": value, "goal": goal, "result": result, "detail": detail}


def labserver_cmd(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "labserver.cli", "serve", "--strategy", "gen-continuous", "--model", args.model,
            "--device", "cpu", "--port", str(port), "--max-batch", str(args.max_batch), "--log-level", "warning"]


# -- the two tools' figures, like with like ---------------------------------------------------------------

def ours(result: LoadResult, keep: range | None = None) -> dict[str, float]:
    """labserver's generator's run in guidellm's definitions (and its own TTFT from the schedule);
    ``keep``: the request numbers (schedule order) to count."""
    rec = result.records if keep is None else result.records[result.records["i"].isin(keep)]
    ok = rec[(rec["status"] == 200) & (rec["error"] == "")]
    n = ok["n_tokens"].astype(float)
    ttft_send = (ok["first_token_s"] - ok["sent_s"]).to_numpy(dtype=float) * 1000
    tokens = result.tokens[result.tokens["i"].isin(ok["i"])]
    span = tokens.groupby("i")["t_s"].agg(["min", "max", "count"])
    itl = ((span["max"] - span["min"]) / (span["count"] - 1))[span["count"] > 1] * 1000
    last = tokens.groupby("i")["t_s"].max().reindex(ok["i"]).to_numpy(dtype=float)
    tpot_g = (last - ok["sent_s"].to_numpy(dtype=float)) * 1000 / n.to_numpy()
    return {"n": len(ok), "errors": int(len(rec) - len(ok)),
            "ttft_p50_ms": float(np.percentile(ttft_send, 50)), "ttft_p99_ms": float(np.percentile(ttft_send, 99)),
            "ttft_sched_p50_ms": float(ok["ttft_ms"].median()),
            "ttft_sched_p99_ms": float(np.percentile(ok["ttft_ms"].to_numpy(dtype=float), 99)),
            "itl_mean_ms": float(itl.mean()), "tpot_guidellm_ms": float(np.mean(tpot_g)),
            "output_tps": float(n.sum() / (ok["done_s"].max() - ok["sent_s"].min())),
            "output_tokens": int(n.sum()), "late_p99_ms": float(result.meta.get("late_ms_p99", math.nan))}


def tokens_made(url: str) -> int:
    """The tokens the server says it generated so far (labserver's /stats)."""
    return int(httpx.get(url + "/stats", timeout=30).json()["tokens_generated"])


def last_step(url: str) -> int:
    """The id of the server's latest step (labserver's /stats), to tell the steps of the next run apart."""
    steps = httpx.get(url + "/stats", params={"steps": 1}, timeout=30).json().get("recent_steps") or []
    return int(steps[-1]["step"]) if steps else 0


def server_itl_ms(url: str, after_step: int) -> float:
    """The server's own mean ITL over the sequences it started after ``after_step``, from its step log:
    a token is made at the end of the prefill or decode step that computed it (labserver's clock, no HTTP)."""
    steps = httpx.get(url + "/stats", params={"steps": 20_000}, timeout=60).json()["recent_steps"]
    times: dict[int, list[float]] = {}
    for s in steps:
        if s["step"] <= after_step:
            continue
        idle = set(s["idle"])
        for sid in s["seqs"]:
            if sid not in s["decoding"]:  # its prompt (or a recompute): its stream starts here
                times[sid] = [s["end_s"]]
            elif sid in times and sid not in idle:
                times[sid].append(s["end_s"])
    gaps = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return float(np.mean(gaps) * 1000) if gaps else math.nan


def guidellm_figures(doc: dict[str, Any], skip: int) -> dict[str, float]:
    """Figures from guidellm's JSON, computed from its per-request records in schedule order, the first
    ``skip`` left out (as for labserver's: its first requests pay its start-up)."""
    reqs = doc["benchmarks"][0]["requests"]
    every = sorted(reqs["successful"] + reqs.get("errored", []) + reqs.get("incomplete", []),
                   key=lambda r: r["info"]["timings"]["targeted_start"])
    counted = every[skip:]
    good = [r for r in counted if r["info"]["status"] == "completed" and not r["info"]["error"]]
    ttft = np.array([r["time_to_first_token_ms"] for r in good], dtype=float)
    out = np.array([r["output_tokens"] for r in good], dtype=float)
    start = np.array([r["request_start_time"] for r in good], dtype=float)
    end = np.array([r["request_end_time"] for r in good], dtype=float)
    return {"n": len(good), "errors": len(counted) - len(good), "requests_run": len(every),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_mean_ms": float(np.mean([r["inter_token_latency_ms"] for r in good])),
            "tpot_guidellm_ms": float(np.mean([r["time_per_output_token_ms"] for r in good])),
            "output_tps": float(out.sum() / (end.max() - start.min())), "output_tokens": int(out.sum()),
            "dispatch_delay_p99_ms": float(np.percentile([r["request_dispatch_delay"] for r in good], 99) * 1000),
            "startup_dispatch_delay_max_ms": float(max(r["request_dispatch_delay"] for r in every[:skip]) * 1000)
            if skip else math.nan}


def run_guidellm(exe: Path, url: str, model: str, folder: Path, trace: Path, work: Path) -> dict[str, Any]:
    """guidellm replaying ``trace`` (send times and lengths) against ``url``'s /v1/completions."""
    out = work / f"guidellm-{time.time_ns()}.json"
    data = json.dumps({"kind": "trace_synthetic", "source": {"kind": "json_file", "path": str(trace)}})
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
           "--profile", "kind=replay,schedule_turn=timestamp", "--data", data,
           "--tokenizer", f"kind=huggingface_auto,model={folder}", "--output", f"kind=json,path={out}",
           "--disable-console"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=work, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if run.returncode or not out.exists():
        raise PeerUnavailable(f"guidellm failed ({run.returncode}): {(run.stderr or run.stdout)[-1500:]}")
    return json.loads(out.read_text())


def run_ours(url: str, model: str | None, schedule_s: np.ndarray | None, args: argparse.Namespace,
             **how: Any) -> LoadResult:
    timing = (dict(arrival=schedule_s.tolist(), max_requests=len(schedule_s)) if schedule_s is not None
              else dict(arrival="poisson", rate_per_s=args.rate, max_requests=args.requests))
    options = dict(api="openai-completions", model=model, payload=TokenPrompts(args.prompt_tokens),
                   new_tokens=args.output_tokens, ignore_eos=True, timeout_s=1800.0, progress=False,
                   seed=args.seed, **timing)
    return run_load_sync(url, **{**options, **how})


def warm(url: str, model: str | None, **how: Any) -> None:
    run_load_sync(url, **{**dict(api="openai-completions", model=model, users=1, max_requests=3, new_tokens=8,
                                 payload=TokenPrompts(16), progress=False, process=False, timeout_s=600.0), **how})


# -- the three parts ----------------------------------------------------------------------------------------

def against_guidellm(args: argparse.Namespace, folder: Path, work: Path) -> tuple[list[dict[str, Any]], Any]:
    exe = peer_venv(PEERS, "guidellm", ["guidellm"], "guidellm")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    schedule = Poisson(args.rate).times(max_requests=args.requests, seed=args.seed)
    trace = work / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": float(t), "input_length": args.prompt_tokens,
                                         "output_length": args.output_tokens}) + "\n" for t in schedule))
    pairs: list[dict[str, Any]] = []
    with running(labserver_cmd(args, port), url + "/health", work / "labserver-guidellm.log"):
        warm(url, args.model)
        run_ours(url, args.model, schedule[:40], args)  # the server's caches grown at this load before pair 1
        for k in range(args.pairs):
            order = ("guidellm", "labserver") if k % 2 == 0 else ("labserver", "guidellm")
            pair: dict[str, Any] = {"order": list(order)}
            for tool in order:
                print(f"pair {k + 1}/{args.pairs}: {tool} ...", file=sys.stderr)
                before = last_step(url)
                if tool == "guidellm":
                    pair["guidellm"] = guidellm_figures(run_guidellm(exe, url, args.model, folder, trace, work),
                                                        args.skip_requests)
                else:
                    pair["result"] = run_ours(url, args.model, schedule, args)
                pair[f"server_itl_ms_{tool}"] = server_itl_ms(url, before)
            # the same requests on both sides: guidellm's replay may leave out the trace's last line
            keep = range(args.skip_requests, pair["guidellm"]["requests_run"])
            pair["labserver"] = ours(pair.pop("result"), keep)
            for tool in ("labserver", "guidellm"):
                pair[tool]["server_itl_mean_ms"] = pair.pop(f"server_itl_ms_{tool}")
            pairs.append(pair)

    def per_pair(key: str) -> list[float]:
        return [p["labserver"][key] / p["guidellm"][key] for p in pairs]

    def med(key: str) -> float:
        return statistics.median(per_pair(key))

    def val(tool: str, key: str) -> float:
        return statistics.median(p[tool][key] for p in pairs)
    rows = []
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_mean_ms", "mean ITL"),
                       ("output_tps", "output tokens/s")):
        r = med(key)
        rows.append(row(f"1 labserver / guidellm {label}", r, "0.95 .. 1.05", 0.95 <= r <= 1.05,
                        f"{val('labserver', key):.4g} vs {val('guidellm', key):.4g} (medians of {len(pairs)} pairs; "
                        f"per pair {', '.join(f'{ratio:.3f}' for ratio in per_pair(key))})"))
    for tool in ("labserver", "guidellm"):
        own = [p[tool]["itl_mean_ms"] / p[tool]["server_itl_mean_ms"] for p in pairs]
        rows.append(row(f"1 {tool}'s mean ITL / the server's own, same run (its step log)", statistics.median(own),
                        "(INFO)", None, f"{val(tool, 'itl_mean_ms'):.4g} vs {val(tool, 'server_itl_mean_ms'):.4g} ms; "
                        f"per pair {', '.join(f'{x:.3f}' for x in own)}: near 1, the tool read what the server did"))
    rows.append(row("1 the server's own mean ITL, during labserver's / during guidellm's runs",
                    med("server_itl_mean_ms"), "(INFO)", None,
                    f"{val('labserver', 'server_itl_mean_ms'):.4g} vs {val('guidellm', 'server_itl_mean_ms'):.4g} ms: "
                    "below 1, the server itself ran slower while guidellm loaded it"))
    rows.append(row("1 labserver / guidellm TPOT as guidellm defines it (first token counted)", med("tpot_guidellm_ms"),
                    "(INFO)", None, f"{val('labserver', 'tpot_guidellm_ms'):.4g} vs "
                    f"{val('guidellm', 'tpot_guidellm_ms'):.4g} ms: (last token - send) / tokens"))
    rows.append(row("1 labserver TTFT p99 from the schedule / from the send", val("labserver", "ttft_sched_p99_ms")
                    / val("labserver", "ttft_p99_ms"), "(INFO)", None,
                    f"{val('labserver', 'ttft_sched_p99_ms'):.4g} vs {val('labserver', 'ttft_p99_ms'):.4g} ms; "
                    f"late sends p99 {val('labserver', 'late_p99_ms'):.2f} ms; guidellm's dispatch delay p99 "
                    f"{val('guidellm', 'dispatch_delay_p99_ms'):.2f} ms (not in its TTFT), up to "
                    f"{val('guidellm', 'startup_dispatch_delay_max_ms'):.0f} ms in its first {args.skip_requests}"))
    return rows, pairs


def against_peer(args: argparse.Namespace, folder: Path, work: Path) -> tuple[list[dict[str, Any]], Any]:
    exe = peer_venv(PEERS, "hfserve", ["transformers[serving]==5.23.0"], "transformers")
    runs: dict[str, Any] = {}
    for name in ("labserver", "transformers serve"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "labserver":
            cmd, served, eos = labserver_cmd(args, port), args.model, {"ignore_eos": True}
        else:  # its /v1/models fails offline (it scans the hub cache): the name is the folder as given
            cmd, served, eos = transformers_serve(exe, folder, port), str(folder), {"ignore_eos": False}
        print(f"peer: {name} ...", file=sys.stderr)
        with running(cmd, url + "/health", work / f"{name.replace(' ', '-')}.log"):
            probe = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": served, "prompt": "hello", "max_tokens": 2, "ignore_eos": True})
            runs.setdefault("ignore_eos_probe", {})[name] = f"{probe.status_code} {probe.text[:160]}"
            warm(url, served, **eos)
            result = run_ours(url, served, None, args, **eos)
        runs[name] = {**ours(result), "summary": {k: v for k, v in result.summary().items()
                                                  if isinstance(v, (int, float, str))}}
        if runs[name]["errors"]:
            errors = result.records.loc[result.records["error"] != "", "error"].value_counts().to_dict()
            runs[name]["error_kinds"] = errors
    a, b = runs["labserver"], runs["transformers serve"]
    tokens_note = (f"output tokens {a['output_tokens']} vs {b['output_tokens']}; ignore_eos sent to it: "
                   f"{runs['ignore_eos_probe']['transformers serve'][:3]}")
    rows = [row("2 labserver / transformers serve output tokens/s", a["output_tps"] / b["output_tps"], "(INFO)",
                None, f"{a['output_tps']:.4g} vs {b['output_tps']:.4g} tokens/s; {tokens_note}"),
            row("2 labserver / transformers serve TTFT p99", a["ttft_sched_p99_ms"] / b["ttft_sched_p99_ms"], "(INFO)",
                None, f"{a['ttft_sched_p99_ms']:.4g} vs {b['ttft_sched_p99_ms']:.4g} ms from the schedule")]
    return rows, runs


def door_cost(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pairs = []
    with running(labserver_cmd(args, port), url + "/health", work / "labserver-door.log"):
        warm(url, args.model)
        for k in range(args.pairs):
            pair = {}
            for api in (("openai-completions", "labserver") if k % 2 == 0 else ("labserver", "openai-completions")):
                print(f"door pair {k + 1}/{args.pairs}: {api} ...", file=sys.stderr)
                before = tokens_made(url)
                r = run_ours(url, args.model, None, args, api=api, mode="generate", arrival=None, rate_per_s=None,
                             users=args.door_users, duration_s=args.door_seconds, max_requests=None)
                s, rec = r.summary(), r.records  # the counts: warm-up included, as the server's
                answers = rec[ok(rec)]
                pair[api] = {"tps": s["token_throughput_tps"], "n_ok": s["n_ok"], "ttft_p50_ms": s["ttft_p50_ms"],
                             "sent": int(rec["sent_s"].notna().sum()), "answered": len(answers),
                             "tokens_client": int(rec["n_tokens"].fillna(0).sum()),
                             "tokens_server": tokens_made(url) - before,
                             "short_answers": int((answers["n_tokens"].fillna(0) < args.output_tokens).sum())}
            pairs.append(pair)
    ratios = [p["openai-completions"]["tps"] / p["labserver"]["tps"] for p in pairs]
    r = statistics.median(ratios)
    v1 = statistics.median(p["openai-completions"]["tps"] for p in pairs)
    native = statistics.median(p["labserver"]["tps"] for p in pairs)
    return [row("3 /v1/completions / /generate tokens/s at saturation", r, ">= 0.95", r >= 0.95,
                f"{v1:.4g} vs {native:.4g} tokens/s, {args.door_users} users closed loop, {args.door_seconds:g} s each; "
                f"per pair {', '.join(f'{x:.3f}' for x in ratios)}")], pairs


def smoke_checks(numbers: dict[str, Any], skip: set[str], args: argparse.Namespace) -> Checks:
    check = Checks()
    ran = {part: numbers[part] for part in PARTS if part not in skip}
    check.rows(numbers["rows"], [prefix for part in ran for prefix in PARTS[part]])
    for part, raw in list(ran.items()):
        why = raw.get("error") if isinstance(raw, dict) else None
        if not check(why is None, f"{part}: could not run here: {why}"):
            del ran[part]
    for i, pair in enumerate(ran.get("guidellm", []), 1):
        for tool in ("labserver", "guidellm"):
            check.positive(pair[tool]["n"], f"guidellm pair {i}: {tool}'s answered requests")
            check(pair[tool]["errors"] == 0, f"guidellm pair {i}: {tool} counted {pair[tool]['errors']} errors")
            check.positive(pair[tool]["server_itl_mean_ms"], f"guidellm pair {i}: the server's mean ITL, {tool}'s run")
        check(pair["labserver"]["n"] == pair["guidellm"]["n"], f"guidellm pair {i}: labserver counted "
              f"{pair['labserver']['n']} requests, guidellm {pair['guidellm']['n']}: not the same requests")
    if "peer" in ran:
        for name in ("labserver", "transformers serve"):
            check.positive(ran["peer"][name]["n"], f"peer: {name}'s answered requests")
        errors = ran["peer"]["labserver"]["errors"]
        check(errors == 0, f"peer: labserver had {errors} errors")
    if "door" in ran:
        check(len(ran["door"]) == args.pairs, f"door: {len(ran['door'])} pairs of {args.pairs}")
    for i, pair in enumerate(ran.get("door", []), 1):
        for api, m in pair.items():
            where = f"door pair {i}, {api}"
            check.positive(m["n_ok"], f"{where}: answered requests")
            check.positive(m["tps"], f"{where}: tokens/s")
            check(m["sent"] == m["answered"], f"{where}: {m['sent']} requests sent, {m['answered']} answered")
            check(m["short_answers"] == 0, f"{where}: {m['short_answers']} answers shorter than the "
                  f"{args.output_tokens} tokens asked under ignore_eos")
            check(m["tokens_client"] == m["tokens_server"], f"{where}: the client counted {m['tokens_client']} "
                  f"tokens, the server's /stats {m['tokens_server']}")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-random", help="labserver's model (saved for the peer as it is)")
    ap.add_argument("--rate", type=float, default=2.5, help="Poisson requests/s (below the server's capacity)")
    ap.add_argument("--requests", type=int, default=330, help="requests per run (>= 300 counted for a p99)")
    ap.add_argument("--skip-requests", type=int, default=20,
                    help="the first requests of each run left out of both tools' figures (their start-up)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16, help="labserver's sequences per step")
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs; ratios are medians over them")
    ap.add_argument("--door-users", type=int, default=32, help="closed-loop users for the /v1 door's cost")
    ap.add_argument("--door-seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: guidellm, peer, door")
    ap.add_argument("--smoke", action="store_true",
                    help="exit on checks of what was measured (rows, counts, no errors), not on the goals")
    ap.add_argument("--out", default="results/crosscheck/cpu.json")
    args = ap.parse_args()
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)
    skip = set(filter(None, args.skip.split(",")))
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args),
                               "command": " ".join(["python", *sys.argv])}
    rows: list[dict[str, Any]] = []
    folder = save_for_peer(args.model, PEERS / args.model)
    with tempfile.TemporaryDirectory(prefix="crosscheck-") as tmp:
        work = Path(tmp)
        for part, fn, call in (("guidellm", against_guidellm, (args, folder, work)),
                               ("peer", against_peer, (args, folder, work)),
                               ("door", door_cost, (args, work))):
            if part in skip:
                continue
            try:
                part_rows, raw = fn(*call)
            except Exception as e:  # a part that cannot run keeps its row, with why
                logging.getLogger("crosscheck").exception("%s failed", part)
                why = f"{type(e).__name__}: {e}"
                part_rows, raw = [row(f"{part}: could not run here", math.nan, "-", None, why[:400])], {"error": why}
            rows += part_rows
            numbers[part] = raw
    numbers["rows"] = rows
    lines = [f"{'target':<80} {'value':>8} {'goal':>13} {'result':>6}  detail"]
    lines += [f"{r['target']:<80} {r['value']:>8.3f} {r['goal']:>13} {r['result']:>6}  {r['detail']}" for r in rows]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(numbers, indent=1, default=float))
    out.with_suffix(".txt").write_text(f"$ {numbers['command']}\n{numbers['machine']['when']}\n\n{table}\n")
    print(f"wrote {out} and {out.with_suffix('.txt')}", file=sys.stderr)
    if args.smoke:
        return smoke_checks(numbers, skip, args).verdict()
    return 0 if all(r["result"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
