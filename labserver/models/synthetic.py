"""Synthetic models: a known cost and no compute, for strategy tests and lessons.

- ``synthetic:BASE_MS+PER_ITEM_MS`` (an encoder): blocks the calling thread for
  BASE + n*PER_ITEM ms on a batch of n (``time.sleep`` releases the GIL, as real
  kernels do). An input containing ``__poison__`` raises inside the model. Options
  after ``?`` (joined by ``&``): ``oom_above=N`` raises ``OutOfMemory`` for batches bigger
  than N; ``per_token=MS`` adds MS per *padded* token, n x the longest text's tokens, as a
  real encoder pays for padding (a text's tokens: its words + 2, a BERT tokenizer's count
  of the built-in words with [CLS] and [SEP]).
- ``echo``: no compute at all; returns each input's length.
- ``synthetic-gen:PREFILL_MS+STEP_MS`` (a generator): a prefill call blocks PREFILL_MS
  (+ ``per_token`` ms per token in the call), a decode step STEP_MS (+ ``per_seq`` ms per
  sequence in the step): by default a step costs the same for 1 sequence or 64, the
  memory-bound regime where batching decode steps is free. It keeps a KV pool of blocks as
  the real models do, but what it stores at a position is a running signature of every token
  up to it, read back through the block table: the next token is a function of the whole
  context, so a wrong block table, a bad shared prefix or a lost token changes the output.
  A prompt containing ``__poison__`` fails its prefill; ``eos_after=N`` ends every sequence
  after N tokens unless the request says ``ignore_eos``. It keeps no log of its calls
  (a server runs it for hours; ``tests/fakes.CallLog`` logs them for a test).
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import POISON, Chunk, InputRejected, ModelError, OutOfMemory, Verified, position_seed

__all__ = ["Echo", "Synthetic", "SyntheticGen", "parse_synthetic", "parse_synthetic_gen"]


@dataclass
class Echo:
    name: str = "echo"
    max_chars: int | None = None
    max_tokens = None  # (no tokens: it reads characters)

    def __call__(self, texts: list[str]) -> list[Any]:
        return [{"chars": len(t)} for t in texts]

    def check(self, text: str) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [0] * len(texts)  # (it cannot say)


@dataclass
class Synthetic:
    """Blocks for base_ms + n * per_item_ms per call: a model with a known cost."""

    base_ms: float
    per_item_ms: float
    oom_above: int | None = None  # batches larger than this raise OutOfMemory
    per_token_ms: float = 0.0  # cost per padded token: n x the longest text's tokens
    name: str = ""
    max_chars: int | None = None
    max_tokens = None  # (its "tokens" are words, uncut)
    calls: int = field(default=0, repr=False)  # batches computed, for tests
    items: int = field(default=0, repr=False)  # items computed, for tests

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"synthetic:{self.base_ms:g}+{self.per_item_ms:g}"
            if self.per_token_ms:
                self.name += f"?per_token={self.per_token_ms:g}"

    def cost_ms(self, n: int, longest: int = 0) -> float:
        """A batch of ``n`` texts whose longest has ``longest`` tokens."""
        return self.base_ms + n * self.per_item_ms + n * longest * self.per_token_ms

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(t.split()) + 2 for t in texts]

    def __call__(self, texts: list[str]) -> list[Any]:
        if self.oom_above is not None and len(texts) > self.oom_above:
            raise OutOfMemory(f"batch of {len(texts)} > {self.oom_above} does not fit")
        longest = max(self.count_tokens(texts)) if self.per_token_ms else 0
        time.sleep(self.cost_ms(len(texts), longest) / 1000)
        self.calls += 1
        self.items += len(texts)
        for t in texts:
            if POISON in t:
                raise ModelError("poisoned input")
        return [{"chars": len(t)} for t in texts]

    def check(self, text: str) -> None:
        pass


_SYNTHETIC = re.compile(r"^synthetic:(?P<base>[0-9.]+)\+(?P<per>[0-9.]+)(?:\?(?P<opts>.*))?$")


def parse_synthetic(spec: str) -> Synthetic:
    m = _SYNTHETIC.match(spec)
    if not m:
        raise ValueError(
            f"bad synthetic spec {spec!r}: use synthetic:BASE_MS+PER_ITEM_MS, e.g. synthetic:10+0"
        )
    opts = dict(kv.split("=", 1) for kv in m["opts"].split("&")) if m["opts"] else {}
    unknown = set(opts) - {"oom_above", "per_token"}
    if unknown:
        raise ValueError(f"unknown synthetic option(s) {sorted(unknown)}; known: oom_above, per_token")
    oom = int(opts["oom_above"]) if "oom_above" in opts else None
    per_token = float(opts.get("per_token", 0.0))
    if per_token < 0:
        raise ValueError(f"synthetic per_token must be >= 0 ms, got {per_token}")
    return Synthetic(float(m["base"]), float(m["per"]), oom_above=oom, per_token_ms=per_token)


POISONED = 50_001  # the token encode() appends to a poisoned prompt (outside the words' range: never generated)
_MOD = (1 << 61) - 1


@dataclass
class SyntheticGen:
    """A generator with a known cost per call and no compute: for strategy tests and lessons."""

    prefill_ms: float  # per prefill call
    step_ms: float  # per decode step
    per_token_ms: float = 0.0  # prefill: extra per token in the call
    per_seq_ms: float = 0.0  # decode: extra per sequence in the step
    eos_after: int | None = None  # every sequence emits EOS as its N-th token (None: never)
    max_context: int = 4096
    right: float = 1.0  # greedy: the context's token with this probability, else another (drawn per position and
    #   context): a draft model whose guesses a synthetic target keeps at an acceptance rate of ``right``
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)  # a virtual clock swaps this
    name: str = ""
    note: str | None = "synthetic: no model runs; tokens are placeholders"
    eos_id: int | None = 0
    kv_bytes_per_token: int = 0  # what a position would hold (a real model's, from its config): 0 says nothing
    vocab_size = POISONED + 1  # EOS, the words' 50,000 tokens, the poisoned one
    paged = True  # the step engine runs it
    kv_portable = True  # its signatures copy out and in (export_kv, import_kv)
    device = "cpu"
    tokenizer = None  # (words are tokens: no chat template of its own)
    scores = False  # no log-probabilities: it computes nothing

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return () if self.eos_id is None else (self.eos_id,)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"synthetic-gen:{self.prefill_ms:g}+{self.step_ms:g}"
        self._live: set[int] = set()  # sequences prefilled and not released
        self.allocate_kv(0, 16)

    # -- text <-> tokens: word n of the vocabulary is token n + 1 (0 is EOS) ------------------
    def encode(self, prompt: str) -> list[int]:
        words = prompt.split()
        if not words:
            raise InputRejected("the prompt has no words")
        return [1 + zlib.crc32(w.encode()) % 50_000 for w in words] + ([POISONED] if POISON in prompt else [])

    def token_text(self, token: int) -> str:
        return "<eos>" if token == 0 else f" t{token}"

    def text(self, tokens: list[int]) -> str:
        return "".join(self.token_text(t) for t in tokens if t != 0)

    def token_bytes(self, token: int) -> bytes:
        return self.token_text(token).encode()

    def prefill_cost_ms(self, tokens: int) -> float:
        return self.prefill_ms + self.per_token_ms * tokens

    def step_cost_ms(self, n: int) -> float:
        return self.step_ms + self.per_seq_ms * n

    # -- the KV pool: one signature per position ----------------------------------------------
    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        self.blocks, self.block_tokens = blocks, block_tokens
        self.pool: dict[int, list[int | None]] = {}  # block -> the signature kept at each of its positions

    def _slot(self, chunk: Chunk, position: int) -> tuple[list[int | None], int]:
        i = position // self.block_tokens
        if i >= len(chunk.blocks) or not 0 <= chunk.blocks[i] < self.blocks:
            raise ModelError(f"sequence {chunk.sid}: position {position} has no block in {list(chunk.blocks)} "
                             f"(pool of {self.blocks})")
        return self.pool.setdefault(chunk.blocks[i], [None] * self.block_tokens), position % self.block_tokens

    def _run(self, chunk: Chunk) -> list[int]:
        """Write the chunk's signatures, each from the one before it (read through the table); return them."""
        signature = 0
        if chunk.start:
            block, offset = self._slot(chunk, chunk.start - 1)
            if block[offset] is None:
                raise ModelError(f"sequence {chunk.sid}: position {chunk.start - 1} was never computed")
            signature = block[offset]  # type: ignore[assignment]
        signatures = []
        for p, token in enumerate(chunk.tokens, chunk.start):
            signature = (signature * 1_000_003 + token + 1) % _MOD
            block, offset = self._slot(chunk, p)
            block[offset] = signature
            signatures.append(signature)
        return signatures

    # -- the call: a decode step costs step_cost_ms, any call with prompt tokens prefill_cost_ms ------------
    def forward(self, chunks: list[Chunk]) -> list[int | Verified | None]:
        decode = all(c.decode for c in chunks)  # (a verification of k guesses costs as k + 1 decoding sequences)
        self.sleep((self.step_cost_ms(sum(c.draft + 1 for c in chunks)) if decode else
                    self.prefill_cost_ms(sum(len(c.tokens) for c in chunks))) / 1000)
        if not decode and any(POISONED in c.tokens for c in chunks):
            raise ModelError("poisoned prompt")
        for c in chunks:
            if c.decode and c.sid not in self._live:
                raise ModelError(f"decode of sequence {c.sid}, which has no cache (never prefilled or released)")
        out: list[int | Verified | None] = []
        for c in chunks:
            signatures = self._run(c)
            if c.draft and c.sample:  # a token after each of the last draft + 1 positions
                out.append(Verified(tuple(self._token(c, p, sig) for p, sig in
                                          zip(range(c.end - c.draft, c.end + 1), signatures[-1 - c.draft:]))))
            else:
                out.append(self._token(c, c.end, signatures[-1]) if c.sample else None)
        self._live.update(c.sid for c in chunks)
        return out

    def release(self, seq_ids: list[int]) -> None:
        self._live.difference_update(seq_ids)

    def export_kv(self, table: Sequence[int], positions: int) -> list[int]:
        """The signatures of a sequence's first ``positions`` positions (what a hand-over carries)."""
        chunk = Chunk(0, (), 0, table)
        out = []
        for p in range(positions):
            block, offset = self._slot(chunk, p)
            if block[offset] is None:
                raise ModelError(f"position {p} was never computed")
            out.append(block[offset])
        return out  # type: ignore[return-value]

    def import_kv(self, sid: int, table: Sequence[int], start: int, end: int, kv: Sequence[int]) -> None:
        """Write positions start..end - 1 of ``sid`` from ``export_kv``'s signatures."""
        if len(kv) < end:
            raise ModelError(f"a hand-over of {len(kv)} positions does not hold positions 0..{end - 1}")
        chunk = Chunk(sid, (), 0, table)
        for p in range(start, end):
            block, offset = self._slot(chunk, p)
            block[offset] = kv[p]
        self._live.add(sid)

    def _token(self, chunk: Chunk, position: int, signature: int) -> int:
        """The token after ``position`` tokens: greedy, a word picked by the context's signature; sampled, a word
        drawn per position (seeded: reproducible)."""
        s = chunk.sampling
        generated = position - chunk.prompt_len + 1  # its number among the generated tokens
        if self.eos_after is not None and generated >= self.eos_after and (s is None or position >= s.eos_from):
            return 0
        if s is None or s.greedy:
            token = 1 + signature % 50_000
            if self.right < 1.0 and random.Random(signature ^ position).random() >= self.right:
                return 1 + token % 50_000  # (another word: a wrong guess)
            return token
        draw = random.Random(position_seed(s.seed, position)) if s.seed is not None else random
        return 1 + draw.randrange(50_000)

    @property
    def cached(self) -> int:
        """Sequences the engine has not released (a leak shows here)."""
        return len(self._live)


_SYNTHETIC_GEN = re.compile(r"^synthetic-gen:(?P<prefill>[0-9.]+)\+(?P<step>[0-9.]+)(?:\?(?P<opts>.*))?$")
_OPTIONS: dict[str, Callable[[str], Any]] = {"per_token": float, "per_seq": float, "eos_after": int,
                                             "max_context": int, "right": float, "kv_bytes": int}


def parse_synthetic_gen(spec: str) -> SyntheticGen:
    m = _SYNTHETIC_GEN.match(spec)
    if not m:
        raise ValueError(f"bad spec {spec!r}: use synthetic-gen:PREFILL_MS+STEP_MS, e.g. synthetic-gen:20+5")
    opts = dict(kv.split("=", 1) for kv in m["opts"].split("&")) if m["opts"] else {}
    unknown = set(opts) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown synthetic-gen option(s) {sorted(unknown)}; known: {', '.join(_OPTIONS)}")
    names = {"per_token": "per_token_ms", "per_seq": "per_seq_ms", "kv_bytes": "kv_bytes_per_token"}
    kwargs = {names.get(k, k): _OPTIONS[k](v) for k, v in opts.items()}
    return SyntheticGen(float(m["prefill"]), float(m["step"]), **kwargs)
