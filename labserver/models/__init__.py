"""Model specs -> model objects, for both kinds: encoders and generators.

A spec is a short string:

=================================  ========  =============================================
spec                               kind      what (module)
=================================  ========  =============================================
``minilm`` (default)               encode    the embedded all-MiniLM-L6-v2 (``encoders``)
``bert-base-random``               encode    the guide's BERT shape, random weights (``encoders``)
a hub id or folder                 encode    any transformers pipeline (``encoders``)
``synthetic:BASE+PER``, ``echo``   encode    known cost, no compute (``synthetic``)
``smollm2`` (default)              generate  the embedded SmolLM2-135M-Instruct (``smollm2``)
``gpt2-random``                    generate  GPT-2 small's shape, random weights (``gpt2``)
``gpt2-tiny-random``               generate  2 layers, 64 wide: for tests (``gpt2``)
a causal LM folder                 generate  GPT-2, Llama, Qwen2: your own (``causal``)
``synthetic-gen:PREFILL+STEP``     generate  known cost, no compute (``synthetic``)
=================================  ========  =============================================

``MODELS`` is the registry (a name or pattern -> its kind and loader, as ``STRATEGIES`` is
for rules): ``register_model`` adds one, ``kind_of(spec)`` says what a spec is without
loading it, ``load_model(spec)`` loads either kind. The protocols both kinds follow and
the errors are in ``labserver.models.base``. Nothing here knows HTTP or strategies; torch and
transformers are imported only when a real model is built, so the synthetic models work
(and test) without them. Nothing downloads a model unless a hub id is named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import (GREEDY, MEANINGLESS, POISON, Chunk, GenModel, InputRejected, Logprob, Model, ModelError,
                   ModelLoadError, OutOfMemory, Sampling, Scored, Verified, minilm_dir, pick_device, pick_dtype)
from .cpu import keep_freed_memory, no_core_spare, on_fresh_thread, release_openmp_threads
from .synthetic import (
    Echo,
    Synthetic,
    SyntheticGen,
    parse_synthetic,
    parse_synthetic_gen,
)

__all__ = ["DEFAULT_MODELS", "GREEDY", "MEANINGLESS", "MODELS", "POISON", "Chunk", "Echo", "GenModel",
           "InputRejected", "Logprob", "Model", "ModelError", "ModelLoadError", "ModelSpec", "OutOfMemory", "Sampling",
           "Scored", "Synthetic", "Verified",
           "SyntheticGen", "find_spec", "keep_freed_memory", "kind_of", "load_model", "minilm_dir", "model_names",
           "no_core_spare", "on_fresh_thread", "parse_synthetic", "parse_synthetic_gen", "pick_device", "pick_dtype",
           "register_model", "release_openmp_threads"]

Loader = Callable[..., Any]  # (spec, device=, dtype=, task=) -> the model


@dataclass(frozen=True)
class ModelSpec:
    """A family of specs: which strings it answers, what kind of model it loads, and how."""

    name: str  # as the docs and errors show it: "gpt2-random", "synthetic-gen:PREFILL_MS+STEP_MS"
    kind: str  # "encode" | "generate"
    matches: Callable[[str], bool]
    load: Loader


MODELS: list[ModelSpec] = []  # the registry, most specific first; a hub id or folder (encoders) is the last resort
DEFAULT_MODELS = {"encode": "minilm", "generate": "smollm2"}  # what a strategy of each kind gets unasked


def register_model(name: str, kind: str, matches: Callable[[str], bool] | None = None) -> Callable[[Loader], Loader]:
    """Register a loader for the specs ``matches`` accepts (by default: exactly ``name``)."""
    def add(load: Loader) -> Loader:
        MODELS.append(ModelSpec(name, kind, matches or (lambda spec: spec == name), load))
        return load
    return add


def find_spec(spec: str) -> ModelSpec:
    """The registered family a spec belongs to (any other string is an encoder from a hub id or folder)."""
    return next((m for m in MODELS if m.matches(spec)), _HUB)


def kind_of(spec: str) -> str:
    """"generate" for a generator's spec, "encode" for anything else: asked of the registry, nothing loads."""
    return find_spec(spec).kind


def model_names(kind: str | None = None) -> list[str]:
    """Registered model names (of one kind, or all): what errors and the CLI offer."""
    return [m.name for m in MODELS if kind is None or m.kind == kind] + (["a hub id or folder"] if kind != "generate"
                                                                       else [])


