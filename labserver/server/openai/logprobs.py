"""Log-probabilities in OpenAI's two shapes, from what the engine kept per token (``models.Logprob``).

- ``/v1/completions`` (``"logprobs": K``): four parallel lists, ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (per token a ``{text: logprob}`` of its K most
  likely alternatives and, as OpenAI and vLLM do, the chosen token's own) and
  ``text_offset`` (where each token's text begins in the choice's text). With ``echo``,
  the prompt's tokens come first; its first token has nothing before it to be predicted
  from (what evaluation harnesses skip), so it gets ``UNLIKELY`` and itself as its only
  alternative: OpenAI's own answer has null there, but its published schema has numbers
  and objects only, and the SDKs and clients generated from that schema parse by it.
- ``/v1/chat/completions`` (``"logprobs": true, "top_logprobs": K``): ``{"content":
  [...], "refusal": null}``, per token its text, log-probability, UTF-8 ``bytes`` and K
  alternatives.

Every token the model chose is listed, EOS included: the values are the model's, from
its raw scores (before temperature and top-p), so a scoring harness reads the model
itself. A token's text is the model's ``token_text``; its bytes are the tokenizer's own
(a byte-level token may hold half a character, which its text cannot show).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...models import GenModel, Logprob

__all__ = ["UNLIKELY", "chat_logprobs", "completion_logprobs", "prompt_entries"]


UNLIKELY = -9999.0  # chat's value for a log-probability it does not have (OpenAI: "very unlikely")


def _text(model: GenModel, token: int) -> str:
    return model.token_text(token)


def _bytes(model: GenModel, token: int) -> list[int]:
    return list(model.token_bytes(token))


def prompt_entries(prompt_ids: Sequence[int], scored: Sequence[Logprob]) -> list[Logprob]:
    """The prompt's tokens as entries: its first with no log-probability (NaN: shown ``UNLIKELY``), then those scored."""
    return [Logprob(prompt_ids[0], math.nan), *scored] if prompt_ids else []


def completion_logprobs(model: GenModel, entries: Sequence[Logprob], offset: int) -> dict[str, Any]:
    """The completions shape for these tokens; ``offset``: where the first one's text begins in the choice's text.

    A NaN log-probability (the prompt's first token; a token the EOS stand-in chose) is ``UNLIKELY``."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = _text(model, e.token)
        logprob = UNLIKELY if math.isnan(e.logprob) else e.logprob
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{_text(model, t): v for t, v in e.top}, text: logprob})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(model: GenModel, entries: Sequence[Logprob]) -> dict[str, Any]:
    """The chat shape for these tokens (a NaN log-probability is ``UNLIKELY``)."""
    return {"content": [{"token": _text(model, e.token),
                         "logprob": UNLIKELY if math.isnan(e.logprob) else e.logprob, "bytes": _bytes(model, e.token),
                         "top_logprobs": [{"token": _text(model, t), "logprob": v, "bytes": _bytes(model, t)}
                                          for t, v in e.top]}
                        for e in entries],
            "refusal": None}
