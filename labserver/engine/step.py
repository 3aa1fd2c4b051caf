"""The step engine: generation requests become sequences, one worker runs prefill and decode steps.

An encoder request is one item in one model call. A generation request is a
*sequence* that needs one model call per output token, so the worker's loop is a
loop over steps::

    while True:
        joining = await strategy.admit(queue, running, clock)   # who joins at this step boundary
        drop sequences whose client left, and requests already past their deadline
        give the joining their KV blocks (a prefix cache may already hold the first ones)
        prefill(joining)          # their prompts: KV cache + first token each; they join `running`
        decode(running)           # ONE step for every running sequence: one token each
        retire the finished       # leave at once, or (gen-static) when the whole batch is done

Everything that differs between request-level batching and continuous
(iteration-level) batching is the strategy's ``admit`` and whether finished
sequences leave at once (``holds_finished``). With ``prefill="chunked"`` the two
calls become one: every step computes the running sequences' decode tokens and, in
what is left of ``max_step_tokens``, the next pieces of the prompts still being
prefilled, so a long prompt never stalls the streams for its whole prefill.

KV memory is blocks (``labserver.engine.blocks``): this engine keeps each sequence's
block table and hands it to the model with the work (``labserver.models.Chunk``).
The strategy decides how much a sequence must find free to be admitted (all it may
ever need, or only its prompt's blocks); when a step finds no block for a sequence's
next token, ``make_room`` preempts the strategy's victim (the newest sequence): its
blocks go back, it returns to the head of the queue, and it is recomputed later.

The model runs on the model thread; tokens are handed to each request's handler on
the event loop after every step, through ``Seq.emit``. A strategy whose steps happen
in transformers' own manager (``scheduler = "transformers"``) runs
``labserver.engine.hfcb``'s loop instead. Every step is recorded (``StepRecord``):
the Gantt and KV plots are drawn from these. Nothing here knows HTTP or torch; the
same loop runs on a virtual clock (``labserver.engine.virtual.simulate_gen``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..models import GREEDY, Chunk, GenModel, InputRejected, Sampling
from ..strategies import GenStrategy
from .base import Counters, EngineBase, ShuttingDown
from .blocks import BlockManager
from .runner import run_isolating
from .sequence import Seq

logger = logging.getLogger(__name__)

__all__ = ["Running", "Seq", "StepCounters", "StepEngine", "StepRecord"]

Work = list[tuple[Seq, int]]  # a model call: each sequence and how many of its pending tokens it computes


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill" | "decode" | "mixed" (chunked prefill: prompt pieces and decodes in one call)
    start_s: float  # clock, s
    end_s: float
    seqs: tuple[int, ...]  # sequence ids in the model call
    idle: tuple[int, ...] = ()  # among seqs: already finished, computed anyway (request-level batching's waste)
    kv_tokens: int = 0  # tokens cached by running sequences after the call
    kv_reserved: int = 0  # prompt + max_new_tokens of every running sequence
    tokens: int = 0  # tokens computed in the call (prompt pieces + one per decode)
    prefilling: tuple[int, ...] = ()  # among seqs: those whose prompt (or a piece, or a recompute) was computed
    preempted: tuple[int, ...] = ()  # sequences preempted to make room for this call (requeued, recomputed later)
    blocks_used: int = 0  # KV blocks after the call: in a running sequence's table
    blocks_cached: int = 0  # in none, kept for the prefix cache
    blocks_free: int = 0


class Running:
    """The sequences admitted and not yet done, and the KV blocks they hold, as an admission rule sees them."""

    def __init__(self, blocks: BlockManager) -> None:
        self.seqs: list[Seq] = []  # in admission order: the last one is the newest
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Seq]:
        return iter(self.seqs)

    @property
    def reserved(self) -> int:
        return sum(s.reserve for s in self.seqs)

    @property
    def kv_tokens(self) -> int:
        return sum(s.kv_tokens for s in self.seqs)

    @property
    def total_blocks(self) -> int:
        return self.blocks.total

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence could take now (the prefix cache's unreferenced ones included)."""
        return self.blocks.available

    @property
    def reserved_blocks(self) -> int:
        return sum(self.blocks_for(s.reserve) for s in self.seqs)

    def blocks_for(self, tokens: int) -> int:
        return self.blocks.blocks_for(tokens)

    def blocks_needed(self, seqs: Sequence[Seq]) -> int:
        """Blocks these waiting sequences take if admitted now: their context and the token they make next,
        less what a prefix cache shares with the running ones."""
        return sum(self.blocks.cost(s.context, s.kv_tokens + 1) for s in seqs)


