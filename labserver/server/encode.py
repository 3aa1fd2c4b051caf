"""The encoder routes: ``POST /`` (the guide's: the body is the text) and ``POST /predict`` (JSON).

A request's texts are checked on the event loop, queued as items on the batch engine,
and answered together once every item is computed; the client leaving or the deadline
passing first ends the wait (``ClientWatch``), and the items still queued are then
never computed. Every answer carries the server's view of the request in headers
(``labserver.wire``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response

from .. import wire
from ..engine import BatchEngine, Item
from ..models import InputRejected
from .handling import (ClientError, ClientWatch, FastJSON, answer, check_text, deadline_end_s, decode_text, parse_json,
                       request_class)
from .runtime import Runtime

__all__ = ["parse_inputs", "post_predict", "post_root"]


def parse_inputs(body: bytes, max_inputs: int) -> tuple[list[str], bool]:
    """The texts of a /predict body and whether it was a single string."""
    doc = parse_json(body, '{"inputs": "text"}')
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


def check_texts(rt: Runtime, texts: list[str], name: str = '"inputs"') -> None:
    assert rt.model is not None
    for i, t in enumerate(texts):
        where = "text" if len(texts) == 1 else f"{name}[{i}]"
        check_text(where, t, rt.config.max_chars)
        try:
            rt.model.check(t)  # type: ignore[union-attr]
        except InputRejected as e:
            raise ClientError("bad_request", str(e)) from None


def encoder_engine(rt: Runtime, other_route: str) -> BatchEngine:
    """The runtime's batch engine, or a 400 that names the route a generation server offers."""
    if rt.engine is None or rt.engine.kind != "encode":
        raise ClientError("bad_request", f"this server generates text ({rt.strategy.name}); "
                                         f"POST {other_route} instead")
    return cast(BatchEngine, rt.engine)


async def infer(rt: Runtime, request: Request, texts: list[str], rid: str, t0: float,
                priority: Any = None) -> tuple[list[Any], list[Item]]:
    """Queue the texts (in the request's class: ``priority``, else its ``x-priority`` header) and wait for
    all of them, the client, or the deadline, whichever first."""
    level, tenant = request_class(request, priority)
    items = encoder_engine(rt, f'{wire.GENERATE_PATH} with JSON {{"prompt": "..."}}').submit(
        texts, rid, priority=level, tenant=tenant)
    futures = {i.future for i in items}
    timeout_ms = rt.config.limits.timeout_ms
    why = f"not served within timeout_ms={timeout_ms:g}" if timeout_ms is not None else ""
    try:
        async with ClientWatch(request) as watch:
            pending = set(futures)
            while pending:
                done = await watch.first(pending, deadline_end_s(rt, t0), why)
                pending -= done
                for fut in done:
                    if fut.exception() is not None:
                        raise fut.exception()  # type: ignore[misc]
    finally:
        for fut in futures:
            fut.cancel()  # a no-op on finished ones; queued ones are then skipped, never computed
    return [i.future.result() for i in items], items


def server_headers(items: list[Item], rid: str, t0: float, now: float) -> dict[str, str]:
    """The timing headers of the request's last item's batch, and the tokens of all its texts."""
    item = items[-1]
    b = item.batch
    headers = {wire.HEADER_REQUEST_ID: rid, wire.HEADER_SERVER_MS: f"{(now - t0) * 1000:.3f}"}
    tokens = sum(i.tokens for i in items)
    if tokens:
        headers[wire.HEADER_INPUT_TOKENS] = str(tokens)
    if b is not None:
        headers[wire.HEADER_QUEUE_MS] = f"{item.queue_ms:.3f}"
        headers[wire.HEADER_COMPUTE_MS] = f"{b.compute_ms:.3f}"
        headers[wire.HEADER_BATCH_SIZE] = str(b.size)
        headers[wire.HEADER_BATCH_ID] = str(b.batch_id)
        headers[wire.HEADER_DISPATCH] = b.reason
    return headers


def _texts_route(texts_of: Callable[[bytes, Runtime], tuple[list[str], bool]], bare: bool) -> Any:
    async def work(rt: Runtime, request: Request, body: bytes, rid: str, t0: float) -> Response:
        encoder_engine(rt, f'{wire.GENERATE_PATH} with JSON {{"prompt": "..."}}')
        texts, single = texts_of(body, rt)
        check_texts(rt, texts)
        outputs, items = await infer(rt, request, texts, rid, t0)
        now = time.perf_counter()
        rt.answered(now - t0)
        content = outputs[0] if bare else ({"output": outputs[0]} if single else {"outputs": outputs})
        return FastJSON(content, headers=server_headers(items, rid, t0, now))

    async def route(request: Request) -> Response:
        return await answer(request, work)

    return route


post_root = _texts_route(lambda body, rt: ([decode_text(body)], True), bare=True)
post_predict = _texts_route(lambda body, rt: parse_inputs(body, rt.config.max_inputs), bare=False)
