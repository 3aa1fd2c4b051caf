"""Length distributions: how many tokens each generation request asks for, or each prompt holds.

A length source turns (count, rng) into an array of positive ints, the
``max_new_tokens`` of successive requests (or, given to ``labserver.load.prompts.TokenPrompts``,
the tokens of successive texts, for generation or encoder loads); like the arrival processes and payloads
in ``labserver.load.arrivals`` it is plain numpy, seeded and drawn before a run, so a
run is reproducible and can be split over processes. Prompts are not here: they
are payloads (``WordTexts``, ``FileLines``, lists) as for any other load.

This module only says what is asked. Whether a server honours it (``ignore_eos``,
its own cap on ``max_new_tokens``) shows in the records' ``n_tokens``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

__all__ = ["LENGTHS", "ConstantLength", "GeometricLength", "Lengths", "LognormalLength", "ReplayLengths",
           "UniformLength", "iter_lengths", "make_lengths", "take_lengths"]

_CHUNK = 1024  # lengths drawn per round by the endless iterator (closed loop)
_Z99 = NormalDist().inv_cdf(0.99)  # the standard normal's 99th percentile, 2.326


class Lengths:
    """Base of the length sources: ``take(n, rng)`` gives ``n`` ints >= 1."""

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def mean(self) -> float:
        """The expected length (before any clipping a subclass does not model: see each)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ConstantLength(Lengths):
    """Every request asks for ``n`` tokens."""

    n: int

    def __post_init__(self) -> None:
        _check_positive("ConstantLength n", self.n)

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)

    def mean(self) -> float:
        return float(self.n)


