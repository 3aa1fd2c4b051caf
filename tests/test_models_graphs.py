"""Decode steps padded to buckets (``labserver.models.graphs``), run eagerly on the CPU: what a CUDA graph replays.

A GPU captures these same padded steps; here they run uncaptured (``capture=False``), so
the padding itself is what is tested: every step's scores still match transformers', the
padding rows touch only the scratch slot, and only calls of single sampled tokens take the
padded path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

import labserver
from labserver import wire
from labserver.models import ModelLoadError, kvcache, load_model
from labserver.models.base import Chunk
from labserver.models.paged import Costs
from labserver.models.gpt2 import gpt2_random
from labserver.models.graphs import CompiledDecode, compile_blocker, compiled_cache, use_cuda_graphs
from labserver.models.kvcache import PagedKV, in_place
from labserver.strategies import Limits

from .test_models_gpt2 import Tracker, prompt


def _company(gen: object, tracker: Tracker) -> None:
    """Three sequences of unlike lengths (a bucket of 4: one padding row), a fourth joining in pieces, one leaving."""
    for sid, ids in ((10, prompt(gen, 20, 40)), (11, prompt(gen, 7, 500)), (12, prompt(gen, 2, 70))):
        tracker.add(sid, ids)
    tracker.run([(10, None), (11, None), (12, None)])
    for step in range(60):  # sequence 10 passes 64 positions: its bucket of keys grows from 64 to 128
        if step == 3:  # a prompt's piece rides along: that call runs eagerly
            tracker.add(13, prompt(gen, 30, 90))
            tracker.run([(13, 10), (11, None), (10, None), (12, None)])
            continue
        if step == 5:
            tracker.release(12)
        tracker.decode(sorted(tracker.ids))


def test_padded_gpt2_steps_match_transformers_as_sequences_join_and_leave() -> None:
    gen = gpt2_random(tiny=True, device="cpu")
    graphs = use_cuda_graphs(gen, 8, capture=False)
    tracker = Tracker(gen, blocks=96)  # (checks every sampled row against transformers over its whole context)
    _company(gen, tracker)
    assert graphs.replays >= 55  # every call of decodes alone went through a bucket
    assert {(4, 64), (4, 128)} <= set(graphs.steps)  # 3 sequences: a bucket of 4, one padding row
    assert gen.kv.scratch == 96 * 4  # the spare block: past every block a table may name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_llama_steps_equal_the_eager_steps(folders: dict[str, Path], family: str) -> None:
    """Grouped-query attention (and Qwen3's QK-norm) through the bucket: the same greedy tokens as the eager path."""
    eager = load_model(str(folders[family]), device="cpu", kind="generate")
    padded = load_model(str(folders[family]), device="cpu", kind="generate")
    graphs = use_cuda_graphs(padded, 4, capture=False)
    answers = []
    for gen in (eager, padded):
        gen.allocate_kv(32, 16)
        prompts = {1: list(range(5, 40)), 2: list(range(50, 53)), 3: list(range(100, 150))}  # (50: past 64 keys mid-way)
        tables = {sid: tuple(range(8 * (sid - 1), 8 * sid)) for sid in prompts}
        outs = gen.forward([Chunk(sid, ids, 0, tables[sid]) for sid, ids in prompts.items()])
        tokens = {sid: [int(t)] for sid, t in zip(prompts, outs, strict=True)}
        for _ in range(24):
            chunks = [Chunk(sid, [tokens[sid][-1]], len(prompts[sid]) + len(tokens[sid]) - 1, tables[sid],
                            decode=True) for sid in prompts]
            for c, t in zip(chunks, gen.forward(chunks), strict=True):
                tokens[c.sid].append(int(t))
        answers.append(tokens)
    assert answers[0] == answers[1]
    assert graphs.replays == 24 and {(4, 64), (4, 128)} <= set(graphs.steps)


def test_a_call_over_the_largest_bucket_or_with_scores_runs_eagerly() -> None:
    gen = gpt2_random(tiny=True, device="cpu")
    graphs = use_cuda_graphs(gen, 2, capture=False)
    gen.allocate_kv(16, 16)
    table = {sid: (sid,) for sid in range(3)}
    gen.forward([Chunk(sid, [5, 6, 7], 0, table[sid]) for sid in range(3)])
    assert not graphs.fits([Chunk(sid, [8], 3, table[sid], decode=True) for sid in range(3)])  # 3 > 2
    assert not graphs.fits([Chunk(0, [8], 3, table[0], decode=True, score=[8])])
    assert graphs.fits([Chunk(0, [8], 3, table[0], decode=True)])


def test_graphs_are_refused_where_there_is_nothing_to_capture() -> None:
    with pytest.raises(ModelLoadError, match="needs a CUDA device; gpt2-tiny-random is on cpu"):
        use_cuda_graphs(gpt2_random(tiny=True, device="cpu"), 8)
    with pytest.raises(ModelLoadError, match="own forward pass"):
        use_cuda_graphs(load_model("synthetic-gen:1+1", kind="generate"), 8)
    with pytest.raises(ModelLoadError, match="needs a CUDA device"):  # served: the load fails, saying why
        labserver.serve("gen-continuous", "gpt2-tiny-random", device="cpu", cuda_graphs=True)


def test_the_flag_reaches_the_limits() -> None:
    from labserver.cli import build_parser
    from labserver.cli.args import limits_from

    parse = build_parser().parse_args
    assert limits_from(parse(["serve", "--strategy", "gen-continuous", "--cuda-graphs"])).cuda_graphs
    assert not limits_from(parse(["serve", "--strategy", "gen-continuous"])).cuda_graphs
    compiles = [limits_from(parse(["serve", "--strategy", "gen-continuous", *flag])).compile
                for flag in ([], ["--compile"], ["--compile", "on"], ["--compile", "off"], ["--compile", "auto"])]
    assert compiles == ["auto", True, True, False, "auto"]  # the server compiles where it can unless told
    assert Limits().compile is False  # (the Python API: eager unless asked, a lesson's server starting in seconds)
    with pytest.raises(ValueError, match="compile must be"):
        Limits(compile="yes")


def test_auto_compiles_only_where_it_can(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--compile auto`` (the server's default) on what cannot compile: eager, saying why, and serving; asked for
    (``compile=True``), the load fails instead. A compile that fails under auto leaves the eager steps as they were
    (the same tokens); asked for, it fails the load with the compiler's error. Where torch keeps the code."""
    import httpx

    def decode(h: labserver.ServerHandle) -> str:
        return str(httpx.get(h.url + "/stats", timeout=10).json()["decode"])

    body = {"prompt": "the cat sat on the mat", "max_new_tokens": 8, "ignore_eos": True}
    with labserver.serve("gen-continuous", "synthetic-gen:0+0", compile="auto") as h:
        assert decode(h) == "eager: 'synthetic-gen:0+0' has no forward pass of labserver's own to compile"
        assert httpx.get(h.url + "/stats", timeout=10).json()["compiled_calls"] is None
        assert httpx.post(h.url + "/generate", json=body, timeout=30).status_code == 200
    with pytest.raises(ModelLoadError, match="has none"):
        labserver.serve("gen-continuous", "synthetic-gen:0+0", compile=True)

    tiny = load_model("gpt2-tiny-random", device="cpu", kind="generate")
    assert compile_blocker(tiny) is None  # (this machine has g++)
    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", lambda: "no-such-c++")
    assert compile_blocker(tiny) == "no C++ compiler (no-such-c++) for torch.compile's generated code"
    monkeypatch.undo()

    with labserver.serve("gen-continuous", tiny, device="cpu") as h:
        want = httpx.post(h.url + "/generate", json=body, timeout=30).json()["tokens"]

    def broken(self: CompiledDecode, batch: bool = True) -> float:
        raise RuntimeError("C++ compile error: no such header")

    monkeypatch.setattr(CompiledDecode, "warm", broken)
    tiny = load_model("gpt2-tiny-random", device="cpu", kind="generate")
    with labserver.serve("gen-continuous", tiny, device="cpu", compile="auto") as h:
        assert decode(h) == "eager: the compile failed (RuntimeError)"
        assert tiny.graphs is None and not tiny.kv.dynamic  # (undone: the eager steps as before)
        assert httpx.post(h.url + "/generate", json=body, timeout=30).json()["tokens"] == want
    with pytest.raises(ModelLoadError, match="--compile failed: RuntimeError: C\\+\\+ compile error"):
        labserver.serve("gen-continuous", load_model("gpt2-tiny-random", device="cpu", kind="generate"),
                        device="cpu", compile=True)

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("LABSERVER_CACHE", str(tmp_path))
    assert compiled_cache() == str(tmp_path / "inductor")  # labserver's cache, not the temporary folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # (torch's default, written by torch)
    assert compiled_cache() == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's: kept
    assert compiled_cache() == str(tmp_path / "mine")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_in_place_equals_the_copy_and_sdpa(dtype: torch.dtype) -> None:
    """``kvcache.in_place`` (a compiled batch's attention: the slots read where they lie) beside the eager path's
    copy and SDPA, called eagerly: sequences of unlike lengths padded and masked, three query heads to a KV head, a
    float16 pool attended in float32; a wrong mask, scale or grouping of heads is off by far more than the sums'
    order."""
    torch.manual_seed(0)
    kv = PagedKV(layers=1, heads=3, head_dim=64, device=torch.device("cpu"), dtype=dtype)
    kv.allocate(64, 16)
    kv.k[0].copy_(torch.randn_like(kv.k[0], dtype=torch.float32))
    kv.v[0].copy_(torch.randn_like(kv.v[0], dtype=torch.float32))
    lengths, longest = [40, 33, 17, 40, 38], 40
    slots = torch.randperm(64 * 16)[:len(lengths) * longest].view(len(lengths), longest)
    mine = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    slots = torch.where(mine, slots, slots[:, :1])  # (padding: each one's first slot, masked out)
    q = torch.randn(len(lengths), 9, 64).to(dtype)
    with torch.inference_mode():
        want = kv._decode(kv.k[0], kv.v[0], q, slots.flatten(), longest, mine[:, None, None, :], gqa=True)
        got = in_place(kv.k[0], kv.v[0], q.float(), slots, mine, kv_heads=3).to(dtype)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-6 if dtype == torch.float32 else 1e-3, rtol=1e-5)
    assert not torch.allclose(in_place(kv.k[0], kv.v[0], q.float(), slots, torch.ones_like(mine), 3).to(dtype),
                              want, atol=1e-2)  # (the mask matters here: a test that could fail)


def test_compiled_steps_of_one_sequence_and_of_several_equal_the_eager_steps(folders: dict[str, Path],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile of the decode steps (``--compile``), served: one sequence's step and a batch's, each compiled
    once while the model loads (the batch's attention in place: ``kvcache.in_place``); the same greedy tokens as the
    eager path, for one request and for two prompts of different lengths decoding side by side (their positions
    padded and masked); the pool's new size costs no second compile."""
    import httpx

    attended = torch.zeros((), dtype=torch.long)  # layers attended in place: a tensor the compiled step adds to (a
    #   Python list appended to would be guarded on, and the next step would need another compile)
    monkeypatch.setattr(kvcache, "in_place", lambda *a, **k: (attended.add_(1), in_place(*a, **k))[1])

    body = {"prompt": "the cat sat on the mat", "max_new_tokens": 40, "ignore_eos": True}
    two = {"prompt": ["the cat sat on the mat", "a dog"], "max_tokens": 24, "temperature": 0,
           "ignore_eos": True, "return_token_ids": True}

    def both(url: str) -> list[list[int]]:
        choices = httpx.post(url + wire.V1_COMPLETIONS_PATH, json=two, timeout=60).json()["choices"]
        return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]

    eager = load_model(str(folders["llama"]), device="cpu", kind="generate")
    with labserver.serve("gen-continuous", eager, device="cpu") as h:
        want = httpx.post(h.url + "/generate", json=body, timeout=60).json()["tokens"]
        want_two = both(h.url)
    compiled = load_model(str(folders["llama"]), device="cpu", kind="generate")
    with labserver.serve("gen-continuous", compiled, device="cpu", compile="auto") as h:  # (compiled while loading,
        #   as the server's default does where it can)
        assert httpx.get(h.url + "/stats", timeout=10).json()["decode"] == "compiled"
        steps = compiled.graphs
        assert steps.replays == 0  # (both compiled over the scratch slot, before any request)
        layers = compiled.hf_model.config.num_hidden_layers
        assert attended.item() == layers  # (the batch's step compiled through in_place, warmed once)
        assert httpx.post(h.url + "/generate", json=body, timeout=60).json()["tokens"] == want
        assert steps.replays == 39 and steps.batched == 0  # every decode step of one sequence went through the
        #   compiled code
        st = httpx.get(h.url + "/stats", timeout=10).json()
        assert st["compiled_calls"] == 39 == st["decode_calls"]  # (/stats counts them)
        assert both(h.url) == want_two
        assert steps.batched == 23  # (the two decoded side by side, every step through the batch's compiled step:
        #   their lengths padded to the longer are within SLACK of their own)
        assert attended.item() == layers * 24  # ... each attending in place, none of them failed and bisected
        assert steps.fits([Chunk(1, [5], 9, (0,)), Chunk(2, [5], 3, (1,))])  # padded 20 keys for 14: within SLACK
        assert steps.fits([Chunk(1, [5], 300, (0,)), Chunk(2, [5], 3, (1,))])  # 602 for 305: 297 more, within 2 x 160
        assert not steps.fits([Chunk(1, [5], 400, (0,)), Chunk(2, [5], 3, (1,))])  # 802 for 405: eager
        assert steps.fits([Chunk(k, [5], 1000 + k, (k,)) for k in range(8)])  # 8 x 1008 for 8,036: within PADDING
        assert not steps.fits([Chunk(1, [5], 0, (0,)), Chunk(2, [5], 0, (1,))])  # one position each: eager
        assert not steps.fits([Chunk(1, [5, 6], 9, (0,))])  # a prompt piece: eager
        assert steps.checked == {"one", "batch"}  # (the guards ran once for each; the later steps skipped them)
        compiled.costs = Costs()  # a benchmark's split of each call's time (servedperf): the compiled steps as before,
        steps.checked.clear()  # their guards checked again (as after a pool made again)
        assert httpx.post(h.url + "/generate", json=body, timeout=60).json()["tokens"] == want
        assert compiled.costs.calls > 0
        compiled.costs = None
    qkv = compiled.projections()[0]  # the projections the compiled step read: the modules' own weights, [out, in]
    attn = compiled.hf_model.model.layers[0].self_attn
    assert all(p.rows_weight is not None for p in compiled.projections())
    assert attn.q_proj.weight.data_ptr() == qkv.rows_weight.data_ptr()  # (a view: nothing held twice)
    assert attn.k_proj.weight.data_ptr() == qkv.rows_weight[qkv.outs[0]:].data_ptr()
    compiled.allocate_kv(8, 16)
    assert not steps.checked  # a pool made again: the next step of each kind checks every guard
    with pytest.raises(ModelLoadError, match="choose one"):
        labserver.serve("gen-continuous", "gpt2-tiny-random", device="cpu", compile=True, cuda_graphs=True)
