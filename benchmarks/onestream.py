"""One stream at llama.cpp's pace? labserver's decode against ``llama-server`` on the same GGUF, with its roofline.

    python benchmarks/onestream.py --out results/onestream/cpu.json    # ~30 min on 2 cores (--rounds 3: ~40)
    python benchmarks/onestream.py --smoke --out /tmp/onestream.json   # gpt2-tiny-random, ~1 min

In one run on this machine:

1. **the roofline beside it** (``roofline.py``'s own functions): the machine's read bandwidth,
   and for each labserver model its decode step at 1 sequence (the model's ``forward`` on a
   decode chunk at a context of ``--context`` tokens, the median of 20) against the floor the
   bytes it reads put under it;
2. **exact**: each exact model's greedy answers against transformers' on the same weights in
   its dtype (``foldercheck.check``: ``--exact-questions`` chat questions x ``--answer-tokens``
   tokens, equal, or parted only at a near-tie); and how many of the 64 built-in questions'
   greedy answers each other model (another dtype; ``smollm2-q4``, the GGUF's 4-bit blocks in
   torch's int4 kernel, computed in bfloat16) changes against the first, ``smollm2``;
3. **the streams**: ``--streams`` closed-loop users (1, 16, 32) on each server, one after
   the other, never at once: labserver ``gen-continuous`` with each of ``--models``, and
   ``llama-server`` (built once under ``benchmarks/.peers/llama.cpp``)
   on the GGUF itself, the same prompts and load (``realmodel.py``'s runs: streamed
   ``/v1/completions``, ``--answer-tokens`` with ``ignore_eos``, output tokens/s in the
   window), in alternating order over ``--rounds``; each ratio is the median of the rounds;
4. **the compile**: ``+compile`` models compile while they load, from an empty inductor cache
   (``--warm-cache``: the one this machine holds), then once more in a fresh process on the
   cache the first left: what the next server start pays.

Goals (exact models): 1 stream >= 0.5x llama-server (``smollm2:float16+compile``); 32 streams
>= 1.5x (``smollm2``); a compile <= 60 s, a second start <= 0.25x it. ``smollm2:bfloat16+compile``,
``smollm2-q4`` and 16 streams are INFO. ``--smoke`` runs everything tiny and judges only what was measured.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import foldercheck  # (benchmarks/ is the script's folder: on the path)
import realmodel
from genperf import Checks, exit_status, per, row, write_results

from labserver.experiments import roofline
from labserver.experiments.peers import PeerUnavailable
from labserver.experiments.runs import machine_info
from labserver.load.prompts import QUESTIONS
from labserver.models import Chunk, ModelLoadError, load_model, on_fresh_thread
from labserver.models.graphs import use_compiled
from labserver.models.base import token_of

PEER = realmodel.PEER
FULL = dict(models="smollm2,smollm2:float16,smollm2:float16+compile,smollm2:bfloat16+compile,smollm2-q4", rounds=2, warmup=5.0, duration=20.0, streams="1,16,32",
            answer_tokens=64, prompt_tokens=32, quiet_wait=120.0, max_rest=0.6, exact_questions=16, changed_questions=64)
SMOKE = dict(models="gpt2-tiny-random,gpt2-tiny-random:float16", rounds=1, warmup=0.5, duration=2.0, streams="1,4",
             answer_tokens=16, prompt_tokens=16, quiet_wait=0.0, max_rest=float("inf"), exact_questions=1, changed_questions=4)
MEANING = ("labserver's smollm2 runs float32 PyTorch (the GGUF dequantized once, exact against transformers); "
           "smollm2:float16 the same weights in float16 (--dtype float16: exact against transformers in float16; "
           "one row through float16's own kernel, at the memory's pace, several rows through a float32 copy in "
           "oneDNN's layout); +compile with one sequence's step compiled by torch.compile (--compile; batches run "
           "as without); smollm2:bfloat16 in bfloat16 through oneDNN where the CPU multiplies it natively (its "
           "answers compared with float32's: bfloat16's rounding parts them from transformers' at many ties); "
           "smollm2-q4 the GGUF's Q4_1 blocks in torch's int4 kernel, in bfloat16 (lossy); llama-server the same "
           "blocks with llama.cpp's C++ kernels.")
GOALS = {"1": 0.5, "32": 1.5}  # labserver / llama-server, output tokens/s, an exact model ...
GOAL_MODELS = {"1": "smollm2:float16+compile", "32": "smollm2"}  # ... in the dtype whose kernels suit that load
LOSSY = ("smollm2-q4", "smollm2:bfloat16+compile")  # compared with the first model's answers, not transformers'


def load_gen(name: str) -> Any:
    """A model by name, ``name:dtype`` for another dtype of it (``smollm2:float16``), ``+compile`` with one
    sequence's step compiled (``--compile``: compiled here, before anything is measured; the seconds it took kept
    in ``COMPILE_S``)."""
    name, plus, _ = name.partition("+compile")
    spec, _, dtype = name.partition(":")
    gen = load_model(spec, device="cpu", kind="generate", dtype=dtype or "auto")
    if plus:
        COMPILE_S[name + plus] = on_fresh_thread(lambda: use_compiled(gen).warm(batch=False))  # (one stream's)
    return gen


COMPILE_S: dict[str, float] = {}
SECOND_START = ("import sys; from labserver.models import load_model, on_fresh_thread; "
                "from labserver.models.graphs import use_compiled; "
                "gen = load_model(sys.argv[1], device='cpu', kind='generate', dtype=sys.argv[2]); "
                "print(on_fresh_thread(lambda: use_compiled(gen).warm(batch=False)))")


def second_start(name: str) -> float:
    """The compile's seconds in a fresh process, on the cache the first compile left (``TORCHINDUCTOR_CACHE_DIR``):
    what the next start of a server with ``--compile`` on this machine pays."""
    spec, _, dtype = name.partition("+compile")[0].partition(":")
    done = subprocess.run([sys.executable, "-c", SECOND_START, spec, dtype or "auto"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if done.returncode != 0:
        raise RuntimeError(f"a second start of {name} failed: {done.stderr[-500:]}")
    return float(done.stdout.split()[-1])


def greedy_answers(gen: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens for each prompt, all decoded together (a prefill each, then one step for all)."""
    block = 16
    per_seq = -(-(max(len(p) for p in prompts) + n) // block)
    gen.allocate_kv(per_seq * len(prompts), block)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    answers = [[token_of(gen.forward([Chunk(i + 1, p, 0, tables[i])])[0])] for i, p in enumerate(prompts)]
    while len(answers[0]) < n:
        outs = gen.forward([Chunk(i + 1, [a[-1]], len(p) + len(a) - 1, tables[i], decode=True)
                            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))])
        for a, out in zip(answers, outs, strict=True):
            a.append(token_of(out))
    gen.release([i + 1 for i in range(len(prompts))])
    return answers


