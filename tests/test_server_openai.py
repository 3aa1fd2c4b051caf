"""The /v1 routes on the wire: exact stream framing, fields accepted, refused and ignored, every error path.

Most tests run a real uvicorn server on a loopback socket with a synthetic generator
(known tokens, no compute); ``TextStream`` and ``parse_request`` are also tested alone.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import labserver
from labserver import wire
from labserver.models import SyntheticGen
from labserver.server.handling import ClientError
from labserver.server.openai.params import MIN_TEMPERATURE, parse_request, render_chat
from labserver.engine.output import Detokenizer
from labserver.server.openai.text import TextStream

from .fakes import SteppedGen
from .test_server import wait_until

NAME = "synthetic-gen:1+0.5"


@pytest.fixture(scope="module")
def gen() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", SyntheticGen(1, 0.5, max_context=64), max_batch_size=8,
                         max_body_bytes=4096, max_new_tokens=40, max_prompts=4) as h:
        yield h


@pytest.fixture
def stepped() -> Iterator[tuple[labserver.ServerHandle, SteppedGen]]:
    model = SteppedGen()
    with labserver.serve("gen-continuous", model, max_batch_size=4, max_queue=2, timeout_ms=300) as h:
        yield h, model
        model.allow(10_000)


def assert_openai_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    assert "Traceback" not in r.text and r.headers[wire.HEADER_REQUEST_ID]
    return body["error"]


def raw_stream(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
        r.read()
        return r, r.content


def chunks(raw: bytes) -> list[Any]:
    """Every event of an OpenAI stream, checked for the exact framing: ``data: ...`` and a blank line."""
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]", raw[-200:]
    out = []
    for event in events[:-2]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        out.append(json.loads(event[6:]))
    return out


# -- the stream, exactly ------------------------------------------------------------------------

def test_completion_stream_framing_and_usage(gen: labserver.ServerHandle) -> None:
    r, raw = raw_stream(gen.url, wire.V1_COMPLETIONS_PATH, {"model": NAME, "prompt": "one two three",
                                                            "max_tokens": 6, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = chunks(raw)
    assert len(evs) == 7  # one per token, then the usage
    assert all(e["object"] == "text_completion" and e["model"] == NAME and e["id"] == evs[0]["id"] for e in evs)
    assert all(e["usage"] is None for e in evs[:-1]) and evs[-1]["choices"] == []
    assert evs[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 0}}
    assert [e["choices"][0]["finish_reason"] for e in evs[:-1]] == [None] * 5 + ["length"]
    whole = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "one two three", "max_tokens": 6}).json()
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == whole["choices"][0]["text"]


def test_chat_stream_first_delta_carries_the_role(gen: labserver.ServerHandle) -> None:
    _, raw = raw_stream(gen.url, wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3})
    evs = chunks(raw)
    assert [e["object"] for e in evs] == ["chat.completion.chunk"] * 3 and "usage" not in evs[0]
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant" and evs[0]["choices"][0]["delta"]["content"]
    assert all(set(e["choices"][0]["delta"]) == {"content"} for e in evs[1:])


def test_several_prompts_are_several_choices(gen: labserver.ServerHandle) -> None:
    body = {"prompt": ["a b", "c d e", "f"], "max_tokens": 4}
    whole = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["prompt_tokens"] == 6 and whole["usage"]["completion_tokens"] == 12
    _, raw = raw_stream(gen.url, wire.V1_COMPLETIONS_PATH, body)
    texts = ["", "", ""]
    for e in chunks(raw):
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in whole["choices"]]


def test_token_id_prompts_are_answered_as_their_text(gen: labserver.ServerHandle) -> None:
    """vLLM's token-id prompts (lm-eval's local-completions sends them): one list of ids, or a list of such lists;
    the same answer as the text they encode, the prompt counted as sent, echo showing its text."""
    model = SyntheticGen(1, 0.5)
    ids = [model.encode(t) for t in ("one two three", "four five")]
    as_text = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH,
                         json={"prompt": ["one two three", "four five"], "max_tokens": 5}).json()
    for prompt in (ids[0], ids):
        r = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": prompt, "max_tokens": 5, "echo": True})
        assert r.status_code == 200, r.text
        body = r.json()
        several = isinstance(prompt[0], list)
        assert body["usage"]["prompt_tokens"] == (sum(map(len, ids)) if several else len(ids[0]))
        for choice, expected, sent in zip(body["choices"], as_text["choices"], ids if several else [ids[0]]):
            assert choice["text"] == model.text(sent) + expected["text"]  # echoed as its text, then the same answer
    floats = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": [float(t) for t in ids[1]],
                                                                 "max_tokens": 5})
    assert floats.json()["choices"][0]["text"] == as_text["choices"][1]["text"]  # (JSON's integer: 5.0 is 5)


def test_max_model_len_is_what_one_sequence_may_hold_here() -> None:
    """The model's context, or the KV pool where that holds less: a request of exactly that many tokens is served,
    one more is refused (a client sizing its prompts by it never gets a 400 it was not told of)."""
    with labserver.serve("gen-paged", SyntheticGen(0, 0, max_context=512), max_kv_tokens=96, kv_block_tokens=16,
                         max_new_tokens=64) as h:
        listed = httpx.get(h.url + wire.V1_MODELS_PATH).json()["data"][0]["max_model_len"]
        assert listed == 96
        fits = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": [5] * 40, "max_tokens": 56})
        assert fits.status_code == 200 and fits.json()["usage"]["total_tokens"] == 96
        over = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": [5] * 41, "max_tokens": 56})
        assert over.status_code == 400 and "KV-cache budget of 96" in over.json()["error"]["message"]
    with labserver.serve("gen-paged", SyntheticGen(0, 0, max_context=512)) as h:
        assert httpx.get(h.url + wire.V1_MODELS_PATH).json()["data"][0]["max_model_len"] == 512


def test_return_token_ids_gives_each_choice_its_tokens_and_its_prompts(gen: labserver.ServerHandle) -> None:
    """vLLM's ``return_token_ids``: the ids a client can compare with another server's, in the answer and the
    stream alike (the stream's chunks carry each token once, in order)."""
    ids = SyntheticGen(1, 0.5).encode("one two three")
    body = {"prompt": ids, "max_tokens": 6, "return_token_ids": True}
    whole = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json=body).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 6
    assert SyntheticGen(1, 0.5).text(choice["token_ids"]) == choice["text"]
    _, raw = raw_stream(gen.url, wire.V1_COMPLETIONS_PATH, body)
    streamed = [t for e in chunks(raw) for c in e["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]
    chat = httpx.post(gen.url + wire.V1_CHAT_PATH, json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3, "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == 3 and chat["choices"][0]["prompt_token_ids"]
    assert "token_ids" not in httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={**body, "return_token_ids": False}
                                         ).json()["choices"][0]


def test_a_nul_character_is_text_like_any_other(gen: labserver.ServerHandle) -> None:
    """vLLM answers a prompt that holds NUL (``vllm bench serve``'s random prompts can): refused only what cannot be
    tokenized (a lone surrogate)."""
    for path, body in ((wire.V1_COMPLETIONS_PATH, {"prompt": "nul\x00inside", "max_tokens": 2}),
                       (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 2}),
                       (wire.GENERATE_PATH, {"prompt": "nul\x00inside", "max_new_tokens": 2})):
        r = httpx.post(gen.url + path, json=body)
        assert r.status_code == 200, (path, r.text)
    lone = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, content=b'{"prompt": "a\\ud800", "max_tokens": 2}',
                      headers={"content-type": "application/json"})
    assert lone.status_code == 400 and "unpaired surrogate" in lone.json()["error"]["message"]


