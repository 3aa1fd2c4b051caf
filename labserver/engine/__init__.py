"""Engines: the queue, the worker and the model, joined by a strategy.

- ``base``: what every engine shares (queue, lifecycle, the door, counters, dropping the gone);
- ``batch``: ``BatchEngine``, encoders (one model call answers a batch of items);
- ``step``: ``StepEngine``, generation (one model call per token; sequences join and leave between steps);
- ``runner``: the model thread and failure isolation by splitting a batch;
- ``hfcb``: transformers' own continuous-batching manager as an outside scheduler (``gen-hf-cb``);
- ``virtual``: any strategy's rule on a virtual clock (deterministic, instant, no HTTP).

Nothing here knows HTTP.
"""

from __future__ import annotations

from typing import Any

from ..strategies import Strategy
from .base import EngineBase, Expired, Overloaded, ShuttingDown, WorkerDied
from .batch import BatchEngine, BatchRecord, Item
from .hfcb import serve_through_manager
from .step import Seq, StepEngine, StepRecord

__all__ = ["BatchEngine", "BatchRecord", "EngineBase", "Expired", "Item", "Overloaded", "Seq", "ShuttingDown",
           "StepEngine", "StepRecord", "WorkerDied", "make_engine"]


def make_engine(strategy: Strategy, model: Any) -> EngineBase:
    """The engine a strategy's kind calls for (and, for gen-hf-cb, transformers' manager as its scheduler)."""
    if strategy.kind != "generate":
        return BatchEngine(strategy, model)
    outside = serve_through_manager if getattr(strategy, "scheduler", "labserver") == "transformers" else None
    return StepEngine(strategy, model, scheduler=outside)  # type: ignore[arg-type]
