"""The scheduler: waiting and running sequences, their KV blocks, and the plan of each model call.

One room for every decision about who is computed next, and all of them are the
strategy's (``labserver.strategies.generate``); the scheduler asks and keeps the books::

    await scheduler.admit()                 a step boundary
        strategy.admit(queue, running, clock) -> who joins, and whom they displace (preempted
            now); the gone are dropped, the expired answered 504, the joining get their block
            tables (a prefix cache may already hold their first blocks);
            strategy.compose(running) -> the step's calls, one at a time
    call = scheduler.next_call()            the step's next call (None: the step is over): each
            sequence with how many tokens it computes (a prompt, a piece, a recompute, or the one
            token of a decode), its blocks for every position it writes; when none is free,
            strategy.victim(running) is preempted (blocks back, requeued at the head, recomputed later)
    ... the engine runs the model on call.chunks ...
    scheduler.apply(call, outputs, start_s, end_s)
        positions computed, tokens emitted, failures, counters, the step record;
        strategy.leaving(running) -> who leaves the batch

``released`` lists the sequences whose KV the model may drop (finished, failed, gone,
preempted): the engine tells the model before its next call. Nothing here runs the model,
knows torch or HTTP; the same scheduler runs on a virtual clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..models import Chunk, Logprob, Scored, Verified
from ..strategies import Admission, GenStrategy
from ..strategies.generate import Call
from .blocks import BlockManager
from .connector import KVConnector
from .running import RunningSeqs
from .ending import FinishReason, Status
from .sequence import Seq
from .steprecord import StepCounters, CallRecord

__all__ = ["ModelCall", "RunningSeqs", "Scheduler", "StepCounters", "CallRecord"]

@dataclass
class ModelCall:
    """One model call: who, how many tokens each, and where their KV lives."""

    work: Call  # each sequence and how many of its pending tokens it computes
    chunks: list[Chunk]  # one per entry of work, for the model
    decoding: frozenset[int]  # sequences computing one token of their answer; the rest compute prompt tokens
    preempted: list[Seq] = field(default_factory=list)  # taken out to make room for it
    guesses: dict[int, tuple[int, ...]] = field(default_factory=dict)  # decoding sequences' guesses to verify, by id

    @property
    def prefills(self) -> bool:
        """Some sequence computes prompt tokens."""
        return len(self.decoding) < len(self.work)

    def halves(self) -> tuple[ModelCall, ModelCall]:
        """The call split in two, each a call of its own over the same chunks (what a failed call is retried as).

        Nothing is booked between a plan and its outcome: positions computed and tokens emitted
        move only in ``Scheduler.apply``, once, for the whole call, and every block the call
        writes was taken when it was planned. So a half computes exactly the positions it would
        have computed in the whole call, into the same blocks, and each half runs once.
        """
        mid = len(self.work) // 2
        return self._part(0, mid), self._part(mid, len(self.work))

    def _part(self, lo: int, hi: int) -> ModelCall:
        work = self.work[lo:hi]
        ids = {s.sid for s, _ in work}
        return ModelCall(work, self.chunks[lo:hi], self.decoding & ids,
                         guesses={sid: g for sid, g in self.guesses.items() if sid in ids})


class Scheduler:
    """Asks the strategy who runs next and keeps the books (see the module docstring)."""

    def __init__(self, strategy: GenStrategy, queue: Any, blocks: BlockManager, counters: StepCounters,
                 clock: Callable[[], float], live: Callable[[list[Seq], float, str], list[Seq]],
                 emit: Callable[[Seq, int, float, Logprob | None], None],
                 end: Callable[[Seq, FinishReason, BaseException | None], None], history: int = 20_000) -> None:
        """``live`` drops the gone and answers the expired (the engine's door); ``emit`` hands a token over; ``end``
        ends a sequence (the engine's one ending, which calls ``drop`` back)."""
        self.strategy, self.queue, self.blocks, self.counters = strategy, queue, blocks, counters
        self.clock, self.live, self.emit, self.end = clock, live, emit, end
        self.running = RunningSeqs(blocks)
        self._displaced: list[Seq] = []  # preempted at admission for a higher class: shown on the next call
        self.released: list[int] = []  # sequences whose KV the model may drop, until the engine tells it
        self.steps: deque[CallRecord] = deque(maxlen=history)
        self._calls: Iterator[Call] = iter(())  # the step under way: the rest of its calls
        self._step_ids = 0
        self.connector: KVConnector | None = None  # KV from or for other engines (the engine's, if any)

    # -- the plan -------------------------------------------------------------------------
    def next_call(self) -> ModelCall | None:
        """The next model call of the step under way, with its blocks; None at a step boundary."""
        for work in self._calls:
            preempted = self._make_room(work)
            work = [(s, n) for s, n in work if s not in preempted]
            if work:
                preempted, self._displaced = self._displaced + preempted, []
                return ModelCall(work, [self._chunk(s, n) for s, n in work],
                                 frozenset(s.sid for s, _ in work if s.decoding), preempted)
            self._retire()
        return None

    async def admit(self) -> None:
        """A step boundary: who joins (the strategy's ``admit``, which waits while nothing runs); the gone
        leave; the joining get their blocks; then the strategy composes the step's calls."""
        joining, reason, victims = Admission(*await self.strategy.admit(self.queue, self.running, self.clock))
        for victim in victims:  # a newcomer of a higher class takes its place
            self._requeue(victim)
            self.counters.preempted_for_priority += 1
            self._displaced.append(victim)
        gone = [s for s in self.running if s.gone]
        self.counters.left_while_generating += len(gone)
        self._end(gone, FinishReason.ABORT)
        now = self.clock()  # one reading for the deadline check and the prefill's start
        joined = self._give_blocks(self._after_parents(self.live(joining, now, "no first token before timeout_ms")),
                                   now)
        if joined:
            self.counters.prefill_reasons[reason] += 1
        self.running.seqs.extend(joined)
        self._calls = self.strategy.compose(self.running)

    def _after_parents(self, joining: list[Seq]) -> list[Seq]:
        """A choice (n > 1) whose first choice is running with its prompt not yet computed waits a step (back to
        the head of the queue), to share those blocks instead of computing the same prompt beside them; only under
        a rule that lets it join at the next step (``joins_running``: a static batch would hold it for a whole
        batch)."""
        if not self.strategy.joins_running:
            return joining
        running = set(self.running.seqs) | set(joining)
        wait = [s for s in joining if s.parent in running and s.parent.computed < len(s.parent.prompt_ids)]
        for seq in reversed(wait):
            self.queue.putback(seq)
        return [s for s in joining if s not in wait] if wait else joining

    def _start(self, seq: Seq) -> tuple[int, bool]:
        """A new block table: (tokens it already holds, whether they are its first choice's). Shared with its first
        choice (n > 1) when that one holds its computed prompt, else the prefix cache's hits under its salt (none for a
        prompt still to be scored: its every position is computed)."""
        parent = seq.parent
        if parent is not None and parent.sid in self.blocks.tables and parent.computed >= len(parent.prompt_ids):
            if seq.wants_prompt_scores:  # (the same prompt: the first choice scored it)
                seq.prompt_logprobs[:] = parent.prompt_logprobs
            return self.blocks.fork(seq.sid, parent.sid, len(seq.prompt_ids) - 1), True
        return self.blocks.start(seq.sid, () if seq.wants_prompt_scores else seq.context, seq.cache_salt), False

    def _give_blocks(self, seqs: list[Seq], now: float) -> list[Seq]:
        """The admitted get their block tables: shared or cached blocks (``_start``), then blocks for the rest and
        their next token.

        The strategy admitted them because these blocks are available; should one still not
        fit, it and those after it go back to the head of the queue, in order.
        """
        c = self.counters
        for i, seq in enumerate(seqs):
            hit, forked = self._start(seq)
            if not self.blocks.grow(seq.sid, seq.kv_tokens + 1):
                self.blocks.release(seq.sid)
                for back in reversed(seqs[i:]):
                    self.queue.putback(back)
                return seqs[:i]
            seq.computed, seq.status = hit, Status.PREFILLING
            if math.isnan(seq.admitted_s):  # its first admission (a preempted one keeps its first times)
                seq.admitted_s = now
                c.prompt_tokens += len(seq.prompt_ids)
                if forked:
                    c.shared_tokens += hit
                else:
                    seq.cached_tokens = hit
                    c.cached_tokens += hit
            else:
                c.recomputed_tokens += seq.pending
            if seq.deadline_s < now:  # live() used the same reading: impossible, counted anyway
                c.computed_after_deadline += 1
            if self.connector is not None:  # KV from elsewhere is written past the hit before its next call
                self.connector.allocated(seq, hit, now)
        return seqs

    def _make_room(self, work: Call) -> list[Seq]:
        """Blocks for every position this call writes; when none is available, the strategy's victim
        is preempted: blocks released, back to the head of the queue, recomputed when admitted again."""
        preempted: list[Seq] = []
        for seq, n in work:
            while seq not in preempted and not self.blocks.grow(seq.sid, seq.computed + n):
                victim = self.strategy.victim(self.running)
                self._requeue(victim)
                self.counters.preemptions += 1
                preempted.append(victim)
        return preempted

    def _requeue(self, victim: Seq) -> None:
        """Blocks released, back to the head of the queue (of its class), recomputed when admitted again."""
        self.running.seqs.remove(victim)
        self.blocks.release(victim.sid)
        self.released.append(victim.sid)
        victim.computed, victim.status = 0, Status.WAITING
        if victim.wants_prompt_scores:  # scored in part: scored again from the start when recomputed
            victim.prompt_logprobs.clear()
        victim.preemptions += 1
        self.queue.putback(victim)  # several in one step: the oldest ends up first in line

    def _chunk(self, seq: Seq, n: int) -> Chunk:
        """The next ``n`` of its pending tokens (a finished sequence: its last position, computed again)."""
        start, prompt = seq.computed, seq.prompt_ids
        past = start - len(prompt)  # how far into its answer the chunk begins (< 0: inside its prompt)
        if past >= 0:  # its answer's tokens only (a decode; an answer recomputed after preemption): nothing to score
            tokens, score = seq.tokens[past:past + n], ()
        else:  # (a chunk that ends inside the prompt takes none of the answer, however long that is)
            tokens = prompt[start:start + n] + seq.tokens[:max(0, past + n)]
            scoring = seq.wants_prompt_scores and len(seq.prompt_logprobs) == start  # (echo: from position 1 on)
            score = prompt[start + 1:start + n + 1] if scoring else ()
        return Chunk(seq.sid, tokens, start, tuple(self.blocks.tables[seq.sid]), sample=start + n == seq.kv_tokens,
                     sampling=seq.sampling, prompt_len=len(prompt), score=score, decode=seq.decoding,
                     grammar=None if seq.finished else seq.grammar)

    def guessing(self, call: ModelCall, k: int, max_context: int) -> list[tuple[Seq, int]]:
        """The call's decoding sequences that may take guesses, with at most how many each: k, fewer near its
        ``max_new_tokens`` (a verification makes up to guesses + 1 tokens) or the model's context. None with a
        grammar: its answer is made one masked token at a time (speculation is off for it)."""
        out = []
        for seq, n in call.work:
            room = min(k, seq.max_new_tokens - len(seq.tokens) - 1, max_context - seq.kv_tokens)
            if seq.sid in call.decoding and n == 1 and not seq.finished and room > 0 and seq.grammar is None:
                out.append((seq, room))
        return out

    def with_guesses(self, call: ModelCall, guesses: dict[int, Sequence[int]]) -> ModelCall:
        """The call with each sequence's guesses after its last token (``Chunk.draft``), blocks taken for them; a
        guess that finds no free block is cut to what its blocks hold (a guess never preempts anyone)."""
        work, chunks, kept = [], [], {}
        for (seq, n), chunk in zip(call.work, call.chunks, strict=True):
            guess = tuple(guesses.get(seq.sid, ()))
            if guess and not self.blocks.grow(seq.sid, seq.computed + 1 + len(guess)):
                held = len(self.blocks.tables[seq.sid]) * self.blocks.block_tokens
                guess = guess[:max(0, held - seq.computed - 1)]
            if guess:
                kept[seq.sid] = guess
                n = 1 + len(guess)
                chunk = replace(chunk, tokens=[*chunk.tokens, *guess], blocks=tuple(self.blocks.tables[seq.sid]),
                                draft=len(guess))
            work.append((seq, n))
            chunks.append(chunk)
        return ModelCall(work, chunks, call.decoding, call.preempted, kept) if kept else call

    # -- the outcome ------------------------------------------------------------------------
    def apply(self, plan: ModelCall, outs: Sequence[Any], start_s: float, end_s: float, calls: int = 1,
              model_s: tuple[float, float] | None = None) -> None:
        """What follows from a call's outputs (a token, None for a prompt piece, or an exception per entry);
        ``calls``: the model calls it took (more than one: it was bisected); ``model_s``: when the model thread
        began and ended it (``CallRecord.model_s``)."""
        c = self.counters
        decoding = plan.decoding  # (the rest computed prompt tokens)
        idle, failed = [], []
        guessed = accepted = 0
        for (seq, n), out in zip(plan.work, outs, strict=True):
            logprob = None
            if seq.settled:  # ended while the call ran (a drain): what it made is nobody's
                continue
            if isinstance(out, Scored):
                if seq.wants_prompt_scores and len(seq.prompt_logprobs) == seq.computed:
                    seq.prompt_logprobs += out.prompt
                out, logprob = out.token, out.logprob
            if isinstance(out, Exception):
                c.items_failed += 1
                failed.append((seq, out))
                continue
            if seq.finished:  # held by gen-static: computed again in place, thrown away
                idle.append(seq.sid)
                continue
            if isinstance(out, Verified):  # a decode step that verified guesses: 1 to guesses + 1 tokens
                made, kept = self._verified(seq, plan.guesses.get(seq.sid, ()), out, end_s)
                guessed, accepted = guessed + len(plan.guesses.get(seq.sid, ())), accepted + kept
                seq.decode_calls += 1
                seq.decode_batch_sum += len(plan.work)
                seq.status = Status.FINISHED if seq.finished else Status.DECODING
                self.strategy.scheduling.served(seq, 0, made)
                continue
            if not seq.tokens and seq.computed + n == seq.kv_tokens:
                c.requests_prefilled += 1
            seq.computed += n
            if self.blocks.registers(seq.sid, seq.computed):
                self.blocks.computed(seq.sid, seq.context, seq.computed)
            if out is not None:
                if seq.sid in decoding:
                    seq.decode_calls += 1
                    seq.decode_batch_sum += len(plan.work)
                self.emit(seq, out, end_s, logprob)
                c.tokens_generated += 1
            seq.status = (Status.FINISHED if seq.finished else
                          Status.DECODING if seq.tokens and seq.pending == 1 else Status.PREFILLING)
            self.strategy.scheduling.served(seq, 0 if seq.sid in decoding else n, 1 if seq.sid in decoding else 0)
        c.iteration_tokens.observe(sum(n for _, n in plan.work))
        if decoding:  # a decode step (or a mixed one: chunked prefill)
            self.strategy.scheduling.observe_step(len(plan.work), (end_s - start_s) * 1000)
            c.decode_calls += 1
            c.step_size_histogram[len(decoding) + len(idle)] += 1
            c.idle_tokens += len(idle)
        for seq, error in sorted(failed, key=lambda f: f[0].sid):
            self.end(seq, FinishReason.ERROR, error)
        prefilling = tuple(s.sid for s, _ in plan.work if s.sid not in decoding and not s.finished)
        self._step_ids += 1
        b = self.blocks
        self.steps.append(CallRecord(self._step_ids, start_s, end_s, tuple(s.sid for s, _ in plan.work),
                                     tuple(idle), self.running.kv_tokens, self.running.reserved,
                                     sum(n for _, n in plan.work), prefilling,
                                     tuple(s.sid for s in plan.preempted), b.used, b.cached, b.free,
                                     tuple(s.sid for s, _ in plan.work if s.sid in decoding), calls,
                                     tuple(s.sid for s, _ in failed), guessed, accepted, tuple(plan.guesses),
                                     model_s))
        self._retire()

    def _verified(self, seq: Seq, guess: Sequence[int], out: Verified, now: float) -> tuple[int, int]:
        """The tokens a verification makes: the guesses the model's choices confirm, then its first choice that
        differs (or its choice after the last guess), each emitted in turn until the sequence finishes. Only the
        positions up to the last guess kept hold valid KV: ``computed`` stops there, and the blocks taken for the
        rest go back. (tokens made, guesses kept)"""
        c = self.counters
        kept = 0
        while kept < len(guess) and kept + 1 < len(out.tokens) and out.tokens[kept] == guess[kept]:
            kept += 1
        c.spec_drafts += 1
        c.spec_proposed_tokens += len(guess)
        c.spec_accepted_tokens += kept
        c.spec_accepted_histogram[kept] += 1
        start, made = seq.computed, 0
        for i, token in enumerate(out.tokens[:kept + 1]):
            self.emit(seq, token, now, out.logprobs[i] if out.logprobs else None)
            made += 1
            c.tokens_generated += 1
            if seq.finished:
                break
        seq.computed = start + min(made, kept) + 1  # its last token and the guesses kept (and emitted)
        self.blocks.computed(seq.sid, seq.context, seq.computed)
        if not seq.finished:
            self.blocks.shrink(seq.sid, seq.kv_tokens)
        return made, kept

    def _retire(self) -> None:
        """The answered the strategy lets leave (static batching holds them to the end of their batch) end."""
        for seq in sorted(self.strategy.leaving(self.running), key=lambda s: s.sid):
            assert seq.finish_reason is not None  # (leaving: answered, the token that ended it said why)
            self.end(seq, seq.finish_reason, None)
        for seq in [s for s in self.running if s.settled]:  # (ended while a call ran: dropped once it is applied)
            self.drop(seq)

    def _end(self, seqs: list[Seq], reason: FinishReason) -> None:
        for seq in sorted(seqs, key=lambda s: s.sid):  # (blocks back in id order: the order a pool reuses them)
            self.end(seq, reason, None)

    def drop(self, seq: Seq) -> None:
        """An ended sequence out of the batch (``GenEngine.end`` calls this): its blocks back, unless the KV connector
        keeps them for another engine; the model is told before its next call. One never admitted holds nothing."""
        if seq not in self.running.seqs:
            return
        self.running.seqs.remove(seq)
        self.released.append(seq.sid)
        if self.connector is None or not self.connector.finished(seq):
            self.blocks.release(seq.sid)
