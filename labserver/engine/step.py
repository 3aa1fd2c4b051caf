"""The step engine: generation requests become sequences, one worker runs prefill and decode steps.

An encoder request is one item in one model call. A generation request is a
*sequence* that needs one model call per output token, so the worker's loop is a
loop over steps::

    while True:
        joining = await strategy.admit(queue, running, clock)   # who joins at this step boundary
        drop sequences whose client left, and requests already past their deadline
        prefill(joining)          # their prompts: KV cache + first token each; they join `running`
        decode(running)           # ONE step for every running sequence: one token each
        retire the finished       # leave at once, or (gen-static) when the whole batch is done

Everything that differs between request-level batching and continuous
(iteration-level) batching is the strategy's ``admit`` and whether finished
sequences leave at once (``holds_finished``). The model runs on the model thread;
tokens are handed to each request's handler on the event loop after every step,
through ``Seq.emit``. A strategy whose steps happen in transformers' own manager
(``scheduler = "transformers"``) runs ``labserver.engine.hfcb``'s loop instead.

Every step is recorded (``StepRecord``: who was in it, who was computed although
already finished, KV tokens in use): the Gantt and KV plots are drawn from these.

Nothing here knows HTTP or torch. The same loop runs on a virtual clock
(``labserver.engine.virtual.simulate_gen``): it awaits nothing but the queue and the model.
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

from ..models import GREEDY, GenModel, InputRejected, Sampling
from ..strategies import GenStrategy
from .base import Counters, EngineBase, ShuttingDown
from .runner import run_isolating

logger = logging.getLogger(__name__)

__all__ = ["Running", "Seq", "StepCounters", "StepEngine", "StepRecord"]


@dataclass(eq=False)
class Seq:
    """One generation request, from the queue through every step it takes part in."""

    sid: int
    prompt_ids: list[int]
    max_new_tokens: int
    future: Any  # resolves with this Seq when answered, or an exception; cancelled when the client leaves
    enqueued_s: float  # clock time it joined the queue, s
    deadline_s: float = math.inf  # no first token by then: 504, never prefilled
    ignore_eos: bool = False
    request_id: str = ""
    sampling: Sampling | None = None  # how its tokens are chosen (None: greedy), min_tokens folded in as eos_from
    stop: tuple[str, ...] = ()  # it finishes ("stop") once its text contains one of these
    min_tokens: int = 0  # EOS does not end it before this many tokens
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache, not computed
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "eos" | "stop" once finished
    admitted_s: float = math.nan  # its prefill started
    first_token_s: float = math.nan
    finished_s: float = math.nan  # its last token was made
    steps: int = 0  # decode steps it took part in while generating
    step_batch_sum: int = 0  # sum of those steps' sizes (for its mean batch)
    _wake: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def reserve(self) -> int:
        """KV-cache tokens this sequence may need: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def gone(self) -> bool:
        """The client left, or the request was answered otherwise (timeout, shutdown)."""
        return self.future.done() and not self.finished

    def emit(self, token: int, now: float, eos_id: int | None, text: Callable[[list[int]], str] | None = None) -> None:
        """Append a token; finish on a stop string, max_new_tokens or EOS; wake whoever streams it.

        ``text`` (the model's detokenizer) is read only for a sequence with stop strings.
        """
        if not self.tokens:
            self.first_token_s = now
        self.tokens.append(token)
        if self.stop and text is not None and any(s in text(self.tokens) for s in self.stop):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        elif token == eos_id and not self.ignore_eos and len(self.tokens) > self.min_tokens:
            self.finish_reason = "eos"
        if self.finished:
            self.finished_s = now
        self.wake()

    def wake(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def next_change(self) -> asyncio.Future[None]:
        """A future that completes at the next token (on the event loop; wait on it with ``future``)."""
        if self._wake is None or self._wake.done():
            self._wake = asyncio.get_running_loop().create_future()
        return self._wake


def _samplings(seqs: list[Seq]) -> tuple[list[Sampling | None], ...]:
    """The extra argument of a model call: every sequence's choice, or nothing when all are greedy
    (so a model that only decodes greedily need not take the argument)."""
    return () if all(s.sampling is None for s in seqs) else ([s.sampling for s in seqs],)


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill" | "decode"
    start_s: float  # clock, s
    end_s: float
    seqs: tuple[int, ...]  # sequence ids in the model call
    idle: tuple[int, ...] = ()  # among seqs: already finished, computed anyway (request-level batching's waste)
    kv_tokens: int = 0  # tokens cached by running sequences after the call
    kv_reserved: int = 0  # prompt + max_new_tokens of every running sequence


class Running:
    """The sequences in the batch between steps, and what they hold."""

    def __init__(self) -> None:
        self.seqs: list[Seq] = []

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


class StepEngine(EngineBase):
    """One generation strategy, one generative model, the queue, and the step loop."""

    def __init__(self, strategy: GenStrategy, model: GenModel, *, clock: Callable[[], float] = time.perf_counter,
                 history: int = 20_000, scheduler: Callable[[StepEngine], Awaitable[None]] | None = None) -> None:
        """``scheduler``: an outside loop that runs the steps instead of ``step_loop`` (``engine.hfcb``)."""
        super().__init__(strategy, model, clock=clock)
        self.scheduler = scheduler
        self.strategy: GenStrategy = strategy
        self.model: GenModel = model
        self.counters = StepCounters()
        self.running = Running()
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
        budget = self.limits.max_kv_tokens
        if budget is not None and need > budget:
            raise InputRejected(f"prompt + max_new_tokens is {need} tokens, over the server's whole KV-cache "
                                f"budget of {budget} (max_kv_tokens); ask for fewer tokens")
        self.admit_or_refuse(1)
        now = self.clock()
        if min_tokens and not ignore_eos:
            sampling = replace(sampling or GREEDY, eos_from=len(prompt_ids) + min_tokens)
        seq = Seq(next(self._sids), prompt_ids, max_new_tokens, asyncio.get_running_loop().create_future(), now,
                  self.deadline_s(now), ignore_eos, request_id, sampling, tuple(stop), min_tokens)
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
        while True:
            joining, reason = await self.strategy.admit(self.queue, self.running, self.clock)
            await self._drop_gone()  # (awaits the model thread: check the newcomers' deadlines after it)
            now = self.clock()  # one reading for the deadline check and the prefill's start
            live = self.live(joining, now, "no first token before timeout_ms")
            if live:
                await self._prefill(live, reason, now)
            if self.running.seqs:
                await self._decode()

    async def _drop_gone(self) -> None:
        """Sequences whose client left (or that were answered 504/503) free their place now."""
        gone = [s for s in self.running.seqs if s.gone]
        if gone:
            self.counters.left_running += len(gone)
            await self._leave(gone)

    async def _prefill(self, seqs: list[Seq], reason: str, start: float) -> None:
        for seq in seqs:
            seq.admitted_s = start
            if seq.deadline_s < start:  # live() used the same reading: impossible, counted anyway
                self.counters.computed_after_deadline += 1
        outs, calls = await self.call(run_isolating, self._prefill_call, seqs)
        end = self.clock()
        self.counters.prefills += calls
        self.counters.reasons[reason] += 1
        ok = []
        for seq, out in zip(seqs, outs, strict=True):
            if isinstance(out, Exception):
                self.counters.failed += 1
                if not seq.future.done():
                    seq.future.set_exception(out)
            else:
                self.counters.requests += 1
                seq.emit(out, end, self.model.eos_id, self.model.text)
                self.counters.tokens += 1
                ok.append(seq)
        self.running.seqs.extend(ok)
        self._record("prefill", start, end, tuple(s.sid for s in ok), ())
        await self._retire()

    def _prefill_call(self, seqs: list[Seq]) -> list[int]:
        """One prefill call (on the model thread; ``run_isolating`` splits the list when it fails)."""
        return self.model.prefill([(s.sid, s.prompt_ids) for s in seqs], *_samplings(seqs))

    async def _decode(self) -> None:
        limit = self.model.max_context
        # finished sequences are still computed while a strategy holds them (gen-static), as
        # model.generate computes a batch's finished rows until its longest one is done
        batch = [s for s in self.running.seqs if not s.finished or s.kv_tokens < limit]
        if not batch:
            await self._retire()
            return
        start = self.clock()
        try:
            outs = await self.call(self.model.decode, [(s.sid, s.tokens[-1]) for s in batch], *_samplings(batch))
        except Exception as e:  # a failed step fails every sequence in it (mid-stream: an error event)
            logger.exception("decode step failed for %d sequences", len(batch))
            self.counters.failed += len(batch)
            for seq in batch:
                if not seq.future.done():
                    seq.future.set_exception(e)
            await self._leave(batch)
            return
        end = self.clock()
        idle = []
        for seq, token in zip(batch, outs, strict=True):
            if seq.finished:
                idle.append(seq.sid)
                continue
            seq.steps += 1
            seq.step_batch_sum += len(batch)
            seq.emit(token, end, self.model.eos_id, self.model.text)
        self.counters.decode_steps += 1
        self.counters.tokens += len(batch) - len(idle)
        self.counters.idle_tokens += len(idle)
        self.counters.step_sizes[len(batch)] += 1
        self._record("decode", start, end, tuple(s.sid for s in batch), tuple(idle))
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
        ids = {s.sid for s in seqs}
        self.running.seqs[:] = [s for s in self.running.seqs if s.sid not in ids]
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

    def _record(self, kind: str, start: float, end: float, sids: tuple[int, ...], idle: tuple[int, ...]) -> None:
        if sids:
            self.steps.append(StepRecord(next(self._step_ids), kind, start, end, sids, idle,
                                         self.running.kv_tokens, self.running.reserved))

    # -- what /stats shows ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        g = self.counters
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
            "finished": dict(g.finished),
            "left_while_generating": g.left_running,
            "step_size_histogram": {str(k): v for k, v in sorted(g.step_sizes.items())},
            "prefill_reasons": dict(g.reasons),
        }

    def step_log(self, last: int | None = None) -> list[dict[str, Any]]:
        steps = list(self.steps)[-last:] if last else list(self.steps)
        return [vars(s).copy() for s in steps]
