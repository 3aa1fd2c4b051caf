"""What one running app holds: the model, the engine, the response counts.

``Runtime`` loads the model in the background at startup (``/health`` says 503 until
it is ready, or for good if loading failed), starts the engine the strategy's kind
calls for (``labserver.engine.make_engine``), drains it at shutdown, and keeps the
response counts that ``/stats`` and ``/metrics`` report. The routes that use it are
in ``labserver.server``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..config import ServerConfig
from ..engine import EngineBase, make_engine
from ..models import GenModel, Model, ModelLoadError, load_model, on_fresh_thread
from ..strategies import GenStrategy, make_strategy, strategy_names
from .looplag import LagMonitor

logger = logging.getLogger(__name__)


class Runtime:
    """Everything one running app holds: the model, the engine, the counters."""

    def __init__(self, config: ServerConfig, model: Model | GenModel | None = None,
                 engine_factory: Callable[[Any, Any], EngineBase] = make_engine) -> None:
        """``engine_factory(strategy, model)``: another engine behind the same routes (replicas' ingress)."""
        self.config = config
        self.engine_factory = engine_factory
        self.strategy = make_strategy(config.strategy, config.limits)  # validate names eagerly
        self.model: Model | GenModel | None = model
        self.engine: EngineBase | None = None
        self.state = "loading"  # loading -> ready | failed; stopping at shutdown
        self.load_error: str | None = None
        self.load_s: float | None = None  # how long the model took to load (None: given loaded, or not yet)
        self.compile_s: float | None = None  # how long its compile took (None: not compiled)
        self.decode = "eager"  # a generator's decode steps: "compiled", "cuda graphs", or "eager" (why, where auto
        #   chose it)
        self.statuses: Counter[int] = Counter()
        self.started_s = time.time()
        self.lag = LagMonitor(config.lag_interval_ms)
        self._ids = itertools.count(1)
        self._prefix = f"{secrets.token_hex(3)}-"  # per server start: ids stay unique across servers in one process
        self._load_task: asyncio.Task[None] | None = None
        self.latency_observer: Callable[[float], None] | None = None  # set by labserver.server.metrics
        self.registry: Any = None  # the app's Prometheus registry, set with it

    def request_id(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    async def start(self) -> None:
        self.lag.start()
        self._load_task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        cfg = self.config
        generate = isinstance(self.strategy, GenStrategy)
        try:
            if self.model is None:
                began = time.perf_counter()
                self.model = await asyncio.to_thread(load_model, cfg.model, device=cfg.device, dtype=cfg.dtype,
                                                     task=cfg.task, kind=self.strategy.kind,
                                                     paged=self.strategy.paged)
                self.load_s = time.perf_counter() - began
            if generate != isinstance(self.model, GenModel):
                raise ModelLoadError(_mismatch(self.strategy.name, cfg.model, generate))
            limits = self.strategy.limits
            if limits.cuda_graphs and limits.compile is True:
                raise ModelLoadError("--cuda-graphs and --compile each take over the decode step: choose one")
            if limits.cuda_graphs:
                from ..models.graphs import use_cuda_graphs

                use_cuda_graphs(self.model, limits.max_batch_size)
                self.decode = "cuda graphs"
            elif self.engine_factory is make_engine and (limits.compile is True or limits.compile == "auto"
                                                         and generate):  # (an ingress's replicas run the model)
                await self._compile(limits.compile == "auto")
        except ModelLoadError as e:
            self.state, self.load_error = "failed", str(e)
            logger.error("model %r failed to load: %s", cfg.model, e, exc_info=e.__cause__)
            return
        except Exception as e:  # anything else while loading is a load failure too, not a crash
            self.state, self.load_error = "failed", f"{type(e).__name__}: {e}"
            logger.exception("model %r failed to load", cfg.model)
            return
        if cfg.freeze_gc:
            # Python's full (generation 2) garbage collection walks every container object
            # alive: with torch and transformers imported that is hundreds of thousands, a
            # pause of 50-200 ms on 2 cores, the loop and the model thread both stopped (the
            # GIL). Freezing moves everything that exists now, the model included, out of the
            # collector's sight, so later collections walk only what serving allocates.
            gc.freeze()
        try:
            self.engine = self.engine_factory(self.strategy, self.model)
        except ModelLoadError as e:  # an engine that cannot drive this model here (say, its library's version)
            self.state, self.load_error = "failed", str(e)
            logger.error("strategy %r cannot serve %r: %s", self.strategy.name, cfg.model, e)
            return
        self.engine.start()
        try:
            await self.engine.ready()
        except ModelLoadError as e:  # it started, and found it cannot serve this model (gen-hf-cb's probe)
            await self.engine.stop()
            self.state, self.load_error = "failed", str(e)
            logger.error("strategy %r cannot serve %r: %s", self.strategy.name, cfg.model, e)
            return
        self.state = "ready"
        logger.info("serving %s with strategy %s", self.model.name, self.strategy.name)

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def drain(self) -> None:
        """Finish queued work (up to drain_grace_s), answer the rest 503; new requests get 503."""
        if self.state == "ready":
            self.state = "stopping"
        if self.engine is not None:
            await self.engine.drain(self.config.drain_grace_s)

    async def stop(self) -> None:
        await self.drain()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        if self.engine is not None:
            await self.engine.stop()
        self.lag.stop()

    async def _compile(self, auto: bool) -> None:
        """The decode steps through torch.compile (``--compile``), before the engine starts. ``auto`` (the server's
        default): only where they can compile (``models.graphs.compile_blocker``), and eager, with a warning, if the
        compile fails; asked for (``--compile on``), a failure fails the load."""
        from ..models.graphs import compile_blocker, compiled_cache, use_compiled

        cfg = self.config
        if auto and (blocker := compile_blocker(self.model)) is not None:
            self.decode = f"eager: {blocker}"
            logger.info("%s's decode steps run eagerly: %s", cfg.model, blocker)
            return
        logger.info("compiling %s's decode steps (torch.compile; the first time on a machine ~2 min on 2 cores, "
                    "then read from %s; --compile off to skip)", cfg.model, compiled_cache())
        try:
            # (made and warmed on a thread that ends with it: stacking the weights and the compile run parallel
            # ops, and any other thread that does keeps an OpenMP team beside the model thread's; models.cpu)
            self.compile_s = await asyncio.to_thread(on_fresh_thread, lambda: use_compiled(self.model).warm())
        except Exception as e:
            if not auto:
                raise ModelLoadError(f"--compile failed: {type(e).__name__}: {e}") from e
            self.model.kv.dynamic = False  # type: ignore[union-attr]
            self.model.use_graphs(None)  # type: ignore[union-attr]
            self.decode = f"eager: the compile failed ({type(e).__name__})"
            logger.warning("%s's decode steps run eagerly: the compile failed", cfg.model, exc_info=e)
            return
        self.decode = "compiled"
        logger.info("compiled %s's decode steps in %.1f s", cfg.model, self.compile_s)

    def compiled_calls(self) -> int | None:
        """Model calls through the compiled (or captured) decode steps so far; None where they run eagerly. A call
        they do not take (a prompt, or positions padded past ``graphs.SLACK``) runs eagerly."""
        graphs = getattr(self.model, "graphs", None)  # (None where eager: a failed compile takes it away too)
        return None if graphs is None else int(graphs.replays)

    def healthy(self) -> bool:
        return self.state == "ready" and self.engine is not None and self.engine.healthy

    def answered(self, server_s: float) -> None:
        """Count one successful answer (its server time, s, goes to /metrics)."""
        self.statuses[200] += 1
        if self.latency_observer is not None:
            self.latency_observer(server_s)


def _mismatch(strategy: str, model: str, generate: bool) -> str:
    if generate:
        return f"strategy {strategy} generates text and needs a generative model; {model!r} is not one"
    return (f"strategy {strategy} serves encoders (one call per batch); {model!r} is a generative model: "
            f"use a gen-* strategy ({', '.join(strategy_names('generate'))})")
