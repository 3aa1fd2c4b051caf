"""What requests carry: payload sources, turned into texts before a run.

Plain numpy and the standard library, seeded like the arrival processes
(``labserver.load.arrivals``, which says *when* a request goes; this module says
*what* it sends). A payload is one fixed text, a ``WordTexts`` (seeded sentences from
the built-in word list), the lines of a file, any source with ``take(n, rng)`` (such as
``labserver.load.prompts.TokenPrompts``), or an iterable of texts. Output lengths for
generation are in ``labserver.load.lengths``. A request carries one text, or (a JSON
list, ``texts_per_request`` > 1) several drawn in order: ``take_requests``, ``next_request``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["WORDS", "FileLines", "Inputs", "PayloadLike", "PayloadSource", "Sessions", "WordTexts", "input_chars",
           "iter_payloads", "next_request", "take_payloads", "take_requests"]

# A small neutral vocabulary: enough variety for tokenizers, no external file.
WORDS = tuple("""
the a of to and in is it that for on with as was at by be this from or an are not
have one all were when we there can more if out so up said what about than into them
only some time would like other new could very after first also well way because any
these two how our work even back good day most us model server batch queue request
token answer question small large fast slow early late quiet bright river mountain city
garden window paper music light water stone cloud story table morning evening winter
summer people student teacher number simple careful little great open close always
""".split())


@dataclass(frozen=True)
class WordTexts:
    """Texts of varying length from the built-in word list.

    ``dist``: "lognormal" (mean ``mean_words``, spread ``sigma``), "uniform" (between
    ``min_words`` and ``max_words``) or "fixed" (``mean_words`` each); lengths are
    clipped to [min_words, max_words].
    """

    mean_words: float = 20
    dist: str = "lognormal"
    sigma: float = 0.6
    min_words: int = 1
    max_words: int = 256

    def lengths(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.dist == "lognormal":  # mean of exp(N(mu, s²)) is exp(mu + s²/2)
            mu = math.log(self.mean_words) - self.sigma**2 / 2
            raw = rng.lognormal(mu, self.sigma, n)
        elif self.dist == "uniform":
            raw = rng.integers(self.min_words, self.max_words + 1, n)
        elif self.dist == "fixed":
            raw = np.full(n, self.mean_words)
        else:
            raise ValueError(f"dist must be 'lognormal', 'uniform' or 'fixed', got {self.dist!r}")
        return np.clip(np.rint(raw), self.min_words, self.max_words).astype(int)

    def take(self, n: int, rng: np.random.Generator) -> list[str]:
        lengths = self.lengths(n, rng)
        words = rng.integers(0, len(WORDS), int(lengths.sum()))
        ends = np.cumsum(lengths)
        return [" ".join(WORDS[w] for w in words[e - k:e]) for k, e in zip(lengths, ends)]


@dataclass(frozen=True)
class FileLines:
    """The lines of a text file, in order (blank lines skipped), reused when used up."""

    path: str | Path

    def lines(self) -> list[str]:
        lines = [s for s in Path(self.path).read_text(encoding="utf-8").splitlines() if s.strip()]
        if not lines:
            raise ValueError(f"{self.path} has no non-blank lines to send")
        return lines


@dataclass(frozen=True)
class Sessions:
    """Multi-turn conversations: each turn resends the conversation so far plus a new message.

    ``sessions`` conversations run side by side, their turns interleaved (every session's
    turn 1, then every turn 2, ...), ``turns`` each; then a fresh set. A conversation opens
    with one of ``prefixes`` shared system texts of ``prefix_words`` (none when 0: groups of
    sessions sharing a prompt prefix, more groups than replicas if you like) and a first
    message of ``first_words``; every later turn appends a stand-in answer of
    ``answer_words`` and a new message of ``turn_words``. So turn k's prompt begins with
    turn k-1's whole prompt: what a prefix cache keeps, if the same replica gets it. The
    answers are stand-ins (the generator sends its texts before it hears any answer).
    """

    sessions: int = 8
    turns: int = 4
    first_words: int = 40
    turn_words: int = 12
    answer_words: int = 24
    prefixes: int = 0
    prefix_words: int = 64

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "first_words", "turn_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"Sessions.{name} must be at least 1, got {getattr(self, name)}")

    def take(self, n: int, rng: np.random.Generator) -> list[str]:
        def words(k: int) -> str:
            return " ".join(WORDS[w] for w in rng.integers(0, len(WORDS), k))

        shared = [f"system {g}: " + words(self.prefix_words) for g in range(self.prefixes)]
        out: list[str] = []
        while len(out) < n:
            opening = [f"{shared[rng.integers(len(shared))]} " if shared else "" for _ in range(self.sessions)]
            talk = [f"{o}user: {words(self.first_words)}" for o in opening]
            for turn in range(self.turns):
                for s in range(self.sessions):
                    if turn:
                        talk[s] += f" assistant: {words(self.answer_words)} user: {words(self.turn_words)}"
                    out.append(talk[s])
        return out[:n]


class PayloadSource(Protocol):
    """Anything that draws texts from a seeded generator (``WordTexts``, ``labserver.load.prompts``)."""

    def take(self, n: int, rng: np.random.Generator) -> list[str]: ...


PayloadLike = str | WordTexts | PayloadSource | FileLines | Path | Iterable[str]
Inputs = str | list[str]  # what one request carries: a text, or its list of texts


def _is_source(payload: object) -> bool:
    return not isinstance(payload, (str, Path, FileLines)) and callable(getattr(payload, "take", None))


def iter_payloads(payload: PayloadLike, seed: int | Sequence[int] = 0) -> Iterator[str]:
    """An endless stream of texts. A str is one fixed text; finite iterables (lists,
    file lines, a generator that ends) start again from their beginning."""
    if isinstance(payload, str):
        return itertools.repeat(payload)
    if _is_source(payload):
        rng = np.random.default_rng(seed)
        return itertools.chain.from_iterable(payload.take(1024, rng) for _ in itertools.count())
    if isinstance(payload, Path):
        payload = FileLines(payload)
    if isinstance(payload, FileLines):
        return itertools.cycle(payload.lines())
    return _cycle_checked(payload)


def _cycle_checked(items: Iterable[str]) -> Iterator[str]:
    seen = False
    for text in itertools.cycle(items):
        if not isinstance(text, str):
            raise TypeError(f"payloads must be str, got {type(text).__name__}")
        seen = True
        yield text
    if not seen:
        raise ValueError("the payload iterable is empty")


def take_payloads(payload: PayloadLike, n: int, seed: int | Sequence[int] = 0) -> list[str]:
    """The first ``n`` texts of ``iter_payloads(payload, seed)``."""
    if _is_source(payload):
        return payload.take(n, np.random.default_rng(seed))
    return list(itertools.islice(iter_payloads(payload, seed), n))


def take_requests(payload: PayloadLike, n: int, per_request: int = 1,
                  seed: int | Sequence[int] = 0) -> list[str] | list[list[str]]:
    """``n`` requests' inputs: the first ``n * per_request`` texts of ``take_payloads``, in lists
    of ``per_request`` when that is above 1 (so one text per request draws what it always did)."""
    texts = take_payloads(payload, n * per_request, seed)
    if per_request == 1:
        return texts
    return [texts[k:k + per_request] for k in range(0, len(texts), per_request)]


def next_request(texts: Iterator[str], per_request: int = 1) -> Inputs:
    """The next request's inputs from an endless stream of texts (closed loop)."""
    return next(texts) if per_request == 1 else [next(texts) for _ in range(per_request)]


def input_chars(inputs: Inputs) -> int:
    """Characters a request carries, summed over its texts."""
    return len(inputs) if isinstance(inputs, str) else sum(len(t) for t in inputs)
