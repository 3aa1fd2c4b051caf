"""Prefill here, decode there: one sequence's KV handed from one step engine to another (a ``KVConnector``).

Disaggregated serving (DistServe, Splitwise; vLLM's prefill and decode instances) runs a
request's two phases on different engines: one computes the prompt and the first token,
another makes the rest. Between them goes the prompt's KV, ``kv_bytes_per_token`` x the
prompt's tokens, so the decode side computes nothing of the prompt again. Both sides plug
a ``HandoverConnector`` into their engine (``StepEngine.connect``); the scheduler calls it
as it calls any connector (``labserver.engine.connector``).

The prefill side. A request submitted with ``remote_decode=True`` is scheduled like any
other; its first token ends it (``FinishReason.HAND_OVER``, unless EOS, a stop string or
``max_new_tokens`` ended it first: then it is simply answered). Its blocks are then not
given back (``finished``) but *parked* under a ticket (its sequence id)::

    parked ──pull(ticket)──► a copy of its KV (the model's ``export_kv``, off the model thread),
      │                      then its blocks go back (kept as prefix-cache blocks when caching)
      └──timeout_s──► freed unpulled (a decode side that died or gave up): ``kv_handed_expired``

The decode side. ``submit(..., kv_transfer=Handover)`` queues a sequence whose prompt's KV
came with it (``accept``). Admitted like any other, it takes its blocks (the prefix cache
may hold its first ones already: those positions are not written); its first token is
emitted then (``allocated``), the rest of its positions are written from the copy before
the next model call (``load``: the model's ``import_kv``, on the model thread), and its next
step is a decode. A sequence preempted later is recomputed from its tokens as any other:
the copy is used once.

Nothing here knows Ray: ``labserver.replicas.disagg`` moves the tickets and the copies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..models import Logprob, ModelError, ModelLoadError
from .base import ReplicaLost, WorkerDied
from .blocks import BlockManager
from .connector import KVConnector
from .counters import Metric, gauge
from .ending import FinishReason, Status
from .sequence import Seq

logger = logging.getLogger(__name__)

__all__ = ["Handover", "HandoverConnector", "Parking", "handover_lost"]


@dataclass(frozen=True)
class Handover:
    """What a decode engine needs to go on with a sequence a prefill engine began."""

    first: int  # the first token, chosen by the prefill side
    positions: int  # KV positions in ``kv``: the prompt's
    kv: Any  # the model's copy of them (``export_kv``: a tensor for a real model)
    logprob: Logprob | None = None  # the first token's, when the request asked for log-probabilities
    prompt_logprobs: tuple[Logprob, ...] = ()  # the prompt's (echo), scored on the prefill side


def handover_lost(ticket: int) -> ReplicaLost:
    return ReplicaLost(f"the prefill replica no longer holds hand-over {ticket} (pulled already, freed after its "
                       "timeout, or the replica stopped); retry")


class Parking:
    """The prefill side's sequences whose blocks wait for a pull, each with a timer that frees them."""

    def __init__(self, blocks: BlockManager, timeout_s: float, expired: Callable[[Seq], None]) -> None:
        self.blocks, self.timeout_s, self.expired = blocks, timeout_s, expired
        self.parked: dict[int, tuple[Seq, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self.parked)

    def park(self, seq: Seq) -> None:
        """Keep ``seq``'s blocks for a pull, for ``timeout_s`` at most (on the event loop)."""
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, seq.sid)
        self.parked[seq.sid] = (seq, timer)

    def _expire(self, ticket: int) -> None:
        seq, _ = self.parked.pop(ticket)
        self.blocks.release(ticket)
        self.expired(seq)

    def take(self, ticket: int) -> tuple[Seq, tuple[int, ...]]:
        """The parked sequence and its block table, no longer timed; ``release`` its blocks once copied.
        ReplicaLost when nothing is parked under ``ticket``."""
        try:
            seq, timer = self.parked.pop(ticket)
        except KeyError:
            raise handover_lost(ticket) from None
        timer.cancel()
        return seq, tuple(self.blocks.tables[ticket])

    def release(self, ticket: int) -> None:
        self.blocks.release(ticket)

    def clear(self) -> None:
        """Every parked sequence's blocks back (the engine stops)."""
        for ticket, (_, timer) in list(self.parked.items()):
            timer.cancel()
            self.blocks.release(ticket)
        self.parked.clear()


