"""Speculative decoding: guesses verified k + 1 at a time change no token, and sampled tokens keep their distribution.

The proposers (prompt lookup, a draft model), the rollback of rejected guesses in the block
pool, and the engine's books, on the synthetic model (a draft that is right two times in
three), on every family's tiny random folder, and on the real model (``smollm2``), where
greedy answers are checked against transformers'. The sampling rule is checked by a
chi-square test on a three-token Markov model whose exact distribution is known.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from labserver.engine import StepEngine
from labserver.engine.blocks import BlockManager
from labserver.engine.scheduler import Scheduler
from labserver.engine.speculation import DraftModel, ngram_guess
from labserver.models import Chunk, Sampling, Verified, load_model
from labserver.models.folders import FAMILIES
from labserver.models.sampling import choose
from labserver.models.synthetic import SyntheticGen
from labserver.strategies import Limits, make_strategy

from .test_engine_paged import prompts

# -- the proposer and the pool ------------------------------------------------------------------------------------


def test_prompt_lookup_takes_what_followed_the_latest_earlier_match_of_the_longest_suffix() -> None:
    context = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert ngram_guess(context, 3, 2, 4) == [2, 3, 6]  # [6, 7] last seen before the end at 6..7 -> 2, 3, 6
    assert ngram_guess([1, 2, 3, 9, 1, 2, 3, 4, 4, 1, 2, 3], 2, 2, 4) == [4, 4]  # [1, 2, 3]'s latest match wins
    assert ngram_guess([1, 2, 3, 4, 2, 3], 5, 2, 4) == [4, 2, 3]  # as many as followed, at most k
    assert ngram_guess([1, 2, 3, 4, 5], 4, 2, 4) == []  # nothing repeats
    assert ngram_guess([1, 2, 3, 4, 5, 5], 4, 2, 4) == []  # one token repeated is below the shortest suffix
    assert ngram_guess([1, 2, 3, 4, 5, 5], 4, 1, 4) == [5]
    assert ngram_guess([7, 7, 7, 7], 2, 2, 3) == [7]  # the match must be followed by a token of the context


def test_shrink_gives_back_the_tail_a_rejected_guess_took_and_keeps_the_books() -> None:
    blocks = BlockManager(10, 4, prefix_cache=True)
    blocks.start(1, ())
    assert blocks.grow(1, 14)  # 4 blocks: positions 0..13
    blocks.computed(1, list(range(14)), 9)  # two whole blocks computed: registered
    blocks.shrink(1, 10)
    assert len(blocks.tables[1]) == 3 and blocks.free == 7
    blocks.check()
    blocks.shrink(1, 12)  # nothing past what it holds
    assert len(blocks.tables[1]) == 3
    blocks.release(1)
    assert blocks.cached == 2 and blocks.free == 8
    blocks.check()


# -- the engine: nothing changes but how many steps it takes ------------------------------------------------------


class Erring(SyntheticGen):
    """The synthetic model's greedy tokens, except at every third position: a draft right two times in three."""

    def _token(self, chunk: Chunk, position: int, signature: int) -> int:
        token = super()._token(chunk, position, signature)
        return token + 1 if position % 3 == 0 else token


def run(model: Any, texts: list[str], new: list[int], strategy: str = "gen-continuous", draft: Any = None,
        sampling: Sampling | None = None, **limits: Any) -> tuple[list[Any], dict[str, Any], list[dict[str, Any]]]:
    """Submit every text at once, await all: (sequences, /stats, step log); ``draft`` a model that guesses."""
    async def main() -> tuple[list[Any], dict[str, Any], list[dict[str, Any]]]:
        if draft is not None:
            limits.update(speculative="draft", draft_model="(given)")
        e = StepEngine(make_strategy(strategy, Limits(**limits)), model)
        if draft is not None:
            e.spec.draft = DraftModel(draft, e.blocks.total, e.blocks.block_tokens)  # type: ignore[union-attr]
        e.start()
        try:
            await e.ready()
            seqs = [e.submit(model.encode(t), n, ignore_eos=True, sampling=sampling)
                    for t, n in zip(texts, new, strict=True)]
            await asyncio.gather(*(s.future for s in seqs))
            e.blocks.check()
            assert e.blocks.used == 0
            return seqs, e.stats(), e.step_log()
        finally:
            await e.stop()

    return asyncio.run(main())


