"""Tiny random-weight folders (labserver.models.folders): plain transformers loads them, offline, and
their tokenizers, special tokens and KV sizes are each family's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GPT2Config

from labserver.cli import main
from labserver.models.folders import FAMILIES, kv_bytes_per_token, make_tokenizer, parameter_count, write_tiny

pytestmark = pytest.mark.torch

TEXT = "Hello, world! naïve café 123"
ODD = "Ünïcödé ✓ 漢字 🙂 tabs\tand\nnewlines <unk> <|im_start|>"  # bytes the toy vocabularies never saw
CONFIGS = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "mistral": "MistralConfig"}


def load(folder: Path) -> tuple[Any, Any]:
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_each_family(folders: dict[str, Path], family: str) -> None:
    model, tok = load(folders[family])
    config = model.config
    assert type(config).__name__ == CONFIGS[family] and config.model_type == family
    assert config.num_attention_heads == 8 and config.hidden_size == 64 and config.num_hidden_layers == 2
    if family == "gpt2":  # GPT-2's own names, as the brief's reader of these folders expects them
        assert (config.n_positions, config.n_embd, config.n_layer, config.n_head) == (512, 64, 2, 8)
    else:
        assert config.num_key_value_heads == 2 and config.max_position_embeddings == 512
    assert config.vocab_size == len(tok) == 1024
    n = model.num_parameters()
    assert n == parameter_count(folders[family]) and n < 2_000_000
    with torch.inference_mode():
        logits = model(torch.tensor([tok.encode(TEXT)])).logits[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    assert logits.argmax(-1).unique().numel() > 1  # not one answer for every position


def test_family_structure(folders: dict[str, Path]) -> None:
    qwen, _ = load(folders["qwen2"])
    llama, _ = load(folders["llama"])
    gpt2, _ = load(folders["gpt2"])
    attn = qwen.model.layers[0].self_attn
    assert all(p.bias is not None and p.bias.abs().sum() > 0 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None and llama.model.layers[0].self_attn.q_proj.bias is None
    assert qwen.config.tie_word_embeddings and qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert not llama.config.tie_word_embeddings
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)
    # norms and biases were jittered off their ones and zeros: a forward pass that drops one cannot match
    assert not torch.allclose(llama.model.norm.weight, torch.ones(64))
    assert gpt2.transformer.h[0].attn.c_attn.bias.abs().sum() > 0
    assert llama.config.rms_norm_eps == 1e-6 and llama.config.rope_parameters["rope_theta"] == 10000


def test_same_seed_same_bytes(folders: dict[str, Path], tmp_path: Path) -> None:
    again = write_tiny("llama", tmp_path / "again").joinpath("model.safetensors").read_bytes()
    other = write_tiny("llama", tmp_path / "other", seed=1).joinpath("model.safetensors").read_bytes()
    assert again == (folders["llama"] / "model.safetensors").read_bytes()
    assert other != again and len(other) == len(again)


def test_tokenizer_training_is_deterministic() -> None:
    assert make_tokenizer("qwen2").backend_tokenizer.to_str() == make_tokenizer("qwen2").backend_tokenizer.to_str()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_reloads_as_written(folders: dict[str, Path], family: str) -> None:
    """transformers 5 rebuilds a model-specific tokenizer class's pipeline from vocab and merges: ours must match it."""
    built = make_tokenizer(family)
    _, loaded = load(folders[family])
    # (for model_type mistral transformers 5 loads its generic TokenizersBackend from tokenizer.json, as a whole)
    assert type(loaded).__name__ == ("TokenizersBackend" if family == "mistral" else type(built).__name__)
    for text in (TEXT, ODD, " leading space", "two  spaces\n\nand lines", "cafe\u0301"):  # (Qwen2's NFC)
        assert loaded.encode(text) == built.encode(text)


def test_byte_level_round_trips(folders: dict[str, Path]) -> None:
    for family in ("gpt2", "qwen2"):
        _, tok = load(folders[family])
        ids = tok.encode(TEXT)
        assert tok.bos_token_id not in ids  # neither adds a BOS
        assert tok.decode(ids) == TEXT
        assert tok.decode(tok.encode(ODD)) == ODD


