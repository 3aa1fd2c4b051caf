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

``Questions`` are the other kind: real questions, for a real model (``smollm2``) to
answer as it sees fit, from one-word facts to short essays, so its answer lengths are its
own (what the EOS stand-in of the random-weight models only imitates). ``QUESTION_KINDS``
groups them by the answer each kind calls for (facts, lists, explanations, writing,
advice); a ``Mix`` of one ``Flow`` per kind labels each answer with its kind.
``GroundedTasks`` (``labserver.load.grounded``, importable from here too) are their
counterpart: texts to rewrite, correct, summarise or quote, whose answers copy the
prompt: where speculation by prompt lookup pays, as on these questions it cannot.

A payload source like ``WordTexts``: ``take(n, rng)`` gives n texts; it sends nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrivals import WORDS, WordTexts
from .grounded import GroundedTasks
from .lengths import Lengths, LengthsLike, make_lengths

__all__ = ["QUESTIONS", "QUESTION_KINDS", "GroundedTasks", "Questions", "TokenPrompts"]

QUESTION_KINDS: dict[str, tuple[str, ...]] = {  # what people ask a small chat model, by the answer it calls for
    "facts": (
        "What is the capital of France?", "How many days are in a leap year?", "What is 12 times 12?",
        "Who wrote Romeo and Juliet?", "What is the chemical symbol for gold?", "How many continents are there?",
        "What colour do you get by mixing blue and yellow?", "What is the largest ocean on Earth?",
        "What is the boiling point of water in Celsius?", "Which planet is known as the red planet?",
        "Translate 'thank you' into Spanish.", "Give me a synonym for 'quick'.", "What is the square root of 81?",
        "In which year did the first person walk on the Moon?", "What language is spoken in Brazil?"),
    "lists": (
        "Name three primary colours.", "List four kinds of fruit.", "Name the planets of the solar system.",
        "List five animals that live in the ocean.", "What are the three states of matter?",
        "Give three tips for sleeping better.", "List the days of the week.", "Name three famous painters.",
        "What are the main ingredients of bread?", "Give me four ideas for a rainy afternoon."),
    "explanations": (
        "Why is the sky blue?", "What is photosynthesis?", "How does a rainbow form?", "What is gravity?",
        "Explain what a computer virus is.", "Why do we have seasons?", "What does a doctor do?",
        "How do bees make honey?", "What is the difference between weather and climate?",
        "Explain how a bicycle works.", "What is machine learning?", "Why do cats purr?",
        "How does the internet work, in simple terms?", "What causes thunder?", "What is a black hole?"),
    "writing": (
        "Write a haiku about the sea.", "Write a short poem about autumn leaves.",
        "Write a two-sentence story about a lost key.", "Describe a sunset in a few sentences.",
        "Write a short thank-you note to a teacher.", "Write a limerick about a cat.",
        "Describe your ideal weekend.", "Write a short story about a robot who learns to paint.",
        "Write a paragraph about the importance of friendship.", "Describe a busy city street."),
    "advice": (
        "How do I boil an egg?", "How can I save money on groceries?", "How do I make a cup of tea?",
        "What should I pack for a day at the beach?", "How can I learn a new language faster?",
        "What are the benefits of regular exercise?", "How do I plant a tomato seedling?",
        "What is a good way to start a presentation?", "How do I write a good email?",
        "Is it better to read books or watch films?", "What makes a good friend?",
        "Should I learn to play the piano or the guitar?", "What is your favourite season and why?",
        "Say hello in three languages."),
}
QUESTIONS = tuple(q for kind in QUESTION_KINDS.values() for q in kind)


@dataclass(frozen=True, eq=False)
class Questions:
    """Real questions (``QUESTIONS``, or your own), drawn in a seeded order, each once before any repeats."""

    questions: tuple[str, ...] = QUESTIONS

    def take(self, n: int, rng: np.random.Generator) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            out += [self.questions[i] for i in rng.permutation(len(self.questions))]
        return out[:n]


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


def masked_texts(n: int, *, mask: str = "[MASK]", min_words: int = 6, max_words: int = 16,
                 seed: int = 0) -> list[str]:
    """``n`` seeded sentences from the built-in word list, each with one ``mask`` token.

    Fill-mask models (``bert-base-random``, the guide's task) refuse a text without one.

    >>> masked_texts(2, min_words=3, max_words=3)[0].count("[MASK]")
    1
    """
    rng = np.random.default_rng(seed)
    texts = WordTexts(dist="uniform", min_words=min_words, max_words=max_words).take(n, rng)
    out = []
    for text in texts:
        words = text.split()
        words[int(rng.integers(len(words)))] = mask
        out.append(" ".join(words))
    return out
