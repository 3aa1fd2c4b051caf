"""The real model (smollm2, SmolLM2-135M-Instruct) measured three ways in one run: served against offline,
its decode step against transformers', and labserver beside llama.cpp's own server on the same GGUF.

    python benchmarks/realmodel.py --out results/realmodel/cpu.json   # ~21 min on 2 cores (+ ~6 min to build
                                                                      #   llama-server the first time)
    python benchmarks/realmodel.py --smoke --out /tmp/realmodel.json  # smoke: gpt2-tiny-random, ~1 min

Every other benchmark here runs GPT-2-shaped random weights; this one asks whether what they
found holds on the real model labserver serves by default, and how far a Python server on
PyTorch float32 is from the C++ server people run small models with on a CPU.

labserver's decode steps are compiled first, as ``labserver serve`` runs them by default where
they can compile (``labserver.models.graphs``; ``--eager`` leaves them eager), in every part.

1. **Served against offline** (``servedperf``'s machinery, unchanged, on ``--model``): the same
   loaded model measured offline (``genperf.offline_engine``: prefill and decode called
   directly, ``--max-batch`` sequences always running) and served (``gen-continuous`` with
   ``--max-batch``, 2 x max_batch closed-loop users streaming ``genperf``'s workload: prompts of
   8-24 words, ``--tokens`` answers with ``ignore_eos``), in alternating order over ``--rounds``;
   tokens/s in ``--duration`` seconds after ``--warmup``, both (the offline engine starts with every
   sequence young, its calls cheaper than in the steady state). Target: served / offline >= 0.95
   (median of the rounds), as for the random weights: serving should keep the model's speed.
2. **The decode step** of max_batch (16) sequences, served (the mean decode call timed inside
   the served runs' windows) against transformers' own forward on the same weights with its
   dense cache (``labserver.experiments.roofline.dense_step_ms``: the median of 30 steps at the
   served mix's mean context). INFO: labserver's paged KV gathers what a dense cache reads in place, so a ratio
   above 1 is the price of paging, below 1 what its own forward saves.
3. **labserver against llama-server**: ``gen-continuous`` (max_batch_size = the stream count,
   the float32 folder the GGUF was converted to) and llama.cpp's ``llama-server`` (built once under
   ``benchmarks/.peers/llama.cpp``, ``labserver.experiments.peers.llama_server``) on the GGUF itself
   (``smollm2.gguf_path()``, 4-bit Q4_1) with as many parallel slots as labserver's batch, continuous
   batching, a context of ``--context`` tokens per slot, one thread per core. For each of ``--streams``
   (closed-loop users): the same load from the same generator over ``/v1/completions``
   (``api="openai-completions"``, streamed, the same list of prompts in the same order, each of
   ``--prompt-tokens`` tokens counted by smollm2's tokenizer, ``--answer-tokens`` out with ``ignore_eos``,
   greedy), output tokens/s in the window (``genperf.window_tps``: token events between the first answer
   after --warmup and the last by --warmup + --duration) and TTFT p50 from the scheduled send (in a closed
   loop: the user's previous answer). labserver serves in this process (the model loaded once), llama-server
   as its own process; the load generator runs in a process of its own for both. The two servers run one after the
   other, never at once, each started for its run and stopped after it, in alternating order over
   ``--rounds``; each ratio is the median of the rounds. INFO rows: they compare float32 PyTorch
   (~540 MB of weights read per step) with llama.cpp's 4-bit kernels (~100 MB) in C++, so they say
   how far labserver is from a production CPU engine, not which scheduler is better. Rows 4 set
   each server's saturated tokens/s over its own single stream: the gain each gets from batching.

Two cores shared with other work make any of this meaningless: a second busy process halves a
server's cores, and worse, stalls every barrier of its thread team (PyTorch's OpenMP, llama.cpp's
threadpool) while one of its threads waits for a core, which can slow a step ten times. So before
each run (parts 1 and 3) the script waits, up to ``--quiet-wait`` seconds, for the machine to go idle;
it counts the cores busy beside the server and itself during the run (the load generator's few
tenths, or more when someone else computed meanwhile) and measures a run again (at most ``--retries``
times) when they exceed ``--max-rest``. Row 5 reports them, and the runs measured again.

``--smoke`` runs everything tiny (gpt2-tiny-random for labserver's parts, llama-server on the
GGUF only if it is already built, else its rows are SKIP with the reason) and judges what was
measured (rows present and finite, every run answered without errors, the answers as long as
asked, labserver's tokens counted alike by client and server), never a speed. ``--no-peer``
leaves llama-server out (SKIP rows).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from typing import Any

import genperf  # (benchmarks/ is the script's folder: on the path)
import servedperf
from genperf import Checks, check_run, exit_status, per, row, write_results

import labserver
from labserver import analysis
from labserver.experiments import roofline
from labserver.experiments.peers import PeerUnavailable, free_port, llama_server, llama_server_cmd, running
from labserver.experiments.runs import machine_info
from labserver.load.lengths import UniformLength
from labserver.load.payloads import take_payloads
from labserver.load.prompts import TokenPrompts
from labserver.loadgen import run_load_sync
from labserver.models import ModelLoadError, load_model, on_fresh_thread, smollm2
from labserver.models.graphs import compile_blocker, use_compiled

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / ".peers"
OURS, PEER = "labserver", "llama-server"
FULL = dict(model="smollm2", max_batch=16, rounds=3, warmup=10.0, duration=30.0, tokens="16:256", streams="1,16,32",
            answer_tokens=64, prompt_tokens=32, quiet_wait=180.0, max_rest=0.6)
SMOKE = dict(model="gpt2-tiny-random", max_batch=4, rounds=1, warmup=0.5, duration=2.0, tokens="4:32", streams="1,4",
             answer_tokens=16, prompt_tokens=16, quiet_wait=0.0, max_rest=math.inf)
MEANING = ("labserver runs float32 PyTorch (the GGUF dequantized once); llama-server runs the GGUF's 4-bit Q4_1 "
           "weights with llama.cpp's C++ kernels: a ratio is the distance to a production CPU engine, not a verdict "
           "on scheduling.")


# -- 3: one closed-loop load on either server ----------------------------------------------------------------

def prompts(args: argparse.Namespace, n: int = 1024) -> list[str]:
    """The part-3 prompts, drawn once: --prompt-tokens tokens each by smollm2's tokenizer (both servers use it),
    sent in this order to each server (the load generator cycles a list from its start in every run)."""
    source = TokenPrompts(args.prompt_tokens, tokenizer=str(smollm2.folder()) if args.model == "smollm2" else None)
    return take_payloads(source, n, seed=[args.seed, 1])


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds a process has used so far (this one by default), from /proc; a server's (``pid``) with every
    process under it (vLLM computes in an engine process its API server starts)."""
    pids = [pid, *_descendants(pid)] if pid else ["self"]
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (gone meanwhile)
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def quiet(max_wait_s: float, busy_cores: float = 0.3, probe_s: float = 2.0) -> float:
    """Wait (at most ``max_wait_s``) until the machine's cores are busy less than ``busy_cores`` over ``probe_s``:
    a run started while other work computes measures that work's share of the cores. Returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        a = servedperf.usage()
        time.sleep(probe_s)
        b = servedperf.usage()
        waited = time.perf_counter() - t0
        if (b["machine"] - a["machine"]) / (b["t"] - a["t"]) < busy_cores or waited >= max_wait_s:
            return waited


def guarded(what: str, run: Callable[[], dict[str, Any]], rest: Callable[[dict[str, Any]], float],
            args: argparse.Namespace) -> dict[str, Any]:
    """``run()`` once the machine is idle (``quiet``), and again (up to --retries times) when other work kept more
    than --max-rest cores busy beside it meanwhile (``rest``: the cores used by neither the server nor this script)."""
    dropped: list[float] = []
    while True:
        waited = quiet(args.quiet_wait) if args.quiet_wait else 0.0
        m = run()
        busy = rest(m)
        if not busy > args.max_rest or len(dropped) >= args.retries:
            return {**m, "waited_for_quiet_s": waited, "rest_cores": busy, "dropped_rest_cores": dropped}
        dropped.append(busy)
        print(f"  {what}: {busy:.2f} cores busy beside it (over {args.max_rest:g}): measured again", file=sys.stderr)


def warm(url: str, model: str, texts: list[str]) -> None:
    """A few short requests first: first calls allocate (and llama-server's slots start)."""
    run_load_sync(url, api="openai-completions", model=model, users=2, max_requests=4, new_tokens=4,
                  payload=texts[-8:], process=False, progress=False, timeout_s=600.0)


def load(url: str, model: str, users: int, texts: list[str], args: argparse.Namespace,
         server_pid: int | None = None) -> dict[str, Any]:
    """``users`` closed-loop streams for --warmup + --duration s: windowed output tokens/s, TTFT p50, counts,
    and the cores the server process and the whole machine were busy (the rest: the client, and anyone else)."""
    before = servedperf.usage(), cpu_s(server_pid)
    result = run_load_sync(url, api="openai-completions", model=model, users=users, payload=texts,
                           new_tokens=args.answer_tokens, ignore_eos=True, stream=True, warmup_s=args.warmup,
                           duration_s=args.warmup + args.duration, seed=args.seed, timeout_s=args.timeout,
                           progress=False)
    after = servedperf.usage(), cpu_s(server_pid)
    seconds = after[0]["t"] - before[0]["t"]
    cores = {"server": (after[1] - before[1]) / seconds,
             "machine": (after[0]["machine"] - before[0]["machine"]) / seconds}
    for w in result.warnings:
        if "fell behind" not in w:
            print(f"  warning: {w}", file=sys.stderr)
    tps, a_s, b_s = genperf.window_tps(result, args.warmup, args.warmup + args.duration)
    s = analysis.summarize(result.records, tokens=result.tokens)
    records = result.records
    return {"tps": tps, "window_s": [a_s, b_s], "requests": int(s["count"]), "errors": int(s["count"] - s["n_ok"]),
            "cores": {**cores, "rest": cores["machine"] - cores["server"]},
            **{k: float(s.get(k, math.nan)) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms")},
            **genperf.counts(records, records[analysis.ok(records)], result, -1)}


def run_ours(gen: Any, users: int, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    with labserver.serve("gen-continuous", gen, device="cpu", max_batch_size=users, max_queue=100_000,
                         timeout_ms=None, max_new_tokens=args.answer_tokens) as h:  # (in this process)
        warm(h.url, gen.name, texts)
        before = h.stats()["tokens_generated"]
        m = load(h.url, gen.name, users, texts, args)
        m["tokens_server"] = h.stats()["tokens_generated"] - before
    return m


def run_peer(exe: Path, users: int, texts: list[str], args: argparse.Namespace, name: str) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = llama_server_cmd(exe, smollm2.gguf_path(), port, users, args.context, alias=name)
    with running(cmd, url + "/health", PEERS / "llama.cpp" / f"server-{users}.log", timeout_s=120) as proc:
        warm(url, name, texts)
        m = load(url, name, users, texts, args, server_pid=proc.pid)
    return {**m, "tokens_server": None, "command": " ".join(cmd)}  # (it keeps no count labserver's way)


def against_peer(gen: Any, exe: Path | None, args: argparse.Namespace,
                 peer: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Part 3: per stream count, one run of each server per round, their order alternating. A peer that is built
    but will not start here (say, built for another CPU's instructions: SIGILL) is left out from then on, its
    error in ``peer``."""
    runs: dict[str, list[dict[str, Any]]] = {}
    streams, texts = [int(n) for n in args.streams.split(",")], prompts(args)
    for i in range(args.rounds):
        order = (OURS, PEER) if i % 2 == 0 else (PEER, OURS)
        for n in streams:
            r: dict[str, Any] = {}
            for who in order:
                print(f"round {i + 1}/{args.rounds}: {who}, {n} streams ...", file=sys.stderr)
                if who == PEER and exe is None:
                    continue
                try:
                    r[who] = guarded(f"{who}, {n} streams", lambda: run_peer(exe, n, texts, args, gen.name)
                                     if who == PEER else run_ours(gen, n, texts, args), lambda m: m["cores"]["rest"],
                                     args)
                except PeerUnavailable as e:
                    peer["error"], exe = str(e), None
                    print(f"SKIP llama-server: {e}", file=sys.stderr)
                    continue
                print(f"  {r[who]['tps']:.1f} tokens/s, TTFT p50 {r[who]['ttft_p50_ms']:.0f} ms; cores busy: server "
                      f"{r[who]['cores']['server']:.2f}, the rest {r[who]['cores']['rest']:.2f}", file=sys.stderr)
            runs.setdefault(str(n), []).append(r)
    return runs


# -- 1 and 2: servedperf's runs on this model ------------------------------------------------------------------

def served_vs_offline(gen: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    work = genperf.workload(gen, 512, args.seed)
    rounds = []
    for i in range(args.rounds):
        r: dict[str, Any] = {}
        for where in (("offline", "served") if i % 2 == 0 else ("served", "offline")):
            print(f"round {i + 1}/{args.rounds}: {where}, {args.max_batch} sequences ...", file=sys.stderr)
            r[where] = guarded(where, lambda: servedperf.offline(gen, work, args) if where == "offline"
                               else servedperf.served(gen, args), lambda m: m["cores"]["rest of the machine"], args)
        r["ratio"] = per(r["served"]["tps"], r["offline"]["tps"])
        print(f"  served {r['served']['tps']:.1f} vs offline {r['offline']['tps']:.1f} tokens/s: {r['ratio']:.3f}",
              file=sys.stderr)
        rounds.append(r)
    return rounds


# -- the table ---------------------------------------------------------------------------------------------------

def rows_of(numbers: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds, dense = numbers["served_offline"], numbers["dense"]
    ratios = sorted(r["ratio"] for r in rounds)
    ratio = statistics.median(ratios)

    def med(where: str, key: str) -> float:
        return statistics.median(r[where][key] for r in rounds)

    step = per(med("served", "decode_call_ms"), dense["step_ms"])
    rows = [row("1 served/offline tokens/s", ratio, ">= 0.95", ratio >= 0.95,
                f"{med('served', 'tps'):.1f} vs {med('offline', 'tps'):.1f} tokens/s, {args.max_batch} sequences, "
                f"{args.model}, decode steps {numbers.get('decode', 'eager')} (medians of {len(rounds)}); rounds "
                + ", ".join(f"{x:.3f}" for x in ratios)),
            row(f"2 served decode call of {args.max_batch} / transformers' dense-cache step", step, "(info)", None,
                f"{med('served', 'decode_call_ms'):.1f} vs {dense['step_ms']:.1f} ms at a context of "
                f"{dense['context']} tokens, same weights; offline's call {med('offline', 'decode_call_ms'):.1f} ms; "
                "above 1: the paged KV's gather costs more than its own forward saves")]
    peer = numbers["peer"]
    for n, runs in numbers["streams"].items():
        if "error" in peer:
            for what in ("output tokens/s", "TTFT p50"):
                rows.append({**row(f"3 labserver / llama-server {what}, {n} streams", math.nan, "(info)", None,
                                   f"llama-server not measured: {peer['error']}"[:300]), "result": "SKIP"})
            continue
        for what, key in (("output tokens/s", "tps"), ("TTFT p50", "ttft_p50_ms")):
            per_round = [per(r[OURS][key], r[PEER][key]) for r in runs]
            a, b = (statistics.median(r[who][key] for r in runs) for who in (OURS, PEER))
            unit = "tokens/s" if key == "tps" else "ms"
            means = (f"labserver delivers {statistics.median(per_round):.0%} of llama-server's output"
                     if key == "tps" else f"a labserver user waits {statistics.median(per_round):.2f}x as long "
                                          "for the first token")
            other = "" if args.model == "smollm2" else f" (labserver runs {args.model}, not the GGUF's model)"
            rows.append(row(f"3 labserver / llama-server {what}, {n} streams", statistics.median(per_round), "(info)",
                            None, f"{a:.4g} vs {b:.4g} {unit}: {means}{other}; rounds "
                            + ", ".join(f"{x:.3f}" for x in per_round)))
    counts = list(numbers["streams"])
    if len(counts) > 1:
        for who in (OURS, PEER):
            if who == PEER and "error" in peer:
                continue
            one = statistics.median(r[who]["tps"] for r in numbers["streams"][counts[0]])
            for n in counts[1:]:
                many = statistics.median(r[who]["tps"] for r in numbers["streams"][n])
                rows.append(row(f"4 {who} tokens/s, {n} streams / {counts[0]}", per(many, one), "(info)", None,
                                f"{many:.4g} vs {one:.4g} tokens/s: what batching {n} streams gains it"))
    kept = [m for r in rounds for m in (r["served"], r["offline"])]
    kept += [m for runs in numbers["streams"].values() for r in runs for m in r.values()]
    rest = [m["rest_cores"] for m in kept]
    dropped = [x for m in kept for x in m["dropped_rest_cores"]]
    rows.append(row("5 cores busy beside the server and this script, most of the runs kept", max(rest), "(info)",
                    None, f"median {statistics.median(rest):.2f} of {os.cpu_count()}: the load generator's share (a "
                    f"few tenths), more when other work shared the machine; {len(dropped)} runs measured again (other "
                    f"work kept {', '.join(f'{x:.2f}' for x in dropped) or 'no'} cores busy in them)"))
    return rows


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    streams = args.streams.split(",")
    check.rows(numbers["rows"], ["1 served/offline tokens/s", "2 served decode call",
                                 *(f"3 labserver / llama-server {w}, {n} streams" for n in streams
                                   for w in ("output tokens/s", "TTFT p50")),
                                 *(["4 labserver tokens/s"] if len(streams) > 1 else []), "5 cores busy beside"])
    check(len(numbers["served_offline"]) == args.rounds, f"{len(numbers['served_offline'])} rounds of {args.rounds}")
    for i, r in enumerate(numbers["served_offline"], 1):
        check_run(check, f"round {i} served", r["served"])
        check.positive(r["offline"]["tps"], f"round {i}: offline tokens/s")
    check.positive(numbers["dense"]["step_ms"], "transformers' dense decode step (ms)")
    for n in streams:
        runs = numbers["streams"].get(n, [])
        check(len(runs) == args.rounds, f"{n} streams: {len(runs)} rounds of {args.rounds}")
        for i, r in enumerate(runs, 1):
            for who, m in r.items():
                where = f"round {i}, {n} streams, {who}"
                check.positive(m["tps"], f"{where}: tokens/s")
                check.positive(m["ttft_p50_ms"], f"{where}: TTFT p50")
                check(m["errors"] == 0, f"{where}: {m['errors']} of {m['requests']} measured requests failed")
                check(m["sent"] == m["answered"], f"{where}: {m['sent']} requests sent, {m['answered']} answered")
                check(m["short_answers"] == 0, f"{where}: {m['short_answers']} answers shorter than asked")
                if who == OURS:
                    check(m["tokens_client"] == m["tokens_server"], f"{where}: the client counted "
                          f"{m['tokens_client']} tokens, the server's /stats {m['tokens_server']}")
            check(OURS in r and (PEER in r or "error" in numbers["peer"]),
                  f"round {i}, {n} streams: ran {sorted(r)}, not both servers")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=f"labserver's model (default {FULL['model']}; smoke {SMOKE['model']})")
    ap.add_argument("--max-batch", type=int, help="parts 1-2: sequences decoded together (default 16)")
    ap.add_argument("--rounds", type=int, help="alternating rounds; ratios are their median (default 3)")
    ap.add_argument("--warmup", type=float, help="served runs: seconds before the window (default 10)")
    ap.add_argument("--duration", type=float, help="seconds measured, every run (default 30)")
    ap.add_argument("--tokens", help="part 1: asked output lengths, uniform in LO:HI (default 16:256)")
    ap.add_argument("--streams", help="part 3: closed-loop streams, comma-separated (default 1,16,32)")
    ap.add_argument("--answer-tokens", type=int, help="part 3: tokens each answer (ignore_eos; default 64)")
    ap.add_argument("--prompt-tokens", type=int, help="part 3: tokens each prompt (default 32)")
    ap.add_argument("--context", type=int, default=256, help="part 3: llama-server's context per slot (-c / -np)")
    ap.add_argument("--quiet-wait", type=float, help="before each run, wait up to this many seconds for the "
                    "machine to go idle (0: never; default 180, smoke 0)")
    ap.add_argument("--max-rest", type=float, help="measure a run again when other work kept more than this many "
                    "cores busy beside it (default 0.6; smoke: never)")
    ap.add_argument("--retries", type=int, default=2, help="at most this many runs again, each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="leave llama-server out (its rows SKIP)")
    ap.add_argument("--eager", action="store_true", help="labserver's decode steps eager (by default compiled, as "
                    "`labserver serve` runs them where they can compile)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny, and exit on checks of what was measured (rows, counts, no errors), not on targets")
    ap.add_argument("--out", default="results/realmodel/cpu.json", help="every number as JSON here (and a .txt)")
    args = ap.parse_args()
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    lo, _, hi = args.tokens.partition(":")
    genperf.LENGTHS = UniformLength(int(lo), int(hi or lo))  # servedperf's workload and server read it
    if args.prompt_tokens + args.answer_tokens > args.context:
        ap.error(f"--context {args.context} holds no prompt of {args.prompt_tokens} + answer of {args.answer_tokens}")
    args.device = "cpu"
    args.timeout = 3 * (args.warmup + args.duration) + 300
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)
    started, when = time.perf_counter(), datetime.now(timezone.utc)
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args), "command": " ".join(sys.argv),
                               "started_utc": when.isoformat(timespec="seconds"), "load_average_at_start":
                               os.getloadavg()}

    exe: Path | None = None
    if args.no_peer:
        numbers["peer"] = {"error": "--no-peer"}
    else:
        try:  # a smoke run only uses a build that is there; a full run builds it (once)
            exe = llama_server(PEERS, install=not args.smoke)
            numbers["peer"] = {"exe": str(exe), "gguf": str(smollm2.gguf_path())}
        except (PeerUnavailable, ModelLoadError) as e:
            numbers["peer"] = {"error": str(e)}
            print(f"SKIP llama-server: {e}", file=sys.stderr)

    gen = load_model(args.model, device="cpu", kind="generate")
    blocker = "--eager" if args.eager else compile_blocker(gen)
    if blocker is None:  # (as `labserver serve` runs it by default: both steps compiled, offline and served)
        numbers["compile_s"] = on_fresh_thread(lambda: use_compiled(gen).warm())
    numbers["decode"] = "compiled" if blocker is None else f"eager: {blocker}"
    print(f"decode steps {numbers['decode']}", file=sys.stderr)
    numbers["served_offline"] = served_vs_offline(gen, args)
    context = round(statistics.median(r["served"]["mean_context"] for r in numbers["served_offline"]))
    numbers["dense"] = {"context": context,
                        "step_ms": on_fresh_thread(roofline.dense_step_ms, gen, args.max_batch, context, 30)}
    numbers["streams"] = against_peer(gen, exe, args, numbers["peer"])
    rows = rows_of(numbers, args)
    numbers["rows"] = rows
    numbers["seconds"] = time.perf_counter() - started
    numbers["load_average_at_end"] = os.getloadavg()
    footer = (f"({numbers['seconds'] / 60:.1f} min from {numbers['started_utc']}; load average "
              f"{numbers['load_average_at_start'][0]:.2f} at the start, {numbers['load_average_at_end'][0]:.2f} at "
              f"the end, on {os.cpu_count()} cores shared with other work now and then)\n{MEANING}")
    write_results(args.out, numbers, rows, footer, width=max(len(r["target"]) for r in rows) + 2)
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.txt')}", file=sys.stderr)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a kill stops the servers it started, as Ctrl-C does)
    sys.exit(main())