def test_min_tokens_and_ignore_eos() -> None:
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, eos_after=2)) as h:
        def n(**extra: Any) -> tuple[int, str]:
            body = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x y", "max_tokens": 9, **extra}).json()
            return body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]

        assert n() == (2, "stop")  # EOS ends it: OpenAI's "stop"
        assert n(min_tokens=5)[0] >= 5
        assert n(ignore_eos=True) == (9, "length")


# -- fields: accepted, refused, ignored ----------------------------------------------------------

def test_ignored_fields_are_accepted_named_and_logged(gen: labserver.ServerHandle,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    body = {"prompt": "x", "max_tokens": 2, "user": "u", "repetition_penalty": 1.1, "top_k": -1,
            "presence_penalty": 0, "logprobs": None, "a_field_from_the_future": 1,
            "stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    with caplog.at_level(logging.DEBUG, logger="labserver.server.openai.params"):
        r = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json=body)
        again = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json=body)
    assert r.status_code == again.status_code == 200
    assert r.headers[wire.HEADER_IGNORED_FIELDS] == ("a_field_from_the_future, presence_penalty, repetition_penalty, "
                                                     "top_k, user, stream_options.continuous_usage_stats")
    # logged with each request, at debug level: the server keeps no set of the names clients sent
    assert caplog.text.count("a_field_from_the_future") == 2 and "WARNING" not in caplog.text
    many = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 1,
                                                                **{f"k{i}": 0 for i in range(300)}})
    assert many.status_code == 200 and many.headers[wire.HEADER_IGNORED_FIELDS].endswith("(+268 more)")
    plain = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 2})
    assert wire.HEADER_IGNORED_FIELDS not in plain.headers


