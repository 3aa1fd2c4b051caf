"""GPT-2, generating one step at a time through our own forward pass.

What this is: the ``gpt2-random`` and ``gpt2-tiny-random`` generators of
``labserver.models``, and any GPT-2 folder (real weights, its own tokenizer:
``labserver.models.causal``). transformers builds the model (``GPT2LMHeadModel``; for
the random ones after a fixed seed, so the same weights every run) and this module only
*reads its weights*: the forward pass below is ours and short, so a lesson can show
exactly what a decode step computes and where the KV cache lives. The random ones use the
bundled BERT uncased WordPiece vocabulary (30,522 tokens), so nothing is downloaded.

The KV cache is paged (``labserver.models.kvcache``): one pool of blocks per layer, and
every call names, per sequence, the tokens to compute, where they start and the block
table that says where its positions live (``labserver.models.Chunk``). A call is one
flattened row of every sequence's new tokens; at each layer their keys and values go to
their slots, and each sequence attends over exactly its own positions: no padding to the
longest live sequence. The engine owns the tables; this model owns the pool. What every
family shares (text, the pool, the two steps) is ``labserver.models.paged``.

What this is not: fast or frugal. There are no fused kernels (each sequence's positions
are gathered into a contiguous copy at every layer, where vLLM's kernel reads the blocks
in place), and with random weights the text is meaningless. Tokens are chosen by
``labserver.models.sampling.choose`` (greedy unless a request samples).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import BertTokenizerFast, GPT2Config, GPT2LMHeadModel

from .base import MEANINGLESS, minilm_dir, pick_device, pick_dtype
from .kvcache import CallPlan
from .linear import Dense
from .paged import Costs, PagedLM

logger = logging.getLogger(__name__)

__all__ = ["TINY", "Costs", "GPT2Gen", "gpt2_random"]

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512}  # ~1 ms a step: for tests


def _layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class GPT2Gen(PagedLM):
    """A GenModel over a GPT-2 made by transformers, run by ``_forward`` over a ``PagedKV`` pool."""

    family = "gpt2"

    def __init__(self, name: str, hf_model: GPT2LMHeadModel, tokenizer: Any, *, note: str | None = None,
                 eos_id: int | None = None, start_id: int | None = None) -> None:
        config = hf_model.config
        super().__init__(name, hf_model, tokenizer, layers=config.n_layer, kv_heads=config.n_head,
                         head_dim=config.n_embd // config.n_head, max_context=config.n_positions, eos_id=eos_id,
                         note=note, start_id=start_id)
        self._dense = [tuple(Dense(conv) for conv in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj))
                       for b in hf_model.transformer.h]  # Conv1D weights as Dense lays them out for the dtype
        tanh_gelu = config.activation_function in ("gelu_new", "gelu_pytorch_tanh")
        self._act = (lambda h: F.gelu(h, approximate="tanh")) if tanh_gelu else hf_model.transformer.h[0].mlp.act

    def projections(self) -> list[Any]:
        return [d for block in self._dense for d in block]

    # -- the forward pass -----------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """GPT-2 over one flattened call ([tokens] ids at their positions) -> final hidden states [tokens, width].

        Every layer is the usual block; only attention reads beyond the call's own tokens:
        ``PagedKV.attend`` stores their keys and values and lets each sequence see its own.
        """
        gpt = self.hf_model.transformer
        heads = self.hf_model.config.n_head
        x = gpt.wte(ids) + gpt.wpe(positions)  # [tokens, width]
        t, width = x.shape
        costs = None if torch.compiler.is_compiling() else self.costs  # (a compiled step: one graph, no split)
        for i, (block, (c_attn, c_proj, c_fc, mlp_proj)) in enumerate(zip(gpt.h, self._dense, strict=True)):
            t0 = time.perf_counter() if costs else 0.0
            qkv = c_attn(_layer_norm(x, block.ln_1))
            q, k, v = (part.view(t, heads, width // heads) for part in qkv.split(width, dim=-1))
            t1 = time.perf_counter() if costs else 0.0
            attended = self.kv.attend(i, q, k, v, plan).reshape(t, width)
            t2 = time.perf_counter() if costs else 0.0
            x = x + c_proj(attended)
            h = self._act(c_fc(_layer_norm(x, block.ln_2)))  # GPT-2's "gelu_new": tanh
            x = x + mlp_proj(h)
            if costs:
                costs.attention_s += t2 - t1
                costs.matmul_s += t1 - t0 + time.perf_counter() - t2
        return _layer_norm(x, gpt.ln_f)


def gpt2_random(tiny: bool = False, device: str = "auto", dtype: str = "auto", seed: int = 0) -> GPT2Gen:
    """GPT-2 small's shape (or ``TINY``) with random weights and the bundled uncased vocabulary."""
    dev = pick_device(device)
    tokenizer = BertTokenizerFast(vocab=str(minilm_dir() / "vocab.txt"), do_lower_case=True)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id,
                        **(TINY if tiny else {}))
    torch.manual_seed(seed)  # the same random weights every time: runs stay comparable
    model = GPT2LMHeadModel(config).to(device=dev, dtype=pick_dtype(dtype, dev)).eval()
    name = "gpt2-tiny-random" if tiny else "gpt2-random"
    logger.warning("%s: %s", name, MEANINGLESS)
    return GPT2Gen(name, model, tokenizer, note=MEANINGLESS, eos_id=tokenizer.sep_token_id,
                   start_id=tokenizer.cls_token_id)  # [CLS] plays GPT-2's start-of-text token
