"""No orphans: whatever fails after a request's sequences were queued lets them go.

A sequence nobody will read must leave the running batch at the next step boundary, not
generate to its end. Each case below fails after the sequences were queued (the answer's
headers cannot be built, the stream cannot start, the client drops the stream once it
has the headers), on a real server on a loopback socket whose sequences would run for
20 s if nobody let them go; ``running`` in ``/stats`` must be back to 0 long before.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import labserver
from labserver import wire
from labserver.models import SyntheticGen

from .test_server import wait_until

LONG = 1000  # tokens at 20 ms a step: 20 s for an orphan
ROUTES = [(wire.GENERATE_PATH, {"prompt": "keeps on going", "max_new_tokens": LONG}),
          (wire.V1_COMPLETIONS_PATH, {"prompt": "keeps on going", "max_tokens": LONG, "n": 2})]
GONE_WITHIN_S = 5.0


@pytest.fixture
def slow() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", SyntheticGen(1, 20), max_batch_size=8, max_new_tokens=LONG,
                         drain_grace_s=0.0) as h:
        yield h


def outcomes(h: labserver.ServerHandle) -> int:
    return sum(h.stats()["statuses"].values())


def running_again(h: labserver.ServerHandle) -> None:
    wait_until(lambda: h.stats()["running"] == 0 and h.stats()["queue_depth"] == 0, GONE_WITHIN_S)
    r = httpx.post(h.url + wire.GENERATE_PATH, json={"prompt": "next one", "max_new_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["generated_tokens"] == 3  # and the server goes on


def name_replicas(h: labserver.ServerHandle, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sequence says it runs on replica ``name`` (what a router sets), which the answer's headers carry."""
    engine = h.runtime.engine
    submit = engine.submit

    def named(*args: Any, **kwargs: Any) -> Any:
        seq = submit(*args, **kwargs)
        seq.replica = name
        return seq

    monkeypatch.setattr(engine, "submit", named)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_header_that_cannot_be_built_lets_the_sequences_go(slow: labserver.ServerHandle, path: str,
                                                              body: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    name_replicas(slow, "r\N{SNOWMAN}", monkeypatch)  # not latin-1: the stream's response is never made
    r = httpx.post(slow.url + path, json={**body, "stream": True}, timeout=30)
    assert r.status_code == 500 and "Traceback" not in r.text
    monkeypatch.undo()
    running_again(slow)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_stream_that_cannot_start_lets_the_sequences_go(slow: labserver.ServerHandle, path: str,
                                                          body: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    name_replicas(slow, "r\x01", monkeypatch)  # a control character: the HTTP server refuses the headers
    before = outcomes(slow)
    with pytest.raises(httpx.HTTPError):  # the connection is closed: no status line was sent
        httpx.post(slow.url + path, json={**body, "stream": True}, timeout=30)
    monkeypatch.undo()
    running_again(slow)
    assert outcomes(slow) == before + 2  # that request counted once (and the one running_again sent)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_client_that_drops_the_stream_after_the_headers_lets_the_sequences_go(slow: labserver.ServerHandle,
                                                                                path: str,
                                                                                body: dict[str, Any]) -> None:
    payload = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection((slow.host, slow.port), timeout=10)
    s.sendall(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
              % (path.encode(), len(payload), payload))
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    s.close()
    running_again(slow)
    assert slow.stats()["statuses"]["499"] == 1


def test_a_stream_whose_client_left_while_its_headers_waited_lets_go_and_counts_499() -> None:
    # the ASGI side: the headers' write waits (a client that stopped reading: the transport paused writing)
    # when the client is found gone, so Starlette cancels the response before its loop ran (no finally of its own)
    from collections import Counter
    from types import SimpleNamespace

    from labserver.server.streaming import SeqStream

    async def main() -> tuple[list[Any], Counter[int], list[Any]]:
        loop = asyncio.get_running_loop()
        seqs = [SimpleNamespace(future=loop.create_future()) for _ in range(2)]
        rt = SimpleNamespace(statuses=Counter())
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message["type"])
            await asyncio.Event().wait()  # a paused write: never drained

        response = SeqStream(rt, seqs, "rid", 0.0, None, {})  # type: ignore[arg-type]  # (never rendered)
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return seqs, rt.statuses, sent

    seqs, statuses, sent = asyncio.run(main())
    assert sent == ["http.response.start"] and all(s.future.cancelled() for s in seqs) and statuses == {499: 1}
