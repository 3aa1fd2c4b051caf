"""Synthetic models: a known cost and no compute, for strategy tests and lessons.

- ``synthetic:BASE_MS+PER_ITEM_MS`` (an encoder): blocks the calling thread for
  BASE + n*PER_ITEM ms on a batch of n (``time.sleep`` releases the GIL, as real
  kernels do). An input containing ``__poison__`` raises inside the model. Option
  after ``?``: ``oom_above=N`` raises ``OutOfMemory`` for batches bigger than N.
- ``echo``: no compute at all; returns each input's length.
- ``synthetic-gen:PREFILL_MS+STEP_MS`` (a generator): a prefill call blocks PREFILL_MS
  (+ ``per_token`` ms per prompt token), a decode step STEP_MS (+ ``per_seq`` ms per
  sequence in the step): by default a step costs the same for 1 sequence or 64, the
  memory-bound regime where batching decode steps is free. Tokens are words of the
  prompt's vocabulary; a prompt containing ``__poison__`` fails its prefill;
  ``eos_after=N`` ends every sequence after N tokens unless the request says
  ``ignore_eos``. Every call is logged in ``calls`` (kind, seq ids).
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import POISON, InputRejected, ModelError, OutOfMemory, Sampling, Samplings, position_seed

__all__ = ["Echo", "Synthetic", "SyntheticGen", "parse_synthetic", "parse_synthetic_gen"]


@dataclass
class Echo:
    name: str = "echo"
    max_chars: int | None = None

    def __call__(self, texts: list[str]) -> list[Any]:
        return [{"chars": len(t)} for t in texts]

    def check(self, text: str) -> None:
        pass


@dataclass
class Synthetic:
    """Blocks for base_ms + n * per_item_ms per call: a model with a known cost."""

    base_ms: float
    per_item_ms: float
    oom_above: int | None = None  # batches larger than this raise OutOfMemory
    name: str = ""
    max_chars: int | None = None
    calls: int = field(default=0, repr=False)  # batches computed, for tests
    items: int = field(default=0, repr=False)  # items computed, for tests

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"synthetic:{self.base_ms:g}+{self.per_item_ms:g}"

    def cost_ms(self, n: int) -> float:
        return self.base_ms + n * self.per_item_ms

    def __call__(self, texts: list[str]) -> list[Any]:
        if self.oom_above is not None and len(texts) > self.oom_above:
            raise OutOfMemory(f"batch of {len(texts)} > {self.oom_above} does not fit")
        time.sleep(self.cost_ms(len(texts)) / 1000)
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
    unknown = set(opts) - {"oom_above"}
    if unknown:
        raise ValueError(f"unknown synthetic option(s) {sorted(unknown)}; known: oom_above")
    oom = int(opts["oom_above"]) if "oom_above" in opts else None
    return Synthetic(float(m["base"]), float(m["per"]), oom_above=oom)


@dataclass
class SyntheticGen:
    """A generator with a known cost per call and no compute: for strategy tests and lessons."""

    prefill_ms: float  # per prefill call
    step_ms: float  # per decode step
    per_token_ms: float = 0.0  # prefill: extra per prompt token in the call
    per_seq_ms: float = 0.0  # decode: extra per sequence in the step
    eos_after: int | None = None  # every sequence emits EOS as its N-th token (None: never)
    max_context: int = 4096
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)  # a virtual clock swaps this
    name: str = ""
    note: str | None = "synthetic: no model runs; tokens are placeholders"
    eos_id: int | None = 0
    calls: list[tuple[str, tuple[int, ...]]] = field(default_factory=list, repr=False)  # (kind, seq ids)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"synthetic-gen:{self.prefill_ms:g}+{self.step_ms:g}"
        self._length: dict[int, int] = {}  # seq id -> tokens generated so far
        self._seed: dict[int, int] = {}  # seq id -> where its output starts in the vocabulary
        self._prompt: dict[int, int] = {}  # seq id -> prompt tokens (a token's position = prompt + generated before it)

    # -- text <-> tokens: word n of the vocabulary is token n + 1 (0 is EOS) ------------------
    def encode(self, prompt: str) -> list[int]:
        words = prompt.split()
        if not words:
            raise InputRejected("the prompt has no words")
        return [1 + zlib.crc32(w.encode()) % 50_000 for w in words] + ([0] if POISON in prompt else [])

    def token_text(self, token: int) -> str:
        return "<eos>" if token == 0 else f" t{token}"

    def text(self, tokens: list[int]) -> str:
        return "".join(self.token_text(t) for t in tokens if t != 0)

    def prefill_cost_ms(self, prompt_tokens: int) -> float:
        return self.prefill_ms + self.per_token_ms * prompt_tokens

    def step_cost_ms(self, n: int) -> float:
        return self.step_ms + self.per_seq_ms * n

    # -- the two steps --------------------------------------------------------------------
    def prefill(self, seqs: list[tuple[int, list[int]]], sampling: Samplings = None) -> list[int]:
        self.calls.append(("prefill", tuple(s for s, _ in seqs)))
        self.sleep(self.prefill_cost_ms(sum(len(p) for _, p in seqs)) / 1000)
        if any(p and p[-1] == 0 for _, p in seqs):  # encode() marks a poisoned prompt with a trailing 0
            raise ModelError("poisoned prompt")
        for sid, prompt in seqs:
            self._length[sid] = 1
            self._seed[sid] = prompt[-1]
            self._prompt[sid] = len(prompt)
        return [self._token(sid, s) for (sid, _), s in zip(seqs, sampling or [None] * len(seqs), strict=True)]

    def decode(self, seqs: list[tuple[int, int]], sampling: Samplings = None) -> list[int]:
        self.calls.append(("decode", tuple(s for s, _ in seqs)))
        self.sleep(self.step_cost_ms(len(seqs)) / 1000)
        out = []
        for (sid, _), s in zip(seqs, sampling or [None] * len(seqs), strict=True):
            if sid not in self._length:
                raise ModelError(f"decode of sequence {sid}, which has no cache (never prefilled or released)")
            self._length[sid] += 1
            out.append(self._token(sid, s))
        return out

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            for held in (self._length, self._seed, self._prompt):
                held.pop(sid, None)

    def _token(self, sid: int, sampling: Sampling | None = None) -> int:
        """Greedy: the next word after the prompt's last; sampled: a word drawn per position (seeded: reproducible)."""
        n = self._length[sid]
        position = self._prompt[sid] + n - 1  # tokens before this one
        if self.eos_after is not None and n >= self.eos_after and (sampling is None or position >= sampling.eos_from):
            return 0
        if sampling is None or sampling.greedy:
            return 1 + (self._seed[sid] + n) % 50_000
        draw = random.Random(position_seed(sampling.seed, position)) if sampling.seed is not None else random
        return 1 + draw.randrange(50_000)

    @property
    def cached(self) -> int:
        """Sequences holding cache now (a leak shows here)."""
        return len(self._length)


_SYNTHETIC_GEN = re.compile(r"^synthetic-gen:(?P<prefill>[0-9.]+)\+(?P<step>[0-9.]+)(?:\?(?P<opts>.*))?$")
_OPTIONS: dict[str, Callable[[str], Any]] = {"per_token": float, "per_seq": float, "eos_after": int,
                                             "max_context": int}


def parse_synthetic_gen(spec: str) -> SyntheticGen:
    m = _SYNTHETIC_GEN.match(spec)
    if not m:
        raise ValueError(f"bad spec {spec!r}: use synthetic-gen:PREFILL_MS+STEP_MS, e.g. synthetic-gen:20+5")
    opts = dict(kv.split("=", 1) for kv in m["opts"].split("&")) if m["opts"] else {}
    unknown = set(opts) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown synthetic-gen option(s) {sorted(unknown)}; known: {', '.join(_OPTIONS)}")
    kwargs = {("per_token_ms" if k == "per_token" else "per_seq_ms" if k == "per_seq" else k): _OPTIONS[k](v)
              for k, v in opts.items()}
    return SyntheticGen(float(m["prefill"]), float(m["step"]), **kwargs)
