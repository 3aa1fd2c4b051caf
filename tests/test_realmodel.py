"""The embedded real model, smollm2: installed without a compiler, converted once, served exactly.

Its answers are checked against transformers on the same converted folder, teacher-forced:
one forward pass over each prompt and the tokens the server chose gives transformers'
scores at every position, so each served greedy token must be transformers' argmax there.
Where they first differ, the two top scores must be within ``NEAR_TIE`` (in the spirit of
vLLM's ``check_logprobs_close``), and the rest of that answer is not compared (its context
differs from then on). ``benchmarks/foldercheck.py --model smollm2`` runs transformers'
own ``generate`` for the same check at full length.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import labserver
from labserver import wire
from labserver.models import load_model
from labserver.models.smollm2 import CONVERSION_RECORD, LAYOUT, folder, gguf_path, is_current
from labserver.server.openai.logprobs import UNLIKELY

from .test_engine_paged import serve

NEAR_TIE = 1e-3  # the two top logits at a first divergence may differ by at most this
LOGPROB_ATOL = 1e-4
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
             "Write a haiku about the sea.", "Who wrote Hamlet?", "How many legs does a spider have?",
             "What is the boiling point of water in Celsius?", "Give me a synonym for happy.",
             "What is photosynthesis?", "Translate 'good morning' into French.", "What is the largest planet?",
             "Why is the sky blue?", "List two programming languages.", "What is a prime number?",
             "Say hello in Spanish.", "What colour is a ripe banana?"]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="module")
def hf(model: Any) -> Any:
    """transformers' own model on the same weights (the served model's module, run by transformers' forward)."""
    return model.hf_model


@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[labserver.ServerHandle]:
    with labserver.serve("gen-continuous", model, max_batch_size=32) as h:
        yield h


def chat_text(model: Any, question: str) -> str:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)


@torch.inference_mode()
def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' scores [positions, vocab] for one sequence: row p scores the token at p + 1."""
    return hf(torch.tensor([ids])).logits[0].float()


def first_divergence(hf: Any, prompt: list[int], served: list[int]) -> tuple[int | None, float]:
    """Where the served greedy tokens first differ from transformers' argmax (None: nowhere), and the gap there
    between the two top scores."""
    logits = hf_logits(hf, prompt + served)[len(prompt) - 1:len(prompt) - 1 + len(served)]
    best = logits.argmax(-1).tolist()
    for i, (ours, theirs) in enumerate(zip(served, best, strict=True)):
        if ours != theirs:
            return i, float(logits[i, theirs] - logits[i, ours])
    return None, 0.0


# -- installed as the issue of a compiler-free install asks -------------------------------------------

def test_installed_without_llama_cpp_and_converted_once_with_a_record() -> None:
    assert importlib.util.find_spec("llama_cpp") is None  # the wheel's dependencies were never installed
    source = gguf_path()
    target = folder()
    record = json.loads((target / CONVERSION_RECORD).read_text())
    assert record["source_bytes"] == source.stat().st_size and len(record["source_sha256"]) == 64
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(record["files"])
    weights = (target / "model.safetensors").stat().st_mtime_ns
    assert folder() == target and (target / "model.safetensors").stat().st_mtime_ns == weights  # reused, not redone
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


def test_the_converted_folder_is_an_ordinary_one_other_servers_load() -> None:
    """As save_pretrained writes it (vLLM loads it unchanged): the tied tensor under the embedding's name, once, and
    a config naming the architecture and dtype."""
    from safetensors import safe_open

    target = folder()
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names and len(names) == 272
    record = json.loads((target / CONVERSION_RECORD).read_text())
    assert record["layout"] == LAYOUT and not is_current(target, {**record, "layout": LAYOUT - 1})  # older: redone


