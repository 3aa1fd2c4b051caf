"""Disaggregated prefill/decode on the virtual clock (``routing.pd``) and the P:D search (``routing.pd_search``).

Hand-made traces (two or three requests with chosen arrival times) check the timelines to
the microsecond; workload runs check what must hold in aggregate; the search runs with few
requests so the file stays fast.
"""

from __future__ import annotations

import numpy as np
import pytest

from labserver.routing.pd import (DECODE_HEAVY, LINKS, MIXED, PREFILL_HEAVY, PDCosts, Role, Workload, _Cluster,
                                  simulate_colocated, simulate_disaggregated)
from labserver.routing.pd_search import SLO, best_split, capacity, default_splits, goodput

COSTS = PDCosts()  # prefill 5 ms + 0.05 ms/token, decode step 8 ms + 0.1 ms/sequence, 50 kB/token over RDMA
QUIET = 0.02  # req/s: each request has the cluster to itself (decode-heavy answers take ~5 s)


def trace(kinds: tuple[list[str], list[str]], arrival: list[float], prompt: list[int], output: list[int],
          costs: PDCosts = COSTS) -> dict[str, list[float]]:
    cluster = _Cluster(costs, arrival, prompt, output)
    cluster.run(*([Role(k) for k in tier] for tier in kinds))
    return cluster.rec


def test_a_quiet_colocated_instance_answers_in_one_prefill_and_steps_of_one() -> None:
    res = simulate_colocated(2, QUIET, DECODE_HEAVY, n_requests=200)
    assert np.allclose(res.ttft, COSTS.prefill_ms(res.prompt))
    assert np.allclose(res.queue, 0) and np.allclose(res.transfer, 0) and np.allclose(res.decode_wait, 0)
    assert np.allclose(res.tpot, COSTS.decode_step_ms(1))
    assert np.allclose(res.finish - res.arrival, res.ttft + (res.output - 1) * COSTS.decode_step_ms(1))


def test_a_quiet_disaggregated_pair_adds_the_transfer_and_no_decode_wait() -> None:
    res = simulate_disaggregated(1, 1, QUIET, PREFILL_HEAVY, n_requests=200)
    moved = COSTS.transfer_ms(res.prompt)
    assert np.allclose(res.transfer, moved) and moved.min() > 3  # 50 kB x 1500 tokens at 200 Gb/s: 3 ms + 0.02
    assert np.allclose(res.ttft, COSTS.prefill_ms(res.prompt) + moved)
    assert np.allclose(res.decode_wait, 0)
    assert np.allclose(res.tpot, COSTS.decode_step_ms(1))


def test_a_slow_link_costs_its_bytes_over_its_bits_per_second() -> None:
    fast, slow = COSTS.with_link("rdma"), COSTS.with_link("tcp")
    assert slow.link_gbps == LINKS["tcp"][0] == 10
    a = simulate_disaggregated(2, 2, QUIET, PREFILL_HEAVY, fast, n_requests=100)
    b = simulate_disaggregated(2, 2, QUIET, PREFILL_HEAVY, slow, n_requests=100)
    bits = 50_000 * 8 * a.prompt  # 1500-3000 tokens: 0.6-1.2 Gbit, 60-120 ms at 10 Gb/s
    expected = bits / 10e9 * 1000 - bits / 200e9 * 1000 + LINKS["tcp"][1] - LINKS["rdma"][1]
    assert np.allclose(b.ttft - a.ttft, expected)
    assert expected.min() > 55


def test_the_ttft_parts_add_up_under_load() -> None:
    res = simulate_disaggregated(2, 2, 15, MIXED, n_requests=600)
    assert np.allclose(res.ttft, res.queue + res.prefill + res.transfer + res.decode_wait)
    assert res.queue.max() > 0 and res.decode_wait.min() >= 0 and res.transfer.min() > 0


