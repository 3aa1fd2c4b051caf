"""Disaggregated serving on a real Ray Serve (``labserver.replicas.disagg``): a prefill pool, a decode pool, the KV
handed over between them, and what happens when a replica dies on either side.

One local Ray serves the module; each deployment joins it (the app removed after its tests). The real model's
answers through the two pools are compared with one server's; the synthetic model's deployment takes the faults,
which come last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

import labserver  # noqa: E402
from labserver import wire  # noqa: E402
from labserver.replicas import ReplicasHandle, ray_session  # noqa: E402

from .fakes import sse_events  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # Ray's own

KV_BYTES = 1000  # what the synthetic model says a position holds
MODEL = f"synthetic-gen:20+5?kv_bytes={KV_BYTES}"


@pytest.fixture(scope="module", autouse=True)
def local() -> Iterator[None]:
    """One local Ray and Serve on loopback for the module (each deployment joins them, removing only its app)."""
    with ray_session():
        yield
    assert not ray.is_initialized()


def replica_stats(h: ReplicasHandle, role: str, until: Any = lambda s: True) -> dict[str, Any]:
    """The one replica of ``role``'s stats once they show ``until`` and nothing running or holding KV (the board
    is refreshed twice a second: this polls, bounded)."""
    deadline = time.monotonic() + 30
    while True:
        mine = [s for s in h.stats()["replicas"].values() if s["role"] == role]
        if mine and mine[-1]["running"] == 0 and mine[-1]["kv_blocks"]["used"] == 0 and until(mine[-1]):
            return mine[-1]
        if time.monotonic() > deadline:
            raise AssertionError(f"no settled {role} replica: {h.stats()['replicas']}")
        time.sleep(0.2)


def chats(url: str, questions: list[str]) -> list[dict[str, Any]]:
    """Each question's greedy answer (16 tokens at most) with its tokens' log-probabilities."""
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence, and name the "
                                           "city you mean."}
    out = []
    for q in questions:
        r = httpx.post(url + wire.V1_CHAT_PATH, json={"model": "smollm2", "max_tokens": 16, "temperature": 0,
                                                      "logprobs": True, "messages": [system, {"role": "user",
                                                                                              "content": q}]},
                       timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0])
    return out


def test_smollm2_through_prefill_and_decode_pools_answers_as_one_server() -> None:
    """Greedy answers and their log-probabilities token for token, the second time a prompt comes with its first
    blocks already in the decode replica's prefix cache (not written again)."""
    questions = ["What is the capital of France?", "What is the capital of Italy?", "What is the capital of France?"]
    with labserver.serve("gen-continuous", "smollm2", max_batch_size=4, prefix_cache=True) as one:
        want = chats(one.url, questions)
    with labserver.serve("gen-continuous", "smollm2", disaggregate=(1, 1), max_batch_size=4,
                         prefix_cache=True) as h:
        got = chats(h.url, questions)
        decode = replica_stats(h, "decode", lambda s: s["kv_handed_in"] == 3)
        stats = h.stats()
    for a, b in zip(got, want, strict=True):
        assert a["message"]["content"] == b["message"]["content"] and len(a["logprobs"]["content"]) > 3
        assert [t["token"] for t in a["logprobs"]["content"]] == [t["token"] for t in b["logprobs"]["content"]]
        assert [t["logprob"] for t in a["logprobs"]["content"]] == pytest.approx(
            [t["logprob"] for t in b["logprobs"]["content"]], abs=1e-4)
    assert "Paris" in got[0]["message"]["content"]
    assert decode["prefill_calls"] == 0 and decode["cached_tokens"] >= 16
    prompt_tokens = decode["prompt_tokens"]
    assert stats["kv_transfers"] == 3 and stats["kv_transfer_bytes"] == prompt_tokens * decode["kv_bytes_per_token"]


@pytest.fixture(scope="module")
def pools() -> Iterator[ReplicasHandle]:
    h = labserver.serve("gen-continuous", MODEL, disaggregate=(1, 1), router="round-robin", max_batch_size=4,
                        prefix_cache=True, kv_block_tokens=4, max_new_tokens=256)
    try:
        yield h
    finally:
        h.stop()


