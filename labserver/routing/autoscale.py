"""How many replicas: the autoscaler's rule as a plain object. No Ray, no clock of its own.

Ray Serve's default autoscaling policy (``ray/serve/autoscaling_policy.py``, 2.60), written
again so that a virtual clock can run it (``labserver.routing.scaling``) and a lesson can
read it; the live server hands the same numbers to Ray as its ``autoscaling_config``
(``Autoscaler.ray_config``), and Ray's controller applies its own copy of the rule.

Each control tick the autoscaler sees the requests ongoing across the deployment (queued at
the handles and running in replicas), averaged over the last ``look_back_s``:

1. wanted = ongoing / ``target_ongoing``, moved towards by ``upscaling_factor`` or
   ``downscaling_factor`` from the running count (rounded up; a scale-down stuck by the factor
   still drops one), then held within [``min_replicas``, ``max_replicas``];
2. a change is made only once it has been wanted in the same direction without a break for
   ``upscale_delay_s`` (up) or ``downscale_delay_s`` (down); a tick that wants the current
   target resets the wait.

The decision is a new *target*; replicas reach it later: a new one after its cold start (an
actor, a model load, a compile), a removed one after it drains.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Autoscaler", "Decision"]


@dataclass(frozen=True)
class Decision:
    """One change of target, at ``t_s`` (the caller's clock)."""

    t_s: float
    old: int  # the target before
    new: int  # the target after
    ongoing: float  # the averaged ongoing requests that decided it
    running: int  # replicas running when it was decided


@dataclass
class Autoscaler:
    """Ray Serve's rule (the module docstring); ``decide`` once per control tick."""

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing: float = 2.0  # requests per replica the rule aims at (Ray's default 2)
    upscale_delay_s: float = 30.0  # Ray's default
    downscale_delay_s: float = 600.0  # Ray's default
    look_back_s: float = 30.0  # the window the ongoing count is averaged over (Ray's look_back_period_s)
    metrics_interval_s: float = 10.0  # how often replicas and handles report (Ray's metrics_interval_s)
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    target: int = field(default=-1, repr=False)  # the current target (min_replicas until the first decision)
    decisions: list[Decision] = field(default_factory=list, repr=False)
    _since_s: float | None = field(default=None, repr=False)  # when the current run of same-direction wants began
    _direction: int = field(default=0, repr=False)  # +1 up, -1 down, 0 none

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}:{self.max_replicas} (e.g. --replicas 1:4)")
        if self.target_ongoing <= 0:
            raise ValueError(f"target_ongoing must be positive, got {self.target_ongoing}")
        if min(self.upscale_delay_s, self.downscale_delay_s) < 0 or min(self.look_back_s, self.metrics_interval_s) <= 0:
            raise ValueError("delays must be >= 0 and look_back_s, metrics_interval_s > 0")
        if self.target < 0:
            self.target = self.min_replicas

    def wanted(self, ongoing: float, running: int) -> int:
        """Step 1: the replica count the averaged ``ongoing`` asks for, within the bounds."""
        if running == 0:  # (from zero: one as soon as anything waits, no factor, no delay)
            return max(self.target, 1) if ongoing > 0 else self.target
        desired = ongoing / self.target_ongoing
        factor = self.upscaling_factor if desired > running else self.downscaling_factor
        scaled = math.ceil(running + factor * (desired - running) - 1e-9)
        if math.ceil(desired - 1e-9) < running and scaled == running:
            scaled -= 1
        return min(max(scaled, self.min_replicas), self.max_replicas)

    def decide(self, now_s: float, ongoing: float, running: int) -> int:
        """Step 2: the target after this tick (``self.target``); a change is recorded in ``decisions``."""
        want = self.wanted(ongoing, running)
        direction = (want > self.target) - (want < self.target)
        if running == 0 and want > self.target:
            return self._set(now_s, want, ongoing, running)
        if direction == 0:
            self._since_s, self._direction = None, 0
            return self.target
        if direction != self._direction or self._since_s is None:
            self._since_s, self._direction = now_s, direction
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if now_s - self._since_s + 1e-9 >= delay:
            return self._set(now_s, max(want, 1) if direction < 0 and self.target > 1 else want, ongoing, running)
        return self.target

    def _set(self, now_s: float, new: int, ongoing: float, running: int) -> int:
        self.decisions.append(Decision(now_s, self.target, new, ongoing, running))
        self.target, self._since_s, self._direction = new, None, 0
        return new

    def ray_config(self) -> dict[str, Any]:
        """The same numbers as Ray Serve's ``autoscaling_config``."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.min_replicas, "target_ongoing_requests": self.target_ongoing,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_s, "metrics_interval_s": self.metrics_interval_s,
                "upscaling_factor": self.upscaling_factor, "downscaling_factor": self.downscaling_factor}

    def settings(self) -> dict[str, Any]:
        """The rule's settings (not its state), for /stats and records."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_") and k not in ("target", "decisions")}
