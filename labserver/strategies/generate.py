"""Generation rules (gen-*): who joins the running batch at this step boundary, and how much KV memory it must find.

``admit(queue, running, clock)`` returns the sequences that join the running batch
(one model call per token); ``fits`` is the memory rule behind it (reserve the worst
case, or take the blocks a prompt needs now), ``victim`` whom to preempt when a step
finds no free block. The engine (``labserver.engine.step``) does the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from .base import Admission, Clock, Queue, Strategy, register

__all__ = ["GenContinuous", "GenHFContinuous", "GenNaive", "GenPaged", "GenStatic", "GenStrategy", "Running"]

class Running(Protocol):
    """The sequences admitted and not done, and the KV blocks they hold, as an admission rule sees them."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...  # in admission order: the last is the newest

    @property
    def total_blocks(self) -> int: ...  # the KV pool, in blocks

    @property
    def free_blocks(self) -> int: ...  # blocks a sequence could take now

    @property
    def reserved_blocks(self) -> int: ...  # blocks for prompt + max_new_tokens of every running sequence

    def blocks_for(self, tokens: int) -> int: ...

    def blocks_needed(self, seqs: list[Any]) -> int: ...  # blocks these would take now (prompt, next token)


# -- generation: who joins the running batch at this step boundary? -------------------------


class GenStrategy(Strategy):
    """A generation rule; ``admit`` waits only when nothing is running.

    Caps: ``max_batch_size`` sequences running together; KV memory in blocks of
    ``kv_block_tokens``, ``max_kv_tokens`` in all. These rules *reserve*: a sequence is
    admitted only if the blocks for its prompt and every token it may generate fit beside
    what the running ones reserved, so each always finds its next block and none is ever
    evicted (``gen-paged`` does otherwise). First come, first served: a sequence that does
    not fit goes back to the head of the queue (``putback``) and nobody overtakes it.
    """

    kind = "generate"
    offload = True  # every generation strategy keeps the model off the event loop
    holds_finished: ClassVar[bool] = False  # True: finished sequences wait for the whole batch
    scheduler: ClassVar[str] = "labserver"  # "transformers": the steps happen in transformers' own manager

    chunks_prefill: ClassVar[bool] = False  # True: it joins at every step, so prefill="chunked" applies

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        raise NotImplementedError

    def fits(self, seq: Any, running: Running, joining: list[Any]) -> bool:
        """Reservation: blocks for its prompt and all it may generate, held from admission to its end."""
        if len(running) + len(joining) >= self.limits.cap:
            return False
        wanted = sum(running.blocks_for(s.reserve) for s in (*joining, seq))
        return running.reserved_blocks + wanted <= running.total_blocks

    def victim(self, running: Running) -> Any:
        """Whom a step that finds no free block preempts: the most recently admitted (under reservation
        it never comes to this)."""
        return list(running)[-1]


@register
class GenNaive(GenStrategy):
    """One request at a time, start to finish."""

    name = "gen-naive"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"
        return [await queue.get()], "single"


@register
class GenStatic(GenStrategy):
    """Request-level batching: the deadline rule forms a batch, which runs until its longest member ends.

    Nobody joins a batch in flight; a member that finished early keeps its slot, is
    computed as padding (as ``model.generate`` computes a batch's finished rows) and is
    answered with the batch. That idle tail is the waste.
    """

    name = "gen-static"
    holds_finished = True

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"  # nobody joins a batch in flight
        batch = [await queue.get()]
        due_s = clock() + self.limits.max_wait_ms / 1000
        while len(batch) < self.limits.cap:
            if self.limits.idle_dispatch and queue.empty():
                return batch, "idle"
            remaining_s = due_s - clock()
            seq = await queue.get(remaining_s) if remaining_s > 0 else None
            if seq is None:
                return batch, "deadline"
            if not self.fits(seq, running, batch):
                queue.putback(seq)
                return batch, "kv-full"
            batch.append(seq)
        return batch, "full"


@register
class GenContinuous(GenStrategy):
    """Iteration-level scheduling (Orca, OSDI '22): join at every step boundary, leave as soon as done.

    ``prefill="budget"`` caps the prompt tokens prefilled between two decode steps
    (``max_prefill_tokens``), so a burst of new prompts stalls the running streams for
    a bounded time instead of all at once.
    """

    name = "gen-continuous"
    chunks_prefill = True

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        joining = [] if len(running) else [await queue.get()]  # nothing to decode: wait for work
        budget = self.limits.max_prefill_tokens if self.limits.prefill == "budget" else math.inf
        prompt_tokens = sum(len(s.prompt_ids) for s in joining)
        while not queue.empty():
            seq = await queue.get(0)
            if seq is None:
                break
            over_budget = joining and prompt_tokens + len(seq.prompt_ids) > budget
            if over_budget or not self.fits(seq, running, joining):
                queue.putback(seq)  # first in line next time: nobody overtakes it
                break
            joining.append(seq)
            prompt_tokens += len(seq.prompt_ids)
        return joining, "join" if len(running) else "start"


@register
class GenPaged(GenContinuous):
    """Paged KV memory (vLLM, SOSP '23): admit on the blocks a prompt needs now; preempt the newest when none is free.

    Reservation holds prompt + ``max_new_tokens`` from admission to the end, though most
    answers stop far earlier (EOS): memory promised and never used caps how many run
    together. Here a sequence needs only its prompt's blocks (and its next token's) to join,
    and takes one more block each time it fills one. When a step finds none free, the
    newest sequence is preempted: its blocks go back, it returns to the head of the queue,
    and is later prefilled again over its prompt and the tokens it already sent (recompute),
    so its stream goes on with nothing repeated or lost.
    """

    name = "gen-paged"

    def fits(self, seq: Any, running: Running, joining: list[Any]) -> bool:
        """Paging: the blocks its prompt needs now, and a spare block for every other running sequence
        (each wants one within ``kv_block_tokens`` steps: without the spare, the newcomer would be
        the first preempted, at once, over and over)."""
        if len(running) + len(joining) >= self.limits.cap:
            return False
        return running.blocks_needed([*joining, seq]) + len(running) + len(joining) <= running.free_blocks


@register
class GenHFContinuous(GenStrategy):
    """transformers' ContinuousBatchingManager (its own thread, scheduler and paged cache), fed from our queue.

    labserver keeps the queue, so 503, 504 and leaving clients work as for the others; at
    most ``max_batch_size`` requests are handed over at once, ``max_kv_tokens`` sizes its
    cache (``labserver.engine.hfcb``). There is no step log: the steps happen inside it.
    """

    name = "gen-hf-cb"
    scheduler = "transformers"
