"""``POST /generate``: a prompt in, tokens out, as one JSON answer or a stream of server-sent events.

The request is JSON: ``{"prompt": "...", "max_new_tokens": 64, "stream": false,
"ignore_eos": false}`` (only the prompt is required; ``wire`` describes the answer).
The handler checks it, queues one sequence on the generation engine and waits for
its first token, the client leaving, or the deadline, whichever comes first. Until
the first token nothing has been sent, so every failure up to then is an ordinary
JSON error with its status (400, 413, 500, 503, 504): with ``stream`` the 200 and its
headers go out *with* the first token. After it, a stream carries one event per
token and a final ``done`` (or ``error``) event.

A client that leaves is noticed by Starlette (while streaming) or by ``ClientWatch``
(while waiting): the sequence's future is cancelled, and the engine drops it at
the next step boundary, so it is never decoded further.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .. import wire
from ..engine import Seq
from ..models import GenModel
from .handling import (ClientError, FastJSON, answer, cache_salt, check_text, error_body, parse_json,
                       request_class)
from .runtime import Runtime
from .streaming import SeqStream, generation_engine, letting_go, wait_all, wait_first_token

__all__ = ["GenParams", "parse_generate", "post_generate", "result_body", "timing"]

DEFAULT_MAX_NEW_TOKENS = 64
_FIELDS = {"prompt": str, "max_new_tokens": int, "stream": bool, "ignore_eos": bool}


@dataclass
class GenParams:
    prompt: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stream: bool = False
    ignore_eos: bool = False


def parse_generate(body: bytes, max_new_tokens_cap: int, max_chars: int) -> GenParams:
    """The fields of a /generate body, each checked, with a message that says what to send."""
    example = '{"prompt": "Once upon a time", "max_new_tokens": 32}'
    doc = parse_json(body, example)
    if not isinstance(doc, dict) or "prompt" not in doc:
        raise ClientError("bad_request", f'expected a JSON object with a "prompt", e.g. {example}')
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise ClientError("bad_request", f"unknown field(s) {unknown}; known: {', '.join(_FIELDS)}")
    for name, kind in _FIELDS.items():
        value = doc.get(name)
        # bool is an int in Python: max_new_tokens=true is a type error, not 1 token
        if name in doc and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise ClientError("bad_request", f'"{name}" is {type(value).__name__}, expected {kind.__name__}')
    params = GenParams(**{"max_new_tokens": min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens_cap), **doc})
    check_text('"prompt"', params.prompt, max_chars)
    if not 1 <= params.max_new_tokens <= max_new_tokens_cap:
        raise ClientError("bad_request", f'"max_new_tokens" must be between 1 and {max_new_tokens_cap} '
                                         f"(the server's cap), got {params.max_new_tokens}")
    return params


def result_body(model: GenModel, seq: Seq, t0: float, now: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": seq.output.text if seq.output is not None else model.text(seq.tokens),
        "tokens": seq.tokens,
        "finish_reason": seq.finish_reason.value if seq.finish_reason else None,  # (labserver's own word: eos ...)
        "prompt_tokens": len(seq.prompt_ids),
        "generated_tokens": len(seq.tokens),
        "timing": timing(seq, t0, now),
    }
    if model.note:
        body["note"] = model.note
    return body


def timing(seq: Seq, t0: float, now: float) -> dict[str, Any]:
    """The server's view (its clock), in ms from the request's arrival (``t0``)."""
    def ms(t_s: float) -> float | None:
        return None if math.isnan(t_s) else round((t_s - t0) * 1000, 3)

    return {"queue_ms": ms(seq.admitted_s), "ttft_ms": ms(seq.first_token_s), "server_ms": ms(now),
            "decode_calls": seq.decode_calls,
            "mean_decode_batch": round(seq.decode_batch_sum / seq.decode_calls, 2) if seq.decode_calls else None,
            "cached_tokens": seq.cached_tokens, "preemptions": seq.preemptions,
            "prefilled_ms": ms(seq.prefilled_s),
            "transfer_ms": None if math.isnan(seq.transfer_ms) else round(seq.transfer_ms, 3)}


def _event(kind: bytes, data: Any) -> bytes:
    return kind + b"data: " + orjson.dumps(data) + b"\n\n"


class _Events:
    """``/generate``'s stream: one event per token, then ``done`` (the whole answer) or ``error``."""

    def __init__(self, rt: Runtime, seq: Seq, rid: str, t0: float) -> None:
        self.rt, self.seq, self.rid, self.t0 = rt, seq, rid, t0
        self.model: GenModel = rt.model  # type: ignore[assignment]
        self.sent = 0

    def pending(self) -> bytes:
        ready = self.seq.tokens[self.sent:]
        events = b"".join(_event(wire.SSE_TOKEN, {"index": self.sent + k, "id": t, "text": self.model.token_text(t)})
                          for k, t in enumerate(ready))
        self.sent += len(ready)
        return events

    def open(self) -> list[Seq]:
        return [] if self.seq.future.done() else [self.seq]

    def done(self) -> bytes:
        return _event(wire.SSE_DONE, result_body(self.model, self.seq, self.t0, time.perf_counter()))

    def failed(self, kind: str, message: str, error: BaseException) -> bytes:
        return _event(wire.SSE_ERROR, error_body(kind, message, self.rid, error, self.rt.config.debug))


async def _generate(rt: Runtime, request: Request, body: bytes, rid: str, t0: float) -> Response:
    engine = generation_engine(rt, f"this server runs the encoder strategy {rt.strategy.name}; "
                                   f"{wire.GENERATE_PATH} needs a gen-* strategy and a generative model "
                                   "(labserver serve --strategy gen-continuous)")
    params = parse_generate(body, rt.config.max_new_tokens, rt.config.max_chars)
    prompt_ids = rt.model.encode(params.prompt)  # type: ignore[union-attr]  # InputRejected: 400
    priority, tenant = request_class(request)
    seq = engine.submit(prompt_ids, params.max_new_tokens, ignore_eos=params.ignore_eos, request_id=rid,
                        priority=priority, tenant=tenant, cache_salt=cache_salt(rt.config.cache_isolation, tenant))
    with letting_go([seq]):  # whatever fails from here (a header too), the sequence is not left generating
        await wait_first_token(rt, request, seq, t0)
        headers = {wire.HEADER_REQUEST_ID: rid,
                   wire.HEADER_QUEUE_MS: f"{(seq.admitted_s - seq.enqueued_s) * 1000:.3f}"}
        if seq.replica:
            headers[wire.HEADER_REPLICA] = seq.replica
        if params.stream:
            return SeqStream(rt, [seq], rid, t0, _Events(rt, seq, rid, t0), headers)
        await wait_all(request, seq)
        now = time.perf_counter()
        response = FastJSON(result_body(rt.model, seq, t0, now),  # type: ignore[arg-type]
                            headers={**headers, wire.HEADER_SERVER_MS: f"{(now - t0) * 1000:.3f}"})
    rt.answered(now - t0)
    return response


async def post_generate(request: Request) -> Response:
    return await answer(request, _generate)
