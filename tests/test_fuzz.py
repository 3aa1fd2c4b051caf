"""Fuzzing the HTTP surface: whatever comes in, a 2xx or a documented 4xx goes out.

Every hypothesis example goes to one ``echo`` server (thread strategy) shared by the
module, and is held against an oracle written from the contract: the status the
server must give, and for a 200 the exact output. After each example the server
must still answer a normal request correctly. The embedded model gets its own
server for texts far past its 256-token window and for odd Unicode reaching a real
tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labserver
from labserver import wire

MAX_INPUTS, MAX_CHARS, MAX_BODY = 5000, 4000, 256 * 1024
FUZZ = settings(max_examples=200, deadline=None)
JSON = {"content-type": "application/json"}  # /predict takes JSON only (server.guard); "/" ignores it
LEAKS = ("Traceback", 'File "', "site-packages", "labserver/", ".py")


@pytest.fixture(scope="module")
def server() -> Iterator[labserver.ServerHandle]:
    with labserver.serve("thread", "echo", max_inputs=MAX_INPUTS, max_chars=MAX_CHARS,
                         max_body_bytes=MAX_BODY) as h:
        yield h


@pytest.fixture(scope="module")
def client(server: labserver.ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# -- the contract, as an oracle -----------------------------------------------------------

def expected(path: str, body: bytes) -> int | Any:
    """What the echo server must answer for this body: its JSON output, or 400/413."""
    if len(body) > MAX_BODY:
        return 413
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return 400
    if path == "/":
        texts, single = [text], True
    else:
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return 400
        if not isinstance(doc, dict) or "inputs" not in doc:
            return 400
        inputs = doc["inputs"]
        if isinstance(inputs, str):
            texts, single = [inputs], True
        elif isinstance(inputs, list) and 0 < len(inputs) <= MAX_INPUTS and all(isinstance(x, str) for x in inputs):
            texts, single = inputs, False
        else:
            return 400
    for t in texts:
        if not t.strip() or len(t) > MAX_CHARS or any(0xD800 <= ord(c) <= 0xDFFF for c in t):
            return 400
    outs = [{"chars": len(t)} for t in texts]
    if path == "/":
        return outs[0]
    return {"output": outs[0]} if single else {"outputs": outs}


def check(r: httpx.Response, path: str, body: bytes, c: httpx.Client) -> None:
    assert r.status_code < 500, r.text
    for leak in LEAKS:
        assert leak not in r.text
    data = r.json()  # every answer is JSON, errors included
    want = expected(path, body)
    if isinstance(want, int):
        assert r.status_code == want, (body[:200], r.text[:300])
        assert set(data) == {"error"}
        err = data["error"]
        assert set(err) == {"type", "message", "request_id"}
        assert wire.ERROR_TYPES[err["type"]] == r.status_code
        assert err["message"] and err["request_id"] == r.headers[wire.HEADER_REQUEST_ID]
    else:
        assert r.status_code == 200, (body[:200], r.text[:300])
        assert data == want
    assert c.post("/", content=b"still fine").json() == {"chars": 10}  # and the server is unharmed


def post(c: httpx.Client, path: str, body: bytes) -> None:
    check(c.post(path, content=body, headers=JSON), path, body, c)


# -- generators -----------------------------------------------------------------------------

# every code point, lone surrogates (U+D800..U+DFFF) and NUL included; the nasty ones often
NASTY = "\x00\ud800\udbff\udc00\udfff\u202e\u200b\ufeff\u0301\x7f \t\n"
any_text = st.text(st.sampled_from(NASTY) | st.characters(codec=None, exclude_categories=[]), max_size=40)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=5)
                           | st.dictionaries(any_text, kids, max_size=5), max_leaves=25)
predict_docs = st.one_of(
    json_values,
    st.fixed_dictionaries({"inputs": json_values}),
    st.fixed_dictionaries({"inputs": any_text}),
    st.fixed_dictionaries({"inputs": st.lists(any_text, max_size=30)}),
    st.fixed_dictionaries({"inputs": st.lists(any_text, max_size=5)}, optional={"extra": json_values}),
)


def encode(doc: Any, ascii_only: bool) -> bytes:
    # ensure_ascii writes a lone surrogate as a "\ud800" escape; without it the raw surrogate
    # is written as the 3 bytes UTF-8 forbids ("surrogatepass"), which the server must refuse
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


# -- properties -------------------------------------------------------------------------------

@FUZZ
@given(path=st.sampled_from(["/", "/predict"]), body=st.binary(max_size=4096))
def test_arbitrary_bytes(client: httpx.Client, path: str, body: bytes) -> None:
    post(client, path, body)


@FUZZ
@given(doc=predict_docs, ascii_only=st.booleans())
def test_arbitrary_json_at_predict(client: httpx.Client, doc: Any, ascii_only: bool) -> None:
    post(client, "/predict", encode(doc, ascii_only))


@FUZZ
@given(text=any_text | st.text(max_size=MAX_CHARS + 50))
def test_arbitrary_text_at_root(client: httpx.Client, text: str) -> None:
    post(client, "/", text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(doc=predict_docs, at=st.integers(min_value=0), junk=st.binary(min_size=1, max_size=4),
       cut=st.booleans())
def test_damaged_json(client: httpx.Client, doc: Any, at: int, junk: bytes, cut: bool) -> None:
    body = encode(doc, True)
    i = at % (len(body) + 1)
    body = body[:i] if cut else body[:i] + junk + body[i:]  # truncated, or bytes spliced in
    post(client, "/predict", body)


@settings(max_examples=40, deadline=None)
@given(path=st.sampled_from(["/", "/predict"]), offset=st.integers(-2, 2), chunked=st.booleans())
def test_body_limit_is_exact(client: httpx.Client, path: str, offset: int, chunked: bool) -> None:
    size = MAX_BODY + offset
    body = b'{"inputs": "' + b"x" * (size - 14) + b'"}' if path == "/predict" else b"y" * size
    assert len(body) == size
    content: Any = body
    if chunked:  # no content-length: the limit is enforced while reading
        content = iter([body[j:j + 65536] for j in range(0, size, 65536)])
    r = client.post(path, content=content, headers=JSON)
    check(r, path, body, client)
    assert (r.status_code == 413) is (size > MAX_BODY)


@settings(max_examples=60, deadline=None)
@given(rid=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=100).map(str.strip))
def test_request_id_header(client: httpx.Client, rid: str) -> None:
    r = client.post("/", content=b"x", headers={wire.HEADER_REQUEST_ID: rid})
    assert r.status_code == 200
    echoed = r.headers[wire.HEADER_REQUEST_ID]
    assert echoed == rid if 0 < len(rid) <= 64 else (echoed and echoed != rid)  # else one of its own


# -- named nasties, so a reader sees each case ----------------------------------------------

@pytest.mark.parametrize(
    "path, body",
    [
        ("/", b""),
        ("/predict", b""),
        ("/", b"\x00"),
        ("/", b"nul\x00byte"),
        ("/predict", b'{"inputs": "nul \\u0000 escape"}'),
        ("/", b"\xed\xa0\x80"),  # an encoded surrogate: not UTF-8
        ("/", b"\xc3\x28 bad continuation"),
        ("/", b"\xef\xbb\xbfBOM first"),
        ("/predict", b'{"inputs": "lone \\ud800"}'),
        ("/predict", b'{"inputs": ["fine", "lone low \\udc00"]}'),
        ("/predict", b'{"inputs": "pair \\ud83d\\ude00"}'),  # a valid pair: one character
        ("/predict", '{"inputs": "\u202eright-to-left \u200b zero width"}'.encode()),
        ("/predict", b'{"inputs": "  \\t\\n "}'),
        ("/predict", b'{"inputs": 1' + b"0" * 5000 + b"}"),  # an int Python refuses to parse
        ("/predict", b'{"inputs": NaN}'),
        ("/predict", b'{"inputs": "a", "inputs": ["b", "cc"]}'),  # duplicate keys: the last wins
        ("/predict", b'{"inputs": "x"} trailing'),
        ("/predict", b"\x00" * 100),
        ("/predict", b"null"),
    ],
)
def test_named_nasties(client: httpx.Client, path: str, body: bytes) -> None:
    post(client, path, body)


@pytest.mark.parametrize("depth", [10, 500, 40_000])  # 40 000 levels: far past the recursion limit
@pytest.mark.parametrize("shape", ["top-list", "top-dict", "inputs-list", "inputs-dict"])
def test_deep_nesting(client: httpx.Client, depth: int, shape: str) -> None:
    nest = ("[" * depth + "]" * depth) if shape.endswith("list") else ('{"a":' * depth + "1" + "}" * depth)
    body = (nest if shape.startswith("top") else '{"inputs": ' + nest + "}").encode()
    r = client.post("/predict", content=body, headers=JSON)
    check(r, "/predict", body, client)
    assert r.status_code == 400


def test_thousands_of_inputs_in_one_request(client: httpx.Client) -> None:
    texts = [f"item {i}" for i in range(MAX_INPUTS)]
    r = client.post("/predict", json={"inputs": texts})
    assert r.status_code == 200
    assert r.json() == {"outputs": [{"chars": len(t)} for t in texts]}
    r = client.post("/predict", json={"inputs": texts + ["one too many"]})
    assert r.status_code == 400 and f"limit of {MAX_INPUTS}" in r.json()["error"]["message"]


# -- the embedded model: over-long texts and a real tokenizer ---------------------------------

@pytest.fixture(scope="module")
def minilm() -> Iterator[httpx.Client]:
    with labserver.serve("thread", "minilm", device="cpu") as h, httpx.Client(base_url=h.url, timeout=60) as c:
        yield c


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) == 384 and all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b, strict=True))


@pytest.mark.torch
def test_text_far_past_max_length_is_truncated_and_said(minilm: httpx.Client) -> None:
    long = "many words here " * 6000  # ~96 000 characters, ~18 000 tokens: 70x the window
    short = "A cat sits on the mat."
    alone = minilm.post("/predict", json={"inputs": short}).json()["output"]
    assert alone["truncated"] is False
    r = minilm.post("/predict", json={"inputs": [short, long]})
    assert r.status_code == 200
    out_short, out_long = r.json()["outputs"]
    assert out_long["truncated"] is True and len(out_long["embedding"]) == 384
    assert out_short["truncated"] is False
    assert _close(out_short["embedding"], alone["embedding"])  # its batch-mate did not disturb it
    r = minilm.post("/", content=long.encode())
    assert r.status_code == 200 and r.json()["truncated"] is True
    too_long = minilm.post("/", content=b"x" * 100_001)  # past max_chars (default 100 000): refused
    assert too_long.status_code == 400 and "100000" in too_long.json()["error"]["message"]


@pytest.mark.torch
def test_long_texts_share_batches_with_short_ones(minilm: httpx.Client) -> None:
    texts = ["short one", "word " * 20_000, "short two", "token " * 15_000]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(minilm.base_url), timeout=60) as c:
            return await asyncio.gather(*(c.post("/", content=t.encode()) for t in texts))

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.json()["truncated"] for r in responses] == [False, True, False, True]


@pytest.mark.torch
@settings(max_examples=40, deadline=None)
@given(text=any_text)
def test_odd_unicode_reaches_the_tokenizer_safely(minilm: httpx.Client, text: str) -> None:
    body = json.dumps({"inputs": text}).encode()  # lone surrogates travel as "\ud800" escapes
    r = minilm.post("/predict", content=body, headers=JSON)
    assert r.status_code < 500, r.text
    valid = bool(text.strip()) and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    assert r.status_code == (200 if valid else 400), (text, r.text[:200])
    if valid:
        assert len(r.json()["output"]["embedding"]) == 384
    assert minilm.post("/", content=b"still fine").status_code == 200