@pytest.mark.parametrize("path, body, param, fragment", [
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "n": 0}, "n", "at least 1"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": ["x", "y"], "n": 3}, "n", "over the limit of 4"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "best_of": 2}, "best_of", "must equal"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "logprobs": 1}, "logprobs", "computes no scores"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "logprobs": 6}, "logprobs", "between 0 and 5"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "logprobs": True}, "logprobs", "integer"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [1, 2, 10**9]}, "prompt", "token id 1000000000 is out of vocabulary"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [1, -2]}, "prompt", "token id -2 is out of vocabulary"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [[1, 2], []]}, "prompt", "non-empty list of such lists"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [[1, 2], "x"]}, "prompt", "non-empty list of such lists"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [1, True]}, "prompt", "token ids"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": [1] * 64}, "prompt", "the prompt is 64 tokens"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 0}, "max_tokens", "between 1 and 40"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 41}, "max_tokens", "cap"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "temperature": 3}, "temperature", "between 0 and 2"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "top_p": 1.5}, "top_p", "between 0 and 1"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "stop": [1]}, "stop", "stop"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "stop": []}, "stop", "non-empty list"),  # (OpenAI's minItems: 1)
    (wire.V1_COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 5, "min_tokens": 6}, "min_tokens", "min_tokens"),
    (wire.V1_COMPLETIONS_PATH, {"prompt": "   "}, None, "empty"),
    (wire.V1_COMPLETIONS_PATH, {}, "prompt", "prompt"),
    (wire.V1_CHAT_PATH, {"messages": []}, "messages", "non-empty"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "text"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "no scores"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "between 0 and 20"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", "completions"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", "tools"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "json_object"}}, "response_format", "no scores"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}],
                         "response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (wire.V1_CHAT_PATH, {"messages": [{"role": "user", "content": "x"}],
                         "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
])
def test_values_that_cannot_be_honoured_are_400(gen: labserver.ServerHandle, path: str, body: dict[str, Any],
                                                param: str | None, fragment: str) -> None:
    err = assert_openai_error(httpx.post(gen.url + path, json=body), 400, "bad_request", param)
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "still here"}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["\u0100", "new\nline", "k" * 257, "tab\there"])
def test_a_field_name_no_client_sends_is_400_before_anything_is_queued(gen: labserver.ServerHandle, name: str,
                                                                        stream: bool) -> None:
    """Such a name once reached the x-ignored-fields header after the sequences were queued: a 500 (or a dropped
    connection) and a sequence generating for nobody."""
    err = assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, timeout=30,
                                         json={"prompt": "x", "max_tokens": 4, "stream": stream, name: 1}),
                              400, "bad_request")
    assert "field name" in err["message"] and "printable ASCII" in err["message"]
    assert httpx.get(gen.url + "/stats").json()["running"] == 0