def tokens(seqs: list[Any]) -> list[list[int]]:
    return [s.tokens for s in seqs]


def test_a_draft_right_two_times_in_three_changes_no_token_with_preemption_prefix_cache_and_chunks() -> None:
    model = SyntheticGen(0, 0)
    texts, new = prompts(10, shared=24), [20 + 7 * (k % 4) for k in range(10)]
    plain, _, _ = run(model, texts, new, max_batch_size=10)
    for strategy, limits in (("gen-continuous", {"max_batch_size": 10}),
                             ("gen-paged", {"max_batch_size": 10, "max_kv_tokens": 160, "kv_block_tokens": 8}),
                             ("gen-continuous", {"max_batch_size": 4, "prefix_cache": True, "kv_block_tokens": 8}),
                             ("gen-continuous", {"max_batch_size": 10, "prefill": "chunked", "max_step_tokens": 40})):
        guessed, stats, steps = run(model, texts, new, strategy, draft=Erring(0, 0), **limits)
        assert tokens(guessed) == tokens(plain), (strategy, limits)
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
        assert sum(st["accepted"] for st in steps) == stats["spec_accepted_tokens"]
        assert stats["tokens_generated"] == sum(new)
        if "max_kv_tokens" in limits:
            assert stats["preemptions"] > 0
        if limits.get("prefix_cache"):
            assert stats["cached_tokens"] > 0
    assert model.cached == 0


def test_a_verify_step_makes_up_to_k_plus_one_tokens_and_counts_them() -> None:
    model = SyntheticGen(0, 0)
    plain, _, plain_steps = run(model, prompts(1), [40])
    same, stats, steps = run(model, prompts(1), [40], draft=SyntheticGen(0, 0), num_speculative_tokens=4)
    assert tokens(same) == tokens(plain)
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0  # an exact draft: all kept
    assert stats["spec_accepted_histogram"] == {"4": stats["spec_drafts"] - 1, "3": 1}  # 40 = 1 + 7 x 5 + 4
    decodes = [st for st in steps if st["decoding"]]
    assert len(decodes) == 8 and len([st for st in plain_steps if st["decoding"]]) == 39
    assert max(st["tokens"] for st in decodes) == 5 and stats["spec_verify_ms"] >= 0 <= stats["spec_draft_ms"]


def test_the_gantt_shows_the_steps_that_verified_guesses(ax: Any) -> None:
    from labserver.plots import step_gantt

    _, _, steps = run(SyntheticGen(0, 0), prompts(3), [12, 12, 12], draft=Erring(0, 0), max_batch_size=3)
    assert any(st["verifying"] for st in steps)
    step_gantt(pd.DataFrame(steps), ax)
    assert "decode, verifying guesses" in [t.get_text() for t in ax.get_legend().get_texts()]
    _, _, plain = run(SyntheticGen(0, 0), prompts(3), [12, 12, 12], max_batch_size=3)
    ax.clear()
    step_gantt(pd.DataFrame(plain), ax)
    assert "decode, verifying guesses" not in [t.get_text() for t in ax.get_legend().get_texts()]


def test_speculation_is_off_above_the_batch_size_rule() -> None:
    model = SyntheticGen(0, 0)
    texts, new = prompts(6), [12] * 6
    _, busy, _ = run(model, texts, new, draft=SyntheticGen(0, 0), max_batch_size=6, speculative_disable_batch_size=5)
    _, quiet, _ = run(model, texts, new, draft=SyntheticGen(0, 0), max_batch_size=6, speculative_disable_batch_size=6)
    assert busy["spec_proposed_tokens"] == 0 and quiet["spec_proposed_tokens"] > 0


@pytest.fixture(scope="module")
def family_models(folders: dict[str, Path]) -> dict[str, Any]:
    return {family: load_model(str(folders[family]), device="cpu") for family in FAMILIES}


