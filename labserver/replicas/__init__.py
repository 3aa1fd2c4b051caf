"""Past one server: N replicas of any generation strategy on Ray Serve, one URL, a request router by name.

    with labserver.serve("gen-paged", "synthetic-gen:20+10", replicas=2, router="prefix-aware",
                         prefix_cache=True) as h:
        run_load_sync(h.url, mode="generate", ...)      # the same routes, every answer names its replica
        h.stats()["replicas"]                            # each replica's queue, running, KV blocks, hit rate

``labserver serve --replicas N --router NAME [--ray-address ADDR]`` does the same from the
shell; ``--replicas MIN:MAX`` (``replicas=(MIN, MAX)``) lets Ray Serve's autoscaler choose N
(``labserver.routing.autoscale``, ``labserver.replicas.watch``). Without an address a local Ray instance is started (``num_cpus`` logical CPUs) and
stopped with the handle; with one, or when this process already runs Ray, the app joins it
and only the app is removed at the end, never Ray. Routers: ``labserver.replicas.routers`` (Ray request
routers over ``labserver.routing``'s policies); ``docs/replicas.md`` has the lessons.

A local Ray started for a loopback ``host`` listens on loopback (``local_ray``): its GCS, raylet,
agents, workers and metrics exporter are reachable from this machine only, as labserver's own
port is, and so is each replica's inter-deployment gRPC server, which Serve would open on every
interface (``labserver.replicas.loopback``; docs/security.md).
Stopping drains first, as one server does: the ingress refuses new requests (503
``shutting_down``), finishes what it holds for up to ``drain_grace_s``, and ends the streams
still open with a ``shutting_down`` event, before Serve removes the app.

Ray is an optional extra (``pip install 'labserver[ray]'``; ``make`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ..config import ServerConfig
from ..models.cpu import on_fresh_thread
from ..routing.autoscale import Autoscaler
from ..server.guard import is_loopback

__all__ = ["APP", "ReplicasHandle", "ray_session", "serve_replicas"]

logger = logging.getLogger(__name__)
APP = "labserver"  # the Serve application's name


class ReplicasHandle:
    """What ``serve_replicas`` returns: the URL, the stats, ``stop()`` (also by leaving a ``with`` block)."""

    def __init__(self, url: str, config: ServerConfig, replicas: int, router: str, started_ray: bool,
                 started_serve: bool, disaggregate: tuple[int, int] | None = None,
                 autoscale: Autoscaler | None = None) -> None:
        self.url, self.config, self.replicas, self.router = url, config, replicas, router
        self.started_ray, self.started_serve = started_ray, started_serve
        self.disaggregate = disaggregate  # (P, D): prefill and decode pools
        self.autoscale = autoscale  # the autoscaler's settings (None: a fixed count of replicas)
        self.stopped = False

    def __repr__(self) -> str:
        pools = (f"{self.disaggregate[0]} prefill + {self.disaggregate[1]} decode" if self.disaggregate else
                 f"{self.autoscale.min_replicas}:{self.autoscale.max_replicas} autoscaled" if self.autoscale else
                 f"x{self.replicas}")
        return f"<labserver {self.config.strategy} {pools} replicas, router {self.router}, at {self.url}>"

    def fault(self, pool: str, when: str) -> None:
        """Fault injection (tests, lessons): one replica of ``pool`` ("Prefill", "Decode"; the router's pick) exits
        at ``when`` (``labserver.replicas.deploy.Replica.fault``); Serve starts a new one in its place."""
        from ray import serve

        off_loop(lambda: serve.get_deployment_handle(pool, app_name=APP).fault.remote(when).result(timeout_s=30))

    @property
    def api_key(self) -> str | None:
        """The ingress's first key (``api_keys``), for clients in this process; None without one."""
        return self.config.api_keys[0] if self.config.api_keys else None

    @property
    def headers(self) -> dict[str, str]:
        """What every request needs: ``Authorization: Bearer KEY`` when the ingress asks for a key."""
        return self.config.client_headers

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", headers=self.headers, timeout=30).json()  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Drain the ingress, remove the app; stop Serve and Ray only if this handle started them (never a
        cluster it joined)."""
        if self.stopped:
            return
        self.stopped = True
        import ray
        from ray import serve

        try:
            if self.url:
                self.drain()
            serve.delete(APP)
        finally:
            if self.started_serve:
                serve.shutdown()
            if self.started_ray:
                ray.shutdown()

    def drain(self) -> None:
        """What a single server does before it closes: new requests 503, the rest finished or ended (the module
        docstring). A drain that fails (the ingress already gone) is logged: removing the app still follows."""
        from ray import serve

        try:
            off_loop(lambda: serve.get_app_handle(APP).drain.remote().result(
                timeout_s=self.config.drain_grace_s + 30))
        except Exception as e:
            logger.warning("the ingress did not drain: %s", e)

    def __enter__(self) -> ReplicasHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def off_loop(call: Callable[[], Any]) -> Any:
    """``call()`` where Ray lets a handle's ``result()`` block: on this thread, or on a helper thread when this one
    runs an event loop (a Jupyter cell: Ray refuses to block a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return call()
    return on_fresh_thread(call)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_replicas(config: ServerConfig, replicas: int | tuple[int, int] | None = None, router: str = "pow2", *,
                   ray_address: str | None = None, num_cpus: float | None = None, max_ongoing: int | None = None,
                   models: list[str] | None = None, timeout_s: float = 300.0,
                   disaggregate: tuple[int, int] | None = None, pin_cores: bool = False,
                   threads: int | None = None, autoscale: Autoscaler | None = None,
                   graceful_shutdown_s: float = 60.0) -> ReplicasHandle:
    """Deploy ``replicas`` copies of ``config``'s server behind an ingress on Ray Serve; returns once it answers.

    ``models``: replica i serves ``models[i % len(models)]`` instead of ``config.model`` (one
    slower replica, say: ``["synthetic-gen:40+20"] + ["synthetic-gen:20+10"] * 3``); the
    ingress reads prompts with ``config.model``'s tokenizer, so they must share one.
    ``max_ongoing``: requests one replica holds (default 4 x max_batch_size); Ray's router
    holds the rest.
    ``disaggregate=(P, D)``: instead of ``replicas``, P prefill and D decode replicas, the KV
    handed over between them (``labserver.replicas.disagg``); ``router`` picks within each pool.
    ``pin_cores``: each replica's process on its own share of this machine's CPUs (prefill
    replicas first), one torch thread per core; ``threads``: torch threads per replica.
    ``replicas=(MIN, MAX)`` or ``autoscale=Autoscaler(...)``: as many replicas as Ray Serve's
    autoscaler decides (``labserver.routing.autoscale``; its target ongoing requests a replica's
    ``max_batch_size`` unless given); a replica scaled down is sent nothing new and has
    ``graceful_shutdown_s`` to finish what it holds. ``/stats`` shows the replicas over time, the
    decisions and each new replica's cold start under ``scaling`` (``labserver.replicas.watch``).
    """
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, RequestRouterConfig

    from .deploy import Board, Ingress, ReplicaServer
    from .disagg import core_groups
    from .routers import router_class

    from ..strategies import GenStrategy, make_strategy

    config.warn_if_exposed()
    if isinstance(replicas, tuple) or autoscale is not None:
        autoscale = autoscaler_for(config, replicas, autoscale, disaggregate)
        replicas = autoscale.max_replicas
    if (replicas is None) == (disaggregate is None):
        raise ValueError("give replicas=N or disaggregate=(P, D), not both" if replicas is not None else
                         "give replicas=N or disaggregate=(P, D)")
    pools = [replicas] if replicas is not None else list(disaggregate)  # type: ignore[arg-type]
    if len(pools) not in (1, 2) or min(pools) < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}" if replicas is not None else
                         f"disaggregate needs at least one prefill and one decode replica, got {disaggregate}")
    if not isinstance(make_strategy(config.strategy, config.limits), GenStrategy):
        raise ValueError(f"replicas serve generation (a gen-* strategy); {config.strategy} is an encoder strategy")
    if disaggregate is not None and config.strategy == "gen-hf-cb":
        raise ValueError("disaggregate hands KV blocks between labserver's own engines: gen-hf-cb (transformers' "
                         "manager) cannot; use gen-continuous or gen-paged")
    path = router_class(router)  # ValueError before anything starts
    total = sum(pools)
    if config.limits.max_batch_size is None:
        raise ValueError("replicas need max_batch_size (what each replica runs at once)")
    started = False
    if ray.is_initialized():  # this process already runs Ray (a notebook, a benchmark): join it, leave it running
        pass
    elif ray_address is None:
        start_local_ray(config.host, num_cpus or total + 1)
        started = True
    else:
        ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    started_serve = False
    try:
        if serve.status().proxies:  # Serve already runs on this Ray: its HTTP proxy keeps its own address
            host, port = serving_address(config)
        else:
            host, port = config.host, config.port or free_port(config.host)
            serve.start(http_options=HTTPOptions(host=host, port=port), logging_config={"log_level": "WARNING"})
            started_serve = True
        per_replica = max_ongoing or 4 * config.limits.max_batch_size  # its batch and a queue behind it
        cpu = 1.0 if num_cpus is None else num_cpus / (total + 1)
        board = Board.remote()
        groups = core_groups(sorted(os.sched_getaffinity(0)), total) if pin_cores else None

        def pool(name: str, n: int, first: int, route: str, *args: Any) -> Any:
            cores = groups[first:first + n] if groups else None
            count: dict[str, Any] = ({"num_replicas": n} if autoscale is None else  # (MAX x per_replica in flight)
                                     {"autoscaling_config": autoscale.ray_config(),
                                      "graceful_shutdown_timeout_s": graceful_shutdown_s,
                                      "graceful_shutdown_wait_loop_s": 0.5})
            return ReplicaServer.options(
                name=name, max_ongoing_requests=per_replica, ray_actor_options={"num_cpus": cpu * 0.9},
                request_router_config=RequestRouterConfig(request_router_class=route),
                health_check_period_s=1.0, health_check_timeout_s=10.0, **count,
            ).bind(config, board, models, *args, cores=cores, threads=threads)

        if disaggregate is None:
            replica, decode = pool("ReplicaServer", total, 0, path), None
        else:
            replica = pool("Prefill", pools[0], 0, router_class(router, pinned=True), "prefill", None)
            decode = pool("Decode", pools[1], pools[0], path, "decode", replica)
        watch = ("ReplicaServer", APP, None if autoscale is None else autoscale.settings())
        ingress = Ingress.options(ray_actor_options={"num_cpus": cpu * 0.1}, max_ongoing_requests=100_000
                                  ).bind(config, replica, board, total * per_replica, decode, watch)
        serve.run(ingress, name=APP, route_prefix="/", blocking=False)
        url = f"http://{host}:{port}"
        handle = ReplicasHandle(url, config, replicas or total, router, started, started_serve, disaggregate,
                                autoscale)
        wait_healthy(url, timeout_s)
        return handle
    except BaseException:
        ReplicasHandle("", config, total, router, started, started_serve).stop()
        raise