def test_prompts_times_n_are_bounded_by_max_prompts() -> None:
    """256 prompts of one request were 256 sequences; TGI's max-client-batch-size is the same guard."""
    from labserver.config import ServerConfig

    assert ServerConfig().max_prompts == 16
    with labserver.serve("gen-continuous", SyntheticGen(0, 0, max_context=64)) as h:  # the default bound
        ok = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": ["x"] * 4, "n": 4, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 16
        assert_openai_error(httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": ["x"] * 17, "max_tokens": 1}),
                            400, "bad_request", "prompt")
        assert_openai_error(httpx.post(h.url + wire.V1_CHAT_PATH, json={
            "messages": [{"role": "user", "content": "x"}], "n": 17, "max_tokens": 1}), 400, "bad_request", "n")


def test_temperatures_near_zero_priorities_and_stop_lengths(gen: labserver.ServerHandle) -> None:
    tiny = httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 3, "temperature": 1e-300})
    assert tiny.status_code == 200, tiny.text  # raised to 0.01, as vLLM does (dividing by it made NaN: a 500)
    req = parse_request(b'{"prompt": "x", "temperature": 1e-300}', chat=False, max_chars=100, max_tokens_cap=50,
                        max_prompts=4)
    assert req.sampling is not None and req.sampling.temperature == MIN_TEMPERATURE == 0.01
    for priority in (1001, -1001, -999999999999):
        assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x",
                                                                                "priority": priority}),
                            400, "bad_request", "priority")
    header = httpx.post(gen.url + wire.GENERATE_PATH, json={"prompt": "x", "max_new_tokens": 1},
                        headers={wire.HEADER_PRIORITY: "-5000"})
    assert header.status_code == 400 and "between -1000 and 1000" in header.json()["error"]["message"]
    assert httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 1,
                                                                "priority": -1000}).status_code == 200
    assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "stop": "s" * 513}),
                        400, "bad_request", "stop")


def test_malformed_bodies_and_limits(gen: labserver.ServerHandle) -> None:
    assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, content=b"{nope", headers={"content-type": "application/json"}), 400, "bad_request")
    assert_openai_error(httpx.post(gen.url + wire.V1_CHAT_PATH, content=b"[]", headers={"content-type": "application/json"}), 400, "bad_request")
    assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x" * 5000}), 413,
                        "payload_too_large")
    assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "w " * 70}), 400,
                        "bad_request")  # over the model's 64 tokens
    err = assert_openai_error(httpx.get(gen.url + "/v1/nothing"), 404, "not_found")
    assert err["type"] == "not_found_error"
    assert_openai_error(httpx.get(gen.url + wire.V1_COMPLETIONS_PATH), 405, "method_not_allowed")
    native = httpx.get(gen.url + "/nothing").json()  # the native routes keep their shape
    assert native["error"]["type"] == "not_found" and "request_id" in native["error"]


