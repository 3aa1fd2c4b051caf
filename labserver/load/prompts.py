"""Prompts of a chosen length in tokens, with or without a long prefix they all share.

The workloads LLM benchmarks use (vLLM's ``random`` and ``prefix_repetition`` datasets,
guidellm's synthetic data, SGLang's generated shared prefix) fix or draw each prompt's
length in *tokens*. ``TokenPrompts`` makes such prompts from the built-in word list
(``labserver.load.arrivals.WORDS``): each of those words is one token in the bundled
uncased vocabulary, and one token in most BPE vocabularies when it follows a space, so
N words make about N tokens (the server's ``usage.prompt_tokens`` says exactly; a server
also adds its own special tokens: labserver's GPT-2 models add one). Given a
``tokenizer`` (a local folder or anything ``transformers.AutoTokenizer`` loads offline)
the words are trimmed or extended until that tokenizer counts exactly N.

``prefix_tokens`` > 0 makes the shared-prefix workload: one long prefix (or
``prefixes`` of them, each prompt drawing one) fixed by ``prefix_seed`` whatever the
run's seed and process, then a short suffix of its own per prompt: what a prefix
cache (or its absence) shows on.

A payload source like ``WordTexts``: ``take(n, rng)`` gives n texts; it sends nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrivals import WORDS
from .lengths import Lengths, LengthsLike, make_lengths

__all__ = ["TokenPrompts"]


@dataclass(frozen=True, eq=False)
class TokenPrompts:
    """Prompts of ``tokens`` tokens each (an int, a ``Lengths`` or a list to replay); see the module docstring."""

    tokens: LengthsLike = 128  # tokens of each prompt's own part (after the shared prefix)
    prefix_tokens: int = 0  # tokens of the shared prefix, 0: none
    prefixes: int = 1  # distinct shared prefixes; each prompt draws one
    prefix_seed: int = 0  # fixes the prefixes, the same in every run and process
    tokenizer: str | None = None  # count exactly with this tokenizer (a local folder), else one word = one token

    def __post_init__(self) -> None:
        make_lengths(self.tokens)  # fails now, with what to pass
        if self.prefix_tokens < 0 or self.prefixes < 1:
            raise ValueError(f"prefix_tokens must be >= 0 and prefixes >= 1, got {self.prefix_tokens}, "
                             f"{self.prefixes}")

    @property
    def lengths(self) -> Lengths:
        return make_lengths(self.tokens)

    def shared(self) -> list[str]:
        """The shared prefixes (empty without ``prefix_tokens``)."""
        if not self.prefix_tokens:
            return []
        rng = np.random.default_rng([self.prefix_seed, 7])
        return [self._text(self.prefix_tokens, rng) for _ in range(self.prefixes)]

    def take(self, n: int, rng: np.random.Generator) -> list[str]:
        sizes = self.lengths.take(n, rng)
        prefixes = self.shared()
        picks = rng.integers(0, len(prefixes), n) if prefixes else None
        out = []
        for k, size in enumerate(sizes.tolist()):
            own = self._text(size, rng)
            out.append(f"{prefixes[picks[k]]} {own}" if picks is not None else own)
        return out

    def _text(self, n_tokens: int, rng: np.random.Generator) -> str:
        words = [WORDS[w] for w in rng.integers(0, len(WORDS), n_tokens)]
        if self.tokenizer is None:
            return " ".join(words)
        return _fit(words, n_tokens, _tokenizer(self.tokenizer), rng)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # only when asked for: a second of import

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _fit(words: list[str], n_tokens: int, tokenizer: Any, rng: np.random.Generator) -> str:
    """Words trimmed or extended until ``tokenizer`` counts ``n_tokens`` (no special tokens)."""
    for _ in range(20):
        count = len(tokenizer.encode(" ".join(words), add_special_tokens=False))
        if count == n_tokens:
            break
        if count > n_tokens:
            words = words[: max(1, len(words) - max(1, (count - n_tokens) // 2))]
        else:
            words = words + [WORDS[w] for w in rng.integers(0, len(WORDS), max(1, (n_tokens - count) // 2))]
    return " ".join(words)
