"""Model specs -> model objects, for both kinds: encoders and generators.

A spec is a short string:

=================================  ========  =============================================
spec                               kind      what (module)
=================================  ========  =============================================
``minilm`` (default)               encode    the embedded all-MiniLM-L6-v2 (``encoders``)
``bert-base-random``               encode    the guide's BERT shape, random weights (``encoders``)
a hub id or folder                 encode    any transformers pipeline (``encoders``)
``synthetic:BASE+PER``, ``echo``   encode    known cost, no compute (``synthetic``)
``gpt2-random``                    generate  GPT-2 small's shape, random weights (``gpt2``)
``gpt2-tiny-random``               generate  2 layers, 64 wide: for tests (``gpt2``)
``synthetic-gen:PREFILL+STEP``     generate  known cost, no compute (``synthetic``)
=================================  ========  =============================================

``load_model(spec)`` loads either kind; the protocols both kinds follow and the errors
are in ``labserver.models.base``. Nothing here knows HTTP or strategies; torch and
transformers are imported only when a real model is built, so the synthetic models work
(and test) without them. Nothing downloads a model unless a hub id is named.
"""

from __future__ import annotations

from .base import (GREEDY, MEANINGLESS, POISON, Chunk, GenModel, InputRejected, Model, ModelError, ModelLoadError,
                   OutOfMemory, Sampling, minilm_dir, pick_device, pick_dtype)
from .synthetic import (
    Echo,
    Synthetic,
    SyntheticGen,
    parse_synthetic,
    parse_synthetic_gen,
)

__all__ = ["GEN_SPECS", "GREEDY", "MEANINGLESS", "POISON", "Chunk", "Echo", "GenModel", "InputRejected", "Model",
           "ModelError", "ModelLoadError", "OutOfMemory", "Sampling", "Synthetic", "SyntheticGen", "kind_of",
           "load_model", "minilm_dir", "parse_synthetic", "parse_synthetic_gen", "pick_device", "pick_dtype"]

GEN_SPECS = ("gpt2-random", "gpt2-tiny-random", "synthetic-gen:PREFILL_MS+STEP_MS")


def kind_of(spec: str) -> str:
    """"generate" for a generator's spec, "encode" for anything else."""
    return "generate" if spec.startswith("synthetic-gen") or spec in ("gpt2-random", "gpt2-tiny-random") else "encode"


def load_model(spec: str = "minilm", *, device: str = "auto", dtype: str = "auto", task: str | None = None,
               kind: str | None = None) -> Model | GenModel:
    """Load the model a spec names, once. Raises ModelLoadError with what to do on failure.

    ``kind`` ("encode" or "generate"), when given, is checked against the spec before
    anything loads, so a generation server asked for an encoder fails at once.
    """
    if kind is not None and kind != kind_of(spec):
        if kind == "generate":
            raise ModelLoadError(f"{spec!r} is not a generative model; use one of: {', '.join(GEN_SPECS)}")
        raise ModelLoadError(f"{spec!r} is a generative model; an encoder strategy needs an encoder "
                             "(minilm, bert-base-random, synthetic:..., a hub id)")
    try:
        if spec == "echo":
            return Echo()
        if spec.startswith("synthetic-gen"):
            return parse_synthetic_gen(spec)
        if spec.startswith("synthetic"):
            return parse_synthetic(spec)
        if spec in ("gpt2-random", "gpt2-tiny-random"):
            from .gpt2 import gpt2_random

            return gpt2_random(tiny=spec == "gpt2-tiny-random", device=device, dtype=dtype)
        from .encoders import MiniLM, bert_base_random, from_hub_or_folder

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
