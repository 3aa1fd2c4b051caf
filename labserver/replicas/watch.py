"""The replicas over time, the autoscaler's decisions and each new replica's cold start, as the ingress sees them.

Ray Serve's controller decides how many replicas run (``autoscaling_config``, the rule of
``labserver.routing.autoscale``) and starts and stops them; its instance details (what
``serve status`` and the dashboard read) give the deployment's target and each replica's
state and ``start_time_s``, the time its actor was started, in the control-loop step that
decided it. ``ScaleWatch`` turns a series of those details into a timeline (a row each time the
target or a count changes), the decisions (each change of target) and, with what each replica
reports of its own start (``labserver.replicas.deploy.Replica``: when its constructor ran, its
model load, its compile, its first token), each cold start split into its parts:

- ``actor_s``: from the decision to the replica's constructor (a Ray worker process, imports);
- ``load_s``: the model load; ``compile_s``: a compile, when asked (``--compile``);
- ``serving_s``: from the end of those to its first token (Serve's controller marks it running,
  the routers learn of it, its first request arrives and is prefilled);
- ``first_token_s``: from the decision to that first token, the whole cold start.

``ScaledEngine`` is the ingress's engine with a ``ScaleWatch`` fed every ``REPORT_S``. The parsing is
plain Python (tested without Ray); only ``ScaledEngine`` talks to the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..engine.counters import Metric, gauge
from .remote import REPORT_S, BoardedEngine

__all__ = ["KEEP", "ScaleWatch", "ScaledEngine", "cold_start"]

KEEP = 1000  # timeline rows and decisions kept (the oldest go first)
LIVE = ("STARTING", "UPDATING", "RECOVERING", "RUNNING", "PENDING_MIGRATION")  # replicas that count as held


class ScaleWatch:
    """The controller's view of one deployment over time (the module docstring); ``observe`` each reading."""

    def __init__(self, deployment: str, app: str, clock: Callable[[], float] = time.time) -> None:
        self.deployment, self.app, self.clock = deployment, app, clock
        self.timeline: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.started: dict[str, float] = {}  # replica id -> when its actor was started (the decision's time)
        self.target: int | None = None
        self.colds: dict[str, dict[str, float | None]] = {}

    def observe(self, details: dict[str, Any]) -> None:
        """One reading of the controller's instance details (``get_serve_instance_details``)."""
        now = self.clock()
        app = (details.get("applications") or {}).get(self.app) or {}
        deployment = (app.get("deployments") or {}).get(self.deployment)
        if deployment is None:
            return
        target = int(deployment["target_num_replicas"])
        states = [r["state"] for r in deployment.get("replicas", [])]
        new = [float(r["start_time_s"]) for r in deployment.get("replicas", []) if r["replica_id"] not in self.started]
        for r in deployment.get("replicas", []):
            self.started.setdefault(r["replica_id"], float(r["start_time_s"]))
        if len(self.started) > 4 * KEEP:  # (bounded: the oldest replicas' start times go first)
            for gone in sorted(self.started, key=self.started.__getitem__)[:KEEP]:
                del self.started[gone]
        if self.target is not None and target != self.target:
            at = min(new) if target > self.target and new else now  # (an upscale: when its replicas' actors started)
            self.decisions.append({"t_s": at, "old": self.target, "new": target})
        self.target = target
        row = {"target": target, "running": states.count("RUNNING"), "starting": states.count("STARTING"),
               "stopping": states.count("STOPPING")}
        if not self.timeline or {k: self.timeline[-1][k] for k in row} != row:
            self.timeline.append({"t_s": now, **row})

    def cold_starts(self, reports: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
        """Replica id -> its cold start's parts (``cold_start``), for every replica that reported its start (kept
        after it leaves; the most recent ``KEEP``)."""
        for r, s in reports.items():
            if r in self.started and s.get("start"):
                self.colds[r] = cold_start(self.started[r], s["start"])
        while len(self.colds) > KEEP:
            del self.colds[next(iter(self.colds))]
        return dict(self.colds)

    def stats(self, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"target": self.target, "timeline": list(self.timeline), "decisions": list(self.decisions),
                "cold_starts": self.cold_starts(reports)}


def cold_start(decided_s: float, start: dict[str, float | None]) -> dict[str, float | None]:
    """A replica's cold start in parts (seconds; the module docstring), from the decision's time and what the
    replica reported: wall-clock times ``init_s`` (its constructor began), ``loaded_s`` (ended), ``first_token_s``
    (None until it made one) and durations ``load_s``, ``compile_s`` (None: not compiled)."""
    first = start.get("first_token_s")
    return {"decided_s": decided_s, "actor_s": float(start["init_s"]) - decided_s,  # type: ignore[arg-type]
            "load_s": start["load_s"], "compile_s": start["compile_s"],
            "serving_s": None if first is None else float(first) - float(start["loaded_s"]),  # type: ignore[arg-type]
            "first_token_s": None if first is None else float(first) - decided_s}


class ScaledEngine(BoardedEngine):
    """The ingress's engine with the deployment's replicas over time and the autoscaler's decisions (``ScaleWatch``)
    in ``/stats`` (``scaling``) and ``/metrics`` (``replicas_target``, ``replicas_running``, ``scale_decisions``)."""

    def __init__(self, strategy: Any, model: Any, handle: Any, max_in_flight: int, board: Any, deployment: str,
                 app: str, settings: dict[str, Any] | None) -> None:
        super().__init__(strategy, model, handle, max_in_flight, board)
        self.watch, self.settings = ScaleWatch(deployment, app), settings
        self._watching: asyncio.Task[None] | None = None

    def start(self) -> None:
        super().start()
        self._watching = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        while True:
            with contextlib.suppress(Exception):  # (the controller busy or gone while the app stops)
                self.watch.observe(await controller.get_serve_instance_details.remote())
            self.watch.cold_starts({r: s for r, (s, _) in self.reports.items()})  # (kept: a replica may leave soon)
            await asyncio.sleep(REPORT_S)

    async def stop(self, in_flight_timeout_s: float = 60.0) -> None:
        if self._watching is not None:
            self._watching.cancel()
        await super().stop(in_flight_timeout_s)

    def metrics(self) -> list[Metric]:
        row = self.watch.timeline[-1] if self.watch.timeline else {}
        ups = sum(d["new"] > d["old"] for d in self.watch.decisions)
        return [*super().metrics(),
                gauge("replicas_target", "Replicas the autoscaler wants (Serve's target)", self.watch.target),
                gauge("replicas_running", "Replicas running (ready for requests)", row.get("running")),
                Metric("scale_decisions", "Changes of the replica target, by direction", "counter",
                       {"up": ups, "down": len(self.watch.decisions) - ups}, "direction")]

    def stats(self) -> dict[str, Any]:
        reports = {r: s for r, (s, _) in self.reports.items()}
        return {**super().stats(), "scaling": {"autoscaling": self.settings, **self.watch.stats(reports)}}
