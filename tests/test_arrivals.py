"""Arrival processes and payload sources: pure functions of (bounds, seed)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labserver.load.arrivals import (WORDS, Constant, FileLines, OnOff, Poisson, Ramp, Replay, Steps,
                                WordTexts, iter_payloads, make_arrival, take_payloads)


def test_constant_is_exactly_evenly_spaced():
    t = Constant(250).times(duration_s=2.0)
    assert len(t) == 500
    np.testing.assert_allclose(t, np.arange(500) / 250, rtol=0, atol=1e-12)
    assert len(Constant(250).times(duration_s=2.0, max_requests=7)) == 7
    assert len(Constant(250).times(max_requests=7)) == 7


def test_poisson_gaps_are_exponential():
    rate = 800.0
    t = Poisson(rate).times(duration_s=30, seed=3)
    gaps = np.diff(t)
    n_expected = rate * 30
    assert abs(len(t) - n_expected) < 4 * np.sqrt(n_expected)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # CV of an exponential is 1
    # memorylessness, roughly: P(gap > mean) = 1/e
    assert (gaps > 1 / rate).mean() == pytest.approx(np.exp(-1), abs=0.02)


def test_poisson_is_seeded():
    a, b, c = (Poisson(100).times(duration_s=5, seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


def test_on_off_sends_nothing_while_off():
    arrival = OnOff(rate_per_s=400, on_s=0.25, off_s=0.75)
    t = arrival.times(duration_s=20, seed=5)
    phase = np.mod(t, 1.0)
    assert (phase < 0.25).all()
    assert len(t) / (20 * 0.25) == pytest.approx(400, rel=0.08)  # the rate holds while on
    assert arrival.mean_rate_per_s(20) == pytest.approx(100, rel=1e-3)
    even = OnOff(rate_per_s=100, on_s=0.5, off_s=0.5, poisson=False).times(duration_s=2)
    np.testing.assert_allclose(even, np.concatenate([np.arange(50) / 100, 1 + np.arange(50) / 100]))


def test_steps_hold_each_rate_for_its_segment_then_stop():
    steps = [(2.0, 100.0), (2.0, 400.0), (1.0, 0.0), (2.0, 50.0)]
    even = Steps(steps, poisson=False).times(duration_s=100)
    counts = np.histogram(even, bins=[0, 2, 4, 5, 7, 100])[0]
    assert counts.tolist() == [200, 800, 0, 100, 0]
    random = Steps(steps).times(duration_s=100, seed=9)
    counts = np.histogram(random, bins=[0, 2, 4, 5, 7, 100])[0]
    for got, want in zip(counts, [200, 800, 0, 100, 0]):
        assert abs(got - want) <= 4 * np.sqrt(want) + 1e-9


def test_ramp_rate_grows_linearly_then_holds():
    ramp = Ramp(start_per_s=0, end_per_s=1000, ramp_s=2.0, poisson=False)
    t = ramp.times(duration_s=3.0)
    # λ(t) = 500 t on the ramp, so Λ(t) = 250 t²: 62.5 arrivals by 0.5 s, 1000 by 2 s
    counts = np.histogram(t, bins=[0, 0.5, 1.0, 2.0, 3.0])[0]
    assert np.abs(counts - [62.5, 187.5, 750, 1000]).max() <= 1
    assert ramp.mean_rate_per_s(2.0) == pytest.approx(500, rel=1e-3)
    poisson = Ramp(0, 1000, 2.0).times(duration_s=2.0, seed=4)
    assert (poisson < 1.0).sum() == pytest.approx(250, abs=4 * np.sqrt(250))


def test_replay_reads_a_generator_lazily_up_to_the_bounds():
    drawn = []

    def every_10ms():
        for k in itertools.count():
            drawn.append(k)
            yield k * 0.01

    t = make_arrival(every_10ms()).times(duration_s=0.5)
    np.testing.assert_allclose(t, np.arange(50) * 0.01)
    assert len(drawn) == 51  # one past the window, no more: the generator may be endless
    assert len(Replay(every_10ms()).times(max_requests=5)) == 5


@pytest.mark.parametrize("times", [[0.0, 0.2, 0.1], [-0.1, 0.3]])
def test_replay_refuses_unsorted_or_negative_times(times):
    with pytest.raises(ValueError, match="non-decreasing"):
        Replay(times).times(duration_s=1.0)


def test_bounds_and_names_are_validated():
    with pytest.raises(ValueError, match="bounded"):
        Poisson(10).times()
    with pytest.raises(ValueError, match="unknown arrival"):
        make_arrival("gaussian", 10)
    with pytest.raises(ValueError, match="rate_per_s"):
        make_arrival("poisson")
    assert make_arrival("constant", 5) == Constant(5)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.05, 2.0), st.sampled_from([0.0, 5.0, 50.0, 300.0])),
                   min_size=1, max_size=5),
    poisson=st.booleans(),
    duration_s=st.floats(0.1, 8.0),
    max_requests=st.one_of(st.none(), st.integers(0, 500)),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_step_schedule_is_sorted_bounded_and_silent_at_rate_zero(steps, poisson, duration_s,
                                                                     max_requests, seed):
    t = Steps(steps, poisson=poisson).times(duration_s, max_requests, seed=seed)
    assert np.all(np.diff(t) >= 0)
    assert t.size == 0 or (t[0] >= 0 and t[-1] < duration_s)
    assert max_requests is None or len(t) <= max_requests
    edges = np.cumsum([0.0] + [d for d, _ in steps])
    segment = np.searchsorted(edges, t, side="right") - 1
    rates = np.array([r for _, r in steps] + [0.0])
    assert (rates[segment] > 0).all()
    if not poisson and max_requests is None:  # evenly spaced: one arrival per unit of Λ(duration)
        lam = sum(r * max(0.0, min(b, duration_s) - a) for (_, r), a, b in zip(steps, edges, edges[1:]))
        assert math.ceil(lam - 1e-6) <= len(t) <= math.ceil(lam + 1e-6)


def test_word_texts_are_seeded_and_have_the_asked_length():
    a = take_payloads(WordTexts(mean_words=30), 2000, seed=1)
    assert a == take_payloads(WordTexts(mean_words=30), 2000, seed=1)
    assert a != take_payloads(WordTexts(mean_words=30), 2000, seed=2)
    lengths = np.array([len(s.split()) for s in a])
    assert lengths.mean() == pytest.approx(30, rel=0.05)
    assert lengths.std() > 5  # varying, not fixed
    assert set(" ".join(a).split()) <= set(WORDS)
    uniform = take_payloads(WordTexts(dist="uniform", min_words=3, max_words=5), 300)
    uniform = [len(s.split()) for s in uniform]
    assert set(uniform) == {3, 4, 5}


def test_payload_sources_repeat_when_used_up(tmp_path):
    assert take_payloads("same", 3) == ["same"] * 3
    assert take_payloads(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    assert take_payloads((s for s in ["x", "y"]), 3) == ["x", "y", "x"]
    f = tmp_path / "lines.txt"
    f.write_text("first\n\n  \nsecond\n")
    assert take_payloads(FileLines(f), 3) == ["first", "second", "first"]
    assert take_payloads(f, 2) == ["first", "second"]
    endless = iter_payloads(WordTexts(), seed=0)
    assert len(list(itertools.islice(endless, 3000))) == 3000


def test_payload_sources_refuse_nonsense():
    with pytest.raises(ValueError, match="empty"):
        take_payloads([], 1)
    with pytest.raises(TypeError, match="str"):
        take_payloads([b"bytes"], 1)


def test_sessions_resend_the_conversation_so_far_turn_after_turn() -> None:
    from labserver.load.payloads import Sessions

    s = Sessions(sessions=5, turns=3, first_words=10, turn_words=4, answer_words=6)
    texts = take_payloads(s, 40, seed=3)  # 2 sets of 15, and 10 of a third
    assert len(texts) == 40 and texts == take_payloads(s, 40, seed=3)
    for block in (texts[0:15], texts[15:30]):
        for k in range(5):  # session k's turns, 5 apart
            t1, t2, t3 = block[k], block[k + 5], block[k + 10]
            assert t2.startswith(t1 + " assistant: ") and t3.startswith(t2 + " assistant: ")
            assert len(t3.split()) == len(t2.split()) + 12 == len(t1.split()) + 24  # answer 6 + "user:" 1 + 4 ...
        assert len({t.split(" assistant:")[0] for t in block}) == 5  # five conversations
    assert texts[0] != texts[15]  # a fresh set of sessions after the first
    # sessions in groups that share a system prefix: more groups than a cluster has replicas, say
    grouped = take_payloads(Sessions(sessions=40, turns=1, prefixes=6, prefix_words=20), 40, seed=0)
    heads = {t.split(" user:")[0] for t in grouped}
    assert len(heads) == 6 and all(h.startswith("system ") for h in heads)
    # and it streams through iter_payloads like any source
    assert next(iter_payloads(s, seed=3)) == texts[0]
    with pytest.raises(ValueError, match="turns"):
        Sessions(turns=0)
