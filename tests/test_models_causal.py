"""Your own model: GPT-2, Llama and Qwen2 folders through labserver's forward passes and paged engine.

Each family's tiny random folder (``labserver.models.folders.write_tiny``: real tokenizers,
8 query heads and 2 KV heads for Llama and Qwen2) is checked against transformers on the
same folder: logits on prefill and decode as sequences join, leave, come in pieces and
share prefixes; greedy tokens served over HTTP against ``generate``; and the engine's
memory mechanisms (preemption, prefix cache, chunked prefill) change no token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import labserver
from labserver import wire
from labserver.engine import StepEngine, make_engine
from labserver.models import Chunk, InputRejected, ModelLoadError, kind_of, load_model, minilm_dir
from labserver.models.folders import FAMILIES, kv_bytes_per_token
from labserver.models.paged import PagedLM, TransformersOnly
from labserver.strategies import Limits, make_strategy
from labserver.engine.ending import FinishReason

from .test_engine_paged import prompts, serve
from .test_models_gpt2 import Tracker


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, PagedLM]:
    return {name: load_model(str(path), device="cpu") for name, path in folders.items()}  # type: ignore[misc]


def ids_of(model: PagedLM, text: str) -> list[int]:
    """The folder's tokenizer, called as transformers' users call it: the reference encoding."""
    return model.tokenizer(text)["input_ids"]  # type: ignore[no-any-return]


def hf_greedy(model: PagedLM, ids: list[int], n: int) -> list[int]:
    """transformers' generate on the same weights: greedy, EOS not stopping it (ignore_eos)."""
    with torch.inference_mode():
        out = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_loads_as_its_family(family: str, folders: dict[str, Path], models: dict[str, PagedLM]) -> None:
    model = models[family]
    assert kind_of(str(folders[family])) == "generate"
    assert model.family == family and model.paged
    config = model.hf_model.config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads)
    assert model.kv.heads == kv and (kv < heads) == (family != "gpt2")  # Llama and Qwen2 here share KV heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # (Qwen3 names its own)
    assert model.kv_bytes_per_token == config.num_hidden_layers * 2 * kv * dim * 4 == kv_bytes_per_token(config)
    assert model.note is not None  # random weights say so in every answer
    text = "Hello, world! naïve café 123"
    assert model.encode(text) == ids_of(model, text)  # as the folder's tokenizer encodes it by default
    adds_bos = family in ("llama", "mistral")  # (their SentencePiece-style tokenizers add <s>; the others nothing)
    assert (model.encode(text)[0] == model.tokenizer.bos_token_id) == adds_bos


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_as_sequences_join_leave_and_come_in_pieces(
        family: str, models: dict[str, PagedLM]) -> None:
    model = models[family]
    t = Tracker(model)  # checks every sampled row against transformers over the whole context, atol 1e-4
    t.add(1, ids_of(model, "the quick brown fox jumps over the lazy dog"))
    t.add(2, ids_of(model, "a"))
    t.run([(1, None), (2, None)])  # two prompts of two lengths, one call
    for _ in range(3):
        t.decode([1, 2])
    t.add(3, ids_of(model, "once upon a time there was a server that fed a model from a queue, " * 3))
    t.run([(3, 5)])  # a piece of a prompt alone: nothing samples
    t.run([(2, None), (3, 9)])  # a decode and the next 9 prompt tokens of another (chunked prefill)
    t.run([(3, None), (1, None)])  # the rest of the prompt beside a decode
    t.release(2)
    for _ in range(4):
        t.decode([3, 1])
    t.blocks.check()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_prefix_is_read_and_matches_transformers(family: str, models: dict[str, PagedLM]) -> None:
    model = models[family]
    t = Tracker(model, prefix_cache=True)
    shared = ids_of(model, "system: you are a helpful assistant who answers briefly and well. user:")
    t.add(1, shared + ids_of(model, "hi")[-1:])
    t.run([(1, None)])
    hit = t.add(2, shared + ids_of(model, "bye")[-1:])
    assert hit == len(shared) // 4 * 4 and hit > 0  # whole blocks of 4 read from 1's
    t.run([(2, None)])
    t.decode([1, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_group_all_as_long_is_attended_without_a_mask(family: str, models: dict[str, PagedLM]) -> None:
    """Sequences decoding at one length need no mask (each one's keys are all its own, no padding); one a position
    shorter in the group brings the mask back. Every row matches transformers either way."""
    model = models[family]
    t = Tracker(model)
    a = ids_of(model, "the quick brown fox jumps over the lazy dog")
    t.add(1, a)
    t.add(2, a[::-1])  # as long, other tokens
    t.add(3, a[:-1])  # a position shorter: padded to the others' length in their group
    t.run([(1, None), (2, None), (3, None)])
    level, ragged = model.kv.plan([t.chunk(1), t.chunk(2)]), model.kv.plan([t.chunk(1), t.chunk(2), t.chunk(3)])
    assert [len(g[0]) for g in level.decodes] == [2] and level.decodes[0][3] is None
    assert [len(g[0]) for g in ragged.decodes] == [3] and ragged.decodes[0][3] is not None
    t.decode([1, 2])
    t.decode([1, 2, 3])
    t.decode([2, 1])


def served(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_served_equal_transformers_generate(family: str, folders: dict[str, Path],
                                                          models: dict[str, PagedLM]) -> None:
    texts = ["hello there", "the cat sat on the mat and looked at the door", "what is a queue?"]
    n = 12
    model = models[family]
    want = [hf_greedy(model, ids_of(model, t), n) for t in texts]
    with labserver.serve("gen-continuous", str(folders[family]), max_batch_size=4, device="cpu") as h:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # batched together on the server
            native = list(pool.map(lambda t: served(h.url, wire.GENERATE_PATH,
                                                    {"prompt": t, "max_new_tokens": n, "ignore_eos": True}), texts))
        assert [a["tokens"] for a in native] == want
        openai = served(h.url, "/v1/completions", {"model": str(folders[family]), "prompt": texts,
                                                   "max_tokens": n, "temperature": 0, "ignore_eos": True})
        choices = sorted(openai["choices"], key=lambda c: c["index"])
        tokenizer = model.tokenizer
        assert [c["text"] for c in choices] == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
        assert [c["finish_reason"] for c in choices] == ["length"] * len(texts)
        assert openai["usage"]["prompt_tokens"] == sum(len(ids_of(model, t)) for t in texts)
        stats = httpx.get(h.url + "/stats").json()
        assert stats["kv_bytes_per_token"] == model.kv_bytes_per_token
        assert stats["kv_memory_bytes"] == stats["kv_tokens_total"] * model.kv_bytes_per_token > 0


def test_gen_hf_cb_serves_a_folder_through_transformers_manager(folders: dict[str, Path],
                                                               models: dict[str, PagedLM]) -> None:
    model = models["llama"]
    want = hf_greedy(model, ids_of(model, "hello there"), 8)
    with labserver.serve("gen-hf-cb", str(folders["llama"]), device="cpu", kv_memory_mb=1) as h:
        answer = served(h.url, wire.GENERATE_PATH, {"prompt": "hello there", "max_new_tokens": 8, "ignore_eos": True})
    assert answer["tokens"] == want


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_chat_goes_through_the_folders_template_with_one_bos(family: str, folders: dict[str, Path],
                                                            models: dict[str, PagedLM]) -> None:
    model = models[family]
    messages = [{"role": "user", "content": "hello, who are you?"}]
    want = model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    with labserver.serve("gen-continuous", str(folders[family]), device="cpu") as h:
        answer = served(h.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                        "ignore_eos": True})
    assert answer["usage"]["prompt_tokens"] == len(want)
    assert model.encode(model.tokenizer.apply_chat_template(messages, tokenize=False,
                                                            add_generation_prompt=True)) == list(want)
    bos = model.tokenizer.bos_token_id
    if family in ("llama", "mistral"):  # the template writes <s>; the encoding adds no second one
        assert model.encode("hi")[0] == bos and list(want)[:2].count(bos) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_prefix_cache_and_chunking_change_no_token(family: str, models: dict[str, PagedLM]) -> None:
    model = models[family]
    texts, new = prompts(8, shared=20), [40 + 10 * (k % 4) for k in range(8)]
    plain, _, _ = serve(model, texts, new, max_batch_size=8)
    longest = max(len(model.encode(t)) + n for t, n in zip(texts, new, strict=True))
    tight, stats, _ = serve(model, texts, new, "gen-paged", max_batch_size=8, kv_block_tokens=8,
                            max_kv_tokens=-(-2 * longest // 8) * 8)  # room for two of the longest: others wait
    assert stats["preemptions"] >= 2
    cached, on, _ = serve(model, texts, new, max_batch_size=2, prefix_cache=True)
    assert on["cached_tokens"] > 0
    chunked, _, steps = serve(model, texts, new, max_batch_size=8, prefill="chunked", max_step_tokens=24)
    assert max(st["tokens"] for st in steps) <= 24
    for other in (tight, cached, chunked):
        assert [s.tokens for s in other] == [s.tokens for s in plain]
    assert model.cached == 0


def test_the_folders_eos_ends_answers_and_ignore_eos_only_keeps_going(models: dict[str, PagedLM]) -> None:
    model = models["llama"]
    ids = ids_of(model, "the end is near")
    greedy = hf_greedy(model, ids, 6)
    saved = model.eos_id, model.eos_ids
    model.eos_id, model.eos_ids = saved[0], (*saved[1], greedy[2])  # a second EOS, as Llama 3 lists several

    async def main() -> tuple[Any, Any]:
        engine = StepEngine(make_strategy("gen-continuous", Limits()), model)
        engine.start()
        try:
            stops = engine.submit(ids, 6)
            goes_on = engine.submit(ids, 6, ignore_eos=True)
            await asyncio.gather(stops.future, goes_on.future)
            return stops, goes_on
        finally:
            await engine.stop()

    try:
        stops, goes_on = asyncio.run(main())
    finally:
        model.eos_id, model.eos_ids = saved
    assert stops.tokens == greedy[:3] and stops.finish_reason is FinishReason.EOS  # the EOS token is emitted, then it ends
    assert goes_on.tokens == greedy and goes_on.finish_reason is FinishReason.LENGTH  # vLLM's ignore_eos: EOS may appear


def test_gqa_holds_four_times_the_sequences_in_the_same_kv_bytes(models: dict[str, PagedLM]) -> None:
    gqa, mha = models["llama"], models["llama-mha"]
    assert mha.kv_bytes_per_token == 4 * gqa.kv_bytes_per_token
    held = {}
    for name, model in (("gqa", gqa), ("mha", mha)):
        engine = make_engine(make_strategy("gen-paged", Limits(kv_memory_mb=0.25, max_batch_size=None)), model)
        held[name] = engine.blocks.total * engine.blocks.block_tokens
        assert held[name] == 2**18 // model.kv_bytes_per_token // 16 * 16
    assert held["gqa"] == 4 * held["mha"]


def test_other_architectures_are_refused_by_name_before_loading(folders: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    folder = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=1100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folders["gpt2"] / name).exists():
            (folder / name).write_bytes((folders["gpt2"] / name).read_bytes())
    assert kind_of(str(folder)) == "generate"
    with pytest.raises(ModelLoadError, match=r"GPTNeoXForCausalLM.*gpt2.*llama.*qwen2.*gen-hf-cb"):
        load_model(str(folder), device="cpu", kind="generate")
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        labserver.serve("gen-paged", str(folder), device="cpu")  # the server does not start
    only = load_model(str(folder), device="cpu", kind="generate", paged=False)  # what gen-hf-cb gets
    assert isinstance(only, TransformersOnly) and only.encode("hello")
    assert only.kv_bytes_per_token == 1 * 2 * 2 * 16 * 4  # from its config: what transformers' cache would hold
    with pytest.raises(ModelLoadError, match="gen-hf-cb"):
        make_engine(make_strategy("gen-continuous", Limits()), only)
    with pytest.raises(ModelLoadError, match="transformers' continuous batching manager cannot run"):
        labserver.serve("gen-hf-cb", str(folder), device="cpu")  # it loads, but the manager fails its probe
    with pytest.raises(ModelLoadError, match="not a generative model"):
        load_model(str(minilm_dir()), kind="generate")  # an encoder folder


def test_a_sliding_window_is_served_as_a_context_it_cannot_hide_anything_in(tmp_path: Path) -> None:
    from labserver.models.folders import write_tiny

    model = load_model(str(write_tiny("mistral", tmp_path / "windowed", sliding_window=24)), device="cpu")
    assert model.max_context == 24 and model.hf_model.config.sliding_window == 24
    t = Tracker(model)  # transformers applies its window; up to 24 positions it hides nothing
    t.add(1, ids_of(model, "one two three four five six seven eight nine ten")[:12])
    t.run([(1, None)])
    for _ in range(10):
        t.decode([1])  # positions up to 22: logits equal transformers' (the Tracker checks each)
    with pytest.raises(InputRejected, match="24"):
        model.encode("word " * 40)  # longer than the window: refused, never silently wrong


def test_a_hub_id_serves_only_from_the_local_cache(tmp_path: Path) -> None:
    script = """
import os
from pathlib import Path
from labserver.models import ModelLoadError, kind_of, load_model
from labserver.models.folders import write_tiny
repo = Path(os.environ["HF_HUB_CACHE"]) / "models--someone--tiny-qwen"
write_tiny("qwen2", repo / "snapshots" / "abc123")
(repo / "refs").mkdir()
(repo / "refs" / "main").write_text("abc123")
assert kind_of("someone/tiny-qwen") == "generate" and kind_of("someone/not-cached") == "encode"
model = load_model("someone/tiny-qwen", device="cpu", kind="generate")
assert model.family == "qwen2" and model.encode("hi"), model
try:
    load_model("someone/not-cached", kind="generate")
except ModelLoadError as e:
    assert "nothing downloads" in str(e) and "tiny-model" in str(e), e
else:
    raise AssertionError("an uncached hub id loaded")
print("ok")
"""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_half_precision_follows_transformers_in_the_same_dtype(family: str, dtype: str,
                                                               folders: dict[str, Path]) -> None:
    """float16 and bfloat16 weights stay [out, in] (their CPU kernels read the transpose slowly; bfloat16 goes to
    oneDNN instead where the CPU multiplies it natively) and the pool is attended in float32: every score of a
    prompt and 6 decode steps stays within the dtype's rounding of transformers' own forward pass in that dtype."""
    from labserver.models.linear import native_bf16

    model = load_model(str(folders[family]), device="cpu", dtype=dtype)
    half = getattr(torch, dtype)
    width = model.hf_model.config.hidden_size
    if dtype == "bfloat16" and native_bf16():  # oneDNN's own copy; the modules keep transformers' weights
        assert model._head_proj.onednn and model._head_proj.weight.is_mkldnn
        w = model.hf_model.get_output_embeddings().weight
    elif family == "gpt2":  # Conv1D's [in, out] weight, a view of [out, in] memory
        w = model.hf_model.transformer.h[0].mlp.c_fc.weight.t()
        assert w.shape == (4 * width, width)
    else:  # q, k and v side by side, [out, in]
        w = model._packed[0].qkv.weight
        assert w.shape == (sum(model._packed[0].qkv.outs), width)
    assert w.dtype == half and w.is_contiguous()
    assert model.kv.compute == torch.float32
    ids = ids_of(model, "the quick brown fox jumps over the lazy dog and then")
    seq, table = list(ids), tuple(range(4))
    model.allocate_kv(len(table), 16)
    scores = model.logits([Chunk(1, ids, 0, table)])[0]
    tolerance = {"float16": 2e-2, "bfloat16": 1.5e-1}[dtype]
    for _ in range(7):
        with torch.inference_mode():
            want = model.hf_model(torch.tensor([seq])).logits[0, -1]
        assert scores.dtype == half
        assert float((scores.float() - want.float()).abs().max()) <= tolerance * float(want.float().abs().max())
        seq.append(int(want.argmax()))
        scores = model.logits([Chunk(1, [seq[-1]], len(seq) - 1, table, decode=True)])[0]
    model.release([1])
