"""transformers' ContinuousBatchingManager behind HFManager, on gpt2-tiny-random (CPU, real threads)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from labserver.models.gpt2 import GPT2Gen, gpt2_random
from labserver.engine.hfcb import PAGE_TOKENS, HFManager
from labserver.models import ModelError
from labserver.models.base import generate_alone
from labserver.engine.ending import FinishReason

WAIT_S = 30.0  # bound on every wait for the manager's thread (it normally takes well under a second)


class Sink:
    """One request's callbacks, as the manager's reader thread calls them."""

    def __init__(self, progress_at: int = 1) -> None:
        self.tokens: list[int] = []
        self.calls = 0  # on_tokens calls: more than one means it streamed
        self.reason: str | None = None
        self.error: Exception | None = None
        self.ended = threading.Event()
        self.progress = threading.Event()  # set once it has progress_at tokens
        self._progress_at = progress_at

    def on_tokens(self, tokens: list[int]) -> None:
        assert not self.ended.is_set(), "tokens after the end"
        self.tokens += tokens
        self.calls += 1
        if len(self.tokens) >= self._progress_at:
            self.progress.set()

    def on_done(self, reason: str) -> None:
        self.reason = reason
        self.ended.set()

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.ended.set()

    def callbacks(self) -> tuple:
        return self.on_tokens, self.on_done, self.on_error

    def wait(self) -> Sink:
        assert self.ended.wait(WAIT_S), "the request never ended"
        return self


@pytest.fixture(scope="module")
def gen() -> GPT2Gen:
    return gpt2_random(tiny=True, device="cpu")


@pytest.fixture
def manager(gen: GPT2Gen) -> Iterator[HFManager]:
    m = HFManager(gen, max_running=8, max_kv_tokens=4096)
    m.start()
    yield m
    m.stop()


def greedy(gen: GPT2Gen, ids: list[int], n: int, sid: int = 1) -> list[int]:
    """Our own forward pass's greedy tokens: the reference."""
    return generate_alone(gen, ids, n, sid=sid)


def manager_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "_run_generation_loop" in t.name or t.name == "hfcb-results"]


def test_caps_map_onto_the_config(gen: GPT2Gen) -> None:
    m = HFManager(gen, max_running=4, max_kv_tokens=1000)
    assert m.cb_config.max_requests_per_batch == 4
    assert m.cb_config.num_blocks == math.ceil(1000 / PAGE_TOKENS) and m.cb_config.page_size == PAGE_TOKENS
    assert m.cb_config.max_batch_tokens == gen.max_context  # any prompt fits one forward pass
    assert HFManager(gen, max_running=None, max_kv_tokens=None).kv_tokens >= 32 * gen.max_context
    with pytest.raises(ValueError, match="max_running"):
        HFManager(gen, max_running=0, max_kv_tokens=None)


def test_two_overlapping_requests_stream_greedy_tokens(gen: GPT2Gen, manager: HFManager) -> None:
    a_ids, b_ids = gen.encode("the first prompt"), gen.encode("a second prompt, somewhat longer than the first one")
    a, b = Sink(), Sink()
    manager.submit(1, a_ids, 12, True, *a.callbacks())
    manager.submit(2, b_ids, 30, True, *b.callbacks())
    a.wait(), b.wait()
    assert (a.error, b.error) == (None, None)
    assert (len(a.tokens), a.reason, len(b.tokens), b.reason) == (12, FinishReason.LENGTH, 30, FinishReason.LENGTH)
    assert a.calls > 1 and b.calls > 1  # streamed, not delivered at the end
    assert a.tokens == greedy(gen, a_ids, 12) and b.tokens == greedy(gen, b_ids, 30)  # same weights, same argmax
    assert manager.kv_tokens >= 4096


def test_eos_ends_a_request_unless_ignored(gen: GPT2Gen) -> None:
    ids = gen.encode("where does this one stop")
    reference = greedy(gen, ids, 12)
    eos = reference[5]  # pretend the 6th greedy token is EOS
    with_eos = SimpleNamespace(hf_model=gen.hf_model, eos_id=eos, eos_ids=(eos,), max_context=gen.max_context)
    m = HFManager(with_eos, max_running=4, max_kv_tokens=2048)  # type: ignore[arg-type]
    m.start()
    try:
        stops, ignores = Sink(), Sink()
        m.submit(1, ids, 12, False, *stops.callbacks())
        m.submit(2, ids, 12, True, *ignores.callbacks())
        stops.wait(), ignores.wait()
    finally:
        m.stop()
    assert stops.reason is FinishReason.EOS and stops.tokens == reference[:reference.index(eos) + 1]
    assert ignores.reason is FinishReason.LENGTH and ignores.tokens == reference


