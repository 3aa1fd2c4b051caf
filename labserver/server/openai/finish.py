"""How a sequence ended, in the API's words: the one table from ``FinishReason`` to OpenAI's and vLLM's.

OpenAI's ``finish_reason`` is ``stop`` (the model ended, or a stop string did) or ``length``;
vLLM's ``FinishReason`` adds ``abort`` and ``error`` (its ``vllm:request_success`` metric is
labelled with them). labserver's own reasons are finer (``eos``, a hand-over, an expiry):
each maps to one of those words, or to none where vLLM keeps no count of it (a request
refused before it ran: vLLM counts those as admission rejections).
"""

from __future__ import annotations

from ...engine.ending import FinishReason

__all__ = ["API_WORDS", "api_word"]

API_WORDS: dict[FinishReason, str | None] = {
    FinishReason.STOP: "stop",
    FinishReason.EOS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.HAND_OVER: "length",  # (vLLM's prefill instance ends at its max_tokens of 1)
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.EXPIRED: None,
    FinishReason.SHED: None,
}


def api_word(reason: FinishReason | None) -> str:
    """An answered sequence's ``finish_reason`` (``stop`` where nothing says otherwise)."""
    return (API_WORDS[reason] if reason is not None else None) or "stop"
