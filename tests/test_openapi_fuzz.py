"""The four ``/v1`` operations fuzzed against OpenAI's own OpenAPI spec with Schemathesis.

Schemathesis draws requests from the spec OpenAI publishes (``../shared/openai-openapi``,
read where it lies, never copied here) through hypothesis, with a fixed seed, for each of
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings`` and
``GET /v1/models``, in three runs: schema-valid requests (positive), requests that break
the schema (negative), and schema-valid requests narrowed to what labserver honours
(``honoured``: as published, most completions and embeddings requests ask for something
refused by design, so few answers would be 200s to judge). The positive run sends
``SHAPES`` first: the rarer shapes of an answer (echo with log-probabilities, several
choices streamed with usage, base64 vectors). Every answer must pass two checks:
``not_a_server_error`` (no 5xx: what labserver cannot honour is a 400 in OpenAI's error
shape) and ``response_schema_conformance`` (a 200 is what the spec says).
``status_code_conformance`` is not checked: the spec documents only 200 and 429 for the
three POSTs and only 200 for ``GET /models``, so every 400 and 404 (OpenAI's own answers
to such requests) would count against the server.

What the spec cannot judge as written, and what this module does about it:

- ``model``: the spec's are OpenAI's names; a server answers to its own (another is a 404
  by design), so a string ``model`` is sent as the served one, and generation is reached.
- streams: the chat spec gives each chunk's schema under ``text/event-stream``, where
  Schemathesis would read a whole SSE event; the deserializer below (registered for the
  process) reads the ``data:`` lines as the clients do, so every chunk is checked against
  it. Completions documents no stream, so a streamed completion is checked for what every
  client needs: ``data:`` events of JSON, no error event, ``[DONE]`` last.
- ``encoding_format: base64``: OpenAI answers a base64 string where its spec says a list
  of numbers (openai/openai-openapi#424); the SDK asks for base64 and decodes it, so the
  answer is checked as the SDK reads it: decoded to float32 numbers, then against the spec.

Generation cost is bounded by the server's own cap (``max_new_tokens``: a case asking for
more is a 400), not by editing cases. ``LABSERVER_FUZZ_CASES=500`` runs a longer fuzz
(cases per operation and run), ``LABSERVER_FUZZ_SEED`` draws other cases (docs/api.md).
"""

from __future__ import annotations

import base64
import collections
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import requests
import schemathesis  # in the test extras: a missing Schemathesis fails here rather than skipping
import yaml
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import response_schema_conformance

import labserver

SPEC = Path(__file__).resolve().parents[1].parent / "shared" / "openai-openapi" / "openapi.labserver.yaml"
CASES = int(os.environ.get("LABSERVER_FUZZ_CASES", "30"))  # per operation and run
GEN, EMB = "gpt2-tiny-random", "minilm"
MAX_NEW_TOKENS = 8
SEED = int(os.environ.get("LABSERVER_FUZZ_SEED", "20261127"))  # another seed draws other cases, as fixed
OPERATIONS = [("POST", "/completions"), ("POST", "/chat/completions"), ("POST", "/embeddings"), ("GET", "/models")]
CHECKS = [not_a_server_error, response_schema_conformance]

pytestmark = pytest.mark.skipif(not SPEC.is_file(), reason=f"OpenAI's OpenAPI spec is not at {SPEC} (../shared)")


@schemathesis.deserializer("text/event-stream")
def _stream_chunks(ctx: Any, response: Any) -> list[Any]:
    """An OpenAI stream as its clients read it: each ``data:`` line's JSON, until ``[DONE]``."""
    return [json.loads(data) for data in _data_lines(response.content) if data != "[DONE]"]


def _data_lines(content: bytes) -> list[str]:
    events = content.decode("utf-8").split("\n\n")
    assert events[-1] == "", f"a stream ends with a blank line: {content[-200:]!r}"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1]), content[:400]
    return [e[len("data: "):] for e in events[:-1]]


@pytest.fixture(scope="module")
def gen() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", GEN, device="cpu", max_new_tokens=MAX_NEW_TOKENS) as h:
        yield h


@pytest.fixture(scope="module")
def emb() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("thread", EMB, device="cpu") as h:
        yield h


@pytest.fixture(scope="module")
def specs() -> dict[str, Any]:
    raw = yaml.safe_load(SPEC.read_text())
    return {"as published": schemathesis.openapi.from_dict(raw),
            "honoured": schemathesis.openapi.from_dict(honoured(copy.deepcopy(raw)))}


