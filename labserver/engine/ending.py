"""How a sequence ends, and where it is until then: one ``FinishReason`` and the scheduler's ``Status``.

Every ending goes through ``GenEngine.end`` (``labserver.engine.genbase``), which records the
reason, lets the sequence's blocks and KV go and settles its future; the routes translate a
reason into their API's words at the edge (``labserver.server.openai.finish``).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["FinishReason", "Status", "status_of"]


class FinishReason(Enum):
    """How a sequence ended: every way there is, each settled by ``GenEngine.end`` (vLLM's request status folds
    them so: FINISHED_STOPPED, FINISHED_LENGTH_CAPPED, FINISHED_ABORTED, FINISHED_ERROR ...). The API's words for
    them are the routes' (``server.openai.finish``); the value is labserver's own word (``/generate``, ``/stats``)."""

    STOP = "stop"  # a stop string in its text
    LENGTH = "length"  # max_new_tokens made
    EOS = "eos"  # the model chose to end (EOS, or a token its config ends with)
    HAND_OVER = "hand-over"  # its first token made, its KV kept for another engine (a KV connector's)
    ABORT = "abort"  # its client left, or the server stopped before it was done
    ERROR = "error"  # the model failed on it, its worker or replica died, its KV could not be had
    EXPIRED = "expired"  # its deadline passed before a first token (504): never computed
    SHED = "shed"  # the queue's discipline refused it (503): never computed

    @property
    def answered(self) -> bool:
        """It ended with an answer (its tokens were made), not an error."""
        return self in _ANSWERED


_ANSWERED = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.EOS, FinishReason.HAND_OVER})


class Status(Enum):
    """Where a sequence is, as the scheduler keeps it; the last four are endings (``GenEngine.end``)."""

    WAITING = "waiting"  # queued (or preempted and queued again): nothing of it in the KV cache
    PREFILLING = "prefilling"  # admitted: its prompt (or a piece, or a recompute) is being computed
    DECODING = "decoding"  # only its last token lacks KV: one decode step makes the next
    FINISHED = "finished"  # answered (gen-static computes it again as padding until its batch is done)
    ABORTED = "aborted"  # ended without its answer: the client left, or the server stopped
    FAILED = "failed"  # ended with an error
    REFUSED = "refused"  # ended before it was computed: expired or shed


def status_of(reason: FinishReason) -> Status:
    """The status a sequence ending for ``reason`` is left in."""
    if reason.answered:
        return Status.FINISHED
    return {FinishReason.ABORT: Status.ABORTED, FinishReason.ERROR: Status.FAILED}.get(reason, Status.REFUSED)
