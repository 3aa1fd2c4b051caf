"""KV memory in the step engine, on a real event loop: preemption, prefix caching, chunked prefill, blocks given back.

Every comparison runs the same requests twice, once where the mechanism cannot act and
once where it must, and asks for the same tokens: memory management changes when tokens
are computed, never which.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest

from labserver.engine import Seq, StepEngine
from labserver.models import InputRejected, SyntheticGen, load_model
from labserver.strategies import Limits, make_strategy
from labserver.engine.ending import FinishReason

from .fakes import SteppedGen


def prompts(n: int, shared: int = 0) -> list[str]:
    """n prompts of 5-12 words; the first ``shared`` words are the same in all."""
    head = " ".join(f"common{i}" for i in range(shared))
    return [f"{head} " + " ".join(f"word{k}x{i}" for i in range(5 + k % 8)) for k in range(n)]


def serve(model: Any, texts: list[str], new: list[int], strategy: str = "gen-continuous",
          **limits: Any) -> tuple[list[Seq], dict[str, Any], list[dict[str, Any]]]:
    """Submit every text at once, await all; (sequences, /stats, step log)."""
    async def main() -> tuple[list[Seq], dict[str, Any], list[dict[str, Any]]]:
        e = StepEngine(make_strategy(strategy, Limits(**limits)), model)
        e.start()
        try:
            seqs = [e.submit(model.encode(t), n, ignore_eos=True) for t, n in zip(texts, new, strict=True)]
            await asyncio.gather(*(s.future for s in seqs))
            return seqs, e.stats(), e.step_log()
        finally:
            await e.stop()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("gpt2-tiny-random", device="cpu")


@pytest.mark.parametrize("spec", ["synthetic", "gpt2-tiny-random"])
def test_a_preempted_stream_gets_the_tokens_of_an_unpreempted_one(spec: str, tiny: Any) -> None:
    model = SyntheticGen(0, 0) if spec == "synthetic" else tiny
    texts, new = prompts(12), [30 + 7 * (k % 5) for k in range(12)]
    roomy, _, _ = serve(model, texts, new, max_batch_size=12)
    tight, stats, steps = serve(model, texts, new, "gen-paged", max_batch_size=12, max_kv_tokens=192,
                                kv_block_tokens=8)
    assert stats["preemptions"] >= 3 and any(s["preempted"] for s in steps)
    assert sum(s.preemptions for s in tight) == stats["preemptions"]
    assert [s.tokens for s in tight] == [s.tokens for s in roomy]  # none repeated, none lost, none changed
    assert stats["kv_blocks"]["used"] == 0 and model.cached == 0


def test_a_preempted_sequence_is_recomputed_over_what_it_already_sent() -> None:
    model = SyntheticGen(0, 0)
    seqs, stats, steps = serve(model, prompts(6), [40] * 6, "gen-paged", max_kv_tokens=96, kv_block_tokens=8)
    victim = next(s for s in seqs if s.preemptions)
    cut = next(i for i, st in enumerate(steps) if victim.sid in st["preempted"])
    back = next(st for st in steps[cut:] if victim.sid in st["seqs"])  # its next call: the recompute
    assert not back["decoding"] and back["tokens"] > len(victim.prompt_ids)  # prompt + tokens sent so far
    assert stats["recomputed_tokens"] >= back["tokens"]
    assert victim.cached_tokens == 0 and victim.finish_reason is FinishReason.LENGTH and len(victim.tokens) == 40


def test_a_preempted_sequence_the_prefix_cache_restores_to_its_last_token_is_prefilled_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of 2: a sequence preempted with an odd context finds every position but its last one in
    # the cache; under chunked prefill it must still go through a prefill call (the model has not seen it
    # since it was released), not into the next decode step
    from labserver.engine.blocks import BlockManager

    restored: list[int] = []
    start = BlockManager.start

    def watch(self: BlockManager, owner: int, tokens: list[int], salt: str = "") -> int:
        hit = start(self, owner, tokens, salt)
        if hit == len(tokens) - 1 and hit > 0:
            restored.append(owner)
        return hit

    monkeypatch.setattr(BlockManager, "start", watch)
    model = SyntheticGen(0, 0)
    texts, new = prompts(12), [12, 40, 8, 20, 11, 35, 32, 34, 28, 17, 10, 35]
    roomy, _, _ = serve(model, texts, new, max_batch_size=8)
    restored.clear()
    tight, stats, steps = serve(model, texts, new, "gen-paged", max_batch_size=8, max_kv_tokens=80,
                                kv_block_tokens=2, prefix_cache=True, prefill="chunked", max_step_tokens=12)
    assert restored and stats["preemptions"] > 0
    assert [s.tokens for s in tight] == [s.tokens for s in roomy] and stats["items_failed"] == 0
    for i, st in enumerate(steps):  # every preempted sequence's next call prefills it
        for sid in st["preempted"]:
            back = next(later for later in steps[i + 1:] if sid in later["seqs"])
            assert sid in back["prefilling"], (sid, back)
    assert model.cached == 0


def test_a_shared_prefix_is_computed_once_and_changes_no_token(tiny: Any) -> None:
    texts, new = prompts(8, shared=40), [12] * 8
    plain, off, _ = serve(tiny, texts, new, max_batch_size=2)  # two at a time: the later ones find a cache
    cached, on, steps = serve(tiny, texts, new, max_batch_size=2, prefix_cache=True)
    assert [s.tokens for s in cached] == [s.tokens for s in plain]
    assert off["cached_tokens"] == 0 and all(s.cached_tokens == 0 for s in plain)
    ids = [tiny.encode(t) for t in texts]
    common = next(i for i in range(len(ids[0])) if len({p[i] for p in ids}) > 1)  # tokens all prompts share
    assert common >= 48 and all(s.cached_tokens == common // 16 * 16 for s in cached[2:])  # whole blocks of 16
    assert on["cached_tokens"] == sum(s.cached_tokens for s in cached)
    later = [st for st in steps if not st["decoding"]][1:]  # prefill calls
    assert all(st["tokens"] <= sum(len(p) for p in ids[:2]) - 2 * 48 for st in later)  # only what was not cached
    assert on["kv_blocks"]["used"] == 0 and on["kv_blocks"]["cached"] > 0  # kept for the next prompt


@pytest.mark.parametrize("strategy", ["gen-continuous", "gen-paged"])
def test_chunked_prefill_changes_no_token_and_keeps_the_step_budget(strategy: str, tiny: Any) -> None:
    texts = prompts(5) + ["long " + " ".join(f"w{i}" for i in range(150))]
    new = [40] * 5 + [10]
    eager, _, _ = serve(tiny, texts, new, strategy, max_batch_size=8)
    chunked, _, steps = serve(tiny, texts, new, strategy, max_batch_size=8, prefill="chunked", max_step_tokens=24)
    assert [s.tokens for s in chunked] == [s.tokens for s in eager]
    assert max(st["tokens"] for st in steps) <= 24
    long = chunked[-1]
    pieces = [st for st in steps if long.sid in st["prefilling"]]
    assert len(pieces) >= 150 // 24 and any(st["decoding"] for st in pieces)  # beside running decodes


class ChunkSizes:
    """Any generator, with the number of tokens in each chunk it was given logged."""

    def __init__(self, model: Any) -> None:
        self.inner, self.sizes = model, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        self.sizes += [len(c.tokens) for c in chunks]
        return self.inner.forward(chunks)


def test_a_preempted_answer_is_recomputed_in_chunks_of_the_planned_size_under_chunked_prefill() -> None:
    """Recomputed after preemption, a sequence's context is its prompt and the answer it had sent: a chunk that
    ends inside the prompt holds prompt tokens only, however long that answer. (Such a chunk once took answer tokens
    too: 44 where 10 were planned, here; the answers stayed exact only because later chunks wrote those positions
    again.)"""
    model = ChunkSizes(SyntheticGen(0, 0))
    texts, new = [" ".join(f"w{k}x{i}" for i in range(6)) for k in range(8)], [60] * 8
    roomy, _, _ = serve(SyntheticGen(0, 0), texts, new, max_batch_size=8)
    tight, stats, steps = serve(model, texts, new, "gen-paged", max_batch_size=8, max_kv_tokens=320,
                                kv_block_tokens=8, prefill="chunked", max_step_tokens=12)
    assert stats["preemptions"] >= 2 and any(len(s.prompt_ids) < 60 for s in tight)
    assert [s.tokens for s in tight] == [s.tokens for s in roomy]
    assert sum(model.sizes) == sum(st["tokens"] for st in steps)  # what the model computed is what was planned
    assert max(st["tokens"] for st in steps) <= 12


def test_only_sequences_with_the_same_salt_share_prefix_blocks(tiny: Any) -> None:
    """One prompt under salts a, b, a, then a's n = 2 choices and b's again: a hit only under the salt that
    computed it, the choices share (a fork keeps the salt), and the tokens are the unsalted ones."""
    ids = tiny.encode(prompts(1, shared=40)[0])

    async def main() -> tuple[list[Seq], dict[str, Any], Any]:
        e = StepEngine(make_strategy("gen-continuous", Limits(prefix_cache=True)), tiny)
        e.start()
        try:
            seqs = []
            for salt in ("a", "b", "a", ""):
                seqs.append(e.submit(ids, 6, ignore_eos=True, cache_salt=salt))
                await seqs[-1].future
            first = e.submit(ids, 6, ignore_eos=True, cache_salt="b")
            second = e.submit(ids, 6, ignore_eos=True, cache_salt="b", parent=first)
            await asyncio.gather(first.future, second.future)
            return [*seqs, first, second], e.stats(), e.blocks
        finally:
            await e.stop()

    seqs, stats, blocks = asyncio.run(main())
    whole = (len(ids) - 1) // 16 * 16
    assert [s.cached_tokens for s in seqs[:4]] == [0, 0, whole, 0]  # "": no salt, its own cache
    assert seqs[4].cached_tokens == whole and stats["shared_tokens"] == whole  # b's blocks, then a fork of them
    assert all(s.tokens == seqs[3].tokens for s in seqs)
    blocks.check()


def test_a_client_that_leaves_gives_its_blocks_back() -> None:
    model = SteppedGen()

    async def main() -> tuple[int, int, int]:
        e = StepEngine(make_strategy("gen-paged", Limits(kv_block_tokens=4)), model)  # type: ignore[arg-type]
        e.start()
        a = e.submit(model.encode("one two three four five"), 100)
        b = e.submit(model.encode("six seven"), 3)
        await asyncio.to_thread(model.wait_entered)
        both = e.blocks.used
        a.future.cancel()  # the client leaves in the middle of a step
        model.allow(3)
        await b.future
        await asyncio.to_thread(model.wait_entered)  # a's next step would be this one; it was dropped first
        after_b = e.blocks.used
        model.allow(10)
        await e.stop()
        return both, after_b, e.blocks.used

    both, after_b, end = asyncio.run(main())
    assert both == 2 + 1 and after_b == 0 and end == 0  # a: 5 prompt tokens + 1 = 2 blocks of 4; b: 3 tokens
    assert model.cached == 0


def test_eos_stand_in_ends_answers_early_seeded_per_request() -> None:
    model = SyntheticGen(0, 0)
    texts = prompts(40)
    seqs, stats, _ = serve(model, texts, [512] * 40, max_batch_size=40, eos_prob=1 / 32)
    lengths = [len(s.tokens) for s in seqs]
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)  # ignore_eos: the stand-in is EOS, ignored too

    async def main() -> list[int]:
        e = StepEngine(make_strategy("gen-continuous", Limits(max_batch_size=40, eos_prob=1 / 32)), model)
        e.start()
        try:
            out = [e.submit(model.encode(t), 512) for t in texts + texts[:5]]
            await asyncio.gather(*(s.future for s in out))
            return [len(s.tokens) for s in out]
        finally:
            await e.stop()

    ended = asyncio.run(main())
    assert lengths == [512] * 40
    assert 16 < statistics.mean(ended) < 64 and len(set(ended)) > 10  # geometric, mean ~32
    assert ended[40:] == ended[:5]  # the same request ends at the same token: a stand-in for a model's choice


def test_a_request_larger_than_the_pool_is_refused_at_the_door() -> None:
    async def main() -> None:
        e = StepEngine(make_strategy("gen-paged", Limits(max_kv_tokens=100, kv_block_tokens=16)), SyntheticGen(0, 0))
        e.start()
        try:
            with pytest.raises(InputRejected, match="96"):  # 6 blocks of 16
                e.submit([1] * 10, 87)  # 97 tokens: 7 blocks
            e.submit([1] * 10, 86)
        finally:
            await e.stop()

    asyncio.run(main())


def test_the_pool_is_sized_from_tokens_bytes_or_the_context() -> None:
    from labserver.cli import build_parser
    from labserver.cli.args import limits_from
    from labserver.engine.step import kv_budget_tokens
    from labserver.models import ModelLoadError

    model = SyntheticGen(0, 0, max_context=512, kv_bytes_per_token=1024)
    assert kv_budget_tokens(Limits(kv_memory_mb=2), model) == 2048  # 2 MiB / 1 KiB a position
    assert kv_budget_tokens(Limits(kv_memory_mb=2, max_kv_tokens=1000), model) == 1000  # the smaller
    assert kv_budget_tokens(Limits(max_kv_tokens=3000), model) == 3000
    assert kv_budget_tokens(Limits(max_batch_size=8), model) == 8 * 512  # neither: cap x context
    assert kv_budget_tokens(Limits(max_batch_size=None), SyntheticGen(0, 0, max_context=131_072)) == 64 * 2048
    with pytest.raises(ModelLoadError, match="less than one block"):
        kv_budget_tokens(Limits(kv_memory_mb=0.01), model)  # 10 positions
    with pytest.raises(ModelLoadError, match="max_kv_tokens"):
        kv_budget_tokens(Limits(kv_memory_mb=2), SyntheticGen(0, 0))  # says nothing of its bytes
    with pytest.raises(ValueError, match="kv_memory_mb"):
        Limits(kv_memory_mb=0)
    args = build_parser().parse_args(["serve", "--strategy", "gen-paged", "--kv-memory-mb", "1.5"])
    assert limits_from(args).kv_memory_mb == 1.5


def test_chunked_prefill_needs_a_rule_that_joins_every_step() -> None:
    with pytest.raises(ValueError, match="chunked"):
        StepEngine(make_strategy("gen-static", Limits(prefill="chunked")), SyntheticGen(0, 0))
    with pytest.raises(ValueError, match="max_step_tokens"):
        Limits(prefill="chunked", max_batch_size=32, max_step_tokens=32)


@pytest.mark.parametrize("strategy, shares", [("gen-continuous", True), ("gen-static", False)])
def test_n_choices_share_the_first_ones_computed_prompt_blocks(strategy: str, shares: bool) -> None:
    """Choices 2..n of one prompt wait a step, then start with the first's whole prompt blocks (a fork) and compute
    only the rest; a static batch, which nobody joins mid-way, computes each choice's prompt beside the others."""
    async def main() -> tuple[Seq, list[Seq], dict[str, Any], list[dict[str, Any]], Any]:
        e = StepEngine(make_strategy(strategy, Limits(max_batch_size=8, kv_block_tokens=4)), SyntheticGen(0, 0))
        e.start()
        try:
            ids = list(range(1, 12))  # 11 prompt tokens: two whole blocks before the last one
            first = e.submit(ids, 5, ignore_eos=True)
            others = [e.submit(ids, 5, ignore_eos=True, parent=first) for _ in range(3)]
            await asyncio.gather(*(s.future for s in (first, *others)))
            return first, others, e.stats(), e.step_log(), e.blocks
        finally:
            await e.stop()

    first, others, stats, steps, blocks = asyncio.run(main())
    assert all(o.tokens == first.tokens for o in others)  # greedy: the same answer, however it was computed
    prefilled = [s for s in steps if s["prefilling"]]
    if shares:
        assert stats["shared_tokens"] == 3 * 8 and stats["cached_tokens"] == 0
        assert prefilled[0]["prefilling"] == (first.sid,) and prefilled[0]["tokens"] == 11  # the first, alone
        assert sum(s["tokens"] for s in prefilled[1:]) == 3 * 3  # then 3 tokens each: 8 shared of 11
    else:
        assert stats["shared_tokens"] == 0 and prefilled[0]["tokens"] == 4 * 11
    blocks.check()
    assert stats["kv_blocks"]["used"] == 0
