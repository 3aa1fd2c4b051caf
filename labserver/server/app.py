"""The Starlette app: one model, one strategy, its routes, and what it says about itself.

``create_app(config)`` builds the app around a ``Runtime`` (``labserver.server.runtime``:
the model loads in the background at startup, ``/health`` says 503 until it is ready,
or for good if loading failed). The routes live beside this module: ``encode`` (``/``,
``/predict``), ``generate`` (``/generate``) and ``openai`` (``/v1/*``), all answered through
``handling.answer``, so every request gets exactly one response: the output, or a JSON
error ``{"error": {"type", "message", "request_id"}}``. Here: ``/health``, ``/stats``,
``/metrics``, and the errors outside the inference path (404, 405, a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.middleware import Middleware
from starlette.routing import Route

from .. import wire
from ..config import ServerConfig
from ..models import GenModel, Model
from .encode import post_predict, post_root
from .generate import post_generate
from .guard import Guard
from .handling import error_response
from .metrics import attach_metrics, metrics_response
from .openai import openai_error, routes as openai_routes
from .runtime import Runtime

logger = logging.getLogger(__name__)
_PROC = psutil.Process()

__all__ = ["create_app", "process_info", "stats_dict"]


async def health(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    body = {"status": "ok" if rt.healthy() else rt.state, "model": rt.config.model,
            "strategy": rt.strategy.name}
    if rt.load_error:
        body["error"] = rt.load_error
    if rt.engine is not None and rt.engine.dead is not None:
        detail = f": {rt.engine.dead}" if rt.config.debug else "; restart the server (its log says why)"
        body["status"], body["error"] = "failed", f"model worker is gone{detail}"
    return JSONResponse(body, 200 if rt.healthy() else 503)


def process_info() -> dict[str, float]:
    """Memory, threads and tasks: what a soak watches for leaks. Call on the server's loop."""
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # not on a loop
        tasks = -1
    return {"rss_mb": round(_PROC.memory_info().rss / 2**20, 1), "threads": threading.active_count(), "tasks": tasks}


def stats_dict(rt: Runtime, batches: int = 0, lag: bool = False, steps: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "state": rt.state,
        "model": rt.config.model,
        "strategy": rt.strategy.name,
        "uptime_s": round(time.time() - rt.started_s, 3),
        "decode": rt.decode,  # a generator's decode steps: compiled, or eager (and why)
        "compile_s": None if rt.compile_s is None else round(rt.compile_s, 3),
        "compiled_calls": rt.compiled_calls(),  # model calls through those steps (None: eager); decode_calls: all
        "statuses": {str(k): v for k, v in sorted(rt.statuses.items())},
        "loop_lag": rt.lag.summary(),
        "process": process_info(),
    }
    if rt.engine is not None:
        out.update(rt.engine.stats())
        if batches:
            out["recent_batches"] = rt.engine.batch_log(batches)
        if steps:
            out["recent_steps"] = rt.engine.step_log(steps)
    if lag:
        out["loop_lag_samples"] = list(rt.lag.samples)
    return out


async def stats(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    try:
        batches = int(request.query_params.get("batches", "0"))
        steps = int(request.query_params.get("steps", "0"))
    except ValueError:
        return error_response(rt, "bad_request", "batches and steps must be integers", rt.request_id())
    lag = request.query_params.get("lag", "") in ("1", "true", "yes")
    return JSONResponse(stats_dict(rt, max(0, batches), lag, max(0, steps)))


async def metrics(request: Request) -> Response:
    return metrics_response(request.app.state.runtime)


# -- errors outside the inference path -----------------------------------------------------

async def http_error(request: Request, exc: Exception) -> Response:
    rt: Runtime = request.app.state.runtime
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
    if request.url.path.startswith("/v1/"):  # OpenAI's clients parse their own error shape
        return openai_error(rt, kind, f"{request.method} {request.url.path}: {exc.detail}", rt.request_id(),
                            headers=dict(exc.headers or {}))
    return error_response(rt, kind, f"{request.method} {request.url.path}: {exc.detail}", rt.request_id(),
                          headers=dict(exc.headers or {}))


async def internal_error(request: Request, exc: Exception) -> Response:
    rt: Runtime = request.app.state.runtime
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    if request.url.path.startswith("/v1/"):
        return openai_error(rt, "internal", "internal server error", rt.request_id())
    return error_response(rt, "internal", "internal server error", rt.request_id(), exc=exc)


def create_app(config: ServerConfig | None = None, model: Model | GenModel | None = None,
               engine_factory: Callable[[Any, Any], EngineBase] | None = None) -> Starlette:
    """The app for one config. ``model`` skips loading by spec (a ready object, e.g. a test fake);
    ``engine_factory`` puts another engine behind the same routes (the replicas' ingress)."""
    config = config or ServerConfig()
    runtime = Runtime(config, model) if engine_factory is None else Runtime(config, model, engine_factory)
    attach_metrics(runtime)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = Starlette(
        debug=False,  # Starlette's debug pages would leak tracebacks; ours are opt-in in JSON
        routes=[
            Route("/", post_root, methods=["POST"]),
            Route("/predict", post_predict, methods=["POST"]),
            Route(wire.GENERATE_PATH, post_generate, methods=["POST"]),
            *openai_routes(),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        middleware=[Middleware(Guard, config=config)],  # the host check, the key, JSON only (server.guard)
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    return app
