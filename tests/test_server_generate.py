"""POST /generate on a real uvicorn server on a loopback socket: answers, streams, every error path."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import labserver
from labserver import wire
from labserver.models import SyntheticGen
from labserver.models import POISON
from labserver.models.base import generate_alone

from .fakes import CallLog, SteppedGen
from .test_server import assert_error, wait_until


@pytest.fixture
def gen() -> Iterator[labserver.ServerHandle]:
    model = SyntheticGen(1, 0.5, max_context=64)
    with labserver.serve("gen-continuous", model, max_batch_size=8, max_body_bytes=4096, max_chars=500,
                         max_new_tokens=40) as h:
        yield h


@pytest.fixture
def stepped() -> Iterator[tuple[labserver.ServerHandle, SteppedGen]]:
    model = SteppedGen()
    with labserver.serve("gen-continuous", model, max_batch_size=4, max_queue=2, timeout_ms=300) as h:
        yield h, model
        model.allow(10_000)  # never leave the model thread blocked behind a failed test


def events(lines: Iterator[str]) -> list[tuple[str, Any]]:
    """(event, data) pairs from an SSE line stream."""
    out, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[len("data: "):])))
    return out


def stream(url: str, body: dict[str, Any]) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    with httpx.stream("POST", url + wire.GENERATE_PATH, json={**body, "stream": True}, timeout=30) as r:
        return r, events(r.iter_lines()) if r.status_code == 200 else []


def test_json_answer(gen: labserver.ServerHandle) -> None:
    r = httpx.post(gen.url + "/generate", json={"prompt": "once upon a time", "max_new_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_tokens"] == len(body["tokens"]) == 7
    assert body["finish_reason"] == "length" and body["prompt_tokens"] == 4
    assert body["text"] == "".join(f" t{t}" for t in body["tokens"])
    assert body["note"].startswith("synthetic")
    timing = body["timing"]
    assert set(timing) == set(wire.TIMING_FIELDS)
    assert 0 <= timing["queue_ms"] <= timing["ttft_ms"] <= timing["server_ms"] and timing["decode_calls"] == 6
    assert r.headers[wire.HEADER_REQUEST_ID] and float(r.headers[wire.HEADER_SERVER_MS]) >= timing["ttft_ms"]


def test_stream_is_every_token_in_order_then_done(gen: labserver.ServerHandle) -> None:
    r, evs = stream(gen.url, {"prompt": "once upon a time", "max_new_tokens": 12})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = [k for k, _ in evs]
    assert kinds == ["token"] * 12 + ["done"]
    tokens = [d for k, d in evs if k == "token"]
    assert [t["index"] for t in tokens] == list(range(12))
    done = evs[-1][1]
    assert [t["id"] for t in tokens] == done["tokens"]
    assert "".join(t["text"] for t in tokens) == done["text"]
    # the same prompt without streaming gives the same tokens
    plain = httpx.post(gen.url + "/generate", json={"prompt": "once upon a time", "max_new_tokens": 12}).json()
    assert plain["tokens"] == done["tokens"]


def test_streams_interleave_and_each_is_complete(gen: labserver.ServerHandle) -> None:
    results: dict[int, list[tuple[str, Any]]] = {}

    def one(k: int) -> None:
        results[k] = stream(gen.url, {"prompt": f"prompt number {k}", "max_new_tokens": 5 + 3 * k})[1]

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for k, evs in results.items():
        assert [d["index"] for kind, d in evs if kind == "token"] == list(range(5 + 3 * k))
        assert evs[-1][0] == "done" and evs[-1][1]["generated_tokens"] == 5 + 3 * k
    assert gen.stats()["step_size_histogram"]  # they shared decode steps
    assert max(int(n) for n in gen.stats()["step_size_histogram"]) > 1


@pytest.mark.parametrize("body, fragment", [
    (b"", "empty body"),
    (b"{not json", "malformed JSON"),
    (b"\xff{}", "UTF-8"),
    (b'["prompt"]', '"prompt"'),
    (b'{"text": "hi"}', '"prompt"'),
    (b'{"prompt": 3}', "expected str"),
    (b'{"prompt": "   "}', "empty"),
    (b'{"prompt": "hi", "max_new_tokens": 0}', "between 1 and 40"),
    (b'{"prompt": "hi", "max_new_tokens": 41}', "between 1 and 40"),
    (b'{"prompt": "hi", "max_new_tokens": 2.5}', "expected int"),
    (b'{"prompt": "hi", "max_new_tokens": true}', "expected int"),
    (b'{"prompt": "hi", "stream": "yes"}', "expected bool"),
    (b'{"prompt": "hi", "max_tokens": 5}', "unknown field"),
    (json.dumps({"prompt": "w " * 30, "max_new_tokens": 40}).encode(), "context of 64"),
    (json.dumps({"prompt": "x" * 501}).encode(), "over the limit of 500"),
])
def test_bad_requests_are_400_and_the_server_goes_on(gen: labserver.ServerHandle, body: bytes, fragment: str) -> None:
    r = httpx.post(gen.url + "/generate", content=body, headers={"content-type": "application/json"})
    error = assert_error(r, 400, "bad_request")
    assert fragment in error["message"]
    assert httpx.post(gen.url + "/generate", json={"prompt": "still here", "max_new_tokens": 2}).status_code == 200


def test_body_limit_is_413(gen: labserver.ServerHandle) -> None:
    assert_error(httpx.post(gen.url + "/generate", json={"prompt": "x" * 5000}), 413, "payload_too_large")


def test_poisoned_prompt_is_500_before_any_token(gen: labserver.ServerHandle) -> None:
    r = httpx.post(gen.url + "/generate", json={"prompt": f"a {POISON} prompt", "stream": True})
    assert_error(r, 500, "model_error")
    assert httpx.post(gen.url + "/generate", json={"prompt": "fine", "max_new_tokens": 2}).status_code == 200


def test_wrong_endpoint_for_the_kind_of_strategy(gen: labserver.ServerHandle) -> None:
    assert "/generate" in assert_error(httpx.post(gen.url + "/predict", json={"inputs": "x"}), 400,
                                       "bad_request")["message"]
    with labserver.serve("thread", "synthetic:0+0") as enc:
        msg = assert_error(httpx.post(enc.url + "/generate", json={"prompt": "x"}), 400, "bad_request")["message"]
        assert "gen-" in msg


def test_encoder_model_under_a_generation_strategy_fails_to_load_clearly() -> None:
    with labserver.serve("gen-continuous", "synthetic:0+0", wait=False) as h:
        wait_until(lambda: h.runtime.state != "loading")
        health = httpx.get(h.url + "/health")
        assert health.status_code == 503 and "generative model" in health.json()["error"]
        assert_error(httpx.post(h.url + "/generate", json={"prompt": "x"}), 503, "model_unavailable")


def test_queue_cap_503_and_deadline_504(stepped: tuple[labserver.ServerHandle, SteppedGen]) -> None:
    h, model = stepped
    first: dict[str, Any] = {}
    t = threading.Thread(target=lambda: first.update(r=httpx.post(
        h.url + "/generate", json={"prompt": "holds the model", "max_new_tokens": 3}, timeout=30)))
    t.start()
    model.wait_entered()  # its first decode step is in the model: the batch is busy...
    # ...but gen-continuous admits others at the next boundary, which never comes until we allow it
    waiting = [threading.Thread(target=lambda: httpx.post(h.url + "/generate", json={"prompt": "q"}, timeout=30))
               for _ in range(2)]
    for w in waiting:
        w.start()
    wait_until(lambda: h.stats()["queue_depth"] == 2)
    r = httpx.post(h.url + "/generate", json={"prompt": "no room"})
    assert_error(r, 503, "overloaded")
    assert r.headers["retry-after"] == "1"
    started = time.perf_counter()
    for w in waiting:
        w.join(30)
    assert time.perf_counter() - started < 5  # both answered 504 at their 300 ms deadline, not left hanging
    assert h.stats()["statuses"]["504"] == 2
    model.allow(10)
    t.join(30)
    assert first["r"].status_code == 200 and first["r"].json()["generated_tokens"] == 3
    assert h.stats()["expired_in_queue"] + h.stats()["skipped_client_gone"] == 2  # never prefilled


def test_client_leaving_mid_stream_stops_its_decoding(stepped: tuple[labserver.ServerHandle, SteppedGen]) -> None:
    h, model = stepped
    received = 0
    with httpx.stream("POST", h.url + "/generate", json={"prompt": "leaves early", "max_new_tokens": 500,
                                                        "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        while received < 3:
            line = next(lines)
            if line.startswith("event: token"):
                received += 1
                model.allow()  # one more step
    # the response is closed: the client is gone. The server notices (its future is cancelled)...
    engine = h.runtime.engine
    wait_until(lambda: all(s.future.done() for s in engine.running.seqs))
    n_begun = len([1 for kind, _ in model.calls if kind == "decode"]) + 1  # + the step waiting in the model
    # ...and drops it at the next step boundary: no step that begins from now on has it
    model.allow(20)
    other = httpx.post(h.url + "/generate", json={"prompt": "after", "max_new_tokens": 4}, timeout=30)
    assert other.status_code == 200
    decodes = [ids for kind, ids in model.calls if kind == "decode"]
    assert decodes[n_begun:] and all(1 not in ids for ids in decodes[n_begun:])
    assert sum(1 in ids for ids in decodes) <= 4  # the 3 steps whose tokens it read, plus the one in flight
    wait_until(lambda: h.stats()["left_while_generating"] == 1)
    wait_until(lambda: model.cached == 0)  # (its KV is released just after it is counted, on the model's thread)


# -- the same on the small real model (GPT-2 shape, random weights, our slot KV cache) -------------

@pytest.fixture(scope="module")
def tiny() -> Any:
    from labserver.models import load_model

    return load_model("gpt2-tiny-random", device="cpu")


def test_real_model_streams_every_token_in_order_and_matches_offline(tiny: Any) -> None:
    prompts = [f"the quick brown fox number {k} jumps" for k in range(5)]
    with labserver.serve("gen-continuous", tiny, max_batch_size=4) as h:
        results: dict[int, list[tuple[str, Any]]] = {}

        def one(k: int) -> None:
            results[k] = stream(h.url, {"prompt": prompts[k], "max_new_tokens": 10 + 7 * k, "ignore_eos": True})[1]

        threads = [threading.Thread(target=one, args=(k,)) for k in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert max(int(n) for n in h.stats()["step_size_histogram"]) > 1  # they shared steps
    for k, evs in results.items():
        tokens = [d for kind, d in evs if kind == "token"]
        assert [t["index"] for t in tokens] == list(range(10 + 7 * k)) and evs[-1][0] == "done"
        assert [t["id"] for t in tokens] == evs[-1][1]["tokens"]
        assert "random weights" in evs[-1][1]["note"]
    # the served tokens are the model's own greedy tokens, whoever shared the steps
    sid = 10_000
    for k, prompt in enumerate(prompts):
        out = generate_alone(tiny, tiny.encode(prompt), 10 + 7 * k, sid=sid + k)
        assert out == results[k][-1][1]["tokens"], k


def test_real_model_client_leaving_mid_stream_is_not_decoded_to_the_end(tiny: Any) -> None:
    logged = CallLog(tiny)  # (sequence ids start at 1 in every server)
    with labserver.serve("gen-continuous", logged, max_batch_size=4) as h:
        other: dict[str, Any] = {}
        t = threading.Thread(target=lambda: other.update(evs=stream(h.url, {"prompt": "stays", "max_new_tokens": 300,
                                                                            "ignore_eos": True})[1]))
        t.start()
        with httpx.stream("POST", h.url + "/generate", json={"prompt": "leaves", "max_new_tokens": 400,
                                                            "stream": True, "ignore_eos": True}, timeout=30) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("event: token")
                if seen == 5:
                    break
        wait_until(lambda: h.stats()["left_while_generating"] == 1)
        t.join(60)
        assert len([d for k, d in other["evs"] if k == "token"]) == 300  # the other one went on to its end
    decoded = sorted(sum(sid in ids for kind, ids in logged.calls if kind == "decode") for sid in (1, 2))
    assert decoded[1] == 299  # the one that stayed: a prefill and 299 steps
    assert decoded[0] < 200  # the leaver: dropped long before its 400 tokens (exactly when: the stepped test)
    assert tiny.cached == 0


def test_real_model_refuses_what_does_not_fit(tiny: Any) -> None:
    with labserver.serve("gen-continuous", tiny, max_kv_tokens=100) as h:
        msg = assert_error(httpx.post(h.url + "/generate", json={"prompt": "word " * 600}), 400, "bad_request")
        assert "512" in msg["message"]  # the tiny model's context
        msg = assert_error(httpx.post(h.url + "/generate", json={"prompt": "hi", "max_new_tokens": 200}), 400,
                           "bad_request")
        assert "max_kv_tokens" in msg["message"]
        assert httpx.post(h.url + "/generate", json={"prompt": "hi", "max_new_tokens": 20}).status_code == 200


def metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_the_503s_of_a_generation_server() -> None:
    """As a new user tries it: a slow generator, a queue of 2, one at a time, 20 clients at once."""
    import asyncio

    with labserver.serve("gen-continuous", "synthetic-gen:50+50", max_queue=2, max_batch_size=1) as h:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as client:
                answers = await asyncio.gather(*(client.post(h.url + "/generate",
                                                             json={"prompt": f"hello {k}", "max_new_tokens": 2})
                                                 for k in range(20)))
            return [r.status_code for r in answers]

        statuses = asyncio.run(burst())
        rejected = statuses.count(503)
        assert rejected >= 10 and set(statuses) <= {200, 503}
        page = httpx.get(h.url + "/metrics").text
        assert metric(page, "labserver:rejected_overload_total") == rejected
        assert metric(page, 'labserver:responses_total{status="503"}') == rejected
        assert metric(page, "labserver:tokens_generated_total") == 2 * statuses.count(200)
        assert httpx.get(h.url + "/stats").json()["rejected_overload"] == rejected
