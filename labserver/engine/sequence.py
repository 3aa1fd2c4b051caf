"""One generation request as the step engine sees it: a ``Seq``, from the queue through every step.

A ``Seq`` stands alone: its prompt, the tokens made so far, how many of its positions hold
keys and values in the KV cache (``computed``), its times and how it ended. It knows
nothing of blocks (the engine keeps its block table) or of the model. A preempted sequence
goes back to the queue with ``computed = 0`` and keeps its tokens: when it is admitted
again, its prompt and those tokens are prefilled together, and the next token it makes is
the next one its client receives (none repeated, none lost).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Collection
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any

from ..models import Sampling
from ..models.base import Logprob, position_seed
from .ending import FinishReason, Status, status_of
from .output import Detokenizer

__all__ = ["EosStandIn", "FinishReason", "Request", "Seq", "Status"]


@dataclass(frozen=True)
class Request:
    """What the client asked, fixed from the queue to the answer (a ``Seq`` reads it as its own fields)."""

    prompt_ids: list[int]  # (never changed: a preempted sequence recomputes it)
    max_new_tokens: int
    enqueued_s: float  # clock time it joined the queue, s
    ignore_eos: bool = False
    request_id: str = ""
    sampling: Sampling | None = None  # how its tokens are chosen (None: greedy), min_tokens folded in as eos_from
    stop: tuple[str, ...] = ()  # it finishes ("stop") once its text contains one of these
    min_tokens: int = 0  # EOS does not end it before this many tokens
    priority: int = 0  # its class: a lower value is served first (and may displace a higher one: scheduling)
    tenant: str = ""  # whose request: fair shares are kept per tenant
    seed: int = 0  # seeds the engine's per-request draws that sampling does not make (the EOS stand-in's)
    cache_salt: str = ""  # prefix-cache blocks are shared only between requests with the same salt ("": none)
    remote_decode: bool = False  # vLLM's do_remote_decode: it ends after its first token (FinishReason.HAND_OVER),
    #   its KV kept by the engine's KV connector for another engine, which makes the rest
    constraint: Any = None  # the shape its answer must take (``models.grammar.Constraint``; None: any text)


def _asked(name: str) -> property:
    return property(attrgetter(f"request.{name}"), doc=f"The request's ``{name}`` (read-only).")


@dataclass(eq=False)
class Seq:
    """One generation request, from the queue through every step it takes part in: the request (immutable) and
    what the engine has made of it so far."""

    sid: int
    request: Request
    future: Any  # resolves with this Seq when answered, or an exception; cancelled when the client leaves
    deadline_s: float = math.inf  # no first token by then: 504, never prefilled (inf once it has one)
    parent: Seq | None = field(default=None, repr=False)  # n > 1: the request's first choice (its prompt blocks
    #   are shared with this one once computed)
    # -- what it has made, and the scheduler's state
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # how it ended (an answer's reason from the token that ended it)
    computed: int = 0  # positions (prompt, then tokens) whose keys and values are in the KV cache
    status: Status = Status.WAITING  # the scheduler's: set at admission, preemption and after each call
    logprobs: list[Logprob] = field(default_factory=list)  # one per token, when its sampling asks (Sampling.logprobs)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # one per prompt token after the first (echo)
    output: Detokenizer | None = field(default=None, repr=False)  # its text as it comes, stop strings found there
    #   (None: nobody reads its text, e.g. on a virtual clock)
    grammar: Any = field(default=None, repr=False)  # its ``models.grammar.Matcher``, advanced by each token it emits
    #   (None: unconstrained); a preempted sequence keeps it with its tokens
    # -- its times and counts, for /stats and the step log
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache, not computed (first admission)
    preemptions: int = 0  # times its blocks were taken back and it was requeued to be recomputed
    admitted_s: float = math.nan  # its first prefill started
    first_token_s: float = math.nan
    last_token_s: float = math.nan  # its latest token was made
    finished_s: float = math.nan  # its last token was made
    decode_calls: int = 0  # decode calls it took part in while generating
    decode_batch_sum: int = 0  # sum of those calls' sizes (for its mean batch)
    replica: str = ""  # behind a router: the replica generating it (known by its first token)
    prefilled_s: float = math.nan  # disaggregated: the prefill replica's first token reached the ingress
    transfer_ms: float = math.nan  # disaggregated: the decode replica's pull of its KV took this long
    settled: bool = False  # it has ended (``GenEngine.end``): counted, its blocks let go, its future settled
    _wake: asyncio.Future[None] | None = field(default=None, repr=False)

    prompt_ids = _asked("prompt_ids")
    max_new_tokens = _asked("max_new_tokens")
    enqueued_s = _asked("enqueued_s")
    ignore_eos = _asked("ignore_eos")
    request_id = _asked("request_id")
    sampling = _asked("sampling")
    stop = _asked("stop")
    min_tokens = _asked("min_tokens")
    priority = _asked("priority")
    tenant = _asked("tenant")
    cache_salt = _asked("cache_salt")

    @property
    def reserve(self) -> int:
        """KV-cache tokens this sequence may need: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def kv_tokens(self) -> int:
        """Its context: prompt and tokens made (the last one's KV is computed by the next step)."""
        return len(self.request.prompt_ids) + len(self.tokens)

    @property
    def context(self) -> list[int]:
        return self.request.prompt_ids + self.tokens

    @property
    def pending(self) -> int:
        """Tokens to compute before it can choose its next one (1 when it is decoding)."""
        return self.kv_tokens - self.computed

    @property
    def decoding(self) -> bool:
        """Its next call computes one token, its last, in a decode step: it is decoding, or finished and held (a
        static batch computes it as padding). A preempted sequence whose prefix cache hit leaves only its last
        token pending is prefilling, not decoding: the model has released it, so that token is a prefill."""
        return self.status is Status.DECODING or self.status is Status.FINISHED

    @property
    def finished(self) -> bool:
        """Its answer is made (a token ended it); static batching may still hold it in its batch."""
        return self.finish_reason is not None and self.finish_reason.answered

    @property
    def gone(self) -> bool:
        """Its future was settled by someone else (the client left) before it ended here."""
        return self.future.done() and not self.settled

    @property
    def wants_prompt_scores(self) -> bool:
        """Its prompt's log-probabilities are asked for (echo) and not all computed yet."""
        s = self.sampling
        return s is not None and s.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def may_end(self) -> bool:
        """EOS would end it now (not ignored, ``min_tokens`` made)."""
        return not self.ignore_eos and len(self.tokens) >= self.min_tokens

    def emit(self, token: int, now: float, eos_id: int | None, eos_ids: Collection[int] = (),
             logprob: Logprob | None = None) -> None:
        """Append a token; finish when its grammar is complete, on a stop string, max_new_tokens or EOS; wake whoever
        streams it.

        ``logprob``: the model's for the token it chose (kept when its sampling asks for them;
        NaN when the engine put another token in its place: ``EosStandIn``).
        ``eos_ids``: further tokens that end it as EOS does (a model whose config lists several).
        The token's text goes to ``output`` (decoded once, where stop strings are found).
        """
        if not self.tokens:
            self.first_token_s = now
            self.deadline_s = math.inf  # the deadline is for the first token: a preempted stream is not 504'd
        may_end = self.may_end
        self.last_token_s = now
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob if logprob.token == token else Logprob(token, math.nan))
        complete = self.grammar is not None and self.grammar.accept(token)  # its grammar ended with this token
        if (self.output is not None and self.output.push(token)) or complete:
            self.finish_reason = FinishReason.STOP
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif (token == eos_id or token in eos_ids) and may_end:
            self.finish_reason = FinishReason.EOS
        elif self.request.remote_decode:  # its KV goes to another engine, which makes the rest
            self.finish_reason = FinishReason.HAND_OVER
        if self.finished:
            self.finished_s = now
            if self.output is not None:
                self.output.finish()
        self.wake()

    def settle(self, reason: FinishReason, now: float, error: BaseException | None = None) -> None:
        """Ended for ``reason`` (``GenEngine.end`` calls this, and only it): its status, its end time, the rest of
        its text; its future settled with itself, or with ``error`` (unless someone settled it first: a client
        that left cancels it)."""
        status = status_of(reason)  # (first: a reason that is not a FinishReason fails here, nothing half-settled)
        self.settled = True
        self.finish_reason = self.finish_reason if self.finished else reason
        self.status = status
        if math.isnan(self.finished_s):
            self.finished_s = now
        if self.output is not None:
            self.output.finish()
        self.wake()
        if not self.future.done():
            if error is None:
                self.future.set_result(self)
            else:
                self.future.set_exception(error)

    def wake(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def next_change(self) -> asyncio.Future[None]:
        """A future that completes at the next token (on the event loop; wait on it with ``future``)."""
        if self._wake is None or self._wake.done():
            self._wake = asyncio.get_running_loop().create_future()
        return self._wake


class EosStandIn:
    """``Limits.eos_prob``: a stand-in for a trained model's end of answer, for models that never choose EOS
    (random weights). After each token that may end it, the token becomes EOS with this probability,
    drawn per position from the request's seed: the same request ends at the same token, preempted or not."""

    def __init__(self, prob: float) -> None:
        self.prob = prob

    def __call__(self, seq: Seq, token: int, eos_id: int | None) -> int:
        """The token to emit in place of ``token``."""
        if (self.prob and eos_id is not None and seq.may_end
                and random.Random(position_seed(seq.request.seed, seq.kv_tokens)).random() < self.prob):
            return eos_id
        return token
