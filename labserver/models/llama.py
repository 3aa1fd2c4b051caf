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

import torch
import torch.nn.functional as F

from .kvcache import CallPlan
from .paged import PagedLM, side_by_side

__all__ = ["LlamaGen"]


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, the weight applied in the input's dtype."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [tokens, heads, head_dim], pairing dimension i with i + head_dim / 2 (transformers' layout)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class _Packed:
    """One layer's projections as three matmuls, not seven: q, k and v side by side (with their biases, Qwen2),
    gate and up side by side; o and down transposed alone (``side_by_side``: the module's weights are views)."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.split = [m.weight.shape[0] for m in projections]
        self.qkv, self.o = side_by_side(*projections), side_by_side(attn.o_proj)
        self.gate_up, self.down = side_by_side(mlp.gate_proj, mlp.up_proj), side_by_side(mlp.down_proj)
        self.qkv_bias, self.o_bias = _biases(*projections), _biases(attn.o_proj)  # (Qwen2; Llama's attention_bias)
        self.gate_up_bias, self.down_bias = _biases(mlp.gate_proj, mlp.up_proj), _biases(mlp.down_proj)  # (mlp_bias)


def _biases(*linears: Any) -> torch.Tensor | None:
    """Their biases end to end (zeros for one without), or None when none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device) if m.bias is None
                      else m.bias.detach() for m in linears])


def _times(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight (+ bias): a packed projection."""
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


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

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """One flattened call ([tokens] ids at their positions) -> final hidden states [tokens, width]."""
        body = self.hf_model.model
        x = body.embed_tokens(ids)  # [tokens, width]: no position added here; RoPE rotates q and k
        t = x.shape[0]
        cos, sin = body.rotary_emb(x, positions[None])  # [1, tokens, head_dim]: each token's own angles
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # broadcast over heads
        heads, kv_heads, dim = self.heads, self.kv.heads, self.head_dim
        costs = self.costs
        for i, (layer, w) in enumerate(zip(body.layers, self._packed, strict=True)):
            t0 = time.perf_counter() if costs else 0.0
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            q, k, v = _times(h, w.qkv, w.qkv_bias).split(w.split, dim=-1)  # q, k and v in one matmul
            q, k, v = q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)
            if self.qk_norm:  # Qwen3: each head normalised before it is rotated
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            t1 = time.perf_counter() if costs else 0.0
            attended = self.kv.attend(i, q, k, v, plan).reshape(t, heads * dim)  # query heads share KV heads
            t2 = time.perf_counter() if costs else 0.0
            x = x + _times(attended, w.o, w.o_bias)
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate, up = _times(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # gate and up in one matmul
            x = x + _times(layer.mlp.act_fn(gate) * up, w.down, w.down_bias)  # SwiGLU
            if costs:
                costs.attention_s += t2 - t1
                costs.matmul_s += t1 - t0 + time.perf_counter() - t2
        return _rms_norm(x, body.norm)
