"""Speculative decoding: guess a few tokens cheaply, then let the model verify them all in one step.

A decode step computes one token per sequence; at low load it reads every weight to do
so, and the arithmetic waits on memory. A *proposer* guesses the next k tokens; the step
computes the sequence's last token and the k guesses together (``Chunk.draft``: a chunk of
k + 1 tokens, causal, like a piece of a prompt) and the model chooses the token after each
of those k + 1 positions exactly as one decode step at a time would (``Verified``). The
engine keeps the guesses these choices confirm, then the first choice that differs (or,
all confirmed, the choice after the last guess): 1 to k + 1 tokens for one step.

Two proposers:

- ``ngram`` (prompt lookup; vLLM's ``ngram``, transformers' ``prompt_lookup_num_tokens``):
  the last n tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up
  earlier in the sequence's own context, and the k tokens that followed their latest
  earlier occurrence are the guess. Free to make, and right where the answer copies its
  prompt (summaries, extraction, rewrites); nothing to propose where it does not.
- ``draft``: a smaller model with the same tokenizer decodes k tokens greedily. It keeps
  its own KV (its own pool and block tables, ``DraftModel``): each proposal first catches
  up on the tokens the target accepted since the last one, then takes k - 1 decode steps.

Exactness. Every guess is a point (the proposer names one token, with certainty), and the
choice at each position is made as without speculation: greedy is the argmax at that
position; a sampled token is drawn from the model's distribution with the position's own
seed. A guess is kept only when the choice equals it. For a point guess this *is* the
rejection-sampling rule of Leviathan et al. (2023) and Chen et al. (2023): they accept a
guess x with probability min(1, p(x) / q(x)) = p(x) when q is a point mass at x, and on a
rejection draw from max(0, p - q) renormalised, which is p without x; a draw y ~ p kept
as is does both at once (P[y = x] = p(x); y given y != x is p without x). So every token
comes from the target's distribution, and a seeded request's tokens are the same with and
without speculation, token for token (greedy ones up to near-ties: k + 1 positions in one
call are computed in other shapes than one, ``docs/generation.md``).

Rollback. Only the positions up to the last kept guess hold valid keys and values: the
sequence's ``computed`` advances past them alone, and the blocks taken for the rejected
guesses go back to the pool (``BlockManager.shrink``). Prefix caching registers computed
blocks only, so a rejected guess never enters the cache; preemption recomputes what was
kept.

When to speculate (``Speculator.active``): a verify step of b sequences computes
b x (k + 1) rows. At low load the rows ride along nearly free; once the batch fills the
machine they cost what they compute, and a rejected guess is work thrown away. vLLM's
``disable_by_batch_size`` rule turns speculation off while more than N requests are
running or waiting (``speculative_disable_batch_size``); ``docs/generation.md`` has why
this rule and not an estimate from acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..models import Chunk, GenModel
from ..models.base import token_of
from .blocks import BlockManager

__all__ = ["DraftModel", "Guess", "Speculator", "ngram_guess", "same_tokenizer"]


def ngram_guess(context: Sequence[int], k: int, shortest: int = 2, longest: int = 4) -> list[int]:
    """Prompt lookup: for n from ``longest`` down to ``shortest``, the context's last n tokens are searched for
    earlier in it; at the latest earlier match, the (at most) k tokens that followed it. None found: []."""
    end = len(context)
    if k < 1 or end < 2:
        return []
    tail = list(context[-longest:])
    for n in range(min(longest, end - 1), shortest - 1, -1):
        want = tail[-n:]
        first = want[0]
        for i in range(end - n - 1, -1, -1):  # (i + n <= end - 1: at least one token follows the match)
            if context[i] == first and list(context[i:i + n]) == want:
                return list(context[i + n:i + n + k])
    return []


@dataclass(frozen=True)
class Guess:
    """What the proposer is asked for one sequence: its id, its context, and at most how many tokens."""

    sid: int
    context: Sequence[int]
    k: int


def same_tokenizer(target: GenModel, draft: GenModel) -> bool:
    """The draft names tokens as the target does: both synthetic (words are tokens), or the same vocabulary."""
    a, b = target.tokenizer, draft.tokenizer
    if a is None or b is None:
        return a is None and b is None
    return a is b or a.get_vocab() == b.get_vocab()


class DraftModel:
    """A smaller model's guesses, with its own KV: a pool of ``blocks`` blocks and a block table per sequence.

    Runs on the model thread (``propose``, ``forget``). ``held[sid]``: how many of the
    sequence's positions the draft holds keys and values for, a prefix of its context.
    """

    def __init__(self, model: GenModel, blocks: int, block_tokens: int) -> None:
        self.model = model
        self.blocks = BlockManager(blocks, block_tokens)
        model.allocate_kv(blocks, block_tokens)
        self.held: dict[int, int] = {}

    def propose(self, asks: list[Guess]) -> dict[int, list[int]]:
        """k greedy tokens for each sequence asked (fewer where its pool is full: none)."""
        going = []
        for ask in asks:
            ask = Guess(ask.sid, ask.context, min(ask.k, self.model.max_context - len(ask.context)))
            if ask.k < 1:
                continue
            if ask.sid not in self.blocks.tables:
                self.blocks.start(ask.sid, ())
            if not self.blocks.grow(ask.sid, len(ask.context) + ask.k - 1):  # (k - 1 guesses get KV here)
                self.forget([ask.sid])
                continue
            going.append(ask)
        if not going:
            return {}
        table = {a.sid: tuple(self.blocks.tables[a.sid]) for a in going}
        since = {a.sid: min(self.held.get(a.sid, 0), len(a.context) - 1) for a in going}  # what it has not seen
        first = self.model.forward([Chunk(a.sid, list(a.context[since[a.sid]:]), since[a.sid], table[a.sid],
                                          prompt_len=len(a.context)) for a in going])
        guesses = {a.sid: [token_of(out)] for a, out in zip(going, first, strict=True)}
        for a in going:
            self.held[a.sid] = len(a.context)
        for j in range(1, max(a.k for a in going)):
            now = [a for a in going if a.k > j]
            outs = self.model.forward([Chunk(a.sid, [guesses[a.sid][-1]], len(a.context) + j - 1, table[a.sid],
                                             prompt_len=len(a.context), decode=True) for a in now])
            for a, out in zip(now, outs, strict=True):
                guesses[a.sid].append(token_of(out))  # type: ignore[arg-type]
                self.held[a.sid] = len(a.context) + j
        return guesses  # type: ignore[return-value]

    def kept(self, sid: int, positions: int) -> None:
        """The target kept the sequence's first ``positions`` positions: the draft's KV past them is stale."""
        if sid in self.held:
            self.held[sid] = min(self.held[sid], positions)

    def forget(self, sids: Sequence[int]) -> None:
        """These sequences are gone (or their pool ran out): their blocks back, the draft model told."""
        for sid in sids:
            self.blocks.release(sid)
            self.held.pop(sid, None)
        self.model.release(list(sids))


class Speculator:
    """One engine's speculation: the method, k, the rule for when, and the draft model when there is one."""

    def __init__(self, limits: Any, draft: DraftModel | None = None) -> None:
        self.method: str = limits.speculative
        self.k: int = limits.num_speculative_tokens
        self.shortest, self.longest = limits.prompt_lookup_min, limits.prompt_lookup_max
        self.off_above: int | None = limits.speculative_disable_batch_size
        self.draft = draft  # method "draft": set once loaded (the engine's ``ready``); until then, no guesses

    def active(self, running: int, waiting: int) -> bool:
        """Speculate this step: at most ``speculative_disable_batch_size`` requests running and waiting."""
        return self.off_above is None or running + waiting <= self.off_above

    def propose(self, asks: list[Guess]) -> dict[int, list[int]]:
        """Each sequence's guess (on the model thread: a draft model computes)."""
        if self.method == "draft":
            return self.draft.propose([a for a in asks if a.k > 0]) if self.draft is not None else {}
        return {a.sid: g for a in asks if (g := ngram_guess(a.context, a.k, self.shortest, self.longest))}

    def kept_by(self, seqs: Iterable[Any]) -> None:
        """After a verification: each sequence's ``computed`` positions are what the draft may keep of its KV."""
        if self.draft is not None:
            for seq in seqs:
                self.draft.kept(seq.sid, seq.computed)

    def forget(self, sids: Sequence[int]) -> None:
        if self.draft is not None:
            self.draft.forget(sids)
