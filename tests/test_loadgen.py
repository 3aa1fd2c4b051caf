"""The load generator against a small stub server on a loopback socket.

The stub is a Starlette app under a real uvicorn server, either in a background
thread (most tests) or as a task on the test's own event loop (to show what an
inline model does to a client that shares its loop). A request whose body is
``stall:<seconds>`` blocks the server's event loop with time.sleep, the way a model
called inline in an async handler does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from labserver import wire
from labserver.analysis import summarize
from labserver.load.arrivals import WordTexts
from labserver.load.clients import check_target
from labserver.loadgen import RECORD_COLUMNS, LoadResult, LoadSpec, run_load, run_load_sync
from labserver.load.worker import timer_late_fraction

HEADERS = {
    wire.HEADER_QUEUE_MS: "1.5", wire.HEADER_COMPUTE_MS: "2.25", wire.HEADER_BATCH_SIZE: "4",
    wire.HEADER_DISPATCH: "full", wire.HEADER_SERVER_MS: "3.75",
}
FAST = dict(process=False, progress=False)  # in-process: quick to start, for behaviour tests


def make_app(seen: list[dict]) -> Starlette:
    async def echo(request: Request):
        body = await request.body()
        seen.append({"path": request.url.path, "body": body, "port": request.client.port,
                     "content_type": request.headers.get("content-type")})
        if body.startswith(b"stall:"):
            time.sleep(float(body[6:]))  # blocks this server's loop, like an inline model
        n = len(seen)
        headers = {**HEADERS, wire.HEADER_BATCH_ID: str(n), wire.HEADER_REQUEST_ID: f"req-{n}"}
        return PlainTextResponse(str(len(body)), headers=headers)

    async def predict(request: Request):
        data = await request.json()
        seen.append({"path": request.url.path, "json": data,
                     "content_type": request.headers.get("content-type")})
        return JSONResponse({"chars": len(data["inputs"])}, headers=HEADERS)

    async def bare(request: Request):
        return PlainTextResponse("no timing headers here")

    async def slow(request: Request):
        await asyncio.sleep(float(request.query_params["s"]))
        return PlainTextResponse("late")

    async def health(request: Request):
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/", echo, methods=["POST"]), Route("/predict", predict, methods=["POST"]),
        Route("/bare", bare, methods=["POST"]), Route("/slow", slow, methods=["POST"]),
        Route("/health", health),
    ])


def listening_socket() -> socket.socket:
    # Bound and listening before the server starts, so clients can never race its startup.
    # proto=IPPROTO_TCP matters: asyncio and uvloop set TCP_NODELAY on accepted connections
    # only then, and without it each keep-alive response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def make_server(app, keep_alive_s: float = 5) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", ws="none",
                            http="httptools", loop="asyncio", timeout_graceful_shutdown=1,
                            timeout_keep_alive=keep_alive_s)
    return uvicorn.Server(config)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """A uvicorn server for ``app`` on its own thread, on a loopback port; yields its URL."""
    sock = listening_socket()
    server = make_server(app)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


class Stub:
    def __init__(self, url: str, seen: list[dict]):
        self.url, self.seen = url, seen


@pytest.fixture(scope="module")
def stub():
    seen: list[dict] = []
    with serving(make_app(seen)) as url:
        yield Stub(url, seen)


@contextlib.asynccontextmanager
async def stub_on_this_loop(keep_alive_s: float = 5):
    """The stub served by a task on the caller's loop, as a notebook's inline server is."""
    seen: list[dict] = []
    sock = listening_socket()
    server = make_server(make_app(seen), keep_alive_s)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield Stub(f"http://127.0.0.1:{sock.getsockname()[1]}", seen)
    finally:
        server.should_exit = True
        await task
        sock.close()


def stall_at(index: int, stall_s: float, n: int = 200) -> list[str]:
    return ["x"] * index + [f"stall:{stall_s}"] + ["x"] * n


def assert_record_shape(records: pd.DataFrame) -> None:
    assert list(records.columns) == list(RECORD_COLUMNS)
    for col, dtype in RECORD_COLUMNS.items():  # pandas < 3 keeps text in object columns
        assert str(records[col].dtype) in (("str", "object") if dtype == "str" else (dtype,)), col


def fell_behind(result: LoadResult) -> bool:
    return any("fell behind" in w for w in result.warnings)


# --- records ---------------------------------------------------------------------------

@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_server_headers_become_columns_and_missing_ones_are_nan(stub, client):
    with_headers = run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=10,
                                 client=client, **FAST)
    r = with_headers.records
    assert_record_shape(r)
    assert (r["status"] == 200).all() and (r["error"] == "").all()
    assert with_headers.meta["target_rate"] == pytest.approx(200)
    assert (r["queue_ms"] == 1.5).all() and (r["compute_ms"] == 2.25).all()
    assert (r["server_ms"] == 3.75).all() and (r["batch_size"] == 4).all()
    assert (r["dispatch"] == "full").all()
    assert r["batch_id"].is_unique and r["request_id"].str.startswith("req-").all()
    assert (r["request_id"] == "req-" + r["batch_id"].astype(str)).all()

    bare = run_load_sync(stub.url, path="/bare", arrival="constant", rate_per_s=200, max_requests=5,
                         client=client, **FAST).records
    assert (bare["status"] == 200).all()
    for col in ("queue_ms", "compute_ms", "server_ms", "batch_size", "batch_id", "dispatch", "request_id",
                "input_tokens"):
        assert bare[col].isna().all(), col
    assert_record_shape(bare)


def test_json_mode_posts_inputs_to_predict(stub):
    before = len(stub.seen)
    result = run_load_sync(stub.url, mode="json", payload=WordTexts(mean_words=8), seed=7,
                           arrival="poisson", rate_per_s=300, max_requests=20, **FAST)
    got = stub.seen[before:]
    assert [s["path"] for s in got] == ["/predict"] * 20
    assert {s["content_type"] for s in got} == {"application/json"}
    sent_chars = sorted(len(s["json"]["inputs"]) for s in got)
    assert sorted(result.records["input_chars"]) == sent_chars
    assert result.meta["target_url"].endswith("/predict")


def test_text_mode_posts_plain_text(stub):
    before = len(stub.seen)
    run_load_sync(stub.url, payload="héllo", arrival="constant", rate_per_s=100, max_requests=3, **FAST)
    got = stub.seen[before:]
    assert [(s["path"], s["body"]) for s in got] == [("/", "héllo".encode())] * 3
    assert got[0]["content_type"].startswith("text/plain")


# --- coordinated omission ---------------------------------------------------------------

def test_latency_from_schedule_exposes_a_stall_that_send_latency_hides(stub):
    """One request stalls the server for 0.3 s. A client that can only have one request
    in flight (like a closed-loop user) sends the next ones late, after the stall; timed
    from their actual sends they look fast, timed from their schedule they are not."""
    stall_s, gap_s = 0.3, 0.02
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=1 / gap_s, duration_s=1.0,
                           payload=stall_at(10, stall_s), max_in_flight=1, overflow="wait", **FAST)
    r = result.records.set_index("i")
    stalled = r.loc[10]
    assert stalled["late_ms"] < 50  # it went out on time...
    assert stalled["send_latency_ms"] >= stall_s * 1e3 - 10  # ...and both views see its wait
    assert stalled["latency_ms"] >= stall_s * 1e3 - 10

    behind = r[(r["scheduled_s"] > stalled["scheduled_s"]) & (r["scheduled_s"] < stalled["done_s"])]
    assert len(behind) >= 13  # scheduled 0.22 .. 0.48 s
    assert (behind["sent_s"] > stalled["done_s"]).all()  # they waited for the slot
    wait_ms = (stalled["done_s"] - behind["scheduled_s"]) * 1e3
    assert (behind["latency_ms"] >= wait_ms).all()  # the schedule-based latency counts the wait
    assert (behind["send_latency_ms"] < 100).all()  # the naive one does not

    naive_slow = (r["send_latency_ms"] > 100).sum()
    honest_slow = (r["latency_ms"] > 100).sum()
    assert naive_slow == 1  # a naive client reports one slow request...
    assert honest_slow >= 10  # ...where 0.2 s worth of scheduled requests were slow
    np.testing.assert_allclose(r["latency_ms"], r["send_latency_ms"] + r["late_ms"])
    assert fell_behind(result) and "max_in_flight=1" in " ".join(result.warnings)


def test_open_loop_without_a_limit_sends_through_the_stall(stub):
    """The same stall with no in-flight limit: sends stay on time, so both latencies agree
    and every request scheduled during the stall shows it."""
    stall_s = 0.3
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=50, duration_s=1.0,
                           payload=stall_at(10, stall_s), **FAST)
    r = result.records.set_index("i")
    assert r["late_ms"].max() < 50
    during = r[(r["scheduled_s"] > r.loc[10, "scheduled_s"]) & (r["scheduled_s"] < 0.2 + stall_s - 0.05)]
    assert len(during) >= 10
    assert (during["send_latency_ms"] > 40).all()
    assert (r["send_latency_ms"] > 100).sum() >= 10


# --- warm-up, lateness, overflow ---------------------------------------------------------

def test_warmup_rows_are_kept_flagged_and_left_out_of_summaries(stub):
    # a 0.1 s stall at 0.05 s, queued behind one slot, slows only warm-up requests
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=100, duration_s=0.5, warmup_s=0.2,
                           payload=stall_at(5, 0.1), max_in_flight=1, overflow="wait", **FAST)
    r = result.records
    assert len(r) == 50
    assert r["warmup"].tolist() == [True] * 20 + [False] * 30
    assert result.meta["n_warmup"] == 20 and result.meta["n_measured"] == 30
    summary = result.summary()
    assert summary["count"] == 30 and summary["n_warmup"] == 20
    # one summary: the result's is analysis.summarize's, entry for entry
    again = summarize(result.records, meta=result.meta, tokens=result.tokens).to_dict()
    pd.testing.assert_series_equal(pd.Series(summary), pd.Series(again))
    assert r.loc[r["warmup"], "latency_ms"].max() >= 90
    assert summary["max_ms"] < 60
    # the sends held back during warm-up do not count towards the generator's lateness
    assert (r.loc[r["warmup"], "late_ms"] > 50).sum() >= 5
    assert result.meta["late_ms_max"] < 50


def test_warns_when_an_inline_server_stalls_a_generator_on_its_loop(caplog):
    """The reason process mode is the default: a client sharing the server's loop is
    frozen by an inline model, so its sends go out late."""

    async def main():
        async with stub_on_this_loop() as server:
            return await run_load(server.url, arrival="constant", rate_per_s=100, duration_s=1.0,
                                  payload=stall_at(10, 0.25), **FAST)

    with caplog.at_level(logging.WARNING, logger="labserver.loadgen"):
        result = asyncio.run(main())
    r = result.records.set_index("i")
    frozen = r[(r["scheduled_s"] > 0.11) & (r["scheduled_s"] < 0.3)]
    assert (frozen["late_ms"] > 50).all()
    assert fell_behind(result)
    assert result.meta["late_fraction"] > 0.1
    assert any("fell behind" in rec.getMessage() for rec in caplog.records)


def test_process_mode_is_immune_to_an_inline_stall_and_matches_in_process_records():
    async def main():
        async with stub_on_this_loop() as server:
            spawned = await run_load(server.url, arrival="constant", rate_per_s=100, duration_s=1.0,
                                     payload=stall_at(10, 0.25), process=True, processes=2, progress=False)
            here = await run_load(server.url, arrival="constant", rate_per_s=100, max_requests=5, **FAST)
            return spawned, here

    spawned, here = asyncio.run(main())
    r = spawned.records
    assert list(r.columns) == list(here.records.columns)
    assert (r.dtypes == here.records.dtypes).all()
    assert r["i"].tolist() == list(range(100))
    assert (r["process"] == r["i"] % 2).all()  # the schedule is dealt round-robin
    assert spawned.meta["processes"] == 2
    during = r[(r["scheduled_s"] > 0.11) & (r["scheduled_s"] < 0.3)]
    assert (during["late_ms"] < 50).all()  # the stall did not reach the client...
    assert (during["latency_ms"] > 40).all()  # ...but it shows in the latencies


def test_no_late_warning_at_a_modest_rate(stub):
    # On a shared machine other processes can preempt the generator for a few ms at a time:
    # then the warning is right, and the machine is to blame. So a failing attempt is retried,
    # and after three the test only fails if a bare timer loop keeps time here.
    for attempt in range(3):
        result = run_load_sync(stub.url, arrival="poisson", rate_per_s=100, duration_s=1.5, seed=attempt,
                               progress=False)
        assert result.meta["n_requests"] > 100
        assert (result.records["status"] == 200).all()
        assert result.meta["achieved_send_rate_per_s"] == pytest.approx(
            result.meta["scheduled_rate_per_s"], rel=0.02)
        if not fell_behind(result):
            return
    if (noise := timer_late_fraction()) > 0.01:
        pytest.skip(f"this machine wakes even a bare timer loop late {noise:.1%} of the time")
    pytest.fail(f"the generator fell behind at 100 requests/s: {result.warnings}")


def test_overflow_is_recorded_not_queued(stub):
    result = run_load_sync(stub.url + "/slow?s=0.3", arrival="constant", rate_per_s=100, max_requests=10,
                           max_in_flight=3, **FAST)
    r = result.records
    assert (r["error"] == "client_overflow").sum() == 7
    assert r.loc[r["error"] == "client_overflow", "sent_s"].isna().all()
    assert (r.loc[r["error"] == "", "status"] == 200).sum() == 3
    assert any("client_overflow" in w for w in result.warnings)


def test_an_overflow_is_not_also_reported_as_late_sends(stub):
    """Requests the client did not send lower the sent rate; the sends it made were on time."""
    result = run_load_sync(stub.url + "/slow?s=0.3", arrival="constant", rate_per_s=100, max_requests=60,
                           max_in_flight=3, **FAST)
    r = result.records
    sent = r[r["sent_s"].notna()]
    assert (r["error"] == "client_overflow").sum() > 40
    assert result.meta["achieved_send_rate_per_s"] < 0.5 * result.meta["scheduled_rate_per_s"]
    assert (sent["late_ms"] < 50).all()
    assert any("client_overflow" in w for w in result.warnings)
    assert not fell_behind(result), result.warnings


# --- errors and ends ---------------------------------------------------------------------

@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_failures_get_short_error_kinds(stub, client):
    timeouts = run_load_sync(stub.url + "/slow?s=2", arrival="constant", rate_per_s=100, max_requests=2,
                             timeout_s=0.2, client=client, **FAST).records
    assert timeouts["error"].tolist() == ["timeout"] * 2 and (timeouts["status"] == 0).all()
    assert timeouts["send_latency_ms"].between(150, 1500).all()

    closed = listening_socket()
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    refused = run_load_sync(f"http://127.0.0.1:{port}", arrival="constant", rate_per_s=100,
                            max_requests=2, client=client, **FAST).records
    assert refused["error"].tolist() == ["connect"] * 2

    cut = run_load_sync(stub.url + "/slow?s=5", arrival="constant", rate_per_s=100, max_requests=3,
                        drain_s=0.1, client=client, **FAST)
    assert cut.records["error"].tolist() == ["cancelled"] * 3
    assert cut.meta["elapsed_s"] < 3
    assert any("cancelled" in w for w in cut.warnings)


def test_closed_loop_users_keep_their_connections_and_think(stub):
    before = len(stub.seen)
    result = run_load_sync(stub.url, users=2, max_requests=20, think_s=0.02, **FAST)
    r = result.records
    assert len(r) == 20 and (r["status"] == 200).all()
    assert r["i"].tolist() == list(range(20))
    assert len({s["port"] for s in stub.seen[before:]}) == 2  # keep-alive: one socket per user
    assert result.meta["loop"] == "closed" and result.meta["concurrency"] == 2
    assert (r["late_ms"] < 50).all()
    # a user's next send is scheduled think_s after its previous answer
    gaps = r["scheduled_s"].sort_values().to_numpy()[2:] - np.sort(r["done_s"].to_numpy())[:-2]
    assert np.median(gaps) == pytest.approx(0.02, abs=0.01)


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_connections_the_server_closed_while_idle_are_not_reused(client):
    async def main():
        async with stub_on_this_loop(keep_alive_s=0.1) as server:  # closes idle sockets after 0.1 s
            return await run_load(server.url, users=1, think_s=0.3, max_requests=3, client=client,
                                  timeout_s=5, **FAST), server.seen

    result, seen = asyncio.run(main())
    r = result.records
    assert (r["status"] == 200).all() and (r["error"] == "").all()
    assert (r["send_latency_ms"] < 500).all()  # no request waited for a dead socket
    assert len({s["port"] for s in seen}) == 3  # each one needed a fresh connection


def test_probes_see_a_server_stall_from_the_side(stub):
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=20, duration_s=0.8,
                           payload=stall_at(4, 0.3), probe_interval_s=0.02, **FAST)
    p = result.probes
    assert list(p.columns) == ["t_s", "latency_ms", "status", "error"]
    assert len(p) >= 20 and (p["status"] == 200).all()
    stall_start = result.records.set_index("i").loc[4, "sent_s"]
    hit = p[(p["t_s"] > stall_start + 0.01) & (p["t_s"] < stall_start + 0.2)]
    assert len(hit) >= 5 and (hit["latency_ms"] > 80).all()
    assert p["latency_ms"].min() < 20


# --- guard, sync helper, persistence -----------------------------------------------------

@pytest.mark.parametrize("url", ["http://example.com/", "http://10.0.0.1:8000", "http://192.168.1.5",
                                 "http://[2001:db8::1]:80/", "http://localhost.example.com",
                                 "http://127.0.0.1.nip.io"])
def test_non_loopback_targets_are_refused(url):
    with pytest.raises(ValueError, match="allow_remote"):
        run_load_sync(url, rate_per_s=10, max_requests=1, **FAST)
    assert check_target(url, allow_remote=True)  # opting in passes the guard (nothing is sent here)


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "http://127.9.8.7", "http://[::1]:8000",
                                 "http://localhost:8000/predict"])
def test_loopback_targets_pass_the_guard(url):
    assert check_target(url)[1] in url


def test_progress_bar_goes_to_stderr(stub, capsys):
    run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=20, process=False, progress=True)
    assert "20/20" in capsys.readouterr().err


def test_sync_helper_works_inside_a_running_loop(stub):
    async def notebook_cell():  # a Jupyter cell runs on a thread whose loop is already running
        assert asyncio.get_running_loop()
        return run_load_sync(stub.url, arrival="constant", rate_per_s=200, max_requests=10, **FAST)

    result = asyncio.run(notebook_cell())
    assert len(result.records) == 10 and (result.records["status"] == 200).all()


def test_spec_can_be_reused_with_changes(stub):
    spec = LoadSpec(stub.url, arrival="constant", rate_per_s=200, max_requests=4, **FAST)
    result = run_load_sync(spec, max_requests=6)
    assert len(result.records) == 6 and result.meta["max_requests"] == 6
    with pytest.raises(ValueError, match="bounded"):
        LoadSpec(stub.url, rate_per_s=10)
    with pytest.raises(ValueError, match="either users"):
        LoadSpec(stub.url, users=2, arrival="poisson", duration_s=1)


def test_csv_round_trip_keeps_records_meta_and_probes(stub, tmp_path):
    result = run_load_sync(stub.url, arrival="constant", rate_per_s=100, duration_s=0.3, warmup_s=0.1,
                           probe_interval_s=0.05, **FAST)
    bare = run_load_sync(stub.url, path="/bare", arrival="constant", rate_per_s=100, max_requests=3, **FAST)
    both = LoadResult(pd.concat([result.records, bare.records], ignore_index=True), result.meta,
                      ["a warning"], result.probes)
    path = both.to_csv(tmp_path / "run.csv")
    back = LoadResult.from_csv(path)
    pd.testing.assert_frame_equal(back.records, both.records)
    assert back.meta == json.loads(json.dumps(both.meta, default=repr))
    assert back.warnings == ["a warning"]
    pd.testing.assert_frame_equal(back.probes, both.probes, check_dtype=False)
