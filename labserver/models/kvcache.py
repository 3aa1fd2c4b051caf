"""The KV cache as a pool of blocks, and attention over it with no padding: what a model call reads and writes.

Per layer, one K and one V tensor of ``blocks * block_tokens`` *slots*, ``[slots, kv_heads,
head_dim]``: slot s holds one position's keys (or values) for every KV head. With
grouped-query attention (Llama, Qwen2) several query heads share one KV head, so a
position holds ``heads / kv_heads`` times fewer bytes than multi-head attention's (GPT-2:
one KV head per query head). Position p of a
sequence lives in slot ``table[p // block_tokens] * block_tokens + p % block_tokens`` of
its block table: sequences of any lengths share the pool with no padding, and a block
freed by one is taken by the next (``labserver.engine.blocks`` says which blocks each
sequence holds; this module only reads and writes them).

A model call is flattened: the new tokens of every sequence in it (a whole prompt, a
piece of one, or one decode token) in one row, ``[tokens, heads, head_dim]``. At every
layer ``attend`` first writes the new tokens' K and V to their slots, then each sequence
attends over exactly its own positions, read through its table:

- decode tokens (one query each): sorted by length and taken in groups of up to
  ``GROUP``, a group closed where padding would make its keys more than ``PADDING`` times
  its own; each group gathers its sequences' positions (``index_select``: a copy) into
  one batch padded only to the group's own longest, and runs one
  ``scaled_dot_product_attention`` with a mask for each sequence's length (none for a group of
  one, or of sequences all as long). Under grouped-query attention the query heads that share a KV head are that head's
  queries (``[sequences, KV heads, query heads per KV head, head_dim]``), so no KV head is
  repeated for its query heads: a decode call of 32 on smollm2 took 0.95x the time of
  ``enable_gqa`` over every query head (2 cores; the same greedy tokens). Sorting keeps
  the padding to a few percent of the keys, where one batch padded to the longest live
  sequence (a slot cache) computes up to twice what is needed;
- a verification (speculative decoding: a decoding sequence's token and its k guesses,
  ``Chunk.draft``): grouped as decodes are, k + 1 queries each, query i seeing the keys up
  to its own position;
- prompt tokens: per chunk, a gather of its positions and one attention call, causal
  within the new tokens (a piece after cached positions also sees all of those); whole
  prompts of one length side by side in the call are one batch of one call (16 prompts of
  32 tokens on smollm2's shapes: 0.33 against 1.34 ms a layer one by one, 2 cores).

On a GPU, vLLM's attention kernel reads the blocks in place; eagerly on a CPU, the gather is
the price of paging (``docs/memory.md`` has what it costs on 2 cores). Under ``torch.compile``
(``--compile``) a batch of decode tokens is attended in place instead (``in_place``): the
attention written as two sums over each sequence's slots, which inductor makes loops that read
K and V where they lie, no copy. On a CPU,
a float16 or bfloat16 pool is attended in float32 (the gathered keys, values and queries
widened, the output rounded back): torch's CPU attention accumulates in float32 either way,
and widening first was faster for one decode token on 2 cores (``docs/models.md``).

What this is not: a kernel of its own; eagerly, nothing reads the blocks in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Chunk, ModelError

__all__ = ["CallPlan", "PagedKV", "in_place", "padded_within"]


GROUP = 32  # decoding sequences attended together (fewer calls, each padded to its own longest): 32 took
#   60 ms where 8 took 64 for a decode call of 32 on smollm2 (2 cores), and 35 where 8 took 39 for 16
PADDING = 1.25  # ... as long as the group's keys, padded, are at most this many times its own: 19 sequences of 16
#   to 560 positions in one group made a decode call of gpt2-random 1.5x as long a sequence as 6 in groups


def padded_within(count: int, longest: int, own: int) -> bool:
    """``count`` sequences of ``own`` positions in all, attended as one group padded to the ``longest``: within
    ``PADDING`` of their own."""
    return count * longest <= PADDING * own


def in_place(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, read: torch.Tensor, mine: torch.Tensor,
             kv_heads: int) -> torch.Tensor:
    """Attention of one query a sequence over its slots, read where they lie: written for ``torch.compile``.

    q [n, query heads, head_dim]; ``read`` [n, longest] each sequence's slots, padded; ``mine`` [n, longest] which
    are its own. The scores are a sum over ``head_dim`` and the output a sum over the slots, each indexing the pool:
    inductor makes each sum one loop that loads a slot's row as it goes, where the eager path copies every row
    first (``index_select``) and hands the copy to SDPA. A decode call of 32 on smollm2's shapes at 96 positions,
    compiled: ~0.45 against ~0.65 ms a layer (2 cores). Eagerly it is slower than the copy and SDPA: only
    the compiled path takes it. The same softmax, summed in another order: the last bits of a score may differ.
    """
    n, longest = read.shape
    dim = q.shape[-1]
    queries = q.view(n, 1, kv_heads, -1, dim)  # each KV head's query heads
    k, v = keys[read], values[read]  # [n, longest, KV heads, dim]: read inside the sums below, never copied
    scores = (queries * k[:, :, :, None, :]).sum(-1) * dim ** -0.5  # [n, longest, KV heads, query heads each]
    scores = torch.where(mine.view(n, longest, 1, 1), scores, float("-inf"))
    e = torch.exp(scores - scores.amax(1, keepdim=True))
    out = (e[..., None] * v[:, :, :, None, :].to(e.dtype)).sum(1) / e.sum(1)[..., None]  # [n, KV heads, each, dim]
    return out.reshape(n, -1, dim)


@dataclass
class CallPlan:
    """Where one call's tokens go and what each sequence reads, computed once for all layers."""

    write: torch.Tensor  # [tokens]: the slot of every new token, in call order
    decodes: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]  # per group of decoding sequences:
    #   their rows in the call, the slots they read ([group x longest], padded), the longest, which keys are theirs
    #   (None: one query each and every key each one's own: one sequence, or all as long)
    prompts: list[tuple[int, int, torch.Tensor, torch.Tensor | None, int]]  # per prompt chunk, or run of whole
    #   prompts of one length side by side in the call: its rows a..z, its positions' slots, the keys each query
    #   may see (None: plain causal, whole prompts), how many sequences
    alone: tuple[torch.Tensor, int, torch.Tensor | None] | None = None  # the one decode group's slots, longest and
    #   keys when it is the whole call, its rows in call order (one stream's step, or a few sequences')


