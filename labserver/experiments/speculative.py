"""Runs that measure speculative decoding on a served model: what ``benchmarks/specperf.py`` and notebook 13 share.

Each run starts ``gen-continuous`` in this process on the given model object, with a kind of
speculation (``spec_options``: plain, ``ngram``, ``ngram`` off above a batch size, a draft
model), loads it, and returns its output tokens per second with what the engine counted
(``SPEC_STATS``, from ``/stats``, over the run):

- ``one_at_a_time``: prompts sent one after another (greedy chat answers, each ending at the
  model's EOS or ``max_tokens``); tokens per second of request time, a single stream's
  pace, and the answers' texts (the same prompts to two servers: were the answers equal?);
- ``closed_loop``: ``users`` closed-loop users for a window (the load generator); the window's
  output tokens per second, the server's throughput at that load;
- ``verify_cost``: a batch's step of k + 1 tokens a sequence (a verification) over its step of
  one, timed on the model alone: what the guesses cost, paid in full when they are rejected.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..models import Chunk

__all__ = ["SPEC_STATS", "acceptance", "closed_loop", "one_at_a_time", "spec_options", "verify_cost"]

SPEC_STATS = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_drafts", "spec_draft_ms", "spec_verify_ms",
              "tokens_generated")


def spec_options(kind: str, *, draft: str | None = None, off_above: int | None = None, k: int = 4) -> dict[str, Any]:
    """The server's knobs for a kind of run: ``plain``, ``ngram``, ``rule`` (ngram, off above ``off_above`` requests
    running or waiting), ``draft`` (the model ``draft`` guesses)."""
    if kind == "plain":
        return {}
    if kind == "draft":
        return {"speculative": "draft", "draft_model": draft, "num_speculative_tokens": k}
    if kind == "rule":
        return {"speculative": "ngram", "num_speculative_tokens": k, "speculative_disable_batch_size": off_above}
    if kind == "ngram":
        return {"speculative": "ngram", "num_speculative_tokens": k}
    raise ValueError(f"unknown kind of run {kind!r}: plain, ngram, rule or draft")


def _counters(h: Any) -> dict[str, float]:
    stats = h.stats()
    return {k: float(stats.get(k) or 0) for k in SPEC_STATS}


def one_at_a_time(gen: Any, prompts: list[str], max_tokens: int, **options: Any) -> dict[str, Any]:
    """Each prompt alone, in order, as a greedy chat answer: output tokens per second of request time, the answers'
    texts, and the counters over the prompts (a first "Hello" warms the server up, outside them)."""
    import httpx

    from .. import wire
    from ..launch import serve

    with serve("gen-continuous", gen, device="cpu", max_batch_size=8, timeout_ms=None, **options) as h:
        url = h.url + wire.V1_CHAT_PATH
        body = {"model": gen.name, "max_tokens": max_tokens, "temperature": 0.0}
        httpx.post(url, json={**body, "messages": [{"role": "user", "content": "Hello"}]}, timeout=600)
        before = _counters(h)
        tokens, seconds, answers = 0, 0.0, []
        for p in prompts:
            t = time.perf_counter()
            r = httpx.post(url, json={**body, "messages": [{"role": "user", "content": p}]}, timeout=600)
            seconds += time.perf_counter() - t
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
            answers.append(r.json()["choices"][0]["message"]["content"])
        after = _counters(h)
    return {"tps": tokens / seconds, "tokens": tokens, "seconds": seconds, "answers": answers,
            **{k: after[k] - before[k] for k in SPEC_STATS}}


def closed_loop(gen: Any, prompts: list[str], users: int, max_tokens: int, *, warmup_s: float, duration_s: float,
                seed: int = 0, **options: Any) -> dict[str, Any]:
    """``users`` closed-loop users asking ``prompts`` (greedy chat, streamed): output tokens/s in the window after
    ``warmup_s``, and the counters over the whole run."""
    from ..launch import serve
    from ..loadgen import run_load_sync

    with serve("gen-continuous", gen, device="cpu", max_batch_size=users, max_queue=100_000, timeout_ms=None,
               **options) as h:
        before = _counters(h)
        result = run_load_sync(h.url, api="openai-chat", model=gen.name, users=users, payload=prompts,
                               new_tokens=max_tokens, ignore_eos=False, stream=True, warmup_s=warmup_s,
                               duration_s=warmup_s + duration_s, seed=seed, timeout_s=600, progress=False)
        after = _counters(h)
    t = result.tokens["t_s"]  # every token event the clients received, s from the start
    tps = float(((t > warmup_s) & (t <= warmup_s + duration_s)).sum() / duration_s)
    return {"tps": tps, "users": users, **{k: after[k] - before[k] for k in SPEC_STATS}}


def verify_cost(gen: Any, k: int, seqs: int = 1, context: int = 160, repeats: int = 15) -> dict[str, float]:
    """``seqs`` sequences at ``context`` tokens: their step of k + 1 tokens each (a verification of k guesses) and
    their step of one each, ms (medians of ``repeats``), and the ratio: what a step's guesses cost at that batch."""
    per = -(-(context + 1) // 16)
    gen.allocate_kv(per * seqs, 16)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(seqs)]
    ids = [[(7 * i + 3 * s) % 1000 + 10 for i in range(context)] for s in range(seqs)]
    gen.forward([Chunk(s + 1, ids[s], 0, tables[s]) for s in range(seqs)])

    def ms(n: int) -> float:
        chunks = [Chunk(s + 1, ids[s][-n:], context - n, tables[s], decode=True, draft=n - 1) for s in range(seqs)]
        gen.forward(chunks)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            gen.forward(chunks)  # (the same positions again: their KV rewritten, the cost a step has)
            times.append(time.perf_counter() - t)
        return 1000 * statistics.median(times)

    one, many = ms(1), ms(k + 1)
    gen.release([s + 1 for s in range(seqs)])
    return {"one_ms": one, "verify_ms": many, "ratio": many / one, "k": k, "seqs": seqs}


def acceptance(m: dict[str, Any]) -> str:
    """A run's speculation in words: acceptance rate, guesses kept of proposed, tokens a verification made."""
    proposed, drafts = m["spec_proposed_tokens"], m["spec_drafts"]
    if not proposed:
        return "nothing proposed"
    return (f"acceptance {m['spec_accepted_tokens'] / proposed:.0%} ({m['spec_accepted_tokens']:.0f} of "
            f"{proposed:.0f} guessed), {1 + m['spec_accepted_tokens'] / drafts:.2f} tokens a verification")
