"""Replicas that follow the load on a real Ray Serve: ``replicas=(1, 2)`` scales up under a burst, a scaled-down
replica finishes its streams, /stats and /metrics tell the story, and every listener stays on loopback.

One deployment, ``synthetic-gen`` (sleeps, so two cores do not hide what the autoscaler does), delays of seconds
instead of Ray's defaults of minutes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

import labserver  # noqa: E402
from labserver import wire  # noqa: E402
from labserver.replicas import ReplicasHandle  # noqa: E402
from labserver.routing import Autoscaler  # noqa: E402

from .fakes import exposed, listeners, sse_events  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # Ray's own

MODEL = "synthetic-gen:5+10"  # 5 ms a prefill, 10 ms a decode step


@pytest.fixture(scope="module")
def scaled() -> Iterator[ReplicasHandle]:
    rule = Autoscaler(1, 2, target_ongoing=2, upscale_delay_s=0.5, downscale_delay_s=3, look_back_s=1,
                      metrics_interval_s=0.25)
    h = labserver.serve("gen-continuous", MODEL, autoscale=rule, router="round-robin", max_batch_size=2,
                        max_new_tokens=1000, graceful_shutdown_s=60)
    try:
        yield h
    finally:
        h.stop()
    assert not ray.is_initialized()


def until(check: Callable[[], Any], what: str, timeout_s: float = 90) -> Any:
    """``check()`` once it is truthy: a bounded poll of a state the server reports (no event crosses Ray for it)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def stream(url: str, tokens: int, out: list[dict[str, Any]], i: int) -> None:
    with httpx.stream("POST", url + "/generate", timeout=180,
                      json={"prompt": f"request {i:03d}", "max_new_tokens": tokens, "stream": True}) as r:
        body = r.read().decode()
        out.append({"status": r.status_code, "replica": r.headers.get(wire.HEADER_REPLICA),
                    "events": sse_events(body), "done_s": time.time()})


def burst(url: str, n: int, tokens: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    threads = [threading.Thread(target=stream, args=(url, tokens, out, i)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, out


def answered_whole(out: list[dict[str, Any]], tokens: int) -> bool:
    return all(o["status"] == 200 and [k for k, _ in o["events"]] == ["token"] * tokens + ["done"] for o in out)


def test_a_burst_scales_up_a_lull_scales_down_and_no_stream_is_lost(scaled: ReplicasHandle) -> None:
    first = scaled.stats()["scaling"]
    assert first["target"] == 1 and first["autoscaling"]["max_replicas"] == 2
    one = listeners(os.getpid())
    assert exposed(one) == [], one  # one replica: Ray's, Serve's and labserver's listeners on loopback

    threads, out = burst(scaled.url, 12, 150)  # 12 streams for 2 slots a replica: the queue asks for more
    up = until(lambda: (s := scaled.stats()["scaling"])["timeline"][-1]["running"] == 2 and s, "a second replica")
    assert [(d["old"], d["new"]) for d in up["decisions"]][:1] == [(1, 2)]
    two = listeners(os.getpid())
    assert exposed(two) == [], two  # the replica the autoscaler started listens on loopback too
    assert len({pid for *_, name, pid in two if name.startswith("ray::ServeReplica")}) == 3  # ingress + 2
    for t in threads:
        t.join(120)
    assert len(out) == 12 and answered_whole(out, 150)

    # two long streams, one a replica (round-robin): 2 ongoing wants 1 replica, so one is scaled down mid-stream
    threads, out = burst(scaled.url, 2, 1000)
    down = until(lambda: (s := scaled.stats()["scaling"])["target"] == 1 and s, "a scale-down")
    decided = down["decisions"][-1]
    assert (decided["old"], decided["new"]) == (2, 1)
    for t in threads:
        t.join(120)
    assert len(out) == 2 and answered_whole(out, 1000), [o["events"][-1] for o in out]  # drained, none cut
    assert len({o["replica"] for o in out}) == 2 and all(o["done_s"] > decided["t_s"] for o in out)
    left = until(lambda: (s := scaled.stats()["scaling"])["timeline"][-1]["running"] == 1
                 and s["timeline"][-1]["stopping"] == 0 and s, "the replica gone")
    assert any(row["stopping"] == 1 for row in left["timeline"])  # it drained before it went

    metrics = httpx.get(scaled.url + "/metrics", timeout=30).text
    assert 'labserver:scale_decisions_total{direction="up"} 1.0' in metrics
    assert 'labserver:scale_decisions_total{direction="down"} 1.0' in metrics
    assert "labserver:replicas_running 1.0" in metrics and "labserver:replicas_target 1.0" in metrics

    colds = left["cold_starts"]  # the first replica's (from the deploy) and the one the burst started
    assert len(colds) == 2, colds
    for part in colds.values():
        assert part["compile_s"] is None and part["load_s"] is not None and part["actor_s"] > 0
        assert part["first_token_s"] >= part["actor_s"] + part["load_s"]  # the parts add up within the whole
