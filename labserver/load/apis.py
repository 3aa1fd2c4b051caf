"""The APIs the load generator speaks: labserver's own routes, and OpenAI's that every LLM server offers.

=======================  ==========================  ========================================================
``api``                  default path                a request
=======================  ==========================  ========================================================
``labserver``            ``/``, ``/predict``,        the body of ``mode`` (text, json or generate;
                         ``/generate``               ``labserver.wire``)
``openai-completions``   ``/v1/completions``         ``{"model", "prompt", "max_tokens", "stream", ...}``
``openai-chat``          ``/v1/chat/completions``    ``{"model", "messages": [{"role": "user", ...}], ...}``
``openai-embeddings``    ``/v1/embeddings``          ``{"model", "input", "encoding_format": "float"}``
=======================  ==========================  ========================================================

A generation request asks for exactly what vLLM's and guidellm's benchmarks ask: greedy
(``temperature`` 0), a stream with ``stream_options.include_usage`` (so output tokens
come from the server's own count), and ``ignore_eos`` when the run wants fixed output
lengths (a vLLM extension that labserver, vLLM, SGLang and llama.cpp honour; servers that
do not know it ignore it, and the records' ``n_tokens`` then show what came back).

Only bodies and names live here: sending is ``labserver.load.worker``'s, reading an
OpenAI stream ``labserver.load.openai_sse``'s. Nothing here imports the server.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit, urlunsplit

from .. import wire

__all__ = ["APIS", "GENERATIVE_APIS", "OPENAI_APIS", "default_path", "is_generative", "models_url", "openai_body"]

APIS = ("labserver", "openai-completions", "openai-chat", "openai-embeddings")
OPENAI_APIS = APIS[1:]
GENERATIVE_APIS = ("openai-completions", "openai-chat")
_PATHS = {"openai-completions": wire.V1_COMPLETIONS_PATH, "openai-chat": wire.V1_CHAT_PATH,
          "openai-embeddings": wire.V1_EMBEDDINGS_PATH}
_MODES = {"text": "/", "json": "/predict", "generate": wire.GENERATE_PATH}


def is_generative(api: str, mode: str) -> bool:
    """Whether requests of this api (and labserver ``mode``) generate tokens, read as streams."""
    return api in GENERATIVE_APIS or (api == "labserver" and mode == "generate")


def default_path(api: str, mode: str, url_path: str = "") -> str:
    """The path to load when the URL names none (or only ``/v1``, the base URL OpenAI clients take)."""
    if api == "labserver":
        return _MODES[mode]
    if url_path.rstrip("/").endswith("/v1"):
        return url_path.rstrip("/") + _PATHS[api].removeprefix("/v1")
    return _PATHS[api]


def models_url(url: str) -> str:
    """``GET /v1/models`` of the server behind a base or full URL (its ``/v1`` prefix kept)."""
    parts = urlsplit(url)
    path = parts.path
    prefix = path[: path.index("/v1") + 3] if "/v1" in path else "/v1"
    return urlunsplit((parts.scheme, parts.netloc, prefix + "/models", "", ""))


def openai_body(api: str, model: str, text: str, max_tokens: int | None = None, *, stream: bool = True,
                ignore_eos: bool = True, priority: int | None = None) -> bytes:
    """One request body of an OpenAI ``api`` for ``text`` asking ``max_tokens`` (generation);
    ``priority`` (a mix's class, lower served first) goes in as vLLM's ``"priority"`` field."""
    extra = {} if priority is None else {"priority": int(priority)}
    if api == "openai-embeddings":
        return json.dumps({"model": model, "input": text, "encoding_format": "float", **extra}).encode()
    doc: dict[str, object] = {"model": model, **extra}
    if api == "openai-chat":
        doc["messages"] = [{"role": "user", "content": text}]
    else:
        doc["prompt"] = text
    doc.update(max_tokens=int(max_tokens or 16), temperature=0.0, stream=stream)
    if stream:
        doc["stream_options"] = {"include_usage": True}
    if ignore_eos:
        doc["ignore_eos"] = True
    return json.dumps(doc).encode()
