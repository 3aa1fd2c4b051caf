"""Batches by tokens: the budget any rule can use, the ``tokens`` rule, padding counted; exact on a
virtual clock, then on a real server (``synthetic`` with a per-token cost, and ``minilm``)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest

import labserver
from labserver import wire
from labserver.engine.virtual import simulate
from labserver.models import load_model, parse_synthetic
from labserver.strategies import Limits, make_strategy

COST = lambda n, longest: 1.0 + 0.01 * n * longest  # noqa: E731: ms, padding included


def long_tailed(n: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """n arrivals within 0.2 s (a backlog: the rule has a queue to choose from), lognormal lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0, 0.2, n))
    tokens = np.clip(np.rint(rng.lognormal(np.log(20), 1.1, n)), 3, 400).astype(int).tolist()
    return arrivals, tokens


def test_trim_keeps_the_order_within_the_budget_and_the_first_always() -> None:
    s = make_strategy("thread", Limits(max_batch_tokens=100))
    items = [SimpleNamespace(tokens=t) for t in (10, 30, 20, 40, 5)]
    kept, rest = s.trim(items)
    assert [i.tokens for i in kept] == [10, 30, 20]  # 3 x 30 = 90; a fourth makes 4 x 40 = 160
    assert rest == items[3:]
    alone = [SimpleNamespace(tokens=500), SimpleNamespace(tokens=1)]
    assert s.trim(alone) == ([alone[0]], [alone[1]])  # over the budget: served alone, never refused
    assert make_strategy("thread").trim(items) == (items, [])  # no budget: nothing cut


@pytest.mark.parametrize("name", ["tokens", "thread", "deadline", "per-fetch", "adaptive", "slo"])
def test_no_batch_over_budget_and_every_text_served_once(name: str) -> None:
    arrivals, tokens = long_tailed(2000)
    run = simulate(make_strategy(name, Limits(max_batch_size=64, max_batch_tokens=1024)), arrivals, COST,
                   tokens=tokens)
    assert sum(run.sizes) == 2000 and len(run.latencies_ms) == 2000
    assert all(o.status == 200 for o in run.outcomes)
    for b in run.batches:
        assert b.padded_tokens <= 1024 or b.size == 1  # a lone text may be longer than the budget
    assert sum(b.tokens for b in run.batches) == sum(tokens)
    over = [t for t in tokens if t > 1024]
    assert len([b for b in run.batches if b.padded_tokens > 1024]) == len(over)


def test_tokens_rule_pads_little_where_the_count_rule_pads_much() -> None:
    arrivals, tokens = long_tailed(3000)

    def waste(name: str, **limits: object) -> tuple[float, float]:
        run = simulate(make_strategy(name, Limits(**limits)), arrivals, COST, tokens=tokens)
        padded = sum(b.padded_tokens for b in run.batches)
        end_s = run.batches[-1].dispatched_s + run.batches[-1].compute_ms / 1000
        return (padded - sum(b.tokens for b in run.batches)) / padded, end_s

    count_waste, count_end = waste("thread", max_batch_size=32)
    token_waste, token_end = waste("tokens", max_batch_size=32)
    assert count_waste > 0.6 and token_waste < 0.15
    assert token_end < count_end / 2  # the same backlog, half the time or less


def test_the_shortest_anchors_until_the_oldest_is_overdue_then_the_oldest_does() -> None:
    """At every dispatch: the oldest waiting text leaves if it has waited the age bound, else the shortest
    does; so no text waits past the bound once it is the oldest, plus the batch in the model."""
    from labserver.strategies import Tokens

    arrivals, tokens = long_tailed(1500, seed=3)
    run = simulate(make_strategy("tokens", Limits(max_batch_size=16)), arrivals, COST, tokens=tokens)
    frame = run.frame().assign(tokens=tokens)
    bound_s = Tokens.age_bound_ms / 1000
    overdue_seen = 0
    for b in run.batches:
        waiting = frame[(frame.arrival_s <= b.dispatched_s) & (frame.left_s >= b.dispatched_s)]
        oldest = waiting.sort_values("arrival_s", kind="stable").iloc[0]
        if b.dispatched_s - oldest.arrival_s >= bound_s:
            overdue_seen += 1
            assert oldest.left_s == b.dispatched_s
        else:
            assert waiting.loc[waiting.left_s == b.dispatched_s, "tokens"].min() == waiting["tokens"].min()
    assert overdue_seen > 10  # the backlog made the bound matter
    assert frame.status.eq(200).all()


def test_a_text_over_the_budget_goes_alone() -> None:
    run = simulate(make_strategy("tokens", Limits(max_batch_tokens=100)), [0.0] * 4, COST, tokens=[10, 300, 10, 10])
    assert sorted((b.size, b.padded_tokens) for b in run.batches) == [(1, 300), (3, 30)]


def test_same_lengths_make_the_tokens_rule_the_count_rule() -> None:
    arrivals = np.linspace(0, 0.05, 400)
    runs = [simulate(make_strategy(name, Limits(max_batch_size=32, max_batch_tokens=32 * 20)), arrivals, COST,
                     tokens=[20] * 400) for name in ("tokens", "thread")]
    assert runs[0].sizes == runs[1].sizes
    assert all(b.padded_tokens == b.tokens for b in runs[0].batches)


