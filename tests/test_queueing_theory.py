"""The theory check that keeps the numbers honest: naive + synthetic:D+0 + Poisson is M/D/1.

Mean response = D + rho*D / (2(1 - rho)) with rho = lambda*D (Pollaczek-Khinchine). A
real server on a loopback socket, loaded by the real generator in its own process,
is checked two ways, each after adding a fixed per-request overhead (HTTP, parsing,
the client) measured in the same run at light load:

- against the exact M/D/1 outcome of the *same* arrival times, replayed through the
  strategy on a virtual clock: no sampling noise, so within 10 % at every rho;
- against the Pollaczek-Khinchine mean, within 10 % at rho 0.3 and 0.5. At rho 0.7 a
  12 s run's mean is itself a noisy estimate (simulated: 6 % low on average, 12 %
  spread), so the formula is printed there, not asserted; the replay is.
"""

from __future__ import annotations

import numpy as np
import pytest

import labserver
from labserver import analysis
from labserver.loadgen import run_load_sync
from labserver.strategies import make_strategy
from labserver.theory import md1_mean_response_ms
from labserver.virtual import simulate

SERVICE_MS = 20.0  # long enough that the loop's own HTTP work per request is a small share


def run(url: str, rate: float, duration_s: float, seed: int) -> tuple[float, float, float]:
    """Mean latency from the schedule, the server's mean model time, and the same
    schedule's mean latency on a virtual M/D/1 server with that model time."""
    result = run_load_sync(url, arrival="poisson", rate_per_s=rate, duration_s=duration_s + 1, warmup_s=1,
                           payload="x", seed=seed, progress=False)
    s = analysis.summarize(result.records)
    assert s["n_ok"] == s["count"], "every request must succeed"
    service_ms = float(s["mean_compute_ms"])
    rec = result.records.sort_values("scheduled_s")
    sim = simulate(make_strategy("naive"), rec["scheduled_s"].tolist(), lambda n: service_ms)
    replay_ms = float(np.mean(np.array(sim.latencies_ms)[~rec["warmup"].to_numpy()]))
    return float(s["mean_ms"]), service_ms, replay_ms


def test_naive_is_an_md1_queue(capsys: pytest.CaptureFixture[str]) -> None:
    with labserver.serve("naive", f"synthetic:{SERVICE_MS:g}+0") as h:
        light = 2.5  # rho = 0.05: almost no queueing
        light_mean, service_ms, light_replay = run(h.url, light, 8, seed=1)
        overhead_ms = light_mean - light_replay
        rows = []
        for k, rho in enumerate((0.3, 0.5, 0.7)):
            rate = rho / (SERVICE_MS / 1000)
            measured, _, replay = run(h.url, rate, 12, seed=10 + k)
            rows.append((rho, measured, replay + overhead_ms, md1_mean_response_ms(rate, service_ms) + overhead_ms))
    with capsys.disabled():
        print(f"\nM/D/1 check: D = {service_ms:.2f} ms measured by the server, fixed overhead "
              f"(HTTP, client) measured at rho 0.05: {overhead_ms:.2f} ms")
        for rho, measured, replay, formula in rows:
            print(f"  rho {rho}: measured mean {measured:.2f} ms; same arrivals on a virtual M/D/1 "
                  f"{replay:.2f} ms (ratio {measured / replay:.3f}); Pollaczek-Khinchine {formula:.2f} ms "
                  f"(ratio {measured / formula:.3f})")
    assert 0 <= overhead_ms < 5, "the fixed overhead should be small"
    for rho, measured, replay, formula in rows:
        assert measured == pytest.approx(replay, rel=0.10), f"rho {rho}: against the replay"
        if rho < 0.7:
            assert measured == pytest.approx(formula, rel=0.10), f"rho {rho}: against the formula"
