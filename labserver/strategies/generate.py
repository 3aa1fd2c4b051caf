"""Generation rules (gen-*): who joins, how a step is composed, whom to preempt, who leaves.

The engine's scheduler (``labserver.engine.scheduler``) asks a rule four questions, and
their answers are everything that differs between one gen-* strategy and another:

- ``admit(queue, running, clock)``: who joins the running batch at this step boundary
  (``order``: in what order the waiting are considered; ``fits``: how much KV memory one
  must find free to join), and whom a newcomer of a higher class displaces: an ``Admission``;
- ``compose(running)``: the model calls of one step, each built once the one before it
  has been applied: the prefill rule's (``labserver.strategies.steps``: eager, budget,
  chunked, one class each);
- ``victim(running)``: whom a call that finds no free KV block preempts;
- ``leaving(running)``: who leaves the batch after a call.

The scheduler does the bookkeeping (blocks, counters, the step log) and the engine runs
the model; neither decides anything these methods decide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from .base import Admission, Clock, Limits, Queue, Strategy, register
from .scheduling import make_scheduling
from .steps import Call, make_prefill

__all__ = ["Call", "GenContinuous", "GenHFContinuous", "GenNaive", "GenPaged", "GenStatic", "GenStrategy", "Running"]

class Running(Protocol):
    """The sequences admitted and not done, and the KV blocks they hold, as a rule sees them."""

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

    def without(self, seqs: list[Any]) -> Running: ...  # the batch as it would be with these preempted


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
    joins_running: ClassVar[bool] = False  # admits beside running sequences at any step boundary (continuous)

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__(limits)
        self.prefill = make_prefill(self.limits)  # how a step is composed
        if self.prefill.joins_each_step and not self.joins_running:
            raise ValueError(f"prefill={self.limits.prefill!r} needs a strategy that joins at every step "
                             f"(gen-continuous, gen-paged), not {self.name}")
        if not self.discipline.orders_generation:
            raise ValueError(f"queue={self.limits.queue!r} is an encoder discipline; generation orders its waiting "
                             "by scheduling= (fcfs, priority, fair, slo)")
        self.scheduling = make_scheduling(self.limits)  # the order of the waiting, who may be displaced

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        raise NotImplementedError

    def order(self, waiting: list[Any], running: Running, now: float) -> list[Any]:
        """The order in which the waiting are considered for admission: the scheduling policy's
        (``fcfs``: priority classes, then first come, first served)."""
        return self.scheduling.arrange(waiting, tuple(running), now)

    def fits(self, seq: Any, running: Running, joining: list[Any]) -> bool:
        """Reservation: blocks for its prompt and all it may generate, held from admission to its end."""
        if len(running) + len(joining) >= self.limits.cap or not self.scheduling.fits(seq, list(running), joining):
            return False
        wanted = sum(running.blocks_for(s.reserve) for s in (*joining, seq))
        return running.reserved_blocks + wanted <= running.total_blocks

    def compose(self, running: Running) -> Iterator[Call]:
        """One step's model calls, each built when the one before it has been applied: the prefill rule's."""
        return self.prefill.compose(running)

    def victim(self, running: Running) -> Any:
        """Whom a step that finds no free block preempts: the most recently admitted (under reservation
        it never comes to this)."""
        return list(running)[-1]

    def leaving(self, running: Running) -> list[Any]:
        """Who leaves the running batch after a call: the finished, at once."""
        return [s for s in running if s.finished]


@register
class GenNaive(GenStrategy):
    """One request at a time, start to finish."""

    name = "gen-naive"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return Admission([], "busy")
        return Admission([await queue.get()], "single")


@register
class GenStatic(GenStrategy):
    """Request-level batching: the deadline rule forms a batch, which runs until its longest member ends.

    Nobody joins a batch in flight; a member that finished early keeps its slot, is
    computed as padding (as ``model.generate`` computes a batch's finished rows) and is
    answered with the batch. That idle tail is the waste.
    """

    name = "gen-static"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return Admission([], "busy")  # nobody joins a batch in flight
        batch = [await queue.get()]
        due_s = clock() + self.limits.max_wait_ms / 1000
        while len(batch) < self.limits.cap:
            if self.limits.idle_dispatch and queue.empty():
                return Admission(batch, "idle")
            remaining_s = due_s - clock()
            seq = await queue.get(remaining_s) if remaining_s > 0 else None
            if seq is None:
                return Admission(batch, "deadline")
            if not self.fits(seq, running, batch):
                queue.putback(seq)
                return Admission(batch, "kv-full")
            batch.append(seq)
        return Admission(batch, "full")

    def leaving(self, running: Running) -> list[Any]:
        """Nobody until the whole batch is done: the finished wait for its longest member."""
        seqs = list(running)
        return seqs if all(s.finished for s in seqs) else []


@register
class GenContinuous(GenStrategy):
    """Iteration-level scheduling (Orca, OSDI '22): join at every step boundary, leave as soon as done.

    ``prefill="budget"`` caps the prompt tokens prefilled between two decode steps
    (``max_prefill_tokens``), so a burst of new prompts stalls the running streams for
    a bounded time instead of all at once. ``prefill="chunked"`` makes every step one call:
    each running stream's next token, then pieces of the prompts still being prefilled in
    what is left of ``max_step_tokens``, so a long prompt never stalls the streams at all.
    """

    name = "gen-continuous"
    joins_running = True

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if not len(running):
            queue.putback(await queue.get())  # nothing to decode: wait for work
        budget = self.prefill.admit_tokens
        joining: list[Any] = []
        victims: list[Any] = []
        left = running  # the batch, less the victims so far
        prompt_tokens = 0
        for seq in self.order(queue.waiting(), running, clock()):
            over_budget = joining and prompt_tokens + len(seq.prompt_ids) > budget
            if over_budget:
                break
            while not self.fits(seq, left, joining) and (victim := self.scheduling.displace(seq, list(left))):
                victims.append(victim)  # a lower class makes room (recomputed later)
                left = running.without(victims)
            if not self.fits(seq, left, joining):
                break  # it stays first in line: nobody overtakes it
            joining.append(seq)
            prompt_tokens += len(seq.prompt_ids)
        queue.take(joining)
        return Admission(joining, "join" if len(left) else "start", victims)


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
        if len(running) + len(joining) >= self.limits.cap or not self.scheduling.fits(seq, list(running), joining):
            return False
        return running.blocks_needed([*joining, seq]) + len(running) + len(joining) <= running.free_blocks


@register
class GenHFContinuous(GenStrategy):
    """transformers' ContinuousBatchingManager (its own thread, scheduler and paged cache), fed from our queue.

    labserver keeps the queue, so 503, 504 and leaving clients work as for the others; the
    rule here is only how many are handed over: one at a time, while fewer than
    ``max_batch_size`` run (``max_kv_tokens`` sizes the manager's cache). Every other
    decision is the manager's, in its own engine (``labserver.engine.hfcb``): there is no step log.
    """

    name = "gen-hf-cb"
    paged = False  # transformers runs the model: any causal LM folder transformers can build (models.causal)

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running) >= self.limits.cap:
            return Admission([], "full")  # the engine waits for one to leave
        return Admission([await queue.get()], "handed")
