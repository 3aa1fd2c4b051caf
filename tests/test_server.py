"""The HTTP surface, on a real uvicorn server on a loopback socket."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

import labserver
from labserver import wire
from labserver.launch import PortInUse
from labserver.models import POISON, ModelLoadError

from .fakes import CrashModel, GateModel


@pytest.fixture
def echo() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("thread", "synthetic:0+0", max_inputs=8, max_body_bytes=4096, max_chars=1000) as h:
        yield h


def wait_until(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Poll a server-side condition we cannot subscribe to over HTTP (bounded)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.002)


def assert_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert body["error"]["type"] == kind
    assert body["error"]["message"]
    assert body["error"]["request_id"] == r.headers[wire.HEADER_REQUEST_ID]
    assert "Traceback" not in r.text and "/labserver/" not in r.text
    return body["error"]


def test_post_root_like_the_guide(echo: labserver.ServerHandle) -> None:
    r = httpx.post(echo.url + "/", content=b"test [MASK]")
    assert r.status_code == 200
    assert r.json() == {"chars": 11}
    for h in (wire.HEADER_QUEUE_MS, wire.HEADER_COMPUTE_MS, wire.HEADER_SERVER_MS):
        assert float(r.headers[h]) >= 0
    assert int(r.headers[wire.HEADER_BATCH_SIZE]) == 1
    assert r.headers[wire.HEADER_DISPATCH] == "idle"


def test_predict_string_and_list(echo: labserver.ServerHandle) -> None:
    r = httpx.post(echo.url + "/predict", json={"inputs": "héllo"})
    assert r.json() == {"output": {"chars": 5}}
    r = httpx.post(echo.url + "/predict", json={"inputs": ["a", "bb", "ccc"]})
    assert r.json() == {"outputs": [{"chars": 1}, {"chars": 2}, {"chars": 3}]}
    assert echo.stats()["items_computed"] == 4


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/", b"", "empty body"),
        ("/", b"\xff\xfe bad", "UTF-8"),
        ("/", b"   ", "empty"),
        ("/predict", b"{not json", "malformed JSON"),
        ("/predict", b"[1, 2]", '"inputs"'),
        ("/predict", b'{"input": "typo"}', '"inputs"'),
        ("/predict", b'{"inputs": 3}', "string"),
        ("/predict", b'{"inputs": []}', "non-empty"),
        ("/predict", b'{"inputs": ["ok", null]}', '"inputs"[1]'),
        ("/predict", json.dumps({"inputs": ["x"] * 9}).encode(), "over the limit of 8"),
        ("/predict", json.dumps({"inputs": "y" * 1001}).encode(), "over the limit of 1000"),
    ],
)
def test_bad_input_is_400_and_server_keeps_serving(echo: labserver.ServerHandle, path: str, body: bytes,
                                                   fragment: str) -> None:
    r = httpx.post(echo.url + path, content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400, "bad_request")
    assert fragment in err["message"]
    assert httpx.post(echo.url + "/", content=b"still fine").status_code == 200


def test_body_over_limit_is_413(echo: labserver.ServerHandle) -> None:
    assert_error(httpx.post(echo.url + "/", content=b"x" * 5000), 413, "payload_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: the limit is enforced while reading
        for _ in range(10):
            yield b"y" * 1000

    assert_error(httpx.post(echo.url + "/", content=chunks()), 413, "payload_too_large")
    assert httpx.post(echo.url + "/", content=b"fine").status_code == 200


def test_404_405_are_json(echo: labserver.ServerHandle) -> None:
    assert_error(httpx.get(echo.url + "/nope"), 404, "not_found")
    assert_error(httpx.get(echo.url + "/"), 405, "method_not_allowed")


def test_health_stats_metrics(echo: labserver.ServerHandle) -> None:
    httpx.post(echo.url + "/", content=b"one")
    httpx.post(echo.url + "/", content=b"")
    assert httpx.get(echo.url + "/health").json()["status"] == "ok"
    stats = httpx.get(echo.url + "/stats", params={"batches": 5}).json()
    assert stats["statuses"] == {"200": 1, "400": 1}
    assert stats["batch_size_histogram"] == {"1": 1}
    assert stats["dispatch_reasons"] == {"idle": 1}
    assert stats["queue_depth"] == 0
    assert stats["recent_batches"][0]["size"] == 1
    text = httpx.get(echo.url + "/metrics").text
    assert 'labserver:responses_total{status="200"} 1.0' in text
    assert "labserver:batch_size_histogram_count 1.0" in text
    assert "labserver:request_seconds_count 1.0" in text


def test_503_with_retry_after_when_queue_is_full(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1, max_queue=1) as h, httpx.Client() as c:
        results: list[httpx.Response] = []
        first = threading.Thread(target=lambda: results.append(c.post(h.url + "/", content=b"first")))
        first.start()
        assert gate.entered.wait(10)  # "first" is in the model
        second = threading.Thread(target=lambda: results.append(c.post(h.url + "/", content=b"second")))
        second.start()
        wait_until(lambda: h.stats()["queue_depth"] == 1)
        t0 = time.perf_counter()
        r = c.post(h.url + "/", content=b"third")
        assert time.perf_counter() - t0 < 1.0  # at once, not after waiting
        assert_error(r, 503, "overloaded")
        assert r.headers["retry-after"] == "1"
        gate.gate.set()
        first.join()
        second.join()
        assert sorted(x.status_code for x in results) == [200, 200]
        assert gate.computed == ["first", "second"]


def test_504_when_deadline_passes_and_expired_never_computed(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1, timeout_ms=200) as h, httpx.Client() as c:
        results: dict[str, httpx.Response] = {}
        a = threading.Thread(target=lambda: results.setdefault("a", c.post(h.url + "/", content=b"a")))
        a.start()
        assert gate.entered.wait(10)
        r = c.post(h.url + "/", content=b"b")  # queued behind a batch that never ends in time
        assert_error(r, 504, "timeout")
        a.join()
        assert_error(results["a"], 504, "timeout")  # in the model past its deadline: 504 at the deadline
        gate.gate.set()
        wait_until(lambda: h.stats()["items_computed"] == 1)
        stats = h.stats()
        assert gate.computed == ["a"]  # "b" expired in the queue and never reached the model
        assert stats["computed_after_deadline"] == 0
        assert stats["statuses"]["504"] == 2


def test_poison_fails_alone_in_a_shared_batch(gate: GateModel) -> None:
    texts = ["good 1", f"bad {POISON}", "good 2", "good 3"]
    with labserver.serve("thread", gate, max_batch_size=8) as h, httpx.Client() as c:
        out: dict[str, httpx.Response] = {}
        warm = threading.Thread(target=lambda: c.post(h.url + "/", content=b"warm"))
        warm.start()
        assert gate.entered.wait(10)  # the model is busy, so the next four queue up together
        threads = [threading.Thread(target=lambda t=t: out.setdefault(t, c.post(h.url + "/", content=t.encode())))
                   for t in texts]
        for t in threads:
            t.start()
        wait_until(lambda: h.stats()["queue_depth"] == 4)
        gate.gate.set()
        for t in threads + [warm]:
            t.join()
    assert gate.calls[1] == texts or sorted(gate.calls[1]) == sorted(texts)  # one shared batch of 4
    for t in texts:
        if POISON in t:
            err = assert_error(out[t], 500, "model_error")
            assert "poison" not in err["message"]  # internals stay in the log
        else:
            assert out[t].status_code == 200
            assert out[t].headers[wire.HEADER_BATCH_SIZE] == "4"


def test_disconnected_client_is_dropped_before_compute(gate: GateModel) -> None:
    with labserver.serve("thread", gate, max_batch_size=1) as h, httpx.Client() as c:
        a = threading.Thread(target=lambda: c.post(h.url + "/", content=b"a"))
        a.start()
        assert gate.entered.wait(10)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(h.url + "/", content=b"leaver", timeout=httpx.Timeout(5, read=0.3))
        wait_until(lambda: h.stats()["statuses"].get("499") == 1)
        gate.gate.set()
        a.join()
        r = c.post(h.url + "/", content=b"c")
        assert r.status_code == 200
        assert gate.computed == ["a", "c"]
        assert h.stats()["skipped_client_gone"] == 1


def test_model_load_failure_is_503_not_a_crash() -> None:
    with pytest.raises(ModelLoadError, match="cannot load"):
        labserver.serve("thread", "/no/such/model-folder")
    with labserver.serve("thread", "/no/such/model-folder", wait=False) as h:
        wait_until(lambda: h.runtime.state != "loading")
        health = httpx.get(h.url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        err = assert_error(httpx.post(h.url + "/", content=b"x"), 503, "model_unavailable")
        assert "cannot load" in err["message"]


def test_worker_death_turns_health_503_and_answers_everyone() -> None:
    with labserver.serve("thread", CrashModel(), max_batch_size=1) as h:
        assert httpx.post(h.url + "/", content=b"fine").status_code == 200
        assert_error(httpx.post(h.url + "/", content=b"__crash__"), 503, "model_unavailable")
        assert httpx.get(h.url + "/health").status_code == 503
        assert_error(httpx.post(h.url + "/", content=b"after"), 503, "model_unavailable")


def test_debug_shows_tracebacks_only_when_on() -> None:
    for debug in (False, True):
        with labserver.serve("thread", "synthetic:0+0", debug=debug) as h:
            r = httpx.post(h.url + "/predict", json={"inputs": POISON})
            assert r.status_code == 500
            assert ("traceback" in r.json()["error"]) is debug


def test_event_loop_responsive_over_http_with_thread_not_naive() -> None:
    def health_during_compute(strategy: str) -> float:
        with labserver.serve(strategy, "synthetic:400+0") as h, httpx.Client() as c:
            t = threading.Thread(target=lambda: c.post(h.url + "/", content=b"slow"))
            t.start()
            wait_until(lambda: h.runtime.engine.in_flight or h.runtime.engine.counters.batches)
            t0 = time.perf_counter()
            httpx.get(h.url + "/health")
            took = time.perf_counter() - t0
            t.join()
            return took

    assert health_during_compute("naive") > 0.15  # waited behind the model
    assert health_during_compute("thread") < 0.15


def test_busy_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUse, match=f"{port}.*port=0"):
            labserver.serve("naive", "echo", port=port)


def test_start_stop_inside_a_running_event_loop() -> None:
    async def main() -> tuple[int, int]:
        # on the caller's own loop
        h = await labserver.serve_async("deadline", "echo")
        async with httpx.AsyncClient() as c:
            a = (await c.post(h.url + "/", content=b"on my loop")).status_code
        await h.astop()
        assert h.stopped
        # on its own thread, started from inside a running loop (as in a Jupyter cell)
        with labserver.serve("naive", "echo") as h2:
            async with httpx.AsyncClient() as c:
                b = (await c.post(h2.url + "/", content=b"own thread")).status_code
        assert h2.stopped
        return a, b

    assert asyncio.run(main()) == (200, 200)


def test_shutdown_answers_every_queued_client() -> None:
    # 200 ms per item: the queue stays full long enough to be seen even on a busy machine;
    # a 0.3 s grace lets one or two more finish, the rest must get 503
    h = labserver.serve("thread", "synthetic:200+0", max_batch_size=1, drain_grace_s=0.3)
    results: list[int | str] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        try:
            r = httpx.post(h.url + "/", content=f"r{i}".encode(), timeout=30)
            out: int | str = r.status_code
        except httpx.HTTPError as e:  # a clean close is acceptable; a hang is not
            out = type(e).__name__
        with lock:
            results.append(out)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: h.stats()["queue_depth"] >= 4)
    h.stop()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(results) == 8
    assert 200 in results and 503 in results  # some finished in the grace period, the rest got 503
    assert set(results) <= {200, 503}


def test_request_ids_are_unique_across_servers_in_one_process() -> None:
    """Two servers started one after the other in one kernel: "find it in the log" stays unambiguous."""
    ids = []
    for _ in range(2):
        with labserver.serve("naive", "echo") as h:
            ids += [httpx.post(h.url + "/", content=b"x").headers["x-request-id"] for _ in range(3)]
    assert len(set(ids)) == 6
    assert ids[0].split("-")[0] != ids[3].split("-")[0]  # a prefix per server start
