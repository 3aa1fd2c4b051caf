"""The step engine: generation requests become sequences; one worker runs the calls a scheduler plans.

An encoder request is one item in one model call. A generation request is a
*sequence* that needs one model call per output token, so the worker is a loop over
calls, each planned by the ``Scheduler`` (``labserver.engine.scheduler``), which asks
the strategy every question (who joins, how a step is composed, whom to preempt, who
leaves)::

    while True:
        call = scheduler.next_call()        # who is computed, how many tokens each, their blocks
        tell the model which sequences it may forget (finished, failed, gone, preempted)
        if call is None:                    # the step is over
            await scheduler.admit()         # a step boundary: who joins, and the calls of the next step
            continue
        where the model leaves no core spare: the loop writes the last call's tokens now (see below)
        outputs = model.forward(call.chunks)          # on the model thread; any mix of prompts and decodes;
                                                      # one that raises is bisected until its failure falls alone
        scheduler.apply(call, outputs)      # positions computed, tokens emitted, failures, who leaves

KV memory is blocks (``labserver.engine.blocks``): the scheduler keeps each sequence's
block table and hands it to the model with the work (``labserver.models.Chunk``); the
model owns the pool. The model runs on the model thread; tokens are handed to each
request's handler on the event loop after every call, through ``Seq.emit``. Every call
is recorded (``CallRecord``): the Gantt and KV plots are drawn from these. Nothing here
knows HTTP or torch; the same loop runs on a virtual clock
(``labserver.engine.gensim.simulate_gen``).

Where the loop's work runs. Each call's tokens are written to their streams by the routes'
tasks on the event loop. On a CPU whose every core is in the model's OpenMP team
(``models.no_core_spare``: 2 threads on 2 cores), that work during a call takes a core the
team needs, and the team's other thread may wait for it: it can cost the model up to twice
its own time. Between two calls it costs only its own, so there the loop is given a few turns
(``flush_turns``) to write the tokens before the next call begins (about 1 % more tokens/s
served on 2 cores: ``benchmarks/beside.py``). With a core to spare (a GPU, a CPU with more
cores than the team) the writing runs beside the next call instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..models import GenModel, InputRejected, ModelLoadError, Sampling, load_model, no_core_spare
from ..strategies import GenStrategy
from .blocks import BlockManager
from .counters import Metric, gauge
from .genbase import GenEngine, kv_budget_tokens
from .connector import KVConnector
from .modelthread import WorkerDied, bisecting, let_loop_run
from .scheduler import ModelCall, RunningSeqs, Scheduler, StepCounters, CallRecord
from .sequence import Seq
from .speculation import DraftModel, Guess, Speculator, same_tokenizer

logger = logging.getLogger(__name__)

FLUSH_TURNS = 6  # loop turns that write the tokens just made before the next call, where the model has no spare core
TAKEN_S = 0.002  # the loop waits at most this long for the model thread to begin a call (``ModelThread.submit``)

__all__ = ["RunningSeqs", "Seq", "StepCounters", "StepEngine", "CallRecord", "kv_budget_tokens"]

class StepEngine(GenEngine):
    """One generation strategy, one generative model, the queue, the scheduler, and the loop over calls."""

    counters: StepCounters

    def __init__(self, strategy: GenStrategy, model: GenModel, *, clock: Callable[[], float] = time.perf_counter,
                 queue: Any = None, history: int = 20_000) -> None:
        super().__init__(strategy, model, StepCounters(), clock=clock, queue=queue)
        if not model.paged:  # a causal LM folder with no forward pass here (models.causal)
            raise ModelLoadError(f"{strategy.name} runs labserver's own forward passes, which cannot run "
                                 f"{model.why}; serve it with --strategy gen-hf-cb (transformers' own manager)")
        limits = self.limits
        budget = kv_budget_tokens(limits, model)
        self.blocks = BlockManager(budget // limits.kv_block_tokens, limits.kv_block_tokens,
                                   prefix_cache=limits.prefix_cache)
        model.allocate_kv(self.blocks.total, self.blocks.block_tokens)
        self.scheduler = Scheduler(strategy, self.queue, self.blocks, self.counters, clock, self.live, self.emit,
                                   self.end, history)
        self.in_flight = self.scheduler.running.seqs  # (the same list) what drain waits for and a dying worker fails
        self._calling = False  # a model call (or a KV write) is under way
        self._span: tuple[float, float] | None = None  # the last call on the model thread, by its own clock
        self._forgetting: asyncio.Future[None] | None = None  # a release handed to the model thread, unawaited
        self.spec = Speculator(limits) if limits.speculative else None  # (a draft model joins it in ``ready``)
        self.flush_turns = FLUSH_TURNS if no_core_spare(getattr(model, "device", "")) else 0

    async def ready(self) -> None:
        """With ``--speculative draft``: the draft model loaded (off the loop) and given its own KV pool, the same
        size as the target's; one that cannot be loaded, or names tokens otherwise, fails the start."""
        if self.spec is None or self.spec.method != "draft" or self.spec.draft is not None:
            return
        spec = self.limits.draft_model or ""
        name, _, dtype = spec.rpartition(":")
        if dtype not in ("auto", "float32", "float16", "bfloat16"):  # (a spec with a colon of its own: no dtype)
            name, dtype = spec, "auto"
        draft = await asyncio.to_thread(load_model, name, device=self.model.device, kind="generate", dtype=dtype)
        if not draft.paged:
            raise ModelLoadError(f"the draft model {self.limits.draft_model} has no forward pass here")
        if not same_tokenizer(self.model, draft):
            raise ModelLoadError(f"the draft model {self.limits.draft_model} names tokens otherwise than "
                                 f"{self.model.name}: a draft needs the same tokenizer")
        self.spec.draft = await self.call(DraftModel, draft, self.blocks.total, self.blocks.block_tokens)

    def connect(self, connector: KVConnector) -> None:
        """KV from or for other engines from now on, through ``connector`` (``labserver.engine.connector``)."""
        self.connector = self.scheduler.connector = connector

    def let_go(self, seq: Seq) -> None:
        """Its blocks back, now; or, while a model call is under way (a drain, a dead worker), once that call is
        applied: the call writes its blocks until then (the scheduler drops the ended it finds)."""
        if not self._calling:
            self.scheduler.drop(seq)

    @property
    def running(self) -> RunningSeqs:
        return self.scheduler.running

    @property
    def steps(self) -> Any:
        return self.scheduler.steps

    def check(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None,
              stop: Any, min_tokens: int) -> None:
        super().check(prompt_ids, max_new_tokens, sampling, stop, min_tokens)
        need = len(prompt_ids) + max_new_tokens
        if self.blocks.blocks_for(need) > self.blocks.total:
            raise InputRejected(f"prompt + max_new_tokens is {need} tokens, over the server's whole KV-cache "
                                f"budget of {self.blocks.total * self.blocks.block_tokens} (max_kv_tokens, in blocks "
                                f"of {self.blocks.block_tokens}); ask for fewer tokens")

    @property
    def max_model_len(self) -> int:
        """The model's context, or the whole KV pool where that holds less (``check`` refuses past it)."""
        return min(super().max_model_len, self.blocks.total * self.blocks.block_tokens)

    # -- the worker ----------------------------------------------------------------------
    async def _work(self) -> None:
        await self.step_loop()

    async def step_loop(self) -> None:
        """Plan a call, run it, apply what it made; between steps, admit: the loop in the module docstring."""
        while True:
            call = self.scheduler.next_call()  # the step's next call; None: the step is over
            await self._release()  # the model forgets who left before it computes, or before we wait
            self._calling = True  # (the model thread writes the call's blocks: an ending meanwhile keeps them)
            if self.connector is not None:
                await self.connector.load()  # KV from elsewhere, written before any call reads it
            if call is None:
                self._calling = False
                await self.scheduler.admit()  # a step boundary: who joins (waits while nothing runs)
                continue
            await let_loop_run(self.flush_turns)  # the last call's tokens written first (0: beside this call)
            if self.spec is not None and call.decoding:
                call = await self._guess(call)  # speculation: guesses to verify in this call
            start = self.clock()
            outs, calls = await self._run(call)
            self._calling = False
            if call.prefills:
                self.counters.prefill_calls += calls
            end = self.clock()
            self.scheduler.apply(call, outs, start, end, calls, self._span)
            if call.guesses:
                self.counters.spec_verify_ms += 1000 * (end - start)
                self.spec.kept_by(s for s, _ in call.work if s.sid in call.guesses)  # type: ignore[union-attr]

    async def _guess(self, call: ModelCall) -> ModelCall:
        """The call with the proposer's guesses for its decoding sequences (``labserver.engine.speculation``), when
        the rule speculates at this load; a proposer that fails costs this step its guesses, nothing else."""
        spec = self.spec
        assert spec is not None
        if not spec.active(len(self.running), len(self.queue)):
            return call
        asks = [Guess(seq.sid, seq.context, room)
                for seq, room in self.scheduler.guessing(call, spec.k, self.model.max_context)]
        if not asks:
            return call
        t = self.clock()
        try:
            guesses = await self.call(spec.propose, asks)
        except WorkerDied:
            raise
        except Exception as e:
            logger.warning("the %s proposer failed (%s: %s); this step verifies no guesses", spec.method,
                           type(e).__name__, e)
            return call
        finally:
            self.counters.spec_draft_ms += 1000 * (self.clock() - t)
        return self.scheduler.with_guesses(call, guesses)

    async def _run(self, call: ModelCall) -> tuple[list[Any], int]:
        """The call's outputs, one per sequence, and the model calls they took.

        A failure is never the loop's end, nor its batch-mates': a call that raises is
        bisected, each half run as a call of its own (``ModelCall.halves``) and split again
        while it raises, until the failure falls on the sequence(s) it belongs to; their
        output is the exception, everyone else's what the model made for them, computed
        once. One poisoned sequence among n costs about 2 log2(n) more calls; an
        out-of-memory step is retried smaller until it fits.
        """
        outs, calls = await self._isolate(call)
        if calls > 1:
            failed = [s.sid for (s, _), out in zip(call.work, outs, strict=True) if isinstance(out, Exception)]
            logger.warning("a call of %d sequences raised; bisected in %d calls, the model failed on %s",
                           len(call.work), calls, failed or "none of them")
        return outs, calls

    async def _isolate(self, call: ModelCall) -> tuple[list[Any], int]:
        """``bisecting`` driven from the loop, each call awaited on the model thread (a dead worker ends it)."""
        steps = bisecting(call, ModelCall.halves, lambda c: len(c.work))
        part = next(steps)
        thread = self._thread if self.clock is time.perf_counter else None  # (its spans are on perf_counter)
        self._span = None
        while True:
            try:
                outcome: list[Any] | Exception = await self.call(self.model.forward, part.chunks, taken_s=TAKEN_S)
            except WorkerDied:
                raise  # the model thread is gone: nothing to retry on
            except Exception as e:
                outcome = e
            if thread is not None and thread.span is not None:  # from the thread's own start of the first part
                first = thread.span[0] if self._span is None else self._span[0]
                self._span = (first, thread.span[1])  # to the end of the last
            try:
                part = steps.send(outcome)
            except StopIteration as done:
                outs, calls = done.value
                self.counters.bisections += (calls - 1) // 2  # (each split: one call more than its two halves)
                await self._forgotten()
                return outs, calls

    async def _release(self) -> None:
        """Tell the model which sequences left the batch, so it may forget their KV: queued on the model thread
        ahead of the next call, not waited for (a round trip of its own held a step 7-8 ms at 32 streams); one that
        failed raises once that call has run, as it would have raised here."""
        released = self.scheduler.released
        if released:
            self.scheduler.released = []
            await self._forgotten()
            if self._thread is None:
                self._forget(released)
            else:
                self._forgetting = self._thread.submit(self._forget, released)

    async def _forgotten(self) -> None:
        """The release handed over last, waited for (done by now when a call ran after it); its failure raised."""
        if self._forgetting is not None:
            forgetting, self._forgetting = self._forgetting, None
            await forgetting

    async def stop(self, in_flight_timeout_s: float = 60.0) -> None:
        await super().stop(in_flight_timeout_s)
        if self.connector is not None:
            self.connector.close()

    def _forget(self, sids: list[int]) -> None:
        """On the model thread: the model (and a draft model) may drop these sequences' KV."""
        self.model.release(sids)
        if self.spec is not None:
            self.spec.forget(sids)

    # -- what /stats shows ------------------------------------------------------------------
    def metrics(self) -> list[Metric]:
        g, b = self.counters, self.blocks
        return [*super().metrics(),
                gauge("kv_tokens", "KV-cache tokens held by running sequences", self.running.kv_tokens),
                gauge("kv_reserved", "Prompt + max_new_tokens of every running sequence", self.running.reserved),
                gauge("kv_blocks", "KV-cache blocks by state", {"used": b.used, "cached": b.cached, "free": b.free},
                      label="state"),
                gauge("kv_block_tokens", "Tokens per KV block", b.block_tokens),
                gauge("kv_blocks_total", "KV-cache blocks in the pool", b.total),
                gauge("kv_usage", "Share of the pool's blocks in running sequences' tables (1: all)",
                      b.used / b.total if b.total else 0.0, peer="vllm:kv_cache_usage_perc"),
                gauge("kv_tokens_total", "KV-cache positions the pool holds (its token budget)",
                      b.total * b.block_tokens),
                gauge("kv_bytes_per_token", "KV memory one position holds: layers x 2 x KV heads x head size x "
                      "dtype size (0: the model does not say)", self.model.kv_bytes_per_token),
                gauge("kv_memory_bytes", "KV memory of the whole pool (its byte budget)",
                      b.total * b.block_tokens * self.model.kv_bytes_per_token),
                Metric("kv_blocks_evicted", "Cached blocks whose memory was taken for something else", "counter",
                       b.evicted),
                gauge("prefix_hit_rate", "Share of prompt tokens the prefix cache held (null: no prompt yet)",
                      round(g.cached_tokens / g.prompt_tokens, 4) if g.prompt_tokens else None),
                gauge("spec_acceptance_rate", "Speculative decoding: share of proposed tokens kept (null: none "
                      "proposed)", round(g.spec_accepted_tokens / g.spec_proposed_tokens, 4)
                      if g.spec_proposed_tokens else None),
                gauge("spec_mean_accepted_length", "Speculative decoding: tokens a verification made on average, the "
                      "guesses kept and the model's own (vLLM's mean acceptance length; null: none verified)",
                      round(1 + g.spec_accepted_tokens / g.spec_drafts, 4) if g.spec_drafts else None),
                *(self.connector.metrics() if self.connector is not None else [])]

    def step_log(self, last: int | None = None) -> list[dict[str, Any]]:
        steps = list(self.steps)[-last:] if last else list(self.steps)
        return [vars(s).copy() for s in steps]
