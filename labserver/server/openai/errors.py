"""Failures on ``/v1/*`` in the shape OpenAI's clients parse: ``{"error": {"message", "type", "param", "code"}}``.

The statuses are the native routes' (``labserver.wire.ERROR_TYPES``, decided by the one
error table ``labserver.server.handling.describe``); only the body differs. ``type`` is
OpenAI's family of the error and ``code`` labserver's own kind (``overloaded``,
``timeout``, ...), or ``model_not_found`` for a model this server does not serve, so a
client can branch on either. No traceback is ever sent here: the log has it.

This module is only the dialect; what counts as which failure is decided elsewhere.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from ... import wire
from ..handling import refusal_headers
from ..runtime import Runtime

__all__ = ["MODEL_NOT_FOUND", "openai_error", "openai_error_body", "openai_failure"]

MODEL_NOT_FOUND = "model_not_found"

# status -> OpenAI's error type for it
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}


def openai_error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The error object for a failure of labserver ``kind`` (a key of ``wire.ERROR_TYPES``)."""
    status = wire.ERROR_TYPES[kind]
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code or kind}}


def openai_error(rt: Runtime, kind: str, message: str, rid: str, *, param: str | None = None,
                 code: str | None = None, retry: bool = False, headers: dict[str, str] | None = None) -> Response:
    status = wire.ERROR_TYPES[kind]
    rt.statuses[status] += 1
    extra = {wire.HEADER_REQUEST_ID: rid, **(headers or {})}
    if retry:
        extra["retry-after"] = "1"
    return JSONResponse(openai_error_body(kind, message, param, code), status, headers=extra)


def openai_failure(rt: Runtime, kind: str, message: str, rid: str, exc: BaseException, retry: bool) -> Response:
    """``handling.answer``'s failure hook for the /v1 routes."""
    param = getattr(exc, "param", None)
    code = MODEL_NOT_FOUND if kind == "not_found" and param == "model" else None
    return openai_error(rt, kind, message, rid, param=param, code=code, headers=refusal_headers(exc, retry))
