"""How a generator's projections multiply: float weights laid out for a decode step, or a GGUF's own 4-bit blocks.

A decode step multiplies one row per sequence by every weight of the model: matrix-vector
products, bound by how fast the weights are read. Two ways to read fewer bytes, or read them
faster, each a projection object called as ``proj(x)``:

- ``Dense``: the float weights, several projections of one input (q, k, v; gate, up) side by
  side as one matmul, in the layout the dtype's CPU kernel reads fastest. float32 on a CPU goes
  to oneDNN (``torch.ops.mkldnn``): the weight reordered once into oneDNN's own blocked layout
  for a batch of ``ONEDNN_ROWS`` rows, then multiplied without the per-call repacking torch's
  default matmul does, about 2x faster at 16 to 32 rows and 1.2x at one (``benchmarks/roofline.py``
  prints it). That copy is held beside the module's own weight, which transformers still
  computes with: float32 on a CPU holds its projections twice. bfloat16 goes to oneDNN the
  same way where the CPU multiplies it in its own instructions (``native_bf16``: AVX512-BF16
  or AMX; 2.4x torch's own bfloat16 kernel at one row, measured on such a CPU). The others
  lay the modules' weights out side by side instead (``side_by_side``): float16 and bfloat16
  ``[out, in]`` (``linear(x, W)``: their kernels read the transpose up to 10x slower),
  float32 without oneDNN ``[in, out]`` (``x @ W``). float16's CPU kernel reads one row at
  the memory's pace but multiplies several rows one after another (32 rows ~26x one), so a
  float16 projection on a CPU also keeps a float32 copy in oneDNN's layout (its weights
  widened exactly) for calls of ``WIDE_ROWS`` rows or more: a prompt, a batch. Its inputs
  are widened, its sums float32 as float16's kernel's are, its outputs rounded back to
  float16: the float16 model's own arithmetic, 3x its weights' bytes held. Exact: greedy
  answers equal transformers' but at near-ties, as any change of summation order may
  (``benchmarks/onestream.py`` counts them).
- ``Int4``: a GGUF's Q4_1 blocks as they are (32 weights share a scale ``d`` and a minimum
  ``m``; weight = d * q + m, q in 0..15), in torch's int4 CPU kernel: an eighth of float32's
  bytes. The kernel multiplies in bfloat16 (the activations and each block's scale and
  minimum rounded to 8 bits of mantissa), so the answers may change: ``smollm2-q4`` says how
  many (``benchmarks/onestream.py``).
"""

from __future__ import annotations

from typing import Any

import functools

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Dense", "GROUP", "Int4", "ONEDNN_ROWS", "WIDE_ROWS", "biases", "native_bf16", "onednn_linear",
           "onednn_packs", "onednn_weight", "out_in", "q4_1_blocks", "row_products", "rows_first", "side_by_side",
           "widens"]

GROUP = 32  # weights per Q4_1 block (one scale and one minimum each)


ROWS_FIRST = (torch.float16, torch.bfloat16)  # dtypes whose CPU matmul reads [out, in] fastest
ONEDNN_ROWS = 32  # the batch oneDNN lays a weight out for: as fast as a layout for 1 at one row, 1.5x at 32
WIDE_ROWS = 2  # from this many rows a float16 projection on a CPU multiplies through its float32 copy (see Dense)


def rows_first(dtype: torch.dtype) -> bool:
    """Whether ``side_by_side`` keeps this dtype's weights ``[out, in]`` (else ``[in, out]``)."""
    return dtype in ROWS_FIRST


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in its own instructions (AVX512-BF16 or AMX), which oneDNN's bfloat16
    kernels use: read from ``/proc/cpuinfo`` (elsewhere: no)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _onednn_here(weight: torch.Tensor) -> bool:
    """A CPU tensor, and a torch with oneDNN's linear."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether ``Dense`` multiplies by this weight through oneDNN: float32 on a CPU where torch has oneDNN, and
    bfloat16 where the CPU also multiplies it natively (``native_bf16``)."""
    return _onednn_here(weight) and (weight.dtype == torch.float32
                                     or (weight.dtype == torch.bfloat16 and native_bf16()))


def widens(weight: torch.Tensor) -> bool:
    """Whether ``Dense`` multiplies ``WIDE_ROWS`` or more rows by this weight through a float32 copy in oneDNN's
    layout: float16 on a CPU where torch has oneDNN."""
    return weight.dtype == torch.float16 and _onednn_here(weight)


