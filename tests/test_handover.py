"""A sequence's KV handed from one step engine to another (``labserver.engine.handover``), without Ray.

Two engines on one event loop play a prefill replica and a decode replica: the prefill
engine computes the prompt and first token and its connector (``HandoverConnector``) parks the
blocks; ``pull`` copies the KV out and gives the blocks back; the decode engine admits the
sequence with its KV and decodes on.
Every answer is compared with the same request answered by one engine alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from labserver.engine import StepEngine
from labserver.engine import FinishReason
from labserver.engine.base import ReplicaLost
from labserver.engine.handover import HandoverConnector
from labserver.models import Sampling, SyntheticGen, load_model
from labserver.strategies import Limits, make_strategy

PROMPTS = ["a b c d e f g h i j k", "a b c d e f g h z z", "q w e r t y", "a b c d e f g h i j k"]


def engines(make: Any, n: int = 3, strategy: str = "gen-continuous", **limits: Any) -> list[StepEngine]:
    """n engines, each over a model ``make()`` returns; the first two (prefill, decode) with a HandoverConnector,
    a third (one engine alone) with none."""
    out = [StepEngine(make_strategy(strategy, Limits(**limits)), make()) for _ in range(n)]
    for e in out[:2]:
        e.connect(HandoverConnector(e))
    return out


@contextlib.asynccontextmanager
async def started(*engines: StepEngine) -> AsyncIterator[None]:
    """The engines' workers running for the block, stopped after it."""
    for e in engines:
        e.start()
    try:
        yield
    finally:
        for e in engines:
            await e.stop()


def synthetic() -> SyntheticGen:
    return SyntheticGen(0, 0)


async def through(prefill: StepEngine, decode: StepEngine, ids: list[int], n: int, **kw: Any) -> Any:
    """One request the disaggregated way: prefill, pull, then decode from the handed-over KV."""
    first = await prefill.submit(ids, n, remote_decode=True, **kw).future
    if first.finish_reason is not FinishReason.HAND_OVER:
        return first
    handed = await prefill.connector.pull(first.sid)
    return await decode.submit(ids, n, kv_transfer=handed, **kw).future


def test_handed_over_sequences_answer_as_one_engine_does_and_leave_no_block_behind() -> None:
    async def main() -> None:
        prefill, decode, alone = engines(synthetic, max_batch_size=8, prefix_cache=True, kv_block_tokens=4)
        async with started(prefill, decode, alone):
            for text in PROMPTS:
                ids = prefill.model.encode(text)
                ref = await alone.submit(ids, 12, ignore_eos=True).future
                parked = await prefill.submit(ids, 12, ignore_eos=True, remote_decode=True).future
                assert parked.finish_reason is FinishReason.HAND_OVER and len(parked.tokens) == 1
                assert prefill.stats()["kv_parked"] == 1 and prefill.blocks.used > 0  # held for the pull
                handed = await prefill.connector.pull(parked.sid)
                assert prefill.blocks.used == 0 and handed.positions == len(ids)
                out = await decode.submit(ids, 12, ignore_eos=True, kv_transfer=handed).future
                assert out.tokens == ref.tokens and out.finish_reason is FinishReason.LENGTH
            stats = decode.stats()
            # the fourth prompt is the first again, and the second shares 8 tokens with it: the decode side's
            # prefix cache held them, so those positions were not written again
            assert stats["kv_handed_in"] == 4 and stats["cached_tokens"] == 8 + 8
            assert stats["kv_imported_tokens"] == sum(len(t.split()) for t in PROMPTS) - 16
            assert prefill.stats()["kv_handed_out"] == 4 and stats["prefill_calls"] == 0  # nothing prefilled there
            for e in (prefill, decode):
                e.blocks.check()
                assert e.blocks.used == 0

    asyncio.run(main())


