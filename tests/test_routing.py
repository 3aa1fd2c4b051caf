"""Routing policies, without Ray: each rule's defining property, and the simulation against queueing theory."""

from __future__ import annotations

import random

import pytest

from labserver.analysis.theory import supermarket_mean_time
from labserver.routing import POLICIES, PrefixAware, PrefixHash, Route, make_policy, policy_names, simulate_cluster

IDS = [f"r{i}" for i in range(6)]


def test_every_policy_is_registered_by_name_and_chooses_an_index() -> None:
    assert policy_names() == ["least-loaded", "pow2", "prefix-aware", "prefix-hash", "random", "round-robin"]
    for name in POLICIES:
        policy = make_policy(name, seed=1)
        assert policy.name == name
        picks = {policy.choose(Route(prompt=f"hello {i}"), IDS, [0] * 6) for i in range(60)}
        assert picks <= set(range(6)) and picks
        assert policy.choose(Route(prompt="alone"), ["only"], [5]) == 0
    with pytest.raises(ValueError, match="unknown router 'nope'.*least-loaded"):
        make_policy("nope")


def test_pow2_never_picks_the_longer_of_its_two() -> None:
    policy = make_policy("pow2", seed=3)
    drawn: list[list[int]] = []
    sample = policy.rng.sample
    policy.rng.sample = lambda pop, k: drawn.append(sample(pop, k)) or drawn[-1]  # type: ignore[method-assign]
    rng = random.Random(0)
    for _ in range(2000):
        loads = [rng.randrange(5) for _ in IDS]
        pick = policy.choose(Route(), IDS, loads)
        a, b = drawn[-1]
        assert a != b and pick in (a, b)
        assert loads[pick] == min(loads[a], loads[b])
    assert len({tuple(sorted(d)) for d in drawn}) == 15  # every pair of 6 was drawn: the two are random


def test_least_loaded_is_exact_and_breaks_ties_at_random() -> None:
    policy = make_policy("least-loaded", seed=0)
    rng = random.Random(1)
    for _ in range(1000):
        loads = [rng.randrange(8) for _ in IDS]
        assert loads[policy.choose(Route(), IDS, loads)] == min(loads)
    assert {policy.choose(Route(), IDS, [2, 1, 3, 1, 1, 4]) for _ in range(200)} == {1, 3, 4}


def test_round_robin_takes_turns() -> None:
    policy = make_policy("round-robin")
    assert [policy.choose(Route(), IDS, [9, 0, 0, 0, 0, 0]) for _ in range(8)] == [0, 1, 2, 3, 4, 5, 0, 1]


def test_prefix_hash_is_sticky_and_moves_about_one_key_in_n_when_a_replica_joins() -> None:
    policy = PrefixHash(chars=32)
    keys = [Route(prompt=f"conversation {k:05d} " + "x" * 40) for k in range(8000)]
    eight, nine = IDS[:5] + ["r6", "r7", "r8"], IDS[:5] + ["r6", "r7", "r8", "new"]
    before = [eight[policy.choose(k, eight, [0] * 8)] for k in keys]
    assert before == [eight[policy.choose(k, eight, [99] * 8)] for k in keys]  # blind to load
    counts = [before.count(r) for r in eight]
    assert max(counts) < 1.6 * min(counts), counts  # spread over all
    after = [nine[policy.choose(k, nine, [0] * 9)] for k in keys]
    moved = [a for b, a in zip(before, after) if a != b]
    assert set(moved) == {"new"}  # only to the newcomer, never between old replicas
    assert 0.07 < len(moved) / len(keys) < 0.16  # about 1/9
    # the key is the session when there is one, else the prompt's first characters
    assert policy.choose(Route(prompt="a" * 40 + "one tail"), eight, [0] * 8) == \
        policy.choose(Route(prompt="a" * 40 + "another"), eight, [0] * 8)
    sessions = {policy.choose(Route(prompt="same words", session=f"s{i}"), eight, [0] * 8) for i in range(50)}
    assert len(sessions) > 3


def test_prefix_aware_follows_the_longest_prefix_until_the_loads_spread_past_the_threshold() -> None:
    policy = PrefixAware(seed=0, block=8, balance_abs=4, balance_rel=1.5)
    shared = "system: you are a helpful assistant. " * 3
    ids = ["a", "b", "c"]
    first = policy.choose(Route(prompt=shared + "question one"), ids, [0, 0, 0])
    assert policy.last["reason"] == "no match: most cache room"
    other = policy.choose(Route(prompt="a different conversation altogether " * 3), ids, [0, 0, 0])
    assert other != first  # the one sent the least text
    loads = [0, 0, 0]
    loads[first] = 4  # spread 4: not past balance_abs
    assert policy.choose(Route(prompt=shared + "question two"), ids, loads) == first
    assert policy.last["reason"] == "longest prefix"
    loads[first] = 5  # spread 5 > 4 and 5 > 1.5 x 0: imbalanced
    pick = policy.choose(Route(prompt=shared + "question three"), ids, loads)
    assert pick != first and loads[pick] == 0 and policy.last["reason"] == "imbalanced: least loaded"
    # the longest match wins among partial ones
    longer = shared + "question one, and more"
    assert policy.choose(Route(prompt=longer), ids, [3, 3, 3]) == first
    # below match_threshold of the prompt: treated as no match
    assert policy.choose(Route(prompt=shared[:8] + "z" * 200), ids, [0, 0, 0]) != first or \
        policy.last["reason"] == "no match: most cache room"


