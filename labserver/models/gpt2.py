"""GPT-2 with random weights, generating one step at a time through our own forward pass.

What this is: the ``gpt2-random`` and ``gpt2-tiny-random`` generators of
``labserver.models``. transformers builds the model (``GPT2LMHeadModel`` after a fixed
seed, so the same random weights every run) and this module only *reads its weights*: the
forward pass below is ours and short, so a lesson can show exactly what a decode step
computes and where the KV cache lives. The tokenizer is the bundled BERT uncased WordPiece
vocabulary (30,522 tokens), so nothing is downloaded.

The KV cache is a *slot* cache: per layer one K and one V tensor shaped
``[slots, heads, length, head_dim]``. Each sequence owns one row (its slot) and its own
length. Rows ``0..n-1`` are always exactly the n live sequences, so a step that decodes all
of them reads the view ``[:n, :, :longest]`` (no copy), and a boolean mask hides each row's
positions past its own length. Releasing a sequence moves the last live row into its place.

What this is not: fast or frugal. Every row is padded to the longest live sequence (a paged
cache, as in vLLM or transformers' ContinuousBatchingManager, is not); there are no fused
kernels; and the text is meaningless (random weights). Tokens are chosen by
``labserver.models.sampling.choose`` (greedy unless a request samples).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import BertTokenizerFast, GPT2Config, GPT2LMHeadModel

from .base import MEANINGLESS, InputRejected, ModelError, Samplings, minilm_dir, pick_device, pick_dtype
from .sampling import choose

logger = logging.getLogger(__name__)

__all__ = ["TINY", "GPT2Gen", "SlotCache", "gpt2_random"]

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512}  # ~1 ms a step: for tests

# attend(layer, q, k, v) -> attention output; q/k/v are [batch, heads, tokens, head_dim]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SlotCache:
    """K and V per layer, ``[slots, heads, length, head_dim]``; live row i is sequence ``ids[i]``.

    It grows on demand (doubling slots or length, up to ``max_len``) by reallocating and
    copying, so nothing large is allocated before it is needed, and it gives its memory back
    when the last sequence leaves. Call it under ``torch.inference_mode()``.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.max_len = max_len  # positions the model has (n_positions)
        self.device, self.dtype = device, dtype
        self.ids: list[int] = []  # row -> sequence id, rows 0..n-1
        self.lengths: list[int] = []  # row -> tokens cached
        self.row: dict[int, int] = {}  # sequence id -> row
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._allocate(0, 0)

    @property
    def n(self) -> int:
        return len(self.ids)

    def _allocate(self, slots: int, length: int) -> None:
        """New zeroed tensors holding the live rows' cache (zeros: a masked position must not be NaN)."""
        used = max(self.lengths, default=0)
        for store in (self.k, self.v):
            for i in range(self.layers):
                new = torch.zeros((slots, self.heads, length, self.head_dim), device=self.device, dtype=self.dtype)
                if i < len(store):
                    new[:self.n, :, :used] = store[i][:self.n, :, :used]
                    store[i] = new
                else:
                    store.append(new)

    def reserve(self, slots: int, length: int) -> None:
        """Room for ``slots`` rows of ``length`` positions; grows by doubling so growing stays rare."""
        if length > self.max_len:
            raise ModelError(f"{length} positions asked for; this model has {self.max_len}")
        have_slots, have_length = self.k[0].shape[0], self.k[0].shape[2]
        if slots <= have_slots and length <= have_length:
            return
        self._allocate(max(slots, 2 * have_slots) if slots > have_slots else have_slots,
                       min(self.max_len, max(length, 2 * have_length)) if length > have_length else have_length)

    def commit(self, seq_ids: list[int], lengths: list[int]) -> None:
        """Rows n..n+len-1, already written, now belong to these sequences."""
        for sid, length in zip(seq_ids, lengths, strict=True):
            self.row[sid] = self.n
            self.ids.append(sid)
            self.lengths.append(length)

    def release(self, seq_id: int) -> None:
        """Forget one sequence: the last live row moves into its row, so rows 0..n-1 stay dense."""
        i = self.row.pop(seq_id, None)
        if i is None:
            return
        sid, length = self.ids.pop(), self.lengths.pop()
        if i < self.n:  # it was not the last row: move the last one here
            for t in (*self.k, *self.v):
                t[i, :, :length] = t[self.n, :, :length]
            self.ids[i], self.lengths[i], self.row[sid] = sid, length, i
        if not self.ids:
            self._allocate(0, 0)  # idle: give the memory back


