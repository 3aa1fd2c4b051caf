"""Prefill here, decode there: two pools of replicas on Ray Serve, the KV handed over between them.

``serve(..., disaggregate=(P, D))`` (``labserver serve --disaggregate P:D``) deploys P
*prefill* replicas and D *decode* replicas of the same model behind one ingress and the
same routes. The ingress plays vLLM's disaggregation proxy::

    client ─► ingress ─① job, remote_decode ─► prefill pool (the router picks) ── prompt + first token,
                 │                            blocks parked under a ticket ◄─┐
                 │ ◄── Done(HAND_OVER, ticket) ────┘                          │ ③ pull (pinned to that replica):
                 └─② job, kv={replica, ticket} ─► decode pool (the router picks) ─┘   a copy of the KV, its blocks back
                        ◄── Pulled(ms, bytes), then the tokens: the first (the prefill's) once admitted, then the rest

A request whose first token ends it (EOS, a stop string, ``max_tokens`` 1) is answered by
its prefill replica and never reaches a decode replica. The client sees its first token
when the decode replica has admitted the sequence, as with vLLM's proxy: so TTFT splits
into queue (the ingress's and the prefill replica's), prefill, transfer (the pull) and
decode (the decode replica's queue until admission), each in the answer's ``timing``.

The transfer goes through Ray: the pull is an actor call, its answer (the KV, a tensor of
``kv_bytes_per_token`` x the prompt's tokens) travels through Ray's object store. The
ingress counts ``kv_transfer_bytes`` and ``kv_transfer_ms`` (``/stats``, ``/metrics``);
each replica counts its side (``kv_handed_out``, ``kv_handed_in``, ``kv_parked``, ...).

What can go wrong, and what happens:

- a decode replica that dies before it pulls: the ingress sends the job to the decode pool
  once more (no token has reached the client; the prefill replica still holds the KV); a
  second loss is a 503 ``model_unavailable`` that says to retry. KV never pulled is freed
  by its prefill replica after ``handover_timeout_s``;
- a prefill replica that dies mid-prompt: 503 ``model_unavailable``; its blocks die with it,
  and no decode replica ever heard of the request;
- a decode replica with no room: the sequence waits in its queue as any request does (its
  ``max_queue`` refuses with 503 and Retry-After); a prompt + ``max_tokens`` over its whole
  KV budget is refused with 400 by the prefill replica's own check, before any work.

Imports Ray: only ``labserver.replicas.serve_replicas`` loads this module.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..engine.base import ReplicaLost
from ..engine.counters import count, tally
from ..engine.genbase import GenCounters
from ..engine.output import Done, Failed, Made, Placed, Pulled
from ..engine.ending import FinishReason
from ..engine.sequence import Seq
from .remote import ERRORS, REPLICA_LOST, BoardedEngine, failure, job_of, until

__all__ = ["DisaggCounters", "DisaggEngine", "core_groups"]

logger = logging.getLogger(__name__)

DECODE_TRIES = 2  # a decode replica lost before any token reached the client: the job goes to the pool again once


@dataclass
class DisaggCounters(GenCounters):
    kv_transfer_bytes: int = count("Disaggregated: bytes of KV handed from prefill to decode replicas "
                                   "(kv_bytes_per_token x prompt tokens)")
    kv_transfer_ms: float = count("Disaggregated: milliseconds decode replicas spent pulling KV")
    kv_transfers: int = count("Disaggregated: sequences whose KV was handed over")
    answered_by_prefill: int = count("Disaggregated: sequences their first token ended (EOS, stop, max_tokens 1): "
                                     "no hand-over")
    decode_retries: int = count("Disaggregated: jobs sent to the decode pool again after a decode replica was lost "
                                "before any token reached the client")
    ttft_split_ms: Counter[str] = tally("Disaggregated: time to first token of the sequences handed over, summed by "
                                        "part: queue (the ingress's and the prefill replica's), prefill, transfer "
                                        "(the pull), decode (to the decode replica's admission)", "part")


class _DecodeLost(Exception):
    """The decode replica's stream ended without an answer and no token reached the client (may be retried)."""