def test_a_stale_or_partial_conversion_is_not_trusted(tmp_path: Path) -> None:
    wanted = {"source": "x.gguf", "source_sha256": "a" * 64, "source_bytes": 3, "dtype": "float32",
              "transformers": "5.0", "gguf": "0.1"}
    target = tmp_path / "conv"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / CONVERSION_RECORD).write_text(json.dumps({**wanted, "files": ["config.json"]}))
    assert is_current(target, wanted)
    assert is_current(target, {**wanted, "source": "elsewhere/x.gguf"})  # moved, the same bytes
    assert not is_current(target, {**wanted, "source_sha256": "b" * 64})  # another file
    assert not is_current(target, {**wanted, "transformers": "5.1"})  # another converter
    (target / CONVERSION_RECORD).write_text(json.dumps({**wanted, "files": ["config.json", "model.safetensors"]}))
    assert not is_current(target, wanted)  # a file it lists is missing


def test_it_is_the_default_generator_and_listed_by_its_name(server: labserver.ServerHandle, model: Any) -> None:
    from labserver.config import default_model

    assert default_model("gen-paged") == "smollm2" and model.name == "smollm2" and model.note is None
    assert model.eos_ids == (2,) and model.tokenizer.decode([2]) == "<|im_end|>"
    listed = httpx.get(server.url + wire.V1_MODELS_PATH).json()["data"]
    assert [m["id"] for m in listed] == ["smollm2"] and listed[0]["max_model_len"] == 8192


# -- exact against transformers -----------------------------------------------------------------------

