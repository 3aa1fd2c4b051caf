"""Tiny random-weight model folders of the causal-LM families labserver runs, written offline.

What this is: ``write_tiny(family, folder)`` writes a folder that plain transformers loads
(``AutoModelForCausalLM.from_pretrained(folder)``, ``AutoTokenizer.from_pretrained(folder)``)
for GPT-2, Llama, Qwen2, Qwen3 or Mistral: config.json, generation_config.json, model.safetensors and a
real BPE tokenizer. The weights are transformers' own initialisation after
``torch.manual_seed(seed)`` (same arguments, same bytes), except that the norm weights and
biases it starts at ones and zeros get a little noise: a forward pass that forgets one of
them (Qwen2's q/k/v biases, say) must not match transformers by accident. The tokenizer is
trained here, in well under a second, on the words of the bundled BERT vocabulary, so
nothing is downloaded. It is built the way transformers 5 rebuilds its class from the saved
vocabulary and merges, so it encodes the same before and after ``from_pretrained``.
Each tokenizer has its family's shape: GPT-2's byte-level BPE with ``<|endoftext|>`` and no
BOS; Llama's SentencePiece-style BPE (``▁`` for spaces, byte fallback through 256
``<0xNN>`` tokens, ``<unk> <s> </s>`` first, ``<s>`` added on encode); Qwen2's byte-level
BPE with ChatML's ``<|im_start|> <|im_end|>`` (Qwen3 shares it; Mistral shares Llama's).
All but GPT-2 default to grouped-query attention (8 query heads sharing 2 KV heads); ``kv_heads=heads``
gives the multi-head twin. Qwen3's heads are 16 wide whatever ``hidden`` is (its config
names ``head_dim``, as Qwen3's own do), and it normalises each query and key head.
``kv_bytes_per_token(config)`` is what one token's keys and values cost a KV cache.

What this is not: a model. The text is meaningless (random weights, a toy vocabulary), and
the folders are for checking a forward pass against transformers' and for sizing caches,
not for measuring quality. Their shapes are small on purpose; only the families' structure
(biases, tied embeddings, grouped KV heads, special tokens) follows the real models.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .base import minilm_dir
from .configs import DTYPE_BYTES, RANDOM_KEY, kv_bytes_per_token

__all__ = ["FAMILIES", "kv_bytes_per_token", "make_tokenizer", "parameter_count", "random_of_shape", "write_tiny"]

FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
QWEN3_HEAD_DIM = 16  # Qwen3 names its head size (128 for 0.6B's 1,024 wide, 16 heads: not hidden / heads)
SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
             "<|system|> <|user|> <|assistant|> Question: what is 2 + 2? Answer: 4.")
# TinyLlama-chat's turns after Llama-2's <s>: encode the rendered text with add_special_tokens=False
LLAMA_CHAT = ("{{ bos_token }}{% for m in messages %}"
              "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2's pre-tokenizer (transformers' Qwen2Tokenizer)


def _corpus() -> list[str]:
    """The training text: the BERT vocabulary's ASCII words (no [specials], no ##pieces), then a few sentences."""
    lines = (minilm_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return [w for w in lines if w and w.isascii() and not w.startswith(("[", "##"))] + list(SENTENCES)


def _train(pre_tokenizer: Any, texts: list[str], vocab_size: int, specials: list[str],
           alphabet: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE vocabulary and merges: the same every run (and in every process: no hashing decides a tie)."""
    import json

    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=alphabet, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) for m in model["merges"]]


def make_tokenizer(family: str, vocab_size: int = 1024) -> Any:
    """The family's tokenizer (a transformers tokenizer, built the way its class rebuilds it from the saved files)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import GPT2Tokenizer, LlamaTokenizer, Qwen2Tokenizer  # (in transformers 5 the ...Fast ones)

    words = _corpus()
    if family in ("llama", "mistral"):  # (as LlamaTokenizer builds it: Metaspace without splitting, byte fallback)
        pieces = [f"<0x{b:02X}>" for b in range(256)]
        vocab, merges = _train(pre_tokenizers.Metaspace("▁", prepend_scheme="first"), words, vocab_size,
                               ["<unk>", "<s>", "</s>", *pieces], [])  # ids 0, 1, 2, then <0x00>.. at 3..258
        tok = Tokenizer(BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
        return LlamaTokenizer(tokenizer_object=tok, add_bos_token=True, add_eos_token=False, legacy=False,
                              chat_template=LLAMA_CHAT)
    bpe = {"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False}
    spaced = [" " + w for w in words]  # byte-level: a word after a space is one piece, "Ġword"
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if family == "gpt2":
        gpt2_pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
        vocab, merges = _train(gpt2_pre, spaced, vocab_size - 1, [], alphabet)
        tok = Tokenizer(BPE(vocab, merges, **bpe))
        tok.pre_tokenizer, tok.decoder = gpt2_pre, decoders.ByteLevel()
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        return GPT2Tokenizer(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                             unk_token="<|endoftext|>", add_prefix_space=False)
    if family in ("qwen2", "qwen3"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        qwen_pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        vocab, merges = _train(qwen_pre, spaced, vocab_size - len(specials), [], alphabet)
        tok = Tokenizer(BPE(vocab, merges, byte_fallback=False, **bpe))
        tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizers.NFC(), qwen_pre, decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return Qwen2Tokenizer(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None,  # type: ignore[arg-type]  # (as Qwen2.5's: no unk)
                              chat_template=CHATML)
    raise ValueError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")


def write_tiny(family: str, folder: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 8,
               kv_heads: int | None = None, vocab_size: int = 1024, max_positions: int = 512, seed: int = 0,
               dtype: str = "float32", sliding_window: int | None = None) -> Path:
    """Write a tiny random ``family`` model with its tokenizer to ``folder`` (created); return the folder.

    The tokenizer is trained to ``vocab_size`` ids, its special tokens included; the model's
    vocabulary is that, or the tokenizer's whole length where the vocabulary cannot be that
    small (Llama's 259 specials and bytes). The weights are made in float32 and saved as ``dtype``.
    ``sliding_window`` (Mistral only) writes a window into the config.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")
    if kv_heads is None:
        kv_heads = heads if family == "gpt2" else 2
    if sliding_window is not None and family != "mistral":
        raise ValueError("sliding_window is for the mistral family here")
    if family == "gpt2" and kv_heads != heads:
        raise ValueError(f"GPT-2 has no grouped-query attention: kv_heads must equal heads ({heads}), got {kv_heads}")
    if min(layers, hidden, heads, kv_heads, vocab_size, max_positions) < 1:
        raise ValueError("layers, hidden, heads, kv_heads, vocab_size and max_positions must be positive")
    if hidden % heads:
        raise ValueError(f"heads ({heads}) must divide hidden ({hidden})")
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    import torch
    import transformers as tf

    tok = make_tokenizer(family, vocab_size)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vocab = max(vocab_size, len(tok))  # every id the tokenizer can produce, added tokens included
    if family == "gpt2":
        config: Any = tf.GPT2Config(vocab_size=vocab, n_positions=max_positions, n_embd=hidden, n_layer=layers,
                                    n_head=heads, **ids)
        cls: Any = tf.GPT2LMHeadModel
    else:
        config_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
        extra: dict[str, Any] = {"head_dim": QWEN3_HEAD_DIM} if family == "qwen3" else {}
        if family == "mistral":  # no window (Mistral 7B v0.2 on); v0.1's was 4,096 positions
            extra = {"sliding_window": sliding_window, "head_dim": hidden // heads}
        config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            tie_word_embeddings=family in ("qwen2", "qwen3"),  # as Qwen2.5-0.5B's, Qwen3-0.6B's
                            **extra, **ids)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # norm weights and biases start as ones and zeros: jitter them, so none can be dropped
        for p in model.parameters():  # unseen (biases only a little: GPT-2's would swamp its 0.02-wide embeddings)
            if bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p), alpha=0.1 if p.flatten()[0] == 1 else 0.01)
    model = model.to(getattr(torch, dtype)).eval()  # built in float32, then rounded: same seed, same weights
    model.config.dtype = dtype
    setattr(model.config, RANDOM_KEY, True)  # served answers say the weights are random (models.causal)
    model.generation_config = tf.GenerationConfig(**ids)
    tok.model_max_length = max_positions
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def parameter_count(folder: str | Path) -> int:
    """Parameters stored in a folder's model.safetensors (tied weights once)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (not iterable)


def random_of_shape(folder: str | Path, into: str | Path) -> Path:
    """A model of ``folder``'s config and tokenizer with random weights (seeded), saved to ``into``: a real model's
    shape where its weights cannot travel (a GPU machine), its answers marked meaningless."""
    import torch
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(folder)
    setattr(config, RANDOM_KEY, True)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(into)
    tf.AutoTokenizer.from_pretrained(folder).save_pretrained(into)
    return Path(into)

