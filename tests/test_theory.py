"""Tests for labserver.analysis.theory against values worked out by hand."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from labserver.analysis import theory
from labserver.analysis.theory import (
    capacity_rps,
    md1_mean_response_ms,
    mg1_mean_response_ms,
    mm1_mean_response_ms,
    mm1_response_quantile_ms,
    utilization,
)


@pytest.mark.parametrize(
    ("rate", "service_ms", "expected_ms"),
    [
        (0.0, 10.0, 10.0),  # empty system: just the service time
        (50.0, 10.0, 15.0),  # ρ = 0.5: 10 + 0.5·10 / (2·0.5)
        (80.0, 10.0, 30.0),  # ρ = 0.8: 10 + 8 / 0.4
        (90.0, 10.0, 55.0),  # ρ = 0.9: 10 + 9 / 0.2
        (25.0, 20.0, 20.0 + 0.5 * 20 / 1.0),  # ρ = 0.5 with D = 20
    ],
)
def test_md1_mean_response(rate, service_ms, expected_ms):
    assert md1_mean_response_ms(rate, service_ms) == pytest.approx(expected_ms)


@pytest.mark.parametrize(("rate", "expected_ms"), [(0.0, 10.0), (50.0, 20.0), (90.0, 100.0)])
def test_mm1_mean_response_is_d_over_one_minus_rho(rate, expected_ms):
    assert mm1_mean_response_ms(rate, 10.0) == pytest.approx(expected_ms)


def test_mg1_spans_md1_and_mm1():
    assert mg1_mean_response_ms(50, 10.0, cv2=0.0) == md1_mean_response_ms(50, 10.0)
    assert mg1_mean_response_ms(50, 10.0, cv2=1.0) == pytest.approx(mm1_mean_response_ms(50, 10.0))
    assert mg1_mean_response_ms(50, 10.0, cv2=3.0) == pytest.approx(10 + 0.5 * 10 * 4 / 1.0)


@pytest.mark.parametrize("rate", [100.0, 150.0])
def test_unstable_queues_are_infinite(rate):
    assert md1_mean_response_ms(rate, 10.0) == math.inf
    assert mm1_mean_response_ms(rate, 10.0) == math.inf
    assert mm1_response_quantile_ms(rate, 10.0, 0.99) == math.inf


def test_arrays_in_arrays_out():
    rates = np.array([0.0, 50.0, 100.0])
    out = md1_mean_response_ms(rates, 10.0)
    assert isinstance(out, np.ndarray)
    assert out.tolist() == [10.0, 15.0, math.inf]
    assert isinstance(md1_mean_response_ms(50, 10.0), float)


def test_mm1_quantile_is_exponential():
    # mean 20 ms at ρ = 0.5; the median of an exponential is mean·ln 2
    assert mm1_response_quantile_ms(50, 10.0, 0.5) == pytest.approx(20 * math.log(2))
    assert mm1_response_quantile_ms(50, 10.0, 0.99) == pytest.approx(20 * math.log(100))


def test_utilization_and_capacity():
    assert utilization(50, 10.0) == pytest.approx(0.5)
    assert capacity_rps(10.0) == pytest.approx(100.0)
    assert capacity_rps(20.0, batch_size=8) == pytest.approx(400.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: md1_mean_response_ms(10, 0.0), "service time must be positive"),
        (lambda: md1_mean_response_ms(-1, 10.0), "rates must be >= 0"),
        (lambda: mg1_mean_response_ms(10, 10.0, cv2=-0.1), "cv2"),
        (lambda: mm1_response_quantile_ms(10, 10.0, 1.0), "quantile"),
        (lambda: capacity_rps(10.0, batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments_say_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_module_doctests():
    result = doctest.testmod(theory)
    assert result.attempted >= 5 and result.failed == 0
