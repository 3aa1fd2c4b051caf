"""Run a generation strategy on a virtual clock: the engine's own step loop, a synthetic model, scripted requests.

``simulate_gen(strategy, requests)`` feeds scripted requests (arrival, prompt tokens, new
tokens, ...) to ``StepEngine.step_loop`` with its scheduler and the strategy's own rules, and
charges ``synthetic-gen``'s costs to the virtual clock: every step it would run, instantly and
deterministically (the encoder strategies' counterpart is ``labserver.engine.virtual.simulate``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..models.synthetic import SyntheticGen
from ..strategies import Strategy
from .sequence import Request, Seq
from .speculation import DraftModel
from .step import StepEngine
from .virtual import VirtualFuture, VirtualQueue, drive

__all__ = ["GenSimRun", "GenVirtualQueue", "simulate_gen"]


class GenVirtualQueue(VirtualQueue):
    """Scripted generation requests: (arrival_s, prompt_tokens, max_new_tokens[, shared_prefix_tokens
    [, priority[, tenant]]]) each.

    Every prompt has its own tokens, except that the first ``shared_prefix_tokens`` of those
    that give it are the same for all of them (what a prefix cache can share). ``priority``
    (lower first) and ``tenant`` are what the ``x-priority`` and ``x-tenant`` headers carry.
    """

    def __init__(self, requests: Iterable[tuple[Any, ...]]) -> None:
        requests = sorted(requests, key=lambda r: r[0])
        super().__init__([r[0] for r in requests])
        self._shapes = deque((int(r[1]), int(r[2]), int(r[3]) if len(r) > 3 else 0, int(r[4]) if len(r) > 4 else 0,
                              str(r[5]) if len(r) > 5 else "") for r in requests)
        self.seqs: list[Any] = []  # every sequence created, in arrival order

    def advance(self, seconds: float) -> None:
        """The synthetic model's sleep: the clock moves by the cost of the call."""
        self.now_s += seconds

    def _admit(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s:
            t, _ = heapq.heappop(self._pending)
            prompt, new, shared, priority, tenant = self._shapes.popleft()
            sid = len(self.seqs) + 1
            ids = [1 + i for i in range(min(shared, prompt))]
            ids += [1 + (sid * 100_003 + i) % 49_999 for i in range(prompt - len(ids))]  # its own words
            seq = Seq(sid, Request(ids, new, t, priority=priority, tenant=tenant, seed=sid), VirtualFuture(self.clock))
            self.seqs.append(seq)
            self.line.put(seq)


@dataclass
class GenSimRun:
    steps: list[Any]  # CallRecord per model call
    seqs: list[Any]  # Seq per request: enqueued_s, admitted_s, first_token_s, finished_s, future.settled_s
    stats: dict[str, Any] = field(default_factory=dict)  # the engine's /stats at the end (preemptions, kv_blocks ...)

    def frames(self) -> tuple[Any, Any]:
        """(steps, requests) as DataFrames; requests have ttft_ms, queue_ms, answered_ms (arrival -> answer)."""
        import pandas as pd

        steps = pd.DataFrame([vars(s) for s in self.steps])
        rows = [{"sid": s.sid, "arrival_s": s.enqueued_s, "prompt_tokens": len(s.prompt_ids),
                 "max_new_tokens": s.max_new_tokens, "tokens": len(s.tokens), "cached_tokens": s.cached_tokens,
                 "preemptions": s.preemptions, "queue_ms": (s.admitted_s - s.enqueued_s) * 1000,
                 "ttft_ms": (s.first_token_s - s.enqueued_s) * 1000,
                 "finished_ms": (s.finished_s - s.enqueued_s) * 1000,
                 "answered_ms": (s.future.settled_s - s.enqueued_s) * 1000} for s in self.seqs]
        return steps, pd.DataFrame(rows)


def simulate_gen(strategy: Strategy, requests: Iterable[tuple[float, ...]], *, prefill_ms: float = 20.0,
                 step_ms: float = 10.0, per_token_ms: float = 0.0, per_seq_ms: float = 0.0,
                 kv_bytes_per_token: int = 0, draft: SyntheticGen | None = None) -> GenSimRun:
    """Every step a generation strategy would run for these requests, on one worker.

    ``requests`` are (arrival_s, prompt_tokens, max_new_tokens), optionally with a fourth,
    shared_prefix_tokens; the model is ``synthetic-gen`` (a prefill call costs
    ``prefill_ms + per_token_ms * tokens``, a decode step ``step_ms + per_seq_ms * sequences``),
    charged to the virtual clock; ``kv_bytes_per_token`` (a real model's, from its config) lets
    ``Limits.kv_memory_mb`` size the pool. It is the engine's own step loop (``StepEngine.step_loop``)
    and scheduler with the strategy's own rules (admission, composition, preemption, who
    leaves), KV blocks and ``Limits`` (``eos_prob`` included), run until every request is answered.

    ``draft`` (with ``Limits(speculative="draft", draft_model=...)``, the name only said): a synthetic
    draft model whose calls the clock charges too; ``SyntheticGen(..., right=a)`` guesses the
    target's token with probability a. A verification of k guesses costs the target a decode step of
    k + 1 sequences (``step_ms + per_seq_ms * (k + 1)``): speculation's price on the virtual clock.
    """
    q = GenVirtualQueue(requests)
    model = SyntheticGen(prefill_ms, step_ms, per_token_ms=per_token_ms, per_seq_ms=per_seq_ms, sleep=q.advance,
                         kv_bytes_per_token=kv_bytes_per_token)
    engine = StepEngine(strategy, model, clock=q.clock, queue=q)  # type: ignore[arg-type]
    if draft is not None:
        if engine.spec is None or engine.spec.method != "draft":
            raise ValueError("a draft needs a strategy with Limits(speculative='draft', draft_model=...)")
        draft.sleep = q.advance
        engine.spec.draft = DraftModel(draft, engine.blocks.total, engine.blocks.block_tokens)
    engine.accepting = True
    drive(engine.step_loop())
    return GenSimRun(list(engine.steps), q.seqs, engine.stats())