def honoured(raw: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's spec with its requests narrowed to what labserver honours; its answers as published.

    Drawn from the spec as published, most completions and embeddings requests ask for something
    refused by design (``best_of``, ``suffix``, ``logit_bias``, token ids outside the model's vocabulary,
    empty texts, field names no client sends): 400s, tested in tests/test_server_openai.py. Drawn from this
    one, each request is still valid for OpenAI's spec, and many are answered."""
    schemas = raw["components"]["schemas"]
    text = {"type": "string", "pattern": r"\S"}
    texts = {"oneOf": [text, {"type": "array", "minItems": 1, "maxItems": 4, "items": text}]}
    ids = {"type": "array", "minItems": 1, "maxItems": 8, "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    completion = schemas["CreateCompletionRequest"]
    for name in ("best_of", "suffix", "logit_bias"):
        del completion["properties"][name]
    completion["properties"]["prompt"] = {"oneOf": [*texts["oneOf"], ids,
                                                    {"type": "array", "minItems": 1, "maxItems": 4, "items": ids}]}
    completion["additionalProperties"] = False
    schemas["CreateEmbeddingRequest"]["properties"]["input"] = texts
    return raw


def check_stream(response: Response) -> None:
    """A 200 stream: JSON ``data:`` events, none an error (a failure after the 200 is told in one), ``[DONE]`` last."""
    if not any(v.startswith("text/event-stream") for v in response.headers.get("content-type", [])):
        return
    data = _data_lines(response.content)
    assert data and data[-1] == "[DONE]", response.content[-200:]
    for chunk in map(json.loads, data[:-1]):
        assert "error" not in chunk, chunk


def as_the_sdk_reads(case: Any, response: Response) -> Response:
    """A base64 embeddings answer with each vector decoded (each string must be whole float32s)."""
    body = case.body if isinstance(case.body, dict) else {}
    if response.status_code != 200 or body.get("encoding_format") != "base64":
        return response
    doc = response.json()
    for item in doc["data"]:
        raw = base64.b64decode(item["embedding"], validate=True)
        assert raw and len(raw) % 4 == 0, item
        item["embedding"] = np.frombuffer(raw, dtype="<f4").tolist()
    return Response(200, response.headers, json.dumps(doc).encode(), response.request, response.elapsed,
                    response.verify)


RUNS = [("as published", GenerationMode.POSITIVE), ("as published", GenerationMode.NEGATIVE),
        ("honoured", GenerationMode.POSITIVE)]
# schema-valid requests for the rarer shapes of an answer, sent first in the positive run as published
SHAPES: dict[str, list[dict[str, Any]]] = {
    "/completions": [
        {"prompt": "Once upon a time", "max_tokens": 4, "echo": True, "logprobs": 2},
        {"prompt": ["one two", "three"], "n": 2, "max_tokens": 3, "logprobs": 1, "stream": True,
         "stream_options": {"include_usage": True}},
        {"prompt": "a b c", "max_tokens": 5, "stop": ["."], "temperature": 0.7, "top_p": 0.9, "seed": 3},
    ],
    "/chat/completions": [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "hello"}]}], "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "logprobs": True, "stream": True,
         "stream_options": {"include_usage": True}},
    ],
    "/embeddings": [
        {"input": ["hello", "world"], "encoding_format": "base64"},
        {"input": "hello", "encoding_format": "float", "dimensions": 384},
    ],
}


@pytest.mark.parametrize("requests_from, mode", RUNS, ids=[f"{s}-{m}" for s, m in RUNS])
@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz_conforms_to_openais_spec(method: str, path: str, requests_from: str, mode: GenerationMode,
                                       specs: dict[str, Any], request: pytest.FixtureRequest) -> None:
    served = EMB if path == "/embeddings" else GEN
    server: labserver.ServerHandle = request.getfixturevalue("emb" if path == "/embeddings" else "gen")
    operation = specs[requests_from][path][method]
    statuses: collections.Counter[int] = collections.Counter()

    def fuzz(case: Any) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = served
        response = case.call(base_url=server.url + "/v1", session=session, timeout=60)
        statuses[response.status_code] += 1
        assert "Traceback" not in response.text
        case.validate_response(as_the_sdk_reads(case, response), checks=CHECKS)
        check_stream(response)

    for body in SHAPES.get(path, []) if (requests_from, mode) == RUNS[0] else []:
        fuzz = example(case=operation.Case(body={"model": served, **body}, media_type="application/json"))(fuzz)
    run = settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
                   phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
        seed(SEED)(given(case=operation.as_strategy(mode))(fuzz)))
    with requests.Session() as session:
        run()
    print(f"{method} {path}, {requests_from}, {mode}: {sum(statuses.values())} cases, statuses {dict(statuses)}")
    assert sum(statuses.values()) >= CASES // 2, statuses  # (schemathesis may yield fewer distinct cases)
    if requests_from == "honoured":  # the conformance check has had answers to judge
        assert statuses[200] >= CASES // 4, statuses
    assert httpx.get(server.url + "/v1/models").status_code == 200  # still serving
