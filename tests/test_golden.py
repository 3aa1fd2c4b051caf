"""Every rule's decisions on the virtual clock, against a file committed before the engine was reshaped.

For every ``gen-*`` strategy that runs its own steps x prefill rule x prefix cache x
scheduling policy, the step log of ``simulate_gen`` on one scripted workload (bursts,
shared prefixes, priority classes, tenants, a tight KV pool so that paging preempts),
and for every encoder strategy (each queue discipline, deadline admission) the outcome
of every request in ``simulate``. ``tests/golden/steps.json.gz`` holds what they were; a
change that moves one step or one outcome fails here, with the first case that moved.
Run ``LABSERVER_GOLDEN=write pytest tests/test_golden.py`` to write it again, only when a
change of behaviour is meant.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from labserver.engine.gensim import simulate_gen
from labserver.engine.virtual import simulate
from labserver.strategies import Limits, make_strategy, strategy_names

GOLDEN = Path(__file__).parent / "golden" / "steps.json.gz"  # (gzip: 4 MB of JSON)

GEN = ("gen-naive", "gen-static", "gen-continuous", "gen-paged")
PREFILLS = ("eager", "budget", "chunked")
SCHEDULING = ("fcfs", "priority", "fair", "slo")


def _requests() -> list[tuple[Any, ...]]:
    """40 requests: two bursts, a long prompt among short ones, a shared 48-token prefix, 3 classes, 3 tenants."""
    out = []
    for i in range(40):
        arrival = 0.002 * i if i < 20 else 0.25 + 0.004 * (i - 20)
        prompt = 300 if i % 13 == 5 else 20 + (i * 37) % 90
        new = 4 + (i * 11) % 150
        out.append((round(arrival, 6), prompt, new, 48 if i % 3 == 0 else 0, i % 3, "abc"[i % 4 % 3]))
    return out


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 9)
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


STEP_FIELDS = ("start_s", "end_s", "seqs", "idle", "kv_tokens", "kv_reserved", "tokens", "prefilling", "preempted",
               "blocks_used", "blocks_cached", "blocks_free")


def _gen_case(name: str, prefill: str, prefix: bool, scheduling: str) -> dict[str, Any] | None:
    limits = Limits(max_batch_size=8, max_kv_tokens=480, kv_block_tokens=16, prefix_cache=prefix, prefill=prefill,
                    max_prefill_tokens=160, max_step_tokens=96, scheduling=scheduling, eos_prob=0.02,
                    ttft_targets_ms={0: 100, 1: 400, 2: 2000}, tpot_targets_ms={0: 30, 1: 60, 2: 200})
    try:
        strategy = make_strategy(name, limits)
    except ValueError:
        return None  # a prefill rule the strategy does not compose
    run = simulate_gen(strategy, _requests(), prefill_ms=5.0, step_ms=4.0, per_token_ms=0.05, per_seq_ms=0.5)
    steps = [[_round(getattr(s, f)) for f in STEP_FIELDS] for s in run.steps]
    seqs = [[s.sid, len(s.tokens), s.finish_reason and s.finish_reason.value, s.preemptions, s.cached_tokens,
             *_round([s.admitted_s, s.first_token_s, s.finished_s, s.future.settled_s])] for s in run.seqs]
    return {"steps": steps, "seqs": seqs}


def _enc_case(name: str, queue: str, admit: str) -> dict[str, Any] | None:
    limits = Limits(max_batch_size=16, max_wait_ms=2.0, max_queue=64, timeout_ms=150.0 if admit == "deadline" else
                    300.0, queue=queue, admit=admit, max_batch_tokens=2048)
    try:
        strategy = make_strategy(name, limits)
    except ValueError:
        return None
    arrivals = [0.0009 * i + (0.05 if i % 50 > 40 else 0.0) for i in range(400)]
    arrivals.sort()
    tokens = [8 + (i * 29) % 120 for i in range(400)]
    run = simulate(strategy, arrivals, lambda n, longest=64: 2.0 + 0.4 * n + 0.01 * n * longest,
                   classes=[i % 2 for i in range(400)], tokens=tokens)
    return {"batches": [[b.size, b.reason, _round(b.dispatched_s), _round(b.compute_ms)] for b in run.batches],
            "outcomes": [[_round(v) for v in vars(o).values()] for o in run.outcomes]}


def _cases() -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for name in GEN:
        for prefill in PREFILLS:
            for prefix in (False, True):
                for scheduling in SCHEDULING:
                    case = _gen_case(name, prefill, prefix, scheduling)
                    if case is not None:
                        cases[f"{name} prefill={prefill} prefix_cache={prefix} scheduling={scheduling}"] = case
    for name in strategy_names("encode"):
        for queue in ("fifo", "lifo", "adaptive-lifo", "codel"):
            for admit in ("all", "deadline"):
                case = _enc_case(name, queue, admit)
                if case is not None:
                    cases[f"{name} queue={queue} admit={admit}"] = case
    return cases


def test_every_rule_decides_as_it_did() -> None:
    got = json.loads(json.dumps(_cases()))
    if os.environ.get("LABSERVER_GOLDEN") == "write":
        GOLDEN.parent.mkdir(exist_ok=True)
        text = json.dumps(got, separators=(",", ":"), sort_keys=True) + "\n"
        GOLDEN.write_bytes(gzip.compress(text.encode(), mtime=0))
        pytest.skip(f"wrote {GOLDEN}")
    want = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    assert sorted(got) == sorted(want), "the cases themselves changed"
    moved = [k for k in want if got[k] != want[k]]
    first = moved[0] if moved else ""
    where = next((f"{part}[{i}]: {a} -> {b}" for part in want.get(first, {}) for i, (a, b)
                  in enumerate(zip(want[first][part], got[first][part], strict=False)) if a != b), "")
    assert not moved, f"{len(moved)} of {len(want)} cases decide otherwise now, first: {first}, at {where}"
