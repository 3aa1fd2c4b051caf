"""The load generator speaking OpenAI's API: any server measured the same way as labserver's own routes.

A scripted asyncio fake of an OpenAI-compatible server (its prompt says how to answer:
``first=0.1 gap=0.02 per=3 usage=1 done=1 role=1``) shows what a peer may do that
labserver does not: a role-only first chunk, several tokens per chunk, no usage, no
``[DONE]``. Then the same generator against a real labserver's ``/v1`` routes, and the
workloads the benchmark tools use (gamma bursts, prompts of N tokens, a shared prefix).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import numpy as np
import orjson
import pytest

import labserver
from labserver import cli
from labserver.load.apis import default_path, models_url, openai_body
from labserver.load.arrivals import Gamma, make_arrival, take_payloads
from labserver.load.openai_sse import OpenAIAnswer, spread
from labserver.load.prompts import TokenPrompts
from labserver.loadgen import LoadSpec, run_load_sync
from labserver.models import SyntheticGen, minilm_dir

from .test_loadgen import listening_socket

FAST = dict(process=False, progress=False)


def _data(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeOpenAI:
    """A scripted OpenAI-compatible server; ``seen`` keeps each request's path, body and chunk write times."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.sock = listening_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.started = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self.sock)
        self.started.set()
        await self.stop.wait()
        server.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ")[:2]
                match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                body = json.loads(await reader.readexactly(int(match.group(1)))) if match else {}
                await self._answer(method.decode(), path.decode(), body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if method == "GET":
            doc = orjson.dumps({"object": "list", "data": [{"id": "peer-model", "object": "model"}]})
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(doc), doc))
            return
        log = {"path": path, "body": body, "writes_s": []}
        self.seen.append(log)
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        opt = dict(kv.split("=") for kv in text.split() if "=" in kv)
        first, gap, per = float(opt.get("first", 0)), float(opt.get("gap", 0)), int(opt.get("per", 1))
        chat, n = "messages" in body, body["max_tokens"]
        head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "model": body["model"]}
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if chat and opt.get("role", "1") == "1":  # a role-only first chunk, before any token: not the first token
            writer.write(_chunk(_data({**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})))
        await writer.drain()
        await asyncio.sleep(first)
        k = 0
        while k < n:
            size = min(per, n - k)
            words = "".join(f" w{j}" for j in range(k, k + size))
            k += size
            finish = "length" if k == n else None
            choice = ({"index": 0, "delta": {"content": words}, "finish_reason": finish} if chat
                      else {"index": 0, "text": words, "finish_reason": finish})
            if opt.get("error") == str(k):  # the error event, [DONE], nothing else
                writer.write(_chunk(_data({"error": {"message": "boom", "type": "server_error"}})))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                return
            log["writes_s"].append(time.perf_counter())
            writer.write(_chunk(_data({**head, "choices": [choice]})))
            await writer.drain()
            if k < n:
                await asyncio.sleep(gap)
        if opt.get("usage", "1") == "1":
            writer.write(_chunk(_data({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": k,
                                                                         "total_tokens": 3 + k}})))
        if opt.get("done", "1") == "1":
            writer.write(_chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture(scope="module")
def fake() -> Any:
    server = FakeOpenAI()
    server.thread.start()
    assert server.started.wait(10)
    yield server
    server.close()


def load(url: str, prompt: str, **options: Any) -> Any:
    return run_load_sync(url, payload=prompt, users=1, max_requests=1, **{**FAST, **options})


# -- the reader alone ---------------------------------------------------------------------------------

def test_answer_reads_chunks_split_anywhere() -> None:
    stream = (_data({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
              + _data({"choices": [{"index": 0, "delta": {"content": "ab"}}]})
              + _data({"choices": [{"index": 0, "delta": {"content": "cdef"}, "finish_reason": "length"}]})
              + _data({"choices": [], "usage": {"completion_tokens": 6}}) + b"data: [DONE]\n\n")
    for cut in (1, 7, 40, len(stream) - 3):
        a = OpenAIAnswer()
        a.begin(200, {"content-type": "text/event-stream"})
        a.feed(stream[:cut], 1.0)
        a.feed(stream[cut:], 2.0)
        assert a.outcome(3.0)[0] == "" and a.outcome(3.0)[2] == 6 and a.outcome(3.0)[3] == "length"
        assert len(a.chunk_s) == 2 and a.end == "done"  # the role chunk carried no content
        assert a.token_s == [a.chunk_s[0]] * 2 + [a.chunk_s[1]] * 4  # shares in proportion to characters


def test_answer_without_usage_done_or_with_an_error() -> None:
    def read(events: bytes) -> OpenAIAnswer:
        a = OpenAIAnswer()
        a.begin(200, {"content-type": "text/event-stream"})
        a.feed(events, 1.0)
        return a

    one = _data({"choices": [{"text": "x", "finish_reason": None}]})
    last = _data({"choices": [{"text": "y", "finish_reason": "stop"}]})
    assert read(one + last).outcome(2.0)[:3:2] == ("", 2)  # no usage: a chunk, a token; no [DONE] but finished
    assert read(one).outcome(2.0)[0] == "stream_incomplete"
    broken = read(one + _data({"error": {"message": "boom"}}) + b"data: [DONE]\n\n")
    assert broken.outcome(2.0)[0] == "stream_error" and broken.error == {"message": "boom"}
    only_eos = read(_data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                    + _data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                    + _data({"choices": [], "usage": {"completion_tokens": 1}}) + b"data: [DONE]\n\n")
    assert only_eos.outcome(2.0)[:3:2] == ("", 1) and only_eos.token_s == []  # an answer that is only its EOS
    plain = OpenAIAnswer()
    plain.begin(200, {"content-type": "application/json"})
    plain.feed(orjson.dumps({"choices": [{"text": "abc", "finish_reason": "length"}],
                             "usage": {"completion_tokens": 5}}), 1.0)
    assert plain.outcome(4.0) == ("", 4.0, 5, "length")


def test_spread() -> None:
    assert spread(6, [1, 1, 1]) == [2, 2, 2] and spread(3, [5, 0, 1]) == [1, 1, 1]
    assert spread(10, [6, 1, 1]) == [8, 1, 1] and sum(spread(17, [3, 9, 2, 7])) == 17
    assert spread(2, [1, 1, 1]) == [1, 1, 0]


def test_bodies_and_paths() -> None:
    chat = json.loads(openai_body("openai-chat", "m", "hi", 7))
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    plain = json.loads(openai_body("openai-completions", "m", "hi", 7, stream=False, ignore_eos=False))
    assert plain == {"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.0, "stream": False}
    assert json.loads(openai_body("openai-embeddings", "m", "hi"))["encoding_format"] == "float"
    assert default_path("openai-chat", "text", "/v1") == "/v1/chat/completions"
    assert models_url("http://127.0.0.1:1/v1/completions") == "http://127.0.0.1:1/v1/models"
    assert models_url("http://127.0.0.1:1") == "http://127.0.0.1:1/v1/models"
    assert LoadSpec("http://127.0.0.1:1/v1", api="openai-chat", max_requests=1).target_url().endswith(
        "/v1/chat/completions")


def test_remote_targets_stay_refused() -> None:
    with pytest.raises(ValueError, match="loopback"):
        LoadSpec("http://10.1.2.3:8000", api="openai-chat", max_requests=1)
    assert LoadSpec("http://10.1.2.3:8000", api="openai-chat", max_requests=1, allow_remote=True)


# -- against a peer: the scripted fake -----------------------------------------------------------------

def test_ttft_is_the_first_chunk_with_content(fake: FakeOpenAI) -> None:
    r = load(fake.url, "first=0.15 gap=0.02", api="openai-chat", new_tokens=5)
    rec, log = r.records.iloc[0], fake.seen[-1]
    assert rec["error"] == "" and rec["status"] == 200 and rec["n_tokens"] == 5 and rec["finish_reason"] == "length"
    assert log["body"]["model"] == "peer-model"  # asked of GET /v1/models
    assert log["path"] == "/v1/chat/completions" and log["body"]["ignore_eos"] is True
    assert rec["ttft_ms"] >= 150  # the role chunk came at once; the first token 150 ms later
    assert len(r.tokens) == 5 and (np.diff(r.tokens["t_s"].to_numpy()) >= 0.015).all()  # a chunk each, 20 ms apart


def test_several_tokens_per_chunk_count_from_usage(fake: FakeOpenAI) -> None:
    r = load(fake.url, "first=0.01 gap=0.03 per=3", api="openai-completions", model="any", new_tokens=7)
    rec = r.records.iloc[0]
    assert rec["n_tokens"] == 7 and len(r.tokens) == 7  # 3 chunks (3 + 3 + 1 tokens), 7 token times
    times = r.tokens["t_s"].to_numpy()
    assert times[0] == times[1] == times[2] and times[3] > times[2] + 0.02
    s = r.summary()
    assert abs(s["tpot_p50_ms"] - (times[-1] - times[0]) * 1000 / 6) < 1.0  # TPOT over all 7 tokens


def test_a_peer_without_usage_or_done(fake: FakeOpenAI) -> None:
    r = load(fake.url, "per=2 usage=0 done=0", api="openai-completions", model="any", new_tokens=6)
    rec = r.records.iloc[0]
    assert rec["error"] == "" and rec["n_tokens"] == 3  # counted: 3 chunks, the client cannot know better


def test_an_error_event_mid_stream(fake: FakeOpenAI) -> None:
    r = load(fake.url, "error=3", api="openai-chat", model="any", new_tokens=6)
    rec = r.records.iloc[0]
    assert rec["error"] == "stream_error" and rec["n_tokens"] == 2 and r.summary()["n_ok"] == 0


# -- against labserver's /v1 -----------------------------------------------------------------------------

def test_labserver_native_and_v1_measure_the_same_work() -> None:
    with labserver.serve("gen-continuous", SyntheticGen(2, 1), max_batch_size=16) as h:
        runs = {api: run_load_sync(h.url, api=api, mode="generate", rate_per_s=30, max_requests=30, new_tokens=6,
                                   payload=TokenPrompts(8), progress=False)
                for api in ("labserver", "openai-completions", "openai-chat")}
    for api, r in runs.items():
        rec = r.records
        assert (rec["error"] == "").all() and (rec["n_tokens"] == 6).all(), api
        assert (rec["finish_reason"] == "length").all() and rec["ttft_ms"].notna().all(), api
        assert len(r.tokens) == 180 and rec["queue_ms"].notna().all(), api  # the server's header, read by name
    assert runs["openai-chat"].meta["model"] == "synthetic-gen:2+1"


def test_embeddings_load() -> None:
    with labserver.serve("thread", "minilm", device="cpu") as h:
        r = run_load_sync(h.url, api="openai-embeddings", rate_per_s=20, max_requests=10, progress=False)
    assert (r.records["status"] == 200).all() and r.records["batch_size"].notna().all()
    assert r.meta["target_url"].endswith("/v1/embeddings")


# -- workloads --------------------------------------------------------------------------------------------

def test_gamma_arrivals() -> None:
    for shape in (0.25, 1.0, 4.0):
        t = Gamma(50.0, shape).times(max_requests=20_000, seed=3)
        gaps = np.diff(t)
        assert t[0] == 0 and abs(gaps.mean() * 50 - 1) < 0.05
        assert abs(gaps.std() / gaps.mean() - 1 / np.sqrt(shape)) < 0.1  # CV of the gaps: 1/sqrt(shape)
    assert make_arrival("gamma:0.3", 10) == Gamma(10, 0.3) and make_arrival("gamma", 10) == Gamma(10, 0.5)
    assert len(Gamma(10).times(duration_s=2.0, seed=1)) > 5 and (Gamma(10).times(duration_s=2.0) < 2.0).all()
    with pytest.raises(ValueError, match="gamma"):
        make_arrival("gamma:x", 10)


def test_token_prompts_and_a_shared_prefix() -> None:
    texts = take_payloads(TokenPrompts(16), 5, seed=1)
    assert [len(t.split()) for t in texts] == [16] * 5 and len(set(texts)) == 5
    shared = TokenPrompts(4, prefix_tokens=50)
    a, b = take_payloads(shared, 3, seed=1), take_payloads(shared, 3, seed=2)
    prefix = " ".join(a[0].split()[:50])
    assert all(t.startswith(prefix) and len(t.split()) == 54 for t in a + b)  # the same prefix, whatever the seed
    assert len({t.split(maxsplit=50)[-1] for t in a}) == 3  # own suffixes
    two = take_payloads(TokenPrompts(4, prefix_tokens=20, prefixes=2), 40, seed=0)
    assert len({" ".join(t.split()[:20]) for t in two}) == 2


def test_token_prompts_counted_by_a_tokenizer() -> None:
    from transformers import AutoTokenizer

    folder = str(minilm_dir())
    tok = AutoTokenizer.from_pretrained(folder)
    for text in take_payloads(TokenPrompts(24, tokenizer=folder), 4, seed=0):
        assert len(tok.encode(text, add_special_tokens=False)) == 24


def test_cli_builds_the_load_options() -> None:
    args = cli.build_parser().parse_args([
        "bench", "--url", "http://127.0.0.1:9", "--api", "openai-chat", "--model", "m", "--rate", "2",
        "--arrival", "gamma", "--burstiness", "0.25", "--prompt-tokens", "64", "--shared-prefix", "512",
        "--new-tokens", "32", "--max-concurrency", "8", "--no-ignore-eos"])
    opts = cli.load_options(args)
    assert opts["api"] == "openai-chat" and opts["model"] == "m" and opts["arrival"] == "gamma:0.25"
    assert opts["max_in_flight"] == 8 and opts["overflow"] == "wait" and opts["ignore_eos"] is False
    assert opts["payload"].prefix_tokens == 512 and opts["new_tokens"].n == 32
