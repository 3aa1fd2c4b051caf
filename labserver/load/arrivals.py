"""When requests arrive: the arrival processes.

Everything here is plain numpy and the standard library: no HTTP, no clocks. An
arrival process turns (duration, count, seed) into a sorted array of send times in
seconds from the start of a run. ``labserver.loadgen`` materialises them before a run
starts, so a run is reproducible from its seed and can be split over several processes.
What each request carries is not here but in ``labserver.load.payloads`` (its names
are re-exported below, where older code imports them from).

Rate-based processes share one mechanism: a piecewise-linear rate λ(t) whose
cumulative Λ(t) is inverted, at integers for evenly spaced arrivals and at the
partial sums of Exp(1) draws for a Poisson process (the time-change theorem). So a
step, a ramp, an on/off square wave and a flat rate are one code path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# payload sources, re-exported: notebooks, benchmarks and tests import them from here
from .payloads import WORDS, FileLines, PayloadLike, PayloadSource, WordTexts, iter_payloads, take_payloads

__all__ = [
    "ARRIVALS",
    "Arrival",
    "Constant",
    "Gamma",
    "OnOff",
    "Poisson",
    "Ramp",
    "Replay",
    "Steps",
    "make_arrival",
    "traffic_step",
    # from .payloads
    "WORDS",
    "FileLines",
    "PayloadLike",
    "PayloadSource",
    "WordTexts",
    "iter_payloads",
    "take_payloads",
]

_CHUNK = 4096  # arrivals drawn per round while filling a bounded window


class Arrival:
    """Base of the arrival processes: ``times()`` gives sorted send times in seconds."""

    def times(self, duration_s: float | None = None, max_requests: int | None = None,
              seed: int = 0) -> np.ndarray:
        raise NotImplementedError

    def mean_rate_per_s(self, duration_s: float) -> float | None:
        """Expected arrivals per second over [0, duration_s), None when unknown."""
        return None


class _RateSchedule(Arrival):
    """λ(t) linear between knots (two knots at one time make a step); after the last
    knot the last rate holds, or the knots repeat when ``period_s`` is set."""

    poisson: bool = True

    def knots(self) -> tuple[np.ndarray, np.ndarray, float | None]:
        raise NotImplementedError  # -> (t_s, rate_per_s, period_s)

    def _cumulative(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float | None]:
        t, r, period = self.knots()
        t, r = np.asarray(t, float), np.asarray(r, float)
        if t[0] != 0 or np.any(np.diff(t) < 0) or np.any(r < 0) or not np.all(np.isfinite(r)):
            raise ValueError(f"{self!r}: rates must be finite and >= 0, knots sorted from t=0")
        cum = np.concatenate([[0.0], np.cumsum(np.diff(t) * (r[:-1] + r[1:]) / 2)])
        # Rounded so that an integer u at a segment's end (the 100th arrival of 100/s for
        # 1 s) falls past it, as in exact arithmetic, and not just inside by a rounding error.
        cum = np.round(cum, 9)
        return t, r, cum, period

    def _invert(self, u: np.ndarray) -> np.ndarray:
        """Λ⁻¹(u) = the earliest t with Λ(t) > u (so never inside a zero-rate stretch)."""
        t, r, cum, period = self._cumulative()
        if period is None:
            return _invert_piecewise(u, t, r, cum, tail_rate=r[-1])
        per_period = cum[-1]
        if per_period <= 0:
            return np.full(u.shape, np.inf)
        m = np.floor(u / per_period)
        rem = u - m * per_period
        m, rem = np.where(rem >= per_period, m + 1, m), np.where(rem >= per_period, 0.0, rem)
        return m * period + _invert_piecewise(rem, t, r, cum, tail_rate=0.0)

    def times(self, duration_s=None, max_requests=None, seed=0) -> np.ndarray:
        limit_s, limit_n = _check_bounds(duration_s, max_requests)
        rng = np.random.default_rng(seed)
        chunks: list[np.ndarray] = []
        n, u0 = 0, 0.0
        while n < limit_n:
            if self.poisson:
                u = u0 + np.cumsum(rng.exponential(1.0, _CHUNK))
            else:
                u = u0 + np.arange(_CHUNK, dtype=float)  # u = 0, 1, 2, ...: first one at t=0
            u0 = u[-1] + (0.0 if self.poisson else 1.0)
            t = self._invert(u)
            keep = t[t < limit_s][: limit_n - n]
            chunks.append(keep)
            n += len(keep)
            if len(keep) < len(t):
                break
        return np.concatenate(chunks) if chunks else np.empty(0)

    def mean_rate_per_s(self, duration_s: float) -> float | None:
        if not duration_s or not math.isfinite(duration_s):
            return None
        grid = np.linspace(0.0, duration_s, 20001)  # Λ(duration) / duration, numerically
        return float(np.trapezoid(self._rate_at(grid), grid) / duration_s)

    def _rate_at(self, s: np.ndarray) -> np.ndarray:
        t, r, _, period = self._cumulative()
        if period is not None:
            s = np.mod(s, period)
        return np.interp(s, t, r, right=r[-1])


def _invert_piecewise(u, t, r, cum, *, tail_rate: float) -> np.ndarray:
    """Solve Λ(x) = u where λ is linear on each [t[j], t[j+1]] and ``tail_rate`` after t[-1]."""
    last = len(t) - 1
    j = np.searchsorted(cum, u, side="right") - 1  # cum[j] <= u < cum[j+1]: never a flat stretch
    inside = j < last
    seg = np.minimum(j, max(last - 1, 0))
    if last:
        width = np.diff(t)
        slopes = np.divide(np.diff(r), width, out=np.zeros_like(width), where=width > 0)
        slope = np.where(inside, slopes[seg], 0.0)
    else:
        slope = np.zeros_like(u)
    r0, a = r[j], u - cum[j]
    # r0*dx + slope*dx²/2 = a, in the form that stays exact when slope == 0
    denom = r0 + np.sqrt(np.maximum(r0 * r0 + 2 * slope * a, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        dx = np.where(a == 0, 0.0, 2 * a / denom)
        tail = t[-1] + (u - cum[-1]) / tail_rate if tail_rate > 0 else np.full(u.shape, np.inf)
    return np.where(inside, t[j] + dx, tail)


@dataclass(frozen=True)
class Constant(_RateSchedule):
    """Evenly spaced: request k at k / rate_per_s exactly."""

    rate_per_s: float
    poisson = False

    def knots(self):
        return [0.0], [self.rate_per_s], None

    def times(self, duration_s=None, max_requests=None, seed=0) -> np.ndarray:
        limit_s, limit_n = _check_bounds(duration_s, max_requests)
        if self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s}")
        n = min(limit_n, math.ceil(limit_s * self.rate_per_s) if math.isfinite(limit_s) else limit_n)
        t = np.arange(n) / self.rate_per_s
        return t[t < limit_s]


@dataclass(frozen=True)
class Poisson(_RateSchedule):
    """Memoryless arrivals: exponential gaps with mean 1 / rate_per_s."""

    rate_per_s: float

    def knots(self):
        return [0.0], [self.rate_per_s], None


@dataclass(frozen=True)
class Gamma(Arrival):
    """Bursty (or smoother) arrivals: gamma-distributed gaps with mean 1 / rate_per_s.

    ``burstiness`` is the gamma shape, as in vLLM's benchmark: 1 is Poisson, below 1
    arrivals come in clumps with long quiet gaps between (coefficient of variation of
    the gaps 1/sqrt(burstiness)), above 1 they are more even than Poisson.
    """

    rate_per_s: float
    burstiness: float = 0.5

    def times(self, duration_s=None, max_requests=None, seed=0) -> np.ndarray:
        limit_s, limit_n = _check_bounds(duration_s, max_requests)
        if self.rate_per_s <= 0 or self.burstiness <= 0:
            raise ValueError(f"Gamma needs rate_per_s > 0 and burstiness > 0, got {self!r}")
        rng = np.random.default_rng(seed)
        chunks, n, t0 = [], 0, 0.0
        while n < limit_n:
            gaps = rng.gamma(self.burstiness, 1.0 / (self.rate_per_s * self.burstiness), _CHUNK)
            t = t0 + np.cumsum(gaps) - gaps[0]  # the first arrival at t=0, as for the others
            t0 = t[-1] + gaps[0]
            keep = t[t < limit_s][: limit_n - n]
            chunks.append(keep)
            n += len(keep)
            if len(keep) < len(t):
                break
        return np.concatenate(chunks) if chunks else np.empty(0)

    def mean_rate_per_s(self, duration_s: float) -> float | None:
        return self.rate_per_s


@dataclass(frozen=True)
class OnOff(_RateSchedule):
    """Bursts: rate_per_s for on_s, nothing for off_s, repeated (starts 'on')."""

    rate_per_s: float
    on_s: float
    off_s: float
    poisson: bool = True

    def knots(self):
        if self.on_s <= 0 or self.off_s < 0:
            raise ValueError("OnOff needs on_s > 0 and off_s >= 0")
        t = [0.0, self.on_s, self.on_s, self.on_s + self.off_s]
        return t, [self.rate_per_s, self.rate_per_s, 0.0, 0.0], self.on_s + self.off_s


@dataclass(frozen=True)
class Steps(_RateSchedule):
    """A staircase of (duration_s, rate_per_s) segments; no arrivals after the last one."""

    steps: Sequence[tuple[float, float]]
    poisson: bool = True

    def knots(self):
        if not self.steps or any(d <= 0 for d, _ in self.steps):
            raise ValueError("Steps needs segments of (duration_s > 0, rate_per_s)")
        t, r, start = [], [], 0.0
        for d, rate in self.steps:
            t += [start, start + d]
            r += [rate, rate]
            start += d
        return t + [start], r + [0.0], None


def traffic_step(rate_per_s: float, before_s: float, step_s: float, after_s: float, factor: float = 3.0,
                 poisson: bool = True) -> Steps:
    """A traffic step: ``rate_per_s`` for ``before_s``, ``factor`` x that for ``step_s``, then ``rate_per_s`` again
    for ``after_s`` (what an autoscaler must follow: ``labserver.routing.scaling``, ``benchmarks/autoscale.py``)."""
    if rate_per_s <= 0 or factor <= 0:
        raise ValueError(f"traffic_step needs rate_per_s > 0 and factor > 0, got {rate_per_s} and {factor}")
    return Steps(((before_s, rate_per_s), (step_s, factor * rate_per_s), (after_s, rate_per_s)), poisson=poisson)


@dataclass(frozen=True)
class Ramp(_RateSchedule):
    """Rate rising (or falling) linearly from start to end over ramp_s, then holding end."""

    start_per_s: float
    end_per_s: float
    ramp_s: float
    poisson: bool = True

    def knots(self):
        if self.ramp_s <= 0:
            raise ValueError("Ramp needs ramp_s > 0")
        return [0.0, self.ramp_s], [self.start_per_s, self.end_per_s], None


class Replay(Arrival):
    """Given send times (seconds from start): a list, an array, or any (even endless)
    iterable or generator; read lazily up to the run's bounds."""

    def __init__(self, times_s: Iterable[float]):
        self.times_s = times_s

    def __repr__(self) -> str:
        return f"Replay({type(self.times_s).__name__})"

    def times(self, duration_s=None, max_requests=None, seed=0) -> np.ndarray:
        limit_s, limit_n = _check_bounds(duration_s, max_requests)
        out: list[float] = []
        for t in self.times_s:
            t = float(t)
            if t >= limit_s:
                break  # sorted input, so nothing later can fit
            if not t >= 0 or (out and t < out[-1]):
                raise ValueError(f"arrival times must be >= 0 and non-decreasing; "
                                 f"got {t} after {out[-1] if out else 'the start'} (sort them first)")
            out.append(t)
            if len(out) >= limit_n:
                break
        return np.asarray(out, dtype=float)


