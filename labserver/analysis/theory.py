"""Queueing-theory predictions to hold measurements against.

Single-server queues with Poisson arrivals (M/G/1 and its special cases). A
batching server is not one of these, but two readings still help: with batching
off (one item per model call) the server *is* close to M/D/1, since a model call
on a fixed-size input takes a nearly constant time; and a batching server with
batches of ``b`` items and ``batch_ms`` per call can at best serve
``b / batch_ms`` requests per millisecond (``capacity_rps``).

Rates are requests per second and times are milliseconds, as everywhere in
labserver. Every function accepts a float or a numpy array for the rate, so a
predicted curve can be drawn in one call, and returns ``inf`` where the queue is
unstable (utilisation ρ ≥ 1): its waiting time grows without bound.

Nothing here knows of records, HTTP or matplotlib.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

__all__ = [
    "busy_cycles_ms",
    "speculative_speedup",
    "speculative_tokens",
    "capacity_rps",
    "md1_mean_response_ms",
    "mg1_mean_response_ms",
    "mm1_mean_response_ms",
    "mm1_response_quantile_ms",
    "supermarket_mean_time",
    "utilization",
]

Rate = float | npt.ArrayLike  # requests per second, a scalar or an array of them


def _check(service_ms: float, rate_per_s: Rate) -> np.ndarray:
    if not service_ms > 0:
        raise ValueError(f"service time must be positive, got {service_ms!r} ms")
    rate = np.asarray(rate_per_s, dtype=float)
    if np.any(rate < 0):
        raise ValueError(f"arrival rates must be >= 0 req/s, got {rate_per_s!r}")
    return rate


def _out(values: np.ndarray) -> float | np.ndarray:
    return float(values) if np.ndim(values) == 0 else values


def utilization(rate_per_s: Rate, service_ms: float) -> float | np.ndarray:
    """ρ = λ·D, the fraction of time the server is busy (≥ 1: it cannot keep up)."""
    return _out(_check(service_ms, rate_per_s) * service_ms / 1000.0)


def capacity_rps(service_ms: float, batch_size: int = 1) -> float:
    """The most requests per second one worker can finish: ``batch_size`` every ``service_ms``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    _check(service_ms, 0.0)
    return batch_size * 1000.0 / service_ms


def mg1_mean_response_ms(rate_per_s: Rate, mean_service_ms: float, cv2: float) -> float | np.ndarray:
    """Mean time in system of an M/G/1 queue (Pollaczek–Khinchine), ms.

    ``W = D + ρ·D·(1 + cv²) / (2·(1 − ρ))`` with ``ρ = λ·D`` and ``cv²`` the squared
    coefficient of variation of the service time (0: constant, 1: exponential).

    >>> mg1_mean_response_ms(50, 10.0, cv2=0.5)
    17.5
    """
    if cv2 < 0:
        raise ValueError(f"cv2 is a squared coefficient of variation and must be >= 0, got {cv2!r}")
    rate = _check(mean_service_ms, rate_per_s)
    rho = rate * mean_service_ms / 1000.0
    # errstate: at ρ = 1 the division is by zero; those entries become inf below anyway
    with np.errstate(divide="ignore", invalid="ignore"):
        wait_ms = rho * mean_service_ms * (1.0 + cv2) / (2.0 * (1.0 - rho))
    return _out(np.where(rho < 1.0, mean_service_ms + wait_ms, np.inf))


def md1_mean_response_ms(rate_per_s: Rate, service_ms: float) -> float | np.ndarray:
    """Mean time in system of an M/D/1 queue (constant service time), ms.

    ``W = D + ρ·D / (2·(1 − ρ))``; half the queueing delay of M/M/1 at the same load.

    >>> md1_mean_response_ms(50, 10.0)  # ρ = 0.5: 10 + 0.5·10/(2·0.5)
    15.0
    >>> md1_mean_response_ms(100, 10.0)
    inf
    """
    return mg1_mean_response_ms(rate_per_s, service_ms, cv2=0.0)


def mm1_mean_response_ms(rate_per_s: Rate, service_ms: float) -> float | np.ndarray:
    """Mean time in system of an M/M/1 queue (exponential service), ms: ``D / (1 − ρ)``.

    >>> mm1_mean_response_ms(50, 10.0)
    20.0
    """
    return mg1_mean_response_ms(rate_per_s, service_ms, cv2=1.0)