REPEATING = ["one two three four five six one two three four five six one two three",
             "red green blue red green blue red green", "a b c d a b c d a b c"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_changes_no_token_on_every_family(family: str, family_models: dict[str, Any]) -> None:
    model = family_models[family]
    texts, new = [*REPEATING, *prompts(3, shared=6)], [24, 30, 18, 24, 30, 18]
    plain, _, _ = run(model, texts, new, max_batch_size=6)
    for strategy, limits in (("gen-continuous", {"max_batch_size": 6}),
                             ("gen-paged", {"max_batch_size": 6, "max_kv_tokens": 128, "kv_block_tokens": 8}),
                             ("gen-continuous", {"max_batch_size": 6, "prefix_cache": True, "kv_block_tokens": 4,
                                                 "prefill": "chunked", "max_step_tokens": 16})):
        guessed, stats, _ = run(model, texts, new, strategy, speculative="ngram", **limits)
        assert tokens(guessed) == tokens(plain), (family, strategy, limits)
        assert stats["spec_accepted_tokens"] > 0, stats  # (random weights repeat themselves: guesses that hold)
    assert model.cached == 0


def test_log_probabilities_come_with_every_token_a_verification_makes(family_models: dict[str, Any]) -> None:
    model = family_models["llama"]
    asked = Sampling(logprobs=2)
    plain, _, _ = run(model, REPEATING, [20, 20, 20], sampling=asked, max_batch_size=3)
    guessed, stats, _ = run(model, REPEATING, [20, 20, 20], sampling=asked, speculative="ngram", max_batch_size=3)
    assert stats["spec_accepted_tokens"] > 0 and tokens(guessed) == tokens(plain)
    for a, b in zip(plain, guessed, strict=True):
        assert [lp.token for lp in b.logprobs] == b.tokens and len(b.logprobs) == 20
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in b.logprobs] == [[t for t, _ in lp.top] for lp in a.logprobs]


# -- sampling: the target's distribution, whatever was guessed ------------------------------------------------------

VOCAB = 3
CHAIN = torch.tensor([[0.2, 0.5, 0.3], [0.3, 0.2, 0.5], [0.5, 0.3, 0.2]])  # P(next | token): mostly 0 -> 1 -> 2 -> 0


class Markov(SyntheticGen):
    """A model over three tokens whose next token depends on the last one only (``CHAIN``), sampled as the real
    models sample (``labserver.models.sampling.choose`` on log-probabilities)."""

    def forward(self, chunks: list[Chunk]) -> list[Any]:
        super().forward(chunks)  # (the books: live sequences, blocks checked)
        out: list[Any] = []
        for c in chunks:
            rows = list(c.tokens[len(c.tokens) - 1 - c.draft:])
            picks = choose(CHAIN[rows].log(), list(range(c.end - c.draft, c.end + 1)), [c.sampling] * len(rows))
            out.append(Verified(tuple(picks)) if c.draft else picks[0] if c.sample else None)
        return out

    def encode(self, prompt: str) -> list[int]:
        return [int(w) for w in prompt.split()]


