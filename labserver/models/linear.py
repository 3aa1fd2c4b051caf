"""How a generator's projections multiply: float weights laid out for a decode step, or a GGUF's own 4-bit blocks.

A decode step multiplies one row per sequence by every weight of the model: matrix-vector
products, bound by how fast the weights are read. Two ways to read fewer bytes, or read them
faster, each a projection object called as ``proj(x)``:

- ``Dense``: the float weights, several projections of one input (q, k, v; gate, up) side by
  side as one matmul, in the layout the dtype's CPU kernel reads fastest (``side_by_side``):
  float32 ``[in, out]`` (``x @ W``), which torch's CPU matmul reads about 1.4x faster than
  the ``[out, in]`` transformers stores when one row is multiplied; float16 and bfloat16 keep
  ``[out, in]`` (``linear(x, W)``): their kernels read the transpose up to 10x slower.
  Exact: the same numbers, only their order in memory changes.
- ``Int4``: a GGUF's Q4_1 blocks as they are (32 weights share a scale ``d`` and a minimum
  ``m``; weight = d * q + m, q in 0..15), in torch's int4 CPU kernel: an eighth of float32's
  bytes. The kernel multiplies in bfloat16 (the activations and each block's scale and
  minimum rounded to 8 bits of mantissa), so the answers may change: ``smollm2-q4`` says how
  many (``benchmarks/onestream.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Dense", "GROUP", "Int4", "biases", "q4_1_blocks", "rows_first", "side_by_side"]

GROUP = 32  # weights per Q4_1 block (one scale and one minimum each)


ROWS_FIRST = (torch.float16, torch.bfloat16)  # dtypes whose CPU matmul reads [out, in] fastest


def rows_first(dtype: torch.dtype) -> bool:
    """Whether ``Dense`` keeps this dtype's weights ``[out, in]`` (else ``[in, out]``)."""
    return dtype in ROWS_FIRST


def side_by_side(*linears: Any) -> torch.Tensor:
    """These ``nn.Linear`` weights (one input) side by side in one contiguous tensor, of which each module's
    weight becomes a view: float32 transposed once, ``[in, sum of outs]`` (``x @ packed``); float16 and
    bfloat16 ``[sum of outs, in]`` (``F.linear(x, packed)``). One matmul computes all of them, and each
    module still computes its own part (``F.linear(x, W)``: a block of ``packed``). Nothing is held twice."""
    with torch.no_grad():
        stacked = torch.cat([m.weight.detach() for m in linears], 0)
        rows = rows_first(stacked.dtype)
        packed = stacked.contiguous() if rows else stacked.t().contiguous()
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = packed[start:start + n] if rows else packed[:, start:start + n].t()
            start += n
    return packed


def biases(*linears: Any) -> torch.Tensor | None:
    """Their biases end to end (zeros for one without), or None when none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device) if m.bias is None
                      else m.bias.detach() for m in linears])


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Dense:
    """Several ``nn.Linear`` of one input as one matmul, ``x W^T (+ bias)``, the weight in its dtype's layout."""

    def __init__(self, *linears: Any) -> None:
        self.weight, self.bias = side_by_side(*linears), biases(*linears)
        self.rows = rows_first(self.weight.dtype)  # [out, in]: F.linear; else [in, out]: x @ W
        self.outs = [m.weight.shape[0] for m in linears]

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: the weight (and bias)."""
        return _nbytes(self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows:
            return F.linear(x, self.weight, self.bias)
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's bytes ``[rows, blocks x 20]`` -> (q ``[rows, cols]`` in 0..15, d and m ``[rows, blocks]``).

    A block is d (float16), m (float16) and 16 bytes: byte j holds weight j in its low
    nibble and weight j + 16 in its high one (llama.cpp's ``block_q4_1``)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 4 + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    return q, d, m


def dequantized(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """Q4_1 blocks as float32 ``[rows, cols]``: d * q + m, as llama.cpp and transformers compute them."""
    rows = q.shape[0]
    qf = torch.from_numpy(q.astype(np.float32)).view(rows, -1, GROUP)
    return (qf * torch.from_numpy(d.astype(np.float32))[..., None]
            + torch.from_numpy(m.astype(np.float32))[..., None]).view(rows, -1)


class Int4:
    """``x @ W.T (+ bias)`` with W in Q4_1 blocks, several of one input side by side (rows of ``[out, in]``):
    torch's int4 CPU kernel, computing in bfloat16 (weight = (q - 8) * d + (m + 8 d))."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], bias: torch.Tensor | None) -> None:
        q = torch.from_numpy(np.concatenate([p[0] for p in parts]).astype(np.int32))
        d = torch.from_numpy(np.concatenate([p[1] for p in parts]).astype(np.float32))
        m = torch.from_numpy(np.concatenate([p[2] for p in parts]).astype(np.float32))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        self.scales_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous().to(torch.bfloat16)
        self.bias = bias
        self.outs = [p[0].shape[0] for p in parts]

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: the packed blocks, their scales and minimums (and the bias)."""
        return _nbytes(self.packed, self.scales_zeros, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                         self.scales_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias
