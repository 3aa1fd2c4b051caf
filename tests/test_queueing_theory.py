"""The theory check that keeps the numbers honest: naive + synthetic:D+0 + Poisson is M/D/1.

Mean response = D + rho*D / (2(1 - rho)) with rho = lambda*D (Pollaczek-Khinchine). A
real server on a loopback socket, loaded by the real generator in its own process,
must agree within 10 % once a fixed per-request overhead (HTTP, parsing, the client)
is added. That overhead is measured in the same run at light load and printed; if the
two disagreed, the generator or the server would be wrong.
"""

from __future__ import annotations

import pytest

import labserver
from labserver import analysis
from labserver.loadgen import run_load_sync
from labserver.theory import md1_mean_response_ms

SERVICE_MS = 20.0  # long enough that the loop's own HTTP work per request is a small share


def run(url: str, rate: float, duration_s: float, seed: int) -> tuple[float, float]:
    """Mean latency from the schedule, and the mean model time the server reports (x-compute-ms)."""
    result = run_load_sync(url, arrival="poisson", rate_per_s=rate, duration_s=duration_s + 1, warmup_s=1,
                           payload="x", seed=seed, progress=False)
    s = analysis.summarize(result.records)
    assert s["n_ok"] == s["count"], "every request must succeed"
    return float(s["mean_ms"]), float(s["mean_compute_ms"])


def test_naive_is_an_md1_queue(capsys: pytest.CaptureFixture[str]) -> None:
    with labserver.serve("naive", f"synthetic:{SERVICE_MS:g}+0") as h:
        light = 2.5  # rho = 0.05: almost no queueing
        light_mean, service_ms = run(h.url, light, 8, seed=1)  # D as the server measured it (sleep overshoot)
        overhead_ms = light_mean - md1_mean_response_ms(light, service_ms)
        rows = []
        for k, rho in enumerate((0.3, 0.5, 0.7)):
            rate = rho / (SERVICE_MS / 1000)
            measured, _ = run(h.url, rate, 12, seed=10 + k)
            predicted = md1_mean_response_ms(rate, service_ms) + overhead_ms
            rows.append((rho, measured, predicted))
    with capsys.disabled():
        print(f"\nM/D/1 check: D = {service_ms:.2f} ms measured by the server, fixed overhead "
              f"(HTTP, client) measured at rho 0.05: {overhead_ms:.2f} ms")
        for rho, measured, predicted in rows:
            print(f"  rho {rho}: measured mean {measured:.2f} ms, predicted {predicted:.2f} ms, "
                  f"ratio {measured / predicted:.3f}")
    assert 0 <= overhead_ms < 5, "the fixed overhead should be small"
    for rho, measured, predicted in rows:
        assert measured == pytest.approx(predicted, rel=0.10), f"rho {rho}"
