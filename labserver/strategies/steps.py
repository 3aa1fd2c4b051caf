"""How one generation step is composed: which sequences a model call computes, and how many tokens each.

A step is one or more model calls, each a list of ``(sequence, tokens it computes)``: a
prompt (or a piece of one, or a recompute after a preemption), or one token of a sequence
that is decoding. No call has a kind: who is decoding and who is prefilling is read from
the sequences themselves. A rule (``--prefill NAME``, ``Limits.prefill``) is one class:

- ``eager``: the newcomers' prompts, whole, in one call; then one decode for everyone;
- ``budget``: eager, but at most ``max_prefill_tokens`` of prompts join between two steps
  (``admit_tokens``: what the admission rule reads);
- ``chunked``: one call a step, each decoding sequence's next token first, then pieces of
  the prompts still being prefilled in what is left of ``max_step_tokens``.

``compose`` yields the calls one at a time, each built once the one before it has been
applied (so a decode sees whom the prefill finished or failed). A new rule is a subclass
registered by name; ``labserver serve --prefill NAME`` then finds it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

from ..registry import registrar

__all__ = ["PREFILLS", "Budget", "Call", "Chunked", "Eager", "PrefillRule", "make_prefill", "register_prefill"]

Call = list[tuple[Any, int]]  # one model call: each sequence and how many of its pending tokens it computes


class PrefillRule:
    """A way to compose a step (see the module docstring); ``compose`` is the rule."""

    name: ClassVar[str] = ""
    joins_each_step: ClassVar[bool] = False  # True: it needs a strategy that admits at every step (continuous)

    def __init__(self, limits: Any) -> None:
        self.limits = limits

    @classmethod
    def misfit(cls, limits: Any) -> str | None:
        """What is wrong with these limits for this rule (``Limits`` asks when it is made), or None."""
        return None

    @property
    def admit_tokens(self) -> float:
        """Prompt tokens that may join between two steps (the first newcomer always may)."""
        return math.inf

    def compose(self, running: Any) -> Iterator[Call]:
        raise NotImplementedError


PREFILLS: dict[str, type[PrefillRule]] = {}


register_prefill = registrar(PREFILLS, "prefill rule")


def make_prefill(limits: Any) -> PrefillRule:
    return PREFILLS[limits.prefill](limits)  # (Limits has checked the name)


@register_prefill
class Eager(PrefillRule):
    """The prompts of those not yet prefilled, whole, in one call; then one decode for every running sequence."""

    name = "eager"

    def compose(self, running: Any) -> Iterator[Call]:
        """gen-static's finished sequences decode too: computed as padding, as ``model.generate`` computes a batch's
        finished rows."""
        joined = [s for s in running if not s.decoding]
        if joined:
            yield [(s, s.pending) for s in joined]
        if len(running):
            yield [(s, 1) for s in running]


@register_prefill
class Budget(Eager):
    """Eager, with at most ``max_prefill_tokens`` of new prompts between two decode steps: a burst of prompts
    stalls the running streams for a bounded time instead of all at once."""

    name = "budget"

    @property
    def admit_tokens(self) -> float:
        return float(self.limits.max_prefill_tokens)


@register_prefill
class Chunked(PrefillRule):
    """One call a step: every decoding sequence's next token, then prompt pieces in what is left of
    ``max_step_tokens``, so a long prompt never stalls the streams (Sarathi-Serve; vLLM's chunked prefill)."""

    name = "chunked"
    joins_each_step = True

    @classmethod
    def misfit(cls, limits: Any) -> str | None:
        if limits.max_step_tokens <= (limits.max_batch_size or 0):
            return (f"max_step_tokens must be more than max_batch_size under prefill='chunked' (every decode takes "
                    f"one), got {limits.max_step_tokens!r}")
        return None

    def compose(self, running: Any) -> Iterator[Call]:
        decodes = [(s, 1) for s in running if s.decoding]  # decodes first: a stream never waits for a prompt
        room = self.limits.max_step_tokens - len(decodes)
        pieces = []
        for seq in running:
            if not seq.decoding and room > 0:
                pieces.append((seq, min(seq.pending, room)))
                room -= pieces[-1][1]
        yield decodes + pieces
