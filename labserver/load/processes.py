"""Several plans sent at once, each from its own spawned process, from one common start.

``labserver.loadgen`` calls ``run_in_processes`` when one process cannot send on time
alone (or must not share a core with a model running inline in the caller). Each child
builds a ``Worker`` (``labserver.load.worker``), waits at a barrier until all are set
up, and starts at one wall-clock instant they share; the parent only collects rows and
counts progress. What to send is decided before (``labserver.load.plan``).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from .loops import run_on_fresh_loop
from .plan import Plan
from .worker import Worker

__all__ = ["run_in_processes"]

_START_MARGIN_S = 0.05  # between "all processes ready" and their common start


def _child_main(plan: Plan, counter, inbox, start_at, barrier) -> None:
    """Entry point of a spawned generator process."""
    try:
        worker = Worker(plan, counter)
        gc.freeze()  # the imports (pandas, numpy) out of full collections: no pauses of tens of ms mid-run
        # All processes meet here once set up (the spawn and imports take a while); one of
        # them picks a common start just ahead, in wall-clock time, which all processes share.
        if barrier.wait(timeout=120) == 0:
            start_at.value = time.time() + _START_MARGIN_S
        barrier.wait(timeout=10)
        t0 = time.perf_counter() + (start_at.value - time.time())
        out = run_on_fresh_loop(lambda: worker.run(t0), sockets=plan.sockets(), rate_per_s=plan.rate_per_s())
        inbox.put(("done", plan.worker, out))
    except BaseException:
        inbox.put(("error", plan.worker, traceback.format_exc()))


async def run_in_processes(plans: list[Plan], on_count: Callable[[int], None]) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads or CUDA
    inbox, barrier, start_at = ctx.Queue(), ctx.Barrier(len(plans)), ctx.RawValue("d", 0.0)
    counters = [ctx.RawValue("q", 0) for _ in plans]
    procs = [ctx.Process(target=_child_main, args=(plan, c, inbox, start_at, barrier), daemon=True,
                         name=f"labserver-loadgen-{plan.worker}") for plan, c in zip(plans, counters)]
    for proc in procs:
        proc.start()
    outs: dict[int, Any] = {}
    try:
        while len(outs) < len(procs):
            try:
                kind, w, payload = await asyncio.to_thread(inbox.get, True, 0.25)
            except queue.Empty:
                on_count(sum(c.value for c in counters))
                gone = [f"{p.name} (exit code {p.exitcode})" for plan, p in zip(plans, procs)
                        if plan.worker not in outs and p.exitcode is not None]
                if gone and inbox.empty():
                    raise RuntimeError(
                        f"load generator process(es) {', '.join(gone)} exited without a result. A spawned "
                        "process re-imports your __main__: a script needs an `if __name__ == '__main__':` "
                        "guard, and code fed on stdin cannot be re-imported; there, use process=False")
                continue
            if kind == "error":
                raise RuntimeError(f"load generator process {w} failed:\n{payload}")
            outs[w] = payload
    finally:
        for proc in procs:
            if len(outs) < len(procs):
                proc.terminate()  # only after an error or a cancellation: ours to stop
            proc.join(timeout=10)
    on_count(sum(c.value for c in counters))
    return [outs[w] for w in sorted(outs)]
