"""Model specs, including the real embedded model (small, offline)."""

from __future__ import annotations

import math

import httpx
import pytest

import labserver
from labserver.models import POISON, Echo, InputRejected, ModelError, ModelLoadError, load_model, parse_synthetic


def test_synthetic_spec_and_cost() -> None:
    m = parse_synthetic("synthetic:2+0.5")
    assert (m.base_ms, m.per_item_ms, m.cost_ms(4)) == (2.0, 0.5, 4.0)
    assert m(["a", "bb"]) == [{"chars": 1}, {"chars": 2}]
    with pytest.raises(ModelError):
        m(["fine", f"x{POISON}x"])
    with pytest.raises(ValueError, match="synthetic:BASE_MS"):
        parse_synthetic("synthetic:fast")
    with pytest.raises(ValueError, match="oom_above"):
        parse_synthetic("synthetic:1+1?oops=1")


def test_echo_and_load_errors() -> None:
    assert isinstance(load_model("echo"), Echo)
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model("/definitely/not/a/model")


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    return load_model("minilm", device="cpu")


def test_minilm_embeds_offline(minilm) -> None:  # type: ignore[no-untyped-def]
    a, b, c = minilm(["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply."])
    for out in (a, b, c):
        assert len(out["embedding"]) == 384
        assert math.isclose(sum(x * x for x in out["embedding"]), 1.0, rel_tol=1e-5)
        assert out["truncated"] is False

    def cos(u: dict, v: dict) -> float:
        return sum(x * y for x, y in zip(u["embedding"], v["embedding"]))

    assert cos(a, b) > cos(a, c) + 0.2  # a real sentence model, not noise


def test_minilm_batched_equals_single(minilm) -> None:  # type: ignore[no-untyped-def]
    texts = ["short", "a somewhat longer sentence with more tokens in it"]
    batched = minilm(texts)
    single = [minilm([t])[0] for t in texts]
    for x, y in zip(batched, single):
        assert max(abs(p - q) for p, q in zip(x["embedding"], y["embedding"])) < 1e-5  # padding is masked


def test_minilm_truncates_and_says_so(minilm) -> None:  # type: ignore[no-untyped-def]
    out = minilm(["word " * 2000, "short one"])
    assert out[0]["truncated"] is True and out[1]["truncated"] is False


def test_bert_base_random_fill_mask() -> None:
    m = load_model("bert-base-random", device="cpu")
    n_params = sum(p.numel() for p in m.pipe.model.parameters())
    assert 105e6 < n_params < 115e6  # bert-base-uncased size
    assert m.pipe.tokenizer.vocab_size == 30522  # the full uncased vocabulary, not [UNK] for every word
    assert m.pipe.tokenizer.tokenize("Hello world") == ["hello", "world"]
    out = m(["test [MASK]", "two [MASK] and [MASK]"])
    assert len(out[0]["predictions"]) == 5 and "meaningless" in out[0]["note"]
    assert len(out[1]["predictions"]) == 2  # one candidate list per mask
    with pytest.raises(InputRejected, match=r"\[MASK\]"):
        m.check("no mask here")


def test_guide_curl_against_the_embedded_default() -> None:
    """curl -X POST -d "test sentence" http://127.0.0.1:PORT/ on the real default model."""
    with labserver.serve() as h:
        assert h.config.model == "minilm" and h.config.strategy == "thread"
        r = httpx.post(h.url + "/", content=b"test sentence", timeout=60)
        assert r.status_code == 200
        assert len(r.json()["embedding"]) == 384
        r = httpx.post(h.url + "/predict", json={"inputs": ["one", "two", "three"]}, timeout=60)
        assert [len(o["embedding"]) for o in r.json()["outputs"]] == [384] * 3


def test_on_fresh_thread_returns_raises_and_leaves_no_openmp_team_behind() -> None:
    """GNU OpenMP keeps worker threads for every thread that ran a parallel op until that thread ends;
    a second team slows the model thread's (labserver.models.on_fresh_thread). Seen in a clean process:
    torch work done through on_fresh_thread leaves no thread behind, the same work on the main thread does."""
    import subprocess
    import sys

    from labserver.models import on_fresh_thread

    assert on_fresh_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError):
        on_fresh_thread(lambda: {}["missing"])
    script = (  # (a team's workers leave a moment after their thread: the count is polled, 5 s at most)
        "import os, time, torch\n"
        "from labserver.models import on_fresh_thread\n"
        "def n(): return len(os.listdir('/proc/self/task'))\n"
        "def work(): return (torch.randn(1500, 1500) @ torch.randn(1500, 1500)).sum().item()\n"
        "torch.set_num_threads(2); before = n(); on_fresh_thread(work); end = time.monotonic() + 5\n"
        "while n() > before and time.monotonic() < end: time.sleep(0.01)\n"
        "fresh = n(); work(); main = n()\n"
        "print(before, fresh, main)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, fresh, main = map(int, out.stdout.split())
    assert fresh == before  # the fresh thread's team ended with it
    assert main > before  # (the control: a team on a thread that lives on is visible)


@pytest.mark.parametrize("user_env", [False, True])
def test_keep_freed_memory_stops_the_page_faults_of_varying_tensors(user_env: bool) -> None:
    """Tensors of changing sizes (a step's activations and gathers as contexts grow), made and freed on a
    thread: with glibc's default thresholds each is a fresh mmap whose pages fault in; after
    keep_freed_memory the arena reuses them. A user's own MALLOC_*_ setting is left alone."""
    import os
    import subprocess
    import sys

    script = (
        "import resource, sys, torch\n"
        "from labserver.models import keep_freed_memory, on_fresh_thread\n"
        "torch.set_num_threads(1)\n"
        "def churn():\n"
        "    r0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt\n"
        "    for i in range(300):\n"
        "        x = torch.ones((1 << 18) + (i % 50) * (1 << 14)); y = x * 2; del x, y\n"
        "    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0\n"
        "default = on_fresh_thread(churn); kept = keep_freed_memory(); after = on_fresh_thread(churn)\n"
        "print(default, kept, after)\n")
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(128 << 10)) if user_env else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True, env=env)
    default, kept, after = out.stdout.split()
    if user_env:
        assert kept == "False" and int(after) > int(default) / 3  # untouched: still faulting
    else:
        assert kept == "True"
        assert int(after) < int(default) / 5, (default, after)


def test_a_thread_can_give_back_its_openmp_workers() -> None:
    """labserver.serve frees the caller's OpenMP team (a second team on the cores slows the model thread's)."""
    import sys

    import torch

    from labserver.models import release_openmp_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (a team of one thread has no workers: make test's workers compute on one)
    try:
        torch.randn(256, 256) @ torch.randn(256, 256)  # this thread's team, made
        if sys.platform.startswith("linux"):
            assert release_openmp_threads() is True
        (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # and torch works on after it (a new team)
    finally:
        torch.set_num_threads(threads)