def test_a_first_token_that_ends_the_answer_is_not_parked() -> None:
    async def main() -> None:
        prefill, _ = engines(lambda: SyntheticGen(0, 0, eos_after=1), 2)
        async with started(prefill):
            ids = prefill.model.encode("one two three")
            eos = await prefill.submit(ids, 8, remote_decode=True).future
            one = await prefill.submit(ids, 1, remote_decode=True, ignore_eos=True).future
            assert (eos.finish_reason, one.finish_reason) == (FinishReason.EOS, FinishReason.LENGTH)
            assert len(prefill.connector.parking) == 0 and prefill.blocks.used == 0

    asyncio.run(main())


def test_kv_never_pulled_is_freed_after_the_timeout_and_a_late_pull_is_refused() -> None:
    async def main() -> None:
        (prefill,) = engines(synthetic, 1, handover_timeout_s=0.05)
        async with started(prefill):
            seq = await prefill.submit(prefill.model.encode("x y z"), 5, remote_decode=True, ignore_eos=True).future
            assert prefill.blocks.used == 1
            expired = asyncio.get_running_loop().create_future()
            connector = prefill.connector
            connector.parking.expired = lambda s: (connector._expired(s), expired.set_result(s))
            assert await asyncio.wait_for(expired, 5) is seq
            assert prefill.blocks.used == 0 and prefill.stats()["kv_handed_expired"] == 1
            with pytest.raises(ReplicaLost, match="no longer holds"):
                await prefill.connector.pull(seq.sid)

    asyncio.run(main())


def test_a_pull_is_served_once() -> None:
    async def main() -> None:
        (prefill,) = engines(synthetic, 1)
        async with started(prefill):
            seq = await prefill.submit(prefill.model.encode("x y z"), 5, remote_decode=True, ignore_eos=True).future
            await prefill.connector.pull(seq.sid)
            with pytest.raises(ReplicaLost):
                await prefill.connector.pull(seq.sid)

    asyncio.run(main())


def test_a_handed_over_sequence_preempted_on_the_decode_side_is_recomputed_and_loses_nothing() -> None:
    """A decode pool (paged: blocks as they are needed) with room for two of three sequences at their full
    length: one is preempted and recomputed from its tokens, not from the hand-over (used once)."""
    async def main() -> None:
        prefill, decode, alone = engines(lambda: SyntheticGen(0, 1), strategy="gen-paged", max_batch_size=3,
                                         max_kv_tokens=48, kv_block_tokens=4)
        async with started(prefill, decode, alone):
            prompts = [prefill.model.encode(f"p{k} a b c d e") for k in range(3)]
            refs = await asyncio.gather(*(alone.submit(ids, 16, ignore_eos=True).future for ids in prompts))
            outs = await asyncio.gather(*(through(prefill, decode, ids, 16, ignore_eos=True) for ids in prompts))
            assert [o.tokens for o in outs] == [r.tokens for r in refs]
            assert decode.stats()["preemptions"] >= 1 and decode.stats()["recomputed_tokens"] > 0
            decode.blocks.check()
            assert decode.blocks.used == 0 and prefill.blocks.used == 0

    asyncio.run(main())


