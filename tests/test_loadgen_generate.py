"""The load generator against generative servers: POST /generate, server-sent events,
TTFT/TPOT/ITL from the schedule, output lengths, generation summaries, files.

The server is a plain asyncio HTTP/1.1 fake on a loopback socket, in its own thread,
that follows ``labserver.wire``'s /generate format and is scripted by each request's
prompt (``first=0.1 gap=0.05 end=done``: the delay before the first token, the gap
between tokens, how the stream ends). It writes the chunked encoding by hand, so a
test can cut a stream, split an event over two reads or send several in one, and it
notes the time (``time.perf_counter``, the client's clock too: same process) just
before each token goes out. The assertions compare what the client measured with
what the server did; the client side never sleeps to synchronise.
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
import pandas as pd
import pytest

from labserver import wire
from labserver.analysis import combine, combine_tokens, summarize, summarize_runs
from labserver.load.lengths import (ConstantLength, GeometricLength, ReplayLengths, UniformLength, iter_lengths,
                               make_lengths, take_lengths)
from labserver.load.clients import StreamClient
from labserver.loadgen import RECORD_COLUMNS, TOKEN_COLUMNS, LoadResult, LoadSpec, run_load_sync

from .test_analysis import make_records
from .test_loadgen import assert_record_shape, listening_socket

FAST = dict(process=False, progress=False, mode="generate")
TIMING = {"queue_ms": 1.5, "ttft_ms": 2.5, "server_ms": 7.25, "decode_calls": 3, "mean_decode_batch": 1.0}
HEADER_QUEUE_MS = "9.5"  # differs from TIMING's, so a test can tell which one a column holds


def _event(kind: bytes, data: Any) -> bytes:
    return kind + b"data: " + orjson.dumps(data) + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeGen:
    """The scripted /generate server; ``seen`` holds, per request, its body, request id,
    arrival and the time just before each token was written (``writes_s``)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.sock = listening_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.writers: set[asyncio.StreamWriter] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self.sock)
        self.started.set()
        await self.stop.wait()
        server.close()
        for writer in list(self.writers):
            writer.close()
        await server.wait_closed()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:  # keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
                body = json.loads(await reader.readexactly(length))
                if not await self._answer(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its connection
        finally:
            self.writers.discard(writer)
            writer.close()

    async def _answer(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        """Answer one request as its prompt says; False when the connection was cut."""
        log = {"body": body, "recv_s": time.perf_counter(), "writes_s": [], "id": f"g{len(self.seen)}"}
        self.seen.append(log)
        opt = dict(kv.split("=") for kv in body["prompt"].split())
        first_s, gap_s, end = float(opt.get("first", 0)), float(opt.get("gap", 0)), opt.get("end", "done")
        status, burst, split = int(opt.get("status", 200)), int(opt.get("burst", 1)), int(opt.get("split", -1))
        n = body["max_new_tokens"]
        ids = f"x-request-id: {log['id']}\r\nx-queue-ms: {HEADER_QUEUE_MS}\r\n".encode()
        if status != 200:  # failures before the first token are ordinary JSON errors
            doc = orjson.dumps({"error": {"type": "overloaded", "message": "full", "request_id": log["id"]}})
            writer.write(b"HTTP/1.1 %d Busy\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (status, ids, len(doc), doc))
            return True
        await asyncio.sleep(first_s)
        done = {"text": "", "tokens": list(range(n)), "finish_reason": "length", "prompt_tokens": 3,
                "generated_tokens": n, "timing": TIMING}
        if not body.get("stream"):
            await asyncio.sleep(gap_s * (n - 1))
            doc = orjson.dumps(done)
            writer.write(b"HTTP/1.1 200 OK\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (ids, len(doc), doc))
            return True
        writer.write(b"HTTP/1.1 200 OK\r\n%scontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     % ids)
        k = 0
        while k < n:
            if end == "cut" and k == int(opt["cut"]):
                writer.transport.abort()  # mid-stream, no final event, no last chunk
                return False
            group = [_event(wire.SSE_TOKEN, {"index": j, "id": j, "text": f" t{j}"})
                     for j in range(k, min(k + (burst if k == 0 else 1), n))]
            if k == split:  # one event over two chunks, the first ending inside "event: token"
                writer.write(_chunk(group[0][:9]))
                await writer.drain()
                await asyncio.sleep(0.05)
            log["writes_s"].extend([time.perf_counter()] * len(group))
            writer.write(_chunk(b"".join(group)[9 if k == split else 0:]))
            await writer.drain()
            k += len(group)
            if k < n:
                await asyncio.sleep(gap_s)
        if end == "done":
            writer.write(_chunk(_event(wire.SSE_DONE, done)))
        elif end == "error":
            writer.write(_chunk(_event(wire.SSE_ERROR, {"error": {"type": "model_error", "message": "boom",
                                                                  "request_id": log["id"]}})))
        writer.write(b"0\r\n\r\n")  # end == "none": the stream just ends, without a final event
        await writer.drain()
        return True

    def by_id(self, request_id: str) -> dict[str, Any]:
        return next(s for s in self.seen if s["id"] == request_id)


@pytest.fixture(scope="module")
def fake():
    server = FakeGen()
    server.thread.start()
    assert server.started.wait(10)
    yield server
    server.close()


def generate(url: str, prompt: str, n: int, stream: bool = True) -> tuple[float, Any]:
    """One request through StreamClient; (client time just before sending, answer)."""

    async def main():
        client = StreamClient(url + wire.GENERATE_PATH, content_type="application/json", timeout_s=10)
        try:
            body = json.dumps({"prompt": prompt, "max_new_tokens": n, "stream": stream}).encode()
            sent_s = time.perf_counter()
            return sent_s, await client.request(body)
        finally:
            await client.aclose()

    return asyncio.run(main())


# --- the client ------------------------------------------------------------------------

def test_client_times_each_token_after_the_server_wrote_it(fake):
    sent_s, answer = generate(fake.url, "first=0.1 gap=0.05", 5)
    log = fake.seen[-1]
    assert answer.status == 200 and answer.event_stream and answer.end == "done"
    assert answer.final["finish_reason"] == "length" and answer.timing() == TIMING
    assert answer.headers[wire.HEADER_REQUEST_ID] == log["id"]
    assert len(answer.token_s) == 5 and answer.token_s == sorted(answer.token_s)
    # causality, in one clock: no token is seen before the server wrote it ...
    assert all(seen >= wrote for seen, wrote in zip(answer.token_s, log["writes_s"]))
    # ... and each is seen before the next one was written (the gaps are 50 ms)
    assert all(seen < after for seen, after in zip(answer.token_s, log["writes_s"][1:]))
    assert answer.token_s[0] - sent_s >= 0.1


def test_events_of_one_read_share_its_time_and_a_split_event_counts_once(fake):
    _, answer = generate(fake.url, "first=0 gap=0.03 burst=3 split=4", 6)
    log = fake.seen[-1]
    assert len(answer.token_s) == 6 and answer.end == "done"
    assert answer.token_s[0] == answer.token_s[1] == answer.token_s[2]  # written together, read together
    assert answer.token_s[3] > answer.token_s[2]
    # token 4 was cut inside "event: token"; it counts when its second half came, 50 ms later
    assert answer.token_s[4] >= log["writes_s"][4] >= log["writes_s"][3] + 0.05 + 0.03


def test_one_piece_answer_keeps_its_body(fake):
    _, answer = generate(fake.url, "first=0.02", 4, stream=False)
    assert answer.status == 200 and not answer.event_stream and answer.token_s == []
    assert answer.result()["generated_tokens"] == 4 and answer.timing() == TIMING


# --- records ---------------------------------------------------------------------------

def test_stream_records_ttft_tpot_and_every_token(fake):
    result = run_load_sync(fake.url, payload="first=0.08 gap=0.04", new_tokens=5, arrival="constant",
                           rate_per_s=10, max_requests=3, **FAST)
    r, tok = result.records, result.tokens
    assert_record_shape(r)
    assert (r["status"] == 200).all() and (r["error"] == "").all()
    assert r["n_tokens"].tolist() == [5, 5, 5] and r["max_new_tokens"].tolist() == [5, 5, 5]
    assert (r["finish_reason"] == "length").all()
    assert (r["queue_ms"] == TIMING["queue_ms"]).all() and (r["server_ms"] == TIMING["server_ms"]).all()
    assert (r["ttft_ms"] >= 80).all() and (r["ttft_ms"] < r["latency_ms"]).all()
    np.testing.assert_allclose(r["ttft_ms"], (r["first_token_s"] - r["scheduled_s"]) * 1e3)
    np.testing.assert_allclose(r["tpot_ms"], (r["done_s"] - r["first_token_s"]) * 1e3 / 4)
    assert list(tok.columns) == list(TOKEN_COLUMNS) and len(tok) == 15
    for i, one in tok.groupby("i"):
        row = r.set_index("i").loc[i]
        assert one["k"].tolist() == list(range(5)) and one["t_s"].is_monotonic_increasing
        assert one["t_s"].iloc[0] == row["first_token_s"] and one["t_s"].iloc[-1] <= row["done_s"]
        log = fake.by_id(row["request_id"])
        # each client gap against the server's: never shorter by more than the first's delay allows
        client, server = np.diff(one["t_s"]), np.diff(log["writes_s"])
        assert client.sum() == pytest.approx(server.sum(), abs=0.03)
    assert {s["body"]["max_new_tokens"] for s in fake.seen[-3:]} == {5}
    assert all(s["body"]["stream"] is True and s["body"]["ignore_eos"] is True for s in fake.seen[-3:])
    summary = result.summary()
    assert summary["output_tokens"] == 15 and summary["ttft_p50_ms"] >= 80
    assert summary["itl_p50_ms"] == pytest.approx(40, abs=20) and summary["tpot_p50_ms"] == pytest.approx(40, abs=20)


def test_one_piece_answers_have_ttft_equal_to_latency(fake):
    result = run_load_sync(fake.url, payload="first=0.03 gap=0.01", new_tokens=6, stream=False, ignore_eos=False,
                           arrival="constant", rate_per_s=20, max_requests=2, **FAST)
    r = result.records
    assert (r["error"] == "").all() and r["n_tokens"].tolist() == [6, 6]
    assert (r["first_token_s"] == r["done_s"]).all() and (r["ttft_ms"] == r["latency_ms"]).all()
    assert (r["tpot_ms"] == 0).all() and (r["queue_ms"] == TIMING["queue_ms"]).all()
    assert result.tokens.empty
    assert all(s["body"]["stream"] is False and s["body"]["ignore_eos"] is False for s in fake.seen[-2:])


@pytest.mark.parametrize("script, kind, kept", [
    ("gap=0.01 end=error", "stream_error", 4),  # the model failed after some tokens
    ("gap=0.01 end=cut cut=2", "stream_incomplete", 2),  # the connection dropped mid-stream
    ("gap=0.01 end=none", "stream_incomplete", 4),  # the stream ended without a done event
])
def test_a_stream_that_fails_is_an_error_row_that_keeps_its_tokens(fake, script, kind, kept):
    result = run_load_sync(fake.url, payload=["first=0.01", script], new_tokens=4, arrival="constant",
                           rate_per_s=20, max_requests=2, **FAST)
    r = result.records.set_index("i")
    assert r.loc[0, "error"] == "" and r.loc[0, "n_tokens"] == 4
    assert r.loc[1, "status"] == 200 and r.loc[1, "error"] == kind
    assert r.loc[1, "n_tokens"] == kept and r.loc[1, "finish_reason"] == ""
    assert (result.tokens["i"] == 1).sum() == kept
    assert result.summary()["n_ok"] == 1 and result.summary()[f"err_{kind}"] == 1
    s = summarize(result.records)
    assert s["n_ok"] == 1 and s["n_err"] == 1 and "n_200" not in s and s["output_tokens"] == 4


def test_a_stream_past_its_timeout_keeps_the_tokens_it_got(fake):
    r = run_load_sync(fake.url, payload="first=0 gap=0.1", new_tokens=20, timeout_s=0.35, arrival="constant",
                      rate_per_s=20, max_requests=1, **FAST).records
    assert r.loc[0, "status"] == 200 and r.loc[0, "error"] == "timeout"
    assert 2 <= r.loc[0, "n_tokens"] <= 5  # tokens at 0, 0.1, 0.2, 0.3 s; the 20th would be at 1.9 s


def test_an_error_status_before_the_stream_is_a_status_not_an_error_kind(fake):
    r = run_load_sync(fake.url, payload="status=503", arrival="constant", rate_per_s=20, max_requests=1,
                      **FAST).records
    assert r.loc[0, "status"] == 503 and r.loc[0, "error"] == "" and r.loc[0, "n_tokens"] == 0
    assert np.isnan(r.loc[0, "ttft_ms"])


def test_ttft_counts_from_the_schedule_when_the_send_was_late(fake):
    """One slot (max_in_flight=1, overflow='wait') and a slow first answer: the next requests
    go out late. Their TTFT counts the wait; timed from the actual send it would not."""
    payload = ["first=0.3"] + ["first=0.02"] * 3
    result = run_load_sync(fake.url, payload=payload, new_tokens=2, arrival="constant", rate_per_s=20,
                           max_requests=4, max_in_flight=1, overflow="wait", **FAST)
    r = result.records.set_index("i")
    assert (r["error"] == "").all() and r.loc[0, "late_ms"] < 50
    late = r.loc[1:]
    assert (late["late_ms"] > 150).all()  # scheduled at 0.05 s and on, sent after 0.3 s
    assert (late["ttft_ms"] >= late["late_ms"] + 20).all()
    send_based_ttft_ms = (late["first_token_s"] - late["sent_s"]) * 1e3
    assert (send_based_ttft_ms < late["ttft_ms"] - 150).all()


def test_lengths_are_drawn_from_the_seed_and_sent_as_asked(fake):
    lengths = UniformLength(2, 6)
    result = run_load_sync(fake.url, payload="gap=0", new_tokens=lengths, seed=3, arrival="constant",
                           rate_per_s=50, max_requests=12, **FAST)
    r = result.records
    expected = take_lengths(lengths, 12, seed=[3, 2])
    assert r["max_new_tokens"].tolist() == expected.tolist() and len(set(expected)) > 1
    assert r["n_tokens"].tolist() == expected.tolist()
    for _, row in r.iterrows():
        assert fake.by_id(row["request_id"])["body"]["max_new_tokens"] == row["max_new_tokens"]
    again = run_load_sync(fake.url, payload="gap=0", new_tokens=lengths, seed=3, arrival="constant",
                          rate_per_s=50, max_requests=12, **FAST)
    assert again.records["max_new_tokens"].tolist() == expected.tolist()


def test_closed_loop_in_spawned_processes(fake):
    result = run_load_sync(fake.url, payload="gap=0.005", new_tokens=[3, 5], users=2, max_requests=8,
                           mode="generate", processes=2, progress=False)
    r = result.records
    assert len(r) == 8 and (r["error"] == "").all() and r["i"].tolist() == list(range(8))
    assert sorted(r["max_new_tokens"].tolist()) == [3, 3, 3, 3, 5, 5, 5, 5]
    assert (r["n_tokens"] == r["max_new_tokens"]).all()
    counts = result.tokens.groupby("i").size()
    assert counts.to_dict() == r.set_index("i")["n_tokens"].astype(int).to_dict()  # renumbered together


def test_against_the_real_generation_server():
    """The same client against labserver's own /generate (uvicorn's chunked encoding, its
    timing fields), one step of 2 ms per token."""
    import labserver
    from labserver.models import SyntheticGen

    with labserver.serve("gen-continuous", SyntheticGen(2, 2), max_batch_size=4, max_new_tokens=16) as h:
        result = run_load_sync(h.url, payload="once upon a time", new_tokens=UniformLength(3, 8), seed=1,
                               arrival="constant", rate_per_s=50, max_requests=10, **FAST)
    r = result.records
    assert (r["status"] == 200).all() and (r["error"] == "").all()
    assert (r["n_tokens"] == r["max_new_tokens"]).all() and (r["finish_reason"] == "length").all()
    assert len(result.tokens) == r["n_tokens"].sum()
    assert r["queue_ms"].notna().all() and (r["server_ms"] <= r["latency_ms"]).all()
    assert ((r["ttft_ms"] > 0) & (r["ttft_ms"] < r["latency_ms"])).all()


def test_generate_spec_checks(fake):
    with pytest.raises(ValueError, match="client='raw'"):
        LoadSpec(fake.url, mode="generate", client="httpx", max_requests=1)
    with pytest.raises(TypeError, match="new_tokens"):
        LoadSpec(fake.url, mode="generate", new_tokens="many", max_requests=1)
    with pytest.raises(ValueError, match=">= 1"):
        LoadSpec(fake.url, mode="generate", new_tokens=[4, 0], max_requests=1)
    assert LoadSpec(fake.url, mode="generate", max_requests=1).target_url() == fake.url + "/generate"


def test_text_runs_keep_generation_columns_empty():
    records = make_records([10.0, 20.0])
    assert not any(c in summarize(records) for c in ("ttft_p50_ms", "output_tokens", "gen_goodput_rps"))


# --- output lengths ----------------------------------------------------------------------

def test_length_distributions_are_seeded_and_bounded():
    rng = lambda: np.random.default_rng(7)  # noqa: E731
    assert ConstantLength(9).take(4, rng()).tolist() == [9] * 4
    u = UniformLength(3, 7).take(20_000, rng())
    assert u.min() == 3 and u.max() == 7 and set(u.tolist()) == {3, 4, 5, 6, 7}
    assert u.mean() == pytest.approx(5, abs=0.05)
    assert np.array_equal(u, UniformLength(3, 7).take(20_000, rng()))
    assert not np.array_equal(u, UniformLength(3, 7).take(20_000, np.random.default_rng(8)))
    g = GeometricLength(20).take(20_000, rng())
    assert g.min() >= 1 and g.mean() == pytest.approx(20, rel=0.05)
    clipped = GeometricLength(20, lo=5, hi=30).take(20_000, rng())
    assert clipped.min() == 5 and clipped.max() == 30
    assert ReplayLengths([3, 1, 2]).take(7, rng()).tolist() == [3, 1, 2, 3, 1, 2, 3]
    stream = iter_lengths([3, 1, 2])
    assert [next(stream) for _ in range(5)] == [3, 1, 2, 3, 1]
    endless = iter_lengths(UniformLength(1, 3), seed=1)
    assert {next(endless) for _ in range(3000)} == {1, 2, 3}
    assert make_lengths(5) == ConstantLength(5) and make_lengths(np.array([2, 4])) == ReplayLengths([2, 4])


@pytest.mark.parametrize("bad", [lambda: ConstantLength(0), lambda: UniformLength(5, 4), lambda: GeometricLength(0.5),
                                 lambda: ReplayLengths([]), lambda: make_lengths(True)])
def test_bad_lengths_say_what_is_wrong(bad):
    with pytest.raises((ValueError, TypeError)):
        bad()


# --- analysis on hand-made numbers --------------------------------------------------------

def gen_records() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Three good answers, one stream that failed after its 200, one 503; worked by hand below."""
    records = make_records([100.0, 200.0, 400.0, 150.0, 5.0], status=[200, 200, 200, 200, 503])
    records["error"] = ["", "", "", "stream_error", ""]
    records["n_tokens"] = pd.array([10, 10, 1, 2, 0], dtype="Int64")
    records["ttft_ms"] = [10.0, 20.0, 40.0, 5.0, np.nan]
    records["first_token_s"] = records["scheduled_s"] + records["ttft_ms"] / 1e3
    n = records["n_tokens"].astype(float)
    records["tpot_ms"] = ((records["latency_ms"] - records["ttft_ms"]) / (n - 1)).where(n > 1)
    tokens = pd.DataFrame({"i": [0, 0, 0, 1, 1, 1, 2, 3, 3], "k": [0, 1, 2, 0, 1, 2, 0, 0, 1],
                           "t_s": [0.010, 0.020, 0.050, 1.020, 1.020, 1.060, 2.040, 3.005, 3.500]})
    return records, tokens


def test_generation_summary_by_hand():
    records, tokens = gen_records()
    # ok: i 0, 1, 2 -> ttft 10, 20, 40; tpot (100-10)/9 = 10, (200-20)/9 = 20, NaN (one token)
    assert records["tpot_ms"].iloc[:3].tolist()[:2] == [10.0, 20.0]
    s = summarize(records, duration_s=4.0, tokens=tokens, ttft_slo_ms=25, tpot_slo_ms=15)
    assert (s["n_ok"], s["n_err"], s["n_503"]) == (3, 1, 1)
    assert s["ttft_p50_ms"] == 20 and s["ttft_p90_ms"] == pytest.approx(36) and s["ttft_p99_ms"] == pytest.approx(39.6)
    assert s["tpot_p50_ms"] == 15 and s["tpot_p99_ms"] == pytest.approx(19.9)
    # gaps of i 0..2 pooled: 10, 30, 0, 40 ms (i 3's 495 ms gap is an error's, left out)
    assert s["itl_p50_ms"] == pytest.approx(20) and s["itl_p99_ms"] == pytest.approx(39.7)
    assert s["output_tokens"] == 21 and s["token_throughput_tps"] == pytest.approx(21 / 4)
    assert s["mean_tokens_per_s_per_request"] == pytest.approx((10 / 0.1 + 10 / 0.2 + 1 / 0.4) / 3)
    # good: i 0 only (i 1 misses TPOT, i 2 misses TTFT; the failed stream would pass both)
    assert s["gen_goodput_rps"] == pytest.approx(1 / 4)
    assert summarize(records, duration_s=4.0, tpot_slo_ms=15)["gen_goodput_rps"] == pytest.approx(2 / 4)
    assert summarize(records, duration_s=4.0, ttft_slo_ms=25)["gen_goodput_rps"] == pytest.approx(2 / 4)
    assert summarize(records, duration_s=4.0, ttft_slo_ms=50, tpot_slo_ms=25)["gen_goodput_rps"] == 0.75
    plain = summarize(records, duration_s=4.0)
    assert np.isnan(plain["gen_goodput_rps"]) and "itl_p50_ms" not in plain


def test_generation_summaries_per_run_with_combined_tokens():
    records, tokens = gen_records()
    fast = LoadResult(records, {"target_rate": 1.0}, tokens=tokens)
    slow_records = records.assign(ttft_ms=records["ttft_ms"] * 10)
    slow = LoadResult(slow_records, {"target_rate": 2.0}, tokens=tokens.assign(t_s=tokens["t_s"] * 2))
    runs = {"fast": fast, "slow": slow}
    table = summarize_runs(combine(runs), duration_s=4.0, tokens=combine_tokens(runs), ttft_slo_ms=25)
    assert table["label"].tolist() == ["fast", "slow"]
    assert table["ttft_p50_ms"].tolist() == [20, 200] and table["gen_goodput_rps"].tolist() == [0.5, 0.0]
    assert table["itl_p50_ms"].tolist() == pytest.approx([20, 40])
    with pytest.raises(ValueError, match="combine_tokens"):
        summarize_runs(combine(runs), tokens=tokens)


# --- files ---------------------------------------------------------------------------------

def test_csv_round_trip_keeps_the_tokens(fake, tmp_path):
    result = run_load_sync(fake.url, payload=["gap=0.01", "gap=0.01 end=cut cut=1"], new_tokens=3,
                           arrival="constant", rate_per_s=20, max_requests=4, **FAST)
    assert len(result.tokens) == 3 + 1 + 3 + 1
    path = result.to_csv(tmp_path / "gen.csv")
    assert (tmp_path / "gen.csv.tokens.csv").exists()
    back = LoadResult.from_csv(path)
    pd.testing.assert_frame_equal(back.records, result.records)
    pd.testing.assert_frame_equal(back.tokens, result.tokens)
    pd.testing.assert_series_equal(pd.Series(back.summary()), pd.Series(result.summary()))


def test_old_csv_files_load_with_empty_generation_columns(tmp_path):
    old_columns = [c for c in RECORD_COLUMNS if c not in
                   ("first_token_s", "n_tokens", "max_new_tokens", "finish_reason", "ttft_ms", "tpot_ms", "replica",
                    "reason", "flow", "priority", "tenant", "input_tokens")]
    old = make_records([10.0, 20.0]).assign(process=0, warmup=False)
    old["batch_size"] = old["batch_size"].astype("Int64")
    old["batch_id"] = old["batch_id"].astype("Int64")
    old[old_columns].to_csv(tmp_path / "old.csv", index=False)
    back = LoadResult.from_csv(tmp_path / "old.csv")
    assert_record_shape(back.records)
    assert back.records["n_tokens"].isna().all() and (back.records["finish_reason"] == "").all()
    assert back.records["ttft_ms"].isna().all() and back.tokens.empty
    assert "ttft_p50_ms" not in back.summary()
    assert (back.records["reason"] == "").all() and (back.records["flow"] == "").all()
    assert back.records["priority"].isna().all() and back.records["input_tokens"].isna().all()
