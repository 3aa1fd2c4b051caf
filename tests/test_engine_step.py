"""The generation engine without HTTP, on a real event loop: isolation, leaving, deadlines, overload, drain, death."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from labserver.engine import Expired, Overloaded, ShuttingDown, WorkerDied
from labserver.strategies import Limits
from labserver.engine import Seq, StepEngine
from labserver.models import SyntheticGen, parse_synthetic_gen
from labserver.models import POISON, InputRejected, ModelError
from labserver.strategies import make_strategy

from .fakes import Crash, SteppedGen


def engine(name: str, model: Any, **limits: Any) -> StepEngine:
    return StepEngine(make_strategy(name, Limits(**limits)), model)  # type: ignore[arg-type]


def submit(e: StepEngine, prompt: str, n: int, **kw: Any) -> Seq:
    return e.submit(e.model.encode(prompt), n, **kw)


async def outcomes(seqs: list[Seq]) -> list[Any]:
    return await asyncio.gather(*(s.future for s in seqs), return_exceptions=True)


def decodes(model: Any) -> list[tuple[int, ...]]:
    return [ids for kind, ids in model.calls if kind == "decode"]


@pytest.mark.parametrize("name", ["gen-naive", "gen-static", "gen-continuous"])
def test_poisoned_prompt_fails_alone_and_nothing_stays_cached(name: str) -> None:
    model = SyntheticGen(0, 0)

    async def main() -> list[Any]:
        e = engine(name, model, max_batch_size=8, max_wait_ms=5)
        e.start()
        seqs = [submit(e, f"prompt {i}", 3 + i) for i in range(6)]
        seqs[2] = submit(e, f"bad {POISON} prompt", 4)
        out = await outcomes(seqs)
        await e.stop()
        return out

    out = asyncio.run(main())
    assert isinstance(out[2], ModelError)
    assert [len(s.tokens) for i, s in enumerate(out) if i != 2] == [3, 4, 6, 7, 8]
    assert model.cached == 0


def test_a_sequence_whose_client_left_is_not_decoded_again() -> None:
    model = SteppedGen()

    async def main() -> tuple[Seq, Seq, int]:
        e = engine("gen-continuous", model, max_batch_size=8)
        e.start()
        a, b = submit(e, "first one", 100), submit(e, "second one", 6)
        for _ in range(3):
            await asyncio.to_thread(model.wait_entered)  # a step is in the model, waiting for its permit
            model.allow()
        await asyncio.to_thread(model.wait_entered)  # the 4th step is in flight: a and b in it
        a.future.cancel()  # the client leaves now
        in_flight = len(decodes(model)) + 1  # (the step in the model is logged when it is allowed to run)
        model.allow(10)
        await b.future
        await e.stop()
        return a, b, in_flight

    a, b, in_flight = asyncio.run(main())
    assert a.sid in decodes(model)[in_flight - 1]  # the step already running finishes with it...
    assert all(a.sid not in ids for ids in decodes(model)[in_flight:])  # ...and no later one has it
    assert len(b.tokens) == 6 and model.cached == 0


def test_deadline_passes_in_the_queue_504_and_never_prefilled() -> None:
    model = SteppedGen()

    async def main() -> list[Any]:
        e = engine("gen-naive", model, timeout_ms=30)
        e.start()
        a = submit(e, "running", 3)
        await asyncio.to_thread(model.wait_entered)
        b = submit(e, "waiting", 3)
        await asyncio.sleep(0.06)  # b's 30 ms deadline passes while a holds the model
        model.allow(5)
        out = await outcomes([a, b])
        await e.stop()
        return out

    a, b = asyncio.run(main())
    assert isinstance(a, Seq) and isinstance(b, Expired)
    assert all(2 not in ids for _, ids in model.calls)  # b (sequence 2) never reached the model


def test_queue_cap_refuses_at_once_and_prompts_too_long_are_refused() -> None:
    model = SteppedGen()

    async def main() -> None:
        e = engine("gen-naive", model, max_queue=1, max_kv_tokens=50)
        e.start()
        a = submit(e, "running", 2)
        await asyncio.to_thread(model.wait_entered)
        b = submit(e, "queued", 2)
        with pytest.raises(Overloaded):
            submit(e, "one too many", 2)
        with pytest.raises(InputRejected, match="KV-cache budget"):
            e.submit([1] * 10, 41)
        with pytest.raises(InputRejected, match="context"):
            e.submit([1] * 4000, 100)
        model.allow(5)
        await outcomes([a, b])
        assert e.counters.rejected_overload == 1
        await e.stop()

    asyncio.run(main())


def test_drain_finishes_the_work_then_refuses() -> None:
    model = parse_synthetic_gen("synthetic-gen:1+1")

    async def main() -> list[Any]:
        e = engine("gen-continuous", model, max_batch_size=4)
        e.start()
        seqs = [submit(e, f"p {i}", 5) for i in range(10)]
        await e.drain(10)
        with pytest.raises(ShuttingDown):
            submit(e, "late", 2)
        await e.stop()
        return await outcomes(seqs)

    out = asyncio.run(main())
    assert all(isinstance(s, Seq) and len(s.tokens) == 5 for s in out)


def test_drain_past_its_grace_cuts_the_running_and_the_queued() -> None:
    model = SteppedGen()

    async def main() -> list[Any]:
        e = engine("gen-continuous", model, max_batch_size=1)
        e.start()
        seqs = [submit(e, "long", 50), submit(e, "queued", 5)]
        await asyncio.to_thread(model.wait_entered)
        await e.drain(0.05)
        model.allow(100)
        out = await outcomes(seqs)
        await e.stop()
        return out

    out = asyncio.run(main())
    assert all(isinstance(o, ShuttingDown) for o in out)
    assert model.cached == 0


def failing_decodes(error: BaseException, times: float = float("inf")) -> SyntheticGen:
    """A synthetic generator whose first ``times`` decode steps raise ``error`` (prefills run)."""
    model = SyntheticGen(0, 0)
    real_forward, left = model.forward, [times]

    def forward(chunks: list[Any]) -> list[Any]:
        if all(c.decode for c in chunks) and left[0] > 0:
            left[0] -= 1
            raise error
        return real_forward(chunks)

    model.forward = forward  # type: ignore[method-assign]
    return model


@pytest.mark.parametrize("times", [1, 3])
def test_a_failed_decode_step_is_bisected_and_the_engine_goes_on(times: int) -> None:
    # once: the halves are retried and both finish; three times (the step, then each alone): each fails alone
    model = failing_decodes(ModelError("step failed"), times=times)

    async def main() -> tuple[list[Any], Any]:
        e = engine("gen-continuous", model)
        e.start()
        first = await outcomes([submit(e, "a", 5), submit(e, "b", 5)])
        later = await outcomes([submit(e, "c", 3)])
        await e.stop()
        return first, later[0]

    first, later = asyncio.run(main())
    if times == 1:
        assert all(isinstance(o, Seq) and len(o.tokens) == 5 for o in first)
    else:
        assert all(isinstance(o, ModelError) for o in first)
    assert isinstance(later, Seq) and len(later.tokens) == 3
    assert model.cached == 0


def test_a_dead_model_thread_answers_everyone() -> None:
    model = failing_decodes(Crash("simulated hard fault"))

    async def main() -> tuple[list[Any], bool]:
        e = engine("gen-continuous", model)
        e.start()
        seqs = [submit(e, "a", 5), submit(e, "b", 5)]
        out = await outcomes(seqs)
        with pytest.raises(WorkerDied):
            submit(e, "c", 2)
        healthy = e.healthy
        await e.stop()
        return out, healthy

    out, healthy = asyncio.run(main())
    assert all(isinstance(o, WorkerDied) for o in out) and not healthy


def retained(root: Any) -> int:
    """Items held in every container reachable from ``root`` through labserver's own objects.

    Torch tensors and modules, tokenizers and the event loop's machinery are not followed
    (their size does not depend on how many requests were served); a list, dict, set or
    deque that grows with every request or every step shows up here.
    """
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset, deque)):
            total += len(obj)
            stack.extend(obj)
        elif isinstance(obj, dict):
            total += len(obj)
            stack.extend(obj.values())
        elif type(obj).__module__.startswith(("labserver", "tests")) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


@pytest.mark.parametrize("spec", ["synthetic", "gpt2-tiny-random"])
def test_a_long_run_retains_nothing_per_request_or_per_step(spec: str) -> None:
    """What an engine and its model hold after 60 requests is what they hold after 240 (the step log
    is capped at ``history``): nothing is kept per call, per step or per request."""
    from labserver.models import load_model

    model = SyntheticGen(0, 0) if spec == "synthetic" else load_model(spec, device="cpu")

    async def main() -> list[int]:
        e = StepEngine(make_strategy("gen-paged", Limits(max_batch_size=8, max_kv_tokens=512)), model,
                       history=50)  # type: ignore[arg-type]
        e.start()
        sizes = []
        for n in (60, 180):
            seqs = [submit(e, f"request {k} of {n} words", 4 + k % 9, ignore_eos=True) for k in range(n)]
            await outcomes(seqs)
            del seqs
            sizes.append(retained(e))
        await e.stop()
        return sizes

    after_60, after_240 = asyncio.run(main())
    # (a few items come and go: which step sizes were seen, which sequences the last 50 steps held)
    assert after_240 - after_60 < 60, (after_60, after_240)  # one item per extra request would be 180


class Logged(SyntheticGen):
    """A synthetic generator that logs each call as it begins (on the model thread)."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__(0, 0)
        self.log = log

    def forward(self, chunks: Any) -> Any:
        self.log.append(("call", len(self.log)))
        return super().forward(chunks)