def test_a_long_prefill_stalls_the_decodes_beside_it_unless_chunked_or_elsewhere() -> None:
    """Request 0 decodes alone; request 1 (2,000 prompt tokens) arrives at 50 ms, mid-step."""
    arrival, prompt, output = [0.0, 50.0], [100, 2000], [100, 2]
    first = COSTS.prefill_ms(100)  # 10 ms: request 0's first token
    boundary = first + 5 * COSTS.decode_step_ms(1)  # 50.5: the first step boundary after 50 ms
    rec = trace((["prefill-first"], []), arrival, prompt, output)
    assert rec["started"][1] == pytest.approx(boundary)  # the arrival cut the 99-step run of request 0
    assert rec["first"][1] == pytest.approx(boundary + COSTS.prefill_ms(2000))
    assert rec["max_itl"][0] == pytest.approx(COSTS.prefill_ms(2000) + COSTS.decode_step_ms(2))  # 113.2 ms
    assert rec["max_itl"][1] == pytest.approx(COSTS.decode_step_ms(2))

    chunked = trace((["chunked"], []), arrival, prompt, output)
    slice_ms = COSTS.decode_step_ms(1) + COSTS.prefill_ms_per_token * COSTS.chunk_tokens  # 33.7 ms
    assert chunked["max_itl"][0] == pytest.approx(slice_ms)
    assert chunked["first"][1] > rec["first"][1]  # four slower slices: the prompt waits longer

    apart = trace((["prefill"], ["decode"]), arrival, prompt, output)
    assert apart["max_itl"][0] == pytest.approx(COSTS.decode_step_ms(2))  # the decode instance never prefills
    assert apart["first"][0] == pytest.approx(first + COSTS.transfer_ms(100))


def test_under_load_only_colocation_shows_prefill_stalls() -> None:
    colocated = simulate_colocated(4, 20, MIXED, n_requests=600)
    chunked = simulate_colocated(4, 20, MIXED, policy="chunked", n_requests=600)
    apart = simulate_disaggregated(2, 2, 20, MIXED, n_requests=600)
    assert colocated.p99("max_itl") > COSTS.prefill_ms(1500)
    assert COSTS.decode_step_ms(1) < chunked.p99("max_itl") < colocated.p99("max_itl") / 2
    assert apart.max_itl.max() <= COSTS.decode_step_ms(COSTS.max_batch) + 1e-9


def test_a_full_decode_instance_makes_the_next_request_wait() -> None:
    costs = PDCosts(max_batch=1)
    rec = trace((["prefill"], ["decode"]), [0.0, 1.0], [100, 100], [10, 10], costs)
    done0 = rec["first"][0] + 9 * costs.decode_step_ms(1)
    assert rec["finish"][0] == pytest.approx(done0)
    assert rec["first"][1] == pytest.approx(done0)  # admitted when request 0 leaves, not when its KV landed
    assert rec["moved"][1] < done0

    colocated = trace((["prefill-first"], []), [0.0, 1.0], [100, 100], [10, 10], costs)
    assert colocated["started"][1] == pytest.approx(colocated["finish"][0])  # no room, no prefill


def test_the_same_seed_gives_the_same_run() -> None:
    a = simulate_disaggregated(2, 3, 20, MIXED, n_requests=300, seed=7)
    b = simulate_disaggregated(2, 3, 20, MIXED, n_requests=300, seed=7)
    c = simulate_disaggregated(2, 3, 20, MIXED, n_requests=300, seed=8)
    for name in ("arrival", "prompt", "output", "ttft", "tpot", "max_itl", "finish"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.ttft, c.ttft)
    d = simulate_disaggregated(2, 3, 40, MIXED, n_requests=300, seed=7)  # another rate: the same requests
    assert np.array_equal(a.prompt, d.prompt) and np.allclose(a.arrival, 2 * d.arrival)