def test_a_prompt_near_the_context_is_cut_to_fit(gen: GPT2Gen, manager: HFManager) -> None:
    ids = [gen.tokenizer.cls_token_id, *range(2000, 2000 + gen.max_context - 4)]  # context - 3 tokens
    s = Sink()
    manager.submit(1, ids, 50, True, *s.callbacks())
    assert s.wait().reason is FinishReason.LENGTH and len(s.tokens) == 4  # not 50: positions run out
    too_long = Sink()
    manager.submit(2, ids * 2, 5, True, *too_long.callbacks())
    assert isinstance(too_long.wait().error, ValueError)  # InputRejected, at once


def test_a_request_larger_than_the_cache_is_refused_not_fatal(gen: GPT2Gen) -> None:
    m = HFManager(gen, max_running=4, max_kv_tokens=2 * PAGE_TOKENS)
    m.start()
    try:
        big, small = Sink(), Sink()
        m.submit(1, gen.encode("a prompt of a few words"), 100, True, *big.callbacks())
        assert isinstance(big.wait().error, ValueError) and "max_kv_tokens" in str(big.error)  # InputRejected
        m.submit(2, gen.encode("a prompt of a few words"), 20, True, *small.callbacks())
        assert small.wait().reason is FinishReason.LENGTH and m.alive  # (transformers itself would have stopped)
    finally:
        m.stop()


def test_cancel_stops_one_request_while_another_completes(gen: GPT2Gen, manager: HFManager) -> None:
    long, short = Sink(progress_at=5), Sink()
    manager.submit(1, gen.encode("a long one"), gen.max_context - 8, True, *long.callbacks())
    manager.submit(2, gen.encode("a short one"), 40, True, *short.callbacks())
    assert long.progress.wait(WAIT_S)
    manager.cancel(1)
    seen = len(long.tokens)
    assert short.wait().reason is FinishReason.LENGTH and len(short.tokens) == 40
    scheduler = manager.manager.batch_processor.scheduler  # transformers' own view: it stopped decoding it
    deadline = time.monotonic() + WAIT_S
    while "1" in scheduler.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "1" not in scheduler.active_requests
    assert len(long.tokens) == seen < gen.max_context - 8 and not long.ended.is_set()  # silent after cancel()
    manager.cancel(1)  # twice, or an unknown id: nothing happens
    manager.cancel(12345)


def test_stop_ends_the_threads_and_fails_what_is_in_flight(gen: GPT2Gen) -> None:
    m = HFManager(gen, max_running=4, max_kv_tokens=2048)
    m.start()
    assert m.alive and len(manager_threads()) == 2
    s = Sink(progress_at=2)
    m.submit(1, gen.encode("never finishes"), gen.max_context - 8, True, *s.callbacks())
    assert s.progress.wait(WAIT_S)
    m.stop()
    assert not m.alive and manager_threads() == []
    assert isinstance(s.wait().error, ModelError) and s.reason is None
    late = Sink()
    m.submit(2, gen.encode("too late"), 5, True, *late.callbacks())
    assert isinstance(late.wait().error, ModelError)
    m.stop()  # twice is fine


def test_gen_hf_cb_strategy_serves_through_the_engine(gen: GPT2Gen) -> None:
    """The one consumer: labserver's queue and bookkeeping in front, transformers' scheduler behind."""
    import asyncio

    from labserver.strategies import Limits
    from labserver.engine import make_engine
    from labserver.strategies import make_strategy

    prompts = [gen.encode(p) for p in ("one", "two words", "three words here", "and a fourth, longer prompt")]

    async def main() -> list[list[int]]:
        strategy = make_strategy("gen-hf-cb", Limits(max_batch_size=2, max_kv_tokens=2048))
        e = make_engine(strategy, gen)
        e.start()
        seqs = [e.submit(ids, 6 + i, ignore_eos=True) for i, ids in enumerate(prompts)]
        done = await asyncio.wait_for(asyncio.gather(*(s.future for s in seqs)), WAIT_S)
        await e.stop()
        return [s.tokens for s in done]

    tokens = asyncio.run(main())
    assert tokens == [greedy(gen, ids, 6 + i) for i, ids in enumerate(prompts)]
    assert manager_threads() == []
