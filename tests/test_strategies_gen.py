"""Generation strategies on a virtual clock: the engine's own step loop, no HTTP, no torch, no sleeping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from labserver.strategies import STRATEGIES, Limits
from labserver.strategies import make_strategy, strategy_names
from labserver.strategies.steps import PREFILLS
from labserver.engine.gensim import GenSimRun, simulate_gen
from labserver.engine.ending import FinishReason

LOCAL = ["gen-naive", "gen-static", "gen-continuous", "gen-paged"]  # the ones with a step log (gen-hf-cb runs transformers)


def sim(name: str, requests: list[tuple[float, int, int]], **limits: object) -> GenSimRun:
    return simulate_gen(make_strategy(name, Limits(**limits)), requests, prefill_ms=20, step_ms=10)  # type: ignore[arg-type]


def mixed(n: int = 24, span_s: float = 2.0, seed: int = 0) -> list[tuple[float, int, int]]:
    """n requests arriving uniformly over span_s, prompts of 4-39 tokens, outputs of 16-256."""
    rng = np.random.default_rng(seed)
    return [(float(t), int(p), int(k)) for t, p, k in
            zip(np.sort(rng.uniform(0, span_s, n)), rng.integers(4, 40, n), rng.integers(16, 257, n))]


def decode_calls(run: GenSimRun) -> list:
    return [s for s in run.steps if len(s.decoding) == len(s.seqs)]


def test_registry_keeps_generation_apart() -> None:
    generate = strategy_names("generate")
    assert set(generate) == {"gen-naive", "gen-static", "gen-continuous", "gen-paged", "gen-hf-cb"}
    assert not set(generate) & set(strategy_names("encode"))
    assert all(make_strategy(name).kind == "generate" and make_strategy(name).offload for name in generate)


@pytest.mark.parametrize("name", LOCAL)
def test_every_request_gets_exactly_its_tokens(name: str) -> None:
    requests = mixed()
    run = sim(name, requests, max_batch_size=8)
    assert [len(s.tokens) for s in run.seqs] == [k for _, _, k in requests]
    assert all(s.finish_reason is FinishReason.LENGTH and s.future.done() and s.future.error is None for s in run.seqs)
    # each sequence is in exactly one prefill and in (its tokens - 1) decode steps while generating
    for s in run.seqs:
        assert sum(s.sid in step.seqs for step in run.steps if not step.decoding) == 1
        working = [st for st in decode_calls(run) if s.sid in st.seqs and s.sid not in st.idle]
        assert len(working) == len(s.tokens) - 1


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("cap, kv", [(4, None), (32, 600), (8, 2000)])
def test_caps_are_respected(name: str, cap: int, kv: int | None) -> None:
    run = sim(name, mixed(40), max_batch_size=cap, max_kv_tokens=kv)
    assert max(len(s.seqs) for s in decode_calls(run)) <= cap
    if kv is not None:
        if name != "gen-paged":  # the reserving rules: prompt + max_new_tokens of all running fit the budget
            assert max(s.kv_reserved for s in run.steps) <= kv
        assert max(s.kv_tokens for s in run.steps) <= kv
        assert max(s.blocks_used for s in run.steps) * Limits().kv_block_tokens <= kv
    assert all(s.finished for s in run.seqs)


def test_naive_runs_one_request_at_a_time() -> None:
    run = sim("gen-naive", mixed(10))
    assert {len(s.seqs) for s in run.steps} == {1}
    order = [s.seqs[0] for s in run.steps if not s.decoding]
    assert order == sorted(order)  # first come, first served


def test_continuous_joins_at_the_next_step_boundary() -> None:
    # one long sequence decoding; a second request arrives in the middle of a decode step
    run = sim("gen-continuous", [(0.0, 8, 100), (0.0555, 8, 5)], max_batch_size=8)
    late = run.seqs[1]
    boundary = min(s.end_s for s in run.steps if s.end_s >= late.enqueued_s)
    assert late.admitted_s == pytest.approx(boundary)  # prefilled right after the step it arrived during
    prefill = next(s for s in run.steps if not s.decoding and late.sid in s.seqs)
    after = [s for s in decode_calls(run) if s.start_s >= prefill.end_s][0]
    assert set(after.seqs) == {1, 2}  # merged into the running batch at once
    # the long one kept decoding: it waited one prefill, not for the newcomer's whole generation
    assert run.seqs[0].finished_s < 0.02 + 100 * 0.01 + 0.02 + 0.001


def test_continuous_leaves_at_once_static_holds_until_the_longest() -> None:
    requests = [(0.0, 8, 10), (0.0, 8, 50)]
    cont, static = sim("gen-continuous", requests, max_batch_size=8), sim("gen-static", requests, max_batch_size=8)
    short_c, short_s = cont.seqs[0], static.seqs[0]
    assert short_c.finished_s == pytest.approx(short_s.finished_s)  # same steps until it is done
    # continuous: answered as it finishes and in no step after; static: computed as padding and held
    assert short_c.future.settled_s == pytest.approx(short_c.finished_s)
    assert not any(short_c.sid in s.seqs for s in decode_calls(cont) if s.start_s >= short_c.finished_s)
    idle_steps = [s for s in decode_calls(static) if short_s.sid in s.idle]
    assert len(idle_steps) == 40  # 50 - 10 steps computed for nobody
    assert short_s.future.settled_s == pytest.approx(static.seqs[1].finished_s)


def test_static_nobody_joins_a_batch_in_flight() -> None:
    run = sim("gen-static", [(0.0, 8, 60), (0.1, 8, 5), (0.2, 8, 5)], max_batch_size=8)
    first_batch_end = run.seqs[0].finished_s
    assert run.seqs[1].admitted_s >= first_batch_end and run.seqs[2].admitted_s >= first_batch_end
    # the two that waited form the next batch together (both queued when the model freed up)
    assert run.seqs[1].admitted_s == run.seqs[2].admitted_s


def test_static_uses_the_deadline_rule() -> None:
    requests = [(0.0, 8, 5), (0.0005, 8, 5), (0.003, 8, 5)]
    waits = simulate_gen(make_strategy("gen-static", Limits(max_batch_size=8, max_wait_ms=2, idle_dispatch=False)),
                         requests, prefill_ms=20, step_ms=10)
    first = next(s for s in waits.steps if not s.decoding)
    assert first.seqs == (1, 2) and first.start_s == pytest.approx(0.002)  # due 2 ms after the first item
    eager = sim("gen-static", requests, max_batch_size=8, max_wait_ms=2)
    assert next(s for s in eager.steps if not s.decoding).seqs == (1,)  # idle dispatch: nobody else queued


def test_continuous_beats_static_on_mixed_lengths() -> None:
    requests = mixed(48, span_s=10.0)  # 4.8 requests/s: about what static batches of 8 can carry here
    static, cont = sim("gen-static", requests, max_batch_size=8), sim("gen-continuous", requests, max_batch_size=8)
    assert sum(len(s.idle) for s in decode_calls(static)) > 0
    assert sum(len(s.idle) for s in decode_calls(cont)) == 0
    assert cont.steps[-1].end_s < 0.75 * static.steps[-1].end_s  # the same work, much sooner
    ttft = {name: np.percentile([(s.first_token_s - s.enqueued_s) for s in run.seqs], 90)
            for name, run in (("static", static), ("cont", cont))}
    assert ttft["cont"] < 0.5 * ttft["static"]


def test_fifo_admission_no_starvation_under_a_kv_budget() -> None:
    # budget 300: the big request (20 + 250) only fits once the running small ones leave
    requests = [(0.0, 10, 100), (0.0, 10, 100), (0.001, 20, 250)] + [(0.002 + i * 0.001, 10, 20) for i in range(30)]
    run = sim("gen-continuous", requests, max_batch_size=8, max_kv_tokens=300)
    big = run.seqs[2]
    later = run.seqs[3:]
    assert all(s.admitted_s >= big.admitted_s for s in later)  # nobody overtook it
    assert big.finished and all(s.finished for s in later)


def test_prefill_budget_spreads_prompts_over_steps() -> None:
    requests = [(0.0, 8, 200)] + [(0.05, 100, 10)] * 6
    eager = sim("gen-continuous", requests, max_batch_size=16)
    budget = sim("gen-continuous", requests, max_batch_size=16, prefill="budget", max_prefill_tokens=200)
    sizes = [len(s.seqs) for s in budget.steps if not s.decoding][1:]
    assert max(sizes) <= 2 and sum(sizes) == 6  # at most 200 prompt tokens per boundary: 2 prompts of 100
    assert [len(s.seqs) for s in eager.steps if not s.decoding][1:] == [6]
    # the running stream is never stalled for more than one (smaller) prefill between two steps
    long_steps = [s for s in budget.steps if 1 in s.seqs]
    gaps = np.diff([s.start_s for s in long_steps])
    assert gaps.max() <= 0.010 + 0.020 + 1e-9


def test_prefill_budget_admits_a_prompt_larger_than_the_budget_alone() -> None:
    run = sim("gen-continuous", [(0.0, 500, 5)], prefill="budget", max_prefill_tokens=100)
    assert run.seqs[0].finished


# -- KV memory: reservation against paging, chunked prefill ------------------------------------


def eos_requests(n: int = 160, rate: float = 20.0, seed: int = 0) -> list[tuple[float, int, int]]:
    """n requests asking 512 tokens each, prompts of 20-59 tokens, arriving faster than either rule serves."""
    rng = np.random.default_rng(seed)
    return [(float(t), int(p), 512) for t, p in zip(np.cumsum(rng.exponential(1 / rate, n)), rng.integers(20, 60, n))]


def test_paging_runs_more_sequences_in_the_same_memory() -> None:
    limits = {"max_batch_size": 64, "max_kv_tokens": 4096, "eos_prob": 1 / 128}
    reserved, paged = sim("gen-continuous", eos_requests(), **limits), sim("gen-paged", eos_requests(), **limits)
    assert [len(s.tokens) for s in paged.seqs] == [len(s.tokens) for s in reserved.seqs]  # the same answers
    assert 64 < np.mean([len(s.tokens) for s in paged.seqs]) < 192  # asked 512, stopped near 128
    size = {name: np.mean([len(s.seqs) for s in decode_calls(run)]) for name, run in (("r", reserved), ("p", paged))}
    assert size["p"] > 2 * size["r"]  # reservation holds 4096 / (40 + 512): about 7
    assert paged.steps[-1].end_s < 0.6 * reserved.steps[-1].end_s
    assert reserved.stats["preemptions"] == 0 < paged.stats["preemptions"]
    assert max(s.blocks_used for s in paged.steps) == 256  # it used the whole pool...
    assert max(s.blocks_used for s in reserved.steps) < 0.5 * 256  # ...reservation never got near it


def test_paging_keeps_first_come_first_served() -> None:
    run = sim("gen-paged", eos_requests(60), max_batch_size=64, max_kv_tokens=2048, eos_prob=1 / 64)
    first = {s.sid: s.admitted_s for s in run.seqs}
    assert [sid for sid, _ in sorted(first.items(), key=lambda kv: (kv[1], kv[0]))] == sorted(first)
    assert all(s.finished for s in run.seqs)


def test_chunked_prefill_never_stalls_the_running_streams_for_a_whole_prompt() -> None:
    requests = [(0.0, 8, 300), (0.0, 8, 300), (0.5, 1000, 5)]
    costs = {"prefill_ms": 5, "step_ms": 10, "per_token_ms": 0.2}
    eager = simulate_gen(make_strategy("gen-continuous", Limits(max_batch_size=8)), requests, **costs)
    chunked = simulate_gen(make_strategy("gen-continuous", Limits(max_batch_size=8, prefill="chunked",
                                                                  max_step_tokens=128)), requests, **costs)

    def worst_gap(run: GenSimRun) -> float:
        return max(np.diff([s.end_s for s in run.steps if 1 in s.seqs and 1 not in s.prefilling]))

    assert worst_gap(eager) > 0.2  # the 1000-token prefill: 5 + 200 ms, the streams wait all of it
    assert worst_gap(chunked) < 0.05  # at most 126 prompt tokens ride along in each step
    assert max(s.tokens for s in chunked.steps) <= 128
    assert [s.tokens for s in chunked.seqs] == [s.tokens for s in eager.seqs]


def test_a_shared_prefix_on_the_virtual_clock_is_prefilled_once() -> None:
    requests = [(i * 0.2, 600, 4, 512) for i in range(10)]  # 512 shared tokens, then 88 of its own
    costs = {"prefill_ms": 5, "step_ms": 10, "per_token_ms": 0.2}
    plain = simulate_gen(make_strategy("gen-continuous", Limits()), requests, **costs)
    cached = simulate_gen(make_strategy("gen-continuous", Limits(prefix_cache=True)), requests, **costs)
    ttft = {name: [s.first_token_s - s.enqueued_s for s in run.seqs] for name, run in (("p", plain), ("c", cached))}
    assert [s.cached_tokens for s in cached.seqs] == [0] + [512] * 9
    assert np.median(ttft["c"][1:]) < 0.3 * np.median(ttft["p"][1:])
    assert cached.stats["prefix_hit_rate"] == pytest.approx(9 * 512 / 6000)


def docs_rule(k: int = 0) -> str:
    """Code block ``k`` of docs/generation.md's "Write your own rule": the docs cannot drift from what runs."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "generation.md").read_text()
    section = text[text.index("### Write your own rule"):]
    for _ in range(k):
        section = section[section.index("```\n", section.index("```python")) + 4:]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]


