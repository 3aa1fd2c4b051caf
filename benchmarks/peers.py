"""labserver beside vLLM and llama-server: the same weights, the same cores, one server at a time.

    python benchmarks/peers.py --out results/peers/cpu.json        # ~40 min on 2 cores (vLLM installed on first use)
    python benchmarks/peers.py --smoke --out /tmp/peers.json       # gpt2-tiny-random, labserver alone, ~2 min

The servers, each a process of its own started and stopped here, never two at once:
labserver (``labserver serve --strategy gen-continuous``, float32, the default: its decode steps
compiled where they can be, ``--compile auto``, ``labserver.models.graphs.CompiledDecode``), the
same eager (``--compile off``: parts 1, 2 and 4 only), vLLM 0.32's CPU build
(``labserver.experiments.peers.vllm_python``: its own venv, float32, on every core) and ``llama-server`` (built once, on the GGUF's Q4_1 blocks). labserver and vLLM load
the same converted folder; llama-server the GGUF it came from. One run, in rounds: vLLM and
the default labserver next to each other, in turns (round 1 vLLM first, whose saturation sets
the open-loop rates; round 2 labserver first, ...), then the others:

1. **start**: a process start until ``/health`` answers 200 (vLLM: from the compile cache
   this machine holds in ``~/.cache/vllm``, or compiling where it holds none: said in the row);
2. **streams**: 1, 16 and 32 closed-loop users on each server (``realmodel.load``: streamed
   ``/v1/completions``, ``ignore_eos``, 128 tokens an answer for one stream and 64 for
   more), output tokens/s in the window; each ratio the median of the rounds', each
   round's printed;
3. **open loop** (round 1): ``--open-requests`` Poisson arrivals at 0.5, 0.9 and 1.3 x
   vLLM's saturated request rate (its 32-stream tokens/s over 64 tokens), TTFT and ITL
   p50/p99 measured by labserver's load generator from the scheduled send;
4. **exact** (round 1): 16 chat questions x 64 greedy tokens in float32 on labserver and
   vLLM (``return_token_ids``); where two answers part, labserver's own top two
   log-probabilities there (asked with the common prefix as a token-id prompt): a
   near-tie when they are within 1e-3;
5. **vLLM's own client** (round 1): ``vllm bench serve`` with its ``random`` dataset
   (random token ids decoded into prompts: NUL and replacement characters among them)
   against labserver, run from vLLM's venv through ``vllm.benchmarks.serve``'s
   ``add_cli_args`` and ``main`` (its CLI looks its version up under the name ``vllm``);
6. **lm-eval** (round 1, ``lmevalcheck.py``): ``local-completions`` with its default
   settings (token-id prompts) against labserver, beside its transformers backend on the
   folder: scores, log-likelihoods and generations;
7. **the engine's own steps** (once, first, before any server runs): the model's decode
   step of one sequence against its memory floor (the bytes a step reads over this machine's
   read bandwidth, measured here as ``benchmarks/roofline.py`` measures it: a plain sum over
   1 GiB, the median of the rounds), as the default runs it (compiled here, its seconds
   printed) and eagerly (``--compile off``), and its decode call of 16 against transformers' own
   dense-cache step, all at ``--context`` tokens.

``--smoke``: labserver alone on gpt2-tiny-random, parts 1-3, judged on what was measured.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
import lmevalcheck
import realmodel
from genperf import Checks, RunClock, exit_status, per, row, write_results

from labserver import analysis
from labserver.experiments import peers, roofline
from labserver.experiments.runs import machine_info
from labserver.load.prompts import QUESTIONS
from labserver.loadgen import run_load_sync
from labserver.models import load_model, release_openmp_threads, smollm2
from labserver.models.graphs import use_compiled

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / ".peers"
OURS, EAGER, VLLM, LLAMA = "labserver", "labserver --compile off", "vLLM", "llama-server"
FLAGS = {OURS: [], EAGER: ["--compile", "off"]}  # (the default compiles its decode steps where it can)
FULL = dict(model="smollm2", rounds=3, warmup=10.0, duration=30.0, streams="1,16,32", answer_tokens=64,
            one_stream_tokens=128, prompt_tokens=32, quiet_wait=120.0, max_rest=0.6, open_requests=300,
            exact_questions=16, exact_tokens=64, servers=f"{OURS},{EAGER},{VLLM},{LLAMA}", context=128, batch=16)
SMOKE = dict(model="gpt2-tiny-random", rounds=1, warmup=0.5, duration=2.0, streams="1,4", answer_tokens=16,
             one_stream_tokens=16, prompt_tokens=16, quiet_wait=0.0, max_rest=math.inf, open_requests=40,
             exact_questions=2, exact_tokens=8, servers=OURS, context=32, batch=4)
OPEN_LOADS = (0.5, 0.9, 1.3)  # x vLLM's saturated request rate
NEAR_TIE = 1e-3
MEANING = ("labserver and vLLM run the same float32 weights (labserver's converted folder, loaded unchanged by "
           "both); llama-server runs the GGUF's 4-bit Q4_1 blocks with llama.cpp's C++ kernels. vLLM's CPU build "
           "compiles its model with torch.compile and runs its own C++ kernels for paged attention.")


# -- the servers ----------------------------------------------------------------------------------------------

def folder(args: argparse.Namespace) -> Path:
    return smollm2.folder() if args.model == "smollm2" else Path(args.model)


@contextmanager
def serving(who: str, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """One server for the block: its URL, model name, pid and the seconds it took to answer /health."""
    port = peers.free_port()
    url = f"http://127.0.0.1:{port}"
    env = None
    if who in FLAGS:
        cmd = [sys.executable, "-m", "labserver.cli", "serve", "--strategy", "gen-continuous", "--model", args.model,
               "--port", str(port), "--max-batch", "32", "--max-new-tokens", "1024", "--log-level", "warning",
               *FLAGS[who]]
        name, log = args.model, PEERS / f"labserver-peers{'-eager' if who == EAGER else ''}.log"
    elif who == VLLM:
        python = peers.vllm_python(PEERS, install=not args.smoke)
        cmd, env = peers.vllm_cmd(python, folder(args), port, served_name=args.model), peers.vllm_env()
        name, log = args.model, PEERS / "vllm-server.log"
    else:
        exe = peers.llama_server(PEERS, install=not args.smoke)
        cmd = peers.llama_server_cmd(exe, smollm2.gguf_path(), port, 32, 512, alias=args.model)
        name, log = args.model, PEERS / "llama.cpp" / "server-peers.log"
    cached = (Path.home() / ".cache" / "vllm" / "torch_compile_cache").exists()
    t0 = time.perf_counter()
    with peers.running(cmd, url + "/health", log, timeout_s=1800, env=env, cwd=ROOT) as proc:
        started = time.perf_counter() - t0
        mine = httpx.get(url + "/stats", timeout=30).json() if who in FLAGS else {}  # (how its decode steps run)
        print(f"{who} ready in {started:.1f} s", file=sys.stderr)
        yield {"url": url, "model": name, "pid": proc.pid, "start_s": started, "compile_cache": cached,
               "command": " ".join(cmd), "decode": mine.get("decode"), "compile_s": mine.get("compile_s")}


# -- the parts --------------------------------------------------------------------------------------------------

def closed(server: dict[str, Any], n: int, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``n`` closed-loop users (``realmodel.load``), after the machine is quiet (``realmodel.guarded``)."""
    tokens = args.one_stream_tokens if n == 1 else args.answer_tokens
    sub = argparse.Namespace(**{**vars(args), "answer_tokens": tokens})
    return realmodel.guarded(f"{n} streams", lambda: realmodel.load(server["url"], server["model"], n, texts, sub,
                                                                   server_pid=server["pid"]),
                             lambda m: m["cores"]["rest"], args)


