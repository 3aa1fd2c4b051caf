"""Connections a client cannot hold: the read deadline and the connection bound (server.connections).

Each test talks raw TCP to a real server on loopback: what is tested is what an idle or
dripping client gets, below any route.
"""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

import labserver
from labserver import wire

READ_S = 0.5  # the read deadline these servers get: short, so the tests wait little


def closed_by_server(s: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sent until it closed the connection, and when (s since now)."""
    t0, got = time.monotonic(), b""
    s.settimeout(within_s)
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {within_s} s (got {got[:80]!r})")
    return got, time.monotonic() - t0


@pytest.fixture(scope="module")
def server() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("thread", "synthetic:800+0", read_timeout_s=READ_S, port=0) as h:
        yield h


def connect(h: labserver.ServerHandle) -> socket.socket:
    return socket.create_connection((h.host, h.port), timeout=10)


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(server: labserver.ServerHandle) -> None:
    with connect(server) as s:
        got, after = closed_by_server(s, within_s=10)
    assert got == b"" and after >= READ_S * 0.8  # closed by the deadline, not at once


def test_headers_dripped_a_byte_at_a_time_do_not_keep_it_open(server: labserver.ServerHandle) -> None:
    with connect(server) as s:
        s.sendall(b"POST /predict HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        try:
            for _ in range(100):  # 10 s of one byte every 0.1 s: each byte would reset an idle timer
                s.sendall(b"x")
                time.sleep(0.1)  # the drip itself is the behaviour under test, not a wait for an event
        except OSError:  # the server closed it under us
            pass
        got, _ = closed_by_server(s, within_s=10)
        assert time.monotonic() - t0 < 5
    assert b"200" not in got[:16]


def test_a_body_that_never_finishes_is_a_client_gone(server: labserver.ServerHandle) -> None:
    with connect(server) as s:
        s.sendall(b"POST /predict HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"inputs\": ")
        closed_by_server(s, within_s=10)
    with httpx.Client(base_url=server.url, timeout=10) as c:  # and the server serves on
        assert c.post("/predict", json={"inputs": ["ok"]}).status_code == 200


def test_the_deadline_does_not_cut_an_answer_slower_than_it(server: labserver.ServerHandle) -> None:
    # the synthetic model takes 0.8 s a batch, past the 0.5 s deadline: reading ended before it
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/predict", json={"inputs": ["slow"]})
        assert r.status_code == 200, r.text
        assert float(r.headers[wire.HEADER_COMPUTE_MS]) >= 800 * 0.9
        assert c.post("/predict", json={"inputs": ["again"]}).status_code == 200  # the kept-alive connection too


def test_a_connection_past_the_bound_gets_503_and_is_closed() -> None:
    with labserver.serve("thread", "echo", max_connections=3, port=0) as h:
        held = [connect(h) for _ in range(3)]
        try:
            for s in held:  # each answered once: accepted and counted before the next one comes
                s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            with connect(h) as extra:
                got, _ = closed_by_server(extra, within_s=10)
            assert got.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in got and b'"overloaded"' in got
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 10  # the server sees the closes soon, not at once
        while True:
            try:
                assert httpx.get(h.url + "/health", timeout=5).status_code == 200
                break
            except (AssertionError, httpx.HTTPError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_two_thousand_half_open_connections_and_health_still_answers() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * 2000 + 512  # both ends live in this process
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        with labserver.serve("thread", "echo", read_timeout_s=3.0, port=0) as h:
            half = []
            try:
                for _ in range(2000):
                    s = connect(h)
                    s.sendall(b"GET /health HTTP/1.1\r\n")  # a request begun and never finished
                    half.append(s)
                t0 = time.monotonic()
                r = httpx.get(h.url + "/health", timeout=10)
                took = time.monotonic() - t0
                assert r.status_code == 200 and took < 1.0, took
                for s in half:  # and the deadline frees every one of them
                    closed_by_server(s, within_s=30)
            finally:
                for s in half:
                    s.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


LOWERED = """
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
{body}
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize("body, want", [
    ("from labserver.wire import allow_open_files; assert allow_open_files(1500) == 1500", 1500),
    ("from labserver.wire import allow_open_files; assert allow_open_files(100) == 256", 256),  # never lowered
    ("import labserver\nwith labserver.serve('thread', 'echo', port=0, max_connections=3000): pass", 3000 + 256),
    ("import labserver\nfrom labserver.loadgen import run_load_sync\n"
     "with labserver.serve('thread', 'echo', port=0, max_connections=100) as h:\n"
     "    run_load_sync(h.url, arrival='constant', rate_per_s=100, max_requests=3, max_in_flight=1500,"
     " process=False, progress=False)", 1500 + 64),
])
def test_a_process_may_open_a_file_per_connection_it_will_hold(body: str, want: int) -> None:
    """A desktop's usual soft limit (1,024, here 256) would fail a server's 4,096 connections or a
    load generator's window with EMFILE mid-run: both raise it as far as the hard limit allows."""
    import subprocess
    import sys

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"needs {want} file descriptors; the hard limit is {hard}")
    out = subprocess.run([sys.executable, "-c", LOWERED.format(body=body)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == want
