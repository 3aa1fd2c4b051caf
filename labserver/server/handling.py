"""What every route shares: reading a body, one error table, waiting for an answer or the client.

- ``answer(request, work)``: one request, one response. It reads the body (413 over the
  limit), checks that the model is ready, runs the route's ``work`` and turns whatever
  it raises into the one JSON error its kind calls for.
- ``describe(exc)``: the one error table, exception -> (error type, message, Retry-After),
  used by ``answer`` and by a stream that fails after its first token, so a failure
  reads the same on every route. Tracebacks go to the log, and to the client only when
  the server runs with ``debug``.
- ``request_class``, ``cache_salt``: who is asking (a priority class and a tenant), and
  whose prefix-cache blocks its request may share.
- ``ClientWatch``: wait for what a handler waits for (futures, the next token), the client
  leaving, or the deadline, whichever comes first.
- ``read_body``, ``decode_text``, ``check_text``, ``parse_json``: request decoding with
  messages that say what to send.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .. import wire
from ..engine import Expired, Overloaded, ReplicaLost, ShuttingDown, WorkerDied
from ..models import InputRejected, ModelError
from .runtime import Runtime

logger = logging.getLogger(__name__)

__all__ = ["ClientError", "ClientGone", "ClientWatch", "FastJSON", "answer", "cache_salt", "check_text",
           "client_gone", "decode_text", "describe", "error_body", "error_response", "parse_json", "read_body",
           "refusal_headers", "request_class"]


class ClientError(Exception):
    """A request we refuse before queueing it: a 4xx with a message that says what to do."""

    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param  # the request field at fault, when there is one


class ClientGone(Exception):
    """The client disconnected while its request waited: nobody to answer."""


# -- the one error table ------------------------------------------------------------------

WORKER_GONE = "the model worker is gone; restart the server (its log says why)"
MODEL_FAILED = "the model failed on this input"

# exception -> (error type, message or None for the exception's own, Retry-After); first match wins.
# Anything not listed is a model bug: still one failed request ("model_error"), never a dead server.
ERROR_TABLE: tuple[tuple[type[BaseException], str, str | None, bool], ...] = (
    (InputRejected, "bad_request", None, False),
    (Overloaded, "overloaded", None, True),
    (Expired, "timeout", None, False),
    (ShuttingDown, "shutting_down", None, True),
    (ReplicaLost, "model_unavailable", None, True),  # (before WorkerDied: the others still serve, so retry)
    (WorkerDied, "model_unavailable", WORKER_GONE, False),  # why it died stays in the log: it can name paths
    (ModelError, "model_error", MODEL_FAILED, False),
)


def describe(exc: BaseException) -> tuple[str, str, bool]:
    """(error type, message for the client, send Retry-After) for a failure."""
    if isinstance(exc, ClientError):
        return exc.kind, str(exc), False
    for kind_of_exc, kind, message, retry in ERROR_TABLE:
        if isinstance(exc, kind_of_exc):
            return kind, message if message is not None else str(exc), retry
    return "model_error", MODEL_FAILED, False


def error_body(kind: str, message: str, rid: str, exc: BaseException | None = None,
               debug: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"type": kind, "message": message, "request_id": rid}
    if exc is not None and debug and kind in ("model_error", "model_unavailable", "internal"):
        body["traceback"] = "".join(traceback.format_exception(exc))
    return {"error": body}


def error_response(rt: Runtime, kind: str, message: str, rid: str, *, exc: BaseException | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    status = wire.ERROR_TYPES[kind]
    rt.statuses[status] += 1
    return JSONResponse(error_body(kind, message, rid, exc, rt.config.debug), status,
                        headers={wire.HEADER_REQUEST_ID: rid, **(headers or {})})


def log_failure(rid: str, exc: BaseException) -> None:
    if isinstance(exc, ModelError):
        logger.warning("request %s: model error: %s", rid, exc)
    elif not isinstance(exc, (ClientError, InputRejected, Overloaded, Expired, ShuttingDown, WorkerDied)):
        logger.error("request %s: model failed", rid, exc_info=exc)


# -- the one way a request is answered ----------------------------------------------------

Work = Callable[[Runtime, Request, bytes, str, float], Awaitable[Response]]
Failure = Callable[[Runtime, str, str, str, BaseException, bool], Response]


def refusal_headers(exc: BaseException, retry: bool) -> dict[str, str]:
    """Retry-After on what may succeed later; ``x-reason`` on a refusal (queue-full, codel, deadline, expired)."""
    headers = {"retry-after": "1"} if retry else {}
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        headers[wire.HEADER_REASON] = reason
    return headers


def native_failure(rt: Runtime, kind: str, message: str, rid: str, exc: BaseException, retry: bool) -> Response:
    return error_response(rt, kind, message, rid, exc=exc, headers=refusal_headers(exc, retry))


async def answer(request: Request, work: Work, failure: Failure = native_failure) -> Response:
    """One request, one response: read the body, check readiness, run ``work``, map its failures.

    ``work(runtime, request, body, request_id, t0)`` parses, queues, waits and builds the
    answer; every exception it raises becomes ``failure(...)`` with what ``describe``
    says of it (the native JSON error unless a route speaks another dialect).
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
            return failure(rt, kind, why, rid, ShuttingDown(why), True)
        return await work(rt, request, body, rid, t0)
    except (ClientGone, ClientDisconnect):  # nobody to answer; queued work was cancelled, never computed
        rt.statuses[499] += 1
        return Response(status_code=499)
    except Exception as e:
        log_failure(rid, e)
        kind, message, retry = describe(e)
        return failure(rt, kind, message, rid, e, retry)