def test_llama_adds_bos_and_round_trips(folders: dict[str, Path]) -> None:
    _, tok = load(folders["llama"])
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]) == [0, 1, 2, 3, 258]
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 1 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    emoji = tok.encode("🙂", add_special_tokens=False)  # not in the vocabulary: its four bytes
    assert tok.convert_ids_to_tokens(emoji)[-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert tok.decode(emoji) == "🙂"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_qwen2_chatml(folders: dict[str, Path]) -> None:
    _, tok = load(folders["qwen2"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(chat)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.decode(ids) == chat
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_special_ids_agree(folders: dict[str, Path], family: str) -> None:
    model, tok = load(folders[family])
    gen = GenerationConfig.from_pretrained(folders[family], local_files_only=True)
    assert gen.eos_token_id == model.config.eos_token_id == tok.eos_token_id is not None
    assert gen.bos_token_id == model.config.bos_token_id == tok.bos_token_id
    assert gen.pad_token_id == model.config.pad_token_id == tok.pad_token_id
    assert max(tok.all_special_ids) < model.config.vocab_size
    assert max(tok.encode(TEXT + ODD + tok.eos_token)) < model.config.vocab_size
    assert tok.model_max_length == 512


def test_kv_bytes_per_token(folders: dict[str, Path]) -> None:
    gqa, _ = load(folders["llama"])
    mha, _ = load(folders["llama-mha"])
    assert kv_bytes_per_token(gqa.config) == 2 * 2 * 2 * 8 * 4  # layers x K,V x kv heads x head size x float32
    assert kv_bytes_per_token(mha.config) == 4 * kv_bytes_per_token(gqa.config)
    small = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "torch_dtype": "float32"}
    assert kv_bytes_per_token(small) == 12 * 2 * 768 * 4 == 73_728
    assert kv_bytes_per_token(GPT2Config()) == 73_728  # a transformers config; no dtype: float32
    assert kv_bytes_per_token({**small, "torch_dtype": "float16"}) == 36_864
    assert kv_bytes_per_token({**small, "dtype": "bfloat16"}, dtype_bytes=1) == 18_432
    explicit = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
                "head_dim": 32, "dtype": "bfloat16"}  # head_dim wins over hidden // heads
    assert kv_bytes_per_token(explicit) == 4 * 2 * 2 * 32 * 2


def test_model_vocabulary_covers_the_tokenizer(tmp_path: Path) -> None:
    folder = write_tiny("llama", tmp_path / "small", vocab_size=100)  # below Llama's 259 specials and bytes
    model, tok = load(folder)
    assert model.config.vocab_size == len(tok) > 259
    assert max(tok.encode(TEXT + ODD)) < model.config.vocab_size


def test_half_precision_folder(tmp_path: Path) -> None:
    folder = write_tiny("qwen2", tmp_path / "q16", dtype="float16")
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="auto")
    assert model.dtype == torch.float16
    assert kv_bytes_per_token(model.config) == 2 * 2 * 2 * 8 * 2


@pytest.mark.parametrize(("family", "kwargs", "says"), [
    ("llama", {"kv_heads": 3}, "must divide heads"),
    ("qwen2", {"heads": 6}, "must divide hidden"),
    ("gpt2", {"kv_heads": 2}, "no grouped-query attention"),
    ("falcon", {}, "gpt2, llama, qwen2, qwen3, mistral"),
    ("llama", {"sliding_window": 64}, "for the mistral family"),
])
def test_bad_shapes_are_refused(tmp_path: Path, family: str, kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        write_tiny(family, tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_cli_writes_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "q"
    assert main(["tiny-model", "qwen2", str(folder), "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"labserver serve --strategy gen-paged --model {folder}" in out
    assert "qwen2" in out and "128 KV bytes per token" in out  # 1 layer x 2 x 2 kv heads x 8 x 4 bytes
    assert AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).config.num_hidden_layers == 1
    assert main(["tiny-model", "gpt2", str(tmp_path / "g"), "--kv-heads", "2"]) == 2  # a clear error, not a trace