def test_where_no_core_is_spare_the_tokens_are_written_before_the_next_call() -> None:
    """A reader two loop turns behind each token (as a route's stream is: woken, then writing) has seen every token
    before the call after the one that made it begins: the engine gives the loop its turns between the calls. (Beside
    the call, a reader runs only once the model thread has taken the next call.)"""
    log: list[tuple[str, int]] = []

    async def main() -> Seq:
        e = engine("gen-continuous", Logged(log), max_batch_size=4)
        e.flush_turns = 6  # (what a CPU with no core spare gets, on whatever machine runs this)
        e.start()
        seq = submit(e, "one stream", 12, ignore_eos=True)

        async def reader() -> None:
            while not seq.future.done():
                await seq.next_change()
                await asyncio.sleep(0)  # a second hop: the task that writes
                log.append(("seen", len(seq.tokens)))

        task = asyncio.create_task(reader())
        await seq.future
        await task
        await e.stop()
        return seq

    seq = asyncio.run(main())
    kinds = [kind for kind, _ in log]
    assert len(seq.tokens) == 12 and kinds.count("call") == 12  # a prefill call, then 11 decode calls
    calls = [i for i, kind in enumerate(kinds) if kind == "call"]
    for a, b in zip(calls, calls[1:]):
        assert "seen" in kinds[a + 1:b], log  # each call's token was read before the next call began
    assert [n for kind, n in log if kind == "seen"][:11] == list(range(1, 12))


def test_a_model_off_the_cpu_always_has_a_core_spare() -> None:
    from labserver.models import no_core_spare

    assert not no_core_spare("cuda:0") and not no_core_spare("mps")