def load_model(spec: str = "minilm", *, device: str = "auto", dtype: str = "auto", task: str | None = None,
               kind: str | None = None, paged: bool = True) -> Model | GenModel:
    """Load the model a spec names, once. Raises ModelLoadError with what to do on failure.

    ``kind`` ("encode" or "generate"), when given, is checked against the spec before
    anything loads, so a generation server asked for an encoder fails at once. ``paged``
    False (``gen-hf-cb``): a causal LM folder of a family with no forward pass here loads
    anyway, for transformers' own manager to run.
    """
    family = find_spec(spec)
    if kind is not None and kind != family.kind:
        if kind == "generate":
            raise ModelLoadError(f"{spec!r} is not a generative model labserver can load; use one of: "
                                 f"{', '.join(model_names(kind))}. A hub id counts only once the local Hugging Face "
                                 "cache holds it (nothing downloads at run time): download it first, or write a tiny "
                                 "random folder (labserver tiny-model llama FOLDER)")
        raise ModelLoadError(f"{spec!r} is a generative model; an encoder strategy needs an encoder "
                             f"({', '.join(model_names('encode'))})")
    keep_freed_memory()  # (once per process: torch's freed tensors stay for reuse, no page faults per op)
    try:  # (built on a thread that ends: no OpenMP team is left behind to slow the model thread)
        extra = {} if family is not _FOLDER else {"paged": paged}
        return on_fresh_thread(lambda: family.load(spec, device=device, dtype=dtype, task=task, **extra))
    except ModelLoadError:
        raise
    except ImportError as e:
        raise ModelLoadError(f"cannot load {spec!r}: missing package ({e.name or e}); install it and retry") from e
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # KeyError: transformers' unknown task
        raise ModelLoadError(f"cannot load {spec!r}: {e}") from e


# -- the models labserver knows (torch and transformers are imported only when one of them loads) --------

@register_model("minilm", "encode")
def _minilm(spec: str, *, device: str, dtype: str, task: str | None) -> Model:
    from .encoders import MiniLM

    return MiniLM(device=device, dtype=dtype)


@register_model("bert-base-random", "encode")
def _bert(spec: str, *, device: str, dtype: str, task: str | None) -> Model:
    from .encoders import bert_base_random

    return bert_base_random(device=device, dtype=dtype)


@register_model("echo", "encode")
def _echo(spec: str, **_: Any) -> Model:
    return Echo()


@register_model("smollm2", "generate")
def _smollm2(spec: str, *, device: str, dtype: str, task: str | None) -> GenModel:
    from .causal import load_folder
    from .smollm2 import NAME, folder

    return load_folder(str(folder()), device=device, dtype=dtype, name=NAME)  # type: ignore[no-any-return]


@register_model("smollm2-q4", "generate")
def _smollm2_q4(spec: str, *, device: str, dtype: str, task: str | None) -> GenModel:
    from .smollm2 import load_q4

    return load_q4(device)  # type: ignore[no-any-return]


@register_model("gpt2-tiny-random", "generate")
@register_model("gpt2-random", "generate")
def _gpt2(spec: str, *, device: str, dtype: str, task: str | None) -> GenModel:
    from .gpt2 import gpt2_random

    return gpt2_random(tiny=spec == "gpt2-tiny-random", device=device, dtype=dtype)  # type: ignore[return-value]


@register_model("synthetic-gen:PREFILL_MS+STEP_MS", "generate", lambda spec: spec.startswith("synthetic-gen"))
def _synthetic_gen(spec: str, **_: Any) -> GenModel:
    return parse_synthetic_gen(spec)  # type: ignore[return-value]


@register_model("synthetic:BASE_MS+PER_MS", "encode", lambda spec: spec.startswith("synthetic"))
def _synthetic(spec: str, **_: Any) -> Model:
    return parse_synthetic(spec)


def _folder(spec: str, *, device: str, dtype: str, task: str | None, paged: bool = True) -> GenModel:
    from .causal import load_folder

    return load_folder(spec, device=device, dtype=dtype, paged=paged)  # type: ignore[no-any-return]


def _is_causal_folder(spec: str) -> bool:
    from .causal import causal_config  # (no torch: reads a config.json)

    return causal_config(spec) is not None


# a folder (or cached hub id) of a causal LM: asked first, since a folder on disk is the most specific name
_FOLDER = ModelSpec("a causal LM folder (gpt2, llama, qwen2, qwen3, mistral)", "generate", _is_causal_folder, _folder)
MODELS.insert(0, _FOLDER)


def _hub(spec: str, *, device: str, dtype: str, task: str | None) -> Model:
    from .encoders import from_hub_or_folder

    return from_hub_or_folder(spec, task, device, dtype)


_HUB = ModelSpec("a hub id or folder", "encode", lambda spec: True, _hub)
