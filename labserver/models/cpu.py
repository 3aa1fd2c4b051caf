"""How torch behaves on a CPU, and what labserver does about it: one OpenMP team, freed memory kept.

- ``on_fresh_thread``: torch work (loading, an offline reference) on a thread that ends with
  it, so its OpenMP team goes with it;
- ``release_openmp_threads``: free the calling thread's team (a server started from a
  notebook's kernel, whose main thread ran the model before);
- ``keep_freed_memory``: glibc's malloc keeps the memory torch frees, so a step's tensors
  need no page faults.

``docs/generation.md`` has the measurements behind each.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "no_core_spare", "on_fresh_thread",
           "release_openmp_threads"]

T = TypeVar("T")


def on_fresh_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a new thread that ends with it: torch work that leaves no thread pool behind.

    On the CPU, torch parallelises an op with OpenMP, and GNU OpenMP keeps a team of worker
    threads for *every* thread that ever ran a parallel op, until that thread ends. Its
    workers spin between ops only while the process's OpenMP threads are no more than its
    CPUs; past that (two such threads on a 2-core machine already) they go to sleep after
    each op and must be woken for the next, a system call each, hundreds of times a decode
    step. So one thread should run a server's model (the model thread), and work done
    before (loading) or beside it (an offline reference) runs here, where its team is gone
    when it returns. ``docs/generation.md`` has the measurements.
    """
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = fn(*args)
        except BaseException as e:  # re-raised on the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, name="labserver-fresh")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["value"]  # type: ignore[no-any-return]


MMAP_THRESHOLD = 32 << 20  # glibc's largest; tensors up to 32 MiB come from the heap, not a fresh mmap
TRIM_THRESHOLD = 128 << 20  # free memory an arena keeps before giving it back to the kernel
_malloc_kept: bool | None = None


def no_core_spare(device: str) -> bool:
    """Whether a model on ``device`` computes on every core this process may use: on the CPU, with an OpenMP team
    of as many threads as those cores. Then any other thread's work during a call takes a core from the team, and
    the team's other threads may wait for it at the op's end: measured on 2 cores, a second thread busy 0.07 of a
    core beside the offline engine cost it 3-7 % of its tokens/s in two runs (``benchmarks/beside.py``), up to
    twice its share, whether that thread held the GIL or not. Work done between two calls costs only its own time
    (``StepEngine``'s ``flush_turns``)."""
    if not device.startswith("cpu"):
        return False
    try:
        import torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    except ImportError:
        return False
    return torch.get_num_threads() >= cores


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep the memory torch frees, so the next op's tensors need no page faults.

    A CPU forward pass allocates and frees its activations (and paged attention its gathered
    K/V) every layer of every step. By default glibc hands chunks above a threshold
    (128 KiB, raised as larger ones are freed) to ``mmap`` and unmaps them on free, and a
    thread's arena returns its free top to the kernel past another (``M_TRIM_THRESHOLD``):
    each time, the next allocation touches new pages, which the kernel faults in and zeroes.
    Measured on a server's first model thread: 200,000 faults/s, a quarter of each core
    in the kernel, decode steps of 125 ms instead of 67 (``docs/generation.md``). Fixed
    thresholds (32 MiB, 128 MiB) keep freed memory for reuse. Once per process, on glibc
    only, and never over the user's own ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``.
    Returns whether the thresholds are set.
    """
    global _malloc_kept
    if _malloc_kept is None:
        _malloc_kept = False
        if sys.platform.startswith("linux") and not any(
                k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
            try:
                libc = ctypes.CDLL("libc.so.6")
                m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
                _malloc_kept = bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)
                                    and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD))
            except (OSError, AttributeError):  # not glibc (musl): its allocator has no such knobs
                pass
    return _malloc_kept


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads the calling thread has made (``omp_pause_resource_all``); True if it did.

    Every thread that runs a torch op on a CPU gets its own team of OpenMP workers, and they
    stay. When the model thread's team is not the only one, the cores are oversubscribed and
    libgomp makes every team's workers sleep between parallel regions instead of spinning, so
    each of a step's thousands of ops waits for its workers to wake. Measured on 2 cores, one
    ``smollm2-q4`` stream served from a process whose main thread had run the model once
    before (a notebook's kernel, a benchmark): 27.8 and 30.7 tokens/s, against 47.9 and 49.3
    without that, and 55.2 with that thread's team freed here. ``labserver.serve`` calls it on
    the caller's thread; the team comes back if that thread runs torch again.
    """
    if "torch" not in sys.modules or not sys.platform.startswith("linux"):
        return False  # (nothing made a team yet)
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line), None)
        return path is not None and ctypes.CDLL(path).omp_pause_resource_all(1) == 0  # 1: omp_pause_soft
    except (OSError, AttributeError):  # another OpenMP runtime, or one without OpenMP 5's pause
        return False
