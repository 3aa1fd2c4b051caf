"""What the step engine records: one ``CallRecord`` per model call (the step log, the Gantt) and its counters.

``StepCounters`` are a generation engine's counters (``labserver.engine.counters``: each
field's name is the name ``/stats`` shows and ``/metrics`` exports) plus the step engine's
own: steps, preemptions, prefix-cache hits, speculation. The scheduler
(``labserver.engine.scheduler``) writes both; nothing here decides anything.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .counters import Histogram, count, histogram, sizes
from .genbase import ITERATION_BUCKETS, GenCounters

__all__ = ["StepCounters", "CallRecord"]


@dataclass
class CallRecord:
    step: int
    start_s: float  # clock, s
    end_s: float
    seqs: tuple[int, ...]  # sequence ids in the model call
    idle: tuple[int, ...] = ()  # among seqs: already finished, computed anyway (request-level batching's waste)
    kv_tokens: int = 0  # tokens cached by running sequences after the call
    kv_reserved: int = 0  # prompt + max_new_tokens of every running sequence
    tokens: int = 0  # tokens computed in the call (prompt pieces + one per decode)
    prefilling: tuple[int, ...] = ()  # among seqs: those whose prompt (or a piece, or a recompute) was computed
    #   and that are not finished (one answered by its first token is in neither this nor decoding)
    preempted: tuple[int, ...] = ()  # sequences preempted to make room for this call (requeued, recomputed later)
    blocks_used: int = 0  # KV blocks after the call: in a running sequence's table
    blocks_cached: int = 0  # in none, kept for the prefix cache
    blocks_free: int = 0
    decoding: tuple[int, ...] = ()  # among seqs: those that computed one token of their answer (idle ones too);
    #   the others computed prompt tokens. None: a prefill call; all of seqs: a decode step; else a mixed one
    calls: int = 1  # model calls it took: more when the call raised and was bisected to find whom the failure is
    #   for (each half run as a call of its own)
    failed: tuple[int, ...] = ()  # among seqs: those the model failed on (each answered with its error)
    guessed: int = 0  # tokens proposed by speculation and verified in this call (labserver.engine.speculation)
    accepted: int = 0  # of those, the ones the model's own choices confirmed (kept)
    verifying: tuple[int, ...] = ()  # among decoding: those whose guesses this call verified
    model_s: tuple[float, float] | None = None  # on the model thread: when it began the call and when it was done
    #   (within start_s..end_s; between them and the loop's: the hand-overs. None: no model thread, or a virtual clock)


@dataclass
class StepCounters(GenCounters):
    prefill_calls: int = count("Prefill model calls (more than prefills when a failed one was split and retried)")
    bisections: int = count("Model calls that raised and were split in halves, each retried as a call of its own, "
                            "until the failure fell on its own sequences")
    decode_calls: int = count("Model calls that decoded (decode or mixed steps)")
    idle_tokens: int = count("Tokens computed for sequences already finished (static batching's padding)")
    step_size_histogram: Counter[int] = sizes("Sequences per decode step")
    iteration_tokens: Histogram = histogram("Tokens computed per model call (prompt pieces + decodes)",
                                            ITERATION_BUCKETS, peer="vllm:iteration_tokens_total")
    preemptions: int = count("Sequences preempted for KV blocks (freed, requeued, recomputed)",
                             peer="vllm:num_preemptions")
    preempted_for_priority: int = count("Sequences preempted at admission for a higher priority class (recomputed)")
    recomputed_tokens: int = count("Tokens prefilled again after a preemption")
    prompt_tokens: int = count("Prompt tokens of admitted sequences (first admission)",
                               peer=("vllm:prompt_tokens", "vllm:prefix_cache_queries"))
    cached_tokens: int = count("Of those, tokens whose KV the prefix cache held (not computed)",
                               peer=("vllm:prompt_tokens_cached", "vllm:prefix_cache_hits"))
    shared_tokens: int = count("Of those, tokens a choice shared with its request's first choice (n > 1; not "
                               "computed)")
    spec_proposed_tokens: int = count("Speculative decoding: tokens proposed (guessed) and verified",
                                      peer="vllm:spec_decode_num_draft_tokens")
    spec_accepted_tokens: int = count("Speculative decoding: proposed tokens the model's own choices confirmed",
                                      peer="vllm:spec_decode_num_accepted_tokens")
    spec_drafts: int = count("Speculative decoding: guesses verified (one per sequence per verify step)",
                             peer="vllm:spec_decode_num_drafts")
    spec_accepted_histogram: Counter[int] = sizes("Speculative decoding: guessed tokens kept per guess verified")
    spec_draft_ms: float = count("Speculative decoding: milliseconds spent proposing (a draft model's calls)")
    spec_verify_ms: float = count("Speculative decoding: milliseconds of the model calls that verified guesses")
    kv_handed_out: int = count("Disaggregated prefill side: sequences whose KV a decode replica pulled")
    kv_handed_out_bytes: int = count("Disaggregated prefill side: bytes of KV copied for decode replicas")
    kv_handed_expired: int = count("Disaggregated prefill side: KV freed unpulled when its wait timed out")
    kv_handed_in: int = count("Disaggregated decode side: sequences admitted with their prompt's KV computed elsewhere")
    kv_imported_tokens: int = count("Disaggregated decode side: positions written from hand-overs (past prefix-cache "
                                    "hits)")
