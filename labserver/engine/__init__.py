"""Engines: the queue, the worker and the model, joined by a strategy.

Shared by both wings:

- ``base``: what every engine shares (queue, lifecycle, the door, counters, dropping the gone);
- ``counters``: counters named once, where they are counted, with their help text;
- ``line``: the waiting line; ``modelthread``: the model thread and failure isolation by splitting.

Encoders (one model call answers a batch of items): ``batch`` (``BatchEngine``) and ``virtual``
(an encoder rule on a virtual clock: the same worker, deterministic, instant, no HTTP).

Generation (one model call per token): ``genbase`` (a request becomes a ``Seq``), ``scheduler``
(the ``Scheduler``: waiting and running sequences, KV blocks, each model call as a list of
sequences and the tokens each computes, every decision asked of the strategy), ``step``
(``StepEngine``, the loop that runs its calls), ``sequence`` (one ``Seq``, and its one ending),
``output`` (its text, decoded once; the typed events a replica streams), ``blocks`` (who holds
which KV block), ``hfcb`` (``HFEngine``: transformers' own manager, ``gen-hf-cb``) and
``gensim`` (a gen-* rule on a virtual clock: the same step loop).

``make_engine`` finds the engine a strategy runs on in ``ENGINES``, by the strategy's class
(its nearest registered base). Nothing here knows HTTP.
"""

from __future__ import annotations

from typing import Any

from ..strategies import GenHFContinuous, GenStrategy, Strategy
from .base import EngineBase, Expired, Overloaded, ReplicaLost, ShuttingDown, WorkerDied
from .batch import BatchEngine, BatchRecord, Item
from .connector import KVConnector
from .ending import FinishReason, Status
from .genbase import GenEngine
from .hfcb import HFEngine
from .scheduler import Scheduler, CallRecord
from .sequence import Seq
from .step import StepEngine

__all__ = ["ENGINES", "BatchEngine", "BatchRecord", "EngineBase", "Expired", "FinishReason", "GenEngine", "HFEngine",
           "Item", "KVConnector", "Overloaded", "ReplicaLost", "Scheduler", "Seq", "ShuttingDown", "Status", "StepEngine",
           "CallRecord", "WorkerDied", "make_engine"]

# strategy class -> the engine its rules run on; a subclass runs on its nearest base's engine
ENGINES: dict[type[Strategy], type[EngineBase]] = {
    Strategy: BatchEngine,  # encoders: one model call answers a batch
    GenStrategy: StepEngine,  # generation: labserver's scheduler plans every call
    GenHFContinuous: HFEngine,  # transformers' manager plans them
}


def make_engine(strategy: Strategy, model: Any) -> EngineBase:
    """The engine this strategy runs on (``ENGINES``), with its model."""
    engine = next(ENGINES[cls] for cls in type(strategy).__mro__ if cls in ENGINES)
    return engine(strategy, model)  # type: ignore[call-arg]
