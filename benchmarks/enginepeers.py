"""labserver's model beside vLLM's engine with no server in front: the same float32 weights, prompts and cores.

    python benchmarks/enginepeers.py --out results/enginepeers/cpu.json        # ~10 min on 2 cores
    python benchmarks/enginepeers.py --smoke --out /tmp/enginepeers.json       # labserver alone, gpt2-tiny-random

``peers.py`` measures the two servers under load; this takes the HTTP, the queue and the
load generator away, to say whether what separates them is the engine or what serves it.
One process at a time, in rounds whose order turns:

- **labserver**: its model's calls (``PagedLM.forward``, as ``genperf.offline_engine`` makes
  them: no scheduler), on a thread that ends with them (as a server's model thread): the
  ``--streams`` prompts of ``--prompt-tokens`` random token ids in one call, then
  ``--answer-tokens`` decode calls of every sequence; eagerly (the default) and, as
  **labserver --compile**, with its decode calls compiled as ``--compile`` serves them
  (``labserver.models.graphs.CompiledDecode``, compiled before the first measurement);
- **vLLM**: ``LLM.generate`` on the same folder (its whole engine in one process: scheduler,
  model, sampler), the same token-id prompts, greedy, ``ignore_eos``: once for one token (the
  prefill) and once for ``--answer-tokens`` + 1, fresh prompts each time (no prefix cache hit);
  in its own venv (``labserver.experiments.peers.vllm_python``, which ``peers.py`` installs).

Each engine runs ``--repeats`` times alone, then as many beside a **co-runner**: a process
that spins ``--busy-ms`` of every ``--busy-ms`` + ``--idle-ms`` (1 of 6.5: about 0.15 of a
core; ``peers.py``'s closed-loop client took 0.09-0.12 at 32 streams). Its rows say how much a
neighbour that small costs each engine. Every row is INFO: this explains ``peers.py``'s
figures and judges nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from genperf import Checks, RunClock, exit_status, per, row, write_results

from labserver.experiments import peers
from labserver.experiments.runs import machine_info
from labserver.models import Chunk, load_model, smollm2
from labserver.models.cpu import on_fresh_thread

ROOT = Path(__file__).resolve().parents[1]
OURS, COMPILED = "labserver", "labserver --compile"
FULL = dict(model="smollm2", rounds=2, repeats=3, streams=32, prompt_tokens=32, answer_tokens=64)
SMOKE = dict(model="gpt2-tiny-random", rounds=1, repeats=1, streams=4, prompt_tokens=8, answer_tokens=4)
SPIN = ("import sys, time\nbusy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000\nwhile True:\n"
        "    t = time.perf_counter()\n    while time.perf_counter() - t < busy:\n        pass\n    time.sleep(idle)\n")
VLLM_SIDE = '''
import json, sys, time
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
def main():
    llm = LLM(model=args["folder"], dtype="float32", max_model_len=2048)
    def timed(prompts, n):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0,
                     ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start
    batches = iter(args["prompts"])
    timed(next(batches), args["answer"] + 1)  # (warm)
    for _ in range(args["repeats"]):
        prefill, whole = timed(next(batches), 1), timed(next(batches), args["answer"] + 1)
        print("RESULT " + json.dumps({"prefill_s": prefill, "whole_s": whole}), flush=True)
        input()  # (the parent starts or stops the co-runner between measurements)
if __name__ == "__main__":
    main()
'''


class CoRunner:
    """The small neighbour: a process spinning ``busy`` ms of every ``busy + idle``, while the block runs."""

    def __init__(self, busy_ms: float, idle_ms: float) -> None:
        self.cmd = [sys.executable, "-c", SPIN, str(busy_ms), str(idle_ms)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def prompt_sets(args: argparse.Namespace, count: int, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(args.seed)
    return [[[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
            for _ in range(count)]


def ours(args: argparse.Namespace, neighbour: CoRunner, compiled: bool = False) -> list[dict[str, Any]]:
    """Our model's calls, ``--repeats`` alone then as many beside the co-runner: prefill and decode seconds each;
    ``compiled``: its decode calls through ``torch.compile``, as ``--compile`` serves them."""
    gen = load_model(args.model, device="cpu", kind="generate")
    per_seq = (args.prompt_tokens + args.answer_tokens) // 16 + 2
    gen.allocate_kv(args.streams * per_seq, 16)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.streams)]
    sets = iter(prompt_sets(args, 2 * args.repeats + 1, min(gen.vocab_size, 40000)))
    sid = iter(range(1, 1 << 30))

    def once() -> dict[str, float]:
        ids = [next(sid) for _ in range(args.streams)]
        prompts = [Chunk(s, p, 0, t, prompt_len=len(p)) for s, p, t in zip(ids, next(sets), tables, strict=True)]
        start = time.perf_counter()
        tokens = gen.forward(prompts)
        prefill = time.perf_counter() - start
        for step in range(args.answer_tokens):
            tokens = gen.forward([Chunk(s, [tok], args.prompt_tokens + step, t, prompt_len=args.prompt_tokens,
                                        decode=True) for s, tok, t in zip(ids, tokens, tables, strict=True)])
        whole = time.perf_counter() - start
        gen.release(ids)
        return {"prefill_s": prefill, "whole_s": whole}

    def run() -> list[dict[str, Any]]:
        if compiled:  # (on this thread, as the server makes them on the thread that runs them: models.cpu)
            from labserver.models.graphs import use_compiled

            use_compiled(gen).warm()
        once()  # (warm)
        out = []
        for beside in (False, True):
            if beside:
                neighbour.start()
            try:
                out += [{**once(), "beside": beside} for _ in range(args.repeats)]
            finally:
                neighbour.stop()
        return out

    return on_fresh_thread(run)


def theirs(args: argparse.Namespace, neighbour: CoRunner) -> list[dict[str, Any]]:
    """vLLM's engine in its own venv, the same measurements; its lines read as they come."""
    python = peers.vllm_python(ROOT / "benchmarks" / ".peers")
    folder = smollm2.folder()
    spec = {"folder": str(folder), "repeats": 2 * args.repeats, "answer": args.answer_tokens,
            "prompts": prompt_sets(args, 4 * args.repeats + 1, 40000)}
    proc = subprocess.Popen([str(python), "-c", VLLM_SIDE, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=peers.vllm_env(), cwd="/")
    out: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            if not line.startswith("RESULT "):
                continue
            out.append({**json.loads(line[7:]), "beside": len(out) >= args.repeats})
            if len(out) == args.repeats:  # the next ones beside the co-runner (stopped when vLLM ends)
                neighbour.start()
            proc.stdin.write("\n")
            proc.stdin.flush()
        if proc.wait() != 0 or len(out) != 2 * args.repeats:
            raise peers.PeerUnavailable(f"vLLM's engine ended with {proc.returncode}, {len(out)} measurements")
    finally:
        neighbour.stop()
        proc.kill()
    return out


def summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    """Medians of a set of runs: the prefill's ms, a decode step's ms, output tokens/s (every answer token, the
    prefill's included, over the whole)."""
    prefill = statistics.median(r["prefill_s"] for r in runs)
    whole = statistics.median(r["whole_s"] for r in runs)
    return {"prefill_ms": 1000 * prefill, "step_ms": 1000 * (whole - prefill) / args.answer_tokens,
            "tps": args.streams * (args.answer_tokens + 1) / whole}


def rows_of(numbers: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, m = [], {}
    for who in numbers["runs"]:
        for beside in (False, True):
            m[who, beside] = summary([r for rnd in numbers["runs"][who] for r in rnd if r["beside"] == beside], args)
    where = f"{args.streams} prompts of {args.prompt_tokens} tokens, {args.answer_tokens} decode steps"
    for ours_ in (w for w in (OURS, COMPILED) if ("vLLM", False) in m and (w, False) in m):
        for key, what in (("tps", "output tokens/s"), ("step_ms", "decode step ms"), ("prefill_ms", "prefill ms")):
            for beside in (False, True):
                a, b = m[ours_, beside][key], m["vLLM", beside][key]
                rows.append(row(f"{ours_} model / vLLM engine, {what}{', beside the co-runner' if beside else ''}",
                                per(a, b), "(info)", None, f"{a:.1f} vs {b:.1f}; {where}"))
    for who in numbers["runs"]:
        a, b = m[who, True]["tps"], m[who, False]["tps"]
        rows.append(row(f"{who}: tokens/s beside the co-runner / alone", per(a, b), "(info)", None,
                        f"{a:.1f} vs {b:.1f}: a neighbour spinning {args.busy_ms:g} ms of every "
                        f"{args.busy_ms + args.idle_ms:g}; prefill {m[who, True]['prefill_ms']:.0f} vs "
                        f"{m[who, False]['prefill_ms']:.0f} ms, decode step {m[who, True]['step_ms']:.1f} vs "
                        f"{m[who, False]['step_ms']:.1f} ms"))
    return rows


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check(list(numbers["runs"]) == [OURS], "labserver alone")
    for rnd in numbers["runs"][OURS]:
        check(len(rnd) == 2 * args.repeats, f"{len(rnd)} runs of {2 * args.repeats}")
        for r in rnd:
            check.positive(r["prefill_s"], "prefill seconds")
            check(r["whole_s"] > r["prefill_s"], "decode steps after the prefill")
    check.rows(numbers["rows"], ["labserver: tokens/s beside the co-runner / alone"])
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    for name in ("rounds", "repeats", "streams", "prompt_tokens", "answer_tokens"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int)
    ap.add_argument("--busy-ms", type=float, default=1.0)
    ap.add_argument("--idle-ms", type=float, default=5.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="labserver alone, tiny; judged on what was measured")
    ap.add_argument("--out", default="results/enginepeers/cpu.json")
    args = ap.parse_args()
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    clock, neighbour = RunClock(), CoRunner(args.busy_ms, args.idle_ms)
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args), "command": " ".join(sys.argv),
                               "runs": {OURS: []} if args.smoke else {OURS: [], COMPILED: [], "vLLM": []}}
    names = list(numbers["runs"])
    for rnd in range(args.rounds):
        for who in names[rnd % len(names):] + names[:rnd % len(names)]:  # (the order turns each round)
            print(f"round {rnd + 1}/{args.rounds}: {who} ...", file=sys.stderr)
            numbers["runs"][who].append(theirs(args, neighbour) if who == "vLLM" else
                                        ours(args, neighbour, compiled=who == COMPILED))
    rows = rows_of(numbers, args)
    numbers["rows"] = rows
    footer = clock.line() + "\n" + (
        "labserver: its model's calls with no scheduler (prefill, then one decode call a step), eager and with its "
        "decode calls compiled (--compile); vLLM: LLM.generate, "
        "its whole engine offline. Both float32 on the same converted folder, the same random token-id prompts, "
        "greedy; tokens/s counts every answer token over the prefill and the decode steps. The co-runner is a "
        "process of its own that spins and sleeps, as a load generator's client does.")
    write_results(args.out, numbers, rows, footer, width=max(len(r["target"]) for r in rows) + 2)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