def mm1_response_quantile_ms(rate_per_s: Rate, service_ms: float, q: float) -> float | np.ndarray:
    """The q-quantile of M/M/1 time in system, ms.

    Time in system of M/M/1 (FIFO) is exponential with rate μ − λ, so its
    quantile is ``−ln(1 − q) / (μ − λ)`` — a pessimistic yardstick for a p99 SLO,
    since real model calls vary far less than exponentially.

    >>> round(mm1_response_quantile_ms(50, 10.0, 0.99), 3)  # 20 ms mean · ln 100
    92.103
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q is a quantile and must lie in (0, 1), got {q!r}")
    mean_ms = np.asarray(mm1_mean_response_ms(rate_per_s, service_ms))
    return _out(-np.log1p(-q) * mean_ms)


def supermarket_mean_time(load: float, choices: int = 1) -> float:
    """Mean time in system, in service times, of N -> infinity FIFO M/M/1 replicas when each request joins the
    shortest of ``choices`` replicas drawn at random (Mitzenmacher's supermarket model; Vvedenskaya et al. 1996).

    One choice is plain M/M/1: ``1 / (1 - load)``. With d >= 2 the share of replicas holding at
    least i requests falls doubly exponentially, ``s_i = load ** ((d**i - 1) / (d - 1))``, and the
    mean time is their sum over i >= 1 divided by the load (Little's law).

    >>> supermarket_mean_time(0.9)
    10.000000000000002
    >>> round(supermarket_mean_time(0.9, 2), 2)
    2.61
    """
    if not 0.0 < load < 1.0:
        return math.inf if load >= 1.0 else 0.0
    if choices < 1:
        raise ValueError(f"choices must be at least 1, got {choices}")
    if choices == 1:
        return 1.0 / (1.0 - load)
    total, i = 0.0, 1
    while (term := load ** ((choices ** i - choices) / (choices - 1))) > 1e-15:
        total += term
        i += 1
    return total


def busy_cycles_ms(batches: Iterable[Mapping[str, float]]) -> list[float]:
    """The server's service time as its queue feels it, from its own batch log (``ServerHandle.batches()``).

    Dispatch-to-dispatch gaps between a batch and the next one whose request was already
    queued when the first finished: the model time *plus* the hand-off (the model settles
    the future, the loop wakes, the worker takes the next item), serial work that keeps the
    next request waiting just as the model does. That is the D an M/D/1 prediction needs;
    the model time alone understates the queueing.
    """
    cycles = []
    for a, b in itertools.pairwise(batches):
        finished_s = a["dispatched_s"] + a["compute_ms"] / 1000
        enqueued_s = b["dispatched_s"] - b["queue_wait_ms"] / 1000
        if enqueued_s < finished_s:
            cycles.append((b["dispatched_s"] - a["dispatched_s"]) * 1000)
    return cycles


# -- speculative decoding (Leviathan et al. 2023, section 3) ------------------------------------------------------

def speculative_tokens(alpha: Rate, k: int) -> float | np.ndarray:
    """Tokens one verification of k guesses makes on average when each guess holds with probability ``alpha``,
    independently, given the ones before it held: the kept guesses and the model's own token,
    (1 - alpha^(k + 1)) / (1 - alpha); k + 1 at alpha = 1.

    >>> float(speculative_tokens(0.0, 4)), float(speculative_tokens(0.5, 4)), float(speculative_tokens(1.0, 4))
    (1.0, 1.9375, 5.0)
    """
    a = np.asarray(alpha, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(a >= 1.0, k + 1.0, (1.0 - a ** (k + 1)) / (1.0 - a))
    return _out(out)


def speculative_speedup(alpha: Rate, k: int, draft_cost: float = 0.0, verify_cost: float = 1.0) -> float | np.ndarray:
    """Tokens per unit of time with speculation over without: ``speculative_tokens`` over what making them costs,
    k draft steps of ``draft_cost`` and one verify step of ``verify_cost``, each in plain decode steps (Leviathan et
    al.'s (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), with the verify step's own cost where it is not one step's: on
    a CPU k + 1 rows cost more than one). Below 1 it costs.

    >>> round(float(speculative_speedup(0.8, 4, draft_cost=0.05)), 3)
    2.801
    >>> float(speculative_speedup(0.0, 4, verify_cost=1.3)) < 1  # nothing kept: the verify step is pure cost
    True
    """
    return _out(np.asarray(speculative_tokens(alpha, k)) / (k * draft_cost + verify_cost))