def autoscaler_for(config: ServerConfig, replicas: int | tuple[int, int] | None, autoscale: Autoscaler | None,
                   disaggregate: tuple[int, int] | None) -> Autoscaler:
    """The autoscaler ``serve_replicas`` deploys with: ``autoscale`` as given, or ``replicas=(MIN, MAX)`` with a
    target of ``max_batch_size`` ongoing requests a replica; ValueError for what cannot be combined."""
    if disaggregate is not None:
        raise ValueError("autoscaling scales one pool of replicas: give replicas=(MIN, MAX) without disaggregate")
    if autoscale is None:
        low, high = replicas  # type: ignore[misc]
        return Autoscaler(low, high, target_ongoing=float(config.limits.max_batch_size or 2))
    if isinstance(replicas, tuple) and replicas != (autoscale.min_replicas, autoscale.max_replicas):
        raise ValueError(f"replicas={replicas} and autoscale's {autoscale.min_replicas}:{autoscale.max_replicas} "
                         "differ: give one")
    return autoscale


@contextlib.contextmanager
def ray_session(num_cpus: float = 4, host: str = "127.0.0.1") -> Iterator[None]:
    """A local Ray and Serve for several deployments in turn (each ``serve_replicas`` inside joins them and removes
    only its app); both stopped at the end. Ray started on loopback for a loopback ``host`` (``local_ray``)."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    start_local_ray(host, num_cpus)
    try:
        serve.start(http_options=HTTPOptions(host=host, port=free_port(host)), logging_config={"log_level": "WARNING"})
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def start_local_ray(host: str, num_cpus: float) -> None:
    """A local Ray of ``num_cpus`` logical CPUs, quiet, on loopback for a loopback ``host`` (``local_ray``)."""
    import ray

    with local_ray(host) as node:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False, _node_ip_address=node)


@contextlib.contextmanager
def local_ray(host: str) -> Iterator[str | None]:
    """The node address a local Ray should start with for ``host``: loopback for a loopback host, else Ray's own
    choice (None: the machine's routable address).

    Ray binds each gRPC server (GCS, raylet, workers, agents, the metrics exporter) to loopback only when its
    node address is ``127.0.0.1``, but ``ray.init`` turns a loopback ``_node_ip_address`` into the routable
    one (``services.resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off, the
    switch Ray itself reads (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) to keep a laptop's Ray on loopback. It
    is off for the length of this block only; Ray's token authentication is untouched.
    """
    if not is_loopback(host):
        yield None
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield "127.0.0.1"
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def serving_address(config: ServerConfig) -> tuple[str, int]:
    """The HTTP address of a Serve instance this process did not start."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config  # (Serve has no public getter for it)
    return ("127.0.0.1" if http.host in ("0.0.0.0", "") else http.host), int(http.port)


def wait_healthy(url: str, timeout_s: float) -> None:
    """Until the ingress answers /health with 200 (its model loaded, the replicas deployed)."""
    from ray import serve

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        status = serve.status().applications.get(APP)
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"replicas failed to deploy: {status.message}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # Serve offers no ready event to the caller; this is a bounded poll
    raise TimeoutError(f"replicas not healthy within {timeout_s:.0f} s")
