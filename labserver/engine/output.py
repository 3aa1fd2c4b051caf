"""A sequence's text as its tokens come: each token decoded once, stop strings found in the new text only.

Every generation engine gives each sequence one ``Detokenizer`` (``GenEngine.submit``);
``Seq.emit`` pushes each token into it, and a stop string it finds ends the sequence
("stop"). The routes read the same text (``server.openai.text.TextStream`` only holds back
what a stop string could still claim), so a token is turned into text once, and the
engine and the route can never disagree about where a stop string begins.

Decoding. A token's text can depend on its neighbours (a WordPiece "##ing" joins the word
before it; a tokenizer may tidy spaces around punctuation), so each new token is decoded
together with the one or two before it, and only the part past the window's previous text
is new: two decodes of a few tokens per token, whatever the answer's length (the
incremental detokenizers of TGI and vLLM work so). A byte-level tokenizer may split one
character over several tokens; while the window's text ends in U+FFFD (half a
character) nothing is added, and the window grows until the character is whole.
``finish`` adds what is left, replacement character included: nothing generated is lost.

Stop strings. Earlier text holds no stop string (it was searched when it was new), so one
can only end inside the new text: the search covers the new text and the
``len(longest stop) - 1`` characters before it. With ``s`` stop strings of length at most
``L``, a token costs O(s x (L + its text)), and a whole answer time linear in its length.

Events. Behind a router a replica's engine makes the tokens and the ingress's sequence
mirrors them: the replica streams typed events (``Placed``, ``Made``, ``Done``, ``Failed``),
and the ingress replays them into its own sequence (``labserver.replicas.remote``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ending import FinishReason

__all__ = ["Detokenizer", "Done", "Event", "Failed", "Made", "Placed", "Pulled"]


class Detokenizer:
    """One sequence's text, built token by token (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode  # the model's tokens -> text (special tokens left out)
        self.stop = tuple(s for s in stop if s)
        self.reach = max((len(s) for s in self.stop), default=1) - 1  # characters a stop may reach back
        self.stop_string: str | None = None  # the stop string found: the text ends before it
        self.decoded = 0  # tokens turned into text so far
        self.text = ""  # everything decoded so far (up to a stop string, once found)
        self._window: list[int] = []  # the tokens whose text was last added, then those since
        self._known = 0  # of the window: tokens whose text is in the text already

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, token: int) -> bool:
        """One more token; True when its text completes a stop string (the text then ends before it)."""
        if self.stopped:
            return True
        self.decoded += 1
        self._window.append(token)
        before = self.decode(self._window[:self._known])
        after = self.decode(self._window)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # (U+FFFD: half a character, wait)
            self._add(after[len(before):])
            self._window = self._window[self._known:]  # the last whole token(s) stay as the next one's context
            self._known = len(self._window)
        return self.stopped

    def finish(self) -> None:
        """No more tokens: a character left half made is added as the tokenizer decodes it."""
        if self.stopped or self._known == len(self._window):
            return
        before = self.decode(self._window[:self._known])
        after = self.decode(self._window)
        if len(after) > len(before):
            self._add(after[len(before):])
        self._known = len(self._window)

    def _add(self, new: str) -> None:
        if self.stop:
            start = max(0, len(self.text) - self.reach)
            span = self.text[start:] + new  # the only place a stop string can end: the new text and a stop's reach
            found = [(at, s) for s in self.stop if (at := span.find(s)) >= 0]
            if found:
                at, self.stop_string = min(found)
                self.text = (self.text + new)[:start + at]  # (it may begin in text already held)
                return
        self.text += new


# -- a sequence's events, as one process streams them to another (a replica to the ingress) ----------


@dataclass(frozen=True)
class Placed:
    """Which replica generates it (first of its events)."""

    replica: str


@dataclass(frozen=True)
class Made:
    """Tokens made since the last event, with their log-probabilities when asked for; the first carries its
    prefill's own time and the prompt's log-probabilities (echo)."""

    tokens: list[int]
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] = field(default_factory=list)
    prefill_ms: float | None = None

    @classmethod
    def since(cls, seq: Any, sent: int) -> Made:
        """What ``seq`` made after its first ``sent`` tokens."""
        first = {"prefill_ms": (seq.first_token_s - seq.admitted_s) * 1000,
                 "prompt_logprobs": list(seq.prompt_logprobs)} if not sent else {}
        return cls(seq.tokens[sent:], seq.logprobs[sent:] if seq.logprobs else None, **first)


@dataclass(frozen=True)
class Done:
    """Answered: why it ended, and what its engine counted of it; ended for a hand-over (a prefill replica's), the
    ticket its KV waits under for a decode replica's pull (``labserver.engine.connector``)."""

    finish_reason: FinishReason
    decode_calls: int = 0
    decode_batch_sum: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    ticket: int | None = None

    @classmethod
    def of(cls, seq: Any) -> Done:
        return cls(seq.finish_reason, seq.decode_calls, seq.decode_batch_sum, seq.cached_tokens, seq.preemptions,
                   seq.sid if seq.finish_reason is FinishReason.HAND_OVER else None)


@dataclass(frozen=True)
class Pulled:
    """A decode replica holds the sequence's KV, pulled from its prefill replica: how long it took, how many bytes."""

    ms: float
    bytes: int


@dataclass(frozen=True)
class Failed:
    """It failed: labserver's error kind (``server.handling.ERROR_TABLE``) and the message a client may read."""

    kind: str
    message: str


Event = Placed | Made | Done | Failed | Pulled
