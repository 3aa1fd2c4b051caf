"""What a transformers config says that serving needs, without loading a model: no torch here.

- ``kv_bytes_per_token(config)``: what one position of a sequence holds in a KV cache,
  layers x 2 (K and V) x KV heads x head size x dtype size, from a config object or a
  config.json dict in GPT-2's names or Llama's (Qwen2's, Mistral's ...);
- ``RANDOM_KEY``: the key ``folders.write_tiny`` sets in a config it writes, so that a
  served folder of random weights says so in its answers (``causal``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_BYTES", "RANDOM_KEY", "kv_bytes_per_token"]

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
RANDOM_KEY = "labserver_random_weights"


def kv_bytes_per_token(config: Any, dtype_bytes: int | None = None) -> int:
    """Bytes of keys and values one token holds in a KV cache: layers x 2 x KV heads x head size x dtype bytes.

    ``config`` is a transformers config or a config.json dict, in GPT-2's names (n_layer, n_head,
    n_embd) or Llama's and Qwen2's (num_hidden_layers, num_key_value_heads, head_dim...). The
    dtype is the config's (float32 when it names none) unless ``dtype_bytes`` says otherwise.
    """
    d = config if isinstance(config, dict) else config.to_dict()

    def first(*names: str) -> Any:
        return next((d[n] for n in names if d.get(n) is not None), None)

    layers, heads = first("num_hidden_layers", "n_layer"), first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd")
    kv_heads = first("num_key_value_heads") or heads
    head_dim = first("head_dim") or hidden // heads
    if dtype_bytes is None:
        name = str(first("dtype", "torch_dtype") or "float32").removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {name!r} in the config: pass dtype_bytes")
        dtype_bytes = DTYPE_BYTES[name]
    return int(layers * 2 * kv_heads * head_dim * dtype_bytes)