def test_the_docs_prefill_rule_is_one_class_and_composes_one_prompt_at_a_time() -> None:
    saved = dict(PREFILLS)
    try:
        exec(compile(docs_rule(1), "docs/generation.md", "exec"), {})  # registers it, as a user's module would
        one = make_strategy("gen-continuous", Limits(max_batch_size=8, prefill="one-prompt", max_step_tokens=64))
    finally:
        PREFILLS.clear()
        PREFILLS.update(saved)
    # two streams run; then four prompts of 200 tokens arrive together
    requests = [(0.0, 8, 80), (0.0, 8, 80)] + [(0.05, 200, 10) for _ in range(4)]
    costs = {"prefill_ms": 5, "step_ms": 10, "per_token_ms": 0.2}
    chunked = simulate_gen(make_strategy("gen-continuous", Limits(max_batch_size=8, prefill="chunked",
                                                                  max_step_tokens=64)), requests, **costs)
    ours = simulate_gen(one, requests, **costs)
    assert all(len(step.prefilling) <= 1 for step in ours.steps)  # one prompt at a time
    assert max(len(step.prefilling) for step in chunked.steps) > 1
    assert all(step.tokens <= 64 for step in ours.steps)
    assert [len(s.tokens) for s in ours.seqs] == [k for _, _, k in requests]  # everyone answered in full
    first = {name: min(s.first_token_s for s in run.seqs[2:]) for name, run in (("c", chunked), ("o", ours))}
    assert first["o"] < first["c"]  # the burst's first answer starts sooner


