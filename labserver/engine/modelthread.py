"""How one batch runs: failures isolated by splitting, on the loop or on a model thread.

``bisecting`` splits a call that raises in halves and retries each, so one bad input fails
alone and an out-of-memory call is retried smaller: the batch engine's ``isolating_steps``
and the step engine's calls both run it.
``ModelThread`` is the dedicated thread the offloading strategies run the model on.
Nothing here knows strategies or HTTP; the engines (``labserver.engine``) drive both.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, TypeVar

from ..models import ModelError, OutOfMemory, keep_freed_memory

logger = logging.getLogger(__name__)

ModelFn = Callable[[list[str]], list[Any]]
W = TypeVar("W")  # what one model call computes: a batch of texts, a step engine's ModelCall


class WorkerDied(Exception):
    """The worker (task or thread) running the model is gone (503)."""


async def let_loop_run(turns: int = 16) -> None:
    """Give the event loop some turns between two model calls made on it.

    ``queue.get`` returns at once while items are queued, and an inline model call
    never awaits, so without this a strategy on the loop never yields while work is
    queued: it answers nobody until the queue is empty, reads no new request (no
    quick 503) and never sees a client leave. The loop is meant to block *during* a
    call, not between calls. Each turn moves every pending chain one step (a
    finished future wakes ``asyncio.wait``, which wakes the handler, which writes the
    response; a new socket is accepted, read, parsed, queued; a closed one wakes the
    disconnect watcher, which wakes the handler, which cancels its items): chains
    are 4-6 steps long, so 16 turns leave margin. Cost: a few microseconds each.
    """
    for _ in range(turns):
        await asyncio.sleep(0)


def bisecting(work: W, halves: Callable[[W], tuple[W, W]], size: Callable[[W], int]
              ) -> Generator[W, list[Any] | Exception, tuple[list[Any], int]]:
    """A failing call split in halves until each failure falls on its own inputs: the one bisection both engines use.

    It yields each call to make (``work`` first, then halves of it, ``halves(work)``) and is
    sent what that call returned, or the exception it raised; it returns one entry per input
    (an output, or the exception for that input) and the number of calls made. One poisoned
    input among n costs about 2 log2(n) more calls and fails alone; an out-of-memory call is
    retried smaller until it fits or a single input still does not. Whoever drives it makes
    the calls where they belong (inline, on the model thread, awaited from the loop), and
    lets a worker's death end it rather than send it in.
    """
    outcome = yield work
    if not isinstance(outcome, Exception) and len(outcome) != size(work):
        outcome = ModelError(f"model returned {len(outcome)} outputs for {size(work)} inputs")
    if not isinstance(outcome, Exception):
        return list(outcome), 1
    if size(work) == 1:
        if not isinstance(outcome, ModelError):
            logger.error("model failed on one input", exc_info=outcome)
        return [outcome], 1
    if isinstance(outcome, OutOfMemory):
        logger.warning("a call of %d did not fit; splitting and retrying", size(work))
    left, right = halves(work)
    outs_left, n_left = yield from bisecting(left, halves, size)
    outs_right, n_right = yield from bisecting(right, halves, size)
    return outs_left + outs_right, 1 + n_left + n_right


def _halves(texts: list[str]) -> tuple[list[str], list[str]]:
    mid = len(texts) // 2
    return texts[:mid], texts[mid:]


def run_isolating(model: ModelFn, texts: list[str]) -> tuple[list[Any], int]:
    """A batch of texts, bisected where it raises (``bisecting``): one entry per text and the model calls made."""
    steps = isolating_steps(model, texts)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def isolating_steps(model: ModelFn, texts: list[str]) -> Generator[None, None, tuple[list[Any], int]]:
    """``run_isolating`` as a generator that pauses before every retry.

    An inline strategy drives it with loop turns in the pauses, so a poisoned batch
    blocks the event loop for one model call at a time, not for all ~2*log2(n) of them.
    """
    steps = bisecting(texts, _halves, len)
    part = next(steps)
    while True:
        try:
            outcome: list[Any] | Exception = model(part)
        except Exception as e:
            outcome = e
        try:
            part = steps.send(outcome)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        yield


class Job(NamedTuple):
    """One call for the model thread: what to run, the future it settles, the event it sets once taken."""

    fut: asyncio.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    taken: threading.Event | None


class ModelThread:
    """One dedicated thread that runs model calls handed to it from the event loop.

    A plain thread rather than an executor so that its death is a real event: if a
    call raises something that is not an Exception (SystemExit, a crash in a C
    extension surfacing as BaseException), the thread ends, ``on_death`` runs on the
    loop, and the caller's pending future fails with WorkerDied.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._on_death = on_death
        self._died: WorkerDied | None = None
        self.span: tuple[float, float] | None = None  # the last job's start and end on this thread (perf_counter,
        #   set before its future is settled): how long the model waited for the loop between two calls
        keep_freed_memory()  # a model built without load_model too: no page faults per op (models.cpu says why)
        self._thread = threading.Thread(target=self._run, name="labserver-model", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, taken_s: float = 0.0) -> asyncio.Future[Any]:
        """``fn(*args)`` queued for the thread; its future settles on the loop.

        ``taken_s``: the caller waits, at most that long, until the thread has taken the job. On a
        machine with as many cores as the model has threads, the loop's own work right after a
        hand-over (the tokens just made, written to their streams) and the client's reading them
        took the cores the woken thread needed: a served call of 32 on 2 cores began 1.1-1.5 ms
        late, ~2.5 % of the call (``servedperf.py``'s row 6). Waiting with the GIL released lets
        the thread have a core first; whatever the loop does next runs beside the call, not before it
        (the step engine writes the tokens before the hand-over there: ``labserver.engine.step``).
        """
        fut = self._loop.create_future()
        if self._died is not None:  # nobody would take it
            fut.set_exception(self._died)
            return fut
        taken = threading.Event() if taken_s > 0 else None
        self._jobs.put(Job(fut, fn, args, taken))
        if taken is not None:
            taken.wait(taken_s)
        return fut

    def stop(self, timeout_s: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        fut: asyncio.Future[Any] | None = None
        try:
            while (job := self._jobs.get()) is not None:
                fut, fn, args, taken = job
                if taken is not None:
                    taken.set()
                began = time.perf_counter()
                try:
                    result, error = fn(*args), None
                except Exception as e:  # an ordinary failure: hand it back, keep going
                    result, error = None, e
                self.span = (began, time.perf_counter())
                self._loop.call_soon_threadsafe(settle, fut, result, error)
                fut = None
        except BaseException as e:
            logger.critical("model thread died", exc_info=e)
            died = WorkerDied(f"model thread died: {type(e).__name__}")
            try:  # one callback, death first: whoever the failed call wakes finds the engine already dead
                self._loop.call_soon_threadsafe(self._report_death, fut, died)
            except RuntimeError:  # the loop is already closed: nobody is waiting
                pass

    def _report_death(self, fut: asyncio.Future[Any] | None, died: WorkerDied) -> None:
        self._died = died
        self._on_death(died)
        if fut is not None:
            settle(fut, None, died)
        while True:  # the jobs queued behind it (a release handed over unawaited, then a call) fail with it
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                settle(job.fut, None, died)


def settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
