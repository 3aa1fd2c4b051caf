"""What work beside the model costs it, measured side by side in one process (``--model``, CPU).

On a machine whose every core is in the model's OpenMP team (2 threads on 2 cores), any other
thread that runs during a call takes a core from the team, and the team's other thread waits
for it at the op's end. Three parts, the first two drift-robust (the machine's pace moves by up to 20 %
within ten minutes here, so runs far apart are never compared):

1. **Bursts beside the offline engine** (``genperf.offline_engine``, ``--max-batch`` sequences
   always running, on a fresh thread): alone, beside a thread that every ``--burst-period-ms``
   runs ``--burst-ms`` of Python (the GIL held), and beside one that spends as long in
   ``hashlib`` over a buffer (the GIL released), in alternating order over ``--rounds`` runs of
   ``--duration`` s each. Rows: each kind's tokens/s / alone's (INFO), with the bursts' share
   ``s`` of a core: at the cost of their own time the ratio would be 1 - s/2 (s of the 2 cores'
   time), with the whole team stalled while they run 1 - s.
2. **One served run, a setting switched** every ``--period`` s in ABBA order for ``--pairs``
   pairs (``gen-continuous``, ``2 x --max-batch`` closed-loop streams): ``--switch flush``
   (the step engine writing a call's tokens before the next call, ``StepEngine.flush_turns``,
   against beside it) or ``--switch lag:MS`` (the event-loop lag probe every MS ms against its
   default). The tokens/s of each phase are read from the server's own count (``/stats``),
   half a second after each switch. Row: with / without (INFO), the pairs' median and how many
   were higher.
3. **The server loop's own work per token**: the same served load on ``synthetic-gen:0+0``, a
   model that computes nothing, so the loop is all there is to time: its thread's CPU time
   (``/proc``) per token streamed, over ``--loop-rounds`` runs of ``--loop-duration`` s. Row:
   microseconds a token (INFO). What the loop does between two of the real model's calls
   (planning, applying, writing the streams) is this work, on caches the model's call left
   cold.

``python benchmarks/beside.py`` (~10 min on 2 cores) writes ``results/beside/cpu.json`` and
``.txt``; ``--parts`` runs some of them (``--parts 3``: ~1 min, the model not loaded).
``--smoke`` runs it tiny on random weights and checks that it measured what it reports.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

import genperf  # (benchmarks/ is the script's folder: on the path)
from genperf import Checks, RunClock, exit_status, per, row, sized_args, write_results

from labserver.engine.step import FLUSH_TURNS
from labserver.experiments.runs import machine_info
from labserver.load.lengths import UniformLength
from labserver.models import load_model, on_fresh_thread
from labserver.models.graphs import compile_blocker, use_compiled

FULL = dict(model="smollm2", max_batch=16, rounds=4, duration=12.0, burst_ms=0.8, burst_period_ms=10.0,
            switch="flush", pairs=14, period=8.0, tokens="16:256", loop_rounds=3, loop_duration=10.0, parts="1,2,3")
SMOKE = dict(model="gpt2-tiny-random", max_batch=4, rounds=1, duration=1.0, burst_ms=0.8, burst_period_ms=10.0,
             switch="flush", pairs=2, period=1.0, tokens="4:32", loop_rounds=1, loop_duration=1.0, parts="1,2,3")
NOTHING = "synthetic-gen:0+0"  # part 3's model: no compute, so the loop is all there is
KINDS = ("alone", "python", "native")


# -- 1: bursts beside the offline engine ---------------------------------------------------------------------
class Bursts(threading.Thread):
    """Every ``period_s``, ``burst_s`` of work: a Python loop (the GIL held) or ``hashlib`` (the GIL released)."""

    def __init__(self, kind: str, burst_s: float, period_s: float) -> None:
        super().__init__(name=f"bursts-{kind}", daemon=True)
        self.kind, self.burst_s, self.period_s = kind, burst_s, period_s
        self.stop, self.cpu_s = threading.Event(), 0.0
        self.data = os.urandom(1 << 20)
        self.part = self.data[:self._native_bytes()] if kind == "native" else b""

    def _native_bytes(self) -> int:
        """How many bytes ``hashlib.sha256`` takes ``burst_s`` to read here."""
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 0.1:
            hashlib.sha256(self.data).digest()
            n += 1
        per_byte_s = (time.perf_counter() - t) / (n * len(self.data))
        return max(4096, min(len(self.data), int(self.burst_s / per_byte_s)))

    def run(self) -> None:
        began = time.thread_time()
        while not self.stop.wait(self.period_s):
            if self.kind == "python":
                end, x = time.perf_counter() + self.burst_s, 0
                while time.perf_counter() < end:
                    x += 1
            elif self.kind == "native":
                hashlib.sha256(self.part).digest()
        self.cpu_s = time.thread_time() - began


def offline_beside(gen: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    work = genperf.workload(gen, 1024, args.seed)
    rounds = []
    for i in range(args.rounds):
        r: dict[str, Any] = {}
        for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
            bursts = Bursts(kind, args.burst_ms / 1000, args.burst_period_ms / 1000)
            bursts.start()
            try:
                ran = on_fresh_thread(genperf.offline_engine, gen, work, args.max_batch, args.duration)
            finally:
                bursts.stop.set()
                bursts.join()
            r[kind] = {"tps": ran["tps"], "burst_cores": bursts.cpu_s / ran["seconds"]}
            print(f"  round {i + 1}/{args.rounds}: {kind} {ran['tps']:.1f} tokens/s, bursts "
                  f"{r[kind]['burst_cores']:.3f} of a core", file=sys.stderr)
        rounds.append(r)
    return rounds


# -- 2: one served run, a setting switched ------------------------------------------------------------------------
def switcher(h: Any, switch: str) -> Any:
    """``set(on)``: the setting's two states, applied on the server's loop."""
    rt = h.runtime
    what, _, value = switch.partition(":")
    if what == "flush":  # (on whatever machine: by default a model with a core spare writes beside its calls)
        engine = rt.engine
        if not hasattr(engine, "flush_turns"):
            raise SystemExit(f"--switch flush: {rt.strategy.name}'s engine does not write between its calls")
        return lambda on: setattr(engine, "flush_turns", FLUSH_TURNS if on else 0)
    if what == "lag":
        default_s, other_s = rt.lag.interval_s, float(value or 100) / 1000

        def lag(on: bool) -> None:
            rt.lag.stop()
            rt.lag.interval_s = other_s if on else default_s
            rt.lag.start()

        return lag
    raise SystemExit(f"--switch {switch}: flush or lag:MS")


def served_switched(gen: Any, args: argparse.Namespace) -> dict[str, Any]:
    phases = 2 * args.pairs
    warmup = 2 * args.period
    load_args = argparse.Namespace(**{**vars(args), "warmup": warmup, "duration": (phases + 2) * args.period})
    with genperf.server("gen-continuous", gen, load_args) as h:
        by_default = getattr(h.runtime.engine, "flush_turns", None)
        apply = switcher(h, args.switch)

        def on_loop(on: bool) -> None:
            done = threading.Event()
            h._loop.call_soon_threadsafe(lambda: (apply(on), done.set()))
            done.wait(5)

        tps: dict[bool, list[float]] = {True: [], False: []}
        measured = threading.Event()

        def switching() -> None:
            time.sleep(warmup + 0.5 * args.period)
            for i in range(phases):
                on = i % 4 in (1, 2)  # off, on, on, off: ABBA
                on_loop(on)
                time.sleep(min(0.5, args.period / 4))
                a, t0 = h.stats()["tokens_generated"], time.perf_counter()
                time.sleep(args.period - min(0.5, args.period / 4))
                b, t1 = h.stats()["tokens_generated"], time.perf_counter()
                tps[on].append((b - a) / (t1 - t0))
            on_loop(False)
            measured.set()

        thread = threading.Thread(target=switching, daemon=True)
        thread.start()
        m = genperf.measure(h, load_args, users=2 * args.max_batch)
        thread.join()
    pairs = [per(b, a) for a, b in zip(tps[False], tps[True])]
    return {"on": tps[True], "off": tps[False], "pairs": pairs, "complete": measured.is_set(),
            "flush_turns_by_default": by_default,
            "requests": m["requests"], "errors": m["errors"]}


# -- 3: the server loop's own work per token ------------------------------------------------------------------
def loop_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 3's runs: the loop thread's CPU seconds (and the model thread's) over the tokens the server made."""
    from servedperf import usage  # (its CPU seconds by thread name)

    runs = []
    load_args = argparse.Namespace(**{**vars(args), "warmup": 1.0, "duration": args.loop_duration})
    with genperf.server("gen-continuous", load_model(NOTHING, kind="generate"), load_args) as h:
        for i in range(args.loop_rounds):
            before, made = usage(), h.stats()["tokens_generated"]
            m = genperf.measure(h, load_args, users=2 * args.max_batch)
            after, tokens = usage(), h.stats()["tokens_generated"] - made
            cpu = {k: after["threads"].get(k, 0.0) - before["threads"].get(k, 0.0)
                   for k in ("server loop", "model thread")}
            runs.append({"tokens": tokens, "seconds": after["t"] - before["t"], "errors": m["errors"],
                         "loop_us": 1e6 * cpu["server loop"] / max(tokens, 1),
                         "model_us": 1e6 * cpu["model thread"] / max(tokens, 1)})
            print(f"  round {i + 1}/{args.loop_rounds}: {tokens / runs[-1]['seconds']:.0f} tokens/s, the loop "
                  f"{runs[-1]['loop_us']:.1f} us a token", file=sys.stderr)
    return runs