class DisaggEngine(BoardedEngine):
    """The ingress's engine, disaggregated: ``handle`` is the prefill pool's, ``decode`` the decode pool's."""

    counters: DisaggCounters  # type: ignore[assignment]

    def __init__(self, strategy: Any, model: Any, prefill: Any, max_in_flight: int, board: Any, decode: Any) -> None:
        super().__init__(strategy, model, prefill, max_in_flight, board)
        self.decode = decode
        self.counters = DisaggCounters()

    async def _stream(self, seq: Seq) -> None:
        """The prefill pool computes the prompt and first token; then the decode pool makes the rest."""
        job = job_of(seq)
        prefill = first = ticket = None
        async for event in until(self.handle.options(stream=True).generate.remote({**job, "remote_decode": True}),
                                 seq.future):
            match event:
                case Placed(replica):
                    prefill = seq.replica = replica
                case Made():
                    first = event
                case Done(reason, ticket=t) if reason is FinishReason.HAND_OVER:
                    ticket = t
                case Done():  # its first token ended it: answered here
                    if first is not None:
                        self._made(seq, first)
                    self._finish(seq, event)
                    self.counters.answered_by_prefill += 1
                    return
                case Failed(kind, message):
                    raise failure(kind, message)
        if seq.future.done():  # (the client left)
            return
        if ticket is None or first is None:
            raise ReplicaLost(REPLICA_LOST)
        if first.prefill_ms is not None:  # its prefill began this long before its first token reached us
            seq.admitted_s = self.clock() - first.prefill_ms / 1000
        seq.prefilled_s = self.clock()
        for attempt in range(DECODE_TRIES):
            try:
                await self._decode(seq, job, prefill, ticket)
                return
            except _DecodeLost:
                if attempt + 1 == DECODE_TRIES:
                    raise ReplicaLost(REPLICA_LOST) from None
                self.counters.decode_retries += 1
                logger.warning("request %s: decode replica lost before its first token; sent to the decode pool "
                               "again", seq.request_id)

    async def _decode(self, seq: Seq, job: dict[str, Any], prefill: str | None, ticket: int) -> None:
        stream = self.decode.options(stream=True).generate.remote({**job, "kv": {"replica": prefill,
                                                                                 "ticket": ticket}})
        try:
            async for event in until(stream, seq.future):
                match event:
                    case Placed(replica):
                        seq.replica = f"{prefill}>{replica}"
                    case Pulled(ms, size):
                        seq.transfer_ms = ms
                        self.counters.kv_transfers += 1
                        self.counters.kv_transfer_ms += ms
                        self.counters.kv_transfer_bytes += size
                    case Made():  # (its own prefill_ms is the hand-over's admission: the prefill replica's counts)
                        first = not seq.tokens
                        self._made(seq, dataclasses.replace(event, prefill_ms=None))
                        if first:
                            self._split(seq)
                    case Done():
                        self._finish(seq, event)
                    case Failed(kind, message):
                        raise failure(kind, message)
        except tuple(ERRORS.values()):
            raise
        except Exception as e:  # a decode replica that died mid-call (Ray's RayActorError and kin)
            if seq.tokens:
                raise
            logger.warning("request %s: decode replica %s lost: %s", seq.request_id, seq.replica, e)
            raise _DecodeLost from None
        if not seq.future.done():
            if seq.tokens:
                raise ReplicaLost(REPLICA_LOST)
            raise _DecodeLost


    def _split(self, seq: Seq) -> None:
        """Its time to first token, by part, into ``ttft_split_ms`` (the answer's ``timing`` has the same)."""
        split = self.counters.ttft_split_ms
        transfer = 0.0 if math.isnan(seq.transfer_ms) else seq.transfer_ms  # (NaN: not pulled)
        split["queue"] += 1000 * (seq.admitted_s - seq.enqueued_s)
        split["prefill"] += 1000 * (seq.prefilled_s - seq.admitted_s)
        split["transfer"] += transfer
        split["decode"] += 1000 * (seq.first_token_s - seq.prefilled_s) - transfer


def core_groups(cores: list[int], replicas: int) -> list[list[int]]:
    """``cores`` split among ``replicas`` in order, as evenly as they go (each gets at least one: with more
    replicas than cores, they take turns)."""
    if len(cores) >= replicas:
        k = len(cores) // replicas
        return [cores[i * k:(i + 1) * k] for i in range(replicas)]
    return [[cores[i % len(cores)]] for i in range(replicas)]