def _layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _conv1d(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """GPT-2's Conv1D is a linear layer whose weight is stored [in, out] (transposed from nn.Linear)."""
    return torch.addmm(layer.bias, x.reshape(-1, x.shape[-1]), layer.weight).view(*x.shape[:-1], -1)


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, tokens, width] -> [batch, heads, tokens, head_dim]."""
    b, t, w = x.shape
    return x.view(b, t, heads, w // heads).transpose(1, 2)


class GPT2Gen:
    """A GenModel over a GPT-2 made by transformers, run by ``_forward`` with a ``SlotCache``."""

    def __init__(self, name: str, hf_model: GPT2LMHeadModel, tokenizer: BertTokenizerFast,
                 note: str | None = MEANINGLESS) -> None:
        config = hf_model.config
        self.name, self.note = name, note
        self.hf_model = hf_model  # also driven by labserver.engine.hfcb (transformers' own scheduler)
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.sep_token_id
        self.max_context: int = config.n_positions
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # (kind, seq ids) per prefill/decode call
        self._pieces = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
        self._special = set(tokenizer.all_special_ids)
        weight = hf_model.lm_head.weight
        self.cache = SlotCache(config.n_layer, config.n_head, config.n_embd // config.n_head,
                               config.n_positions, weight.device, weight.dtype)

    # -- text <-> tokens ------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise InputRejected("the prompt has no tokens; send some text")
        ids = [self.tokenizer.cls_token_id, *ids]  # [CLS] plays GPT-2's start-of-text token
        if len(ids) >= self.max_context:
            raise InputRejected(f"the prompt is {len(ids)} tokens; {self.name} holds {self.max_context} "
                                "(prompt + output): shorten it")
        return ids

    def token_text(self, token: int) -> str:
        piece = self._pieces[token]
        if token in self._special:
            return piece
        return piece[2:] if piece.startswith("##") else " " + piece  # "##ing" continues a word

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- the forward pass -----------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """GPT-2 over [batch, tokens] ids at their positions -> final hidden states [batch, tokens, width].

        ``attend`` is where prefill and decode differ: which keys and values each query sees
        and where the new ones are stored.
        """
        gpt = self.hf_model.transformer
        heads = self.hf_model.config.n_head
        x = gpt.wte(ids) + gpt.wpe(positions)
        for i, block in enumerate(gpt.h):
            qkv = _conv1d(_layer_norm(x, block.ln_1), block.attn.c_attn)
            q, k, v = (_split_heads(t, heads) for t in qkv.split(x.shape[-1], dim=-1))
            a = attend(i, q, k, v).transpose(1, 2).reshape(x.shape)  # heads back into the width
            x = x + _conv1d(a, block.attn.c_proj)
            h = F.gelu(_conv1d(_layer_norm(x, block.ln_2), block.mlp.c_fc), approximate="tanh")  # "gelu_new"
            x = x + _conv1d(h, block.mlp.c_proj)
        return _layer_norm(x, gpt.ln_f)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.hf_model.lm_head.weight.T  # tied to wte; no bias

    # -- the two steps --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_logits(self, seqs: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Right-padded prompts in one batch -> next-token logits [batch, vocab]; their K/V join the cache."""
        self.calls.append(("prefill", tuple(s for s, _ in seqs)))
        sids = [s for s, _ in seqs]
        if len(set(sids)) < len(sids) or any(s in self.cache.row for s in sids):
            raise ModelError(f"prefill of sequence ids already cached or repeated: {sids}")
        lengths = [len(p) for _, p in seqs]
        if not all(0 < n <= self.max_context for n in lengths):
            raise ModelError(f"prompt lengths {lengths}: each must be 1..{self.max_context} tokens")
        b, t, n, dev = len(seqs), max(lengths), self.cache.n, self.cache.device
        ids = torch.full((b, t), self.tokenizer.pad_token_id, dtype=torch.long, device=dev)
        for row, (_, prompt) in enumerate(seqs):
            ids[row, :len(prompt)] = torch.tensor(prompt, device=dev)
        lens = torch.tensor(lengths, device=dev)
        pos = torch.arange(t, device=dev)
        self.cache.reserve(n + b, t)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.cache.k[layer][n:n + b, :, :t] = k  # rows past n: not live until commit
            self.cache.v[layer][n:n + b, :, :t] = v
            # causal alone suffices: padding sits *after* each prompt, so no real token ever sees it
            # (pads see pads and real tokens; their outputs are thrown away)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        hidden = self._forward(ids, pos.expand(b, t), attend)
        logits = self._logits(hidden[torch.arange(b, device=dev), lens - 1])  # each prompt's last real token
        self.cache.commit(sids, lengths)  # only now: a failure above leaves no cache behind
        return logits

    @torch.inference_mode()
    def decode_logits(self, seqs: list[tuple[int, int]]) -> torch.Tensor:
        """One step for each (seq id, last token) -> logits [batch, vocab]; each K/V lands at its own position."""
        self.calls.append(("decode", tuple(s for s, _ in seqs)))
        cache, dev = self.cache, self.cache.device
        if len({s for s, _ in seqs}) < len(seqs):
            raise ModelError(f"decode of a sequence twice in one step: {[s for s, _ in seqs]}")
        for sid, _ in seqs:
            if sid not in cache.row:
                raise ModelError(f"decode of sequence {sid}, which has no cache (never prefilled or released)")
            if cache.lengths[cache.row[sid]] >= self.max_context:
                raise ModelError(f"sequence {sid} is at the context limit ({self.max_context} tokens)")
        order = sorted(range(len(seqs)), key=lambda j: cache.row[seqs[j][0]])  # compute in row order
        rows = [cache.row[seqs[j][0]] for j in order]
        rows_t = torch.tensor(rows, device=dev)
        # the usual step decodes every live row: read the view [:n]; a subset needs a gather (a copy)
        read = slice(0, cache.n) if rows == list(range(cache.n)) else rows_t
        pos = torch.tensor([cache.lengths[r] for r in rows], device=dev)  # where each new token goes
        width = int(pos.max()) + 1  # the longest row, including its new token
        visible = torch.arange(width, device=dev)[None, :] <= pos[:, None]  # [b, keys]: its own tokens only
        mask = visible[:, None, None, :]  # [b, 1 (heads), 1 (query), keys]
        cache.reserve(cache.n, width)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.k[layer], cache.v[layer]
            keys[rows_t, :, pos] = k[:, :, 0]  # [b, heads, head_dim], each at its own row and position
            values[rows_t, :, pos] = v[:, :, 0]
            return F.scaled_dot_product_attention(q, keys[read, :, :width], values[read, :, :width], attn_mask=mask)

        tokens = torch.tensor([seqs[j][1] for j in order], device=dev)
        logits = self._logits(self._forward(tokens[:, None], pos[:, None], attend)[:, 0])
        for r in rows:
            cache.lengths[r] += 1
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=dev)] = logits  # back to the caller's order
        return out

    def prefill(self, seqs: list[tuple[int, list[int]]], sampling: Samplings = None) -> list[int]:
        if not seqs:
            return []
        return choose(self.prefill_logits(seqs), [len(p) for _, p in seqs], sampling, self.eos_id)

    def decode(self, seqs: list[tuple[int, int]], sampling: Samplings = None) -> list[int]:
        if not seqs:
            return []
        logits = self.decode_logits(seqs)  # the step moved each sequence one position on
        return choose(logits, [self.cache.lengths[self.cache.row[sid]] for sid, _ in seqs], sampling, self.eos_id)

    @torch.inference_mode()  # the cache tensors are inference tensors: moving rows needs the mode too
    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.cache.release(sid)

    @property
    def cached(self) -> int:
        """Sequences holding cache now (a leak shows here)."""
        return self.cache.n


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
    return GPT2Gen(name, model, tokenizer)
