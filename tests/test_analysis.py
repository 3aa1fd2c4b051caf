"""Tests for labserver.analysis on hand-made records with answers worked out by hand."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labserver import analysis
from labserver.analysis import (
    batch_size_counts,
    batches,
    combine,
    request_phases,
    summarize,
    summarize_runs,
    sweep,
    window_s,
)
from labserver.analysis.theory import md1_mean_response_ms
from labserver.analysis.trust import late_matters, load_seen, trusted

COLUMNS = [
    "i", "scheduled_s", "sent_s", "done_s", "status", "error", "latency_ms", "send_latency_ms", "late_ms",
    "warmup", "input_chars", "queue_ms", "compute_ms", "batch_size", "batch_id", "dispatch", "server_ms",
    "request_id",
]  # fmt: skip


def make_records(
    latency_ms,
    *,
    scheduled_s=None,
    status=None,
    late_ms=None,
    warmup=None,
    queue_ms=None,
    compute_ms=None,
    batch_size=None,
    batch_id=None,
    dispatch=None,
) -> pd.DataFrame:
    """Records as the load generator writes them; server columns NaN unless given."""
    n = len(latency_ms)
    latency = np.asarray(latency_ms, dtype=float)
    scheduled = np.arange(n, dtype=float) if scheduled_s is None else np.asarray(scheduled_s, dtype=float)
    late = np.zeros(n) if late_ms is None else np.asarray(late_ms, dtype=float)
    nan = np.full(n, np.nan)

    def given_or_nan(values):
        return nan if values is None else np.asarray(values, dtype=float)

    frame = pd.DataFrame(
        {
            "i": np.arange(n),
            "scheduled_s": scheduled,
            "sent_s": scheduled + late / 1000.0,
            "done_s": scheduled + latency / 1000.0,
            "status": np.full(n, 200) if status is None else np.asarray(status),
            "error": [""] * n,
            "latency_ms": latency,
            "send_latency_ms": latency - late,
            "late_ms": late,
            "warmup": np.zeros(n, dtype=bool) if warmup is None else np.asarray(warmup, dtype=bool),
            "input_chars": np.full(n, 20),
            "queue_ms": given_or_nan(queue_ms),
            "compute_ms": given_or_nan(compute_ms),
            "batch_size": given_or_nan(batch_size),
            "batch_id": given_or_nan(batch_id),
            "dispatch": [np.nan] * n if dispatch is None else list(dispatch),
            "server_ms": nan,
            "request_id": [f"r{k}" for k in range(n)],
        }
    )
    return frame[COLUMNS]


# ------------------------------------------------------------ percentiles and counts


def test_percentiles_use_numpy_linear_on_known_values():
    rng = np.random.default_rng(0)
    latency = rng.permutation(np.arange(1, 101, dtype=float))  # order must not matter
    s = summarize(make_records(latency))
    assert s["count"] == 100 and s["n_ok"] == 100
    # linear: rank (n-1)q between the sorted values 1..100
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p90_ms"] == pytest.approx(90.1)
    assert s["p99_ms"] == pytest.approx(99.01)
    assert s["p999_ms"] == pytest.approx(99.901)
    assert s["mean_ms"] == pytest.approx(50.5)
    assert s["max_ms"] == 100.0
    assert analysis.PERCENTILE_METHOD == "linear"
    assert s["p99_ms"] == pytest.approx(np.percentile(latency, 99, method="linear"))


def test_single_request_percentiles_are_its_latency():
    s = summarize(make_records([42.0]))
    assert s[["p50_ms", "p99_ms", "p999_ms", "max_ms"]].tolist() == [42.0] * 4


def test_errors_counted_by_status_and_left_out_of_latency():
    status = [200] * 6 + [503, 503, 504, 500, 0, 429]
    latency = [10.0] * 6 + [9000.0] * 6  # failures are slow; they must not reach percentiles
    s = summarize(make_records(latency, status=status))
    assert (s["count"], s["n_ok"]) == (12, 6)
    assert (s["n_503"], s["n_504"], s["n_500"], s["n_429"], s["n_err"]) == (2, 1, 1, 1, 1)
    assert s["error_frac"] == pytest.approx(0.5)
    assert s["max_ms"] == 10.0


def test_error_columns_present_when_zero():
    s = summarize(make_records([5.0, 6.0]))
    assert (s["n_500"], s["n_503"], s["n_504"], s["n_err"], s["error_frac"]) == (0, 0, 0, 0, 0.0)


def test_warmup_rows_left_out_of_everything():
    latency = [5000.0, 5000.0] + [10.0] * 4
    scheduled = [0.0, 0.1, 1.0, 2.0, 3.0, 4.0]
    records = make_records(latency, scheduled_s=scheduled, warmup=[True, True, False, False, False, False])
    s = summarize(records)
    assert s["count"] == 4 and s["max_ms"] == 10.0
    assert s["window_s"] == pytest.approx(4.01 - 1.0)  # from the first measured schedule


def test_window_runs_from_first_schedule_to_last_completion():
    records = make_records([500.0] * 10)  # scheduled every second from 0 s
    assert window_s(records) == pytest.approx(9.5)
    s = summarize(records)
    assert s["throughput_rps"] == pytest.approx(10 / 9.5)
    assert summarize(records, duration_s=5.0)["throughput_rps"] == pytest.approx(2.0)


def test_window_when_nothing_completed_uses_sending_span():
    records = make_records([np.nan] * 3, status=[0, 0, 0])
    assert window_s(records) == pytest.approx(2.0)
    s = summarize(records)
    assert s["throughput_rps"] == 0.0 and math.isnan(s["p99_ms"]) and s["n_err"] == 3


def test_throughput_counts_only_successes():
    s = summarize(make_records([500.0] * 10, status=[200] * 5 + [503] * 5))
    assert s["throughput_rps"] == pytest.approx(5 / 9.5)


def test_goodput_counts_2xx_within_slo():
    records = make_records([10.0, 40.0, 50.0, 60.0, 100.0], status=[200, 200, 200, 200, 503])
    s = summarize(records, slo_ms=50.0, duration_s=2.0)
    assert s["goodput_rps"] == pytest.approx(3 / 2.0)  # 50 ms is within; the 503 never counts
    assert s["slo_ms"] == 50.0
    assert math.isnan(summarize(records)["goodput_rps"])


def test_late_send_fraction():
    s = summarize(make_records([10.0] * 4, late_ms=[0.0, 0.5, 2.0, 5.0]))
    assert s["late_frac"] == pytest.approx(0.5)
    assert s["max_late_ms"] == 5.0
    assert summarize(make_records([10.0] * 4, late_ms=[0.0, 0.5, 2.0, 5.0]), late_threshold_ms=0.1)[
        "late_frac"
    ] == pytest.approx(0.75)


def test_late_sends_matter_only_beside_the_latency_they_distort():
    jitter = summarize(make_records([15.0] * 100, late_ms=[0.0] * 80 + [2.0] * 20))  # mean 0.4 ms vs 15 ms
    assert jitter["late_frac"] == pytest.approx(0.2) and not jitter["late_matters"]
    assert jitter["late_p99_ms"] == pytest.approx(2.0)
    stalled = summarize(make_records([15.0] * 100, late_ms=[0.0] * 80 + [10.0] * 20))  # mean 2 ms vs 15 ms
    assert stalled["late_matters"]
    assert late_matters(0.1, 15.0, sent_rate=90.0, scheduled_rate=100.0)  # a gentler load than asked
    assert "gentler" in load_seen(90.0, 100.0)
    assert "the rate held" in load_seen(4.4, 4.4) and "gentler" not in load_seen(4.4, 4.4)  # late, not fewer


def test_tail_percentiles_need_three_answers_beyond_them():
    table = pd.DataFrame({"n_ok": [299, 300, 29], "p50_ms": [1.0, 1.0, 1.0], "p90_ms": [2.0, 2.0, 2.0],
                          "p99_ms": [3.0, 3.0, 3.0], "ttft_p99_ms": [4.0, 4.0, 4.0], "itl_p99_ms": [5.0, 5.0, 5.0]})
    view = trusted(table)
    assert view["p99_ms"].isna().tolist() == [True, False, True]
    assert view["ttft_p99_ms"].isna().tolist() == [True, False, True]
    assert view["p90_ms"].isna().tolist() == [False, False, True]
    assert view["p50_ms"].notna().all() and view["itl_p99_ms"].notna().all()  # ITL counts gaps, not answers
    assert table["p99_ms"].notna().all()  # a copy: the summary itself keeps every figure


def test_meta_adds_offered_rate_and_concurrency():
    s = summarize(make_records([1.0, 2.0]), meta={"target_rate": 50.0, "duration_s": 10, "concurrency": 8})
    assert s["offered_rps"] == 50.0 and s["concurrency"] == 8
    closed = summarize(make_records([1.0, 2.0]), meta={"target_rate": None, "concurrency": 4})
    assert math.isnan(closed["offered_rps"])


# ------------------------------------------------------------ batches


def two_batches() -> pd.DataFrame:
    """Batch 7: three requests, all seen, left full. Batch 8: size 2, one seen, left on deadline."""
    return make_records(
        [30.0, 28.0, 26.0, 40.0],
        scheduled_s=[0.000, 0.002, 0.004, 0.050],
        queue_ms=[10.0, 7.0, 5.0, 3.0],
        compute_ms=[15.0, 15.0, 15.0, 20.0],
        batch_size=[3, 3, 3, 2],
        batch_id=[7, 7, 7, 8],
        dispatch=["full", "full", "full", "deadline"],
    )


def test_batches_one_row_per_batch_with_dispatch_estimate():
    table = batches(two_batches())
    assert table["batch_id"].tolist() == [7, 8]
    assert table["size"].tolist() == [3, 2]
    assert table["seen"].tolist() == [3, 1]
    assert table["dispatch"].tolist() == ["full", "deadline"]
    # sent + queue per request: 10, 9, 9 ms -> the latest, 10 ms, is the closest estimate
    assert table["start_s"].tolist() == pytest.approx([0.010, 0.053])
    assert table["end_s"].tolist() == pytest.approx([0.025, 0.073])


def test_batch_stats_count_each_batch_once():
    s = summarize(two_batches())
    assert s["n_batches"] == 2
    assert s["mean_batch_size"] == pytest.approx(2.5)  # per request it would be 2.75
    assert s["max_batch_size"] == 3
    assert (s["dispatch_full"], s["dispatch_deadline"]) == (1, 1)
    assert s["mean_queue_ms"] == pytest.approx(25.0 / 4)
    assert s["mean_compute_ms"] == pytest.approx(65.0 / 4)
    assert batch_size_counts(two_batches()).to_dict() == {2: 1, 3: 1}


def test_batch_size_counts_without_ids_divide_requests_by_size():
    records = make_records([5.0] * 6, batch_size=[4, 4, 4, 4, 2, 2])
    assert batch_size_counts(records).to_dict() == {2: 1, 4: 1}
    assert summarize(records)["mean_batch_size"] == pytest.approx(3.0)


def test_request_phases_are_ordered_and_share_the_batch_dispatch():
    phases = request_phases(two_batches())
    assert phases["dispatch_s"].tolist()[:3] == pytest.approx([0.010] * 3)
    assert phases["enqueue_s"].tolist() == pytest.approx([0.000, 0.003, 0.005, 0.050])
    stamps = phases[["scheduled_s", "sent_s", "enqueue_s", "dispatch_s", "compute_end_s", "done_s"]].to_numpy()
    assert (np.diff(stamps, axis=1) >= -1e-12).all()


def test_foreign_server_records_summarize_without_server_columns():
    records = make_records([10.0, 20.0, 30.0])  # every server header missing
    s = summarize(records)
    assert s["n_batches"] == 0 and math.isnan(s["mean_batch_size"]) and math.isnan(s["mean_queue_ms"])
    assert not any(name.startswith("dispatch_") for name in s.index)
    assert batches(records).empty and "start_s" in batches(records).columns
    assert request_phases(records)["dispatch_s"].isna().all()


# ------------------------------------------------------------ several runs


def test_combine_from_mapping_and_list_and_meta():
    a, b = make_records([1.0]), make_records([2.0, 3.0])
    by_label = combine({"a": a, "b": (b, {"target_rate": 20.0})})
    assert by_label["label"].tolist() == ["a", "b", "b"]
    assert by_label["rate"].isna().tolist() == [True, False, False]
    assert combine([("a", 10, a), ("a", 20, b)])["rate"].tolist() == [10.0, 20.0, 20.0]
    assert len(a) == 1 and "label" not in a.columns  # inputs untouched


def test_summarize_runs_orders_rows_and_fills_counts():
    runs = combine(
        [
            ("slow", 20, make_records([50.0] * 4, status=[200, 200, 200, 503])),
            ("fast", 10, make_records([1.0] * 4)),
            ("slow", 10, make_records([20.0] * 4)),
        ]
    )
    table = summarize_runs(runs, slo_ms=30.0)
    assert list(zip(table["label"], table["rate"])) == [("slow", 10.0), ("slow", 20.0), ("fast", 10.0)]
    assert table["n_503"].tolist() == [0, 1, 0] and table["n_503"].dtype == "int64"
    assert table["p99_ms"].tolist() == [20.0, 50.0, 1.0]
    row = table.iloc[1]
    assert row["goodput_rps"] == 0.0 and row["error_frac"] == 0.25


def test_summarize_runs_keeps_closed_loop_runs_with_nan_rate():
    runs = combine({"a": make_records([1.0, 2.0]), "b": make_records([3.0])})
    table = summarize_runs(runs)
    assert table["label"].tolist() == ["a", "b"] and table["count"].tolist() == [2, 1]


def test_summarize_runs_without_keys_is_one_row():
    table = summarize_runs(make_records([1.0, 2.0]))
    assert len(table) == 1 and table.loc[0, "count"] == 2


def test_batches_kept_apart_per_run_even_with_equal_ids():
    runs = combine({"a": two_batches(), "b": two_batches()})
    assert len(batches(runs)) == 4
    assert summarize_runs(runs)["n_batches"].tolist() == [2, 2]


# ------------------------------------------------------------ sweep


def md1_fake(service_ms: float, n: int = 200):
    """A deterministic server: every request takes the M/D/1 mean; overload answers 503."""
    calls = []

    def run_at_rate(rate: float):
        calls.append(rate)
        w = md1_mean_response_ms(rate, service_ms)
        scheduled = np.arange(n) / rate
        if math.isinf(w):
            return make_records([1.0] * n, scheduled_s=scheduled, status=[503] * n)
        return make_records([w] * n, scheduled_s=scheduled), {"target_rate": rate, "duration_s": n / rate}

    return run_at_rate, calls


def md1_max_rate(service_ms: float, slo_ms: float) -> float:
    """Solve D + ρD/(2(1−ρ)) = S for λ: with x = S/D − 1, ρ = 2x/(1 + 2x)."""
    x = slo_ms / service_ms - 1.0
    return 2 * x / (1 + 2 * x) * 1000.0 / service_ms


def test_sweep_finds_md1_knee_within_tolerance():
    run_at_rate, calls = md1_fake(service_ms=10.0)
    result = sweep(run_at_rate, slo_p99_ms=35.0, start_rate=5.0, rel_tol=0.05)
    truth = md1_max_rate(10.0, 35.0)  # ρ = 5/6: 83.3 req/s
    assert md1_mean_response_ms(truth, 10.0) == pytest.approx(35.0)
    assert truth / 1.05 < result.best_rate <= truth
    probes = result.probes
    assert probes["rate"].tolist() == calls
    assert probes["phase"].tolist()[:5] == ["ramp"] * 5  # 5, 10, 20, 40, 80 pass; 160 fails
    assert probes["passed"].tolist()[:6] == [True] * 5 + [False]
    assert (probes["passed"] == (probes["p99_ms"] <= 35.0)).all()
    assert set(result.records["rate"]) == set(calls)


def test_sweep_walks_down_when_the_start_fails():
    run_at_rate, calls = md1_fake(service_ms=10.0)
    result = sweep(run_at_rate, slo_p99_ms=15.0, start_rate=400.0, rel_tol=0.02)
    truth = md1_max_rate(10.0, 15.0)  # 50 req/s
    assert truth / 1.02 < result.best_rate <= truth
    assert calls[:4] == [400.0, 200.0, 100.0, 50.0]


def test_sweep_stops_at_bounds_and_probe_budget():
    run_at_rate, _ = md1_fake(service_ms=10.0)
    capped = sweep(run_at_rate, slo_p99_ms=30.0, start_rate=5.0, max_rate=12.0)
    assert capped.best_rate == 12.0 and capped.probes["rate"].tolist() == [5.0, 10.0, 12.0]
    hopeless = sweep(run_at_rate, slo_p99_ms=5.0, start_rate=10.0, min_rate=2.0)
    assert hopeless.best_rate is None and hopeless.probes["rate"].tolist() == [10.0, 5.0, 2.5, 2.0]
    budget = sweep(run_at_rate, slo_p99_ms=30.0, start_rate=5.0, max_probes=3)
    assert len(budget.probes) == 3 and budget.best_rate == 20.0


def test_sweep_fails_probes_that_shed_load():
    def shedding(rate: float) -> pd.DataFrame:
        shed = int(rate >= 40)  # fast answers, but 1 in 10 is a 503 from 40 req/s on
        return make_records([1.0] * 10, status=[503] * shed + [200] * (10 - shed))

    result = sweep(shedding, slo_p99_ms=100.0, start_rate=10.0, max_error_frac=0.01, rel_tol=0.01)
    assert 40 / 1.01 < result.best_rate < 40


@settings(max_examples=40, deadline=None)
@given(
    service_ms=st.floats(1.0, 50.0),
    slo_factor=st.floats(1.2, 20.0),
    start_rate=st.floats(0.5, 500.0),
    rel_tol=st.sampled_from([0.01, 0.05, 0.2]),
)
def test_sweep_brackets_the_md1_answer(service_ms, slo_factor, start_rate, rel_tol):
    run_at_rate, _ = md1_fake(service_ms, n=20)
    slo_ms = service_ms * slo_factor
    result = sweep(run_at_rate, slo_p99_ms=slo_ms, start_rate=start_rate, rel_tol=rel_tol, max_probes=60)
    truth = md1_max_rate(service_ms, slo_ms)
    assert truth / (1 + rel_tol) * (1 - 1e-9) < result.best_rate <= truth * (1 + 1e-9)


def test_sweep_rejects_bad_arguments():
    with pytest.raises(ValueError, match="factor > 1"):
        sweep(lambda rate: make_records([1.0]), slo_p99_ms=10.0, start_rate=1.0, factor=1.0)


def test_module_doctests():
    assert doctest.testmod(analysis).failed == 0