# -- rows ---------------------------------------------------------------------------------------------------------
def rows_of(numbers: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    if "offline" in numbers:
        rows += offline_rows(numbers["offline"], args)
    if "served" in numbers:
        s = numbers["served"]
        on, off = statistics.mean(s["on"]), statistics.mean(s["off"])
        higher = sum(p > 1 for p in s["pairs"])
        rows.append(row(f"2 served with / without: {args.switch}", per(on, off), "(info)", None,
                        f"{on:.1f} vs {off:.1f} tokens/s, the means of {len(s['pairs'])} pairs of {args.period:g} s "
                        f"(ABBA, one run, {2 * args.max_batch} streams); pairs' median "
                        f"{statistics.median(s['pairs']):.3f}, higher in {higher} of {len(s['pairs'])}"))
    if "loop" in numbers:
        runs = numbers["loop"]
        tps = statistics.median(r["tokens"] / r["seconds"] for r in runs)
        rows.append(row("3 server loop CPU per token (us), the model computing nothing",
                        statistics.median(r["loop_us"] for r in runs), "(info)", None,
                        f"{NOTHING}, {2 * args.max_batch} streams on {args.max_batch} places: {tps:.0f} tokens/s, "
                        f"the model thread {statistics.median(r['model_us'] for r in runs):.1f} us a token; rounds "
                        + ", ".join(f"{r['loop_us']:.1f}" for r in runs)))
    return rows


def offline_rows(rounds: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    alone = [r["alone"]["tps"] for r in rounds]
    for kind, what in (("python", "Python bursts (the GIL held)"), ("native", "hashlib bursts (the GIL released)")):
        ratios = [per(r[kind]["tps"], r["alone"]["tps"]) for r in rounds]
        share = statistics.median(r[kind]["burst_cores"] for r in rounds)
        rows.append(row(f"1 offline beside {what} / alone", statistics.median(ratios), "(info)", None,
                        f"{statistics.median(r[kind]['tps'] for r in rounds):.1f} vs {statistics.median(alone):.1f} "
                        f"tokens/s; the bursts {share:.3f} of a core ({args.burst_ms:g} ms every "
                        f"{args.burst_period_ms:g} ms): at their own time's cost {1 - share / 2:.3f}, stalling the "
                        f"whole team {1 - share:.3f}; rounds "
                        + ", ".join(f"{x:.3f}" for x in ratios)))
    return rows


def smoke_checks(numbers: dict[str, Any], args: argparse.Namespace) -> Checks:
    check = Checks()
    check.rows(numbers["rows"], [name for part, name in (("offline", "1 offline beside Python"),
                                                          ("offline", "1 offline beside hashlib"),
                                                          ("served", "2 served with / without"),
                                                          ("loop", "3 server loop CPU per token")) if part in numbers])
    for i, r in enumerate(numbers.get("offline", []), 1):
        for kind in KINDS:
            check.positive(r[kind]["tps"], f"round {i}: {kind} tokens/s")
        for kind in KINDS[1:]:
            check.positive(r[kind]["burst_cores"], f"round {i}: the {kind} bursts' share of a core")
    if "served" in numbers:
        s = numbers["served"]
        check(s["complete"], "the served run ended before its switching did")
        check(len(s["on"]) == len(s["off"]) == args.pairs,
              f"{len(s['on'])}/{len(s['off'])} phases of {args.pairs} pairs")
        for x in s["on"] + s["off"]:
            check.positive(x, "a phase's tokens/s")
        check(s["errors"] == 0, f"{s['errors']} of {s['requests']} served requests failed")
    for i, r in enumerate(numbers.get("loop", []), 1):
        check.positive(r["tokens"], f"part 3 round {i}: tokens made")
        check.positive(r["loop_us"], f"part 3 round {i}: the loop's CPU a token")
        check(r["errors"] == 0, f"part 3 round {i}: {r['errors']} requests failed")
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = sized_args(ap, FULL, SMOKE, "results/beside/cpu.json")
    lo, _, hi = args.tokens.partition(":")
    genperf.LENGTHS = UniformLength(int(lo), int(hi or lo))
    args.device, args.timeout = "cpu", 900.0
    parts = {p.strip() for p in args.parts.split(",")}
    if not parts or parts - {"1", "2", "3"}:
        ap.error(f"--parts {args.parts}: a comma-separated choice of 1, 2 and 3")
    clock = RunClock()
    numbers: dict[str, Any] = {"machine": machine_info("cpu"), "args": vars(args), "command": " ".join(sys.argv)}
    if parts & {"1", "2"}:
        gen = load_model(args.model, device="cpu", kind="generate")
        blocker = compile_blocker(gen)
        if blocker is None:  # as `labserver serve` runs it by default
            on_fresh_thread(lambda: use_compiled(gen).warm())
        numbers["decode"] = "compiled" if blocker is None else f"eager: {blocker}"
    if "1" in parts:
        print(f"1: the offline engine beside bursts ({args.rounds} rounds) ...", file=sys.stderr)
        numbers["offline"] = offline_beside(gen, args)
    if "2" in parts:
        print(f"2: served, {args.switch} switched every {args.period:g} s ({args.pairs} pairs) ...", file=sys.stderr)
        numbers["served"] = served_switched(gen, args)
    if "3" in parts:
        print(f"3: the server loop's CPU a token, {NOTHING} ({args.loop_rounds} rounds) ...", file=sys.stderr)
        numbers["loop"] = loop_cost(args)
    rows = rows_of(numbers, args)
    numbers["rows"] = rows
    model = f"{args.model}, decode steps {numbers['decode']}" if "decode" in numbers else f"part 3 only ({NOTHING})"
    footer = f"{clock.line()}\n{model}; ratios side by side in one process, never against runs far apart"
    write_results(args.out, numbers, rows, footer, width=max(len(r["target"]) for r in rows) + 2)
    return exit_status(args, numbers, rows, smoke_checks)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