def _conv1d(module: Any) -> bool:
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored ``[in, out]``."""
    return getattr(module, "nf", None) is not None and not isinstance(module, torch.nn.Linear)


def out_in(module: Any) -> torch.Tensor:
    """A module's weight as ``[out, in]`` (a view; a ``Conv1D``'s transposed)."""
    w = module.weight.detach()
    return w.t() if _conv1d(module) else w


def _stacked(modules: Any) -> torch.Tensor:
    """Their weights ``[out, in]`` one under another: ``[sum of outs, in]``, a new tensor."""
    return torch.cat([out_in(m) for m in modules], 0)


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 ``[out, in]`` weight reordered once into oneDNN's layout for ``ONEDNN_ROWS`` rows."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` with W as ``onednn_weight`` laid it out."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def side_by_side(*modules: Any, rows: bool | None = None) -> torch.Tensor:
    """These modules' weights (one input; ``nn.Linear`` or ``Conv1D``) side by side in one contiguous tensor, of
    which each module's weight becomes a view: float32 ``[in, sum of outs]`` (``x @ packed``); float16 and bfloat16
    ``[sum of outs, in]`` (``F.linear(x, packed)``); ``rows``: ``[sum of outs, in]`` (True) or ``[in, sum of outs]``
    whatever the dtype. One matmul computes all of them, and each module still computes its own part from a block
    of ``packed``. Nothing is held twice."""
    with torch.no_grad():
        stacked = _stacked(modules)
        rows = rows_first(stacked.dtype) if rows is None else rows
        packed = stacked.contiguous() if rows else stacked.t().contiguous()
        start = 0
        for m in modules:
            n = out_in(m).shape[0]
            block = packed[start:start + n] if rows else packed[:, start:start + n].t()  # [out, in]
            m.weight.data = block.t() if _conv1d(m) else block
            start += n
    return packed


def biases(*modules: Any) -> torch.Tensor | None:
    """Their biases end to end (zeros for one without), or None when none has one."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([torch.zeros(out_in(m).shape[0], dtype=m.weight.dtype, device=m.weight.device)
                      if m.bias is None else m.bias.detach() for m in modules])


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.library.custom_op("labserver::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear as one opaque op, for ``torch.compile``: inductor calls it as it is (its lowering of oneDNN's
    own op wants the weight as a constant of the graph, which a weight held by the model is not)."""
    return onednn_linear(x, weight, bias)


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def row_products(x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ bias)`` written as products and a sum over each row of W ``[out, in]``, for ``torch.compile``:
    inductor makes it one loop that reads W once, row after row, into the same C++ kernel as the norm and the
    additions around it. For one row (one sequence's decode step) that reads the weights at the pace of a plain sum,
    where a call to oneDNN costs ~11 us of its own each time (120 calls a step for a 30-layer model)."""
    out = (rows * x[..., None, :]).sum(-1)
    return out if bias is None else out + bias


def _through_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``onednn_linear``; under ``torch.compile``, the same as one opaque op."""
    if torch.compiler.is_compiling():
        return _onednn_linear(x, weight, bias)  # type: ignore[no-any-return]
    return onednn_linear(x, weight, bias)


class Dense:
    """Several linear modules of one input as one matmul, ``x W^T (+ bias)``: oneDNN's layout (float32 on a CPU) or
    the modules' weights side by side in their dtype's layout."""

    def __init__(self, *modules: Any) -> None:
        self.outs = [out_in(m).shape[0] for m in modules]
        self.bias = biases(*modules)
        first = modules[0].weight
        self.onednn = onednn_packs(first)
        if self.onednn:
            stacked = _stacked(modules)
            self.weight = onednn_weight(stacked)
            self.shape = tuple(stacked.shape)  # (oneDNN's tensor has its own strides: only its bytes are ours)
            self.rows = True
        else:
            self.weight = side_by_side(*modules)
            self.rows = rows_first(self.weight.dtype)  # [out, in]: F.linear; else [in, out]: x @ W
            self.shape = tuple(self.weight.shape) if self.rows else tuple(self.weight.shape[::-1])
        self.itemsize = first.element_size()
        self.modules = modules
        self.rows_weight: torch.Tensor | None = None  # float32, compiled: [out, in], the modules' own (``compiled``)
        self.wide: tuple[torch.Tensor, torch.Tensor | None] | None = None  # float16: a float32 copy for WIDE_ROWS+
        if widens(first):
            self.wide = (onednn_weight(self.weight.float()), None if self.bias is None else self.bias.float())

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication of one row reads: the weight (and bias)."""
        return self.shape[0] * self.shape[1] * self.itemsize + _nbytes(self.bias)

    def compiled(self) -> None:
        """Under ``torch.compile`` from now on, multiply one row as ``row_products`` (float32 through oneDNN only;
        several rows stay oneDNN's matmul): the modules' weights made views of one ``[out, in]`` tensor, which it
        reads (nothing held twice)."""
        if self.onednn and self.rows_weight is None and self.modules[0].weight.dtype == torch.float32:
            self.rows_weight = side_by_side(*self.modules, rows=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            if self.rows_weight is not None and torch.compiler.is_compiling() and x.shape[0] == 1:  # (one row)
                return row_products(x, self.rows_weight, self.bias)
            return _through_onednn(x, self.weight, self.bias)
        if self.wide is not None and x.numel() >= WIDE_ROWS * x.shape[-1]:
            return _through_onednn(x.float(), *self.wide).to(x.dtype)
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

    def compiled(self) -> None:
        """Nothing to change under ``torch.compile``: its matmul is one op either way (``Dense.compiled``)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                         self.scales_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias
