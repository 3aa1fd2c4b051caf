"""What every rule shares: the knobs (``Limits``), the base class, the registry by name.

The rules themselves are in ``labserver.strategies.encode`` (encoders: when a batch
leaves) and ``labserver.strategies.generate`` (gen-*: who joins the running batch);
``labserver.strategies`` gathers them all. Nothing here knows HTTP, Starlette or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from .queueing import DOORS, make_discipline, make_door
from ..registry import registrar
from .steps import PREFILLS

SPECULATIVE = ("ngram", "draft")  # the proposers speculative decoding has (labserver.engine.speculation)

__all__ = ["STRATEGIES", "Admission", "Batch", "Clock", "Limits", "Queue", "Strategy", "describe", "make_strategy",
           "register", "strategy_names"]

# -- what a rule sees ----------------------------------------------------------------------


class Queue(Protocol):
    async def get(self, timeout_s: float | None = None) -> Any: ...  # the next request; None after timeout_s

    def empty(self) -> bool: ...

    def putback(self, item: Any) -> None: ...  # back to the head: it goes first next time

    def waiting(self) -> list[Any]: ...  # every live request, in arrival order, left in the queue

    def take(self, items: list[Any]) -> None: ...  # remove these (read from waiting()): they were admitted


Clock = Callable[[], float]
Batch = tuple[list[Any], str]  # (items, dispatch reason)


class Admission(NamedTuple):
    """A generation rule's answer at a step boundary."""

    joining: list[Any]  # sequences to prefill now
    reason: str  # why (counted in prefill_reasons)
    preempt: Sequence[Any] = ()  # running sequences that make room for them (requeued, recomputed later)


