"""N replicas of one strategy and model on Ray Serve, behind one ingress and one request router.

The shape of Ray Serve's own LLM serving: an **ingress** deployment holds the HTTP side
(labserver's whole app: parsing, validation, errors, ``/generate`` and ``/v1``) and calls
the **replica** deployment through a ``DeploymentHandle``; the request router configured
on the replica deployment picks the replica for each call. Bad input is refused at the
ingress and never reaches a replica. Each replica is a labserver runtime (model, engine,
scheduler) in its own Ray actor, streaming a sequence's tokens back as they are made.

Replicas report their ``/stats`` to a small ``Board`` actor twice a second; the ingress's
``/stats`` shows them all under ``replicas`` (id -> queue, running sequences, KV blocks,
prefix-cache hit rate, ...).

The ingress's ``drain`` is called through a handle before the app is removed, so stopping ends
every request as a single server's stop does; Serve's own removal would cut the streams.

Imports Ray: only ``labserver.replicas.serve_replicas`` loads this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from ..config import ServerConfig
from ..engine.output import Done, Failed, Made, Placed
from ..models import Sampling
from ..server import create_app
from ..server.handling import describe
from ..server.streaming import write_stream
from ..server.runtime import Runtime
from .remote import RemoteEngine

__all__ = ["Board", "Ingress", "ReplicaServer", "Reports"]

logger = logging.getLogger(__name__)
REPORT_S = 0.5  # how often a replica sends the board its stats


class Reports:
    """The replicas' latest stats, by replica id: one not heard from in ``max_age_s`` is left out of ``all``, and
    one not heard from in ``FORGET_S`` is forgotten (a replica that died, or was replaced, never reports again)."""

    FORGET_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.reports: dict[str, tuple[float, dict[str, Any], list[Any]]] = {}

    def put(self, replica: str, stats: dict[str, Any], metrics: list[Any]) -> None:
        now = self.clock()
        self.reports[replica] = (now, stats, metrics)
        for gone in [r for r, (t, _, _) in self.reports.items() if now - t > self.FORGET_S]:
            del self.reports[gone]

    def all(self, max_age_s: float = 5.0) -> dict[str, tuple[dict[str, Any], list[Any]]]:
        """replica -> (its /stats, its metrics()), for those heard from in the last ``max_age_s``."""
        now = self.clock()
        return {r: (s, m) for r, (t, s, m) in sorted(self.reports.items()) if now - t <= max_age_s}


Board = ray.remote(num_cpus=0)(Reports)  # the actor every replica reports to and the ingress reads


@serve.deployment
class ReplicaServer:
    """One labserver runtime; ``generate`` streams one sequence's events (``remote`` says which)."""

    async def __init__(self, config: ServerConfig, board: Any, models: list[str] | None = None) -> None:
        context = serve.get_replica_context()
        self.rank = context.rank.rank if context.rank is not None else 0
        if models:  # heterogeneous replicas: replica i serves models[i % len(models)] (e.g. one slower)
            config = dataclasses.replace(config, model=models[self.rank % len(models)])
        self.runtime = Runtime(config)
        await self.runtime.start()
        await self.runtime.wait_loaded()
        if not self.runtime.healthy():
            raise RuntimeError(f"replica failed to start: {self.runtime.load_error}")
        self.id = context.replica_id.unique_id
        self.board = board
        self._report = asyncio.get_running_loop().create_task(self._reporting())

    async def _reporting(self) -> None:
        while True:
            engine = self.runtime.engine
            if engine is not None:
                stats = {**engine.stats(), "answered": self.runtime.statuses[200], "rank": self.rank,
                         "model": self.runtime.config.model}
                with contextlib.suppress(Exception):  # (the board is gone while the app stops)
                    await self.board.put.remote(self.id, stats, engine.metrics())
            await asyncio.sleep(REPORT_S)

    async def generate(self, job: dict[str, Any]) -> Any:
        """The sequence's events (``labserver.engine.output``): where, what it made as it comes, how it ended."""
        yield Placed(self.id)
        engine: Any = self.runtime.engine
        try:
            sampling = Sampling(**job["sampling"]) if job.get("sampling") else None
            seq = engine.submit(job["prompt_ids"], job["max_new_tokens"], ignore_eos=job["ignore_eos"],
                                request_id=job["request_id"], sampling=sampling, stop=tuple(job["stop"]),
                                min_tokens=job["min_tokens"], priority=job.get("priority", 0),
                                tenant=job.get("tenant", ""), cache_salt=job.get("cache_salt", ""))
        except Exception as e:
            yield Failed(*describe(e)[:2])
            return
        # the one stream loop, as /generate and /v1 stream (its ending counted the same way; an ingress that
        # stops reading cancels the sequence, dropped at the next step)
        async for event in write_stream(self.runtime, [seq], job["request_id"], time.perf_counter(), _Events(seq)):
            yield event

    def check_health(self) -> None:
        if not self.runtime.healthy():
            raise RuntimeError("replica engine is not healthy")

    async def __del__(self) -> None:
        self._report.cancel()
        await self.runtime.stop()


class _Events:
    """How a replica writes one sequence's stream: typed events (``labserver.engine.output``), not bytes."""

    def __init__(self, seq: Any) -> None:
        self.seq, self.sent = seq, 0

    def pending(self) -> Made | None:
        """What it made since the last event (the first: with its prefill's own time, to split TTFT at the ingress)."""
        if len(self.seq.tokens) <= self.sent:
            return None
        made, self.sent = Made.since(self.seq, self.sent), len(self.seq.tokens)
        return made

    def open(self) -> list[Any]:
        return [] if self.seq.future.done() else [self.seq]

    def done(self) -> Done:
        return Done.of(self.seq)

    def failed(self, kind: str, message: str, error: BaseException) -> Failed:
        return Failed(kind, message)


@serve.deployment
@serve.ingress()
class Ingress:
    """labserver's app, its engine handing every sequence to the replicas (``RemoteEngine``)."""

    def __init__(self, config: ServerConfig, replicas: Any, board: Any, max_in_flight: int) -> None:
        self.config, self.replicas, self.board, self.max_in_flight = config, replicas, board, max_in_flight

    def __serve_build_asgi_app__(self) -> Any:
        def engine(strategy: Any, model: Any) -> RemoteEngine:
            return BoardedEngine(strategy, model, self.replicas, self.max_in_flight, self.board)

        app = create_app(self.config, engine_factory=engine)
        self.runtime: Runtime = app.state.runtime
        return app

    async def drain(self) -> None:
        """Before the app is removed (``ReplicasHandle.stop``): what a single server does before it closes."""
        await self.runtime.drain()


class BoardedEngine(RemoteEngine):
    """A RemoteEngine whose stats include every replica's, read from the board."""

    def __init__(self, strategy: Any, model: Any, handle: Any, max_in_flight: int, board: Any) -> None:
        super().__init__(strategy, model, handle, max_in_flight)
        self.board = board
        self.reports: dict[str, tuple[dict[str, Any], list[Any]]] = {}
        self._poll: asyncio.Task[None] | None = None

    def start(self) -> None:
        super().start()
        self._poll = asyncio.get_running_loop().create_task(self._polling())

    async def _polling(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.reports = await self.board.all.remote()
            await asyncio.sleep(REPORT_S)

    async def stop(self, in_flight_timeout_s: float = 60.0) -> None:
        if self._poll is not None:
            self._poll.cancel()
        await super().stop(in_flight_timeout_s)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "replicas": {r: s for r, (s, _) in self.reports.items()}}

    def by_replica(self) -> dict[str, list[Any]]:
        return {r: m for r, (_, m) in self.reports.items()}
