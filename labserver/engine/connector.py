"""What crosses engines: one KV connector, which the scheduler and the engine call at fixed points.

A step engine's KV lives in its own pool. Some serving shapes move it between engines:
disaggregated serving computes a prompt on one engine and decodes on another
(``labserver.engine.handover``); a KV cache tier would keep blocks past their pool. vLLM v1
puts all of these behind one interface (``KVConnectorBase_V1``), split into what its
scheduler asks and what its workers do; labserver's has the same two sides, smaller::

    submit(kv_transfer=...)       accept: what another engine made of a request, kept until it is admitted
    scheduler, admission          allocated: its blocks were just taken, the first ``hit`` from the prefix
                                  cache; note what comes from elsewhere (it is written before its next call)
    engine, before each call      load: write what was noted, on the model thread
    scheduler, a sequence ended   finished: keep its blocks for elsewhere (True) or let them go (False)
    engine stops                  close: give back whatever is still kept

An engine holds one connector or none (``StepEngine.connect``); colocated serving has none,
and the scheduler never learns which connector it has. A connector needs a model that
declares ``kv_portable`` (``export_kv``/``import_kv``: ``labserver.models.base.KVPortable``).
"""

from __future__ import annotations

from typing import Any

from .counters import Metric
from .sequence import Seq

__all__ = ["KVConnector"]


class KVConnector:
    """The interface, doing nothing: a subclass overrides what its transfer needs."""

    def accept(self, seq: Seq, kv_transfer: Any) -> None:
        """A queued sequence came with what another engine made of it (``submit(kv_transfer=...)``)."""
        raise NotImplementedError(f"{type(self).__name__} takes no KV with a request")

    def allocated(self, seq: Seq, hit: int, now: float) -> None:
        """``seq`` was just admitted, its block table taken (``hit`` positions from the prefix cache)."""

    async def load(self) -> None:
        """Before the engine's next model call: write the KV ``allocated`` noted (on the model thread)."""

    def finished(self, seq: Seq) -> bool:
        """``seq`` ended and leaves the batch: True to keep its blocks (the connector releases them later)."""
        return False

    def close(self) -> None:
        """The engine stops: every block still kept goes back."""

    def metrics(self) -> list[Metric]:
        """What it reports beside the engine's own (``/stats``, ``/metrics``)."""
        return []