class FastJSON(Response):
    """JSON by orjson, which writes numpy arrays as they are.

    Why: the embedded model returns 384 floats per input. json.dumps spends ~375 us
    turning them into text (8.5 KB); orjson takes ~18 us from a float32 array (4.7 KB),
    time the event loop then spends serving other requests.
    """

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# -- who is asking: a priority class and a tenant --------------------------------------------

MAX_TENANT_CHARS = 64
MAX_PRIORITY = 1000  # a class is an integer in [-MAX_PRIORITY, MAX_PRIORITY]: no client outranks every other by far


def request_class(request: Request, priority: Any = None) -> tuple[int, str]:
    """(priority, tenant) of a request: ``priority`` from the body when a route takes one (the /v1
    routes, as vLLM), else the ``x-priority`` header; the tenant from ``x-tenant``. A lower priority
    is served first; 0 and "" when absent."""
    if priority is None:
        raw = request.headers.get(wire.HEADER_PRIORITY)
        if raw is not None:
            try:
                priority = int(raw.strip())
            except ValueError:
                raise ClientError("bad_request", f"{wire.HEADER_PRIORITY} must be an integer (lower is served "
                                                 f"first), got {raw[:20]!r}") from None
    elif isinstance(priority, bool) or not isinstance(priority, int):
        raise ClientError("bad_request", f'"priority" must be an integer, got {type(priority).__name__}', "priority")
    if priority is not None and not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ClientError("bad_request", f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY} (lower is "
                                         f"served first), got {priority}", "priority")
    tenant = request.headers.get(wire.HEADER_TENANT, "")
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise ClientError("bad_request", f"{wire.HEADER_TENANT} must be printable, at most {MAX_TENANT_CHARS} "
                                         "characters")
    return int(priority or 0), tenant


def cache_salt(isolation: str, tenant: str, salt: str | None = None) -> str:
    """The salt a request's prefix-cache blocks are keyed under (``BlockManager``): only requests with the same
    salt share blocks, and "" is no salt.

    ``isolation`` "none": the request's own ``cache_salt`` (vLLM's field), if it sent one.
    "tenant": its tenant and its ``cache_salt`` together, so no salt a client sends reaches
    another tenant's blocks; a request with neither shares the unnamed tenant's cache.
    """
    if isolation != "tenant":
        return salt or ""
    if not tenant and salt is None:
        return ""
    return f"tenant:{len(tenant)}:{tenant}:{'' if salt is None else f'salt:{salt}'}"


# -- waiting: for the answer, the client, or the deadline ------------------------------------

async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (uvicorn sends http.disconnect after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """``async with ClientWatch(request) as watch: await watch.first(waitables, end_s)``.

    ``first`` returns the waitables that finished first; it raises ``ClientGone`` when the
    client left meanwhile and ``Expired`` once ``end_s`` (``time.perf_counter``) has passed,
    also when an answer came in only as the loop woke past it: a deadline is a promise
    about the response.
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self._gone: asyncio.Future[None] | None = None

    async def __aenter__(self) -> ClientWatch:
        self._gone = asyncio.ensure_future(client_gone(self.request))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._gone is not None
        self._gone.cancel()

    async def first(self, waitables: Iterable[asyncio.Future[Any]], end_s: float = math.inf,
                    why: str = "deadline passed") -> set[asyncio.Future[Any]]:
        assert self._gone is not None
        remaining = end_s - time.perf_counter()
        if remaining <= 0:
            raise Expired(why)
        done, _ = await asyncio.wait({*waitables, self._gone}, timeout=None if math.isinf(remaining) else remaining,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._gone in done:
            raise ClientGone
        if time.perf_counter() > end_s:
            raise Expired(why)
        return done


def deadline_end_s(rt: Runtime, t0: float) -> float:
    """When ``timeout_ms`` runs out for a request that arrived at ``t0`` (perf_counter), or inf."""
    timeout_ms = rt.config.limits.timeout_ms
    return math.inf if timeout_ms is None else t0 + timeout_ms / 1000


# -- decoding -------------------------------------------------------------------------------

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


def parse_json(body: bytes, example: str) -> Any:
    """A JSON body, or a 400 that shows ``example``."""
    if not body:
        raise ClientError("bad_request", f"empty body; send JSON like {example}")
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ClientError("bad_request", f"body is not valid UTF-8 (byte {e.start}); send UTF-8 JSON") from None
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, and ints over 4300 digits
        raise ClientError("bad_request", f"malformed JSON ({e}); send {example}") from None


def check_text(where: str, t: str, limit: int) -> None:
    """What no model can take: empty, too long, unpaired surrogates (no UTF-8 holds them, so no tokenizer takes
    them). ``where`` names it in the message. A NUL character is text like any other: tokenizers take it (vLLM
    answers such a prompt, and ``vllm bench serve``'s random prompts hold some)."""
    if not t.strip():
        raise ClientError("bad_request", f"{where} is empty; send some text")
    if len(t) > limit:
        raise ClientError("bad_request", f"{where} has {len(t)} characters, over the limit of {limit}")
    try:
        t.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape like "\ud800": tokenizers reject it
        raise ClientError("bad_request", f"{where} has an unpaired surrogate (\\u{ord(t[e.start]):04x} at "
                                         f"character {e.start}); send valid Unicode text") from None
