"""The Starlette app: routes, validation, outcomes -> status codes, health, stats, metrics.

One app serves one model through one strategy, held by a ``Runtime``
(``labserver.runtime``: the model loads in the background at startup, ``/health`` says
503 until it is ready, or for good if loading failed); every request is parsed and checked on the event loop, queued as items on the
engine, and answered with exactly one response: the output, or a JSON error
``{"error": {"type", "message", "request_id"}}``. Tracebacks go to the log, and to
the client only when the server runs with ``debug``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import psutil
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import wire
from .config import ServerConfig
from .engine import Expired, Item, Overloaded, ShuttingDown, WorkerDied
from .generation import GenEngine
from .metrics import metrics_response
from .models import InputRejected, Model, ModelError
from .runtime import Runtime

logger = logging.getLogger(__name__)
_PROC = psutil.Process()


class ClientError(Exception):
    """A request we refuse before queueing it: a 4xx with a message that says what to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ClientGone(Exception):
    """The client disconnected while its request waited: nobody to answer."""


# -- responses -------------------------------------------------------------------------

def error_response(
    rt: Runtime, kind: str, message: str, rid: str, *, exc: BaseException | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    status = wire.ERROR_TYPES[kind]
    body: dict[str, Any] = {"type": kind, "message": message, "request_id": rid}
    if exc is not None and rt.config.debug:
        body["traceback"] = "".join(traceback.format_exception(exc))
    rt.statuses[status] += 1
    return JSONResponse({"error": body}, status, headers={wire.HEADER_REQUEST_ID: rid, **(headers or {})})


def _server_headers(item: Item, rid: str, t0: float, now: float) -> dict[str, str]:
    b = item.batch
    headers = {wire.HEADER_REQUEST_ID: rid, wire.HEADER_SERVER_MS: f"{(now - t0) * 1000:.3f}"}
    if b is not None:
        headers[wire.HEADER_QUEUE_MS] = f"{item.queue_ms:.3f}"
        headers[wire.HEADER_COMPUTE_MS] = f"{b.compute_ms:.3f}"
        headers[wire.HEADER_BATCH_SIZE] = str(b.size)
        headers[wire.HEADER_BATCH_ID] = str(b.batch_id)
        headers[wire.HEADER_DISPATCH] = b.reason
    return headers


class FastJSON(Response):
    """JSON by orjson, which writes numpy arrays as they are.

    Why: the embedded model returns 384 floats per input. json.dumps spends ~375 us
    turning them into text (8.5 KB); orjson takes ~18 us from a float32 array (4.7 KB),
    time the event loop then spends serving other requests.
    """

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# -- request parsing --------------------------------------------------------------------

async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError("payload_too_large", f"body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ClientError("payload_too_large", f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_text(body: bytes) -> str:
    if not body:
        raise ClientError("bad_request", 'empty body: send the text to process, e.g. curl -d "hello world"')
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClientError("bad_request", f"body is not valid UTF-8 (byte {e.start}); send UTF-8 text") from None


def parse_inputs(body: bytes, max_inputs: int) -> tuple[list[str], bool]:
    """The texts of a /predict body and whether it was a single string."""
    text = decode_text(body)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, and ints over 4300 digits
        raise ClientError("bad_request", f'malformed JSON ({e}); send {{"inputs": "text"}}') from None
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise ClientError("bad_request", 'expected a JSON object with "inputs": a string or a list of strings')
    inputs = doc["inputs"]
    if isinstance(inputs, str):
        return [inputs], True
    if not isinstance(inputs, list) or not inputs:
        raise ClientError("bad_request", '"inputs" must be a string or a non-empty list of strings')
    if len(inputs) > max_inputs:
        raise ClientError("bad_request", f"{len(inputs)} inputs is over the limit of {max_inputs} per request")
    for i, x in enumerate(inputs):
        if not isinstance(x, str):
            raise ClientError("bad_request", f'"inputs"[{i}] is {type(x).__name__}, expected a string')
    return inputs, False


def check_text(where: str, t: str, limit: int) -> None:
    """What no model can take: empty, too long, NUL, unpaired surrogates. ``where`` names it in the message."""
    if not t.strip():
        raise ClientError("bad_request", f"{where} is empty; send some text")
    if len(t) > limit:
        raise ClientError("bad_request", f"{where} has {len(t)} characters, over the limit of {limit}")
    if "\x00" in t:
        raise ClientError("bad_request", f"{where} contains a NUL character")
    try:
        t.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape like "\ud800": tokenizers reject it
        raise ClientError("bad_request", f"{where} has an unpaired surrogate (\\u{ord(t[e.start]):04x} at "
                                         f"character {e.start}); send valid Unicode text") from None


def check_texts(rt: Runtime, texts: list[str]) -> None:
    assert rt.model is not None
    for i, t in enumerate(texts):
        where = "text" if len(texts) == 1 else f'"inputs"[{i}]'
        check_text(where, t, rt.config.max_chars)
        try:
            rt.model.check(t)
        except InputRejected as e:
            raise ClientError("bad_request", str(e)) from None


# -- the inference path -------------------------------------------------------------------

async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (uvicorn sends http.disconnect after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def infer(rt: Runtime, request: Request, texts: list[str], rid: str, t0: float) -> tuple[list[Any], Item]:
    """Queue the texts and wait for all of them, the client, or the deadline, whichever first."""
    engine = rt.engine
    assert engine is not None
    items = engine.submit(texts, rid)
    futures = {i.future for i in items}
    timeout_ms = rt.config.limits.timeout_ms
    end_s = None if timeout_ms is None else t0 + timeout_ms / 1000
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        pending = set(futures)
        while pending:
            remaining = None if end_s is None else max(0.0, end_s - time.perf_counter())
            done, pending = await asyncio.wait(pending | {watcher}, timeout=remaining,
                                               return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientGone
            pending.discard(watcher)
            if not done or (end_s is not None and time.perf_counter() > end_s):
                # also when the answer came in only as the loop woke past the deadline (an inline
                # batch held it): timeout_ms is a promise about the response, so 504, not a late 200
                raise Expired(f"not served within timeout_ms={timeout_ms:g}")
            for fut in done:
                if fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
    finally:
        watcher.cancel()
        for fut in futures:
            fut.cancel()  # a no-op on finished ones; queued ones are then skipped, never computed
    return [i.future.result() for i in items], items[-1]


Work = Callable[[Runtime, Request, bytes, str, float], Awaitable[Response]]


async def answer(request: Request, work: Work) -> Response:
    """One request, one response: read the body, check readiness, run ``work``, map its failures.

    ``work(runtime, request, body, request_id, t0)`` parses, queues, waits and builds the
    answer; every exception it raises becomes the one JSON error its kind calls for.
    """
    rt: Runtime = request.app.state.runtime
    t0 = time.perf_counter()
    rid = request.headers.get(wire.HEADER_REQUEST_ID, "")
    if not (0 < len(rid) <= 64 and rid.isascii() and rid.isprintable()):
        rid = rt.request_id()
    try:
        body = await read_body(request, rt.config.max_body_bytes)
        if rt.state != "ready" or rt.engine is None:
            why = rt.load_error or ("model is loading" if rt.state == "loading" else "server is stopping")
            kind = "model_unavailable" if rt.state in ("loading", "failed") else "shutting_down"
            return error_response(rt, kind, why, rid, headers={"retry-after": "1"})
        return await work(rt, request, body, rid, t0)
    except ClientError as e:
        return error_response(rt, e.kind, str(e), rid)
    except InputRejected as e:
        return error_response(rt, "bad_request", str(e), rid)
    except Overloaded as e:
        return error_response(rt, "overloaded", f"{e}; retry later", rid, headers={"retry-after": "1"})
    except Expired as e:
        return error_response(rt, "timeout", str(e), rid)
    except ShuttingDown as e:
        return error_response(rt, "shutting_down", str(e), rid, headers={"retry-after": "1"})
    except WorkerDied as e:
        # why it died stays in the log (a crash message can carry internal paths); debug adds the traceback
        return error_response(rt, "model_unavailable", "the model worker is gone; restart the server "
                              "(its log says why)", rid, exc=e)
    except ModelError as e:
        logger.warning("request %s: model error: %s", rid, e)
        return error_response(rt, "model_error", "the model failed on this input", rid, exc=e)
    except (ClientGone, ClientDisconnect):  # nobody to answer; queued items were cancelled, never computed
        rt.statuses[499] += 1
        return Response(status_code=499)
    except Exception as e:  # a model bug is still one failed request, never a dead server
        logger.exception("request %s: model failed", rid)
        return error_response(rt, "model_error", "the model failed on this input", rid, exc=e)


def _texts_work(texts_of: Callable[[bytes, Runtime], tuple[list[str], bool]]) -> Work:
    async def work(rt: Runtime, request: Request, body: bytes, rid: str, t0: float) -> Response:
        if rt.strategy.kind != "encode":
            raise ClientError("bad_request", f"this server generates text ({rt.strategy.name}); "
                                             f"POST {wire.GENERATE_PATH} with JSON {{\"prompt\": \"...\"}}")
        texts, single = texts_of(body, rt)
        check_texts(rt, texts)
        outputs, last = await infer(rt, request, texts, rid, t0)
        now = time.perf_counter()
        rt.answered(now - t0)
        content = outputs[0] if request.url.path == "/" else ({"output": outputs[0]} if single else {"outputs": outputs})
        return FastJSON(content, headers=_server_headers(last, rid, t0, now))

    return work


def _raw_text(body: bytes, rt: Runtime) -> tuple[list[str], bool]:
    return [decode_text(body)], True


def _json_inputs(body: bytes, rt: Runtime) -> tuple[list[str], bool]:
    return parse_inputs(body, rt.config.max_inputs)


async def post_root(request: Request) -> Response:
    return await answer(request, _texts_work(_raw_text))


async def post_predict(request: Request) -> Response:
    return await answer(request, _texts_work(_json_inputs))


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
        "statuses": {str(k): v for k, v in sorted(rt.statuses.items())},
        "loop_lag": rt.lag.summary(),
        "process": process_info(),
    }
    if rt.engine is not None:
        out.update(rt.engine.stats())
        if batches:
            out["recent_batches"] = [vars(b) for b in list(rt.engine.batches)[-batches:]]
        if steps and isinstance(rt.engine, GenEngine):
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
    return error_response(rt, kind, f"{request.method} {request.url.path}: {exc.detail}", rt.request_id(),
                          headers=dict(exc.headers or {}))


async def internal_error(request: Request, exc: Exception) -> Response:
    rt: Runtime = request.app.state.runtime
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(rt, "internal", "internal server error", rt.request_id(), exc=exc)


def create_app(config: ServerConfig | None = None, model: Model | None = None) -> Starlette:
    """The app for one config. ``model`` skips loading by spec (a ready object, e.g. a test fake)."""
    config = config or ServerConfig()
    runtime = Runtime(config, model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    from .genserver import post_generate  # it builds on this module

    app = Starlette(
        debug=False,  # Starlette's debug pages would leak tracebacks; ours are opt-in in JSON
        routes=[
            Route("/", post_root, methods=["POST"]),
            Route("/predict", post_predict, methods=["POST"]),
            Route(wire.GENERATE_PATH, post_generate, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    return app
