"""What every generation engine shares: a request becomes a ``Seq`` on the queue; the running are counted.

Two engines generate: ``StepEngine`` (labserver's own steps, asked of a ``Scheduler``) and
``HFEngine`` (transformers' manager decides the steps). Both take requests the same way
(``submit``: checked, counted at the door, queued as one ``Seq``), cut the running short
the same way after a drain, and count the same outcomes (``GenCounters``); neither
inherits from the other.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..models import GREEDY, GenModel, InputRejected, Logprob, ModelLoadError, Sampling
from ..models.grammar import Constraint, Grammar, Grammars
from .base import Counters, EngineBase, ShuttingDown
from .counters import Histogram, Metric, count, gauge, histogram, tally
from .output import Detokenizer
from .ending import FinishReason
from .sequence import EosStandIn, Request, Seq

__all__ = ["GenCounters", "GenEngine", "kv_budget_tokens"]


DEFAULT_SEQS, DEFAULT_CONTEXT = 64, 2048  # no budget given: this many sequences of this much context, at most

# vLLM 0.32's bucket edges (vllm/v1/metrics/buckets.py), so that its dashboards read labserver's histograms alike
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0)  # a request's phases: e2e, queue, prefill, decode, inference
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens per model call
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def one_two_five(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 ... up to ``most``: vLLM's buckets for tokens per request (``most``: the context)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class GenCounters(Counters):
    requests_prefilled: int = count("Sequences whose prompt was computed (their first token made)")
    tokens_generated: int = count("Tokens generated for clients", peer="vllm:generation_tokens")
    finished: Counter[str] = tally("Sequences answered, by finish reason (length, eos, stop, hand-over)", "reason")
    endings: Counter[str] = tally("Sequences ended, by finish reason: answered, aborted (the client left, a drain), "
                                  "failed (error), expired or shed", "reason", peer="vllm:request_success")
    left_while_generating: int = count("Sequences dropped mid-generation: their client left")
    prefill_reasons: Counter[str] = tally("Admissions by why they happened (start, join, single, full, ...)",
                                          "reason")
    # -- each answered sequence's times and sizes (vLLM's per-request histograms; times in s, on the engine's clock)
    time_to_first_token_s: Histogram = histogram("From joining the queue to the first token, s", TTFT_BUCKETS_S,
                                                 peer="vllm:time_to_first_token_seconds")
    inter_token_latency_s: Histogram = histogram("Between a sequence's tokens (one per model call that made some), s",
                                                 ITL_BUCKETS_S, peer="vllm:inter_token_latency_seconds")
    e2e_latency_s: Histogram = histogram("Answered sequences: from joining the queue to the last token, s",
                                         REQUEST_BUCKETS_S, peer="vllm:e2e_request_latency_seconds")
    queue_time_s: Histogram = histogram("Answered sequences: from joining the queue to their first admission, s",
                                        REQUEST_BUCKETS_S, peer="vllm:request_queue_time_seconds")
    prefill_time_s: Histogram = histogram("Answered sequences: from their first admission to the first token, s",
                                          REQUEST_BUCKETS_S, peer="vllm:request_prefill_time_seconds")
    decode_time_s: Histogram = histogram("Answered sequences: from the first token to the last, s",
                                         REQUEST_BUCKETS_S, peer="vllm:request_decode_time_seconds")
    inference_time_s: Histogram = histogram("Answered sequences: from their first admission to the last token, s",
                                            REQUEST_BUCKETS_S, peer="vllm:request_inference_time_seconds")
    time_per_output_token_s: Histogram = histogram("Answered sequences: decode time per token after the first, s",
                                                   ITL_BUCKETS_S, peer="vllm:request_time_per_output_token_seconds")
    request_prompt_tokens: Histogram = histogram("Answered sequences: prompt tokens", one_two_five(10**5),
                                                 peer="vllm:request_prompt_tokens")
    request_generation_tokens: Histogram = histogram("Answered sequences: tokens generated", one_two_five(10**5),
                                                     peer="vllm:request_generation_tokens")
    request_max_tokens: Histogram = histogram("Answered sequences: the max_tokens asked", one_two_five(10**5),
                                              peer="vllm:request_params_max_tokens")
    request_prefill_computed_tokens: Histogram = histogram(
        "Answered sequences: prompt tokens computed (not from a prefix cache)", one_two_five(10**5),
        peer="vllm:request_prefill_kv_computed_tokens")
    request_preemptions: Histogram = histogram("Answered sequences: times each was preempted", PREEMPTION_BUCKETS,
                                               peer="vllm:request_num_preemptions")

    def sized_for(self, context: int) -> None:
        """Token histograms bucketed up to the model's context (as vLLM sizes them by its max_model_len)."""
        for name in ("request_prompt_tokens", "request_generation_tokens", "request_max_tokens",
                     "request_prefill_computed_tokens"):
            setattr(self, name, Histogram(one_two_five(context)))

    def token_made(self, seq: Seq, now: float) -> None:
        """A token is about to be emitted for ``seq`` at ``now``: its TTFT, or the gap since its last call's."""
        if not seq.tokens:
            self.time_to_first_token_s.observe(now - seq.enqueued_s)
        elif now != seq.last_token_s:  # (a verification's several tokens: one gap, as vLLM counts one per step)
            self.inter_token_latency_s.observe(now - seq.last_token_s)

    def count_ending(self, seq: Seq) -> None:
        """``seq`` ended (``GenEngine.end``: its finish reason and end time set): its reason; if answered, its times
        and sizes."""
        reason = seq.finish_reason
        assert reason is not None  # (settled: every ending has its reason)
        self.endings[reason.value] += 1
        if not reason.answered:
            return
        self.finished[reason.value] += 1
        decode = seq.finished_s - seq.first_token_s
        for hist, value in ((self.e2e_latency_s, seq.finished_s - seq.enqueued_s),
                            (self.queue_time_s, seq.admitted_s - seq.enqueued_s),
                            (self.prefill_time_s, seq.first_token_s - seq.admitted_s),
                            (self.decode_time_s, decode),
                            (self.inference_time_s, seq.finished_s - seq.admitted_s),
                            (self.time_per_output_token_s, decode / (len(seq.tokens) - 1) if len(seq.tokens) > 1
                             else 0.0)):
            if not math.isnan(value):  # (a hand-over's decode side was never admitted here for its prompt)
                hist.observe(value)
        self.request_prompt_tokens.observe(len(seq.prompt_ids))
        self.request_generation_tokens.observe(len(seq.tokens))
        self.request_max_tokens.observe(seq.max_new_tokens)
        self.request_prefill_computed_tokens.observe(len(seq.prompt_ids) - seq.cached_tokens)
        self.request_preemptions.observe(seq.preemptions)