def chat_text(gen: Any, question: str) -> str:
    """The question as the model's chat template renders it (a model without one: the question alone)."""
    if getattr(gen.tokenizer, "chat_template", None) is None:
        return question
    return gen.tokenizer.apply_chat_template([{"role": "user", "content": question}],  # type: ignore[no-any-return]
                                             tokenize=False, add_generation_prompt=True)


def exactness(gens: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: each exact model against transformers in its own dtype; the other models' answers against the
    first's (how many a lossy model, or another dtype, changes)."""
    first, *rest = gens
    out: dict[str, Any] = {"model": first, "checks": {}}
    for name in [n for n in gens if n not in LOSSY]:
        out["checks"][name] = [foldercheck.check(name, chat_text(gens[name], q), args.answer_tokens, "cpu",
                                                 model=gens[name]) for q in QUESTIONS[:args.exact_questions]]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.changed_questions)]
    if rest:
        prompts = [gens[first].encode(chat_text(gens[first], q)) for q in questions]
        base = greedy_answers(gens[first], prompts, args.answer_tokens)
        for name in rest:
            other = greedy_answers(gens[name], prompts, args.answer_tokens)
            parted = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                      for x, y in zip(base, other, strict=True)]
            out[name] = {"questions": len(questions), "changed": sum(p is not None for p in parted),
                         "first_change": [p for p in parted if p is not None]}
    return out


