"""Replicas that follow the load, on a virtual clock: an autoscaler, cold starts and a queue.

``simulate_scaling`` replays arrival times (seconds; ``labserver.load.arrivals.traffic_step``
makes a step) through a cluster whose size an ``Autoscaler`` decides. The model of a
replica is the live one's, simplified:

- a replica serves ``slots`` requests at once (its batch), each for ``service_s`` seconds;
  requests beyond every ready replica's slots wait in one queue (the ingress's and the
  handles': what Ray counts as ongoing with the running ones);
- a new replica is ready ``cold_start_s`` after the decision that asked for it (Ray's actor,
  the model load, a compile), and costs replica-seconds from that decision on;
- a replica scaled down first takes no new request, then leaves when its last one is done
  (``graceful_shutdown_timeout_s`` long enough: nothing is lost); a replica still starting
  is the first to go;
- every ``metrics_interval_s`` the ongoing count is sampled; every ``tick_s`` the autoscaler
  decides on the mean of the samples in its last ``look_back_s`` (Ray's controller loop).

Times in the result are seconds on the virtual clock. Nothing here sleeps: a step of 64
replicas and ~100,000 requests takes a few seconds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .autoscale import Autoscaler, Decision

__all__ = ["ScalingResult", "simulate_scaling"]


@dataclass
class ScalingResult:
    """What a run of the autoscaler on a virtual clock gave; times in seconds."""

    arrivals_s: np.ndarray = field(repr=False)  # when each request arrived
    started_s: np.ndarray = field(repr=False)  # when a replica took it (its wait ends)
    done_s: np.ndarray = field(repr=False)  # when it was answered
    timeline: list[tuple[float, int, int]] = field(repr=False)  # (t_s, replicas ready, replicas held): on changes
    decisions: list[Decision]
    replica_seconds: float  # replicas held (starting, ready or draining) integrated over the run
    lost: int = 0  # requests not answered (none: scaled-down replicas drain)

    @property
    def wait_s(self) -> np.ndarray:
        return self.started_s - self.arrivals_s

    @property
    def reached(self) -> int:
        """The most replicas ready at once."""
        return max(r for _, r, _ in self.timeline)

    def ready_at(self, t_s: float) -> int:
        """Replicas ready at ``t_s``."""
        i = np.searchsorted([t for t, _, _ in self.timeline], t_s, side="right") - 1
        return self.timeline[max(int(i), 0)][1]

    def wait_quantile(self, q: float, start_s: float = 0.0, end_s: float = math.inf) -> float:
        """The ``q`` quantile of waits of the requests that arrived in [start_s, end_s)."""
        keep = (self.arrivals_s >= start_s) & (self.arrivals_s < end_s)
        return float(np.quantile(self.wait_s[keep], q)) if keep.any() else math.nan


def simulate_scaling(autoscaler: Autoscaler, arrivals_s: Sequence[float] | np.ndarray, *, service_s: float = 1.0,
                     slots: int = 4, cold_start_s: float = 30.0, tick_s: float = 1.0,
                     until_s: float | None = None) -> ScalingResult:
    """Run ``arrivals_s`` (sorted seconds) through replicas that ``autoscaler`` adds and removes (module docstring);
    the clock runs until every request is answered and ``until_s`` (default: the last arrival) has passed."""
    if service_s <= 0 or slots < 1 or cold_start_s < 0 or tick_s <= 0:
        raise ValueError("need service_s > 0, slots >= 1, cold_start_s >= 0, tick_s > 0")
    arrivals = np.asarray(arrivals_s, dtype=float)
    n = len(arrivals)
    started, done = np.full(n, np.nan), np.full(n, np.nan)
    ready: dict[int, int] = {}  # replica -> requests it runs (ready ones)
    starting: dict[int, float] = {}  # replica -> when it will be ready
    draining: dict[int, int] = {}  # replica -> requests it still runs (takes no new one)
    queue: deque[int] = deque()
    finishing: list[tuple[float, int, int]] = []  # (done, request, replica)
    samples: deque[tuple[float, int]] = deque()  # (t, ongoing)
    timeline: list[tuple[float, int, int]] = []
    next_id, held_since, replica_s = 0, 0.0, 0.0

    def held() -> int:
        return len(ready) + len(starting) + len(draining)

    def mark(t: float) -> None:
        if not timeline or timeline[-1][1:] != (len(ready), held()):
            timeline.append((t, len(ready), held()))

    def take(t: float) -> None:  # queue head -> the least busy ready replica with a free slot
        while queue and ready:
            r = min(ready, key=ready.__getitem__)
            if ready[r] >= slots:
                return
            i = queue.popleft()
            ready[r] += 1
            started[i] = t
            heapq.heappush(finishing, (t + service_s, i, r))

    for _ in range(autoscaler.target):
        ready[next_id] = 0
        next_id += 1
    mark(0.0)
    end_s = (arrivals[-1] if n else 0.0) if until_s is None else until_s
    t_tick, t_sample, a = 0.0, 0.0, 0
    while a < n or queue or finishing or t_tick <= end_s:
        t_ready = min(starting.values(), default=math.inf)
        t_done = finishing[0][0] if finishing else math.inf
        t_arrive = arrivals[a] if a < n else math.inf
        t = min(t_arrive, t_done, t_ready, t_tick, t_sample)
        replica_s += held() * (t - held_since)
        held_since = t
        if t == t_done:
            _, i, r = heapq.heappop(finishing)
            done[i] = t
            if r in draining:
                draining[r] -= 1
                if draining[r] == 0:
                    del draining[r]
            else:
                ready[r] -= 1
        elif t == t_ready:
            r = min(starting, key=starting.__getitem__)
            del starting[r]
            ready[r] = 0
        elif t == t_arrive:
            queue.append(a)
            a += 1
        elif t == t_sample:
            samples.append((t, len(queue) + sum(ready.values()) + sum(draining.values())))
            t_sample += autoscaler.metrics_interval_s
        else:
            while samples and samples[0][0] < t - autoscaler.look_back_s:
                samples.popleft()
            ongoing = float(np.mean([s for _, s in samples])) if samples else 0.0
            target = autoscaler.decide(t, ongoing, len(ready))
            while len(ready) + len(starting) < target:
                starting[next_id] = t + cold_start_s
                next_id += 1
            while len(ready) + len(starting) > target:
                if starting:
                    del starting[max(starting, key=starting.__getitem__)]
                    continue
                r = min(ready, key=ready.__getitem__)  # the least busy drains
                busy = ready.pop(r)
                if busy:
                    draining[r] = busy
            t_tick += tick_s
        take(t)
        mark(t)
    return ScalingResult(arrivals, started, done, timeline, list(autoscaler.decisions), replica_s,
                         lost=int(np.isnan(done).sum()))
