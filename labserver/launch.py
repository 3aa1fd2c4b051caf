"""Start and stop a real uvicorn server from code: a notebook cell, a test, the CLI.

``serve(...)`` runs the server on its own thread and event loop, so a notebook
kernel stays free (and it works inside a running Jupyter kernel). ``attach=True``
or ``await serve_async(...)`` puts it on the caller's own loop instead, so a
notebook can *show* what a model running on the loop does to everything else.

The socket is bound here, before uvicorn starts: port 0 gets a free port whose
number is known at once, and a busy port is an ``OSError`` naming the port, not
uvicorn's ``SystemExit``. Signal handlers are installed only by the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import uvicorn

from .config import DEFAULT_STRATEGY, ServerConfig, default_model
from .models import GenModel, Model, ModelLoadError, release_openmp_threads
from .server import Runtime, create_app, stats_dict
from .server.connections import protocol_class
from .wire import allow_open_files

logger = logging.getLogger(__name__)


class PortInUse(OSError):
    """The address could not be bound."""


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio and uvloop set TCP_NODELAY on accepted
    # connections only when the listening socket says TCP. Without it, a reply on a
    # kept-alive connection can sit ~40 ms behind Nagle and the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a listener still blocks
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUse(e.errno, f"cannot listen on {host}:{port} ({e.strerror}); "
                                 "choose another port, or port=0 for a free one") from e
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's Server, minus signal handlers unless asked, plus a drain before shutdown."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime, signals: bool) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.signals = signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.signals:
            with super().capture_signals():
                yield
        else:
            yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Answer everything queued (finish it, or 503 after drain_grace_s) while the
        # connections are still open, so no client is left hanging by the close below.
        await self.runtime.drain()
        await super().shutdown(sockets)


def build_server(config: ServerConfig, model: Model | GenModel | None = None, signals: bool = False) -> _Server:
    app = create_app(config, model)
    allow_open_files(config.max_connections + 256)  # (and the model's files, the loop's, a notebook's)
    uv = uvicorn.Config(
        app,
        log_config=None,  # a library must not reconfigure the caller's logging
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=config.drain_grace_s + 5,
        http=protocol_class(config.read_timeout_s, config.max_connections),
        proxy_headers=False,  # nothing here reads the client's address: skip X-Forwarded-* on every request
        # httptools (above, with a read deadline and a connection bound); uvicorn's 'auto' picks uvloop
    )
    return _Server(uv, app.state.runtime, signals)


class ServerHandle:
    """A running labserver: its URL, its numbers, and how to stop it. A context manager."""

    def __init__(self, server: _Server, sock: socket.socket, config: ServerConfig) -> None:
        self.server = server
        self.runtime: Runtime = server.runtime
        self.config = config
        self.host, self.port = sock.getsockname()[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        self._sock = sock
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else self.runtime.state
        return f"<labserver {self.config.strategy} {self.config.model} at {self.url} ({state})>"

    # -- reading it -----------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        """Run fn on the server's loop when that is another thread's, so reads are consistent."""
        loop = self._loop
        if self._thread is None or loop is None or not loop.is_running():
            return fn(*args)

        async def call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def stats(self, batches: int = 0) -> dict[str, Any]:
        """What ``GET /stats`` returns, read directly."""
        return self._call(stats_dict, self.runtime, batches)

    def batches(self) -> list[dict[str, Any]]:
        """Every recorded batch (size, reason, queue wait, compute time), oldest first."""
        engine = self.runtime.engine
        return self._call(lambda: engine.batch_log() if engine is not None else [])

    def steps(self, last: int | None = None) -> list[dict[str, Any]]:
        """The generation engine's step log (who was in each prefill and decode step), oldest first."""
        engine = self.runtime.engine
        return self._call(lambda: engine.step_log(last) if engine is not None else [])

    def loop_lag(self) -> list[tuple[float, float]]:
        """(t_s, lag_ms) samples of the server's event-loop lag."""
        return self._call(lambda: list(self.runtime.lag.samples))

    @property
    def ready(self) -> bool:
        return self.runtime.healthy()

    @property
    def api_key(self) -> str | None:
        """The server's first key (``api_keys``, ``--api-key``), for clients in this process; None without one."""
        return self.config.api_keys[0] if self.config.api_keys else None

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this server needs: ``Authorization: Bearer KEY`` when it asks for a key."""
        return self.config.client_headers

    @property
    def stopped(self) -> bool:
        if self._thread is not None:
            return not self._thread.is_alive()
        return self._task is None or self._task.done()

    # -- stopping it ------------------------------------------------------------------------
    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and stop. From the caller's own loop (attach mode) use ``await handle.astop()``."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(5)
        elif self._task is not None and not self._task.done():
            logger.info("stop() on an attached server only asks it to exit; await handle.astop() to wait")

    async def astop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        elif self._thread is not None:
            await asyncio.to_thread(self.stop)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> ServerHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()


def _prepare(strategy: str, model: str | Model | GenModel | None, host: str, port: int, options: dict[str, Any]
             ) -> tuple[ServerConfig, Model | GenModel | None]:
    model = default_model(strategy) if model is None else model  # the default of the strategy's kind
    obj = None if isinstance(model, str) else model
    spec = model if isinstance(model, str) else getattr(model, "name", type(model).__name__)
    return ServerConfig.build(strategy=strategy, model=spec, host=host, port=port, **options), obj


def serve(
    strategy: str = DEFAULT_STRATEGY,
    model: str | Model | GenModel | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    wait: bool = True,
    attach: bool = False,
    timeout_s: float = 600.0,
    replicas: int | tuple[int, int] | None = None,
    router: str = "pow2",
    ray_address: str | None = None,
    replica_models: list[str] | None = None,
    disaggregate: tuple[int, int] | None = None,
    pin_cores: bool = False,
    autoscale: Any = None,
    graceful_shutdown_s: float = 60.0,
    **options: Any,
) -> Any:
    """Start a labserver and return its handle once it listens (and, with wait, once loaded).

    ``options`` are ServerConfig fields and Limits knobs: max_batch_size, max_wait_ms,
    max_queue, timeout_ms, idle_dispatch, device, dtype, task, debug, ... A model that
    fails to load raises ModelLoadError (the server is stopped) unless ``wait=False``,
    which returns at once and leaves ``/health`` to tell.

    ``attach=True`` schedules the server on the event loop running in this thread
    (a Jupyter kernel has one) and returns immediately; it starts when the cell ends.

    ``replicas=N`` deploys N copies on Ray Serve behind one URL, ``router`` choosing the
    replica for each request (``labserver.replicas``: random, round-robin, pow2,
    least-loaded, prefix-hash, prefix-aware); ``ray_address`` joins a running cluster instead
    of starting a local Ray; ``replica_models`` gives replica i its own model spec (one slower
    replica, say). The handle's ``stop()`` (or the end of a ``with`` block) removes it.
    ``disaggregate=(P, D)`` instead: P prefill and D decode replicas, the KV handed over
    between them (``labserver.replicas.disagg``); ``pin_cores`` gives each replica its own CPUs.
    ``replicas=(MIN, MAX)`` (or ``autoscale=labserver.routing.Autoscaler(...)``): Ray Serve's
    autoscaler adds and removes replicas between MIN and MAX as the load asks; one scaled down
    has ``graceful_shutdown_s`` to finish its requests.
    """
    config, obj = _prepare(strategy, model, host, port, options)
    release_openmp_threads()  # this thread's OpenMP workers would slow the model thread's (models.cpu)
    if replicas is not None or disaggregate is not None or autoscale is not None:  # (serve_replicas warns too)
        return _serve_replicas(config, obj, replicas, router, ray_address, attach, timeout_s, replica_models,
                               disaggregate, pin_cores, autoscale, graceful_shutdown_s)
    config.warn_if_exposed()
    sock = bind_socket(config.host, config.port)
    server = build_server(config, obj)
    handle = ServerHandle(server, sock, config)
    if attach:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            sock.close()
            raise RuntimeError("attach=True needs an event loop running in this thread "
                               "(a Jupyter kernel has one); use serve() without attach here") from None
        handle._loop = loop
        handle._task = loop.create_task(server.serve(sockets=[sock]), name="labserver-uvicorn")
        return handle

    def run() -> None:
        try:
            _run_loop(server, _serve_here(handle, sock))
        except BaseException as e:  # surfaced to the caller of serve(), not lost in a thread
            handle._error = e
        finally:
            sock.close()

    handle._thread = threading.Thread(target=run, name=f"labserver-{config.port or 'server'}", daemon=True)
    handle._thread.start()
    end_s = time.monotonic() + timeout_s
    while not server.started:  # uvicorn offers no start event; this is a bounded poll of its flag
        if not handle._thread.is_alive():
            raise RuntimeError(f"labserver failed to start: {handle._error!r}") from handle._error
        if time.monotonic() > end_s:
            handle.stop()
            raise TimeoutError(f"labserver did not start within {timeout_s} s")
        time.sleep(0.005)
    if wait:
        assert handle._loop is not None
        asyncio.run_coroutine_threadsafe(handle.runtime.wait_loaded(), handle._loop).result(timeout_s)
        _raise_if_failed(handle)
    return handle


def _serve_replicas(config: ServerConfig, obj: Any, replicas: int | tuple[int, int] | None, router: str,
                    ray_address: str | None, attach: bool, timeout_s: float, models: list[str] | None,
                    disaggregate: tuple[int, int] | None = None, pin_cores: bool = False, autoscale: Any = None,
                    graceful_shutdown_s: float = 60.0) -> Any:
    if obj is not None:
        raise ValueError("replicas load their model by name in their own processes: pass a spec "
                         "(e.g. 'gpt2-random'), not a model object")
    if attach:
        raise ValueError("replicas run on Ray Serve, not on this event loop: use serve(..., replicas=N) without attach")
    from .replicas import serve_replicas

    return serve_replicas(config, replicas, router, ray_address=ray_address, timeout_s=timeout_s, models=models,
                          disaggregate=disaggregate, pin_cores=pin_cores, autoscale=autoscale,
                          graceful_shutdown_s=graceful_shutdown_s)


async def _serve_here(handle: ServerHandle, sock: socket.socket) -> None:
    handle._loop = asyncio.get_running_loop()
    await handle.server.serve(sockets=[sock])


def _raise_if_failed(handle: ServerHandle) -> None:
    if handle.runtime.state == "failed":
        handle.stop()
        raise ModelLoadError(handle.runtime.load_error or "model failed to load")


async def serve_async(
    strategy: str = DEFAULT_STRATEGY,
    model: str | Model | GenModel | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    wait: bool = True,
    **options: Any,
) -> ServerHandle:
    """Like ``serve(attach=True)``, but awaits until it listens (and is loaded, with wait)."""
    handle = serve(strategy, model, host=host, port=port, attach=True, **options)
    assert handle._task is not None
    while not handle.server.started:
        if handle._task.done():
            handle._task.result()  # re-raise what stopped it
            raise RuntimeError("labserver stopped during startup")
        await asyncio.sleep(0.005)
    if wait:
        await handle.runtime.wait_loaded()
        if handle.runtime.state == "failed":
            await handle.astop()
            raise ModelLoadError(handle.runtime.load_error or "model failed to load")
    return handle


def serve_each(strategies: Any, model: Any, **knobs: Any) -> Iterator[tuple[str, ServerHandle]]:
    """Start each strategy in turn and yield ``(label, handle)``; each is stopped before the next starts.

    ``strategies`` is a list of names, or ``{label: options}`` where the options
    (``strategy`` among them, else the label is the strategy's name) are added to
    ``knobs`` for that server only. ``model`` is a spec or, better, a loaded object,
    so it loads once for all of them.
    """
    plan = strategies if isinstance(strategies, Mapping) else {name: {} for name in strategies}
    for label, own in plan.items():
        options = {**knobs, **own}
        strategy = options.pop("strategy", label)
        with serve(strategy, model, **options) as handle:
            yield label, handle


def run_forever(config: ServerConfig) -> None:
    """The CLI's blocking run: signal handlers on, Ctrl-C drains and stops."""
    config.warn_if_exposed()
    sock = bind_socket(config.host, config.port)
    server = build_server(config, signals=True)
    try:
        _run_loop(server, server.serve(sockets=[sock]))
    finally:
        sock.close()


def _run_loop(server: _Server, coro: Any) -> None:
    """Run on a fresh loop of uvicorn's choosing (uvloop when installed: faster on loopback)."""
    if not server.config.loaded:
        server.config.load()
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(coro)
