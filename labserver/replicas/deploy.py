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
import os
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from ..config import ServerConfig
from ..engine.base import ReplicaLost
from ..engine.handover import HandoverConnector, handover_lost
from ..engine.output import Done, Failed, Made, Placed, Pulled
from ..models import Sampling
from ..models.grammar import Constraint
from ..server import create_app
from ..server.handling import describe
from ..server.streaming import write_stream
from ..server.runtime import Runtime
from .disagg import DisaggEngine
from .loopback import keep_serve_grpc_on_loopback
from .remote import REPORT_S, RemoteEngine
from .watch import ScaledEngine

__all__ = ["Board", "Ingress", "Replica", "ReplicaServer", "Reports"]

logger = logging.getLogger(__name__)
PULL_TIMEOUT_S = 30.0  # a decode replica gives up on a pull after this long (the prefill replica is gone)


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


class Replica:
    """One labserver runtime; ``generate`` streams one sequence's events (``remote`` says which).

    Disaggregated (``labserver.replicas.disagg``), the same class serves both pools: a
    prefill replica's ``generate`` takes jobs with ``remote_decode`` (its first token, then its KV
    parked by its engine's ``HandoverConnector``) and its ``pull`` hands the KV over; a decode replica's takes jobs with ``kv`` (the
    prefill replica and ticket) and pulls before it submits. ``cores``: the CPUs this replica's
    process may run on (pinned, one torch thread each); ``threads``: torch threads (None: torch's
    default).
    """

    async def __init__(self, config: ServerConfig, board: Any, models: list[str] | None = None, role: str = "",
                       prefill: Any = None, *, cores: list[list[int]] | None = None,
                       threads: int | None = None) -> None:  # (placement by keyword: never taken for a role)
        began_s = time.time()  # (its cold start's parts: labserver.replicas.watch)
        keep_serve_grpc_on_loopback()
        context = serve.get_replica_context()
        self.rank = context.rank.rank if context.rank is not None else 0
        self.role, self.prefill, self.crash = role, prefill, ""
        if models:  # heterogeneous replicas: replica i serves models[i % len(models)] (e.g. one slower)
            config = dataclasses.replace(config, model=models[self.rank % len(models)])
        self.threads = pin(cores[self.rank % len(cores)] if cores else None, threads)
        self.runtime = Runtime(config)
        await self.runtime.start()
        await self.runtime.wait_loaded()
        if not self.runtime.healthy():
            raise RuntimeError(f"replica failed to start: {self.runtime.load_error}")
        if role:  # disaggregated: KV crosses engines through a connector (colocated replicas have none)
            self.connector = HandoverConnector(self.runtime.engine)
            self.runtime.engine.connect(self.connector)  # type: ignore[union-attr]
        self.id = context.replica_id.unique_id
        self.board = board
        self.start = {"init_s": began_s, "load_s": self.runtime.load_s, "compile_s": self.runtime.compile_s,
                      "loaded_s": time.time(), "first_token_s": None}
        self._report = asyncio.get_running_loop().create_task(self._reporting())

    async def _reporting(self) -> None:
        while True:
            engine = self.runtime.engine
            if engine is not None:
                stats = {**engine.stats(), "answered": self.runtime.statuses[200], "rank": self.rank,
                         "model": self.runtime.config.model, "role": self.role or "both", "threads": self.threads,
                         "start": self.start,
                         "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
                with contextlib.suppress(Exception):  # (the board is gone while the app stops)
                    await self.board.put.remote(self.id, stats, engine.metrics())
            await asyncio.sleep(REPORT_S)

    async def generate(self, job: dict[str, Any]) -> Any:
        """The sequence's events (``labserver.engine.output``): where, what it made as it comes, how it ended."""
        yield Placed(self.id)
        engine: Any = self.runtime.engine
        try:
            copy = None
            if job.get("kv"):  # a decode replica's: the KV first, from the prefill replica that holds it
                self._fault("pull")
                start = time.perf_counter()
                copy = await self._pull(job["kv"])
                yield Pulled((time.perf_counter() - start) * 1000, copy.positions * engine.model.kv_bytes_per_token)
            sampling = Sampling(**job["sampling"]) if job.get("sampling") else None
            constraint = job.get("constraint")
            grammar = await engine.grammar(Constraint(**constraint)) if constraint else None
            seq = engine.submit(job["prompt_ids"], job["max_new_tokens"], ignore_eos=job["ignore_eos"],
                                request_id=job["request_id"], sampling=sampling, stop=tuple(job["stop"]),
                                min_tokens=job["min_tokens"], priority=job.get("priority", 0),
                                tenant=job.get("tenant", ""), cache_salt=job.get("cache_salt", ""),
                                remote_decode=bool(job.get("remote_decode")), kv_transfer=copy, grammar=grammar)
            if job.get("remote_decode"):
                self._fault("prefill")
        except Exception as e:
            yield Failed(*describe(e)[:2])
            return
        # the one stream loop, as /generate and /v1 stream (its ending counted the same way; an ingress that
        # stops reading cancels the sequence, dropped at the next step)
        async for event in write_stream(self.runtime, [seq], job["request_id"], time.perf_counter(), _Events(seq)):
            if self.start["first_token_s"] is None and isinstance(event, Made):
                self.start["first_token_s"] = time.time()
            yield event

    async def _pull(self, kv: dict[str, Any]) -> Any:
        """The KV a prefill replica parked for this sequence (``{"replica", "ticket"}``), through the prefill pool's
        handle pinned to that replica; ReplicaLost when it cannot be had within ``PULL_TIMEOUT_S``."""
        try:
            return await asyncio.wait_for(self.prefill.options(method_name="pull").remote(kv), PULL_TIMEOUT_S)
        except ReplicaLost:  # (Ray's error for a pull that raised is an instance of its cause too)
            raise handover_lost(kv["ticket"]) from None
        except Exception as e:
            raise ReplicaLost(f"the prefill replica holding this request's KV could not be reached "
                              f"({type(e).__name__}); retry") from None

    async def pull(self, kv: dict[str, Any]) -> Any:
        """A prefill replica's: the KV parked under ``kv["ticket"]`` (``HandoverConnector.pull``), its blocks given
        back."""
        return await self.connector.pull(int(kv["ticket"]))

    def fault(self, when: str) -> None:
        """Fault injection for tests and lessons, through a Ray handle only (no route reaches it): this replica's
        process exits at ``when``: "prefill" (a prefill replica, its next prompt submitted and not yet computed) or
        "pull" (a decode replica, its next hand-over received and not yet pulled)."""
        self.crash = when

    def _fault(self, when: str) -> None:
        if self.crash == when:
            logger.warning("replica %s: fault injected at %s: exiting", self.id, when)
            os._exit(1)

    def check_health(self) -> None:
        if not self.runtime.healthy():
            raise RuntimeError("replica engine is not healthy")

    async def __del__(self) -> None:
        self._report.cancel()
        await self.runtime.stop()


ReplicaServer = serve.deployment(Replica)


def pin(cores: list[int] | None, threads: int | None) -> int | None:
    """This process on ``cores`` only, with one torch thread per core; or only ``threads`` torch threads. Returns
    the torch threads it set (None: torch's default)."""
    if cores:
        os.sched_setaffinity(0, cores)
        threads = threads or len(cores)
    if threads:
        import torch

        torch.set_num_threads(threads)
    return threads


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

    def __init__(self, config: ServerConfig, replicas: Any, board: Any, max_in_flight: int, decode: Any = None,
                 watch: tuple[str, str, dict[str, Any] | None] = ("ReplicaServer", "labserver", None)) -> None:
        """``decode``: disaggregated, the decode pool's handle (``replicas`` is then the prefill pool's). ``watch``:
        the replica deployment's name, the app's, and the autoscaler's settings (None: a fixed count), for
        ``labserver.replicas.watch``."""
        keep_serve_grpc_on_loopback()
        self.config, self.replicas, self.board, self.max_in_flight = config, replicas, board, max_in_flight
        self.decode, self.watch = decode, watch

    def __serve_build_asgi_app__(self) -> Any:
        def engine(strategy: Any, model: Any) -> RemoteEngine:
            if self.decode is not None:
                return DisaggEngine(strategy, model, self.replicas, self.max_in_flight, self.board, self.decode)
            return ScaledEngine(strategy, model, self.replicas, self.max_in_flight, self.board, *self.watch)

        app = create_app(self.config, engine_factory=engine)
        self.runtime: Runtime = app.state.runtime
        return app

    async def drain(self) -> None:
        """Before the app is removed (``ReplicasHandle.stop``): what a single server does before it closes."""
        await self.runtime.drain()
