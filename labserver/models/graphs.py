"""Decode steps taken over from the eager forward: replayed from CUDA graphs on a GPU, or compiled.

``DecodeGraphs`` (``--cuda-graphs``, a GPU): each step shape captured once, then a step is one
copy in and one replay. ``CompiledDecode`` (``--compile``, any device, made for a CPU):
decode-only calls through ``torch.compile``; its class says why and what it costs.

On a GPU one decode step is a few hundred small kernels (a 30-layer model: norms, the
projections, the rotation, the KV writes and reads, attention, the residual adds), each
launched from Python by the CPU. At one stream each kernel finishes in a few microseconds,
so the GPU waits on the CPU's launches, not on its memory: the step takes several times its
memory floor. A CUDA graph records a call's kernels once and launches them all with one
call (``torch.cuda.CUDAGraph``); what changes between steps (token ids, positions, the
slots each sequence writes and reads) goes into buffers the graph reads, copied in first.

A graph's shapes are fixed when it is captured, so a step is padded to a *bucket*: the
sequences to the next power of two (up to the engine's largest batch), each sequence's
positions to the next power of two of at least ``MIN_KEYS``. A padding row writes its K and
V to a scratch slot past the engine's blocks (``PagedKV.allocate(..., spare=True)``) and
reads only that slot; a sequence's padding keys repeat its first slot and are masked out,
as the eager path pads a decode group. Graphs are captured as buckets are first met and
share one memory pool (the steps never run at once).

Only calls where every chunk computes one token that samples are replayed; prompts, pieces of them and
any call larger than the largest bucket run eagerly as before. Opt-in (``--cuda-graphs``):
a padded bucket multiplies other shapes than the eager step, so the last bits of a score may
differ (``benchmarks/graphs.py`` counts how many greedy tokens do). On a CPU the same padded
step runs eagerly, uncaptured (``capture=False``): how the tests check the padding.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from .base import Chunk, ModelLoadError
from .kvcache import GROUP, CallPlan, padded_within

__all__ = ["MIN_KEYS", "CompiledDecode", "DecodeGraphs", "compile_blocker", "compiled_cache", "use_compiled",
           "use_cuda_graphs"]

MIN_KEYS = 64  # the fewest positions a bucket pads a sequence to
SLACK = 160  # positions a sequence the compiled batch step may pad beyond its own, whatever PADDING allows: it pays
#   padding in its attention only, ~4.4 us a padded position (30 layers, 2 cores), where an eager call costs ~1 ms
#   a sequence more (decode calls of 16 on smollm2 at 116 positions on average, padded 1.8x: 59 ms compiled against
#   74 eagerly in groups); under PADDING alone, answers of unlike lengths (an open loop's) ran nearly all eagerly


def _bucket(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


class DecodeGraphs:
    """The decode-only step of one ``PagedLM``, by bucket: (sequences, positions) -> its buffers, graph, output."""

    def __init__(self, gen: Any, max_batch: int, capture: bool = True) -> None:
        self.gen, self.max_batch, self.capture = gen, _bucket(max_batch), capture
        self.steps: dict[tuple[int, int], tuple[torch.Tensor, Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served from a bucket (counted: the tests and benchmarks read them)

    def clear(self) -> None:
        """Forget every bucket (the pool they write was replaced), and their memory pool with them: a pool whose
        graphs are all gone is freed, and torch refuses to capture into it again."""
        self.steps.clear()
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def fits(self, chunks: list[Chunk]) -> bool:
        """A call this can replay: every chunk one token that samples (a decode, or a prompt of one token), nothing
        to score, within the buckets."""
        return (0 < len(chunks) <= self.max_batch and self.gen.kv.scratch is not None
                and all(c.sample and len(c.tokens) == 1 and not c.score for c in chunks)
                and max(c.end for c in chunks) <= self.gen.max_context)

    def hidden(self, chunks: list[Chunk]) -> torch.Tensor:
        """The final hidden state of each chunk's token [len(chunks), width], from its bucket's step."""
        kv = self.gen.kv
        n = _bucket(len(chunks))
        keys = min(_bucket(max(c.end for c in chunks), MIN_KEYS), _bucket(self.gen.max_context))
        inputs, graph, out = self.steps.get((n, keys)) or self._build(n, keys)
        scratch = kv.scratch
        packed = [0] * (4 * n) + [scratch] * (n * keys)  # ids | positions | write slots | lengths | read slots
        for i, c in enumerate(chunks):
            slots = kv.table_slots(c)
            packed[i], packed[n + i], packed[2 * n + i], packed[3 * n + i] = c.tokens[0], c.start, slots[-1], c.end
            packed[4 * n + i * keys:4 * n + (i + 1) * keys] = slots + slots[:1] * (keys - len(slots))
        for i in range(len(chunks), n):  # padding rows: position 0, one key, the scratch slot only
            packed[2 * n + i], packed[3 * n + i] = scratch, 1
        inputs.copy_(torch.tensor(packed, dtype=torch.long))
        if graph is None:
            out = self._step(inputs, n, keys)
        else:
            graph.replay()
        self.replays += 1
        return out[:len(chunks)]

    def _step(self, inputs: torch.Tensor, n: int, keys: int) -> torch.Tensor:
        """The padded call: every tensor it reads is a view of ``inputs`` (what a captured graph reads again)."""
        ids, positions, write, lengths = inputs[:n], inputs[n:2 * n], inputs[2 * n:3 * n], inputs[3 * n:4 * n]
        read = inputs[4 * n:]
        mine = (torch.arange(keys, device=inputs.device)[None, :] < lengths[:, None])[:, None, None, :]
        rows = torch.arange(n, device=inputs.device)
        plan = CallPlan(write, [(rows, read, keys, mine)], [], (read, keys, mine))
        return self.gen._forward(ids, positions, plan)  # type: ignore[no-any-return]

    def _build(self, n: int, keys: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
        kv = self.gen.kv
        inputs = torch.zeros(4 * n + n * keys, dtype=torch.long, device=kv.device)
        inputs[2 * n:3 * n], inputs[3 * n:4 * n], inputs[4 * n:] = kv.scratch, 1, kv.scratch  # all padding
        graph, out = None, torch.empty(0)
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture: lazy initialisations, library workspaces
                for _ in range(2):
                    self._step(inputs, n, keys)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(inputs, n, keys)
        self.steps[(n, keys)] = (inputs, graph, out)
        return inputs, graph, out


class CompiledDecode:
    """A decode-only call through ``torch.compile`` (inductor): every layer as generated code.

    On a CPU a step is bound partly by the dispatch of its ops: ~70 a layer (norms, the
    rotation, casts, the KV writes and reads, views), a few microseconds each on 2 cores.
    Inductor fuses them into generated C++ loops, and its C++ wrapper (``cpp_wrapper``) calls
    those loops, the projections and attention from C++, not Python. Two compiles, both while
    the model loads (``warm``):

    - *one sequence* (one stream): a float32 projection is written as products and a sum over
      its weight's rows (``linear.row_products``), so inductor's loop reads the weights in order
      inside the same kernel as the norm before it, where oneDNN's call costs ~11 us of its own
      120 times a step (the output head, one large call, stays with oneDNN);
    - *a batch* of 2 to ``GROUP`` sequences, each one token: the projections stay oneDNN's
      calls (several rows are matmuls, which oneDNN does well), and everything between them is
      fused; the sequences' positions are padded to the longest and masked, as the eager path's
      decode group is, and attended where they lie in the pool (``kvcache.in_place``: no copy of
      K and V; a decode call of 32 on smollm2 ~0.88x its time with the copy, 2 cores). Its sizes
      (sequences, positions) are dynamic, so one compile serves every batch (``docs/models.md``).

    Its shapes are dynamic (positions, the pool's slots, the batch), so each compile serves
    every such step. Compiled code is cached by torch in ``compiled_cache()`` (labserver's cache
    folder, unless ``TORCHINDUCTOR_CACHE_DIR`` says another): a second start on the same machine
    loads it instead of compiling again (~20 against ~135 s for smollm2 on 2 cores). Its sums run
    in another order than the eager step's, and inductor keeps float16 intermediates in float32
    inside a fused loop, so the last bits differ from the eager step's: the greedy answers are
    checked against transformers' with the near-tie rule
    (``benchmarks/onestream.py``, ``benchmarks/peers.py``).
    """

    capture = False

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        for projection in gen.projections():
            projection.compiled()
        self.fn = torch.compile(self._step, options={"cpp_wrapper": True})
        self.batch_fn = torch.compile(self._batch, options={"cpp_wrapper": True})
        self.replays = 0  # steps through the compiled code (both kinds)
        self.batched = 0  # of those, steps of several sequences
        self.checked: set[str] = set()  # the kinds of step run with every guard since the pool was last made

    def clear(self) -> None:
        """The pool was made again: the next step of each kind checks every guard (the compiled code reads the
        pool's tensors, whatever their number of slots, so nothing else to forget)."""
        self.checked.clear()

    def fits(self, chunks: list[Chunk]) -> bool:
        """Up to ``GROUP`` chunks of one token that samples, nothing to score; several only when one of them has
        two positions or more (a size of one is a compile of its own to torch) and their positions padded to the
        longest are within ``PADDING`` of their own or ``SLACK`` more a sequence (else the eager path's groups,
        each padded to its own longest, cost less)."""
        if not 0 < len(chunks) <= GROUP or not all(c.sample and len(c.tokens) == 1 and not c.score for c in chunks):
            return False
        ends = [c.end for c in chunks]
        if len(ends) == 1:
            return True
        n, longest, own = len(ends), max(ends), sum(ends)
        return longest >= 2 and (padded_within(n, longest, own) or n * longest - own <= SLACK * n)

    def hidden(self, chunks: list[Chunk]) -> torch.Tensor:
        """The final hidden state of each chunk's token [len(chunks), width], in call order."""
        kv, dev = self.gen.kv, self.gen.kv.device
        self.replays += 1
        if len(chunks) == 1:
            (c,) = chunks
            slots = kv.table_slots(c)
            return self._run("one", torch.tensor([c.tokens[0], c.start, slots[-1]], device=dev),
                             torch.tensor(slots, device=dev))
        self.batched += 1
        longest, head, read = max(c.end for c in chunks), [], []
        for c in chunks:
            slots = kv.table_slots(c)
            head.append((c.tokens[0], c.start, slots[-1], c.end))
            read.append(slots + slots[:1] * (longest - len(slots)))  # (padding: masked out)
        return self._run("batch", torch.tensor(head, device=dev), torch.tensor(read, device=dev))

    def _run(self, kind: str, head: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """One compiled step. Its guards (the checks torch runs before every call that the code still fits: the
        model's tensors, their shapes and strides) cost ~0.5-1 ms of a step on 2 cores, so they run on the first
        step of each kind after the pool was made and whenever one position is read (torch specialises a size of
        1); the other steps skip them (``skip_guard_eval_unsafe``): nothing they check changes in between."""
        for t in (head, read) if kind == "batch" else (read,):  # (any batch, any context: one compile each)
            for d in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, d)
        fn = self.fn if kind == "one" else self.batch_fn
        if kind not in self.checked or read.shape[-1] < 2:
            self.checked.add(kind)
            return fn(head, read)  # type: ignore[no-any-return]
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return fn(head, read)  # type: ignore[no-any-return]

    def _step(self, head: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """``head``: the token, its position, its slot; ``read``: the slots of every position it attends to."""
        keys = read.shape[0]  # (one query over all its keys: no mask)
        plan = CallPlan(head[2:3], [(head[:1] * 0, read, keys, None)], [], (read, keys, None))
        return self.gen._forward(head[:1], head[1:2], plan)  # type: ignore[no-any-return]

    def _batch(self, head: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """``head`` [n, 4]: each sequence's token, position, slot and length; ``read`` [n, longest]: the slots it
        attends to, padded with its first."""
        n, longest = read.shape
        mine = (torch.arange(longest, device=read.device)[None, :] < head[:, 3:4])[:, None, None, :]
        slots = read.flatten()
        plan = CallPlan(head[:, 2], [(torch.arange(n, device=read.device), slots, longest, mine)], [],
                        (slots, longest, mine))
        return self.gen._forward(head[:, 0], head[:, 1], plan)  # type: ignore[no-any-return]

    def warm(self, batch: bool = True) -> float:
        """Compile now (steps over the scratch slot alone: one sequence, then two unless not ``batch``), not at the
        first requests' steps; the seconds it took."""
        start = time.perf_counter()
        s, dev = self.gen.kv.scratch, self.gen.kv.device
        with torch.inference_mode():
            self._run("one", torch.tensor([0, 1, s], device=dev), torch.tensor([s, s], device=dev))
            if batch:
                two = torch.tensor([[0, 1, s, 2]] * 2, device=dev)
                self._run("batch", two, torch.tensor([[s, s]] * 2, device=dev))
        return time.perf_counter() - start


def compile_blocker(model: Any) -> str | None:
    """Why ``--compile auto`` (the server's default) leaves ``model``'s decode steps eager; None where they compile:
    labserver's own forward pass, on a CPU (a GPU's way is ``--cuda-graphs``), with a C++ compiler for inductor's
    generated code."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    from .paged import PagedLM

    if not isinstance(model, PagedLM):
        return f"{getattr(model, 'name', model)!r} has no forward pass of labserver's own to compile"
    if model.kv.device.type != "cpu":
        return f"on {model.kv.device.type} the decode steps compile only when asked (--compile on; or --cuda-graphs)"
    compiler = get_cpp_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) for torch.compile's generated code"
    return None


def compiled_cache() -> str:
    """The folder torch keeps compiled code in: ``$TORCHINDUCTOR_CACHE_DIR`` if set, else ``inductor`` in
    labserver's cache (``models.smollm2.cache_root``), not torch's default under the temporary folder, which a
    reboot may empty. Set for this process (torch reads it at every compile, and writes its default there the
    first time it looks, so its default counts as unset)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from .smollm2 import cache_root

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def use_compiled(model: Any) -> CompiledDecode:
    """Run ``model``'s one-token steps through ``torch.compile`` (``--compile``); the pool's slots made dynamic."""
    from .paged import PagedLM

    if not isinstance(model, PagedLM):
        raise ModelLoadError(f"--compile compiles labserver's own forward pass; {getattr(model, 'name', model)!r} "
                             "has none")
    if isinstance(model.graphs, CompiledDecode):
        return model.graphs
    compiled_cache()
    model.kv.dynamic = True
    return model.use_graphs(CompiledDecode(model))  # type: ignore[no-any-return]


def use_cuda_graphs(model: Any, max_batch: int | None, capture: bool | None = None) -> DecodeGraphs:
    """Replay ``model``'s decode steps from CUDA graphs, up to ``max_batch`` sequences (``--cuda-graphs``).

    ``capture=None``: capture on a CUDA device, and refuse another device (a CPU runs kernels as
    Python calls them; there is nothing to replay); ``capture=False`` runs the padded steps
    eagerly on any device (the tests)."""
    from .paged import PagedLM

    if not isinstance(model, PagedLM):
        raise ModelLoadError(f"--cuda-graphs replays labserver's own forward pass; "
                             f"{getattr(model, 'name', model)!r} has none")
    if capture is None:
        if model.kv.device.type != "cuda":
            raise ModelLoadError(f"--cuda-graphs needs a CUDA device; {model.name} is on {model.kv.device.type}")
        capture = True
    have = model.graphs
    if isinstance(have, DecodeGraphs) and have.capture == capture and have.max_batch >= _bucket(max_batch or 32):
        return have  # (already on: a benchmark's model served again)
    return model.use_graphs(DecodeGraphs(model, max_batch or 32, capture))