@dataclass(frozen=True)
class UniformLength(Lengths):
    """Uniform on the integers ``lo..hi``, both included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_positive("UniformLength lo", self.lo)
        if self.hi < self.lo:
            raise ValueError(f"UniformLength needs lo <= hi, got lo={self.lo}, hi={self.hi}")

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, n, dtype=np.int64)

    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class GeometricLength(Lengths):
    """Geometric on 1, 2, ... with mean ``mean`` (p = 1/mean), clipped to [lo, hi].

    Many short answers and a long tail, the shape chat traffic tends to have. The
    clipping moves the mean a little: ``mean()`` is the unclipped one.
    """

    mean_tokens: float
    lo: int = 1
    hi: int = 2048

    def __post_init__(self) -> None:
        if not (self.mean_tokens >= 1 and math.isfinite(self.mean_tokens)):
            raise ValueError(f"GeometricLength needs a finite mean_tokens >= 1, got {self.mean_tokens}")
        _check_positive("GeometricLength lo", self.lo)
        if self.hi < self.lo:
            raise ValueError(f"GeometricLength needs lo <= hi, got lo={self.lo}, hi={self.hi}")

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raw = rng.geometric(1.0 / self.mean_tokens, n)
        return np.clip(raw, self.lo, self.hi).astype(np.int64)

    def mean(self) -> float:
        return float(self.mean_tokens)


@dataclass(frozen=True)
class LognormalLength(Lengths):
    """Lognormal with median ``median`` and log-spread ``sigma``, rounded and clipped to [lo, hi].

    Text lengths in real traffic look like this: most short, a long tail of long ones
    (an embedding workload's search queries beside its documents). ``from_p99`` gives the
    ``sigma`` for a wanted 99th percentile. The clipping moves the mean: ``mean()`` is the
    unclipped one, ``median * exp(sigma**2 / 2)``.
    """

    median: float
    sigma: float
    lo: int = 1
    hi: int = 2048

    def __post_init__(self) -> None:
        if not (self.median >= 1 and math.isfinite(self.median)):
            raise ValueError(f"LognormalLength needs a finite median >= 1, got {self.median}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"LognormalLength needs a finite sigma >= 0, got {self.sigma}")
        _check_positive("LognormalLength lo", self.lo)
        if self.hi < self.lo:
            raise ValueError(f"LognormalLength needs lo <= hi, got lo={self.lo}, hi={self.hi}")

    @classmethod
    def from_p99(cls, median: float, p99: float, lo: int = 1, hi: int = 2048) -> LognormalLength:
        """The lognormal whose median and 99th percentile (before clipping) are the given ones.

        Most texts short, a few near MiniLM's 256-token limit, as a long-tailed embedding
        workload has them:

        >>> lengths = LognormalLength.from_p99(20, 256, hi=256)
        >>> round(lengths.sigma, 3), round(lengths.mean(), 1)
        (1.096, 36.5)
        """
        if not (p99 >= median and math.isfinite(p99)):
            raise ValueError(f"LognormalLength.from_p99 needs a finite p99 >= median, got median={median}, p99={p99}")
        return cls(median, math.log(p99 / median) / _Z99, lo, hi)

    def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)

    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)


class ReplayLengths(Lengths):
    """Given lengths (a list or an array), in order, started again when used up."""

    def __init__(self, values: Iterable[int]):
        # materialised: a spawned generator process needs it picklable, and cycling needs it finite
        self.values = np.asarray(list(values), dtype=np.int64)
        if self.values.size == 0:
            raise ValueError("ReplayLengths needs at least one length")
        if (self.values < 1).any():
            raise ValueError(f"lengths must be >= 1, got {int(self.values.min())}")

    def __repr__(self) -> str:
        return f"ReplayLengths({self.values.size} lengths)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplayLengths) and np.array_equal(self.values, other.values)

    def take(self, n: int, rng: np.random.Generator | None = None) -> np.ndarray:
        return np.resize(self.values, n)  # repeats the values in order

    def mean(self) -> float:
        return float(self.values.mean())


LENGTHS: dict[str, type[Lengths]] = {
    "constant": ConstantLength, "uniform": UniformLength, "geometric": GeometricLength,
    "lognormal": LognormalLength, "replay": ReplayLengths,
}

LengthsLike = int | Lengths | Sequence[int] | np.ndarray


def make_lengths(lengths: LengthsLike) -> Lengths:
    """An int (every request asks that many), a ``Lengths``, or a list/array to replay."""
    if isinstance(lengths, Lengths):
        return lengths
    if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
        return ConstantLength(int(lengths))
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"new_tokens must be an int, a Lengths ({', '.join(c.__name__ for c in LENGTHS.values())}) "
                        f"or a list of ints, got {lengths!r}")
    return ReplayLengths(lengths)


def parse_lengths(text: str) -> Lengths:
    """A length distribution from a short spec, as the command line takes it.

    ``64`` (every request asks 64), ``uniform:16:256``, ``geometric:100`` or
    ``geometric:100:1:512`` (mean, then bounds), ``lognormal:20:1.1`` or
    ``lognormal:20:1.1:1:256`` (median and sigma, then bounds), ``replay:FILE`` (one int per line).
    """
    kind, _, rest = text.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind.isdigit() and not rest:
            return ConstantLength(int(kind))
        if kind == "uniform" and len(args) == 2:
            return UniformLength(int(args[0]), int(args[1]))
        if kind == "geometric" and len(args) in (1, 3):
            return GeometricLength(float(args[0]), *(int(a) for a in args[1:]))
        if kind == "lognormal" and len(args) in (2, 4):
            return LognormalLength(float(args[0]), float(args[1]), *(int(a) for a in args[2:]))
        if kind == "replay" and rest:
            from pathlib import Path

            return ReplayLengths(int(line) for line in Path(rest).read_text().split())
    except ValueError as e:
        raise ValueError(f"bad lengths {text!r}: {e}") from None
    raise ValueError(f"bad lengths {text!r}: use N, uniform:LO:HI, geometric:MEAN[:LO:HI], "
                     "lognormal:MEDIAN:SIGMA[:LO:HI] or replay:FILE")


def take_lengths(lengths: LengthsLike, n: int, seed: int | Sequence[int] = 0) -> np.ndarray:
    """``n`` lengths drawn with ``seed`` (a replay: its first ``n``, cycled)."""
    return make_lengths(lengths).take(n, np.random.default_rng(seed))


def iter_lengths(lengths: LengthsLike, seed: int | Sequence[int] = 0) -> Iterator[int]:
    """An endless stream of lengths (closed loop draws as it goes)."""
    source = make_lengths(lengths)
    if isinstance(source, ReplayLengths):
        return itertools.cycle(source.values.tolist())
    rng = np.random.default_rng(seed)
    return itertools.chain.from_iterable(source.take(_CHUNK, rng).tolist() for _ in itertools.count())


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
