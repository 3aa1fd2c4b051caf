"""Prefill here, decode there: one sequence's KV handed from one step engine to another.

Disaggregated serving (DistServe, Splitwise; vLLM's prefill and decode instances) runs a
request's two phases on different engines: one computes the prompt and the first token,
another makes the rest. Between them goes the prompt's KV, ``kv_bytes_per_token`` x the
prompt's tokens, so the decode side computes nothing of the prompt again.

The prefill side. A request submitted with ``hand_over=True`` is scheduled like any other;
its first token ends it ("hand-over", unless EOS, a stop string or ``max_new_tokens`` ended
it first: then it is simply answered). Its blocks are then not given back but *parked*
under a ticket (its sequence id)::

    parked ──pull(ticket)──► a copy of its KV (the model's ``export_kv``, on the model thread),
      │                      then its blocks go back (kept as prefix-cache blocks when caching)
      └──timeout_s──► freed unpulled (a decode side that died or gave up): ``kv_handovers_expired``

The decode side. ``submit(..., handed=Handover)`` queues a sequence whose prompt's KV came
with it. Admitted like any other, it takes its blocks (the prefix cache may hold its first
ones already: those positions are not written); the rest are written from the copy (the
model's ``import_kv``, on the model thread, before the next model call), its first token is
emitted then, and its next step is a decode. A sequence preempted later is recomputed from
its tokens as any other: the copy is used once.

Nothing here knows Ray: ``labserver.replicas.disagg`` moves the tickets and the copies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..models import Logprob
from .base import ReplicaLost
from .blocks import BlockManager
from .sequence import Seq, Status

__all__ = ["HANDOVER", "Handover", "Parking", "handed_in", "handover_lost"]

HANDOVER = "hand-over"  # the finish reason of a prefill side's sequence whose KV waits for a decode replica


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


def handed_in(seq: Seq, hit: int, now: float, counters: Any) -> None:
    """A sequence admitted with its prompt's KV (the scheduler's ``_give_blocks``, its blocks taken, ``hit`` of its
    positions in the prefix cache): its prompt counts as computed, its first token is emitted now, and its next call
    is a decode. The positions past the hit are written by the engine before that call."""
    handed = seq.handed
    counters.kv_handed_in += 1
    counters.kv_imported_tokens += len(seq.prompt_ids) - hit
    seq.computed, seq.status = len(seq.prompt_ids), Status.DECODING
    seq.emit(handed.first, now, None, logprob=handed.logprob)  # (the prefill side's token: EOS ruled out there)
    counters.tokens_generated += 1


class Parking:
    """The prefill side's sequences whose blocks wait for a pull, each with a timer that frees them."""

    def __init__(self, blocks: BlockManager, timeout_s: float, expired: Callable[[Seq], None]) -> None:
        self.blocks, self.timeout_s, self.expired = blocks, timeout_s, expired
        self.parked: dict[int, tuple[Seq, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self.parked)

    @property
    def held_blocks(self) -> int:
        return sum(len(self.blocks.tables[sid]) for sid in self.parked)

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