def test_answers_equal_one_engines_and_every_byte_handed_over_is_counted(pools: ReplicasHandle) -> None:
    alone = labserver.serve("gen-continuous", "synthetic-gen:0+0", max_batch_size=4, prefix_cache=True,
                            kv_block_tokens=4)
    prompts = ["a b c d e f g h i", "a b c d e f g h j k", "x y z"]
    try:
        want = [httpx.post(alone.url + "/generate", json={"prompt": p, "max_new_tokens": 9, "ignore_eos": True}
                           ).json()["tokens"] for p in prompts]
    finally:
        alone.stop()
    before = pools.stats()
    for p, tokens in zip(prompts, want, strict=True):
        r = httpx.post(pools.url + "/generate", json={"prompt": p, "max_new_tokens": 9, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == tokens, r.text
        prefill, _, decode = r.headers[wire.HEADER_REPLICA].partition(">")
        assert prefill and decode and prefill != decode
        timing = r.json()["timing"]  # the TTFT split: queue, prefill, transfer, then the decode side's admission
        assert 0 < timing["queue_ms"] < timing["prefilled_ms"] < timing["ttft_ms"]
        assert 0 < timing["transfer_ms"] < timing["ttft_ms"] - timing["prefilled_ms"]
    after = pools.stats()
    assert after["kv_transfers"] - before["kv_transfers"] == 3
    assert after["kv_transfer_bytes"] - before["kv_transfer_bytes"] == KV_BYTES * sum(len(p.split()) for p in prompts)
    metrics = httpx.get(pools.url + "/metrics").text
    assert f"labserver:kv_transfer_bytes_total {float(after['kv_transfer_bytes'])}" in metrics
    assert "labserver:kv_transfer_ms_total" in metrics
    # one token asked for: answered by the prefill replica alone, no hand-over
    r = httpx.post(pools.url + "/generate", json={"prompt": "just one", "max_new_tokens": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["tokens"]) == 1 and ">" not in r.headers[wire.HEADER_REPLICA]
    assert pools.stats()["answered_by_prefill"] == before["answered_by_prefill"] + 1
    assert replica_stats(pools, "prefill", lambda s: s["kv_handed_out"] >= 3)["kv_parked"] == 0


def test_a_chat_stream_goes_through_both_pools(pools: ReplicasHandle) -> None:
    with httpx.stream("POST", pools.url + wire.V1_CHAT_PATH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                            "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200
        body = "".join(r.iter_text())
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 6
    assert body.rstrip().endswith("data: [DONE]")


def test_a_decode_replica_lost_before_its_pull_is_replaced_and_nothing_leaks(pools: ReplicasHandle) -> None:
    """The decode replica exits as the hand-over reaches it, before it pulls: the ingress sends the job to the
    decode pool again (no token had reached the client), Serve's replacement pulls the KV the prefill replica
    still held, and the answer is whole; then no block is held on either side."""
    before = pools.stats()
    pools.fault("Decode", "pull")
    r = httpx.post(pools.url + "/generate", json={"prompt": "survive this please", "max_new_tokens": 8,
                                                  "ignore_eos": True, "stream": True}, timeout=120)
    events = sse_events(r.text)
    assert [k for k, _ in events].count("token") == 8 and events[-1][0] == "done", r.text
    assert pools.stats()["decode_retries"] == before["decode_retries"] + 1
    prefill = replica_stats(pools, "prefill", lambda s: s["kv_handed_out"] >= 1)
    assert prefill["kv_parked"] == 0 and prefill["kv_blocks"]["used"] == 0 and prefill["kv_handed_expired"] == 0
    assert replica_stats(pools, "decode", lambda s: s["kv_handed_in"] == 1)["kv_imported_tokens"] == 3


def test_a_prefill_replica_lost_mid_prompt_is_a_clear_503_and_the_pool_recovers(pools: ReplicasHandle) -> None:
    pools.fault("Prefill", "prefill")
    r = httpx.post(pools.url + "/generate", json={"prompt": "doomed prompt", "max_new_tokens": 8}, timeout=120)
    assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    error = r.json()["error"]
    assert error["type"] == "model_unavailable" and "retry" in error["message"] and "Traceback" not in r.text
    deadline = time.monotonic() + 90  # Serve starts a new prefill replica; requests succeed again
    while True:
        r = httpx.post(pools.url + "/generate", json={"prompt": "after the loss", "max_new_tokens": 4}, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert replica_stats(pools, "decode")["kv_blocks"]["used"] == 0
