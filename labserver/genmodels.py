"""Generative model specs -> one object that prefills prompts and decodes one step at a time.

An encoder (``labserver.models``) turns a list of texts into a list of outputs in one
call. A generator cannot: each output token needs a forward pass over everything
before it, so the serving question becomes *which sequences share each step*. The
model therefore offers the two steps of generation separately, and the scheduler
(``labserver.generation`` with a strategy from ``labserver.genstrategies``) decides
who joins and who leaves between them:

- ``prefill([(seq_id, prompt_ids), ...])`` runs whole prompts, keeps their KV cache
  under ``seq_id``, and returns each sequence's first new token;
- ``decode([(seq_id, last_token), ...])`` runs *one* step for every sequence named
  (each may be at a different length) and returns each one's next token;
- ``release([seq_id, ...])`` frees their cache.

``prefill`` is all or nothing: if it raises, it holds no cache for any of the
sequences it was given (so the engine can split the batch and retry each half, as
``labserver.runner.run_isolating`` does for encoders).

Specs:

- ``synthetic-gen:PREFILL_MS+STEP_MS``: a fake with a known cost. A prefill call
  blocks PREFILL_MS (+ ``per_token`` ms per prompt token), a decode step STEP_MS
  (+ ``per_seq`` ms per sequence in the step): by default a step costs the same for
  1 sequence or 64, the memory-bound regime where batching decode steps is free.
  Tokens are words of the prompt's vocabulary; a prompt containing ``__poison__``
  fails its prefill; ``eos_after=N`` ends every sequence after N tokens unless the
  request says ``ignore_eos``. Every call is logged in ``calls`` (kind, seq ids).
- ``gpt2-random`` / ``gpt2-tiny-random``: see ``labserver.gpt2`` (GPT-2 with random
  weights and the bundled uncased vocabulary; real compute, meaningless text).

Nothing here knows HTTP or strategies. torch is imported only by ``labserver.gpt2``.
"""

from __future__ import annotations

import logging
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .models import POISON, InputRejected, ModelError, ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["GEN_SPECS", "GenModel", "SyntheticGen", "is_generative_spec", "load_gen_model", "parse_synthetic_gen"]

GEN_SPECS = ("gpt2-random", "gpt2-tiny-random", "synthetic-gen:PREFILL_MS+STEP_MS")


@runtime_checkable
class GenModel(Protocol):
    """What the generation engine needs from a model. Sequence ids are the engine's."""

    name: str
    note: str | None  # said in every answer (e.g. "random weights: ..."), None for a real model
    eos_id: int | None  # the token that ends a sequence early, unless the request ignores it
    max_context: int  # prompt + generated tokens one sequence may hold

    def encode(self, prompt: str) -> list[int]:
        """Prompt -> token ids, on the event loop (cheap). Raises InputRejected for a prompt it cannot take."""

    def token_text(self, token: int) -> str:
        """One token's text, as streamed."""

    def text(self, tokens: list[int]) -> str:
        """A whole output's text."""

    def prefill(self, seqs: list[tuple[int, list[int]]]) -> list[int]:
        """Run these prompts, keep their cache under their ids, return each one's first new token."""

    def decode(self, seqs: list[tuple[int, int]]) -> list[int]:
        """One step: each (seq_id, last token) -> its next token. Sequences may differ in length."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences' cache (unknown ids are ignored)."""


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
    def prefill(self, seqs: list[tuple[int, list[int]]]) -> list[int]:
        self.calls.append(("prefill", tuple(s for s, _ in seqs)))
        self.sleep(self.prefill_cost_ms(sum(len(p) for _, p in seqs)) / 1000)
        if any(p and p[-1] == 0 for _, p in seqs):  # encode() marks a poisoned prompt with a trailing 0
            raise ModelError("poisoned prompt")
        for sid, prompt in seqs:
            self._length[sid] = 1
            self._seed[sid] = prompt[-1]
        return [self._token(sid) for sid, _ in seqs]

    def decode(self, seqs: list[tuple[int, int]]) -> list[int]:
        self.calls.append(("decode", tuple(s for s, _ in seqs)))
        self.sleep(self.step_cost_ms(len(seqs)) / 1000)
        out = []
        for sid, _ in seqs:
            if sid not in self._length:
                raise ModelError(f"decode of sequence {sid}, which has no cache (never prefilled or released)")
            self._length[sid] += 1
            out.append(self._token(sid))
        return out

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._length.pop(sid, None)
            self._seed.pop(sid, None)

    def _token(self, sid: int) -> int:
        n = self._length[sid]
        if self.eos_after is not None and n >= self.eos_after:
            return 0
        return 1 + (self._seed[sid] + n) % 50_000

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


def is_generative_spec(spec: str) -> bool:
    return spec.startswith("synthetic-gen") or spec in ("gpt2-random", "gpt2-tiny-random")


def load_gen_model(spec: str, *, device: str = "auto", dtype: str = "auto") -> GenModel:
    """Load a generative model by spec. Raises ModelLoadError with what to do on failure."""
    try:
        if spec.startswith("synthetic-gen"):
            return parse_synthetic_gen(spec)
        if spec in ("gpt2-random", "gpt2-tiny-random"):
            from .gpt2 import gpt2_random

            return gpt2_random(tiny=spec == "gpt2-tiny-random", device=device, dtype=dtype)
    except ModelLoadError:
        raise
    except ImportError as e:
        raise ModelLoadError(f"cannot load {spec!r}: missing package ({e.name or e}); install it and retry") from e
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load {spec!r}: {e}") from e
    raise ModelLoadError(f"{spec!r} is not a generative model; use one of: {', '.join(GEN_SPECS)}")
