"""A model error in a generation step fails only the sequence it belongs to: the step is bisected.

A sequence that makes every call it is in raise (``fakes.FailsMidStream``) shares a step with
three others. The step is split in halves, each a call of its own, until the failure falls on
the poisoned sequence alone: it gets the error, mid-stream; the others finish with exactly the
tokens they make without it, each of their calls computed once. First on the engine alone
(every strategy that runs steps, every way of composing them), then through a real server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

import labserver
from labserver import wire
from labserver.engine import Seq, StepEngine
from labserver.models import ModelError, SyntheticGen
from labserver.models.base import generate_alone
from labserver.strategies import Limits, make_strategy

from .fakes import FailsMidStream, sse_events
from .test_server import wait_until

MARK = FailsMidStream.MARK
TEXTS = ["alpha beta gamma", f"delta {MARK} epsilon", "zeta eta theta iota", "kappa lambda mu"]
NEW = [12, 12, 9, 15]
CASES = [("gen-static", {}), ("gen-continuous", {}), ("gen-continuous", {"prefill": "chunked", "max_step_tokens": 64}),
         ("gen-paged", {"kv_block_tokens": 4})]


def run(model: Any, texts: list[str], new: list[int], strategy: str,
        **limits: Any) -> tuple[list[Seq], dict[str, Any], list[dict[str, Any]]]:
    """Submit every text at once (one step holds them all), await every outcome; (sequences, /stats, step log)."""
    async def main() -> tuple[list[Seq], dict[str, Any], list[dict[str, Any]]]:
        e = StepEngine(make_strategy(strategy, Limits(max_batch_size=4, **limits)), model)
        e.start()
        try:
            seqs = [e.submit(model.encode(t), n, ignore_eos=True) for t, n in zip(texts, new, strict=True)]
            await asyncio.wait([s.future for s in seqs])
            return seqs, e.stats(), e.step_log()
        finally:
            await e.stop()

    return asyncio.run(main())


@pytest.mark.parametrize(("strategy", "limits"), CASES)
def test_a_sequence_failing_mid_stream_fails_alone(strategy: str, limits: dict[str, Any]) -> None:
    model = FailsMidStream(after=3)
    seqs, stats, steps = run(model, TEXTS, NEW, strategy, **limits)
    clean, _, _ = run(FailsMidStream(), TEXTS[:1] + TEXTS[2:], NEW[:1] + NEW[2:], strategy, **limits)
    poisoned, healthy = seqs[1], seqs[:1] + seqs[2:]
    assert isinstance(poisoned.future.exception(), ModelError) and len(poisoned.tokens) == 3
    assert all(s.future.exception() is None for s in healthy)
    assert [s.tokens for s in healthy] == [s.tokens for s in clean]  # exactly what they make without it
    assert [len(s.tokens) for s in healthy] == NEW[:1] + NEW[2:]

    failing = [st for st in steps if st["failed"]]
    assert len(failing) == 1 and failing[0]["failed"] == (poisoned.sid,)
    step = failing[0]
    assert len(step["seqs"]) == 4 and step["calls"] == 5  # 4 -> 2 + 2 -> 1 + 1 on the poisoned side
    assert all(st["calls"] == 1 for st in steps if st is not step)
    assert stats["bisections"] == 2 and stats["items_failed"] == 1
    assert stats["running"] == 0 and stats["kv_blocks"]["used"] == 0 and model.cached == 0

    whole = sum(st["calls"] for st in steps[:steps.index(step)])  # the call that raised, then its halves
    assert model.calls[whole] == tuple(step["seqs"])
    halves = model.calls[whole + 1:whole + step["calls"]]
    ran = sorted(sid for call in halves if poisoned.sid not in call for sid in call)
    assert ran == sorted(s.sid for s in healthy)  # each batch-mate computed once, none twice
    assert all(poisoned.sid not in call for call in model.calls[whole + step["calls"]:])  # it left


def test_under_preemption_and_a_prefix_cache_the_batch_mates_stay_exact() -> None:
    # a pool too small for four: sequences are preempted and recomputed around the failure, over cached blocks
    limits = {"max_kv_tokens": 40, "kv_block_tokens": 4, "prefix_cache": True}
    model = FailsMidStream(after=5)
    seqs, stats, _ = run(model, TEXTS, [30] * 4, "gen-paged", **limits)
    clean, _, _ = run(FailsMidStream(), TEXTS[:1] + TEXTS[2:], [30] * 3, "gen-paged", **limits)
    assert stats["preemptions"] > 0 and stats["bisections"] > 0
    assert isinstance(seqs[1].future.exception(), ModelError) and stats["items_failed"] == 1
    assert [s.tokens for s in seqs[:1] + seqs[2:]] == [s.tokens for s in clean]
    assert stats["running"] == 0 and stats["kv_blocks"]["used"] == 0 and model.cached == 0


def test_a_step_every_sequence_fails_in_fails_each_alone() -> None:
    model = FailsMidStream(after=2)
    seqs, stats, steps = run(model, [f"{MARK} {w}" for w in ("one", "two", "three", "four")], [8] * 4,
                             "gen-continuous")
    assert all(isinstance(s.future.exception(), ModelError) and len(s.tokens) == 2 for s in seqs)
    step = next(st for st in steps if st["failed"])
    assert sorted(step["failed"]) == sorted(s.sid for s in seqs) and step["calls"] == 7  # 1 + 2 + 4
    assert stats["running"] == 0 and model.cached == 0


def test_a_call_that_returns_too_few_outputs_is_bisected() -> None:
    class Short(FailsMidStream):
        def forward(self, chunks):  # type: ignore[no-untyped-def]
            return super().forward(chunks)[:1]  # one output whatever the call: right only for a call of one

    seqs, stats, _ = run(Short(), TEXTS[:1] + TEXTS[2:], [5, 5, 5], "gen-continuous")
    clean, _, _ = run(FailsMidStream(), TEXTS[:1] + TEXTS[2:], [5, 5, 5], "gen-continuous")
    assert [s.tokens for s in seqs] == [s.tokens for s in clean]
    assert stats["bisections"] > 0 and stats["items_failed"] == 0


# -- through a real server ------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_over_http_the_poisoned_request_errs_and_its_batch_mates_finish(stream: bool) -> None:
    model = FailsMidStream(after=3, max_context=128)
    # gen-static: the batch leaves only when full, so the four requests share every step
    with labserver.serve("gen-static", model, max_batch_size=4, max_wait_ms=30_000, idle_dispatch=False) as h:
        url = h.url + wire.GENERATE_PATH
        out: dict[int, Any] = {}

        def send(k: int) -> None:
            body = {"prompt": TEXTS[k], "max_new_tokens": NEW[k], "ignore_eos": True}
            if k == 1 and stream:
                with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
                    out[k] = (r.status_code, sse_events(r.read().decode()))
            else:
                out[k] = httpx.post(url, json=body, timeout=30)

        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if stream:
            status, events = out[1]
            assert status == 200 and [kind for kind, _ in events] == ["token"] * 3 + ["error"]
            assert events[-1][1]["error"]["type"] == "model_error" and "Traceback" not in json.dumps(events)
        else:
            assert out[1].status_code == 500 and out[1].json()["error"]["type"] == "model_error"
        reference = SyntheticGen(0, 0)
        for k in (0, 2, 3):
            assert out[k].status_code == 200, out[k].text
            assert out[k].json()["tokens"] == generate_alone(reference, model.encode(TEXTS[k]), NEW[k])
        wait_until(lambda: h.stats()["running"] == 0)
        stats = h.stats()
        assert stats["bisections"] == 2 and stats["items_failed"] == 1
        steps = httpx.get(h.url + "/stats", params={"steps": 100}).json()["recent_steps"]
        failing = [st for st in steps if st["failed"]]
        assert len(failing) == 1 and len(failing[0]["seqs"]) == 4 and failing[0]["calls"] == 5
        again = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": ["still serving"] * 4, "max_tokens": 4},
                           timeout=30)  # (a batch of four: it leaves at once)
        assert again.status_code == 200 and len(again.json()["choices"]) == 4


class Timed(FailsMidStream):
    """``FailsMidStream`` that also logs when each call began and ended on the thread that ran it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.times: list[tuple[float, float]] = []

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        try:
            return super().forward(chunks)
        finally:
            self.times.append((began, time.perf_counter()))