def test_unknown_model_is_404_and_the_wrong_kind_is_400(gen: labserver.ServerHandle) -> None:
    err = assert_openai_error(httpx.post(gen.url + wire.V1_COMPLETIONS_PATH, json={"model": "gpt-4", "prompt": "x"}),
                              404, "model_not_found", "model")
    assert NAME in err["message"]
    err = assert_openai_error(httpx.post(gen.url + wire.V1_EMBEDDINGS_PATH, json={"input": "x"}), 400, "bad_request")
    assert wire.V1_COMPLETIONS_PATH in err["message"]
    with labserver.serve("thread", "echo") as enc:
        err = assert_openai_error(httpx.post(enc.url + wire.V1_CHAT_PATH, json={
            "messages": [{"role": "user", "content": "x"}]}), 400, "bad_request")
        assert wire.V1_EMBEDDINGS_PATH in err["message"]
        err = assert_openai_error(httpx.post(enc.url + wire.V1_EMBEDDINGS_PATH, json={"input": "x"}), 400,
                                  "bad_request", "model")
        assert "embeddings" in err["message"]  # echo computes no vectors
        assert httpx.get(enc.url + wire.V1_MODELS_PATH).json()["data"][0]["kind"] == "encode"


# -- waiting, overload, deadlines, clients that leave ------------------------------------------------

def test_queue_cap_503_and_deadline_504(stepped: tuple[labserver.ServerHandle, SteppedGen]) -> None:
    h, model = stepped
    url = h.url + wire.V1_COMPLETIONS_PATH
    first: dict[str, Any] = {}
    t = threading.Thread(target=lambda: first.update(r=httpx.post(url, json={"prompt": "holds", "max_tokens": 3},
                                                                  timeout=30)))
    t.start()
    model.wait_entered()
    answers: list[httpx.Response] = []
    waiting = [threading.Thread(target=lambda: answers.append(httpx.post(url, json={"prompt": "q"}, timeout=30)))
               for _ in range(2)]
    for w in waiting:
        w.start()
    wait_until(lambda: h.stats()["queue_depth"] == 2)
    r = httpx.post(url, json={"prompt": "no room"})
    err = assert_openai_error(r, 503, "overloaded")
    assert r.headers["retry-after"] == "1" and err["type"] == "service_unavailable_error"
    for w in waiting:
        w.join(30)
    for a in answers:
        assert assert_openai_error(a, 504, "timeout")["type"] == "timeout_error"
    model.allow(10)
    t.join(30)
    assert first["r"].json()["usage"]["completion_tokens"] == 3


def test_client_leaving_mid_stream_frees_its_place(stepped: tuple[labserver.ServerHandle, SteppedGen]) -> None:
    h, model = stepped
    received = 0
    with httpx.stream("POST", h.url + wire.V1_CHAT_PATH, json={
            "messages": [{"role": "user", "content": "leaves early"}], "max_tokens": 500, "stream": True},
            timeout=30) as r:
        lines = r.iter_lines()
        while received < 3:
            if next(lines).startswith("data: {"):
                received += 1
                model.allow()
    engine = h.runtime.engine
    wait_until(lambda: all(s.future.done() for s in engine.running.seqs))
    n_begun = len([1 for kind, _ in model.calls if kind == "decode"]) + 1
    model.allow(20)
    other = httpx.post(h.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "after", "max_tokens": 4}, timeout=30)
    assert other.status_code == 200
    decodes = [ids for kind, ids in model.calls if kind == "decode"]
    assert decodes[n_begun:] and all(1 not in ids for ids in decodes[n_begun:])
    wait_until(lambda: h.stats()["left_while_generating"] == 1)
    wait_until(lambda: model.cached == 0)  # (the second request's sequence is released after its answer is sent)
    assert model.cached == 0 and h.stats()["statuses"]["499"] == 1


