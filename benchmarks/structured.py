"""Structured outputs on the real model: what a grammar's mask costs, and whether every answer holds its shape.

    python benchmarks/structured.py --out results/structured/cpu.json     # ~10 min on 2 cores, vLLM included
    python benchmarks/structured.py --smoke --out /tmp/structured.json    # gpt2-tiny-random, ~20 s, no vLLM

``smollm2`` (float32) served by ``gen-continuous`` in this process answers extraction tasks
(``labserver.load.shapes``: a person, a place, a review, a meeting; greedy chat, at most
``--max-tokens`` tokens; ``--requests`` at 1 stream, ``--stream-requests`` over ``--streams``) twice: with the task's JSON schema as ``response_format``, and free
(the same prompt, which asks for JSON in words). Over ``--rounds`` in alternating order:

1. **output tokens/s** with the schema against free, at 1 stream (the tasks one at a time)
   and at ``--streams`` concurrent streams (each ratio the median of its rounds): graded against
   free answers made exactly as long as the constrained ones (``ignore_eos``, each task's
   length: only the mask differs), and shown against free answers as the model makes them
   (longer or shorter, so their prompts' share of the time differs too);
2. **the mask's cost**: its seconds (filling each constrained row's bitmask and applying it,
   ``grammar_mask_seconds``) as a share of the model calls' seconds in the same window, per
   call and per row, at 1 stream and at ``--streams``;
3. **compile time**: the vocabulary's preparation (once per model), each schema's first
   compile, and the same schema again (from the cache);
4. **valid**: the constrained answers that parse and validate against their schema (goal
   100 %, each within its budget: an answer cut by ``--max-tokens`` counts as not valid), the
   free answers' share beside it;
5. **vLLM** (``--vllm``, where ``benchmarks/.peers/vllm`` holds its CPU build): the same
   constrained requests one at a time, its output tokens/s, how many of its answers fit, and
   how many are the same text as labserver's.

Goals: schema / free of the same lengths >= 0.9 at 1 and 16 streams; the mask <= 5 % of a step at 1 stream,
<= 10 % at 16; a cached compile <= 1 % of a cold one; valid 100 %. ``--smoke`` judges only
that everything was measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from genperf import Checks, RunClock, exit_status, per, row, sized_args, write_results

import labserver
from labserver.experiments import peers
from labserver.experiments.runs import machine_info
from labserver.experiments.structured import answer_all, compile_times
from labserver.load.shapes import ShapedTasks
from labserver.models import load_model, smollm2

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(model="smollm2", requests=16, streams=16, stream_requests=32, rounds=2, max_tokens=96, vllm="auto")
SMOKE = dict(model="gpt2-tiny-random", requests=4, streams=4, stream_requests=8, rounds=1, max_tokens=24, vllm="off")
GOALS = {"tps": 0.9, "share1": 0.05, "shareN": 0.10, "cached": 0.01, "valid": 1.0}


KINDS = ("free", "schema", "same lengths")  # free as it answers; with the schema; free, made as long as the schema's


def rounds(h: labserver.ServerHandle, gen: Any, tasks: list[Any], streams: int, args: argparse.Namespace
           ) -> list[dict[str, Any]]:
    lengths = [a["tokens"] for a in answer_all(h.url, gen.name, tasks, shaped=True, max_tokens=args.max_tokens,
                                               streams=streams)["answers"]]  # (greedy: every round's; a warm-up)
    out = []
    for i in range(args.rounds):
        r: dict[str, Any] = {"lengths": lengths}
        for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
            r[kind] = answer_all(h.url, gen.name, tasks, shaped=kind == "schema",
                                 max_tokens=lengths if kind == "same lengths" else args.max_tokens, streams=streams,
                                 handle=h)
            print(f"round {i + 1}/{args.rounds}, {streams} stream(s), {kind}: {r[kind]['tps']:.1f} tokens/s, "
                  f"{r[kind]['fit']} of {len(tasks)} fit", file=sys.stderr, flush=True)
        out.append(r)
    return out


def tps_row(runs: list[dict[str, Any]], streams: int, free: str) -> dict[str, Any]:
    """JSON schema against ``free`` (graded: the same lengths, so only the mask differs; as it answers: info)."""
    ratios = [per(r["schema"]["tps"], r[free]["tps"]) for r in runs]
    value = statistics.median(ratios)
    a, b = (statistics.median(r[k]["tps"] for r in runs) for k in ("schema", free))
    length = {k: statistics.mean(x["tokens"] for r in runs for x in r[k]["answers"]) for k in ("schema", free)}
    graded = free == "same lengths"
    return row(f"{streams} stream{'s' * (streams > 1)}: output tokens/s, JSON schema / free "
               + ("answers of the same lengths" if graded else "as it answers"), value,
               f">= {GOALS['tps']:g}" if graded else "(info)", value >= GOALS["tps"] if graded else None,
               f"{a:.4g} vs {b:.4g} tokens/s; answers of {length['schema']:.1f} vs {length[free]:.1f} tokens on "
               "average; rounds " + ", ".join(f"{x:.3f}" for x in ratios))


def mask_row(runs: list[dict[str, Any]], streams: int, goal: float) -> dict[str, Any]:
    m = {k: sum(r["schema"][k] for r in runs) for k in ("mask_s", "mask_rows", "calls", "call_s")}
    share = m["mask_s"] / m["call_s"] if m["call_s"] else float("nan")
    return row(f"mask, {streams} stream{'s' * (streams > 1)}: its share of the model calls' time", share,
               f"<= {goal:g}", share <= goal,
               f"{1000 * m['mask_s'] / max(m['calls'], 1):.3f} ms of {1000 * m['call_s'] / max(m['calls'], 1):.2f} "
               f"ms a call; {1000 * m['mask_s'] / max(m['mask_rows'], 1):.3f} ms a row ({m['mask_rows']} rows in "
               f"{m['calls']} calls)")


def vllm_run(tasks: list[Any], args: argparse.Namespace) -> dict[str, Any] | None:
    """The constrained tasks on vLLM, one at a time; None where it is not installed (or ``--vllm off``)."""
    if args.vllm == "off":
        return None
    try:
        python = peers.vllm_python(args.peers, install=False)
    except peers.PeerUnavailable as e:
        print(f"vLLM: {e}", file=sys.stderr)
        return None
    port = peers.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = peers.vllm_cmd(python, smollm2.folder(), port, served_name=args.model)
    with peers.running(cmd, url + "/health", Path(tempfile.gettempdir()) / "structured-vllm.log", timeout_s=900,
                       env=peers.vllm_env(), cwd=ROOT):
        answer_all(url, args.model, tasks[:1], shaped=True, max_tokens=args.max_tokens)  # (its first request warms)
        return answer_all(url, args.model, tasks, shaped=True, max_tokens=args.max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default=str(ROOT / "benchmarks" / ".peers"), help="where vLLM's venv is")
    args = sized_args(ap, FULL, SMOKE, "results/structured/cpu.json")
    clock = RunClock()
    gen = load_model(args.model, device="cpu", kind="generate")
    tasks = ShapedTasks().take(args.requests, np.random.default_rng(args.seed))
    numbers: dict[str, Any] = {"args": vars(args), "machine": machine_info()}
    numbers["compile"] = compile_times(gen)
    with labserver.serve("gen-continuous", gen, device="cpu", max_batch_size=args.streams, timeout_ms=None,
                         max_queue=10_000) as h:
        answer_all(h.url, gen.name, tasks[:1], shaped=True, max_tokens=args.max_tokens)  # (warm-up, and a compile)
        numbers["1"] = rounds(h, gen, tasks, 1, args)
        numbers["n"] = rounds(h, gen, ShapedTasks().take(args.stream_requests, np.random.default_rng(args.seed + 1)),
                              args.streams, args)
    numbers["vllm"] = vllm_run(tasks, args)
    rows = [tps_row(numbers["1"], 1, "same lengths"), tps_row(numbers["n"], args.streams, "same lengths"),
            tps_row(numbers["1"], 1, "free"), tps_row(numbers["n"], args.streams, "free"),
            mask_row(numbers["1"], 1, GOALS["share1"]), mask_row(numbers["n"], args.streams, GOALS["shareN"])]
    c = numbers["compile"]
    cold, cached = statistics.median(c["cold_s"].values()), statistics.median(c["cached_s"].values())
    rows.append(row("compile: a cached schema / a cold one, s", per(cached, cold), f"<= {GOALS['cached']:g}",
                    per(cached, cold) <= GOALS["cached"],
                    f"{1e6 * cached:.1f} us vs {1000 * cold:.2f} ms (medians of {len(c['cold_s'])} schemas: "
                    + ", ".join(f"{k} {1000 * v:.2f}" for k, v in c["cold_s"].items())
                    + f" ms); the vocabulary's preparation, once per model: {1000 * c['vocab_s']:.0f} ms"))
    shaped, free = ([a for key in ("1", "n") for r in numbers[key] for a in r[kind]["answers"]]
                    for kind in ("schema", "free"))
    valid = sum(a["fits"] for a in shaped) / len(shaped)
    rows.append(row("valid: constrained answers that parse and validate", valid, "100 %", valid >= GOALS["valid"],
                    f"{sum(a['fits'] for a in shaped)} of {len(shaped)} ({sum(a['finish'] == 'length' for a in shaped)}"
                    f" cut by max_tokens {args.max_tokens}); free answers: {sum(a['fits'] for a in free)} of "
                    f"{len(free)} ({100 * sum(a['fits'] for a in free) / len(free):.0f} %)"))
    rows.append(vllm_row(numbers))
    footer = (clock.line() + f"; torch threads: {torch.get_num_threads()}\n"
              f"{args.model} float32 on gen-continuous, greedy chat answers of at most {args.max_tokens} tokens to "
              f"{args.requests} extraction tasks (4 schemas); schema: response_format json_schema (xgrammar's mask); "
              "free: the same prompt without it; speculation is off for constrained sequences.")
    numbers["rows"] = rows
    write_results(args.out, numbers, rows, footer, width=72, result_last=True)
    return exit_status(args, numbers, rows, smoke_checks)


def vllm_row(numbers: dict[str, Any]) -> dict[str, Any]:
    v = numbers["vllm"]
    if v is None:
        return {"target": "vLLM: output tokens/s with the same schemas, 1 stream / labserver's", "value": float("nan"),
                "goal": "(info)", "result": "SKIP", "detail": "vLLM is not installed here (or --vllm off)"}
    ours = numbers["1"][-1]["schema"]
    same = sum(a["text"] == b["text"] for a, b in zip(v["answers"], ours["answers"], strict=True))
    return row("vLLM: output tokens/s with the same schemas, 1 stream / labserver's", per(v["tps"], ours["tps"]),
               "(info)", None, f"{v['tps']:.4g} vs {ours['tps']:.4g} tokens/s; its answers fit: {v['fit']} of "
               f"{len(v['answers'])}; the same text as labserver's: {same} of {len(v['answers'])}")


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check.rows(numbers["rows"][:7], ["1 stream:", f"{args.streams} streams:", "mask, 1 stream", "compile:"])
    for key in ("1", "n"):
        for r in numbers[key]:
            check.positive(r["schema"]["tps"], f"{key}: schema tokens/s")
            check.positive(r["free"]["tps"], f"{key}: free tokens/s")
            check([a["tokens"] for a in r["same lengths"]["answers"]] == r["lengths"],
                  f"{key}: free answers of the constrained ones' lengths are not")
            check(r["schema"]["mask_rows"] > 0 and r["free"]["mask_rows"] == 0, f"{key}: masks where no schema")
    check(numbers["compile"]["hits"] == len(numbers["compile"]["cached_s"]), "the cache missed")
    return check


if __name__ == "__main__":
    sys.exit(main())
