"""Replicas on a real Ray Serve (a local instance, 2 replicas on 2 cores): one URL, routed, named, stopped.

One deployment serves the whole module (Ray and Serve take ~10 s to start); the last two tests
kill replicas' actors and must come last among those that count on both replicas.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

import labserver  # noqa: E402
from labserver import wire  # noqa: E402
from labserver.replicas import ReplicasHandle  # noqa: E402
from labserver.replicas.disagg import core_groups  # noqa: E402

from .fakes import exposed, listeners, sse_events  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # Ray's own

MODEL = "synthetic-gen:20+10"  # 20 ms a prefill, 10 ms a decode step: sleeps, so 2 cores do not hide routing


@pytest.fixture(scope="module")
def cluster() -> Iterator[ReplicasHandle]:
    h = labserver.serve("gen-continuous", MODEL, replicas=2, router="round-robin", max_batch_size=2,
                        max_queue=4, max_new_tokens=256,  # 2 x 8 out with replicas, 4 waiting: a 21st is refused
                        pin_cores=True)  # each replica on its share of the cores, a torch thread a core
    try:
        yield h
    finally:
        h.stop()
    assert not ray.is_initialized()  # the Ray it started is stopped with it


def test_replicas_on_an_exposed_host_without_a_key_warn_before_anything_starts(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from labserver.config import API_KEY_ENV, ServerConfig
    from labserver.replicas import serve_replicas

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = ServerConfig(strategy="gen-continuous", model=MODEL, host="0.0.0.0")
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="unknown router"):
        serve_replicas(config, 2, "no-such-router")  # (refused before Ray starts: the warning came first)
    assert "binding 0.0.0.0 with no API key" in caplog.text
    assert not ray.is_initialized()


def test_ray_and_serve_listen_on_loopback_only(cluster: ReplicasHandle) -> None:
    """Every listening socket of this process and its descendants, as /proc lists them (Ray's GCS, raylet, agents,
    workers, metrics exporter, Serve's proxy and each Serve replica's inter-deployment gRPC server): a loopback
    address, as the server's own host is."""
    found = listeners(os.getpid())
    port = int(cluster.url.rsplit(":", 1)[1])
    assert port in {f[1] for f in found} and len(found) > 10, found  # Serve's proxy, and Ray's own
    assert exposed(found) == [], found


def test_generate_streams_through_the_ingress_and_names_its_replica(cluster: ReplicasHandle) -> None:
    seen = set()
    for i in range(4):
        r = httpx.post(cluster.url + "/generate", json={"prompt": f"hello number {i}", "max_new_tokens": 5,
                                                        "stream": True}, timeout=60)
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert [k for k, _ in events] == ["token"] * 5 + ["done"]
        assert events[-1][1]["generated_tokens"] == 5 and events[-1][1]["finish_reason"] == "length"
        seen.add(r.headers[wire.HEADER_REPLICA])
    assert len(seen) == 2  # round-robin: both replicas, each named