def test_workloads_draw_what_they_say() -> None:
    rng = np.random.default_rng(0)
    p, o = PREFILL_HEAVY.sample(5000, rng)
    assert p.min() >= 1500 and p.max() <= 3000 and o.min() >= 20 and o.max() <= 100
    p, o = DECODE_HEAVY.sample(5000, rng)
    assert p.min() >= 100 and p.max() <= 400 and o.min() >= 300 and o.max() <= 800
    p, _ = MIXED.sample(5000, rng)
    assert 0.45 < np.mean(p >= 1500) < 0.55
    p, _ = Workload("tail", (1000, 1.5), (100, 0.5), dist="lognormal").sample(20000, rng)
    assert 900 < p.mean() < 1100 and np.median(p) < 700  # a long right tail


def test_costs_from_measurements_and_the_summary() -> None:
    fitted = PDCosts.from_measured([(100, 12.0), (1000, 57.0), (2000, 107.0)], [(1, 9.1), (32, 12.2), (64, 15.4)])
    assert fitted.prefill_ms_per_token == pytest.approx(0.05) and fitted.prefill_fixed_ms == pytest.approx(7.0)
    assert fitted.step_ms_per_seq == pytest.approx(0.1) and fitted.step_ms == pytest.approx(9.0)
    res = simulate_colocated(2, 5, MIXED, n_requests=300)
    summary = res.summary()
    assert summary["ttft_p50"] <= summary["ttft_p99"] and summary["tokens_per_s"] > 0
    assert res.slo_attainment(1e9, 1e9) == 1.0 and res.slo_attainment(0, 1e9) == 0.0
    with pytest.raises(ValueError):
        simulate_colocated(2, 5, MIXED, policy="fcfs")


def test_goodput_brackets_the_slo_between_two_probed_rates() -> None:
    slo = SLO(500.0, 15.0)

    def sim(rate: float):
        return simulate_disaggregated(1, 3, rate, MIXED, n_requests=400)

    g = goodput(sim, slo, instances=4, start=5.0, rel_tol=0.05)
    assert 0 < g.rate < g.upper <= g.rate * 1.05 + 1e-9
    assert sim(g.rate).slo_attainment(slo.ttft_ms, slo.tpot_ms) == g.attained >= 0.9
    assert sim(g.upper).slo_attainment(slo.ttft_ms, slo.tpot_ms) < 0.9
    assert g.per_instance == pytest.approx(g.rate / 4)
    impossible = goodput(sim, SLO(50.0, 15.0), start=5.0)  # no 1,500-token prompt prefills in 50 ms
    assert impossible.rate == 0.0


def test_the_best_split_leans_toward_the_heavy_phase() -> None:
    """Decode-heavy: decode instances are the bottleneck, so D > P (DistServe and Anyscale report 1:2, 1:3
    and beyond for such workloads); prefill-heavy: P >= D. With a tight TPOT, long prompts stall colocated
    decodes, so splitting wins there by far."""
    slo = SLO(1000.0, 15.0)
    decode = best_split(8, DECODE_HEAVY, COSTS, slo, n_requests=1500, rel_tol=0.1)
    prefill = best_split(8, PREFILL_HEAVY, COSTS, slo, n_requests=1500, rel_tol=0.1)
    assert decode.best.decode > decode.best.prefill
    assert prefill.best.prefill >= prefill.best.decode
    assert prefill.best.goodput > 1.5 * prefill.colocated("chunked").goodput
    assert len(decode.rows) == 7 + 2 and decode.rows == sorted(decode.rows, key=lambda r: -r.goodput)
    assert "colocated prefill-first" in decode.table()
    assert capacity(COSTS, DECODE_HEAVY, 1, 5) > capacity(COSTS, DECODE_HEAVY, 5, 1)


def test_large_clusters_search_a_coarser_grid() -> None:
    assert default_splits(32) == list(range(1, 32))
    grid = default_splits(64)
    assert {1, 2, 6, 32, 58, 62, 63} <= set(grid) and len(grid) < 30
