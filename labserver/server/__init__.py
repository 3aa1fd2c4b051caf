"""The Starlette app: one model, one engine, the routes that feed it.

- ``runtime``: what one running app holds (the model, loaded in the background; the engine; response counts);
- ``handling``: what every route shares (one way to answer, one error table, waiting for the answer or the client);
- ``encode``: ``POST /`` and ``POST /predict``, for the encoder strategies;
- ``generate``: ``POST /generate`` (JSON or server-sent events), for the gen-* strategies;
- ``app``: ``create_app``, ``/health``, ``/stats``; ``metrics``: ``/metrics``; ``looplag``: the event-loop lag probe.

Nothing here knows how load is generated.
"""

from __future__ import annotations

from .app import create_app, stats_dict
from .runtime import Runtime

__all__ = ["Runtime", "create_app", "stats_dict"]