def test_synthetic_per_token_cost_and_count() -> None:
    m = parse_synthetic("synthetic:1+0.5?per_token=0.01")
    assert m.per_token_ms == 0.01 and m.name == "synthetic:1+0.5?per_token=0.01"
    assert m.count_tokens(["a b c", "a"]) == [5, 3]
    assert m.cost_ms(4, 10) == pytest.approx(1 + 4 * 0.5 + 4 * 10 * 0.01)
    with pytest.raises(ValueError, match="per_token"):
        parse_synthetic("synthetic:1+0?per_token=-1")


def test_live_budget_padding_counters_and_header() -> None:
    """A real server: the thread rule under a budget cuts its batch (reason "tokens"), the rest going
    first next; /stats, /metrics and the batch log count real and padded tokens; the answer says its tokens."""
    texts = ["w " * 3, "w " * 40, "w " * 3, "w " * 3]  # 5, 42, 5, 5 tokens, queued together
    with labserver.serve("thread", "synthetic:1+0?per_token=0.001", max_batch_size=8,
                         max_batch_tokens=60) as h, httpx.Client(timeout=30) as c:
        r = c.post(h.url + "/predict", json={"inputs": texts})
        assert r.status_code == 200, r.text
        assert r.headers[wire.HEADER_INPUT_TOKENS] == str(5 + 42 + 5 + 5)
        stats = c.get(h.url + "/stats").json()
        metrics = c.get(h.url + "/metrics").text
        log = h.batches()
    # 5 then 42 would pad to 84 > 60: the 5 goes alone; 42 and 5 likewise; the last two 5s together
    assert [(b["size"], b["tokens"], b["padded_tokens"], b["reason"]) for b in log] == [
        (1, 5, 5, "tokens"), (1, 42, 42, "tokens"), (2, 10, 10, "idle")]
    assert stats["tokens_computed"] == 57 and stats["tokens_padded"] == 57
    assert "labserver:tokens_padded_total 57" in metrics or "labserver:tokens_padded 57" in metrics


def test_live_padding_is_counted() -> None:
    with labserver.serve("thread", "synthetic:1+0", max_batch_size=8) as h, httpx.Client(timeout=30) as c:
        assert c.post(h.url + "/predict", json={"inputs": ["w " * 3, "w " * 40]}).status_code == 200
        stats = c.get(h.url + "/stats").json()
        (batch,) = h.batches()
    assert (batch["tokens"], batch["padded_tokens"]) == (47, 84)
    assert batch["padding"] == pytest.approx(37 / 84)
    assert (stats["tokens_computed"], stats["tokens_padded"]) == (47, 84)


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    return load_model("minilm", device="cpu")


def test_minilm_counts_what_it_computes(minilm) -> None:  # type: ignore[no-untyped-def]
    texts = ["a", "the model server batch", "word " * 400]
    assert minilm.count_tokens(texts) == [3, 6, 256]  # [CLS] ... [SEP]; the long one cut at 256


def test_tokens_path_embeddings_equal_one_at_a_time(minilm) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    words = "the a model server batch queue token answer river mountain garden".split()
    texts = [" ".join(rng.choice(words, k)) for k in rng.integers(1, 120, 40)]
    alone = [minilm([t])[0]["embedding"] for t in texts]
    with labserver.serve("tokens", minilm, max_batch_size=16, max_batch_tokens=512) as h, \
            httpx.Client(timeout=60) as c:
        got = c.post(h.url + "/predict", json={"inputs": texts}).json()["outputs"]
        sizes = [b["size"] for b in h.batches()]
    assert max(sizes) > 1  # they were batched (grouped by length), not one at a time
    for mine, ref in zip(got, alone, strict=True):
        np.testing.assert_allclose(np.asarray(mine["embedding"]), ref, atol=1e-5)


def test_no_tokens_batch_pads_past_its_cap() -> None:
    from labserver.strategies import Tokens

    arrivals, tokens = long_tailed(2000, seed=5)
    run = simulate(make_strategy("tokens", Limits(max_batch_size=None, max_batch_tokens=2048)), arrivals, COST,
                   tokens=tokens)
    assert all(b.padding <= Tokens.max_padding + 1e-12 for b in run.batches)
    assert max(run.sizes) > 32  # the cap on padding still leaves room for big batches of short texts


def test_padding_pictures_draw_from_a_virtual_run() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from labserver import analysis, plots

    arrivals, tokens = long_tailed(400)
    run = simulate(make_strategy("thread", Limits(max_batch_size=16)), arrivals, COST, tokens=tokens)
    frame = analysis.batch_frame(run.batches, label="thread")
    assert frame["start_s"].iloc[0] == 0 and (frame["padding"].between(0, 1)).all()
    assert analysis.padding_share(run.batches) == pytest.approx(
        1 - frame["tokens"].sum() / frame["padded_tokens"].sum())
    ax = plots.batch_gantt(frame, color="padding")
    assert "padding" in ax.get_title() and len(ax.patches) == len(frame)
    with pytest.raises(ValueError, match="color"):
        plots.batch_gantt(frame, color="tokens")
    summary = pd.DataFrame({"label": ["thread", "thread"], "load": [0.5, 1.0], "padding": [0.4, 0.8]})
    ax = plots.padding_vs_load(summary)
    assert ax.get_ylim() == (0.0, 1.0) and len(ax.lines) == 1