def test_greedy_answers_are_transformers_through_generate_and_chat(server: labserver.ServerHandle, model: Any,
                                                                    hf: Any) -> None:
    """16 chat prompts x 64 tokens through both doors, all 32 at once (batched): transformers' argmax at every
    position, or a near-tie where they first part."""
    def ask(q: str) -> tuple[list[int], str]:
        r = httpx.post(server.url + "/generate", timeout=300, json={"prompt": chat_text(model, q),
                                                                     "max_new_tokens": 64})
        assert r.status_code == 200, r.text
        return r.json()["tokens"], r.json()["finish_reason"]

    def chat(q: str) -> str:
        r = httpx.post(server.url + wire.V1_CHAT_PATH, timeout=300, json={
            "messages": [{"role": "user", "content": q}], "max_tokens": 64, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(32) as pool:  # every answer at once: batched in the same steps
        asked = [pool.submit(ask, q) for q in QUESTIONS]
        chatted = [pool.submit(chat, q) for q in QUESTIONS]
        generated, chats = [f.result() for f in asked], [f.result() for f in chatted]
    parted = []
    for q, (tokens, reason), text in zip(QUESTIONS, generated, chats, strict=True):
        prompt = model.encode(chat_text(model, q))
        at, gap = first_divergence(hf, prompt, tokens)
        if at is not None:
            assert gap <= NEAR_TIE, f"{q!r}: token {at} differs from transformers' by {gap:.2e} in score"
            parted.append(q)
        assert reason == ("eos" if tokens[-1] == 2 else "length")
        if at is None:  # the same tokens: the chat door gives their text
            assert text == model.text(tokens)
    assert len(parted) <= 2, parted  # near-ties are rare; more would be a bug hiding under the allowance
    answer = dict(zip(QUESTIONS, chats, strict=True))["What is the capital of France?"]
    assert "Paris" in answer  # a real model answers


def greedy_ids(server: labserver.ServerHandle, prompt: str, n: int) -> list[int]:
    r = httpx.post(server.url + "/generate", timeout=120, json={"prompt": prompt, "max_new_tokens": n,
                                                                 "ignore_eos": True})
    return r.json()["tokens"]  # type: ignore[no-any-return]


def test_logprobs_top_logprobs_and_echo_are_transformers_log_softmax(server: labserver.ServerHandle, model: Any,
                                                                     hf: Any) -> None:
    prompt, n = "The capital of France is", 6
    r = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, timeout=120, json={
        "prompt": prompt, "max_tokens": n, "logprobs": 5, "echo": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = model.encode(prompt)
    p = len(ids)
    context = ids + greedy_ids(server, prompt, n)  # the same greedy answer, as token ids
    assert lp["tokens"] == [model.token_text(t) for t in context] and choice["text"].startswith(prompt)
    assert lp["token_logprobs"][0] == UNLIKELY == lp["top_logprobs"][0][lp["tokens"][0]]  # nothing predicts it
    scores = torch.log_softmax(hf_logits(hf, context), -1)
    for i in range(1, p + n):
        assert math.isclose(lp["token_logprobs"][i], float(scores[i - 1, context[i]]), abs_tol=LOGPROB_ATOL), i
        top = scores[i - 1].topk(5)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert math.isclose(lp["top_logprobs"][i][model.token_text(t)], v, abs_tol=LOGPROB_ATOL), (i, t)
    assert lp["text_offset"][p] == len(prompt)  # the answer's first token starts where the prompt ends

    question = chat_text(model, "Name a colour.")
    r = httpx.post(server.url + wire.V1_CHAT_PATH, timeout=120, json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "logprobs": True,
        "top_logprobs": 20, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    chat_ids = model.encode(question)
    answer = greedy_ids(server, question, 5)
    scores = torch.log_softmax(hf_logits(hf, chat_ids + answer), -1)[len(chat_ids) - 1:]
    assert [e["token"] for e in content] == [model.token_text(t) for t in answer]
    for i, entry in enumerate(content):
        assert math.isclose(entry["logprob"], float(scores[i, answer[i]]), abs_tol=LOGPROB_ATOL)
        assert bytes(entry["bytes"]) == model.token_bytes(answer[i])
        top = scores[i].topk(20)
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
        assert [e["token"] for e in entry["top_logprobs"]] == [model.token_text(t) for t in top.indices.tolist()]


def test_n_choices_share_the_prompt_blocks_and_differ_when_sampled(server: labserver.ServerHandle,
                                                                   model: Any) -> None:
    long = "Summarise: " + "The river runs past the old mill and under the stone bridge. " * 6
    before = server.stats()
    r = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, timeout=120, json={
        "prompt": long, "max_tokens": 8, "n": 4, "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    p = len(model.encode(long))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == p  # the prompt counted once
    assert len({c["text"] for c in body["choices"]}) > 1  # seed, seed + 1, ...: different draws
    after = server.stats()
    shared = after["shared_tokens"] - before["shared_tokens"]
    assert shared == 3 * ((p - 1) // 16 * 16)  # three choices shared the first's whole prompt blocks
    again = httpx.post(server.url + wire.V1_COMPLETIONS_PATH, timeout=120, json={
        "prompt": long, "max_tokens": 8, "n": 4, "temperature": 1.0, "seed": 7}).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]  # seeded: reproducible


# -- speed tricks change no token -------------------------------------------------------------------

def test_preemption_prefix_cache_and_chunking_change_no_token(model: Any) -> None:
    texts = [chat_text(model, q) for q in QUESTIONS[:8]]  # one system line: a shared prefix
    new = [24] * len(texts)
    plain, _, _ = serve(model, texts, new, max_batch_size=8)
    tight, stats, _ = serve(model, texts, new, "gen-paged", max_batch_size=8, max_kv_tokens=160, kv_block_tokens=8)
    assert stats["preemptions"] >= 2
    cached, cstats, _ = serve(model, texts, new, "gen-paged", max_batch_size=4, prefix_cache=True, kv_block_tokens=8)
    assert cstats["cached_tokens"] > 0  # (four at a time: the later ones find the first ones' blocks)
    chunked, _, steps = serve(model, texts, new, max_batch_size=8, prefill="chunked", max_step_tokens=24)
    assert any(0 < len(s["decoding"]) < len(s["seqs"]) for s in steps)  # a step of decodes and prompt pieces
    want = [s.tokens for s in plain]
    for name, run in (("preempted", tight), ("prefix-cached", cached), ("chunked", chunked)):
        assert [s.tokens for s in run] == want, name
    assert model.cached == 0


def test_the_readme_chat_example_prints_what_the_readme_shows() -> None:
    """The README's chat example is run here; what it prints must be what the README says it prints."""
    import contextlib
    import io
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme[readme.index("<!-- readme-chat"):]
    code, shown = (re.search(rf"```{kind}\n(.*?)```", block, re.S)[1]  # type: ignore[index]
                   for kind in ("python", "text"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue() == shown


# -- its layouts: oneDNN's, the float weights side by side, the GGUF's own 4-bit blocks ----------------------------------

def test_float32_multiplies_through_onednn_beside_transformers_own_weights(model: Any, hf: Any) -> None:
    """float32 on a CPU: each group (q/k/v, gate/up) reordered once into oneDNN's layout; the modules keep their own
    weights, which transformers computes with, and both compute the same projection."""
    layer, packed = hf.model.layers[0], model._packed[0]
    assert packed.qkv.onednn and packed.qkv.shape == (576 + 192 + 192, 576) and packed.gate_up.shape == (2 * 1536, 576)
    assert packed.qkv.nbytes == (576 + 192 + 192) * 576 * 4  # what a step reads: the weight's own bytes
    assert model._head_proj.onednn and model._head_proj.shape == (49_152, 576)
    q, head = layer.self_attn.q_proj.weight, hf.get_output_embeddings().weight
    assert q.shape == (576, 576) and q.is_contiguous() and not q.is_mkldnn  # transformers' own, as loaded
    assert packed.qkv.weight.is_mkldnn  # oneDNN's own tensor beside it, not a view a module could share
    assert head.untyped_storage().data_ptr() == hf.get_input_embeddings().weight.untyped_storage().data_ptr()
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # (outputs up to ~40 and their sums in another order: 5e-5 apart at worst, where a
        #   wrong slice or layout is ~1 apart)
        assert torch.allclose(layer.self_attn.k_proj(x), packed.qkv(x)[:, 576:768], atol=2e-4)
        assert torch.allclose(layer.mlp.up_proj(x), packed.gate_up(x)[:, 1536:], atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_lays_the_weights_side_by_side(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 and bfloat16 (without oneDNN for it): one [sum of outs, in] tensor of which each module's weight
    (nn.Linear, or GPT-2's Conv1D stored [in, out]) becomes a view; one matmul computes what each module computes.
    (float16 also keeps a float32 copy for several rows: the next test.)"""
    from transformers.pytorch_utils import Conv1D

    from labserver.models import linear
    from labserver.models.linear import Dense

    torch.manual_seed(0)
    q, k = torch.nn.Linear(64, 64, bias=False).to(dtype), torch.nn.Linear(64, 32, bias=False).to(dtype)
    conv = Conv1D(48, 64).to(dtype)
    x = torch.randn(1, 64, dtype=dtype)  # (one row: float16's own kernel, not its float32 copy)
    with torch.inference_mode():
        expected = [q(x), k(x), conv(x)]
        with monkeypatch.context() as m:
            m.setattr(linear, "native_bf16", lambda: False)  # (a CPU without bfloat16 instructions: no oneDNN)
            both, alone = Dense(q, k), Dense(conv)
        assert not both.onednn and both.weight.shape == (96, 64) and both.weight.is_contiguous()
        assert q.weight.untyped_storage().data_ptr() == k.weight.untyped_storage().data_ptr() \
            == both.weight.untyped_storage().data_ptr()
        assert conv.weight.shape == (64, 48) and conv.weight.t().is_contiguous()  # still [in, out] to transformers
        assert torch.equal(both(x), torch.cat(expected[:2], 1)) and torch.equal(q(x), expected[0])
        assert torch.equal(alone(x), conv(x))  # Conv1D's own addmm, now on the [out, in] memory
        assert torch.allclose(conv(x), expected[2], atol=2e-2)  # (another kernel: the last bits of a half may move)


def test_a_compiled_float32_step_reads_the_modules_own_weights_row_by_row() -> None:
    """``Dense.compiled`` (``--compile``): a float32 projection keeps oneDNN's copy for the eager calls, and its
    modules' weights become views of one [sum of outs, in] tensor, which ``row_products`` multiplies (the form
    inductor turns into one loop over the rows); GPT-2's Conv1D stays [in, out] to transformers, and biases add."""
    from transformers.pytorch_utils import Conv1D

    from labserver.models.linear import Dense, row_products

    torch.manual_seed(0)
    q, k, conv = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32, bias=False), Conv1D(48, 64)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        expected = [q(x), k(x), conv(x)]
        both, alone = Dense(q, k), Dense(conv)
        if not both.onednn:  # (a torch without oneDNN: nothing to switch)
            both.compiled()
            assert both.rows_weight is None
            return
        both.compiled(), alone.compiled()
        assert both.rows_weight.shape == (96, 64) and both.rows_weight.is_contiguous()
        assert q.weight.data_ptr() == both.rows_weight.data_ptr()
        assert k.weight.data_ptr() == both.rows_weight[64:].data_ptr()
        assert conv.weight.shape == (64, 48) and conv.weight.data_ptr() == alone.rows_weight.data_ptr()
        assert torch.allclose(row_products(x, both.rows_weight, both.bias), torch.cat(expected[:2], 1), atol=1e-5)
        assert torch.allclose(row_products(x, alone.rows_weight, alone.bias), expected[2], atol=1e-5)
        assert torch.allclose(both(x), torch.cat(expected[:2], 1), atol=1e-5)  # (eager: still oneDNN's copy)
        assert torch.equal(q(x), expected[0])  # the module computes as before, from the view


def test_float16_multiplies_several_rows_through_a_float32_copy() -> None:
    """float16 on a CPU: one row through its own [out, in] weights (the memory's pace), two or more through a
    float32 copy in oneDNN's layout (float16's kernel multiplies row after row, ~30x slower at 32 rows); both
    within float16's rounding of the same product in float32."""
    from labserver.models.linear import WIDE_ROWS, Dense, widens

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(torch.float16)
    dense = Dense(lin)
    if not widens(lin.weight):
        assert dense.wide is None
        return
    w, b = dense.wide
    assert w.is_mkldnn and b is not None and b.dtype == torch.float32
    assert dense.weight.dtype == torch.float16 and dense.nbytes == (96 * 64 + 96) * 2  # a step of one reads these
    for rows in (1, WIDE_ROWS, 32):
        x = torch.randn(rows, 64, dtype=torch.float16)
        with torch.inference_mode():
            got, want = dense(x), torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        assert got.dtype == torch.float16 and torch.allclose(got.float(), want, rtol=2e-3, atol=2e-3)


def test_smollm2_q4_runs_the_gguf_blocks_and_says_it_may_differ(model: Any) -> None:
    import numpy as np

    from labserver.models.base import generate_alone
    from labserver.models.linear import Int4, dequantized, q4_1_blocks

    q4 = load_model("smollm2-q4", device="cpu")  # (every block checked against the float weights as it loads)
    assert q4.name == "smollm2-q4" and "may differ" in q4.note and model.note is None
    assert all(isinstance(getattr(p, part), Int4) for p in q4._packed for part in ("qkv", "o", "gate_up", "down"))
    # one Q4_1 block by hand: d = 0.5, m = -1, nibbles 0..15 then 15..0 -> weight j = 0.5 q_j - 1
    block = np.zeros((1, 20), dtype=np.uint8)
    block[0, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    block[0, 2:4] = np.frombuffer(np.float16(-1).tobytes(), dtype=np.uint8)
    block[0, 4:] = [j | (15 - j) << 4 for j in range(16)]
    q, d, m = q4_1_blocks(block)
    assert q.tolist() == [[*range(16), *range(15, -1, -1)]]
    assert dequantized(q, d, m).tolist() == [[0.5 * v - 1 for v in q[0]]]
    ids = model.encode(chat_text(model, "What is the capital of France?"))
    answer = q4.text(generate_alone(q4, ids, 8))
    assert "Paris" in answer, answer
