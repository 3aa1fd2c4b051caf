"""The autoscaler's rule (``routing.autoscale``), its virtual-clock cluster (``routing.scaling``) and the traffic step
(``load.arrivals.traffic_step``): fast, no Ray started."""

from __future__ import annotations

import numpy as np
import pytest

from labserver.load.arrivals import traffic_step
from labserver.routing import Autoscaler, simulate_scaling


def test_a_traffic_step_sends_r_then_three_r_then_r() -> None:
    times = traffic_step(10.0, 20.0, 10.0, 20.0, poisson=False).times(duration_s=100)
    counts = [int(((times >= a) & (times < b)).sum()) for a, b in ((0, 20), (20, 30), (30, 50), (50, 100))]
    assert counts == [200, 300, 200, 0]
    poisson = traffic_step(10.0, 200.0, 100.0, 200.0).times(duration_s=500, seed=1)
    assert abs(((poisson >= 200) & (poisson < 300)).sum() / 100 - 30) < 3  # 3r, within Poisson noise
    with pytest.raises(ValueError, match="rate_per_s > 0"):
        traffic_step(0.0, 1, 1, 1)


def test_the_rule_wants_ongoing_over_target_within_the_bounds() -> None:
    a = Autoscaler(1, 4, target_ongoing=2)
    assert [a.wanted(ongoing, running=1) for ongoing in (0, 1, 2, 2.5, 4, 6, 100)] == [1, 1, 1, 2, 2, 3, 4]
    assert a.wanted(1.0, running=3) == 1  # (1 / 2 rounded up: down to the lower bound)
    half = Autoscaler(1, 8, target_ongoing=1, upscaling_factor=0.5, downscaling_factor=0.5)
    assert half.wanted(8, running=2) == 5  # half of the way from 2 to 8
    assert half.wanted(2.6, running=4) == 4 - 1  # stuck by the factor (ceil 3.3 = 4): still one less
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        Autoscaler(3, 2)


def test_a_change_waits_for_its_delay_without_a_break() -> None:
    a = Autoscaler(1, 4, target_ongoing=1, upscale_delay_s=3, downscale_delay_s=10)
    assert [a.decide(t, 4.0, 1) for t in (0, 1, 2)] == [1, 1, 1]
    assert a.decide(2.5, 1.0, 1) == 1  # a break: the wait starts again
    assert [a.decide(t, 4.0, 1) for t in (3, 4, 5, 6)] == [1, 1, 1, 4]
    assert [(d.t_s, d.old, d.new) for d in a.decisions] == [(6, 1, 4)]
    assert [a.decide(t, 0.0, 4) for t in (7, 12, 17)] == [4, 4, 1]  # down after 10 s of wanting less
    assert a.ray_config()["upscale_delay_s"] == 3 and a.settings()["max_replicas"] == 4


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("running,target,ongoing", [(1, 1, 0.5), (1, 1, 5.0), (2, 2, 9.0), (4, 4, 1.0), (3, 2, 2.5),
                                                    (8, 8, 3.0), (2, 3, 30.0)])
@pytest.mark.parametrize("factors", [(1.0, 1.0), (0.5, 0.3)])
def test_the_rule_is_ray_serves(running: int, target: int, ongoing: float, factors: tuple[float, float]) -> None:
    """The same wanted count and the same delay as Ray Serve 2.60's own functions, on a grid."""
    pytest.importorskip("ray")
    from ray.serve import autoscaling_policy as ray_policy
    from ray.serve.config import AutoscalingConfig

    up, down = factors
    ours = Autoscaler(1, 6, target_ongoing=2, upscale_delay_s=2, downscale_delay_s=4, upscaling_factor=up,
                      downscaling_factor=down, target=target)
    cfg = AutoscalingConfig(min_replicas=1, max_replicas=6, target_ongoing_requests=2, upscale_delay_s=2,
                            downscale_delay_s=4, upscaling_factor=up, downscaling_factor=down)
    theirs = ray_policy._apply_scaling_factors(ongoing / 2, running, cfg)
    assert ours.wanted(ongoing, running) == min(max(theirs, 1), 6)
    state: dict[str, object] = {}
    for t in np.arange(0.0, 6.0, 0.5):  # Ray's delay on the same wanted count, tick by tick
        ray_new, state = ray_policy._apply_delay_logic(ours.wanted(ongoing, running), ours.target, cfg, state, _now=t)
        assert ours.decide(float(t), ongoing, running) == ray_new