def test_prefix_aware_matches_a_prompt_only_under_its_own_salt() -> None:
    """A prompt one tenant sent is no match for another's (its route would tell that tenant what was sent); the
    same salt matches as no salt does."""
    policy = PrefixAware(seed=0, block=8)
    ids = ["a", "b", "c"]
    prompt = "the secret document that tenant a sent " * 4
    first = policy.choose(Route(prompt=prompt, salt="tenant-a"), ids, [0, 0, 0])
    for salt in ("tenant-b", ""):
        policy.choose(Route(prompt=prompt, salt=salt), ids, [0, 0, 0])
        assert policy.last["reason"] == "no match: most cache room", salt
    assert policy.choose(Route(prompt=prompt, salt="tenant-a"), ids, [0, 0, 0]) == first
    assert policy.last["reason"] == "longest prefix"
    index = policy.index[ids[first]]
    assert index.keys(prompt) != index.keys(prompt, "tenant-a") != index.keys(prompt, "tenant-b")


def test_prefix_hash_keys_on_the_salt_with_the_prompt() -> None:
    policy = PrefixHash(chars=32)
    prompt = "one prompt, many tenants " * 4
    plain = policy.choose(Route(prompt=prompt), IDS, [0] * 6)
    assert {policy.choose(Route(prompt=prompt, salt=""), IDS, [0] * 6) for _ in range(3)} == {plain}
    salted = {policy.choose(Route(prompt=prompt, salt=f"tenant-{i}"), IDS, [0] * 6) for i in range(40)}
    assert len(salted) > 3  # each salt its own key: spread, not all on the unsalted prompt's replica
    assert policy.choose(Route(prompt=prompt, salt="t"), IDS, [0] * 6) == \
        policy.choose(Route(prompt=prompt + " another tail", salt="t"), IDS, [0] * 6)  # still sticky within a salt


def test_random_and_pow2_meet_the_supermarket_model_at_load_point_nine() -> None:
    """64 FIFO M/M/1 replicas at load 0.9: one random choice is M/M/1 (10 service times), the shorter of
    two random ones about 2.61 (Mitzenmacher's limit); both within 10 %."""
    for name, choices in (("random", 1), ("pow2", 2)):
        result = simulate_cluster(name, replicas=64, load=0.9, requests=300_000, seed=2)
        theory = supermarket_mean_time(0.9, choices)
        assert abs(result.mean / theory - 1) < 0.10, (name, result.mean, theory)


def test_simulated_lessons_stale_loads_herd_a_slow_replica_and_cache_affinity() -> None:
    fresh = simulate_cluster("least-loaded", replicas=16, load=0.8, requests=60_000, seed=1)
    herd = simulate_cluster("least-loaded", replicas=16, load=0.8, requests=60_000, stale=4.0, seed=1)
    pow2_stale = simulate_cluster("pow2", replicas=16, load=0.8, requests=60_000, stale=4.0, seed=1)
    assert fresh.mean < pow2_stale.mean < herd.mean  # stale loads: everyone piles onto the same "least loaded"
    slow = [0.5] + [1.0] * 7
    rr = simulate_cluster("round-robin", replicas=8, load=0.7, requests=60_000, speeds=slow, seed=1)
    p2 = simulate_cluster("pow2", replicas=8, load=0.7, requests=60_000, speeds=slow, seed=1)
    assert p2.quantile(0.99) < 0.5 * rr.quantile(0.99)  # round-robin overloads the slow one (it gets 1/8 at half speed)
    blind = simulate_cluster("pow2", replicas=8, load=0.7, requests=20_000, groups=32, cache_slots=4, seed=1)
    aware = simulate_cluster("prefix-aware", replicas=8, load=0.7, requests=20_000, groups=32, cache_slots=4, seed=1)
    assert aware.hit_rate > 2 * blind.hit_rate and aware.mean < blind.mean
    assert sum(aware.counts) == 20_000 and len(aware.times) == 18_000  # the first 10 % are warm-up


def test_simulate_cluster_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="speeds"):
        simulate_cluster("random", replicas=2, speeds=[1.0])
    with pytest.raises(ValueError, match="service"):
        simulate_cluster("random", service="pareto")
    with pytest.raises(ValueError, match="unknown router"):
        simulate_cluster("fastest")
