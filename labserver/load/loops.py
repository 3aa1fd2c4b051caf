"""The event loop a load generator sends from, and how late its timers wake.

A generator must send on time, so the loop is chosen for its timers: select() (µs
timeouts) where a process holds few sockets at a moderate rate, uvloop (faster I/O,
ms-coarse timers) elsewhere; ``spin_s`` says how long before each send to stop sleeping
and yield instead. Nothing here sends a request or knows HTTP: that is
``labserver.load.worker``'s.
"""

from __future__ import annotations

import asyncio
import selectors
import time

__all__ = ["RESERVED_FDS", "loop_factory", "run_on_fresh_loop", "spin_s", "timer_late_fraction"]

# Event-loop timers on epoll are only ms-accurate: asyncio's wake late by up to 1 ms,
# uvloop's by up to 1 ms either side. On those loops the scheduler sleeps until this much
# before a send and yields (busy, but still serving responses) for the rest.
_SPIN_S = {"asyncio": 0.001, "uvloop": 0.002}
_SELECT_SPIN_S = 0.001  # select() wakes on time when the machine is idle; this covers a busy one
_SELECT_MAX_RATE = 1000.0  # requests/s per process; above it uvloop's faster I/O wins (measured)
_SELECT_FD_LIMIT = 1024  # select() cannot watch descriptors numbered past FD_SETSIZE
RESERVED_FDS = 64  # a spawned worker's own descriptors (pipes, the loop's self-pipe, ...)


def run_on_fresh_loop(make_coro, sockets: int | None = None, rate_per_s: float = 0.0):
    """Run ``make_coro()`` on a new event loop chosen for sending on time (``loop_factory``)."""
    with asyncio.Runner(loop_factory=loop_factory(sockets, rate_per_s)) as runner:
        return runner.run(make_coro())


def timer_late_fraction(rate_per_s: float = 100.0, duration_s: float = 1.5) -> float:
    """How often a bare timer loop (no HTTP; select() and a 1 ms spin, as a generator process
    waits) wakes more than 1 ms late on this machine right now: the noise no generator beats."""

    async def ticks() -> float:
        t0, late = time.perf_counter(), 0
        n = int(rate_per_s * duration_s)
        for k in range(n):
            target = t0 + k / rate_per_s
            if (delay := target - time.perf_counter() - _SELECT_SPIN_S) > 0:
                await asyncio.sleep(delay)
            while time.perf_counter() < target:
                await asyncio.sleep(0)
            late += time.perf_counter() - target > 1e-3
        return late / n

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())) as runner:
        return runner.run(ticks())


def loop_factory(sockets: int | None = None, rate_per_s: float = 0.0):
    """The event loop for a generator.

    select() when at most ``sockets`` sockets will be open in a process whose file
    descriptors we know are few (a spawned worker) and the rate is moderate: its timeout
    has µs resolution, so the busy-wait before each send can be short (``spin_s``) and
    the cores stay with the server (a CPU model wants them all). Otherwise uvloop: faster
    at I/O, but its timers are ms-coarse, so ``Worker`` busy-waits the last 2 ms before
    each send, which above ~1000 requests/s is a core's worth of spinning either way.
    """
    few_fds = sockets is not None and sockets + RESERVED_FDS < _SELECT_FD_LIMIT
    if few_fds and rate_per_s <= _SELECT_MAX_RATE:
        return lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        import uvloop  # absent on Windows
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def spin_s(loop: asyncio.AbstractEventLoop, mean_gap_s: float) -> float:
    """Seconds before each send to stop sleeping and yield instead, on ``loop``."""
    if isinstance(getattr(loop, "_selector", None), selectors.SelectSelector):
        # µs timers: spin only to ride out a late wake-up, for at most a quarter of the time
        return min(_SELECT_SPIN_S, mean_gap_s / 4)
    return _SPIN_S.get(type(loop).__module__.split(".")[0], max(_SPIN_S.values()))