def test_a_hand_over_that_does_not_fit_the_decode_model_fails_alone() -> None:
    async def main() -> None:
        prefill, decode = engines(synthetic, 2, max_batch_size=4)
        async with started(prefill, decode):
            ids = prefill.model.encode("a b c d e f")
            parked = await prefill.submit(ids, 6, remote_decode=True, ignore_eos=True).future
            handed = await prefill.connector.pull(parked.sid)
            short = type(handed)(handed.first, handed.positions, handed.kv[:2])  # (a copy of 2 positions, not 6)
            bad = decode.submit(ids, 6, kv_transfer=short, ignore_eos=True)
            good = decode.submit(prefill.model.encode("g h i"), 4, ignore_eos=True)
            with pytest.raises(Exception, match="does not fit"):
                await bad.future
            assert len((await good.future).tokens) == 4
            decode.blocks.check()
            assert decode.blocks.used == 0

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # (Ray's own)
def test_disaggregate_is_refused_before_ray_starts_where_it_cannot_work() -> None:
    """gen-hf-cb (transformers' manager keeps its own cache), an encoder strategy, both pool options at once,
    or an empty pool: a ValueError that says why, before any Ray starts."""
    from labserver.config import ServerConfig
    from labserver.replicas import serve_replicas

    ray = pytest.importorskip("ray")
    for strategy, replicas, pools, says in (("gen-hf-cb", None, (1, 1), "gen-hf-cb"),
                                            ("gen-continuous", 2, (1, 1), "not both"),
                                            ("gen-continuous", None, (0, 1), "at least one prefill"),
                                            ("deadline", None, (1, 1), "encoder")):
        config = ServerConfig(strategy=strategy, model="synthetic-gen:1+1" if strategy != "deadline" else "synthetic")
        with pytest.raises(ValueError, match=says):
            serve_replicas(config, replicas, disaggregate=pools)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    """Two copies of the real model: a prefill replica's and a decode replica's."""
    return load_model("smollm2", device="cpu"), load_model("smollm2", device="cpu")


def test_smollm2_handed_over_answers_as_one_engine_with_logprobs_seeds_and_stop_strings(smollm2: Any) -> None:
    """The real model: the KV copied from one model's pool to another's gives the same greedy tokens and
    log-probabilities as one engine alone; seeded draws and a stop string too; a prompt the decode side has seen
    is found in its prefix cache, and those positions are not written again."""
    model_p, model_d = smollm2
    kw = dict(max_batch_size=4, prefix_cache=True, kv_block_tokens=16, max_kv_tokens=2048)
    ids = model_p.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")
    asks = [(Sampling(temperature=0.0, logprobs=2), ()), (Sampling(temperature=0.8, seed=7), ()), (None, (".",))]

    async def alone() -> list[Any]:
        (e,) = engines(lambda: model_p, 1, **kw)
        async with started(e):
            return [await e.submit(ids, 12, sampling=s, stop=stop, ignore_eos=True).future for s, stop in asks]

    async def disaggregated() -> list[Any]:
        prefill = StepEngine(make_strategy("gen-continuous", Limits(**kw)), model_p)
        decode = StepEngine(make_strategy("gen-continuous", Limits(**kw)), model_d)
        for e in (prefill, decode):
            e.connect(HandoverConnector(e))
        async with started(prefill, decode):
            outs = [await through(prefill, decode, ids, 12, sampling=s, stop=stop, ignore_eos=True)
                    for s, stop in asks]
            assert decode.stats()["cached_tokens"] >= 2 * 16 and decode.stats()["prefill_calls"] == 0
            assert decode.stats()["kv_imported_tokens"] == len(ids) + 2 * (len(ids) - len(ids) // 16 * 16)
            for e in (prefill, decode):
                e.blocks.check()
                assert e.blocks.used == 0
            return outs

    refs, outs = asyncio.run(alone()), asyncio.run(disaggregated())
    for ref, out in zip(refs, outs, strict=True):
        assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason
    assert refs[2].finish_reason is FinishReason.STOP
    assert [lp.token for lp in outs[0].logprobs] == outs[0].tokens
    assert [round(lp.logprob, 4) for lp in outs[0].logprobs] == [round(lp.logprob, 4) for lp in refs[0].logprobs]


def test_the_shell_refuses_both_pool_flags_and_a_bad_split(capsys: pytest.CaptureFixture[str]) -> None:
    from labserver.cli import main

    assert main(["serve", "--strategy", "gen-continuous", "--model", "synthetic-gen:1+1", "--replicas", "2",
                 "--disaggregate", "1:1"]) == 2
    assert "--disaggregate P:D replaces --replicas N" in capsys.readouterr().err
    for bad in ("1", "0:1", "1:x", "2:-1"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--strategy", "gen-continuous", "--disaggregate", bad])
        assert exit_.value.code == 2
        assert "give P:D, prefill and decode replicas, each at least 1" in capsys.readouterr().err
