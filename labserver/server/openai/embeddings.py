"""``POST /v1/embeddings``: the batch engine behind OpenAI's embeddings shape.

``input`` is a string or a list of strings; each becomes one item of the encoder's
batch engine, as a ``/predict`` input does, so the same strategy batches them with
everyone else's. ``encoding_format`` is ``float`` (a list of numbers) or ``base64``
(the little-endian float32 bytes, base64-encoded): the official SDK asks for base64
when the caller names no format, and decodes it itself. ``usage`` counts the
tokenizer's tokens when the model has a tokenizer (else words). The server's timing
headers (``labserver.wire``) are on every answer, as on ``/predict``.

Only a model whose outputs are embeddings (the embedded ``minilm``) can answer; any
other encoder's server says so with a 400.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ... import wire
from ..encode import check_texts, encoder_engine, infer, server_headers
from ..handling import ClientError, FastJSON, answer, parse_json
from ..runtime import Runtime
from .catalog import check_model, served_name
from .errors import openai_failure
from .params import check_field_names, ignored_header

__all__ = ["post_embeddings"]

_USED = {"input", "model", "encoding_format", "dimensions", "user", "priority"}


def _inputs(doc: Any, max_inputs: int) -> list[str]:
    value = doc.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        if len(value) > max_inputs:
            raise ClientError("bad_request", f"{len(value)} inputs is over the limit of {max_inputs} per request",
                              "input")
        return value
    if isinstance(value, list) and value and all(isinstance(x, (int, list)) for x in value):
        raise ClientError("bad_request", "token-id inputs are not supported; send text", "input")
    raise ClientError("bad_request", '"input" must be a string or a non-empty list of strings', "input")


def _tokens(rt: Runtime, texts: list[str]) -> int:
    """The input's tokens as the model counts them; words, where it cannot say (all 0)."""
    counts = rt.model.count_tokens(texts)  # type: ignore[union-attr]
    return sum(counts) if any(counts) else sum(len(t.split()) for t in texts)


def _vector(output: Any, fmt: str) -> Any:
    vec = np.asarray(output["embedding"], dtype="<f4")
    return base64.b64encode(vec.tobytes()).decode("ascii") if fmt == "base64" else vec


async def _work(rt: Runtime, request: Request, body: bytes, rid: str, t0: float) -> Response:
    encoder_engine(rt, f"{wire.V1_COMPLETIONS_PATH} or {wire.V1_CHAT_PATH}")
    doc = parse_json(body, '{"model": "...", "input": "some text"}')
    if not isinstance(doc, dict):
        raise ClientError("bad_request", 'expected a JSON object with "input": a string or a list of strings')
    check_field_names(doc)
    name = doc.get("model")
    if name is not None and not isinstance(name, str):
        raise ClientError("bad_request", '"model" must be a string', "model")
    check_model(rt, name)
    fmt = doc.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ClientError("bad_request", f'"encoding_format" must be "float" or "base64", got {fmt!r}',
                          "encoding_format")
    texts = _inputs(doc, rt.config.max_inputs)
    check_texts(rt, texts, '"input"')
    outputs, items = await infer(rt, request, texts, rid, t0, doc.get("priority"))
    if not all(isinstance(o, dict) and "embedding" in o for o in outputs):
        raise ClientError("bad_request", f"the model {served_name(rt)!r} does not produce embeddings; serve "
                                         "minilm (the embedded default) for /v1/embeddings", "model")
    dims = doc.get("dimensions")
    native = len(outputs[0]["embedding"])
    if dims is not None and dims != native:
        raise ClientError("bad_request", f'"dimensions": this model gives {native} dimensions, not {dims}',
                          "dimensions")
    n_tokens = sum(i.tokens for i in items) or _tokens(rt, texts)  # the engine's count, when the model gave one
    data = [{"object": "embedding", "index": i, "embedding": _vector(o, fmt)} for i, o in enumerate(outputs)]
    now = time.perf_counter()
    rt.answered(now - t0)
    headers = server_headers(items, rid, t0, now)
    ignored = sorted(set(doc) - _USED)
    if ignored:
        headers[wire.HEADER_IGNORED_FIELDS] = ignored_header(ignored)
    return FastJSON({"object": "list", "data": data, "model": served_name(rt),
                     "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}, headers=headers)


async def post_embeddings(request: Request) -> Response:
    return await answer(request, _work, openai_failure)
