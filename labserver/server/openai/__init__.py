"""The OpenAI-compatible front door: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``.

The same runtime, engines and strategies as the native routes, answered in the shapes
the official ``openai`` SDK, vLLM's ``bench serve`` and guidellm parse (docs/openai.md):

- ``catalog``: ``GET /v1/models`` and the one model name the server answers to;
- ``params``: what a completions or chat request may carry (honoured, refused, ignored);
- ``text``: a completion's text as it grows (incremental detokenizing, stop strings);
- ``generation``: the completions and chat routes, one JSON answer or an SSE stream;
- ``embeddings``: the embeddings route on the batch engine;
- ``errors``: failures as ``{"error": {"message", "type", "param", "code"}}``.

Every request goes through ``labserver.server.handling.answer`` and its one error
table, so statuses, Retry-After, deadlines and clients that leave behave as on
``/generate`` and ``/predict``.
"""

from __future__ import annotations

from starlette.routing import Route

from ... import wire
from .catalog import get_models
from .embeddings import post_embeddings
from .errors import openai_error, openai_error_body
from .generation import post_chat, post_completions

__all__ = ["openai_error", "openai_error_body", "routes"]


def routes() -> list[Route]:
    return [
        Route(wire.V1_MODELS_PATH, get_models, methods=["GET"]),
        Route(wire.V1_COMPLETIONS_PATH, post_completions, methods=["POST"]),
        Route(wire.V1_CHAT_PATH, post_chat, methods=["POST"]),
        Route(wire.V1_EMBEDDINGS_PATH, post_embeddings, methods=["POST"]),
    ]
