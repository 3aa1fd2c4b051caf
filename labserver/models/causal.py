"""Your own generator: a local folder of a transformers causal LM, served through the paged engine.

``--model PATH`` for any ``gen-*`` strategy names a folder with a ``config.json`` (or a
hub id, only when it is already in the local Hugging Face cache: nothing downloads). The
folder's config says the family, and the family says whose forward pass runs it:

=========  ====================================================  =========================
family     the folders (``model_type``)                          forward pass
=========  ====================================================  =========================
GPT-2      ``gpt2``: GPT-2, DistilGPT-2                          ``gpt2.GPT2Gen``
Llama      ``llama``: Llama 2 and 3, SmolLM, TinyLlama           ``llama.LlamaGen``
Qwen2      ``qwen2``: Qwen2, Qwen2.5                             ``llama.LlamaGen``
Qwen3      ``qwen3``: Qwen3 (dense)                              ``llama.LlamaGen``
Mistral    ``mistral``: Mistral 7B, Ministral                    ``llama.LlamaGen``
=========  ====================================================  =========================

Sliding-window attention (Mistral 7B v0.1, Qwen2 with ``use_sliding_window``) lets a token
see only the last ``sliding_window`` positions. The paged pool has no window, so such a
folder is served with its context cut to the window: no sequence is ever longer than it,
and within it a window hides nothing (the logits are transformers', tested). Any other
causal LM (or one of these with a feature the forward passes lack) is refused before its
weights load, with the architecture named and what runs instead: ``gen-hf-cb``,
transformers' own manager, serves it where transformers can (``load_folder(..., paged=False)``).

The folder's own tokenizer encodes prompts (as it does by default, its BOS included),
its chat template renders ``/v1/chat/completions``, and its EOS (from
``generation_config.json``, else the config, else the tokenizer; every one, when it lists
several) ends answers. ``labserver.models.folders.write_tiny`` writes small random folders
of each family for tests, lessons and anyone without weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .base import MEANINGLESS, ModelLoadError, pick_device, pick_dtype
from .configs import RANDOM_KEY  # (set in config.json by folders.write_tiny: answers say so)

logger = logging.getLogger(__name__)

__all__ = ["PAGED_FAMILIES", "causal_config", "load_folder", "refusal", "window"]

PAGED_FAMILIES = {"gpt2": "GPT-2", "llama": "Llama (Llama 2/3, SmolLM, TinyLlama)", "qwen2": "Qwen2 (Qwen2, Qwen2.5)",
                  "qwen3": "Qwen3 (dense)", "mistral": "Mistral"}
SUPPORTED = "; ".join(f"{k}: {v}" for k, v in PAGED_FAMILIES.items())


def _config_path(spec: str) -> Path | None:
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return folder / "config.json" if (folder / "config.json").is_file() else None
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        return None
    try:  # a hub id: only where the local cache already holds it
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(spec, "config.json")
    except Exception:  # (an id the hub library cannot parse is not a hub id)
        return None
    return Path(hit) if isinstance(hit, str) else None


def causal_config(spec: str) -> dict[str, Any] | None:
    """The config of the causal LM ``spec`` names on disk (a folder, or a cached hub id); None for anything else."""
    path = _config_path(spec)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    return config if causal or config.get("model_type") in PAGED_FAMILIES else None


def refusal(config: dict[str, Any]) -> str | None:
    """Why labserver's own forward passes cannot run this config (None: they can)."""
    kind = config.get("model_type")
    name = ", ".join(config.get("architectures") or []) or kind
    if kind not in PAGED_FAMILIES:
        return f"its architecture is {name} (model_type {kind!r})"
    if kind == "gpt2" and config.get("scale_attn_by_inverse_layer_idx"):
        return "it scales attention by the inverse layer index (scale_attn_by_inverse_layer_idx)"
    return None


def window(config: dict[str, Any]) -> int | None:
    """The sliding window some of its layers attend within (None: every layer sees every position)."""
    size = config.get("sliding_window")
    if config.get("model_type") == "mistral":
        return int(size) if size else None
    sliding = config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or [])
    return int(size) if sliding and size else None


def load_folder(spec: str, *, device: str = "auto", dtype: str = "auto", paged: bool = True,
                name: str | None = None) -> Any:
    """The generator a causal LM folder (or cached hub id) holds. Raises ModelLoadError with what to do.

    ``name``: what answers and logs call it (default: ``spec``; the embedded ``smollm2`` names its cache folder).

    ``paged`` (the step engine's strategies): a family without a forward pass here is refused
    before its weights load. ``paged=False`` (``gen-hf-cb``) loads any causal LM transformers
    can build, as ``TransformersOnly``.
    """
    config = causal_config(spec)
    if config is None:
        raise ModelLoadError(f"{spec!r} is not a folder (or cached hub id) with a causal LM's config.json")
    why = refusal(config)
    if why and paged:
        raise ModelLoadError(f"cannot serve {spec!r} through the paged engine: {why}. It runs these families "
                             f"({SUPPORTED}); --strategy gen-hf-cb serves other causal LMs through transformers' "
                             "own manager")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device)
    folder = Path(spec).expanduser()
    source = str(folder) if folder.is_dir() else spec  # a folder ("~/models/x" too), else the cached hub id
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        hf_model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=pick_dtype(dtype, dev))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {spec!r}: {e}") from e
    hf_model = hf_model.to(dev).eval()
    eos = _eos_ids(hf_model, tokenizer)
    context = config.get("n_positions") or config.get("max_position_embeddings") or 2048
    cut = window(config)
    if cut and cut < context:  # (a window as long as the context hides nothing)
        logger.warning("%s attends within a sliding window of %d positions: served with its context cut from %d "
                       "to %d, where the window hides nothing", spec, cut, context, cut)
        context = cut
    note = MEANINGLESS if config.get(RANDOM_KEY) else None
    if note:
        logger.warning("%s: %s", spec, note)
    first = eos[0] if eos else None
    name = name or spec
    if why:
        from .paged import TransformersOnly

        model: Any = TransformersOnly(name, hf_model, tokenizer, max_context=context, eos_id=first,
                                      why=f"{spec}: {why}")
    elif config["model_type"] == "gpt2":
        from .gpt2 import GPT2Gen

        model = GPT2Gen(name, hf_model, tokenizer, note=note, eos_id=first)
    else:
        from .llama import LlamaGen

        model = LlamaGen(name, hf_model, tokenizer, eos_id=first, max_context=context, note=note)
    model.eos_ids = tuple(eos)
    return model


def _eos_ids(hf_model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends an answer: generation_config's, else the config's, else the tokenizer's."""
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
