"""The doors before any route: who may talk to this server, and from where.

Three checks, in this order, on every HTTP request (an ASGI middleware, so they run before
a body is read or anything is queued):

- **the host check** (bound to a loopback address only): a ``Host`` header that names
  neither a loopback name nor the bound address is refused, 403. A web page the learner
  opens can make the browser send requests to ``127.0.0.1``; with DNS rebinding its own
  name resolves there, and the browser then treats the answers as the page's own. The
  ``Host`` it sends is still the page's name, which is what this refuses (Jupyter Server's
  check). Bound to another address (``--host 0.0.0.0``), names cannot be known: the key is
  the door there.
- **the API key** (``--api-key``, several allowed, or ``LABSERVER_API_KEY``, comma-separated):
  ``Authorization: Bearer KEY`` on every route but ``GET /health``, else 401. Keys are
  compared as SHA-256 digests with ``secrets.compare_digest``, against every key, so the
  time taken says nothing about how much of a guess was right (vLLM's way).

- **the content type** of a POST to ``/predict``, ``/generate`` and ``/v1/*``: JSON
  (``application/json``, parameters allowed, or a ``+json`` type), else 415. A browser
  sends a cross-site POST without asking the server first only as a "simple" request:
  form data, ``text/plain``, or no type at all (a blob). Refusing those means a page can
  make these routes compute only by sending JSON, which the browser asks permission for
  (a CORS preflight this server never grants). ``POST /`` keeps taking raw text, as the
  guide's server does; it is guarded by the host check and the key.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..config import ServerConfig

__all__ = ["Guard", "LOOPBACK_NAMES", "is_loopback"]

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
OPEN_PATHS = frozenset({"/health"})
JSON_PATHS = ("/predict", "/generate", "/v1/")  # a POST here must say it sends JSON

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _host_name(value: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` -> ``[::1]``)."""
    if value.startswith("["):
        return value[:value.find("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_json(content_type: str) -> bool:
    """``application/json`` (``; charset=...`` allowed) or a ``+json`` type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def needs_json(method: str, path: str) -> bool:
    return method == "POST" and any(path == p or (p.endswith("/") and path.startswith(p)) for p in JSON_PATHS)


class Guard:
    """The three checks of this module's docstring, before ``app``."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.keys = [_digest(k) for k in config.api_keys]
        self.hosts = (LOOPBACK_NAMES | {config.host.lower()}) if is_loopback(config.host) else None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        from .handling import error_response
        from .openai import openai_error

        kind, message, headers = refusal
        rt = scope["app"].state.runtime
        rid = rt.request_id()
        if scope["path"].startswith("/v1/"):
            code = "invalid_api_key" if kind == "unauthorized" else None
            response = openai_error(rt, kind, message, rid, code=code, headers=headers)
        else:
            response = error_response(rt, kind, message, rid, headers=headers)
        await response(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[str, str, dict[str, str]] | None:
        """(error kind, message, headers) when the request is refused; None when it may go on."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if self.hosts is not None and host is not None and _host_name(host.lower()) not in self.hosts:
            return "forbidden", ("this server listens on loopback and answers only requests addressed to it there "
                                 "(Host: 127.0.0.1, localhost or ::1)"), {}
        path = scope["path"]
        if self.keys and path not in OPEN_PATHS and not self.authorized(headers.get("authorization", "")):
            return "unauthorized", "a valid API key is needed: send the header Authorization: Bearer KEY", \
                {"www-authenticate": "Bearer"}
        if needs_json(scope["method"], path) and not is_json(headers.get("content-type", "")):
            got = headers.get("content-type")
            return "unsupported_media_type", (f"this route takes JSON: send the header Content-Type: application/json "
                                              f"(got {got[:80]!r})" if got else "this route takes JSON: send the "
                                              "header Content-Type: application/json (none was sent)"), {}
        return None

    def authorized(self, value: str) -> bool:
        scheme, _, token = value.partition(" ")
        got = _digest(token.strip()) if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.keys:  # every key, always: no early exit to time
            ok |= secrets.compare_digest(key, got)
        return ok
