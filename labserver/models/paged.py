"""What every generator labserver runs itself shares: a tokenizer's text, a KV pool, and the two steps.

``PagedLM`` is a ``GenModel`` over a transformers causal LM whose forward pass is ours: a
subclass writes ``_forward`` (the family's layers: ``gpt2.GPT2Gen``, ``llama.LlamaGen``)
and everything else is here, the same for every family:

- text: the tokenizer's own encoding of a prompt, the text of one token as it streams,
  and the text of an answer (``TokenizerText``);
- memory: one ``PagedKV`` pool of blocks, sized in positions by the engine, whose bytes
  per position are the model's (layers x 2 x KV heads x head size x dtype size);
- the steps: a call is a list of ``Chunk`` flattened into one row of tokens; the scores
  of the last token of each chunk that samples become its next token
  (``labserver.models.sampling.choose``), and a verifying chunk's (``Chunk.draft``: its last
  tokens are guesses) give a token after each of its last draft + 1 positions, chosen as
  one decode step at a time would choose them: a ``Verified``; where a chunk's sampling asks, the chosen
  token's log-probability and the most likely alternatives come with it, and a chunk's
  ``score`` tokens (a prompt's, for echo) are scored from the rows before them
  (``labserver.models.sampling.logprobs_of``): a ``Scored`` output.

``TransformersOnly`` is the same text over a causal LM this module cannot run (an
architecture with no forward pass here): only transformers' own manager
(``gen-hf-cb``) can serve it, and the step engine refuses it at startup.
"""

from __future__ import annotations

import functools
import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .base import Chunk, InputRejected, ModelError, Scored, Verified
from .configs import kv_bytes_per_token
from .grammar import apply_masks
from .kvcache import CallPlan, PagedKV
from .linear import Dense
from .sampling import choose, logprobs_of

__all__ = ["Costs", "PagedLM", "TokenizerText", "TransformersOnly"]


@dataclass
class Costs:
    """Where a model's calls spend their time, summed over calls while ``PagedLM.costs`` is set.

    Wall-clock seconds on the thread that calls the model (on a CPU, torch runs each op
    before it returns, so a timer around it measures it; on a GPU it would not).
    """

    attention_s: float = 0.0  # PagedKV.attend: K/V written to their slots, gathered back, attended over
    matmul_s: float = 0.0  # the linear layers, with their norms and activations
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


def _is_wordpiece(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "model", None)).__name__ == "WordPiece"


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