def test_each_record_says_when_the_model_thread_ran_its_call() -> None:
    """``model_s``: the model thread's own start of the call's first model call and end of its last, inside the
    loop's start_s..end_s; for a bisected call, all five of its calls inside it."""
    model = Timed(after=3)
    _, _, steps = run(model, TEXTS, NEW, "gen-continuous")
    assert sum(st["calls"] for st in steps) == len(model.times)
    done = 0
    for st in steps:
        mine, done = model.times[done:done + st["calls"]], done + st["calls"]
        began, ended = st["model_s"]
        assert st["start_s"] <= began <= mine[0][0] and mine[-1][1] <= ended <= st["end_s"]
    bisected = next(st for st in steps if st["calls"] > 1)
    assert bisected["calls"] == 5
    between = [b["model_s"][0] - a["model_s"][1] for a, b in zip(steps, steps[1:])]
    assert all(gap > 0 for gap in between)  # one thread, one call at a time


class SeesTheNextCall(FailsMidStream):
    """Its ``release`` notes whether the loop queued the next call behind it while it ran (a release the loop
    waited for could never see one: nothing is queued until it returns)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.jobs: Any = None  # the model thread's queue, once the engine has one
        self.saw_next: list[bool] = []

    def release(self, seq_ids):  # type: ignore[no-untyped-def]
        deadline = time.perf_counter() + 0.5
        while self.jobs.empty() and time.perf_counter() < deadline:
            time.sleep(0.001)
        self.saw_next.append(not self.jobs.empty())
        self.inner.release(seq_ids)


CLEAN, LENGTHS = TEXTS[:1] + TEXTS[2:] + ["nu xi omicron"], [3, 6, 9, 12]


def test_a_release_is_queued_ahead_of_the_next_call_not_waited_for() -> None:
    """A sequence that leaves while others go on: the model is told before its next call, on its thread, with no
    round trip of its own (the loop queues the call behind it); the answers are those of a release waited for."""
    model = SeesTheNextCall()

    async def main() -> list[Seq]:
        e = StepEngine(make_strategy("gen-continuous", Limits(max_batch_size=4)), model)
        e.start()
        model.jobs = e._thread._jobs  # noqa: SLF001 (what the release looks at)
        try:
            seqs = [e.submit(model.encode(t), n, ignore_eos=True) for t, n in zip(CLEAN, LENGTHS, strict=True)]
            await asyncio.wait([s.future for s in seqs])
            return seqs
        finally:
            await e.stop()

    seqs = asyncio.run(main())
    assert model.saw_next[:3] == [True, True, True]  # the three that left while others were still decoding
    alone = FailsMidStream()
    assert [s.tokens for s in seqs] == [generate_alone(alone, alone.encode(t), n) for t, n in zip(CLEAN, LENGTHS)]
