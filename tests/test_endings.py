"""Every way a sequence ends goes through one function (``GenEngine.end``), and leaves the books square.

One step engine (``gen-continuous``, one sequence at a time, a KV connector plugged in, a
clock the test moves) is walked through every ``FinishReason``: a stop string, the length
limit, EOS, a hand-over, the model failing, a client gone, a deadline passed in the queue,
the queue's discipline shedding, and a drain. Afterwards: no block held, every sequence
settled once with the status its reason leaves, every counter moved once per ending.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from labserver.engine import Expired, FinishReason, Overloaded, ShuttingDown, Status, StepEngine
from labserver.engine.handover import HandoverConnector
from labserver.models import POISON, ModelError
from labserver.strategies import Limits, make_strategy

from .fakes import SteppedGen


async def settled(seq: Any, model: SteppedGen, timeout_s: float = 10.0) -> None:
    """Let the model step until ``seq`` has ended (each wake is a token or its ending)."""
    async def run() -> None:
        while not seq.settled:
            model.allow(1)
            await seq.next_change()
    await asyncio.wait_for(run(), timeout_s)


def test_every_reason_ends_through_one_function_and_the_books_are_square() -> None:
    async def main() -> dict[str, Any]:
        now = [0.0]
        model = SteppedGen()
        limits = Limits(max_batch_size=1, kv_block_tokens=4, max_kv_tokens=64, timeout_ms=1000, eos_prob=0.999,
                        queue="codel", codel_target_ms=100, codel_interval_ms=10_000)
        engine = StepEngine(make_strategy("gen-continuous", limits), model, clock=lambda: now[0])
        engine.connect(HandoverConnector(engine))
        ids = model.encode("a b c d e")
        ends: dict[str, Any] = {}
        engine.start()
        try:
            # answered: the length limit, EOS (eos_prob near 1: at the first token that may end), a stop string, a hand-over
            for name, kw in (("length", dict(ignore_eos=True)), ("eos", {}), ("stop", dict(ignore_eos=True, stop=(" t",))),
                             ("hand-over", dict(ignore_eos=True, remote_decode=True))):
                seq = engine.submit(ids, 3, **kw)
                await settled(seq, model)
                ends[name] = seq
            parked = engine.stats()["kv_parked"]
            await engine.connector.pull(ends["hand-over"].sid)  # (its blocks back)
            ends["error"] = engine.submit(model.encode(f"x {POISON}"), 3)
            await asyncio.wait_for(asyncio.wait([ends["error"].future]), 10)
            # a client gone mid-answer (dropped at the next step boundary), and, queued behind it meanwhile, one whose
            # deadline (1 s) passes: refused once there is room for it
            gone = ends["abort"] = engine.submit(ids, 50, ignore_eos=True)
            await gone.next_change()  # (its first token)
            expired = ends["expired"] = engine.submit(ids, 3)
            now[0] += 2.0
            gone.future.cancel()
            await settled(gone, model)
            await asyncio.wait_for(asyncio.wait([expired.future]), 10)
            # one running, one queued while the queue stood past codel's interval (10 s): shed
            runner = engine.submit(ids, 50, ignore_eos=True)
            await runner.next_change()
            shed = ends["shed"] = engine.submit(ids, 3)
            now[0] += 20.0
            model.allow(1)
            await asyncio.wait_for(asyncio.wait([shed.future]), 10)
            # a drain: the queued and the running end unanswered
            queued = ends["drained-queued"] = engine.submit(ids, 3)
            ends["drained-running"] = runner
            model.allow(1)
            await engine.drain(0)
            return {"ends": ends, "queued": queued, "parked": parked, "engine": engine}
        finally:
            model.allow(10_000)
            await engine.stop()

    r = asyncio.run(main())
    ends, engine = r["ends"], r["engine"]
    stats = engine.stats()  # (stopped: the call under way at the drain applied, its ended sequence dropped)
    want = {"length": FinishReason.LENGTH, "eos": FinishReason.EOS, "stop": FinishReason.STOP,
            "hand-over": FinishReason.HAND_OVER, "error": FinishReason.ERROR, "abort": FinishReason.ABORT,
            "expired": FinishReason.EXPIRED, "shed": FinishReason.SHED, "drained-queued": FinishReason.ABORT,
            "drained-running": FinishReason.ABORT}
    assert {k: s.finish_reason for k, s in ends.items()} == want
    status = {FinishReason.ABORT: Status.ABORTED, FinishReason.ERROR: Status.FAILED, FinishReason.EXPIRED:
              Status.REFUSED, FinishReason.SHED: Status.REFUSED}
    for name, seq in ends.items():
        assert seq.settled and seq.future.done(), name
        assert seq.status is status.get(seq.finish_reason, Status.FINISHED), name
    # what each client got: the answer, or the error its reason names
    for name in ("length", "eos", "stop", "hand-over"):
        assert ends[name].future.result() is ends[name]
    assert ends["abort"].future.cancelled()
    for name, error in (("error", ModelError), ("expired", Expired), ("shed", Overloaded),
                        ("drained-queued", ShuttingDown), ("drained-running", ShuttingDown)):
        assert isinstance(ends[name].future.exception(), error), name
    # the books: no block held (the hand-over's parked until its pull), nothing running, each ending counted once
    assert r["parked"] == 1 and engine.blocks.used == 0 and len(engine.running) == 0
    engine.blocks.check()
    assert stats["endings"] == dict(Counter(reason.value for reason in want.values()))
    assert stats["finished"] == {"length": 1, "eos": 1, "stop": 1, "hand-over": 1}
    assert stats["items_failed"] == 1 and stats["left_while_generating"] == 1  # (the drained runner: no client left)
    assert stats["expired_in_queue"] == 1 and stats["shed"] == {"codel": 1}
    assert stats["time_to_first_token_s"]["count"] >= 4 and stats["e2e_latency_s"]["count"] == 4


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_reason_has_an_api_word_or_none(reason: FinishReason) -> None:
    """The one table at the edge (``server.openai.finish``): OpenAI's words for an answer, vLLM's for the rest."""
    from labserver.server.openai.finish import API_WORDS

    assert API_WORDS[reason] in ({"stop", "length"} if reason.answered else {"abort", "error", None})