@dataclass
class StepCounters(Counters):
    requests: int = 0  # prefilled
    prefills: int = 0  # prefill calls
    decode_steps: int = 0
    tokens: int = 0  # tokens generated for clients
    idle_tokens: int = 0  # computed for finished sequences (gen-static's padding)
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    left_running: int = 0  # client left mid-generation: dropped at the next step boundary
    step_sizes: Counter[int] = field(default_factory=Counter)  # sequences per decode step
    preempted: int = 0  # preemptions (one sequence may be preempted more than once)
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption
    prompt_tokens: int = 0  # prompt tokens of sequences admitted (first admission)
    cached_tokens: int = 0  # of those, served by the prefix cache


class StepEngine(EngineBase):
    """One generation strategy, one generative model, the queue, the KV blocks, and the step loop."""

    def __init__(self, strategy: GenStrategy, model: GenModel, *, clock: Callable[[], float] = time.perf_counter,
                 history: int = 20_000, scheduler: Callable[[StepEngine], Awaitable[None]] | None = None) -> None:
        """``scheduler``: an outside loop that runs the steps instead of ``step_loop`` (``engine.hfcb``)."""
        super().__init__(strategy, model, clock=clock)
        self.scheduler = scheduler
        self.strategy: GenStrategy = strategy
        self.model: GenModel = model
        limits = self.limits
        if limits.prefill == "chunked" and not strategy.chunks_prefill:
            raise ValueError(f"prefill='chunked' needs a strategy that joins at every step (gen-continuous, "
                             f"gen-paged), not {strategy.name}")
        budget = limits.max_kv_tokens or min(limits.cap, 64) * model.max_context  # no budget: cap x full context
        self.blocks = BlockManager(budget // limits.kv_block_tokens, limits.kv_block_tokens,
                                   prefix_cache=limits.prefix_cache)
        if scheduler is None:  # (transformers' manager keeps its own cache)
            model.allocate_kv(self.blocks.total, self.blocks.block_tokens)
        self.counters = StepCounters()
        self.running = Running(self.blocks)
        self.in_flight = self.running.seqs  # (the same list) what drain waits for and a dying worker fails
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self._sids = itertools.count(1)
        self._step_ids = itertools.count(1)

    # -- the request side --------------------------------------------------------------
    def submit(self, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False, request_id: str = "",
               sampling: Sampling | None = None, stop: Sequence[str] = (), min_tokens: int = 0) -> Seq:
        """Queue one sequence. Raises InputRejected (too long), Overloaded, ShuttingDown or WorkerDied.

        ``sampling`` None is greedy; ``stop`` strings end it early ("stop"); EOS cannot end it
        before ``min_tokens`` (the model never chooses EOS before then).
        """
        need = len(prompt_ids) + max_new_tokens
        if need > self.model.max_context:
            raise InputRejected(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) is "
                                f"{need}, over the model's context of {self.model.max_context} tokens")
        if self.blocks.blocks_for(need) > self.blocks.total:
            raise InputRejected(f"prompt + max_new_tokens is {need} tokens, over the server's whole KV-cache "
                                f"budget of {self.blocks.total * self.blocks.block_tokens} (max_kv_tokens, in blocks "
                                f"of {self.blocks.block_tokens}); ask for fewer tokens")
        self.admit_or_refuse(1)
        now = self.clock()
        if min_tokens and not ignore_eos:
            sampling = replace(sampling or GREEDY, eos_from=len(prompt_ids) + min_tokens)
        seed = hash((tuple(prompt_ids), sampling.seed if sampling else None))  # its EOS stand-in: per request
        seq = Seq(next(self._sids), prompt_ids, max_new_tokens, asyncio.get_running_loop().create_future(), now,
                  self.deadline_s(now), ignore_eos, request_id, sampling, tuple(stop), min_tokens,
                  eos_prob=self.limits.eos_prob, eos_seed=seed)
        self.queue.put([seq])
        return seq

    def cut_short(self) -> None:
        """After a drain, the sequences still generating are cut short (503, or an error event mid-stream)."""
        self.fail(list(self.running.seqs), ShuttingDown("server is shutting down; generation stopped"))

    # -- the worker ----------------------------------------------------------------------
    async def _work(self) -> None:
        await (self.scheduler(self) if self.scheduler is not None else self.step_loop())

    async def step_loop(self) -> None:
        """The loop in the module docstring."""
        chunked = self.limits.prefill == "chunked"
        while True:
            joining, reason = await self.strategy.admit(self.queue, self.running, self.clock)
            await self._drop_gone()  # (awaits the model thread: check the newcomers' deadlines after it)
            now = self.clock()  # one reading for the deadline check and the prefill's start
            live = self._give_blocks(self.live(joining, now, "no first token before timeout_ms"), now)
            if live:
                self.counters.reasons[reason] += 1
            if chunked:
                self.running.seqs.extend(live)  # prefilled a piece a step, beside the decodes
                await self._chunked_step()
                continue
            if live:
                await self._call("prefill", [(s, s.pending) for s in live])
            if self.running.seqs:
                # finished sequences are still computed while a strategy holds them (gen-static), as
                # model.generate computes a batch's finished rows until its longest one is done
                await self._call("decode", [(s, 1) for s in self.running.seqs])

    def _give_blocks(self, seqs: list[Seq], now: float) -> list[Seq]:
        """The admitted get their block tables: the prefix cache's hits, then blocks for the rest and their next token.

        The strategy admitted them because these blocks are available; should one still not
        fit, it and those after it go back to the head of the queue, in order.
        """
        for i, seq in enumerate(seqs):
            hit = self.blocks.start(seq.sid, seq.context)
            if not self.blocks.grow(seq.sid, seq.kv_tokens + 1):
                self.blocks.release(seq.sid)
                for back in reversed(seqs[i:]):
                    self.queue.putback(back)
                return seqs[:i]
            seq.computed, seq.seen = hit, False
            if math.isnan(seq.admitted_s):  # its first admission (a preempted one keeps its first times)
                seq.admitted_s = now
                seq.cached_tokens = hit
                self.counters.prompt_tokens += len(seq.prompt_ids)
                self.counters.cached_tokens += hit
            else:
                self.counters.recomputed_tokens += seq.pending
            if seq.deadline_s < now:  # live() used the same reading: impossible, counted anyway
                self.counters.computed_after_deadline += 1
        return seqs

    async def _chunked_step(self) -> None:
        """One call: every decoding sequence's next token, then prompt pieces in admission order, up to
        ``max_step_tokens`` in all (decodes first: a running stream never waits for a prompt)."""
        decodes: Work = [(s, 1) for s in self.running.seqs if s.decoding]
        room = self.limits.max_step_tokens - len(decodes)
        pieces: Work = []
        for seq in self.running.seqs:
            if not seq.decoding and room > 0:
                pieces.append((seq, min(seq.pending, room)))
                room -= pieces[-1][1]
        kind = "mixed" if decodes and pieces else "prefill" if pieces else "decode"
        await self._call(kind, decodes + pieces)

    async def _drop_gone(self) -> None:
        """Sequences whose client left (or that were answered 504/503) free their place now."""
        gone = [s for s in self.running.seqs if s.gone]
        if gone:
            self.counters.left_running += len(gone)
            await self._leave(gone)

    async def _make_room(self, work: Work) -> list[Seq]:
        """Blocks for every position this call writes; when none is available, the strategy's victim
        (the newest sequence) is preempted: blocks released, back to the head of the queue."""
        preempted: list[Seq] = []
        for seq, n in work:
            while seq not in preempted and not self.blocks.grow(seq.sid, seq.computed + n):
                victim = self.strategy.victim(self.running)
                self.running.seqs.remove(victim)
                self.blocks.release(victim.sid)
                victim.computed, victim.seen = 0, False
                victim.preemptions += 1
                self.counters.preempted += 1
                self.queue.putback(victim)  # several in one step: the oldest ends up first in line
                preempted.append(victim)
        if preempted:
            await self.call(self.model.release, [s.sid for s in preempted])
        return preempted

    def _chunk(self, seq: Seq, n: int) -> Chunk:
        """The next ``n`` of its pending tokens (a finished sequence: its last position, computed again)."""
        start, prompt = seq.computed, seq.prompt_ids
        tokens = prompt[start:start + n] + seq.tokens[max(0, start - len(prompt)):start + n - len(prompt)]
        return Chunk(seq.sid, tokens, start, tuple(self.blocks.tables[seq.sid]), sample=start + n == seq.kv_tokens,
                     sampling=seq.sampling, prompt_len=len(prompt))

    def _prefill_call(self, work: Work) -> list[int | None]:
        """One prefill call (on the model thread; ``run_isolating`` splits the list when it fails)."""
        return self.model.prefill([self._chunk(s, n) for s, n in work])

    async def _call(self, kind: str, work: Work) -> None:
        """One model call over ``work``, and what follows from it: KV positions, tokens, failures, the record."""
        preempted = await self._make_room(work)
        work = [(s, n) for s, n in work if s not in preempted]
        if not work:
            await self._retire()
            return
        decoding = {s.sid for s, _ in work if s.decoding}  # (the rest compute prompt tokens)
        start = self.clock()
        if kind == "decode":
            try:
                outs = await self.call(self.model.decode, [self._chunk(s, n) for s, n in work])
            except Exception as e:  # a failed step fails every sequence in it (mid-stream: an error event)
                logger.exception("decode step failed for %d sequences", len(work))
                outs = [e] * len(work)
        else:  # a prompt that fails fails alone: the call is split and retried until it does
            outs, calls = await self.call(run_isolating, self._prefill_call, work)
            self.counters.prefills += calls
        end = self.clock()
        idle, failed = [], []
        for (seq, n), out in zip(work, outs, strict=True):
            if isinstance(out, Exception):
                self.counters.failed += 1
                if not seq.future.done():
                    seq.future.set_exception(out)
                failed.append(seq)
                continue
            if seq.finished:  # held by gen-static: computed again in place, thrown away
                idle.append(seq.sid)
                continue
            if not seq.tokens and seq.computed + n == seq.kv_tokens:
                self.counters.requests += 1
            seq.computed += n
            seq.seen = True
            self.blocks.computed(seq.sid, seq.context, seq.computed)
            if out is not None:
                if seq.sid in decoding:
                    seq.steps += 1
                    seq.step_batch_sum += len(work)
                seq.emit(out, end, self.model.eos_id, self.model.text)
                self.counters.tokens += 1
        if kind == "prefill":  # (the admitted join the batch once prefilled; chunked ones already have)
            self.running.seqs.extend(s for s, _ in work if s not in failed and s not in self.running.seqs)
        else:
            self.counters.decode_steps += 1
            self.counters.step_sizes[len(decoding) + len(idle)] += 1
            self.counters.idle_tokens += len(idle)
        await self._leave(failed)
        prefilling = tuple(s.sid for s, _ in work if s.sid not in decoding and not s.finished)
        self._record(kind, start, end, work, tuple(idle), prefilling, tuple(s.sid for s in preempted))
        await self._retire()

    async def _retire(self) -> None:
        seqs = self.running.seqs
        if self.strategy.holds_finished:
            done = seqs[:] if all(s.finished for s in seqs) else []
        else:
            done = [s for s in seqs if s.finished]
        if done:
            for seq in done:
                self.counters.finished[seq.finish_reason or "?"] += 1
                if not seq.future.done():
                    seq.future.set_result(seq)
            await self._leave(done)

    async def _leave(self, seqs: list[Seq]) -> None:
        """Out of the batch (finished, failed, left): blocks back, the model told."""
        if not seqs:
            return
        ids = {s.sid for s in seqs}
        self.running.seqs[:] = [s for s in self.running.seqs if s.sid not in ids]
        for sid in ids:
            self.blocks.release(sid)
        await self.call(self.model.release, sorted(ids))

    # -- for a strategy that runs its own scheduler (gen-hf-cb): bookkeeping only ----------
    def external_join(self, seq: Seq) -> None:
        seq.admitted_s = self.clock()
        self.running.seqs.append(seq)
        self.counters.requests += 1

    def external_tokens(self, seq: Seq, tokens: list[int]) -> None:
        now = self.clock()
        for token in tokens:
            if seq.finished or seq.future.done():
                return
            seq.emit(token, now, self.model.eos_id, self.model.text)
            self.counters.tokens += 1

    def external_done(self, seq: Seq, reason: str | None, error: BaseException | None) -> None:
        """It finished (reason), failed (error), or left (neither): out of the running batch."""
        if seq not in self.running.seqs:
            return
        self.running.seqs.remove(seq)
        if error is not None:
            self.counters.failed += 1
            if not seq.future.done():
                seq.future.set_exception(error)
        elif reason is not None or seq.finished:
            seq.finish_reason = seq.finish_reason or reason
            if math.isnan(seq.finished_s):
                seq.finished_s = self.clock()
            self.counters.finished[seq.finish_reason or "?"] += 1
            if not seq.future.done():
                seq.future.set_result(seq)
        else:
            self.counters.left_running += 1

    def _record(self, kind: str, start: float, end: float, work: Work, idle: tuple[int, ...],
                prefilling: tuple[int, ...], preempted: tuple[int, ...]) -> None:
        b = self.blocks
        self.steps.append(StepRecord(next(self._step_ids), kind, start, end, tuple(s.sid for s, _ in work), idle,
                                     self.running.kv_tokens, self.running.reserved, sum(n for _, n in work),
                                     prefilling, preempted, b.used, b.cached, b.free))

    # -- what /stats shows ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        g, b = self.counters, self.blocks
        return {
            **super().stats(),
            "running": len(self.running),
            "requests_prefilled": g.requests,
            "prefill_calls": g.prefills,
            "decode_steps": g.decode_steps,
            "tokens_generated": g.tokens,
            "idle_tokens": g.idle_tokens,
            "kv_tokens": self.running.kv_tokens,
            "kv_reserved": self.running.reserved,
            "kv_blocks": {"block_tokens": b.block_tokens, "total": b.total, "used": b.used, "cached": b.cached,
                          "free": b.free, "evicted": b.evicted},
            "preemptions": g.preempted,
            "recomputed_tokens": g.recomputed_tokens,
            "prefix_cache": {"prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens,
                             "hit_rate": round(g.cached_tokens / g.prompt_tokens, 4) if g.prompt_tokens else None},
            "finished": dict(g.finished),
            "left_while_generating": g.left_running,
            "step_size_histogram": {str(k): v for k, v in sorted(g.step_sizes.items())},
            "prefill_reasons": dict(g.reasons),
        }

    def step_log(self, last: int | None = None) -> list[dict[str, Any]]:
        steps = list(self.steps)[-last:] if last else list(self.steps)
        return [vars(s).copy() for s in steps]
