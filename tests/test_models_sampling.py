"""Choosing tokens (labserver.models.sampling and the engine's stop / min_tokens): greedy, seeded, per position."""

from __future__ import annotations

import asyncio

import pytest
import torch

from labserver.engine import StepEngine
from labserver.models import GREEDY, Sampling, SyntheticGen, load_model
from labserver.models.sampling import choose
from labserver.strategies import Limits, make_strategy
from labserver.engine.ending import FinishReason


def scores(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_with_or_without_a_sampling() -> None:
    logits = scores()
    assert choose(logits, [5, 6, 7]) == logits.argmax(-1).tolist()
    assert choose(logits, [5, 6, 7], [GREEDY, None, Sampling(temperature=0)]) == logits.argmax(-1).tolist()


def test_a_seeded_draw_depends_on_the_position_only() -> None:
    row = scores(1)[0]
    hot = Sampling(temperature=1.5, seed=42)
    alone = [choose(row[None], [p], [hot])[0] for p in range(30)]
    batched = choose(row.expand(30, -1), list(range(30)), [hot] * 30)  # same rows in one batch
    assert alone == batched
    assert len(set(alone)) > 5  # it does sample: positions differ
    other = [choose(row[None], [p], [Sampling(temperature=1.5, seed=43)])[0] for p in range(30)]
    assert other != alone  # another seed, another draw


def test_top_p_keeps_only_the_likeliest_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0]])
    draws = {choose(logits, [p], [Sampling(temperature=1.0, top_p=0.5, seed=1)])[0] for p in range(50)}
    assert draws == {0}  # token 0 alone holds more than half the mass
    wider = {choose(logits, [p], [Sampling(temperature=1.0, top_p=0.99, seed=1)])[0] for p in range(200)}
    assert {0, 1} <= wider


def test_eos_is_never_chosen_before_eos_from() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 100.0  # EOS would win every time
    assert choose(logits, [4], [Sampling(eos_from=5)], eos_id=7) != [7]
    assert choose(logits, [5], [Sampling(eos_from=5)], eos_id=7) == [7]


def test_bad_sampling_values_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


def generate(model, prompt: str, n: int, **submit) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    """One sequence through a real step engine on its own loop: (tokens, finish reason)."""
    async def main() -> tuple[list[int], str]:
        engine = StepEngine(make_strategy("gen-continuous", Limits(max_batch_size=4)), model)
        engine.start()
        try:
            seq = engine.submit(model.encode(prompt), n, **submit)
            await seq.future
            return seq.tokens, seq.finish_reason
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_a_stop_string_ends_the_sequence_with_stop() -> None:
    model = SyntheticGen(0, 0)
    tokens, reason = generate(model, "a b c", 20)
    third = model.token_text(tokens[2]).strip()
    stopped, reason = generate(model, "a b c", 20, stop=[third])
    assert reason is FinishReason.STOP and stopped == tokens[:3]


def test_min_tokens_holds_eos_back() -> None:
    model = SyntheticGen(0, 0, eos_after=3)
    early, reason = generate(model, "a b", 20)
    assert reason is FinishReason.EOS and len(early) == 3 and early[-1] == model.eos_id
    late, reason = generate(model, "a b", 20, min_tokens=8)
    assert reason is FinishReason.EOS and len(late) == 9 and model.eos_id not in late[:8]


def test_gpt2_seeded_sampling_is_reproducible_and_greedy_unchanged() -> None:
    model = load_model("gpt2-tiny-random", device="cpu")
    greedy, _ = generate(model, "once upon a time", 12, ignore_eos=True)
    assert generate(model, "once upon a time", 12, ignore_eos=True, sampling=GREEDY)[0] == greedy
    hot = Sampling(temperature=1.0, top_p=0.9, seed=7)
    one, _ = generate(model, "once upon a time", 12, ignore_eos=True, sampling=hot)
    two, _ = generate(model, "once upon a time", 12, ignore_eos=True, sampling=hot)
    assert one == two and one != greedy