def test_a_step_at_cluster_scale_follows_the_load_and_loses_nothing() -> None:
    # 2 s a request, 4 at once a replica, 2 ongoing per replica wanted: 3r = 64 replicas' worth
    rate = 64 / 3
    arrivals = traffic_step(rate, 120, 300, 300).times(duration_s=720, seed=0)
    runs = {}
    for cold in (2.0, 30.0):
        scaler = Autoscaler(1, 64, target_ongoing=2, upscale_delay_s=10, downscale_delay_s=60, look_back_s=10,
                            metrics_interval_s=1)
        runs[cold] = simulate_scaling(scaler, arrivals, service_s=2, slots=4, cold_start_s=cold, until_s=900)
    for r in runs.values():
        assert r.lost == 0 and np.all(r.done_s >= r.started_s) and np.all(r.started_s >= r.arrivals_s)
        assert r.reached == 64 and r.ready_at(400) >= 56 and r.ready_at(899) < 30  # up in the step, down after
        assert max(held for _, _, held in r.timeline) <= 64
        assert r.decisions[0].new > r.decisions[0].old
    # a slower cold start: the queue stands longer in the step, and the replicas it waits for cost as much
    assert runs[30.0].wait_quantile(0.99, 120, 420) > 2 * runs[2.0].wait_quantile(0.99, 120, 420)


def test_fixed_replicas_never_change() -> None:
    arrivals = traffic_step(1.0, 30, 30, 30).times(duration_s=90, seed=0)
    r = simulate_scaling(Autoscaler(2, 2), arrivals, service_s=1, slots=1, cold_start_s=5)
    assert r.decisions == [] and {(ready, held) for _, ready, held in r.timeline} == {(2, 2)}
    assert r.replica_seconds == pytest.approx(2 * max(r.done_s.max(), 90), rel=0.02)  # two held throughout


def test_the_watch_turns_the_controllers_details_into_a_timeline_decisions_and_cold_starts() -> None:
    from labserver.replicas.watch import ScaleWatch

    clock = iter([100.0, 101.0, 102.0, 110.0, 111.0])
    watch = ScaleWatch("ReplicaServer", "labserver", clock=lambda: next(clock))

    def details(target: int, *replicas: tuple[str, str, float]) -> dict:
        return {"applications": {"labserver": {"deployments": {"ReplicaServer": {
            "target_num_replicas": target,
            "replicas": [{"replica_id": r, "state": s, "start_time_s": t} for r, s, t in replicas]}}}}}

    watch.observe(details(1, ("a", "RUNNING", 90.0)))
    watch.observe(details(1, ("a", "RUNNING", 90.0)))  # nothing changed: no row
    watch.observe(details(2, ("a", "RUNNING", 90.0), ("b", "STARTING", 101.5)))  # decided when b's actor started
    watch.observe(details(2, ("a", "RUNNING", 90.0), ("b", "RUNNING", 101.5)))
    watch.observe(details(1, ("a", "STOPPING", 90.0), ("b", "RUNNING", 101.5)))
    assert [(r["t_s"], r["target"], r["running"], r["starting"], r["stopping"]) for r in watch.timeline] == [
        (100.0, 1, 1, 0, 0), (102.0, 2, 1, 1, 0), (110.0, 2, 2, 0, 0), (111.0, 1, 1, 0, 1)]
    assert list(watch.decisions) == [{"t_s": 101.5, "old": 1, "new": 2}, {"t_s": 111.0, "old": 2, "new": 1}]
    start = {"init_s": 104.0, "load_s": 2.0, "compile_s": None, "loaded_s": 106.5, "first_token_s": 108.0}
    cold = watch.stats({"b": {"start": start}, "a": {}})["cold_starts"]
    assert cold == {"b": {"decided_s": 101.5, "actor_s": 2.5, "load_s": 2.0, "compile_s": None, "serving_s": 1.5, "first_token_s": 6.5}}
    assert watch.stats({})["cold_starts"] == cold  # kept after the replica stops reporting


def test_the_prefix_aware_router_forgets_a_replica_that_left() -> None:
    from labserver.routing import Route, make_policy

    policy = make_policy("prefix-aware", seed=0)
    prompt = "a shared system prompt, long enough for blocks " * 8
    policy.choose(Route(prompt=prompt), ["a", "b"], [0, 0])
    assert set(policy.index) == {"a", "b"}
    assert policy.choose(Route(prompt=prompt + "more"), ["b", "c"], [0, 0]) in (0, 1)  # a scaled down, c new
    assert set(policy.index) == {"b", "c"}  # a's view dropped


def test_the_shell_reads_n_or_min_max() -> None:
    import argparse

    from labserver.cli.serve import replica_count

    assert replica_count("3") == 3 and replica_count("1:4") == (1, 4) and replica_count("0:2") == (0, 2)
    for bad in ("0", "3:2", "a:b", "1:"):
        with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
            replica_count(bad)


def test_the_shells_flags_make_the_autoscaler() -> None:
    from labserver.cli import build_parser
    from labserver.cli.serve import autoscaler_of

    args = build_parser().parse_args(["serve", "--strategy", "gen-continuous", "--replicas", "1:4", "--max-batch", "8",
                                      "--upscale-delay", "5", "--downscale-delay", "60", "--look-back", "10"])
    rule = autoscaler_of(args, 8)
    assert (rule.min_replicas, rule.max_replicas, rule.target_ongoing) == (1, 4, 8.0)  # the target: the batch
    assert rule.ray_config()["upscale_delay_s"] == 5 and rule.ray_config()["look_back_period_s"] == 10
    assert autoscaler_of(build_parser().parse_args(["serve", "--replicas", "3"]), 8) is None  # N: fixed