@dataclass
class Limits:
    max_batch_size: int | None = 32  # items per model call (gen-*: sequences running together); None = no cap
    max_wait_ms: float = 1.0  # how long a batch may wait for company, ms
    max_queue: int | None = None  # queued requests before new ones get 503; None = unbounded
    timeout_ms: float | None = None  # per-request deadline from arrival, ms; None = none
    idle_dispatch: bool = True  # dispatch at once when nothing else is queued (deadline, thread)
    target_ms: float = 100.0  # slo: the latency target (an SLO), ms; a batch may spend part of it waiting
    max_batch_tokens: int | None = None  # encoders: a batch's padded tokens (longest x count) at most this; None =
    #   no budget (the tokens rule then takes its own default); one text over it is served alone
    # generation only (gen-* strategies)
    max_kv_tokens: int | None = None  # KV-cache tokens the running sequences may hold; None (and no kv_memory_mb):
    #   max_batch_size (at most 64) x the model's context (at most 2,048)
    kv_memory_mb: float | None = None  # KV-cache memory, MiB: the pool holds as many positions as fit, at the
    #   model's bytes per position (layers x 2 x KV heads x head size x dtype); with max_kv_tokens, the smaller
    kv_block_tokens: int = 16  # tokens per KV block: the unit KV memory is taken and given back in
    prefix_cache: bool = False  # prompts that begin alike share their KV blocks (whole blocks, keyed by tokens)
    cuda_graphs: bool = False  # decode steps replayed from CUDA graphs, padded to buckets (a GPU only:
    #   labserver.models.graphs)
    compile: bool | str = False  # decode steps (one sequence's, a batch's) compiled by torch.compile at startup,
    #   cached (labserver.models.graphs.CompiledDecode); "auto" (the server's default, --compile auto): where they
    #   can compile (labserver's own model on a CPU, a C++ compiler), and eager if the compile fails
    prefill: str = "eager"  # gen-continuous, gen-paged: "eager" prefills whole prompts between two steps; "budget"
    #   at most max_prefill_tokens of them; "chunked" pieces of prompts inside each step, max_step_tokens in all
    max_prefill_tokens: int = 512  # prompt tokens prefilled between two decode steps under prefill="budget"
    max_step_tokens: int = 256  # tokens one step computes under prefill="chunked": a decode's 1 each, then prompts
    eos_prob: float = 0.0  # a stand-in for a trained model's EOS: each token ends its answer with this probability
    # speculative decoding (gen-continuous, gen-paged: labserver.engine.speculation)
    speculative: str | None = None  # None: off; "ngram": prompt lookup; "draft": a draft model's guesses
    num_speculative_tokens: int = 4  # k: tokens guessed, then verified in one step with the last one (k + 1)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix of the context looked up earlier in it
    prompt_lookup_max: int = 4  # ngram: the longest (tried first)
    speculative_disable_batch_size: int | None = None  # no guesses while more than this many requests run or
    #   wait (vLLM's disable_by_batch_size); None: always
    draft_model: str | None = None  # draft: the model that guesses, NAME or NAME:DTYPE, with the target's tokenizer
    handover_timeout_s: float = 30.0  # disaggregated serving: a prefill's KV not pulled by a decode replica within
    #   this is freed (labserver.engine.handover)
    # under overload (labserver.strategies.queueing, .scheduling): who goes first, who is refused
    queue: str = "fifo"  # queue discipline within a priority class: fifo, lifo, adaptive-lifo, codel
    codel_target_ms: float = 5.0  # codel: while a queue stands, shed whoever waited longer than this
    codel_interval_ms: float = 100.0  # a queue "stands" when it has not been empty for this long
    admit: str = "all"  # "deadline": refuse at once a request whose timeout_ms cannot be met (503)
    scheduling: str = "fcfs"  # generation: fcfs, priority (preempts a lower class), fair (per tenant), slo
    ttft_targets_ms: dict[int, float] | None = None  # slo: time-to-first-token target per priority class
    tpot_targets_ms: dict[int, float] | None = None  # slo: time-per-output-token target per priority class

    def __post_init__(self) -> None:
        for name, ok, rule in (
            ("max_batch_size", self.max_batch_size is None or self.max_batch_size >= 1, ">= 1 or None"),
            ("max_wait_ms", self.max_wait_ms >= 0, ">= 0"),
            ("max_queue", self.max_queue is None or self.max_queue >= 1, ">= 1 or None"),
            ("timeout_ms", self.timeout_ms is None or self.timeout_ms > 0, "> 0 or None"),
            ("target_ms", self.target_ms > 0, "> 0"),
            ("max_batch_tokens", self.max_batch_tokens is None or self.max_batch_tokens >= 1, ">= 1 or None"),
            ("kv_block_tokens", self.kv_block_tokens >= 1, ">= 1"),
            ("max_kv_tokens", self.max_kv_tokens is None or self.max_kv_tokens >= self.kv_block_tokens,
             f">= kv_block_tokens ({self.kv_block_tokens}: one block) or None"),
            ("kv_memory_mb", self.kv_memory_mb is None or self.kv_memory_mb > 0, "> 0 or None"),
            ("compile", self.compile in (True, False, "auto"), "True, False or 'auto'"),
            ("prefill", self.prefill in PREFILLS, " or ".join(map(repr, PREFILLS))),
            ("max_prefill_tokens", self.max_prefill_tokens >= 1, ">= 1"),
            ("max_step_tokens", self.max_step_tokens >= 1, ">= 1"),
            ("eos_prob", 0 <= self.eos_prob < 1, "in [0, 1)"),
            ("speculative", self.speculative in (None, *SPECULATIVE), " or ".join(map(repr, (None, *SPECULATIVE)))),
            ("num_speculative_tokens", self.num_speculative_tokens >= 1, ">= 1"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, ">= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             f">= prompt_lookup_min ({self.prompt_lookup_min})"),
            ("speculative_disable_batch_size", self.speculative_disable_batch_size is None
             or self.speculative_disable_batch_size >= 0, ">= 0 or None"),
            ("draft_model", self.speculative != "draft" or bool(self.draft_model),
             "a model spec with speculative='draft' (the model that guesses)"),
            ("handover_timeout_s", self.handover_timeout_s > 0, "> 0"),
            ("codel_target_ms", self.codel_target_ms > 0, "> 0"),
            ("codel_interval_ms", self.codel_interval_ms > 0, "> 0"),
            ("admit", self.admit in DOORS, " or ".join(map(repr, DOORS))),
            ("admit", not (self.admit in DOORS and DOORS[self.admit].needs_timeout) or self.timeout_ms is not None,
             "a rule that keeps no deadline unless timeout_ms is set (the deadline it keeps)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        misfit = PREFILLS[self.prefill].misfit(self)
        if misfit:
            raise ValueError(misfit)

    @property
    def cap(self) -> float:
        return math.inf if self.max_batch_size is None else self.max_batch_size


# -- the registry ---------------------------------------------------------------------------

STRATEGIES: dict[str, type[Strategy]] = {}  # every rule by name, encoders and gen-*


register = registrar(STRATEGIES, "strategy")


def strategy_names(kind: str | None = None) -> list[str]:
    """Registered names (of one kind, "encode" or "generate", or all): what the CLI offers."""
    return [name for name, cls in STRATEGIES.items() if kind is None or cls.kind == kind]


def describe(name: str) -> str:
    """A strategy's one-line description: the first line of its docstring."""
    doc = (STRATEGIES[name].__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def make_strategy(name: str | type[Strategy] | Strategy, limits: Limits | None = None) -> Strategy:
    """A strategy from its name (or class, or an instance, returned as is)."""
    if isinstance(name, Strategy):
        return name
    if isinstance(name, type):
        return name(limits)
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return cls(limits)


class Strategy:
    name: ClassVar[str] = ""
    offload: ClassVar[bool] = False  # True: the model runs on its own thread, the loop stays free
    kind: ClassVar[str] = "encode"  # "encode" | "generate": which engine and which endpoint serve it
    paged: ClassVar[bool] = True  # generation: labserver's own forward pass runs the model (gen-hf-cb: transformers')

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.discipline = make_discipline(self.limits)  # who the queue hands out next, and who it sheds
        self.door = make_door(self.limits)  # who may queue at all (admit=)

    @property
    def batch_cap(self) -> float:
        """The most items one of its batches holds (what ``admit="deadline"`` expects a batch to carry)."""
        return self.limits.cap

    @property
    def batch_tokens(self) -> float:
        """The most padded tokens (longest x count) one of its batches holds: ``max_batch_tokens``, else no limit."""
        return math.inf if self.limits.max_batch_tokens is None else self.limits.max_batch_tokens

    async def collect(self, queue: Queue, clock: Clock) -> Batch:
        raise NotImplementedError

    def trim(self, batch: list[Any]) -> tuple[list[Any], list[Any]]:
        """The batch cut to the token budget, and the rest (which the engine puts back at the queue's head).

        Items are kept in the order collected while the padded cost, the longest x the count, stays within
        ``batch_tokens``; the first is always kept, so a text longer than the budget is served alone.
        An item's ``tokens`` is what the model computes for it (0 when the model cannot count).
        """
        budget = self.batch_tokens
        if math.isinf(budget) or len(batch) < 2:
            return batch, []
        longest = batch[0].tokens
        for n, item in enumerate(batch[1:], start=2):
            longest = max(longest, item.tokens)
            if longest * n > budget:
                return batch[:n - 1], batch[n - 1:]
        return batch, []

    def fit(self, batch: list[Any], reason: str, queue: Queue) -> Batch:
        """``trim`` applied: the rest back at the queue's head, in their order, and the reason "tokens" if any was."""
        batch, rest = self.trim(batch)
        if not rest:
            return batch, reason
        for item in reversed(rest):
            queue.putback(item)
        return batch, "tokens"

    def observe(self, size: int, compute_ms: float) -> None:
        """Called after every batch with its size and model time; a rule that learns costs uses it."""