class HandoverConnector(KVConnector):
    """A step engine's side of disaggregated serving: the prefill side parks and hands out, the decode side takes in.

    ``engine``: the ``StepEngine`` it is plugged into (its blocks, model, counters, model thread and ``end``).
    """

    def __init__(self, engine: Any) -> None:
        if not engine.model.kv_portable:
            raise ModelLoadError(f"{engine.model.name} cannot copy its KV out or in (kv_portable): disaggregated "
                                 "serving needs a model with export_kv and import_kv")
        self.engine = engine
        self.parking = Parking(engine.blocks, engine.limits.handover_timeout_s, self._expired)
        self.incoming: dict[int, Handover] = {}  # decode side: queued sequences' copies, until written
        self.writes: list[tuple[Seq, int]] = []  # admitted, their positions past the hit still to write

    # -- the decode side --------------------------------------------------------------------------
    def accept(self, seq: Seq, kv_transfer: Any) -> None:
        handover: Handover = kv_transfer
        self.incoming[seq.sid] = handover
        seq.prompt_logprobs[:] = handover.prompt_logprobs

    def allocated(self, seq: Seq, hit: int, now: float) -> None:
        """Its prompt counts as computed, its first token is emitted now, its next call is a decode; the positions
        past the hit are written by ``load`` before that call."""
        handover = self.incoming.get(seq.sid)
        if handover is None:
            return
        counters = self.engine.counters
        counters.kv_handed_in += 1
        counters.kv_imported_tokens += len(seq.prompt_ids) - hit
        seq.computed, seq.status = len(seq.prompt_ids), Status.DECODING
        seq.emit(handover.first, now, None, logprob=handover.logprob)  # (the prefill side's token: EOS ruled out)
        counters.tokens_generated += 1
        self.writes.append((seq, hit))

    async def load(self) -> None:
        """The copies of the sequences admitted since the last call, written on the model thread; one that does not
        fit this model fails alone."""
        writes, self.writes = self.writes, []
        engine = self.engine
        for seq, start in writes:
            handover = self.incoming.pop(seq.sid)
            if seq.future.done():  # (ended meanwhile: left, or answered by its first token)
                continue
            table = tuple(engine.blocks.tables[seq.sid])
            try:
                await engine.call(engine.model.import_kv, seq.sid, table, start, handover.positions, handover.kv)
            except WorkerDied:
                raise
            except Exception as e:
                logger.warning("sequence %d: its hand-over could not be written: %s", seq.sid, e)
                engine.counters.items_failed += 1
                engine.end(seq, FinishReason.ERROR, ModelError(f"the KV handed over does not fit "
                                                               f"{engine.model.name}: {e}"))
                continue
            engine.blocks.computed(seq.sid, seq.context, handover.positions)

    # -- the prefill side -------------------------------------------------------------------------
    def finished(self, seq: Seq) -> bool:
        """A sequence whose first token ended it for a decode engine keeps its blocks, parked; any other lets go
        (a decode side's that ended before its copy was written drops the copy)."""
        self.incoming.pop(seq.sid, None)
        if seq.finish_reason is FinishReason.HAND_OVER and not seq.future.cancelled():
            self.parking.park(seq)
            return True
        return False

    async def pull(self, ticket: int) -> Handover:
        """A parked sequence's KV (a copy) for a decode engine; its blocks go back. ReplicaLost when nothing is
        parked under ``ticket`` (pulled already, or freed after ``handover_timeout_s``)."""
        engine = self.engine
        seq, table = self.parking.take(ticket)
        try:  # (off the model thread, which may be in a long prefill: no call writes a parked sequence's blocks)
            kv = await asyncio.to_thread(engine.model.export_kv, table, len(seq.prompt_ids))
        finally:
            self.parking.release(ticket)
        engine.counters.kv_handed_out += 1
        engine.counters.kv_handed_out_bytes += len(seq.prompt_ids) * engine.model.kv_bytes_per_token
        return Handover(seq.tokens[0], len(seq.prompt_ids), kv, seq.logprobs[0] if seq.logprobs else None,
                        tuple(seq.prompt_logprobs))

    def _expired(self, seq: Seq) -> None:
        self.engine.counters.kv_handed_expired += 1
        logger.warning("request %s: its KV was not pulled within %g s; freed", seq.request_id,
                       self.engine.limits.handover_timeout_s)

    def close(self) -> None:
        self.parking.clear()

    def metrics(self) -> list[Metric]:
        return [gauge("kv_parked", "Disaggregated prefill side: sequences whose blocks wait for a decode replica's "
                      "pull", len(self.parking))]