def step_rows(gens: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: the machine's read bandwidth; each model's one-sequence decode step against its memory floor."""
    m = roofline.machine(64 if args.smoke else 1024, 3 if args.smoke else 7, 256 if args.smoke else 2048)
    steps = {}
    for name, gen in gens.items():
        chunks = roofline.decode_chunks(gen, 1, args.context)
        measured = roofline.step_ms(gen, chunks, 5 if args.smoke else 20)
        gen.release([c.sid for c in chunks])
        read = roofline.bytes_read(gen)
        floor = roofline.floors(roofline.weights(gen), gen.kv_bytes_per_token, 1, args.context, m, read)
        steps[name] = {"measured_ms": measured, "floor_ms": floor["memory_floor_ms"], "bytes_read": read}
    return {"machine": m, "steps": steps}


def streams(gens: dict[str, Any], exe: Path | None, args: argparse.Namespace,
            peer: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Part 3: per stream count, every server once per round, their order turning; a peer that will not start here
    left out from then on, its error in ``peer`` (``realmodel.against_peer``)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    texts = realmodel.prompts(args)
    who = [*gens, *([PEER] if exe is not None else [])]
    for i in range(args.rounds):
        order = who[i % len(who):] + who[:i % len(who)]
        for n in (int(x) for x in args.streams.split(",")):
            r: dict[str, Any] = {}
            for name in order:
                if name == PEER and exe is None:
                    continue
                print(f"round {i + 1}/{args.rounds}: {name}, {n} streams ...", file=sys.stderr)
                try:
                    r[name] = realmodel.guarded(
                        f"{name}, {n} streams", lambda: realmodel.run_peer(exe, n, texts, args, args.first)
                        if name == PEER else realmodel.run_ours(gens[name], n, texts, args),
                        lambda m: m["cores"]["rest"], args)
                except PeerUnavailable as e:
                    peer["error"], exe = str(e), None
                    print(f"SKIP llama-server: {e}", file=sys.stderr)
                    continue
                print(f"  {r[name]['tps']:.1f} tokens/s", file=sys.stderr)
            runs.setdefault(str(n), []).append(r)
    return runs


def exact_of(checks: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]]]:
    """Whether a model's answers count as exact (equal, or parted only at near-ties, and few), and the parted."""
    parted = [c for c in checks if c["greedy_tokens_equal"] < c["tokens"]]
    near = all(c["tie_gap"] is not None and c["tie_gap"] <= 1e-3 for c in parted)
    return near and len(parted) <= max(2, len(checks) // 8), parted


def rows_of(numbers: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    first = args.first
    ex = numbers["exact"]
    exact = {name: exact_of(checks)[0] for name, checks in ex["checks"].items()}
    for n, runs in numbers["streams"].items():
        label = f"{n} stream{'s' if n != '1' else ''}:"
        for name in numbers["models"]:
            if PEER not in runs[0]:
                rows.append({**row(f"{label} labserver {name} / llama-server output tokens/s", float("nan"), "(info)",
                                   None, f"llama-server not measured: {numbers['peer'].get('error')}"[:300]),
                             "result": "SKIP"})
                continue
            per_round = [per(r[name]["tps"], r[PEER]["tps"]) for r in runs]
            ratio = statistics.median(per_round)
            a, b = (statistics.median(r[w]["tps"] for r in runs) for w in (name, PEER))
            goal = GOALS.get(n) if GOAL_MODELS.get(n) == name else None
            passed = None if goal is None else ratio >= goal and exact.get(name, False)
            why = "" if goal is None or exact.get(name, False) else "; its answers are not exact"
            rows.append(row(f"{label} labserver {name} / llama-server output tokens/s", ratio,
                            "(info)" if goal is None else f">= {goal:g}", passed,
                            f"{a:.4g} vs {b:.4g} tokens/s{why}; rounds " + ", ".join(f"{x:.3f}" for x in per_round)))
    for name, checks in ex["checks"].items():
        ok, parted = exact_of(checks)
        gaps = [f"{c['tie_gap']:.1e}" for c in parted]
        dtype = name.partition(":")[2].partition("+")[0] or "float32"
        rows.append(row(f"exact: {name}'s greedy answers equal transformers' in {dtype}", len(checks) - len(parted),
                        f"{len(checks)} (ties)", ok,
                        f"{len(checks) - len(parted)} of {len(checks)} answers of {args.answer_tokens} tokens "
                        f"equal; parted only at near-ties: gaps {', '.join(gaps) or 'none'}"))
    for name in numbers["models"][1:]:
        c = ex[name]
        kind = "lossy" if name in LOSSY else "dtype"
        rows.append(row(f"{kind}: {name}'s greedy answers that differ from {first}'s", c["changed"], "(info)", None,
                        f"{c['changed']} of {c['questions']} answers of {args.answer_tokens} tokens; first changed "
                        f"tokens at {sorted(c['first_change'])[:12]}"))
    cache = numbers.get("compile_cache", "")
    for name, seconds in numbers.get("compile_s", {}).items():
        rows.append(row(f"compile: {name}'s one-sequence step, seconds", seconds, "<= 60", seconds <= 60,
                        "torch.compile at load, before anything was measured, "
                        + ("from an empty cache" if cache == "empty" else "on the cache this machine held")))
        again = numbers.get("second_start_s", {}).get(name)
        if again is not None:
            rows.append(row(f"compile: {name}'s second start / its first", per(again, seconds), "<= 0.25",
                            per(again, seconds) <= 0.25, f"{again:.1f} vs {seconds:.1f} s: a fresh process on the "
                            "cache the first left"))
    roof = numbers["roofline"]
    for name, s in roof["steps"].items():
        rows.append(row(f"roofline: {name} decode step of 1 / its memory floor", per(s["measured_ms"], s["floor_ms"]),
                        "(info)", None, f"{s['measured_ms']:.2f} vs {s['floor_ms']:.2f} ms ({s['bytes_read'] / 1e6:.0f}"
                        f" MB at {roof['machine']['read_gb_s']:.1f} GB/s): at most "
                        f"{1000 / s['floor_ms']:.0f} tokens/s for one stream"))
    return rows


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check.rows([r for r in numbers["rows"] if r["result"] != "SKIP"], ["exact:", "roofline:"])
    for n in args.streams.split(","):
        for r in numbers["streams"][n]:
            for name in numbers["models"]:
                m = r[name]
                check.positive(m["tps"], f"{n} streams, {name}: tokens/s")
                check(m["errors"] == 0 and m["sent"] == m["answered"], f"{n} streams, {name}: {m['errors']} errors, "
                      f"{m['sent']} sent, {m['answered']} answered")
    check(all(len(c) == args.exact_questions for c in numbers["exact"]["checks"].values()),
          "exactness: not every question checked")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="labserver's models, the first the exact default, NAME:DTYPE for another dtype "
                    "(default smollm2,smollm2:float16,smollm2:float16+compile,smollm2-q4)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--warmup", type=float)
    ap.add_argument("--duration", type=float)
    ap.add_argument("--streams", help="closed-loop streams, comma-separated (default 1,16,32)")
    ap.add_argument("--answer-tokens", type=int)
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--context", type=int, default=256, help="llama-server's context per slot; the roofline's")
    ap.add_argument("--exact-questions", type=int)
    ap.add_argument("--changed-questions", type=int)
    ap.add_argument("--quiet-wait", type=float)
    ap.add_argument("--max-rest", type=float)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--warm-cache", action="store_true", help="compile on the inductor cache this machine holds "
                    "(default: an empty one, so the compile row is a first start's)")
    ap.add_argument("--smoke", action="store_true", help="tiny; exit on checks of what was measured, not on goals")
    ap.add_argument("--out", default="results/onestream/cpu.json")
    args = ap.parse_args()
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model = args.first = args.models.split(",")[0]  # (realmodel's prompts read --model)
    args.timeout = 3 * (args.warmup + args.duration) + 300
    logging.getLogger("labserver.loadgen").setLevel(logging.ERROR)
    started, when = time.perf_counter(), datetime.now(timezone.utc)
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args), "command": " ".join(sys.argv),
                               "started_utc": when.isoformat(timespec="seconds"),
                               "load_average_at_start": os.getloadavg(), "models": args.models.split(",")}
    exe: Path | None = None
    if args.no_peer:
        numbers["peer"] = {"error": "--no-peer"}
    else:
        try:
            exe = realmodel.llama_server(realmodel.PEERS, install=not args.smoke)
            numbers["peer"] = {"exe": str(exe)}
        except (PeerUnavailable, ModelLoadError) as e:
            numbers["peer"] = {"error": str(e)}
            print(f"SKIP llama-server: {e}", file=sys.stderr)
    if not args.warm_cache:  # (read when inductor first compiles: here, from an empty folder)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="onestream-inductor-")
    numbers["compile_cache"] = "held" if args.warm_cache else "empty"
    gens = {name: load_gen(name) for name in numbers["models"]}
    numbers["compile_s"] = COMPILE_S
    numbers["second_start_s"] = {name: second_start(name) for name in COMPILE_S}
    numbers["roofline"] = step_rows(gens, args)
    numbers["exact"] = exactness(gens, args)
    numbers["streams"] = streams(gens, exe, args, numbers["peer"])
    rows = rows_of(numbers, args)
    numbers["rows"] = rows
    numbers["seconds"] = time.perf_counter() - started
    numbers["load_average_at_end"] = os.getloadavg()
    footer = (f"({numbers['seconds'] / 60:.1f} min from {numbers['started_utc']}; load average "
              f"{numbers['load_average_at_start'][0]:.2f} at the start, {numbers['load_average_at_end'][0]:.2f} at "
              f"the end, on {os.cpu_count()} cores)\n{MEANING}")
    write_results(args.out, numbers, rows, footer, width=max(len(r["target"]) for r in rows) + 2)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