@functools.cache
def _byte_values() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character each byte is written as in a piece, back to the byte (GPT-2's
    table: printable bytes stand for themselves, the rest take the characters from U+0100 on, in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class TokenizerText:
    """A GenModel's text side, from a transformers tokenizer: ``encode``, ``token_text``, ``text``.

    A prompt is encoded as the tokenizer encodes it by default (its BOS included, when it
    adds one), except that a prompt which already begins with the BOS text (a rendered
    chat template) gets no second one. ``start_id`` instead puts one token first and asks
    the tokenizer for no specials (``gpt2-random``: [CLS] plays GPT-2's start of text).
    """

    name: str
    max_context: int

    def __init__(self, tokenizer: Any, start_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.start_id = start_id
        self._special = set(tokenizer.all_special_ids)
        self._wordpiece = _is_wordpiece(tokenizer)
        self._byte_level = _is_byte_level(tokenizer)
        self._texts: dict[int, str] = {}  # token -> its streamed text, as tokens are first seen
        self.vocab_size = len(tokenizer)  # every id it can decode, added tokens included
        backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's own (Rust) tokenizer
        self._rust_decode = (backend.decode if backend is not None and hasattr(backend, "decode")
                             and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None)

    def encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        specials = self.start_id is None and not (bos and prompt.startswith(bos))
        ids = tok.encode(prompt, add_special_tokens=specials)
        if all(i in self._special for i in ids):
            raise InputRejected("the prompt has no tokens; send some text")
        if self.start_id is not None:
            ids = [self.start_id, *ids]
        if len(ids) >= self.max_context:
            raise InputRejected(f"the prompt is {len(ids)} tokens; {self.name} holds {self.max_context} "
                                "(prompt + output): shorten it")
        return ids  # type: ignore[no-any-return]

    def token_text(self, token: int) -> str:
        """One token's text alone (a special token shows as itself): what ``/generate`` streams."""
        text = self._texts.get(token)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if token in self._special or piece is None:
                text = str(piece)
            elif self._wordpiece:
                text = piece[2:] if piece.startswith("##") else " " + piece  # "##ing" continues a word
            else:
                text = self.tokenizer.decode([token])
                if piece.startswith("\u2581") and not text.startswith(" "):  # SentencePiece's word start
                    text = " " + text
            self._texts[token] = text
        return text

    def text(self, tokens: list[int]) -> str:
        """The tokens' text, special tokens left out, as ``tokenizer.decode`` gives it. Two of these a token
        (``engine.output.Detokenizer``): where the tokenizer tidies no spaces, its Rust decode is called directly,
        which is all transformers' ``decode`` then does, without its ~2 us of Python around it."""
        if self._rust_decode is not None:
            return self._rust_decode(tokens, skip_special_tokens=True)  # type: ignore[no-any-return]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[no-any-return]

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes: a byte-level BPE piece (GPT-2, Llama 3, Qwen, SmolLM) may be part of a character,
        which its text shows as U+FFFD; other tokenizers' pieces are whole characters (their text, in UTF-8)."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token not in self._special and isinstance(piece, str) and self._byte_level:
            table = _byte_values()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.token_text(token).encode()


class PagedLM(TokenizerText):
    """A GenModel over a transformers causal LM's weights, run by ``_forward`` over a ``PagedKV`` pool.

    A subclass sets the family's shape (``layers``, ``kv_heads``, ``head_dim``) before calling
    this ``__init__`` and writes ``_forward``; the LM head may be tied to the embeddings.
    """

    paged = True  # the step engine can run it (TransformersOnly: only gen-hf-cb)
    scores = True  # gives log-probabilities when a chunk's sampling asks (Sampling.logprobs)
    kv_portable = True  # export_kv / import_kv below
    family = ""

    def __init__(self, name: str, hf_model: Any, tokenizer: Any, *, layers: int, kv_heads: int, head_dim: int,
                 max_context: int, eos_id: int | None, note: str | None = None, start_id: int | None = None) -> None:
        self.name, self.note = name, note
        self.max_context = max_context
        super().__init__(tokenizer, start_id)
        self.hf_model = hf_model  # also driven by labserver.engine.hfcb (transformers' own scheduler)
        self.eos_id = eos_id
        self.eos_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)  # every token that ends an answer
        self._live: set[int] = set()  # sequences prefilled and not released
        self._head = hf_model.get_output_embeddings()  # (found once: _logits runs every step)
        weight = self._head.weight
        self._head_proj = Dense(self._head)  # its dtype's layout (an embedding tied to it reads its rows)
        self.kv = PagedKV(layers, kv_heads, head_dim, weight.device, weight.dtype)
        self.costs: Costs | None = None  # set a Costs to time every call's parts (a benchmark's breakdown)
        self.graphs: Any = None  # a DecodeGraphs: decode-only calls replayed by bucket (labserver.models.graphs)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV memory one position holds: layers x 2 (K and V) x KV heads x head size x dtype size."""
        return self.kv.bytes_per_token

    @property
    def device(self) -> str:
        return str(self.kv.device)

    # -- the forward pass: the family's ---------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: CallPlan) -> torch.Tensor:
        """[tokens] ids at their positions -> final hidden states [tokens, width]; attention through ``self.kv``."""
        raise NotImplementedError

    def projections(self) -> list[Any]:
        """Every layer's projection objects (``labserver.models.linear``), in call order."""
        return []

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head_proj(hidden)  # (tied to the embeddings in GPT-2, SmolLM2 and the small Qwens)

    # -- the two steps (one computation: a decode is a chunk of one token) ------------------
    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        self.kv.allocate(blocks, block_tokens, spare=self.graphs is not None)
        self._live.clear()
        if self.graphs is not None:
            self.graphs.clear()  # (their steps read and wrote the pool just replaced)

    def use_graphs(self, graphs: Any) -> Any:
        """Decode-only calls through ``graphs`` from now on (``labserver.models.graphs.use_cuda_graphs``); the pool
        is made again with its scratch block, so only before any sequence is computed."""
        if self._live:
            raise ModelError(f"{len(self._live)} sequences hold the pool; turn graphs on before the first call")
        self.graphs = graphs
        self.kv.allocate(self.kv.blocks, self.kv.block_tokens, spare=True)
        return graphs

    @torch.inference_mode()
    def logits(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute the chunks; the next-token scores [chunks that sample, vocab], in call order."""
        return self._logits(self._hidden(chunks)[0])

    def _hidden(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Compute the chunks: the final hidden state of each sampling chunk's last token (a verifying chunk's last
        draft + 1) [rows that choose, width], and for each chunk with tokens to ``score`` the states of its rows that
        predict them."""
        for c in chunks:
            if not c.tokens or c.start < 0 or c.end > self.max_context:
                raise ModelError(f"sequence {c.sid}: positions {c.start}..{c.end - 1} are not within the model's "
                                 f"{self.max_context} (the context limit)")
            if len(c.score) > len(c.tokens) or not 0 <= c.draft < len(c.tokens):
                raise ModelError(f"sequence {c.sid}: {len(c.score)} tokens to score and {c.draft} guesses to verify "
                                 f"in {len(c.tokens)} positions")
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.hidden(chunks), []
        dev = self.kv.device
        plan = self.kv.plan(chunks)
        ids = torch.tensor([t for c in chunks for t in c.tokens], device=dev)
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.end)], device=dev)
        hidden = self._forward(ids, positions, plan)
        starts = [z - len(c.tokens) for c, z in zip(chunks, itertools.accumulate(len(c.tokens) for c in chunks),
                                                     strict=True)]
        last = torch.tensor([r for c, a in zip(chunks, starts, strict=True) if c.sample  # (none: all prompt pieces)
                             for r in range(a + len(c.tokens) - 1 - c.draft, a + len(c.tokens))],
                            dtype=torch.long, device=dev)  # a verifying chunk's last draft + 1 rows, in order
        scored = [hidden[a:a + len(c.score)] for c, a in zip(chunks, starts, strict=True) if c.score]
        return hidden.index_select(0, last), scored

    @torch.inference_mode()
    def _choose(self, chunks: list[Chunk]) -> list[int | Scored | Verified | None]:
        start = time.perf_counter()
        last, scored = self._hidden(chunks)
        scores = self._logits(last)
        picked = [c for c in chunks if c.sample]
        positions = [p for c in picked for p in range(c.end - c.draft, c.end + 1)]  # (one per row: its seed's)
        apply_masks(scores, [c.grammar for c in picked for _ in range(c.draft + 1)])  # (a grammar's: before choosing)
        chosen = choose(scores, positions, [c.sampling for c in picked for _ in range(c.draft + 1)], self.eos_ids)
        self._live.update(c.sid for c in chunks)
        outs: list[int | Scored | Verified | None] = []
        tokens, rows, prompts = iter(chosen), iter(range(len(chosen))), iter(scored)
        for c in chunks:
            k = c.sampling.logprobs if c.sampling else None
            if c.draft and c.sample:  # a verification: every row's choice, in order
                mine = [next(rows) for _ in range(c.draft + 1)]
                picks = [next(tokens) for _ in mine]
                logprobs = () if k is None else tuple(logprobs_of(scores[mine[0]:mine[-1] + 1], picks, k))
                outs.append(Verified(tuple(picks), logprobs))
                continue
            token, row = (next(tokens), next(rows)) if c.sample else (None, None)
            if k is None and not c.score:
                outs.append(token)
                continue
            mine = None if k is None or row is None else logprobs_of(scores[row:row + 1], [token], k)[0]
            prompt = logprobs_of(self._logits(next(prompts)), c.score,
                                 (c.sampling.prompt_logprobs if c.sampling else None) or 0) if c.score else []
            outs.append(Scored(token, mine, tuple(prompt)))
        if self.costs:
            self.costs.add_call(time.perf_counter() - start, len(picked), decode=all(c.decode for c in chunks))
        return outs

    def forward(self, chunks: list[Chunk]) -> list[int | Scored | Verified | None]:
        for c in chunks:
            if c.decode and c.sid not in self._live:
                raise ModelError(f"decode of sequence {c.sid}, which has no cache (never prefilled or released)")
        return self._choose(chunks) if chunks else []

    def release(self, seq_ids: list[int]) -> None:
        self._live.difference_update(seq_ids)

    # -- the hand-over between replicas (labserver.engine.handover) ------------------------------------
    @torch.inference_mode()
    def export_kv(self, table: Sequence[int], positions: int) -> Any:
        """A copy of the KV of a sequence's first ``positions`` positions (``PagedKV.gather``): a numpy array on the
        CPU (Ray moves those without copying them; bfloat16's bits as int16, which numpy lacks)."""
        kv = self.kv.gather(table, positions).cpu()
        return (kv.view(torch.int16) if kv.dtype == torch.bfloat16 else kv).numpy()

    @torch.inference_mode()
    def import_kv(self, sid: int, table: Sequence[int], start: int, end: int, kv: Any) -> None:
        """Write positions start..end - 1 of ``sid`` from a copy ``export_kv`` made (another replica's): from now on
        the sequence holds its cache as if it had been prefilled here."""
        with warnings.catch_warnings():  # (Ray hands the copy over read-only; it is only read)
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.as_tensor(kv)
        if kv.dtype == torch.int16:  # (bfloat16's bits)
            kv = kv.view(torch.bfloat16)
        self.kv.scatter(table, start, end, kv)
        self._live.add(sid)

    @property
    def cached(self) -> int:
        """Sequences the engine has not released (a leak shows here)."""
        return len(self._live)


class TransformersOnly(TokenizerText):
    """A causal LM folder of an architecture with no forward pass here: text, and transformers' model.

    ``gen-hf-cb`` serves it (transformers' manager runs the model); the step engine cannot
    and says so at startup.
    """

    paged = False
    scores = False  # (gen-hf-cb: transformers' manager gives none)
    kv_portable = False
    note = None

    def __init__(self, name: str, hf_model: Any, tokenizer: Any, *, max_context: int, eos_id: int | None,
                 why: str) -> None:
        self.name, self.max_context, self.eos_id, self.why = name, max_context, eos_id, why
        self.eos_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        super().__init__(tokenizer)
        self.hf_model = hf_model
        self.device = str(next(hf_model.parameters()).device)
        try:
            self.kv_bytes_per_token = kv_bytes_per_token(hf_model.config, next(hf_model.parameters()).element_size())
        except (TypeError, ValueError, KeyError, ZeroDivisionError):  # a config in names it does not know
            self.kv_bytes_per_token = 0

    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        raise ModelError(self.why)

    def forward(self, chunks: list[Chunk]) -> list[int | Scored | None]:
        raise ModelError(self.why)

    def release(self, seq_ids: list[int]) -> None:
        pass
