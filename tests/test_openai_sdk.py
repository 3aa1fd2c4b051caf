"""The official ``openai`` SDK against a real labserver on a loopback socket: code no one here wrote.

Completions and chat, streamed and not, on the small real model (``gpt2-tiny-random``);
embeddings with the SDK's defaults (it asks for base64 and decodes it itself) on the
embedded MiniLM; and the SDK's typed exceptions for a 400, a 404 and a 503.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai  # in the test extras: a missing SDK fails here rather than skipping
import pytest

import labserver
from labserver.models import ModelError, SyntheticGen

from .fakes import SteppedGen
from .test_server import wait_until


def client(h: labserver.ServerHandle, **options: Any) -> Any:
    return openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60, **options)


@pytest.fixture(scope="module")
def gen() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", "gpt2-tiny-random", device="cpu", max_batch_size=8) as h:
        yield h


@pytest.fixture(scope="module")
def emb() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("thread", "minilm", device="cpu") as h:
        yield h


def test_models_list(gen: labserver.ServerHandle) -> None:
    models = client(gen).models.list().data
    assert [m.id for m in models] == ["gpt2-tiny-random"]
    assert models[0].model_extra["max_model_len"] == 512 and models[0].model_extra["root"] == "gpt2-tiny-random"


def test_completion_streamed_and_not_give_the_same_text(gen: labserver.ServerHandle) -> None:
    c = client(gen)
    whole = c.completions.create(model="gpt2-tiny-random", prompt="the quick brown fox", max_tokens=12,
                                 extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == 5  # [CLS] + four words
    assert whole.usage.total_tokens == 17 and whole.choices[0].text.strip()
    chunks = list(c.completions.create(model="gpt2-tiny-random", prompt="the quick brown fox", max_tokens=12,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len(chunks) - 1 >= 6  # one chunk per step (a few tokens may decode to nothing alone)


def test_chat_streamed_and_not(gen: labserver.ServerHandle) -> None:
    c = client(gen)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = c.chat.completions.create(model="gpt2-tiny-random", messages=messages, max_completion_tokens=10,
                                      extra_body={"ignore_eos": True})
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert whole.usage.completion_tokens == 10
    stream = c.chat.completions.create(model="gpt2-tiny-random", messages=messages, max_completion_tokens=10,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:])
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_is_reproducible_with_a_seed(gen: labserver.ServerHandle) -> None:
    c = client(gen)

    def text(**kw: Any) -> str:
        out = c.completions.create(model="gpt2-tiny-random", prompt="once upon a time", max_tokens=20,
                                   extra_body={"ignore_eos": True}, **kw)
        return out.choices[0].text

    greedy = text(temperature=0)
    assert text() == greedy  # no temperature: greedy here
    a, b, other = text(temperature=1.5, seed=7), text(temperature=1.5, seed=7), text(temperature=1.5, seed=8)
    assert a == b and a != greedy and other != a


def test_stop_string_cuts_the_text(gen: labserver.ServerHandle) -> None:
    c = client(gen)
    free = c.completions.create(model="gpt2-tiny-random", prompt="the river", max_tokens=30,
                                extra_body={"ignore_eos": True}).choices[0].text
    words = free.split()
    stop = words[3]
    expected = free[:free.find(stop)]
    for stream in (False, True):
        out = c.completions.create(model="gpt2-tiny-random", prompt="the river", max_tokens=30, stop=[stop],
                                   stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(ch.choices[0].text for ch in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_embeddings_with_the_sdk_defaults(emb: labserver.ServerHandle) -> None:
    c = client(emb)
    default = c.embeddings.create(model="minilm", input=["hello world", "a second sentence"])  # base64 on the wire
    floats = c.embeddings.create(model="minilm", input=["hello world", "a second sentence"], encoding_format="float")
    assert [d.index for d in default.data] == [0, 1]
    a, b = np.array(default.data[0].embedding), np.array(floats.data[0].embedding)
    assert a.shape == (384,) and np.allclose(a, b, atol=1e-6) and abs(np.linalg.norm(a) - 1) < 1e-3
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens > 4 and default.model == "minilm"
    one = c.embeddings.create(model="minilm", input="hello world")
    assert np.allclose(one.data[0].embedding, a, atol=1e-5)  # batched with others or alone: the same vector


def test_typed_exceptions_for_400_and_404(gen: labserver.ServerHandle, emb: labserver.ServerHandle) -> None:
    c = client(gen)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="gpt2-tiny-random", prompt="x", n=2, best_of=3)
    assert bad.value.status_code == 400 and bad.value.param == "best_of" and "n" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="gpt2-tiny-random", messages=[{"role": "user", "content": "x"}],
                                  logprobs=True, top_logprobs=21)
    assert bad.value.param == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="gpt-4o", prompt="x")
    assert missing.value.code == "model_not_found" and "gpt2-tiny-random" in missing.value.message
    with pytest.raises(openai.BadRequestError) as wrong:  # an encoder server asked to generate
        client(emb).completions.create(model="minilm", prompt="x")
    assert "/v1/embeddings" in wrong.value.message


def test_overloaded_is_a_503_the_sdk_raises() -> None:
    model = SteppedGen()
    with labserver.serve("gen-continuous", model, max_batch_size=1, max_queue=1) as h:
        c = client(h)
        done: list[Any] = []
        first = threading.Thread(target=lambda: done.append(
            c.completions.create(model="stepped", prompt="holds the model", max_tokens=2)))
        first.start()
        model.wait_entered()
        queued = threading.Thread(target=lambda: done.append(
            c.completions.create(model="stepped", prompt="waits", max_tokens=2)))
        queued.start()
        wait_until(lambda: h.stats()["queue_depth"] == 1)
        with pytest.raises(openai.InternalServerError) as full:
            c.completions.create(model="stepped", prompt="no room", max_tokens=2)
        assert full.value.status_code == 503 and full.value.code == "overloaded"
        assert full.value.response.headers["retry-after"] == "1"
        model.allow(100)
        first.join(30)
        queued.join(30)
        assert [d.usage.completion_tokens for d in done] == [2, 2]


class FailsMidway(SyntheticGen):
    """Fails its third decode step: a failure after the first chunk."""

    decodes = 0

    def forward(self, chunks):  # type: ignore[no-untyped-def]
        if all(c.decode for c in chunks):
            self.decodes += 1
            if self.decodes == 3:
                raise ModelError("the step failed")
        return super().forward(chunks)


def test_a_failure_mid_stream_is_an_error_the_sdk_raises() -> None:
    with labserver.serve("gen-continuous", FailsMidway(0, 0), max_batch_size=1) as h:
        stream = client(h).chat.completions.create(model=h.runtime.config.model, stream=True, max_tokens=10,
                                                   messages=[{"role": "user", "content": "hello"}])
        got = []
        with pytest.raises(openai.APIError) as failed:
            for chunk in stream:
                got.append(chunk)
        assert got and "failed" in failed.value.message
        assert failed.value.body["code"] == "model_error" and "Traceback" not in str(failed.value.body)
        # the server goes on
        again = client(h).completions.create(model=h.runtime.config.model, prompt="again", max_tokens=2)
        assert again.usage.completion_tokens == 2