class PagedKV:
    """K and V for every layer in one pool of blocks. Call it under ``torch.inference_mode()``."""

    def __init__(self, layers: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        """``heads``: the KV heads (fewer than the query heads under grouped-query attention)."""
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.device, self.dtype = device, dtype
        half = dtype in (torch.float16, torch.bfloat16)
        self.compute = torch.float32 if half and torch.device(device).type == "cpu" else dtype  # attention's dtype
        self.dynamic = False  # its slots a dynamic dimension to torch.compile (labserver.models.graphs)
        self.allocate(0, 16)

    def allocate(self, blocks: int, block_tokens: int, spare: bool = False) -> None:
        """The pool: ``torch.empty``, so the operating system hands over pages only as blocks are first written.
        ``spare``: one block more, past the ``blocks`` a table may name, whose first slot is ``scratch`` (where a
        padded step's padding rows write: ``labserver.models.graphs``)."""
        self.blocks, self.block_tokens = blocks, block_tokens
        self.scratch = blocks * block_tokens if spare else None
        shape = ((blocks + spare) * block_tokens, self.heads, self.head_dim)
        self.k = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        self.v = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
        if self.dynamic and shape[0] > 1:  # compiled steps (--compile) serve a pool of any size
            for t in (*self.k, *self.v):
                torch._dynamo.mark_dynamic(t, 0)

    @property
    def bytes_per_token(self) -> int:
        """Memory one position holds: K and V, every layer and head."""
        return 2 * self.layers * self.heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def slots(self, table: Sequence[int], start: int, end: int) -> list[int]:
        b = self.block_tokens
        return [table[p // b] * b + p % b for p in range(start, end)]

    def gather(self, table: Sequence[int], positions: int) -> torch.Tensor:
        """A copy of positions 0..positions - 1 of a block table, every layer's K and V: ``[layers, 2, positions,
        heads, head_dim]`` (what a prefill replica hands a decode replica: ``labserver.engine.handover``)."""
        slots = torch.tensor(self._checked(table, 0, positions), dtype=torch.long, device=self.device)
        return torch.stack([torch.stack((k.index_select(0, slots), v.index_select(0, slots)))
                            for k, v in zip(self.k, self.v, strict=True)])

    def scatter(self, table: Sequence[int], start: int, end: int, kv: torch.Tensor) -> None:
        """Write positions start..end - 1 of a block table from ``kv`` (``gather``'s shape, positions 0..end - 1 or
        more), converted to this pool's dtype and device."""
        want = (self.layers, 2, self.heads, self.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], *kv.shape[3:]) != want or kv.shape[2] < end:
            raise ModelError(f"KV of shape {tuple(kv.shape)} does not hold positions 0..{end - 1} of a model of "
                             f"{self.layers} layers x {self.heads} KV heads x {self.head_dim}")
        slots = torch.tensor(self._checked(table, start, end), dtype=torch.long, device=self.device)
        part = kv[:, :, start:end].to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k.index_copy_(0, slots, part[layer, 0])
            v.index_copy_(0, slots, part[layer, 1])

    def _checked(self, table: Sequence[int], start: int, end: int, whose: str = "") -> list[int]:
        """The slots of positions start..end - 1 of ``table``, the table checked against the pool first."""
        if len(table) * self.block_tokens < end or any(not 0 <= x < self.blocks for x in table):
            raise ModelError(f"{whose}blocks {list(table)} do not hold positions 0..{end - 1} in a pool of "
                             f"{self.blocks}")
        return self.slots(table, start, end)

    def table_slots(self, c: Chunk) -> list[int]:
        """The slots of a chunk's positions 0..end - 1, its table checked against the pool first."""
        return self._checked(c.blocks, 0, c.end, f"sequence {c.sid}: ")

    def plan(self, chunks: Sequence[Chunk]) -> CallPlan:
        """Check each chunk's table against the pool and turn positions into slots."""
        dev = self.device
        write: list[int] = []
        queriers: list[tuple[int, list[int], int]] = []  # (its first row in the call, the slots of all its
        #   positions, its queries): one token's, or a decoding sequence's token and its guesses (a verification)
        pieces: list[tuple[int, int, list[int], int, int]] = []  # prompt chunks: (rows a..z, slots, sequences,
        #   the length of each when they are whole prompts, else 0)
        for c in chunks:
            every = self.table_slots(c)
            a, n = len(write), len(c.tokens)
            write += every[c.start:]
            if n == 1 or c.decode:  # query i sees every position up to its own
                queriers.append((a, every, n))
            elif c.start == 0 and pieces and pieces[-1][1] == a and pieces[-1][4] == n:  # a whole prompt as long as
                b, _, slots, seqs, _ = pieces[-1]  # the whole ones just before it: one batch with them
                pieces[-1] = (b, a + n, slots + every, seqs + 1, n)
            else:
                pieces.append((a, a + n, every, 1, n if c.start == 0 else 0))
        prompts = [(a, z, torch.tensor(every, device=dev), self._sees(len(every), z - a), seqs)
                   for a, z, every, seqs, _ in pieces]
        decodes = self._groups(queriers)  # (sorts queriers)
        alone = None
        if len(decodes) == 1 and not prompts and [a + j for a, _, n in queriers for j in range(n)] == list(
                range(len(write))):
            alone = decodes[0][1:]
        return CallPlan(torch.tensor(write, dtype=torch.long, device=dev), decodes, prompts, alone)

    def _sees(self, keys: int, queries: int) -> torch.Tensor | None:
        """The keys each of a prompt piece's queries sees: query j (position keys - queries + j) every key up to its
        own position; None for a whole prompt (plain causal)."""
        if keys == queries:
            return None
        return (torch.arange(keys, device=self.device)[None, :]
                <= torch.arange(keys - queries, keys, device=self.device)[:, None])

    def _groups(self, queriers: list[tuple[int, list[int], int]]) -> list[tuple[torch.Tensor, torch.Tensor, int,
                                                                                torch.Tensor | None]]:
        """Decoding sequences grouped: the same number of queries, sorted by length, up to ``GROUP`` a group; per
        group its rows, its slots padded to its longest, and the keys each query sees (query i of a sequence of
        length L: 0..L - q + i)."""
        dev, groups = self.device, []
        queriers.sort(key=lambda v: (v[2], len(v[1])))
        own = 0  # the current group's positions, unpadded
        for i, querier in enumerate(queriers):
            length = len(querier[1])
            if (i and querier[2] == queriers[i - 1][2] and len(groups[-1]) < GROUP
                    and padded_within(len(groups[-1]) + 1, length, own + length)):  # (sorted: this one the longest)
                groups[-1].append(querier)
                own += length
            else:
                groups.append([querier])
                own = length
        out = []
        for group in groups:
            q, longest = group[0][2], len(group[-1][1])
            padded = [slots + slots[:1] * (longest - len(slots)) for _, slots, _ in group]  # (padding: masked out)
            rows = torch.tensor([a + j for a, _, _ in group for j in range(q)], device=dev)
            sees = None  # one query each, all as long (one sequence; a batch in step): every key is each one's own,
            #   SDPA without a mask (a decode group of 32 on smollm2's shapes: 87 against 105 us a layer, 2 cores)
            if q > 1 or len(group[0][1]) != longest:
                first = torch.tensor([len(slots) - q for _, slots, _ in group], device=dev)  # each one's first query's
                sees = (torch.arange(longest, device=dev)[None, None, :]
                        <= first[:, None, None] + torch.arange(q, device=dev)[None, :, None])[:, None]
            out.append((rows, torch.tensor(padded, device=dev).flatten(), longest, sees))
        return out

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """q [tokens, query heads, head_dim], k and v [tokens, KV heads, head_dim] of the call's new tokens
        -> attention output, q's shape. Query head h reads KV head h // (query heads / KV heads)."""
        keys, values = self.k[layer], self.v[layer]
        gqa = q.shape[1] != self.heads
        keys.index_copy_(0, plan.write, k)  # first every new token's K and V into its slot, then each sequence
        values.index_copy_(0, plan.write, v)  # reads its own
        wide = self.compute
        if plan.alone is not None:  # one group of decoding sequences, the call's rows in order: no gather of q
            return self._decode(keys, values, q, *plan.alone, gqa)
        out = torch.empty_like(q)
        for rows, read, longest, mine in plan.decodes:
            out[rows] = self._decode(keys, values, q[rows], read, longest, mine, gqa)
        for a, z, read, mask, seqs in plan.prompts:  # [sequences, heads, positions, head_dim]
            kk = keys.index_select(0, read).to(wide).view(seqs, -1, self.heads, self.head_dim).transpose(1, 2)
            vv = values.index_select(0, read).to(wide).view(seqs, -1, self.heads, self.head_dim).transpose(1, 2)
            qq = q[a:z].view(seqs, -1, q.shape[1], q.shape[2]).transpose(1, 2).to(wide)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            out[a:z] = o.transpose(1, 2).reshape(z - a, q.shape[1], q.shape[2]).to(out.dtype)
        return out

    def _decode(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, read: torch.Tensor, longest: int,
                mine: torch.Tensor | None, gqa: bool) -> torch.Tensor:
        """One group of n decoding sequences, m queries each (one; a verification's 1 + its guesses): q [n x m, query
        heads, head_dim] over their gathered positions, ``mine`` [n, 1, m, longest] the keys each query sees (None:
        one query each, which sees them all)."""
        n, m = read.shape[0] // longest, 1 if mine is None else mine.shape[2]
        heads, dim, wide, dtype = self.heads, self.head_dim, self.compute, q.dtype
        if m == 1 and mine is not None and torch.compiler.is_compiling():  # a compiled batch (graphs.CompiledDecode)
            return in_place(keys, values, q.to(wide), read.view(n, longest), mine.view(n, longest), heads).to(dtype)
        if wide == keys.dtype == q.dtype:  # float32: no casts (each a dispatch, 4 a layer of every step)
            kk, vv = keys.index_select(0, read), values.index_select(0, read)
        else:
            kk, vv, q = keys.index_select(0, read).to(wide), values.index_select(0, read).to(wide), q.to(wide)
        kk = kk.view(n, longest, heads, dim).transpose(1, 2)  # [n, heads, longest, dim]
        vv = vv.view(n, longest, heads, dim).transpose(1, 2)
        if m == 1 and gqa:  # one query a sequence: each KV head's query heads as its queries (nothing repeated)
            o = F.scaled_dot_product_attention(q.view(n, heads, -1, dim), kk, vv, attn_mask=mine)
            o = o.reshape(n, q.shape[1], dim)
            return o if o.dtype == dtype else o.to(dtype)
        qq = q.view(n, m, q.shape[1], dim).transpose(1, 2)  # [n, query heads, m, dim]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mine, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(n * m, q.shape[1], dim)
        return o if o.dtype == dtype else o.to(dtype)
