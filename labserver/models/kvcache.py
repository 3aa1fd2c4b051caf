"""The KV cache as a pool of blocks, and attention over it with no padding: what a model call reads and writes.

Per layer, one K and one V tensor of ``blocks * block_tokens`` *slots*, each slot one
position's keys (or values) for every head: ``[slots, heads, head_dim]``. Position p of a
sequence lives in slot ``table[p // block_tokens] * block_tokens + p % block_tokens`` of
its block table: slots, not rows, so sequences of any lengths share the pool with no
padding and a block freed by one is taken by the next (``labserver.engine.blocks`` says
which blocks each sequence holds; this module only reads and writes them).

A model call is flattened: the new tokens of every sequence in it (a whole prompt, a piece
of one, or one decode token) in one row, ``[tokens, heads, head_dim]``. At every layer
``attend`` first writes the new tokens' K and V to their slots, then, for each sequence,
gathers the slots of its positions (``index_select``: a copy of exactly its own length)
and runs attention for its queries over them, causal within its new tokens. On a GPU,
vLLM reads the blocks in place inside its attention kernel; on a CPU without one, the
gather is the price of paging, and it is paid per sequence for its own length only.

What this is not: fused or fast. The loop over sequences is Python, one attention call
each (about 10 us of overhead a sequence a layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Chunk, ModelError

__all__ = ["CallPlan", "PagedKV"]


@dataclass
class CallPlan:
    """Where one call's tokens go and what each sequence reads, computed once for all layers."""

    write: torch.Tensor  # [tokens]: the slot of every new token, in call order
    reads: list[torch.Tensor]  # per chunk: the slots of its positions 0 .. end - 1
    spans: list[tuple[int, int]]  # per chunk: its new tokens' range in the call
    masks: list[torch.Tensor | None]  # per chunk: [new, end] keys each query may see (None: all, or plain causal)
    causal: list[bool]  # per chunk: its whole context is new (a prompt from its start): causal attention


class PagedKV:
    """K and V for every layer in one pool of blocks. Call it under ``torch.inference_mode()``."""

    def __init__(self, layers: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.device, self.dtype = device, dtype
        self.allocate(0, 16)

    def allocate(self, blocks: int, block_tokens: int) -> None:
        """The pool: ``torch.empty``, so the operating system hands over pages only as blocks are first written."""
        self.blocks, self.block_tokens = blocks, block_tokens
        shape = (blocks * block_tokens, self.heads, self.head_dim)
        self.k = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        self.v = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]

    @property
    def bytes_per_token(self) -> int:
        """Memory one position holds: K and V, every layer and head."""
        return 2 * self.layers * self.heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def slots(self, table: Sequence[int], start: int, end: int) -> list[int]:
        b = self.block_tokens
        return [table[p // b] * b + p % b for p in range(start, end)]

    def plan(self, chunks: Sequence[Chunk]) -> CallPlan:
        """Check each chunk's table against the pool and turn positions into slots."""
        dev, b = self.device, self.block_tokens
        write: list[int] = []
        reads, spans, masks, causal = [], [], [], []
        for c in chunks:
            if len(c.blocks) * b < c.end or any(not 0 <= x < self.blocks for x in c.blocks):
                raise ModelError(f"sequence {c.sid}: blocks {list(c.blocks)} do not hold positions 0..{c.end - 1} "
                                 f"in a pool of {self.blocks}")
            every = self.slots(c.blocks, 0, c.end)
            spans.append((len(write), len(write) + len(c.tokens)))
            write += every[c.start:]
            reads.append(torch.tensor(every, device=dev))
            n = len(c.tokens)
            causal.append(c.start == 0 and n > 1)
            # a piece after cached positions: query j sees every key up to its own position start + j
            masks.append(None if n == 1 or c.start == 0 else
                         torch.arange(c.end, device=dev)[None, :] <= torch.arange(c.start, c.end, device=dev)[:, None])
        return CallPlan(torch.tensor(write, device=dev), reads, spans, masks, causal)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """q, k, v: [tokens, heads, head_dim] of the call's new tokens -> attention output, the same shape."""
        keys, values = self.k[layer], self.v[layer]
        keys[plan.write] = k  # first every new token's K and V into its slot, then each sequence reads its own
        values[plan.write] = v
        out = torch.empty_like(q)
        for (a, z), read, mask, causal in zip(plan.spans, plan.reads, plan.masks, plan.causal, strict=True):
            kk = keys.index_select(0, read).transpose(0, 1)  # [heads, positions, head_dim]
            vv = values.index_select(0, read).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[a:z].transpose(0, 1), kk, vv, attn_mask=mask, is_causal=causal)
            out[a:z] = o.transpose(0, 1)
        return out
