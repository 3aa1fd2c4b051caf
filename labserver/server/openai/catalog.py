"""``GET /v1/models`` and the one model name this server answers to.

A labserver serves one model; its id is the model spec it was started with
(``gpt2-random``, ``minilm``, a folder ...), ``root`` says where it came from and
``max_model_len`` how many tokens one sequence may hold here (prompt + output: the
model's context, or the server's whole KV pool where that holds less, as vLLM says it; for
an encoder, the tokens it reads). A request that names another model is a 404 with
code ``model_not_found``, as OpenAI answers; a request that names none gets this one.
"""

from __future__ import annotations

from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ... import wire
from ...engine.genbase import GenEngine
from ..handling import ClientError
from ..runtime import Runtime

__all__ = ["check_model", "get_models", "max_model_len", "served_name"]


def served_name(rt: Runtime) -> str:
    return rt.config.model


def max_model_len(rt: Runtime) -> int | None:
    if rt.engine is not None and rt.engine.kind == "generate":
        return cast(GenEngine, rt.engine).max_model_len
    model = rt.model
    if model is None:
        return None
    length = model.max_tokens  # type: ignore[union-attr]  # (an encoder's)
    return int(length) if length else None


def check_model(rt: Runtime, name: str | None) -> None:
    """A 404 (code ``model_not_found``) unless ``name`` is None or the served model's id."""
    if name is not None and name != served_name(rt):
        raise ClientError("not_found", f"the model {name!r} does not exist here; this server serves "
                                       f"{served_name(rt)!r} (GET {wire.V1_MODELS_PATH})", "model")


def model_card(rt: Runtime) -> dict[str, Any]:
    return {"id": served_name(rt), "object": "model", "created": int(rt.started_s), "owned_by": "labserver",
            "root": rt.config.model, "parent": None, "max_model_len": max_model_len(rt),
            "kind": rt.strategy.kind, "strategy": rt.strategy.name}


async def get_models(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    return JSONResponse({"object": "list", "data": [model_card(rt)]},
                        headers={wire.HEADER_REQUEST_ID: rt.request_id()})