def open_loop(server: dict[str, Any], rate: float, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``--open-requests`` Poisson arrivals at ``rate`` (the same schedule for every server): latencies from the
    scheduled send, a p99 from that many answers."""
    def calls() -> tuple[int, int] | None:  # labserver's decode calls, and of those through its compiled step
        if server["decode"] is None:
            return None
        st = httpx.get(server["url"] + "/stats", timeout=30).json()
        return st.get("decode_calls", 0), st.get("compiled_calls") or 0

    before = calls()
    result = run_load_sync(server["url"], api="openai-completions", model=server["model"], arrival="poisson",
                           rate_per_s=rate, max_requests=args.open_requests, payload=texts,
                           new_tokens=args.answer_tokens, ignore_eos=True, stream=True, seed=args.seed,
                           timeout_s=600.0, progress=False)
    after = calls()
    s = analysis.summarize(result.records, tokens=result.tokens)
    return {"rate": rate, "requests": int(s["count"]), "errors": int(s["count"] - s["n_ok"]),
            "decode_calls": None if after is None or before is None else [b - a for a, b in zip(before, after)],
            **{k: float(s.get(k, math.nan)) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                       "token_throughput_tps")}}


def chat_prompts(args: argparse.Namespace) -> list[str]:
    from transformers import AutoTokenizer

    if args.model != "smollm2":
        return list(QUESTIONS[:args.exact_questions])
    tok = AutoTokenizer.from_pretrained(str(folder(args)))
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS[:args.exact_questions]]


def answers(server: dict[str, Any], prompts: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each prompt's greedy tokens (``ignore_eos``: all ``--exact-tokens`` of them) and its prompt's ids."""
    out = []
    for p in prompts:
        r = httpx.post(server["url"] + "/v1/completions", timeout=600,
                       json={"model": server["model"], "prompt": p, "max_tokens": args.exact_tokens, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append({"prompt_ids": choice["prompt_token_ids"], "tokens": choice["token_ids"]})
    return out


def parted(server: dict[str, Any], ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where labserver's answer first differs from vLLM's, labserver's two best log-probabilities there."""
    out = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        at = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        if at is None and len(a["tokens"]) == len(b["tokens"]) and a["prompt_ids"] == b["prompt_ids"]:
            continue
        if at is None:
            out.append({"question": i, "at": None, "gap": math.inf, "why": "prompts or lengths differ"})
            continue
        r = httpx.post(server["url"] + "/v1/completions", timeout=600,
                       json={"model": server["model"], "prompt": a["prompt_ids"] + a["tokens"][:at], "max_tokens": 1,
                             "logprobs": 5, "temperature": 0})
        top = sorted(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
        out.append({"question": i, "at": at, "gap": top[0] - top[1], "ours": a["tokens"][at], "vllm": b["tokens"][at]})
    return out


def bench_serve(server: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``vllm bench serve`` (its random dataset) against ``server``, from vLLM's venv."""
    python = peers.vllm_python(PEERS, install=False)
    script = ("import sys, json\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = FlexibleArgumentParser(); add_cli_args(p)\nr = main(p.parse_args(sys.argv[1:]))\n"
              "print('RESULT ' + json.dumps({k: r.get(k) for k in ('completed', 'failed', 'request_throughput', "
              "'output_throughput', 'median_ttft_ms', 'p99_ttft_ms', 'median_itl_ms', 'p99_itl_ms')}))\n")
    cmd = [str(python), "-c", script, "--backend", "openai", "--base-url", server["url"], "--endpoint",
           "/v1/completions", "--model", server["model"], "--tokenizer", str(folder(args)), "--dataset-name",
           "random", "--random-input-len", "256", "--random-output-len", "64", "--num-prompts", str(args.bench_prompts),
           "--request-rate", str(args.bench_rate), "--seed", "0", "--disable-tqdm"]
    log = PEERS / "vllm-bench-serve.log"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=peers.vllm_env(), cwd=PEERS)
    log.write_text("$ " + " ".join(cmd[:2]) + " ... " + " ".join(cmd[3:]) + "\n" + done.stdout + done.stderr)
    result = next((line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or result is None:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): see {log}")
    import json

    return {**json.loads(result), "prompts": args.bench_prompts, "rate": args.bench_rate}


def run_server(who: str, rnd: int, numbers: dict[str, Any], texts: list[str], args: argparse.Namespace) -> None:
    """Everything one server does in one round."""
    first = rnd == 0
    with serving(who, args) as server:
        numbers["start"].setdefault(who, []).append({k: server[k] for k in ("start_s", "compile_cache", "command",
                                                                            "decode", "compile_s")})
        realmodel.warm(server["url"], server["model"], texts)
        for n in (int(x) for x in args.streams.split(",")):
            print(f"round {rnd + 1}/{args.rounds}: {who}, {n} streams ...", file=sys.stderr)
            m = closed(server, n, texts, args)
            numbers["streams"].setdefault(str(n), {}).setdefault(who, []).append(m)
            print(f"  {m['tps']:.1f} tokens/s ({m['errors']} errors)", file=sys.stderr)
        if not first:
            return
        if who == EAGER:  # (its greedy answers; the open loop and the clients' checks are the default server's)
            numbers["answers"][who] = answers(server, numbers["exact_prompts"], args)
            if VLLM in numbers["answers"]:
                numbers["parted_eager"] = parted(server, numbers["answers"][who], numbers["answers"][VLLM])
            return
        if who == VLLM or (VLLM not in args.servers and who == OURS):  # the open loop's rates: its saturation
            numbers["saturation_rps"] = numbers["streams"][args.streams.split(",")[-1]][who][0]["tps"] / \
                args.answer_tokens
        if numbers.get("saturation_rps"):
            for load in OPEN_LOADS:
                rate = load * numbers["saturation_rps"]
                print(f"  open loop {rate:.2f} requests/s ...", file=sys.stderr)
                numbers["open"].setdefault(str(load), {})[who] = open_loop(server, rate, texts, args)
        if who in (OURS, VLLM):
            numbers["answers"][who] = answers(server, numbers["exact_prompts"], args)
        if who == OURS:
            if VLLM in numbers["answers"]:
                numbers["parted"] = parted(server, numbers["answers"][OURS], numbers["answers"][VLLM])
            for part, run in (("bench_serve", lambda: bench_serve(server, args)),
                              ("lm_eval", lambda: lmevalcheck.check(server["url"], server["model"], folder(args),
                                                                    PEERS / "lmeval-work"))):
                if part in args.skip:
                    continue
                try:
                    numbers[part] = run()
                except (RuntimeError, peers.PeerUnavailable, subprocess.TimeoutExpired) as e:
                    numbers[part] = {"error": str(e)}
                    print(f"SKIP {part}: {e}", file=sys.stderr)


def engine(args: argparse.Namespace) -> dict[str, Any]:
    """Part 7, in this process before any server starts; its OpenMP team freed after (``models.cpu``)."""
    print("the engine's own steps ...", file=sys.stderr)
    gen = load_model(args.model)
    steps = 3 if args.smoke else 20
    bandwidth = roofline.read_bandwidth(rounds=3 if args.smoke else 9)
    with torch.inference_mode():
        one = roofline.step_ms(gen, roofline.decode_chunks(gen, 1, args.context), steps)
        call = roofline.step_ms(gen, roofline.decode_chunks(gen, args.batch, args.context), steps)
    dense = roofline.dense_step_ms(gen, args.batch, args.context, steps)
    gen.allocate_kv(0, 16)  # (the compiled step takes the pool over: none of it held)
    start = time.perf_counter()
    use_compiled(gen).warm()
    compile_s = time.perf_counter() - start
    with torch.inference_mode():
        chunks = roofline.decode_chunks(gen, 1, args.context)
        eager, compiled = [], []
        for _ in range(3):  # (in turns: the machine's bandwidth moves by the second)
            gen.graphs, graphs = None, gen.graphs
            eager.append(roofline.step_ms(gen, chunks, steps))
            gen.graphs = graphs
            compiled.append(roofline.step_ms(gen, chunks, steps))
    release_openmp_threads()
    return {"bandwidth_gb_s": bandwidth, "step_1_ms": statistics.median(compiled), "eager_1_ms": [one, *eager],
            "compile_s": compile_s, "bytes_1": roofline.bytes_read(gen) + args.context * gen.kv_bytes_per_token,
            f"call_{args.batch}_ms": call, "dense_ms": dense}


def engine_rows(m: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    bw = statistics.median(m["bandwidth_gb_s"])
    floor = m["bytes_1"] / bw / 1e6
    call, dense = m[f"call_{args.batch}_ms"], m["dense_ms"]
    eager = statistics.median(m["eager_1_ms"])
    return [row(f"roofline: {args.model} decode step of 1 / its memory floor", per(m["step_1_ms"], floor), "<= 1.5",
                m["step_1_ms"] <= 1.5 * floor, f"compiled (the default): {m['step_1_ms']:.2f} vs {floor:.2f} ms "
                f"({m['bytes_1'] / 1e6:.0f} MB at {bw:.1f} GB/s: a sum over 1 GiB, the median of "
                f"{len(m['bandwidth_gb_s'])} rounds, which read {min(m['bandwidth_gb_s']):.1f} to "
                f"{max(m['bandwidth_gb_s']):.1f}), at a context of {args.context}; compiled in {m['compile_s']:.0f} s"),
            row(f"roofline: {args.model} eager decode step of 1 / its memory floor", per(eager, floor), "(info)",
                None, f"--compile off: {eager:.2f} vs {floor:.2f} ms, the median of "
                f"{len(m['eager_1_ms'])} turns ({', '.join(f'{v:.2f}' for v in m['eager_1_ms'])}); compiled / eager "
                f"{m['step_1_ms'] / eager:.3f}"),
            row(f"decode call of {args.batch}: labserver {args.model} / transformers' dense-cache step",
                per(call, dense), "<= 0.8", call <= 0.8 * dense, f"{call:.1f} vs {dense:.1f} ms at a context of "
                f"{args.context} tokens, the same float32 weights (the engine's model call, offline)")]


# -- the table ------------------------------------------------------------------------------------------------

def rows_of(numbers: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = engine_rows(numbers["engine"], args) if numbers.get("engine") else []
    ran = [w for w in (OURS, EAGER, VLLM, LLAMA) if w in numbers["start"]]
    for n, by in numbers["streams"].items():
        label = f"{n} stream{'s' if n != '1' else ''}:"
        for ours, peer, goal in ((OURS, VLLM, 1.0), (EAGER, VLLM, None), (OURS, LLAMA, None)):
            if peer not in by or ours not in by:
                continue
            per_round = [per(a["tps"], b["tps"]) for a, b in zip(by[ours], by[peer], strict=False)]
            ratio = statistics.median(per_round)
            a, b = (statistics.median(m["tps"] for m in by[w]) for w in (ours, peer))
            name = f"{args.model}{' --compile off' if ours == EAGER else ''}"
            rows.append(row(f"{label} labserver {name} / {peer} output tokens/s", ratio,
                            "(info)" if goal is None else f">= {goal:g}", None if goal is None else ratio >= goal,
                            f"{a:.4g} vs {b:.4g} tokens/s; rounds " + ", ".join(f"{x:.3f}" for x in per_round)))
    for load, by in numbers["open"].items():
        if OURS not in by or VLLM not in by:
            continue
        a, b = by[OURS], by[VLLM]
        rest = "; ".join(f"{w} TTFT p50/p99 {m['ttft_p50_ms']:.0f}/{m['ttft_p99_ms']:.0f} ms, ITL p50/p99 "
                         f"{m['itl_p50_ms']:.0f}/{m['itl_p99_ms']:.0f} ms, {m['requests']} requests, "
                         f"{m['errors']} errors" for w, m in by.items())
        where = f"open loop {a['rate']:.2f} requests/s ({load}x vLLM's saturation):"
        rows.append(row(f"{where} labserver / vLLM TTFT p50", per(a["ttft_p50_ms"], b["ttft_p50_ms"]), "(info)",
                        None, rest))
        compiled = (f"; labserver's decode calls {a['decode_calls'][0]}, {a['decode_calls'][1]} of them compiled"
                    if a.get("decode_calls") else "")
        rows.append(row(f"{where} labserver / vLLM ITL p99", per(a["itl_p99_ms"], b["itl_p99_ms"]), "(info)", None,
                        f"{a['itl_p99_ms']:.0f} vs {b['itl_p99_ms']:.0f} ms{compiled}"))
    for ours, key in ((OURS, "parted"), (EAGER, "parted_eager")):
        if ours not in numbers["answers"] or VLLM not in numbers["answers"]:
            continue
        total, split = len(numbers["answers"][ours]), numbers.get(key, [])
        ties = [p for p in split if p["gap"] <= NEAR_TIE]
        ok = len(split) == len(ties) and len(split) <= 2
        name = f"{args.model}{' --compile off' if ours == EAGER else ''}"
        rows.append(row(f"exact: labserver {name} greedy texts equal vLLM's", total - len(split),
                        f"{total} (ties)", ok, f"{total - len(split)} of {total} answers of {args.exact_tokens} tokens "
                        "equal, float32 on both; parted at " + (", ".join(
                            f"question {p['question']} token {p['at']} (labserver's top two {p['gap']:.1e} apart)"
                            for p in split) or "none")))
    for who in ran:
        starts = [s["start_s"] for s in numbers["start"][who]]
        how = {VLLM: " (from this machine's compile cache)" if numbers["start"][who][0]["compile_cache"]
               else " (the first: compiling)", EAGER: " (the converted folder cached)", LLAMA: "",
               OURS: " (the converted folder cached; compiled code read from torch's cache where an earlier start "
               "or part 7 left it)"}[who]
        decode = sorted({str(s.get("decode")) for s in numbers["start"][who]} - {"None"})
        compiles = [f"{s['compile_s']:.1f}" for s in numbers["start"][who] if s.get("compile_s") is not None]
        how += (f"; decode steps {', '.join(decode)}" if decode else "") + \
            (f" (compiles {', '.join(compiles)} s)" if compiles else "")
        rows.append(row(f"start: {who} seconds to /health 200", statistics.median(starts), "(info)", None,
                        "starts " + ", ".join(f"{s:.1f}" for s in starts) + how))
    bench = numbers.get("bench_serve")
    if bench is not None:
        if "error" in bench:
            rows.append({**row("vllm bench serve: failed requests against labserver", math.nan, "0", None,
                               bench["error"][:200]), "result": "SKIP"})
        else:
            rows.append(row("vllm bench serve: failed requests against labserver", bench["failed"], "0",
                            bench["failed"] == 0, f"{bench['completed']} of {bench['prompts']} completed at "
                            f"{bench['rate']:g} requests/s (random dataset, 256 in, 64 out); its TTFT p50 "
                            f"{bench['median_ttft_ms']:.0f} ms, ITL p50 {bench['median_itl_ms']:.0f} ms"))
    ev = numbers.get("lm_eval")
    if ev is not None:
        if "error" in ev:
            rows.append({**row("lm-eval: local-completions acc / hf acc", math.nan, "1", None, ev["error"][:200]),
                         "result": "SKIP"})
        else:
            acc = per(ev["acc"][0], ev["acc"][1])
            rows.append(row("lm-eval: local-completions acc / hf acc", acc, "1", ev["acc"][0] == ev["acc"][1],
                            f"{ev['acc'][0]:.4f} vs {ev['acc'][1]:.4f} on {ev['mc_items']} local multiple-choice "
                            f"items, token-id prompts (its defaults); log-likelihoods at most "
                            f"{ev['loglikelihood_max_gap']:.1e} apart"))
            rows.append(row("lm-eval: local-completions generations equal hf's", ev["generations_equal"],
                            f"{ev['gen_items']}", ev["generations_equal"] == ev["gen_items"],
                            f"{ev['generations_equal']} of {ev['gen_items']} greedy answers (until a newline, 32 "
                            "tokens at most)"))
    return rows


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check.rows(numbers["rows"], ["start:", "roofline:", "decode call of"])
    for n in args.streams.split(","):
        for m in numbers["streams"][n][OURS]:
            check.positive(m["tps"], f"{n} streams: tokens/s")
            check(m["errors"] == 0 and m["sent"] == m["answered"], f"{n} streams: {m['errors']} errors")
    for load, by in numbers["open"].items():
        check(by[OURS]["errors"] == 0 and by[OURS]["requests"] > 0, f"open loop {load}: {by[OURS]}")
        made, compiled = by[OURS]["decode_calls"] or (0, 0)
        check(0 < compiled <= made, f"open loop {load}: {compiled} of {made} decode calls compiled")
    check(len(numbers["answers"].get(OURS, [])) == args.exact_questions, "not every question answered")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("model", "streams", "servers"):
        ap.add_argument(f"--{name}")
    for name in ("rounds", "answer_tokens", "one_stream_tokens", "prompt_tokens", "open_requests", "exact_questions",
                 "exact_tokens", "context", "batch"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int)
    for name in ("warmup", "duration", "quiet_wait", "max_rest"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float)
    ap.add_argument("--bench-prompts", type=int, default=200, help="vllm bench serve's random prompts")
    ap.add_argument("--bench-rate", type=float, default=4.0, help="... sent at this rate")
    ap.add_argument("--skip", default="", help="parts to leave out: bench_serve, lm_eval, engine (comma-separated)")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="labserver alone, tiny; judged on what was measured")
    ap.add_argument("--out", default="results/peers/cpu.json")
    args = ap.parse_args()
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.servers = args.servers.split(",")
    args.skip = args.skip.split(",") + (["bench_serve", "lm_eval"] if args.smoke else [])
    args.timeout = 3 * (args.warmup + args.duration) + 300
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a kill still stops the server it started)
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)
    clock = RunClock()
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args), "command": " ".join(sys.argv),
                               "start": {}, "streams": {}, "open": {}, "answers": {}}
    texts = realmodel.prompts(args)
    numbers["exact_prompts"] = chat_prompts(args)
    if "engine" not in args.skip:
        numbers["engine"] = engine(args)
    pair = [w for w in (VLLM, OURS) if w in args.servers]  # round 1: vLLM first (its saturation: the rates)
    rest = [w for w in (EAGER, LLAMA) if w in args.servers]
    for rnd in range(args.rounds):
        for name in (pair if rnd % 2 == 0 else pair[::-1]) + rest:  # (the ratio that has a goal from two servers
            #   measured next to each other, in turns: this machine's pace moves by the minute)
            try:
                run_server(name, rnd, numbers, texts, args)
            except peers.PeerUnavailable as e:
                numbers.setdefault("unavailable", {})[name] = str(e)
                print(f"SKIP {name}: {e}", file=sys.stderr)
    rows = rows_of(numbers, args)
    numbers["rows"] = rows
    footer = clock.line() + "\n" + MEANING
    write_results(args.out, numbers, rows, footer, width=max(len(r["target"]) for r in rows) + 2)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