def chi_square_holds(seen: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> bool:
    """Goodness of fit at the 0.1 % level: the statistic under the chi-square quantile (Wilson-Hilferty's
    approximation, z = 3.09), cells expecting fewer than 5 pooled into one."""
    n = sum(seen.values())
    big = [k for k, p in expected.items() if p * n >= 5]
    cells = [(seen[k], expected[k] * n) for k in big]
    rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
    if rest[1] > 0:
        cells.append(rest)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat < df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("rule", ["kept while equal", "every guess kept (wrong)"])
def test_sampled_tokens_keep_the_models_distribution(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """4,000 answers of three tokens after ``0 1 2 0 1`` (prompt lookup guesses ``2 0 1``), sampled at temperature 1:
    the joint distribution of the three is the chain's, by a chi-square test; a rule that kept every guess fails it."""
    if rule != "kept while equal":
        wrong = Scheduler._verified

        def keep_all(self: Any, seq: Any, guess: Any, out: Verified, now: float) -> Any:
            return wrong(self, seq, guess, Verified((*guess, out.tokens[-1])), now)

        monkeypatch.setattr(Scheduler, "_verified", keep_all)
    torch.manual_seed(0)
    random.seed(0)
    n = 4000
    seqs, stats, _ = run(Markov(0, 0, eos_id=None), ["0 1 2 0 1"] * n, [3] * n, sampling=Sampling(temperature=1.0),
                         speculative="ngram", num_speculative_tokens=2, max_batch_size=256, max_kv_tokens=256 * 16)
    seen = Counter(tuple(s.tokens) for s in seqs)
    expected = {(a, b, c): float(CHAIN[1, a] * CHAIN[a, b] * CHAIN[b, c])
                for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)}
    assert stats["spec_accepted_tokens"] > 0.2 * stats["spec_proposed_tokens"] > 0
    assert chi_square_holds(seen, expected) == (rule == "kept while equal"), seen.most_common(5)


def test_a_seeded_request_draws_the_same_tokens_with_and_without_guesses() -> None:
    model = Markov(0, 0, eos_id=None)
    texts = ["0 1 2 0 1 2 0 1"] * 40
    seeded = [Sampling(temperature=1.0, seed=s) for s in range(40)]

    async def main(spec: dict[str, Any]) -> list[list[int]]:
        e = StepEngine(make_strategy("gen-continuous", Limits(max_batch_size=40, **spec)), model)
        e.start()
        try:
            seqs = [e.submit(model.encode(t), 12, ignore_eos=True, sampling=s) for t, s in zip(texts, seeded)]
            await asyncio.gather(*(s.future for s in seqs))
            return tokens(seqs)
        finally:
            await e.stop()

    assert asyncio.run(main({})) == asyncio.run(main({"speculative": "ngram"}))


# -- the real model: exact against transformers, and counted where everything is counted -----------------------------

def test_smollm2_with_prompt_lookup_answers_as_transformers_and_counts_its_guesses() -> None:
    """Three input-grounded chat prompts x 48 greedy tokens, all at once, through a server with ``--speculative
    ngram``: transformers' argmax at every position (or a near-tie where they first part), the same tokens with
    preemption, the prefix cache and chunked prefill on; the guesses counted in ``/stats`` and, under vLLM's names
    too, in ``/metrics``."""
    import httpx
    import numpy as np

    import labserver
    from labserver.load.grounded import GroundedTasks

    from .test_realmodel import NEAR_TIE, chat_text, first_divergence

    from concurrent.futures import ThreadPoolExecutor

    model = load_model("smollm2", device="cpu")
    texts = [chat_text(model, p) for p in GroundedTasks().take(3, np.random.default_rng(1))]

    def answer(h: Any, text: str) -> list[int]:
        r = httpx.post(h.url + "/generate", timeout=300, json={"prompt": text, "max_new_tokens": 48,
                                                                "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]  # type: ignore[no-any-return]

    with labserver.serve("gen-continuous", model, speculative="ngram", max_batch_size=4) as h:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda t: answer(h, t), texts))
        stats, metrics = h.stats(), httpx.get(h.url + "/metrics").text
    room = sum(-(-len(model.encode(t)) // 16) + 1 for t in texts) * 16  # every prompt and a block: growth preempts
    tight, memory, _ = run(model, [*texts, texts[0]], [48] * 4, "gen-paged", speculative="ngram", max_batch_size=4,
                           prefix_cache=True, prefill="chunked", max_step_tokens=64, max_kv_tokens=room)
    assert tokens(tight) == [*answers, answers[0]]  # (the fourth: the first's prompt again, its blocks cached)
    assert memory["preemptions"] > 0 and memory["cached_tokens"] > 0 and memory["spec_accepted_tokens"] > 0, \
        {k: memory[k] for k in ("preemptions", "cached_tokens", "spec_accepted_tokens", "kv_blocks_total")}
    parted = 0
    for text, made in zip(texts, answers, strict=True):
        at, gap = first_divergence(model.hf_model, model.encode(text), made)
        assert at is None or gap <= NEAR_TIE, f"token {at} differs from transformers' by {gap:.2e} in score"
        parted += at is not None
    assert parted <= 1
    assert stats["spec_accepted_tokens"] >= 0.3 * stats["spec_proposed_tokens"] > 0, stats
    assert stats["spec_acceptance_rate"] == round(stats["spec_accepted_tokens"] / stats["spec_proposed_tokens"], 4)
    assert stats["spec_draft_ms"] > 0 and stats["spec_verify_ms"] > 0
    for name in ("labserver:spec_proposed_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"):
        assert f"\n{name} " in metrics or f'\n{name}{{engine="0",model_name=' in metrics, name


# -- the knobs: a draft model by name, and what is refused -------------------------------------------------------------

def test_a_draft_model_named_on_the_command_line_is_loaded_and_guesses() -> None:
    import httpx

    import labserver
    from labserver.cli import build_parser
    from labserver.cli.args import limits_from

    args = build_parser().parse_args(["serve", "--model", "synthetic-gen:0+0", "--strategy", "gen-continuous",
                                      "--speculative", "draft", "--draft-model", "synthetic-gen:0+0",
                                      "--num-speculative-tokens", "3", "--speculative-disable-batch-size", "8"])
    limits = limits_from(args)
    assert (limits.speculative, limits.draft_model, limits.num_speculative_tokens,
            limits.speculative_disable_batch_size) == ("draft", "synthetic-gen:0+0", 3, 8)
    with labserver.serve("gen-continuous", "synthetic-gen:0+0", speculative="draft", draft_model="synthetic-gen:0+0",
                         num_speculative_tokens=3) as h:
        r = httpx.post(h.url + "/generate", json={"prompt": "a b c", "max_new_tokens": 13, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["tokens"]) == 13
        stats = h.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] == 9  # the same model: all held, 13 = 1 + 3 x 4
    assert stats["spec_mean_accepted_length"] == 4.0


def test_what_speculation_refuses_says_why() -> None:
    import labserver
    from labserver.models import ModelLoadError

    with pytest.raises(ValueError, match="draft_model"):
        Limits(speculative="draft")
    with pytest.raises(ValueError, match="speculative must be"):
        Limits(speculative="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        Limits(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ModelLoadError, match="same tokenizer"):
        with labserver.serve("gen-continuous", "gpt2-tiny-random", speculative="draft",
                             draft_model="synthetic-gen:0+0"):
            pass
    with pytest.raises(ModelLoadError, match="verifies no guesses"):
        with labserver.serve("gen-hf-cb", "gpt2-tiny-random", speculative="ngram"):
            pass


# -- the virtual clock: speculation's price, and Leviathan's formula -------------------------------------------------

@pytest.mark.parametrize("right", [0.5, 0.8])
def test_the_virtual_clock_prices_verification_and_follows_the_formula(right: float) -> None:
    """One request of 600 tokens on the virtual clock, a draft right with probability ``right`` at a tenth of the
    target's step: tokens a verification made, and the time saved, as Leviathan et al.'s formula says (within
    sampling error: ~200 verifications)."""
    from labserver.analysis.theory import speculative_speedup, speculative_tokens
    from labserver.engine.gensim import simulate_gen

    plain = simulate_gen(make_strategy("gen-continuous", Limits()), [(0.0, 16, 600)], prefill_ms=10, step_ms=10)
    spec = simulate_gen(make_strategy("gen-continuous", Limits(speculative="draft", draft_model="synthetic")),
                        [(0.0, 16, 600)], prefill_ms=10, step_ms=10, draft=SyntheticGen(1, 1, right=right))
    assert plain.seqs[0].tokens == spec.seqs[0].tokens  # (a synthetic target: the same words either way)
    made = spec.stats["spec_mean_accepted_length"]
    assert made == pytest.approx(float(speculative_tokens(right, 4)), rel=0.08)
    took = [run.seqs[0].finished_s - run.seqs[0].first_token_s for run in (plain, spec)]
    assert took[0] / took[1] == pytest.approx(float(speculative_speedup(right, 4, draft_cost=0.1)), rel=0.08)
