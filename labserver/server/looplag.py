"""Event-loop lag: how late a timer that should fire every interval actually fires.

A model running on the event loop (``naive``, ``per-fetch``, ``deadline``) blocks
every other coroutine for the length of a batch; this probe makes that visible.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LagMonitor:
    def __init__(self, interval_ms: float = 10.0, history: int = 60_000) -> None:
        self.interval_s = interval_ms / 1000
        self.samples: deque[tuple[float, float]] = deque(maxlen=history)  # (t_s, lag_ms)
        self.t0_s = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="labserver-lag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            expected = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.perf_counter()
            self.samples.append((now - self.t0_s, max(0.0, (now - expected) * 1000)))

    def summary(self) -> dict[str, float]:
        lags = sorted(lag for _, lag in self.samples)
        if not lags:
            return {"samples": 0}
        return {
            "samples": len(lags),
            "p50_ms": lags[len(lags) // 2],
            "p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
            "max_ms": lags[-1],
        }
