"""The Llama family (Llama 2 and 3, SmolLM, TinyLlama, Qwen2, 2.5 and 3, Mistral) through our own forward pass.

What this is: the generator for a Llama, Qwen2, Qwen3 or Mistral folder
(``labserver.models.causal`` reads the folder; transformers builds ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or ``MistralForCausalLM`` and this module only
reads its weights; Mistral's layer is Llama's). A layer differs from GPT-2's in four places, each a
line or two below:

- **RMSNorm** instead of LayerNorm: scale by the root mean square, no mean, no bias;
- **rotary positions** (RoPE) instead of a learned position table: each query and key is
  rotated by an angle that grows with *its own* position, so a sequence's keys in the
  pool need no position added later and a decode token at position p is rotated by p,
  whoever it is batched with (the angles come from the model's own rotary module, so
  Llama 3's scaled frequencies are the model's);
- **grouped-query attention**: ``kv_heads`` key/value heads, each shared by
  ``heads / kv_heads`` query heads; the pool holds only the KV heads
  (``labserver.models.kvcache``), several times fewer bytes a position than GPT-2's;
- **SwiGLU**: the MLP is ``down(silu(gate(x)) * up(x))``.

Qwen2 is the same layer with biases on the query, key and value projections (the
``nn.Linear`` modules carry them) and, for the small ones, the LM head tied to the
embeddings. Qwen3 drops the biases and normalises each query and key head (RMSNorm over
the head, before the rotation: "QK-norm"); its head size is its config's, not
width / heads.

What this is not: sliding-window attention (``labserver.models.causal`` serves such a
folder with its context cut to the window, where the window hides nothing) or
mixture-of-experts layers (refused at startup).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .kvcache import CallPlan
from .linear import Dense, Int4, dequantized, q4_1_blocks
from .paged import PagedLM

__all__ = ["LlamaGen"]


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, the weight applied in the input's dtype."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    if x.dtype == torch.float32 == norm.weight.dtype:  # one op: the same numbers as the weight's product after it
        return F.rms_norm(x, (x.shape[-1],), weight=norm.weight, eps=eps)  # (61 times a decode step)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's cos and sin [tokens, 1, head_dim], the sin's first half negated: ``_rotate`` then needs no
    negation of its own (-(a * b) and a * (-b) are the same number)."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [tokens, heads, head_dim], pairing dimension i with i + head_dim / 2 (transformers' layout:
    x * cos + cat(-x2, x1) * sin)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class _Packed:
    """One layer's projections as four calls, not seven: q, k and v side by side, gate and up side by side, o and
    down alone (``labserver.models.linear``: ``Dense`` float weights, or a GGUF's ``Int4`` blocks)."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o = Dense(attn.q_proj, attn.k_proj, attn.v_proj), Dense(attn.o_proj)
        self.gate_up, self.down = Dense(mlp.gate_proj, mlp.up_proj), Dense(mlp.down_proj)


class LlamaGen(PagedLM):
    """A GenModel over a Llama-shaped ``...ForCausalLM`` (Llama, Qwen2, Qwen3, Mistral), run by ``_forward``."""

    def __init__(self, name: str, hf_model: Any, tokenizer: Any, *, eos_id: int | None, max_context: int,
                 note: str | None = None) -> None:
        config = hf_model.config
        self.family = config.model_type
        self.heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qk_norm = hasattr(hf_model.model.layers[0].self_attn, "q_norm")
        super().__init__(name, hf_model, tokenizer, layers=config.num_hidden_layers, kv_heads=kv_heads,
                         head_dim=self.head_dim, max_context=max_context, eos_id=eos_id, note=note)
        self._packed = [_Packed(layer) for layer in hf_model.model.layers]

    def use_q4_1(self, tensors: dict[str, Any]) -> None:
        """Every layer's projections from a GGUF's own Q4_1 blocks (``Int4``): ``tensors`` by GGUF name
        (``gguf.GGUFReader``'s). Each is checked first: dequantized, it must equal the float weight loaded
        from the same file, bit for bit (q and k with llama.cpp's row order for rotary undone)."""
        names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
        heads = {"q_proj": self.heads, "k_proj": self.kv.heads}
        for i, (layer, w) in enumerate(zip(self.hf_model.model.layers, self._packed, strict=True)):
            parts = {}
            for module, linear in [*((n, getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj")),
                                   *((n, getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))]:
                tensor = tensors[f"blk.{i}.{names[module]}.weight"]
                if tensor.tensor_type.name != "Q4_1":
                    raise ValueError(f"blk.{i}.{names[module]} is {tensor.tensor_type.name}, not Q4_1")
                q, d, m = q4_1_blocks(tensor.data)
                if module in heads:  # llama.cpp stores each head's rotary halves interleaved: its rows, reordered
                    n = q.shape[0]
                    rows = np.arange(n).reshape(heads[module], n // heads[module] // 2, 2).swapaxes(1, 2).reshape(-1)
                    q, d, m = q[rows], d[rows], m[rows]
                if not torch.equal(dequantized(q, d, m), linear.weight.detach()):
                    raise ValueError(f"layer {i} {module}: the GGUF's blocks are not the weights loaded")
                parts[module] = (q, d, m)
            w.qkv = Int4([parts["q_proj"], parts["k_proj"], parts["v_proj"]], w.qkv.bias)
            w.o, w.down = Int4([parts["o_proj"]], w.o.bias), Int4([parts["down_proj"]], w.down.bias)
            w.gate_up = Int4([parts["gate_proj"], parts["up_proj"]], w.gate_up.bias)

    def projections(self) -> list[Any]:
        return [p for w in self._packed for p in (w.qkv, w.o, w.gate_up, w.down)]

    def projection_bytes(self) -> int:
        """Bytes every layer's projections read in a step, as held (float weights or 4-bit blocks)."""
        return sum(p.nbytes for p in self.projections())

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """One flattened call ([tokens] ids at their positions) -> final hidden states [tokens, width]."""
        body = self.hf_model.model
        x = body.embed_tokens(ids)  # [tokens, width]: no position added here; RoPE rotates q and k
        t = x.shape[0]
        cos, sin = body.rotary_emb(x, positions[None])  # [1, tokens, head_dim]: each token's own angles
        cos, sin = _angles(cos[0, :, None, :], sin[0, :, None, :])  # broadcast over heads
        heads, kv_heads, dim = self.heads, self.kv.heads, self.head_dim
        costs = None if torch.compiler.is_compiling() else self.costs  # (a compiled step: one graph, no split)
        for i, (layer, w) in enumerate(zip(body.layers, self._packed, strict=True)):
            t0 = time.perf_counter() if costs else 0.0
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            qk, v = w.qkv(h).split((w.qkv.outs[0] + w.qkv.outs[1], w.qkv.outs[2]), dim=-1)  # q, k, v: one matmul
            qk, v = qk.view(t, heads + kv_heads, dim), v.view(t, kv_heads, dim)
            if self.qk_norm:  # Qwen3: each head normalised before it is rotated
                qk = torch.cat((_rms_norm(qk[:, :heads], attn.q_norm), _rms_norm(qk[:, heads:], attn.k_norm)), 1)
            qk = _rotate(qk, cos, sin)  # every query and key head at once: the same rotation
            q, k = qk[:, :heads], qk[:, heads:]
            t1 = time.perf_counter() if costs else 0.0
            attended = self.kv.attend(i, q, k, v, plan).reshape(t, heads * dim)  # query heads share KV heads
            t2 = time.perf_counter() if costs else 0.0
            x = x + w.o(attended)
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate, up = w.gate_up(h).chunk(2, dim=-1)  # gate and up in one matmul
            x = x + w.down(layer.mlp.act_fn(gate) * up)  # SwiGLU
            if costs:
                costs.attention_s += t2 - t1
                costs.matmul_s += t1 - t0 + time.perf_counter() - t2
        return _rms_norm(x, body.norm)