def test_openai_chat_stream_through_the_ingress(cluster: ReplicasHandle) -> None:
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "say something"}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1][1] == "[DONE]"
    chunks = [d for _, d in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert r.headers[wire.HEADER_REPLICA]


def test_bad_input_is_refused_at_the_ingress_and_never_reaches_a_replica(cluster: ReplicasHandle) -> None:
    before = settled(cluster)
    for body in ({"prompt": 5}, {"prompt": "x", "max_new_tokens": 10_000}, {"prompt": "x", "max_tokens": 3}):
        r = httpx.post(cluster.url + "/generate", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "bad_request", r.text
        assert "Traceback" not in r.text and wire.HEADER_REPLICA not in r.headers
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    assert settled(cluster) == before


def test_a_shape_crosses_to_the_replica_that_generates_and_is_judged_there(cluster: ReplicasHandle) -> None:
    """The constraint travels in the job (plain data); the replica compiles it for its model, or refuses it in its
    own words: here a synthetic model, with no scores to mask."""
    r = httpx.post(cluster.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 400 and "no scores for a grammar to mask" in r.json()["error"]["message"], r.text


def settled(cluster: ReplicasHandle) -> int:
    """Requests the replicas have taken in, once two reports a second apart agree (replicas report twice a
    second, so a count read at once may lag the requests just answered)."""
    def taken() -> int:
        return sum(s["requests_prefilled"] + s["queue_depth"] for s in replica_stats(cluster).values())

    last, deadline = taken(), time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = taken()
        if now == last:
            return now
        last = now
    raise AssertionError("replica stats never settled")


def replica_stats(cluster: ReplicasHandle) -> dict[str, dict[str, Any]]:
    return cluster.stats()["replicas"]  # type: ignore[no-any-return]


def test_stats_show_every_replica_and_the_requests_each_took(cluster: ReplicasHandle) -> None:
    for i in range(6):
        r = httpx.post(cluster.url + "/generate", json={"prompt": f"count {i}", "max_new_tokens": 2}, timeout=60)
        assert r.status_code == 200
    def e2e_counted(text: str, stats: dict[str, dict[str, Any]]) -> bool:
        """Every replica's answered requests in /metrics (vLLM's name) as many as in its /stats."""
        return all((f'vllm:e2e_request_latency_seconds_count{{engine="{replica}",model_name="{MODEL}"}} '
                    f'{float(sum(s["finished"].values()))}') in text for replica, s in stats.items())

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the board hears from each replica twice a second: /stats and /metrics
        stats = replica_stats(cluster)  # are read from it one after the other, so wait until both have heard
        text = httpx.get(cluster.url + "/metrics", timeout=30).text  # of all 6
        answered = sum(sum(s["finished"].values()) for s in stats.values())
        if (len(stats) == 2 and all(s["requests_prefilled"] >= 3 for s in stats.values()) and answered >= 6
                and e2e_counted(text, stats)):
            break
        time.sleep(0.2)
    assert len(stats) == 2
    assert all(s["requests_prefilled"] >= 3 and "kv_blocks" in s and "running" in s for s in stats.values()), stats
    assert cluster.stats()["strategy"] == "gen-continuous"
    assert {s["rank"] for s in stats.values()} == {0, 1} and {s["model"] for s in stats.values()} == {MODEL}
    # pinned colocated replicas: both roles, the machine's cores shared out between them, a torch thread a core
    assert [s["role"] for s in stats.values()] == ["both", "both"]
    assert all(s["threads"] == len(s["cores"]) for s in stats.values()), stats
    mine = sorted(os.sched_getaffinity(0))
    assert sorted(tuple(s["cores"]) for s in stats.values()) == sorted(map(tuple, core_groups(mine, 2)))
    for replica in stats:  # every replica's counters in /metrics, labelled
        assert f'labserver:replica_requests_prefilled_total{{replica="{replica}"}}' in text
    assert e2e_counted(text, stats), text  # in vLLM's names each replica is an engine (as vLLM labels
    #   its data-parallel ranks), its answered requests /stats's
    assert 'labserver:replica_running{replica="' in text


def test_overload_is_refused_at_the_ingress_with_503_and_retry_after(cluster: ReplicasHandle) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def post(i: int) -> httpx.Response:
        return httpx.post(cluster.url + "/generate", json={"prompt": f"busy {i}", "max_new_tokens": 30}, timeout=120)

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(post, range(40)))
    statuses = sorted(r.status_code for r in answers)
    refused = [r for r in answers if r.status_code == 503]
    assert set(statuses) == {200, 503} and len(refused) >= 10, statuses  # 16 out + 4 queued at most, then 503
    assert all(r.headers.get("retry-after") and r.json()["error"]["type"] == "overloaded" for r in refused)
    assert all(r.json()["generated_tokens"] == 30 for r in answers if r.status_code == 200)  # the rest answered


def test_a_killed_replica_fails_its_requests_clearly_and_is_replaced(cluster: ReplicasHandle) -> None:
    # a long stream on one replica, then that replica's actor killed mid-stream
    result: dict[str, Any] = {}
    first_token = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", cluster.url + "/generate", timeout=60,
                          json={"prompt": "a long one", "max_new_tokens": 250, "stream": True}) as r:
            result["replica"] = r.headers.get(wire.HEADER_REPLICA)
            body = ""
            for chunk in r.iter_text():
                body += chunk
                first_token.set()
            result["events"] = sse_events(body)

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(30)
    victim = result["replica"]
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(actors) == 1, actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    t.join(60)
    kinds = [k for k, _ in result["events"]]
    assert kinds[-1] == "error" and kinds.count("token") < 250  # cut short, and said so
    error = result["events"][-1][1]["error"]
    assert error["type"] == "model_unavailable" and "Traceback" not in json.dumps(error)
    # every other request is answered meanwhile, by the replica left
    for i in range(4):
        r = httpx.post(cluster.url + "/generate", json={"prompt": f"after {i}", "max_new_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers[wire.HEADER_REPLICA] != victim
    # Ray starts a replacement; the router sends to it once it is healthy
    deadline = time.monotonic() + 90
    names: set[str] = set()
    while time.monotonic() < deadline and len(names - {victim}) < 2:
        r = httpx.post(cluster.url + "/generate", json={"prompt": "again", "max_new_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        names.add(r.headers[wire.HEADER_REPLICA])
        time.sleep(0.1)
    assert len(names - {victim}) == 2  # two live replicas again, the killed one not among them


def test_requests_whose_replica_dies_are_told_to_retry(cluster: ReplicasHandle) -> None:
    """A /generate and a /v1 request out with replicas, every replica killed: 503 with Retry-After, each in its
    route's error shape (not "restart the server": the ingress and Ray's replacements still serve)."""
    answers: dict[str, httpx.Response] = {}

    def post(path: str, body: dict[str, Any]) -> None:
        answers[path] = httpx.post(cluster.url + path, json=body, timeout=120)

    calls = [(wire.GENERATE_PATH, {"prompt": "doomed", "max_new_tokens": 250}),
             (wire.V1_COMPLETIONS_PATH, {"model": MODEL, "prompt": "doomed too", "max_tokens": 250})]
    victims = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ReplicaServer" in a["name"]]
    assert len(victims) == 2, victims

    def live() -> list[dict[str, Any]]:  # (a dead replica's report lingers 5 s)
        return [s for r, s in replica_stats(cluster).items() if any(r in a["name"] for a in victims)]

    settled(cluster)  # the last test's requests done and reported: what runs from here on is these two
    taken = sum(s["requests_prefilled"] for s in live())
    threads = [threading.Thread(target=post, args=call) for call in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # both prefilled and generating on a live replica, in one report each
        stats = live()
        if sum(s["running"] for s in stats) == 2 and sum(s["requests_prefilled"] for s in stats) == taken + 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the two requests never ran: {replica_stats(cluster)}")
    for actor in victims:
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for t in threads:
        t.join(120)
    native, openai = answers[wire.GENERATE_PATH], answers[wire.V1_COMPLETIONS_PATH]
    for r in (native, openai):
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert "Traceback" not in r.text and "restart" not in r.text
    assert native.json()["error"]["type"] == "model_unavailable" and "retry" in native.json()["error"]["message"]
    error = openai.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "model_unavailable"
    assert set(error) == {"message", "type", "param", "code"} and "retry" in error["message"]


def test_the_ray_extra_pulls_no_cuda_and_keeps_the_cpu_torch() -> None:
    """ray[serve] is pinned beside torch==2.13.0: installing it must not have brought CUDA packages."""
    from importlib import metadata

    names = {d.metadata["Name"].lower() for d in metadata.distributions()}
    assert not {n for n in names if n.startswith("nvidia-") or n.startswith("cuda-")}, sorted(names)
    assert metadata.version("ray") == "2.60.0"
    assert metadata.version("torch").startswith("2.13.0")