def test_gen_hf_cb_refuses_sampling_it_cannot_do() -> None:
    with labserver.serve("gen-hf-cb", "gpt2-tiny-random", device="cpu", max_batch_size=2, max_kv_tokens=1024) as h:
        url = h.url + wire.V1_COMPLETIONS_PATH
        err = assert_openai_error(httpx.post(url, json={"prompt": "x", "temperature": 0.7}), 400, "bad_request",
                                  "temperature")
        assert "greedily" in err["message"] and "gen-continuous" in err["message"]
        assert_openai_error(httpx.post(url, json={"prompt": "x", "stop": "a"}), 400, "bad_request", "stop")
        ok = httpx.post(url, json={"prompt": "x y", "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- the parts alone ---------------------------------------------------------------------------------

def wordpiece(tokens: list[int]) -> str:
    """A decoder where token 1 is a word piece ("##ly") that joins the word before it; 0 decodes to nothing."""
    words = []
    for t in tokens:
        if t == 0:
            continue
        if t == 1 and words:
            words[-1] += "ly"
        else:
            words.append("ly" if t == 1 else f"w{t}")
    return " ".join(words)


def _streamed(decode: Any, tokens: list[int], stop: tuple[str, ...] = (), finish: bool = True) -> list[str]:
    """What a TextStream sends as a sequence's text takes each token in turn (the last push: finished)."""
    out = Detokenizer(decode, stop)
    stream = TextStream(out)
    pieces = []
    for token in tokens:
        out.push(token)
        pieces.append(stream.push(False))
    if finish:
        out.finish()
        pieces.append(stream.push(True))
    return pieces


def test_text_stream_joins_pieces_like_a_whole_decode() -> None:
    tokens = [5, 1, 7, 0, 8, 1, 1, 9]
    pieces = _streamed(wordpiece, tokens)
    assert "".join(pieces) == wordpiece(tokens) == "w5ly w7 w8lyly w9"
    assert pieces[0] == "w5" and pieces[1] == "ly" and pieces[3] == ""  # the special token adds nothing


def test_text_stream_holds_half_a_character_and_sends_it_at_the_end() -> None:
    raw = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b"!"}  # byte-level tokens: "é" is two of them

    def bytes_level(tokens: list[int]) -> str:
        return b"".join(raw[t] for t in tokens).decode("utf-8", errors="replace")

    assert _streamed(bytes_level, [1, 2, 3, 4], finish=False) == ["caf", "", "\u00e9", "!"]
    assert _streamed(bytes_level, [1, 2]) == ["caf", "", "\ufffd"]  # it ends mid-character: nothing is dropped


def test_text_stream_never_sends_part_of_a_stop_string() -> None:
    sent = _streamed(wordpiece, [5, 6, 7, 8, 9], stop=("w7 w8",))
    assert "".join(sent) == "w5 w6 "
    assert all("w7" not in s for s in sent)


def test_parse_request_alone() -> None:
    req = parse_request(json.dumps({"messages": [{"role": "system", "content": "be kind"},
                                                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                    "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0.5, "seed": 1,
                                    "stop": "x", "metadata": {}}).encode(),
                        chat=True, max_chars=100, max_tokens_cap=50, max_prompts=4)
    assert req.prompts == ["system: be kind\nuser: hi\nassistant:"] == [render_chat(
        [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}])]
    assert req.max_tokens == 7 and req.stop == ("x",) and req.ignored == ["metadata"]
    assert req.sampling is not None and req.sampling.temperature == 0.5 and req.sampling.seed == 1
    with pytest.raises(ClientError) as e:
        parse_request(b'{"prompt": ["a", "b", "c"]}', chat=False, max_chars=100, max_tokens_cap=50, max_prompts=2)
    assert e.value.param == "prompt" and "limit of 2" in str(e.value)


def test_a_stream_waits_for_its_first_token_before_the_200(stepped: tuple[labserver.ServerHandle, SteppedGen]) -> None:
    """Until the first token nothing is sent, so a failure before it is an ordinary status (here 504)."""
    h, model = stepped
    holder = threading.Thread(target=lambda: httpx.post(h.url + wire.V1_COMPLETIONS_PATH,
                                                        json={"prompt": "holds", "max_tokens": 2}, timeout=30))
    holder.start()
    model.wait_entered()
    started = time.perf_counter()
    r, _ = raw_stream(h.url, wire.V1_COMPLETIONS_PATH, {"prompt": "late", "max_tokens": 2})
    assert_openai_error(r, 504, "timeout")
    assert time.perf_counter() - started < 5
    model.allow(10)
    holder.join(30)
