"""Answers in a shape from a real server: smollm2 on a loopback socket, asked through the ``openai`` SDK and plain JSON.

``response_format`` (json_schema, json_object) on chat and completions, streamed and not,
vLLM's ``structured_outputs`` (choice, regex, grammar), a compiler's refusal answered with a
400 while the server goes on serving, a budget that ends first (``length``), and the constraint carried
to a replica as plain data (the Ray suite asks a replica itself).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import labserver
from labserver import wire
from labserver.models.grammar import Constraint
from labserver.replicas.remote import RemoteEngine, job_of
from labserver.strategies import Limits, make_strategy

from .fakes import ReplayHandle
from .test_structured import Shaped

PLACE = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
         "required": ["country", "capital"]}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", "smollm2", max_batch_size=8) as h:
        yield h


def client(h: labserver.ServerHandle) -> Any:
    return openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def is_place(text: str) -> bool:
    doc = json.loads(text)
    return isinstance(doc, dict) and set(PLACE["required"]) <= set(doc) and all(isinstance(v, str) for v in doc.values())


def test_the_sdks_response_format_gives_json_that_validates_streamed_or_not_or_cut_by_its_budget(
        server: labserver.ServerHandle) -> None:
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    free = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40)
    assert not is_place(free.choices[0].message.content)  # (the model alone leaves out a required key)
    shaped = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, response_format=fmt)
    text = shaped.choices[0].message.content
    assert is_place(text) and json.loads(text)["capital"] == "Paris" and shaped.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, response_format=fmt,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"
    cut = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, response_format=fmt)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4  # (what was made, cut)
    assert text.startswith(cut.choices[0].message.content)
    anything = c.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    completed = c.completions.create(model="smollm2", prompt="The capital of France, as JSON:", max_tokens=40,
                                     extra_body={"response_format": fmt})  # (the SDK types it for chat alone)
    assert is_place(completed.choices[0].text) and completed.choices[0].finish_reason == "stop"
    stats = httpx.get(server.url + "/stats").json()
    assert stats["grammar_cache_hits"] >= 1 and stats["grammar_mask_rows"] > 0


@pytest.mark.parametrize(("shape", "valid"), [
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ({"grammar": 'root ::= "(" [0-9]+ ")"'}, lambda t: re.fullmatch(r"\([0-9]+\)", t)),
])
def test_vllms_structured_outputs_with_n_choices_sampled(server: labserver.ServerHandle, shape: dict[str, Any],
                                                          valid: Any) -> None:
    r = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, timeout=60, json={
        "prompt": "Is the sky blue? Call me at", "max_tokens": 24, "n": 3, "temperature": 1.0, "seed": 1,
        "structured_outputs": shape})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert valid(choice["text"]) and choice["finish_reason"] == "stop", choice


def test_a_malformed_schema_is_a_400_in_the_compilers_words_and_the_server_goes_on(
        server: labserver.ServerHandle) -> None:
    for shape, words in (({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "objekt"}}}}, 'Unsupported type "objekt"'),
                         ({"structured_outputs": {"regex": "(ab"}}, "parenthesis is not closed")):
        r = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, json={"prompt": "x", "max_tokens": 4, **shape})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client(server).completions.create(model="smollm2", prompt="x", max_tokens=4, extra_body=shape)
    r = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, timeout=60,
                   json={"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("a", "b")


def test_a_constraint_crosses_to_a_replica_as_plain_data_and_is_compiled_there() -> None:
    model = Shaped(0, 0)
    constraint = Constraint("choice", '["yes", "no"]')

    async def main() -> None:
        ingress = RemoteEngine(make_strategy("gen-continuous", Limits()), model, ReplayHandle([]), max_in_flight=4)
        grammar = await ingress.grammar(constraint)
        assert grammar.matcher() is None  # (the router's side compiles nothing)
        ingress.accepting = True  # (its worker is not started: the job is read, not sent)
        job = pickle.loads(pickle.dumps(job_of(ingress.submit(model.encode("hello"), 8, grammar=grammar))))
        assert Constraint(**job["constraint"]) == constraint

    asyncio.run(main())