ARRIVALS: dict[str, type[Arrival]] = {"constant": Constant, "poisson": Poisson, "gamma": Gamma}


def make_arrival(arrival: str | Arrival | Iterable[float], rate_per_s: float | None = None) -> Arrival:
    """A name ("constant", "poisson", "gamma" or "gamma:BURSTINESS") with ``rate_per_s``,
    an Arrival, or times to replay."""
    if isinstance(arrival, Arrival):
        return arrival
    if isinstance(arrival, str) and (arrival == "gamma" or arrival.startswith("gamma:")):
        if rate_per_s is None or rate_per_s <= 0:
            raise ValueError(f"arrival={arrival!r} needs rate_per_s > 0")
        try:
            return Gamma(rate_per_s, float(arrival[6:]) if arrival[6:] else 0.5)
        except ValueError:
            raise ValueError(f"bad arrival {arrival!r}: use gamma or gamma:BURSTINESS, e.g. gamma:0.5") from None
    if isinstance(arrival, str):
        if arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival {arrival!r}; use one of {sorted(ARRIVALS)}, gamma:BURSTINESS, "
                             "an Arrival such as OnOff/Steps/Ramp, or an iterable of times")
        if rate_per_s is None or rate_per_s <= 0:
            raise ValueError(f"arrival={arrival!r} needs rate_per_s > 0")
        return ARRIVALS[arrival](rate_per_s)
    return Replay(arrival)


def _check_bounds(duration_s: float | None, max_requests: int | None) -> tuple[float, int]:
    if duration_s is None and max_requests is None:
        raise ValueError("give duration_s or max_requests (or both): a run must be bounded")
    limit_s = math.inf if duration_s is None else float(duration_s)
    limit_n = 2**62 if max_requests is None else int(max_requests)
    return limit_s, limit_n

