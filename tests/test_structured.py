"""Answers in a shape, on the step engine: the grammar's mask before every choice, the matcher after every token.

A synthetic model with one character per token and scores of its own (``Shaped``) chooses
by the mask as a real model does, in no time: answers are checked against their schema,
regex, choice or grammar, across preemption, the prefix cache, n > 1, sampling and
speculation. The compile cache, its timeout and the compiler's refusals are the same code
a server runs (tests/test_structured_server.py serves smollm2).
"""

from __future__ import annotations

import asyncio
import json
import re
import string
import threading
import zlib
from typing import Any

import pytest
import torch

from labserver.engine import StepEngine
from labserver.engine.ending import FinishReason
from labserver.engine.speculation import DraftModel
from labserver.models import Chunk, InputRejected, Sampling
from labserver.models.grammar import Constraint, Grammars, apply_masks
from labserver.models.sampling import choose
from labserver.models.synthetic import SyntheticGen
from labserver.strategies import Limits, make_strategy

CHARS = ["<eos>", *'{}[]":, ', *string.ascii_lowercase, *string.digits]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "age"], "additionalProperties": False}
SHAPES = {"json": (Constraint("json", json.dumps(SCHEMA)), lambda t: set(json.loads(t)) == {"name", "age"}),
          "json_object": (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
          "regex": (Constraint("regex", "[a-c]{2}[0-9]{1,3}"), lambda t: re.fullmatch("[a-c]{2}[0-9]{1,3}", t)),
          "choice": (Constraint("choice", '["yes", "no", "maybe"]'), lambda t: t in ("yes", "no", "maybe")),
          "grammar": (Constraint("grammar", 'root ::= "[" [a-z]+ "]"'), lambda t: re.fullmatch(r"\[[a-z]+\]", t))}


class Shaped(SyntheticGen):
    """The synthetic model with a character per token and scores drawn from its context: it chooses among what the
    mask leaves (``apply_masks``, then ``choose``, as ``PagedLM`` does)."""

    vocab_size = len(CHARS)
    scores = True

    def encode(self, prompt: str) -> list[int]:
        return [1 + zlib.crc32(w.encode()) % (len(CHARS) - 1) for w in prompt.split()]

    def token_text(self, token: int) -> str:
        return CHARS[token]

    def text(self, tokens: list[int]) -> str:
        return "".join(CHARS[t] for t in tokens if t)

    def _token(self, chunk: Chunk, position: int, signature: int) -> int:
        scores = torch.tensor([[(signature * (t + 7919)) % 1009 / 200 for t in range(len(CHARS))]])
        apply_masks(scores, [chunk.grammar])
        return choose(scores, [position], [chunk.sampling], self.eos_ids)[0]


def run(constraint: Constraint | None, prompts: list[str], new: int = 48, strategy: str = "gen-continuous",
        sampling: Sampling | None = None, n: int = 1, draft: bool = False,
        **limits: Any) -> tuple[list[Any], dict[str, Any]]:
    """Every prompt (n choices each) submitted at once, all awaited: (sequences, /stats); ``draft``: speculation,
    with the same model guessing (every guess right)."""
    model = Shaped(0, 0)
    if draft:
        limits.update(speculative="draft", draft_model="(given)")

    async def main() -> tuple[list[Any], dict[str, Any]]:
        e = StepEngine(make_strategy(strategy, Limits(**{"max_batch_size": 16, **limits})), model)
        if draft:
            e.spec.draft = DraftModel(Shaped(0, 0), e.blocks.total, e.blocks.block_tokens)  # type: ignore[union-attr]
        e.start()
        try:
            await e.ready()
            grammar = await e.grammar(constraint) if constraint else None
            seqs = []
            for p in prompts:
                first = None
                for j in range(n):
                    s = None if sampling is None else Sampling(sampling.temperature, seed=sampling.seed + j)
                    seqs.append(e.submit(model.encode(p), new, sampling=s, parent=first, grammar=grammar))
                    first = first or seqs[-1]
            await asyncio.gather(*(s.future for s in seqs))
            e.blocks.check()
            assert e.blocks.used == 0
            return seqs, e.stats()
        finally:
            await e.stop()

    return asyncio.run(main())


PROMPTS = [f"tell me about thing {k} " + "please " * (k % 5) for k in range(12)]


@pytest.mark.parametrize("kind", list(SHAPES))
def test_every_answer_is_in_its_grammar_and_ends_with_stop(kind: str) -> None:
    constraint, valid = SHAPES[kind]
    free, _ = run(None, PROMPTS)
    assert not any(valid_text(valid, s) for s in free)  # (without the mask, the same model makes no such text)
    for sampling in (None, Sampling(1.0, seed=7)):
        seqs, stats = run(constraint, PROMPTS, new=200, sampling=sampling)
        for s in seqs:
            assert s.finish_reason is FinishReason.STOP and valid_text(valid, s), (kind, s.output.text)
            assert s.tokens[-1] == 0 and s.grammar.rejected == 0
        assert stats["grammar_mask_rows"] == stats["tokens_generated"] and stats["grammar_compiles"] == 1


def valid_text(valid: Any, seq: Any) -> bool:
    try:
        return bool(valid(seq.output.text))
    except (ValueError, TypeError):  # (not JSON, or not an object)
        return False


def test_a_budget_that_ends_first_is_length_and_a_prefix_of_an_answer() -> None:
    constraint, _ = SHAPES["json"]
    whole, _ = run(constraint, PROMPTS[:4])
    cut, _ = run(constraint, PROMPTS[:4], new=5)
    for w, c in zip(whole, cut, strict=True):
        assert c.finish_reason is FinishReason.LENGTH and len(c.tokens) == 5 and w.tokens[:5] == c.tokens


def test_preemption_prefix_cache_chunks_and_n_change_no_token() -> None:
    constraint, valid = SHAPES["json"]
    sampling = Sampling(1.0, seed=3)
    plain, _ = run(constraint, PROMPTS, sampling=sampling, n=2)
    assert len({tuple(s.tokens) for s in plain}) > len(PROMPTS)  # (the choices differ, each its own matcher)
    for strategy, limits in (("gen-paged", {"max_kv_tokens": 160, "kv_block_tokens": 8}),
                             ("gen-continuous", {"max_batch_size": 4, "prefix_cache": True, "kv_block_tokens": 4}),
                             ("gen-continuous", {"max_batch_size": 4, "prefill": "chunked", "max_step_tokens": 12})):
        seqs, stats = run(constraint, PROMPTS, strategy=strategy, sampling=sampling, n=2, **limits)
        assert [s.tokens for s in seqs] == [s.tokens for s in plain], (strategy, limits)
        assert all(valid_text(valid, s) for s in seqs)
        if "max_kv_tokens" in limits:
            assert stats["preemptions"] > 0
        if limits.get("prefix_cache"):
            assert stats["cached_tokens"] + stats["shared_tokens"] > 0


def test_speculation_is_off_for_a_constrained_sequence_and_changes_nothing() -> None:
    constraint, valid = SHAPES["json"]
    plain, _ = run(constraint, PROMPTS)
    seqs, stats = run(constraint, PROMPTS, draft=True)
    assert [s.tokens for s in seqs] == [s.tokens for s in plain] and stats["spec_proposed_tokens"] == 0
    assert all(valid_text(valid, s) for s in seqs)
    free, stats = run(None, PROMPTS, draft=True)
    assert stats["spec_proposed_tokens"] > 0  # (an unconstrained one still takes guesses)


def test_a_grammar_is_compiled_once_per_constraint_and_refusals_use_the_compilers_words() -> None:
    grammars = Grammars(Shaped(0, 0))

    async def main() -> None:
        a, b = await asyncio.gather(grammars.compile(SHAPES["json"][0]), grammars.compile(SHAPES["json"][0]))
        assert a is b and (grammars.compiles, grammars.hits) == (1, 1)
        assert await grammars.compile(Constraint("json", json.dumps(SCHEMA))) is a and grammars.hits == 2
        for bad, words in ((Constraint("json", '{"type": "objekt"}'), 'Unsupported type "objekt"'),
                           (Constraint("regex", "(ab"), "parenthesis is not closed"),
                           (Constraint("grammar", "root ::= foo"), 'Rule "foo" is not defined')):
            with pytest.raises(InputRejected, match=re.escape(words)) as e:
                await grammars.compile(bad)
            assert "/project/" not in str(e.value)  # (the compiler's words, not its source file)
        assert grammars.refused == 3 and grammars.compiles == 1

    asyncio.run(main())


def test_a_slow_compile_is_refused_at_its_timeout_while_other_requests_are_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile runs on a thread of its own: the engine goes on generating for others meanwhile."""
    release = threading.Event()
    compile_ = Grammars._compile

    def slow(self: Grammars, c: Constraint) -> Any:
        if c.kind == "regex":
            release.wait(30)
        return compile_(self, c)

    monkeypatch.setattr(Grammars, "_compile", slow)
    model = Shaped(0, 0)

    async def main() -> None:
        e = StepEngine(make_strategy("gen-continuous", Limits(max_batch_size=4)), model)
        e.start()
        try:
            grammar = await e.grammar(SHAPES["choice"][0])
            assert e.grammars is not None
            e.grammars.timeout_s = 0.5
            slow_one = asyncio.ensure_future(e.grammar(SHAPES["regex"][0]))
            served = e.submit(model.encode("hello"), 8, grammar=grammar)
            await served.future  # (answered while the regex compiles)
            assert served.finish_reason is FinishReason.STOP and not slow_one.done()
            with pytest.raises(InputRejected, match="not compiled within 0.5 s"):
                await slow_one
        finally:
            release.set()
            await e.stop()

    asyncio.run(main())


def test_a_model_that_computes_no_scores_refuses_a_shape() -> None:
    async def main() -> None:
        e = StepEngine(make_strategy("gen-continuous", Limits()), SyntheticGen(0, 0))
        with pytest.raises(InputRejected, match="no scores"):
            await e.grammar(SHAPES["choice"][0])

    asyncio.run(main())