class GenEngine(EngineBase):
    """A generation engine's request side: ``submit``, the running sequences, ``cut_short``."""

    counters: GenCounters

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sids = itertools.count(1)
        self._eos_ids = frozenset(self.model.eos_ids)
        self.counters.sized_for(self.model.max_context)
        self.eos_standin = EosStandIn(self.limits.eos_prob)
        self.grammars: Grammars | None = None  # compiled grammars (structured outputs), made at the first constraint

    def emit(self, seq: Seq, token: int, now: float, logprob: Logprob | None = None) -> None:
        """A token the model made for ``seq`` (or EOS in its place: ``eos_prob``, never where a grammar decides the
        end), handed over."""
        self.counters.token_made(seq, now)
        if seq.grammar is None:
            token = self.eos_standin(seq, token, self.model.eos_id)
        seq.emit(token, now, self.model.eos_id, self._eos_ids, logprob)

    async def grammar(self, constraint: Constraint) -> Grammar:
        """What ``submit(grammar=...)`` takes for ``constraint``: compiled for this model's vocabulary, once per
        constraint (``models.grammar.Grammars``: off the event loop and the model thread). InputRejected for one that
        does not compile, or not in time."""
        if not self.scores:
            raise InputRejected(f"structured outputs: {self.model.name} under {self.strategy.name} computes no scores "
                                "for a grammar to mask; serve a real model (smollm2, a folder) with gen-continuous or "
                                "gen-paged", param="response_format")
        if self.grammars is None:
            self.grammars = Grammars(self.model)
        return await self.grammars.compile(constraint)

    @staticmethod
    def kv_budget_tokens(limits: Any, model: GenModel) -> int:
        """Positions the KV pool holds: ``max_kv_tokens``, or what ``kv_memory_mb`` holds at the model's bytes per
        position (the smaller, given both); neither: ``max_batch_size`` (at most 64) x the context (at most 2,048)."""
        budgets = [limits.max_kv_tokens] if limits.max_kv_tokens else []
        if limits.kv_memory_mb is not None:
            per = model.kv_bytes_per_token
            if not per:
                raise ModelLoadError(f"kv_memory_mb needs a model that says its KV bytes per position; {model.name} "
                                     "does not: give max_kv_tokens")
            budgets.append(int(limits.kv_memory_mb * 2**20) // per)
            if budgets[-1] < limits.kv_block_tokens:
                raise ModelLoadError(f"kv_memory_mb={limits.kv_memory_mb:g} holds {budgets[-1]} positions of {per:,} "
                                     f"bytes ({model.name}): less than one block of {limits.kv_block_tokens}")
        if budgets:
            return min(budgets)
        return int(min(limits.cap, DEFAULT_SEQS) * min(model.max_context, DEFAULT_CONTEXT))

    @property
    def running(self) -> Any:
        """The sequences admitted and not yet done (``len`` and iteration)."""
        raise NotImplementedError

    def check(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None,
              stop: Sequence[str], min_tokens: int) -> None:
        """Raise InputRejected for a request this engine can never serve (the model's context here)."""
        need = len(prompt_ids) + max_new_tokens
        if need > self.model.max_context:
            raise InputRejected(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) is "
                                f"{need}, over the model's context of {self.model.max_context} tokens")
        if sampling is not None and (sampling.logprobs, sampling.prompt_logprobs) != (None, None) and not self.scores:
            raise InputRejected(f'"logprobs": {self.model.name} computes no scores under {self.strategy.name}; '
                                "serve a real model (smollm2, a folder) with gen-continuous or gen-paged",
                                param="logprobs")

    @property
    def max_model_len(self) -> int:
        """Tokens one sequence may hold here (prompt + output): the model's context (``/v1/models`` says it)."""
        return int(self.model.max_context)

    connector: Any = None  # a KV connector (``labserver.engine.connector``) when KV crosses engines, else None

    def end(self, seq: Seq, reason: FinishReason, error: BaseException | None = None) -> None:
        """Every way a sequence ends comes here, once: its reason and end time recorded, its stream woken, its future
        settled (with itself when answered, else ``error``), its blocks and KV let go (``let_go``: the engine's,
        a KV connector may keep them), the ending counted. A second ending of the same sequence is nothing."""
        if seq.settled:
            return
        seq.settle(reason, self.clock(), error)
        self.let_go(seq)
        self.counters.count_ending(seq)

    def let_go(self, seq: Seq) -> None:
        """What the engine held of an ended sequence: its place in the running batch, its blocks, its KV."""

    @property
    def scores(self) -> bool:
        """Whether this engine's model gives log-probabilities (``Sampling.logprobs``): a model that computes."""
        return self.model.scores

    def submit(self, prompt_ids: list[int], max_new_tokens: int, *, ignore_eos: bool = False, request_id: str = "",
               sampling: Sampling | None = None, stop: Sequence[str] = (), min_tokens: int = 0, priority: int = 0,
               tenant: str = "", parent: Seq | None = None, cache_salt: str = "", remote_decode: bool = False,
               kv_transfer: Any = None, grammar: Grammar | None = None) -> Seq:
        """Queue one sequence. Raises InputRejected (too long), Overloaded, ShuttingDown or WorkerDied.

        ``sampling`` None is greedy; ``stop`` strings end it early ("stop"); EOS cannot end it
        before ``min_tokens`` (the model never chooses EOS before then). ``parent``: another
        choice of the same request (n > 1), the first, whose prompt blocks this one may share.
        ``cache_salt``: only sequences with the same salt share prefix-cache blocks ("": no salt).
        Through the engine's KV connector (vLLM's ``kv_transfer_params``): ``remote_decode``, end it
        after its first token with its KV kept for another engine; ``kv_transfer``, what another
        engine made of it (its prompt's KV and first token), which the connector writes when it is admitted.
        ``grammar`` (``await grammar(constraint)``): the shape of its answer; it gets a matcher of its own.
        """
        if (remote_decode or kv_transfer is not None) and self.connector is None:
            raise InputRejected(f"{self.strategy.name} with {self.model.name} has no KV connector: its KV cannot "
                                "cross engines (disaggregated serving needs gen-continuous or gen-paged)")
        if grammar is not None and (remote_decode or kv_transfer is not None):
            raise InputRejected("a structured output is generated on one engine: its KV cannot cross engines",
                                "response_format")
        self.check(prompt_ids, max_new_tokens, sampling, stop, min_tokens)
        self.admit_or_refuse(1)
        now = self.clock()
        if min_tokens and not ignore_eos:
            sampling = replace(sampling or GREEDY, eos_from=len(prompt_ids) + min_tokens)
        seed = hash((tuple(prompt_ids), sampling.seed if sampling else None))  # its EOS stand-in: per request
        request = Request(prompt_ids, max_new_tokens, now, ignore_eos, request_id, sampling, tuple(stop), min_tokens,
                          priority, tenant, seed, cache_salt, remote_decode,
                          grammar.constraint if grammar is not None else None)
        seq = Seq(next(self._sids), request, asyncio.get_running_loop().create_future(), self.deadline_s(now),
                  parent=parent, output=Detokenizer(self.model.text, stop),
                  grammar=grammar.matcher() if grammar is not None else None)
        if kv_transfer is not None:
            self.connector.accept(seq, kv_transfer)
        self.queue.put([seq])
        return seq

    def cut_short(self) -> None:
        """After a drain, the sequences still generating are cut short (503, or an error event mid-stream)."""
        self.end_all(list(self.running), FinishReason.ABORT, ShuttingDown("server is shutting down; generation "
                                                                          "stopped"))

    def metrics(self) -> list[Metric]:
        g = self.grammars
        grammars = [] if g is None else [
            Metric("grammar_compiles", "Structured outputs: grammars compiled (a schema, regex, choice or EBNF)",
                   "counter", g.compiles),
            Metric("grammar_cache_hits", "Structured outputs: constraints whose grammar was already compiled",
                   "counter", g.hits),
            Metric("grammar_refused", "Structured outputs: constraints refused (malformed, or too slow to compile)",
                   "counter", g.refused),
            Metric("grammar_compile_seconds", "Structured outputs: time spent compiling grammars, s", "counter",
                   round(g.compile_s, 6)),
            Metric("grammar_mask_seconds", "Structured outputs: time spent filling and applying token masks, s",
                   "counter", round(g.mask_s, 6)),
            Metric("grammar_mask_rows", "Structured outputs: score rows masked (one per constrained token)",
                   "counter", g.mask_rows)]
        return [*super().metrics(), gauge("running", "Sequences in the running batch", len(self.running),
                                          peer="vllm:num_requests_running"), *grammars]


kv_budget_tokens = GenEngine.kv_budget_tokens  # (the rule both generation engines size their KV pool by)