def test_the_docs_new_rule_is_one_class_and_runs_on_the_virtual_clock() -> None:
    saved = dict(STRATEGIES)
    try:
        scope: dict[str, object] = {}
        exec(compile(docs_rule(), "docs/generation.md", "exec"), scope)  # registers it, as a user's module would
        assert "gen-spf" in strategy_names("generate")
        spf = make_strategy("gen-spf", Limits(max_batch_size=2))
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(saved)
    # two long answers hold both places; then one long prompt arrives, followed by four short ones
    requests = [(0.0, 8, 60), (0.0, 8, 60), (0.1, 400, 10)] + [(0.1 + 0.01 * k, 6, 10) for k in range(1, 5)]
    costs = {"prefill_ms": 5, "step_ms": 10, "per_token_ms": 0.5}
    fifo = simulate_gen(make_strategy("gen-continuous", Limits(max_batch_size=2)), requests, **costs)
    short_first = simulate_gen(spf, requests, **costs)

    def admitted(run: GenSimRun) -> list[int]:  # the late five, by when they were admitted
        return [s.sid for s in sorted(run.seqs[2:], key=lambda s: s.admitted_s)]

    assert admitted(fifo) == [3, 4, 5, 6, 7]  # first come, first served
    assert admitted(short_first) == [4, 5, 6, 7, 3]  # the long prompt goes last
    assert [len(s.tokens) for s in short_first.seqs] == [k for _, _, k in requests]  # everyone answered in full
    ttft = {name: np.mean([s.first_token_s - s.enqueued_s for s in run.seqs[3:]])
            for name, run in (("fifo", fifo), ("spf", short_first))}
    assert ttft["spf"] < 0.8 * ttft["fifo"]  # the short ones no longer wait behind the long prefill
