"""GPT-2 with random weights, generating one step at a time through our own forward pass.

What this is: the ``gpt2-random`` and ``gpt2-tiny-random`` generators of
``labserver.models``. transformers builds the model (``GPT2LMHeadModel`` after a fixed
seed, so the same random weights every run) and this module only *reads its weights*: the
forward pass below is ours and short, so a lesson can show exactly what a decode step
computes and where the KV cache lives. The tokenizer is the bundled BERT uncased WordPiece
vocabulary (30,522 tokens), so nothing is downloaded.

The KV cache is paged (``labserver.models.kvcache``): one pool of blocks per layer, and
every call names, per sequence, the tokens to compute, where they start and the block
table that says where its positions live (``labserver.models.Chunk``). A call is one
flattened row of every sequence's new tokens; at each layer their keys and values go to
their slots, and each sequence attends over exactly its own positions: no padding to the
longest live sequence. The engine owns the tables; this model owns the pool.

What this is not: fast or frugal. There are no fused kernels (each sequence's positions
are gathered into a contiguous copy at every layer, where vLLM's kernel reads the blocks
in place), and the text is meaningless (random weights). Tokens are chosen by
``labserver.models.sampling.choose`` (greedy unless a request samples).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from transformers import BertTokenizerFast, GPT2Config, GPT2LMHeadModel

from .base import MEANINGLESS, Chunk, InputRejected, ModelError, minilm_dir, pick_device, pick_dtype
from .kvcache import CallPlan, PagedKV
from .sampling import choose

logger = logging.getLogger(__name__)

__all__ = ["TINY", "Costs", "GPT2Gen", "gpt2_random"]

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512}  # ~1 ms a step: for tests

@dataclass
class Costs:
    """Where a model's calls spend their time, summed over calls while ``GPT2Gen.costs`` is set.

    Wall-clock seconds on the thread that calls the model (on a CPU, torch runs each op
    before it returns, so a timer around it measures it; on a GPU it would not).
    """

    attention_s: float = 0.0  # PagedKV.attend: K/V written to their slots, gathered back, attended over
    matmul_s: float = 0.0  # the linear layers, with their layer norms and GELU
    total_s: float = 0.0  # whole calls: the above, embeddings, logits, planning, choosing tokens
    tokens: int = 0  # tokens the calls chose (one per sequence that sampled)
    calls: int = 0
    decode_s: float = 0.0  # of total_s, in calls of one token per sequence
    decode_tokens: int = 0
    decode_calls: int = 0

    def add_call(self, seconds: float, tokens: int, decode: bool) -> None:
        self.total_s += seconds
        self.tokens += tokens
        self.calls += 1
        if decode:
            self.decode_s += seconds
            self.decode_tokens += tokens
            self.decode_calls += 1

    def __sub__(self, earlier: Costs) -> Costs:
        """What was added since ``earlier`` (a copy taken then): the costs of a window."""
        return Costs(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def per_token_ms(self) -> dict[str, float]:
        """Milliseconds per chosen token: attention, matmuls, the rest, and in all."""
        n = max(self.tokens, 1)
        rest = self.total_s - self.attention_s - self.matmul_s
        return {"attention": 1000 * self.attention_s / n, "matmul": 1000 * self.matmul_s / n,
                "other": 1000 * rest / n, "total": 1000 * self.total_s / n}


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
    """A GenModel over a GPT-2 made by transformers, run by ``_forward`` over a ``PagedKV`` pool."""

    def __init__(self, name: str, hf_model: GPT2LMHeadModel, tokenizer: BertTokenizerFast,
                 note: str | None = MEANINGLESS) -> None:
        config = hf_model.config
        self.name, self.note = name, note
        self.hf_model = hf_model  # also driven by labserver.engine.hfcb (transformers' own scheduler)
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.sep_token_id
        self.max_context: int = config.n_positions
        self._pieces = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
        self._special = set(tokenizer.all_special_ids)
        self._live: set[int] = set()  # sequences prefilled and not released
        weight = hf_model.lm_head.weight
        self.kv = PagedKV(config.n_layer, config.n_head, config.n_embd // config.n_head, weight.device, weight.dtype)
        self.costs: Costs | None = None  # set a Costs to time every call's parts (a benchmark's breakdown)

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
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """GPT-2 over one flattened call ([tokens] ids at their positions) -> final hidden states [tokens, width].

        Every layer is the usual block; only attention reads beyond the call's own tokens:
        ``PagedKV.attend`` stores their keys and values and lets each sequence see its own.
        """
        gpt = self.hf_model.transformer
        heads = self.hf_model.config.n_head
        x = gpt.wte(ids) + gpt.wpe(positions)  # [tokens, width]
        t, width = x.shape
        costs = self.costs
        for i, block in enumerate(gpt.h):
            t0 = time.perf_counter() if costs else 0.0
            qkv = _conv1d(_layer_norm(x, block.ln_1), block.attn.c_attn)
            q, k, v = (part.view(t, heads, width // heads) for part in qkv.split(width, dim=-1))
            t1 = time.perf_counter() if costs else 0.0
            attended = self.kv.attend(i, q, k, v, plan).reshape(t, width)
            t2 = time.perf_counter() if costs else 0.0
            x = x + _conv1d(attended, block.attn.c_proj)
            h = F.gelu(_conv1d(_layer_norm(x, block.ln_2), block.mlp.c_fc), approximate="tanh")  # "gelu_new"
            x = x + _conv1d(h, block.mlp.c_proj)
            if costs:
                costs.attention_s += t2 - t1
                costs.matmul_s += t1 - t0 + time.perf_counter() - t2
        return _layer_norm(x, gpt.ln_f)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.hf_model.lm_head.weight.T  # tied to wte; no bias

    # -- the two steps (one computation: a decode is a chunk of one token) ------------------
    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        self.kv.allocate(blocks, block_tokens)
        self._live.clear()

    @torch.inference_mode()
    def logits(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute the chunks; the next-token scores [chunks that sample, vocab], in call order."""
        for c in chunks:
            if not c.tokens or c.start < 0 or c.end > self.max_context:
                raise ModelError(f"sequence {c.sid}: positions {c.start}..{c.end - 1} are not within the model's "
                                 f"{self.max_context} (the context limit)")
        dev = self.kv.device
        plan = self.kv.plan(chunks)
        ids = torch.tensor([t for c in chunks for t in c.tokens], device=dev)
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.end)], device=dev)
        hidden = self._forward(ids, positions, plan)
        ends = itertools.accumulate(len(c.tokens) for c in chunks)  # each chunk's last row is its end - 1
        last = torch.tensor([z - 1 for c, z in zip(chunks, ends, strict=True) if c.sample], device=dev)
        return self._logits(hidden.index_select(0, last))

    def _choose(self, chunks: list[Chunk]) -> list[int | None]:
        start = time.perf_counter()
        picked = [c for c in chunks if c.sample]
        tokens = iter(choose(self.logits(chunks), [c.end for c in picked], [c.sampling for c in picked], self.eos_id))
        self._live.update(c.sid for c in chunks)
        if self.costs:
            self.costs.add_call(time.perf_counter() - start, len(picked), decode=all(len(c.tokens) == 1 for c in chunks))
        return [next(tokens) if c.sample else None for c in chunks]

    def prefill(self, chunks: list[Chunk]) -> list[int | None]:
        return self._choose(chunks) if chunks else []

    def decode(self, chunks: list[Chunk]) -> list[int]:
        for c in chunks:
            if c.sid not in self._live:
                raise ModelError(f"decode of sequence {c.sid}, which has no cache (never prefilled or released)")
        return self._choose(chunks) if chunks else []  # type: ignore[return-value]

    def release(self, seq_ids: list[int]) -> None:
        self._live.difference_update(seq_ids)

    @property
    def cached(self) -> int:
        """Sequences the engine has not released (a leak shows here)."""
        return len(self._live)


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
