"""Generation strategies: who joins the running batch at each step boundary.

A generation request needs one model step per output token, and requests ask for
very different numbers of tokens. The rule that decides *when a sequence may join
the batch of sequences being decoded* is what separates the strategies:

- ``gen-naive``: one request at a time, prefill and every decode step, then the next.
- ``gen-static``: request-level batching, the encoders' deadline rule applied to
  whole generations: collect a batch (full, due, or nothing else queued), then run
  it until its *longest* member is done. Nobody joins a batch in flight; a member
  that finished early keeps its slot, is computed as padding (as ``model.generate``
  computes a batch's finished rows) and is answered with the batch. That idle tail
  is the waste.
- ``gen-continuous``: iteration-level scheduling (Orca, OSDI '22): at *every* step
  boundary, queued requests that fit are prefilled and join the running batch;
  finished sequences leave at once. ``prefill="budget"`` caps the prompt tokens
  prefilled between two decode steps (``max_prefill_tokens``), so a burst of new
  prompts stalls the running streams for a bounded time instead of all at once.
- ``gen-hf-cb``: the same endpoint served by transformers' own
  ``ContinuousBatchingManager`` (paged KV cache, its own scheduler thread), the
  production reference; labserver only feeds it from its queue.

Caps, for every strategy: ``max_batch_size`` sequences running together, and
``max_kv_tokens`` KV-cache tokens reserved by them (each reserves its prompt plus
``max_new_tokens``: admission never has to evict). Admission is first come, first
served: a request that does not fit yet goes back to the head of the queue and
nobody overtakes it, so none starves.

Like ``labserver.strategies``, nothing here knows HTTP or torch: ``admit`` sees the
queue, the running batch and a clock, and ``labserver.virtual.simulate_gen`` runs it
on a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, ClassVar

from .strategies import Clock, Queue, Strategy, register

if TYPE_CHECKING:
    from .generation import GenEngine, Running, Seq

logger = logging.getLogger(__name__)

Admission = tuple[list["Seq"], str]  # (sequences to prefill now, why)


class GenStrategy(Strategy):
    kind = "generate"
    offload = True  # every generation strategy keeps the model off the event loop
    holds_finished: ClassVar[bool] = False  # True: finished sequences wait for the whole batch

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        """The sequences that join at this step boundary. Waits only when nothing is running."""
        raise NotImplementedError

    async def run(self, engine: GenEngine) -> None:
        """The worker: the engine's step loop, asking ``admit`` at every boundary."""
        await engine.step_loop()

    def fits(self, seq: Seq, running: Running, joining: list[Seq]) -> bool:
        if len(running) + len(joining) >= self.limits.cap:
            return False
        budget = self.limits.max_kv_tokens
        return budget is None or running.reserved + sum(s.reserve for s in joining) + seq.reserve <= budget


@register
class GenNaive(GenStrategy):
    """One request at a time, start to finish."""

    name = "gen-naive"
    summary = "one request at a time: its prefill and all its decode steps, then the next"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"
        return [await queue.get()], "single"  # type: ignore[list-item]


@register
class GenStatic(GenStrategy):
    """Request-level batching: the deadline rule per batch, which then runs until its longest member ends."""

    name = "gen-static"
    summary = "request-level batching: a batch (deadline rule) runs until its longest member is done"
    holds_finished = True

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        if len(running):
            return [], "busy"  # nobody joins a batch in flight
        batch: list[Seq] = [await queue.get()]  # type: ignore[list-item]
        due_s = clock() + self.limits.max_wait_ms / 1000
        while len(batch) < self.limits.cap:
            if self.limits.idle_dispatch and queue.empty():
                return batch, "idle"
            remaining_s = due_s - clock()
            seq = await queue.get(remaining_s) if remaining_s > 0 else None
            if seq is None:
                return batch, "deadline"
            if not self.fits(seq, running, batch):  # type: ignore[arg-type]
                queue.putback(seq)
                return batch, "kv-full"
            batch.append(seq)  # type: ignore[arg-type]
        return batch, "full"


@register
class GenContinuous(GenStrategy):
    """Iteration-level scheduling: join at every step boundary, leave as soon as done."""

    name = "gen-continuous"
    summary = "continuous batching: join at every step boundary after a prefill, leave at once"

    async def admit(self, queue: Queue, running: Running, clock: Clock) -> Admission:
        joining: list[Seq] = []
        if not len(running):
            joining.append(await queue.get())  # type: ignore[arg-type]  # nothing to decode: wait for work
        budget = self.limits.max_prefill_tokens if self.limits.prefill == "budget" else math.inf
        prompt_tokens = sum(len(s.prompt_ids) for s in joining)
        while not queue.empty():
            seq = await queue.get(0)
            if seq is None:
                break
            over_budget = joining and prompt_tokens + len(seq.prompt_ids) > budget  # type: ignore[attr-defined]
            if over_budget or not self.fits(seq, running, joining):  # type: ignore[arg-type]
                queue.putback(seq)  # first in line next time: nobody overtakes it
                break
            joining.append(seq)  # type: ignore[arg-type]
            prompt_tokens += len(seq.prompt_ids)  # type: ignore[attr-defined]
        return joining, "join" if len(running) else "start"


@register
class GenHFContinuous(GenStrategy):
    """transformers' ContinuousBatchingManager behind the same endpoint, fed from labserver's queue.

    The manager has its own thread and scheduler (paged KV cache, prefill chunking);
    labserver keeps the queue, so 503 at ``max_queue``, 504 before the first token and
    dropping a request whose client left work as for the other strategies. At most
    ``max_batch_size`` requests are handed to the manager at once; ``max_kv_tokens``
    sizes its cache. There is no step log: the steps happen inside the manager.
    """

    name = "gen-hf-cb"
    summary = "transformers' ContinuousBatchingManager (its own thread and scheduler), fed from our queue"

    async def run(self, engine: GenEngine) -> None:
        from .hfcb import HFManager  # transformers, only for this strategy

        loop = asyncio.get_running_loop()
        manager = HFManager(engine.model, max_running=self.limits.max_batch_size,
                            max_kv_tokens=self.limits.max_kv_tokens)
        await engine.call(manager.start)  # warm-up takes seconds: on the model thread
        room = asyncio.Event()

        def feed(seq: Seq) -> None:
            def on_tokens(tokens: list[int]) -> None:
                loop.call_soon_threadsafe(engine.external_tokens, seq, tokens)

            def on_done(reason: str) -> None:
                loop.call_soon_threadsafe(engine.external_done, seq, reason, None)

            def on_error(err: Exception) -> None:
                loop.call_soon_threadsafe(engine.external_done, seq, None, err)

            def left(_: object) -> None:  # client gone, 504 or shutdown: stop decoding it
                if not seq.finished:
                    manager.cancel(seq.sid)
                    engine.external_done(seq, None, None)
                room.set()

            engine.external_join(seq)
            seq.future.add_done_callback(left)
            manager.submit(seq.sid, seq.prompt_ids, seq.max_new_tokens, seq.ignore_eos, on_tokens, on_done, on_error)

        try:
            while True:
                while len(engine.running) >= self.limits.cap:
                    room.clear()
                    await room.wait()
                seq: Seq = await engine.queue.get()  # type: ignore[assignment]
                for live in engine.admissible([seq]):
                    feed(live)
        finally:
            manager.stop()
