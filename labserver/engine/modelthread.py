"""How one batch runs: failures isolated by splitting, on the loop or on a model thread.

``isolating_steps`` runs a batch and, if it raises, splits it in halves and retries
each, so one bad input fails alone and an out-of-memory batch is retried smaller.
``ModelThread`` is the dedicated thread the offloading strategies run the model on.
Nothing here knows strategies or HTTP; the engines (``labserver.engine``) drive both.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any

from ..models import ModelError, OutOfMemory, keep_freed_memory

logger = logging.getLogger(__name__)

ModelFn = Callable[[list[str]], list[Any]]


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


def run_isolating(model: ModelFn, texts: list[str]) -> tuple[list[Any], int]:
    """Run a batch; if it raises, split it in halves and retry each.

    Returns one entry per text (an output or the exception for that text) and the
    number of model calls. One poisoned input costs about 2*log2(n) extra calls and
    fails alone; an out-of-memory batch is retried smaller until it fits or a single
    item still does not.
    """
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
    try:
        outputs = model(texts)
        if len(outputs) != len(texts):
            raise ModelError(f"model returned {len(outputs)} outputs for {len(texts)} inputs")
        return list(outputs), 1
    except Exception as e:
        if len(texts) == 1:
            if not isinstance(e, ModelError):
                logger.error("model failed on one input", exc_info=e)
            return [e], 1
        if isinstance(e, OutOfMemory):
            logger.warning("batch of %d did not fit; splitting and retrying", len(texts))
    mid = len(texts) // 2
    yield
    left, n_left = yield from isolating_steps(model, texts[:mid])
    yield
    right, n_right = yield from isolating_steps(model, texts[mid:])
    return left + right, 1 + n_left + n_right


class ModelThread:
    """One dedicated thread that runs model calls handed to it from the event loop.

    A plain thread rather than an executor so that its death is a real event: if a
    call raises something that is not an Exception (SystemExit, a crash in a C
    extension surfacing as BaseException), the thread ends, ``on_death`` runs on the
    loop, and the caller's pending future fails with WorkerDied.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]] | None]
        self._jobs = queue.SimpleQueue()
        self._on_death = on_death
        keep_freed_memory()  # a model built without load_model too: no page faults per op (models.base says why)
        self._thread = threading.Thread(target=self._run, name="labserver-model", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        fut = self._loop.create_future()
        self._jobs.put((fut, fn, args))
        return fut

    def stop(self, timeout_s: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        fut: asyncio.Future[Any] | None = None
        try:
            while (job := self._jobs.get()) is not None:
                fut, fn, args = job
                try:
                    result = fn(*args)
                except Exception as e:  # an ordinary failure: hand it back, keep going
                    self._loop.call_soon_threadsafe(settle, fut, None, e)
                else:
                    self._loop.call_soon_threadsafe(settle, fut, result, None)
                fut = None
        except BaseException as e:
            logger.critical("model thread died", exc_info=e)
            died = WorkerDied(f"model thread died: {type(e).__name__}")
            try:  # one callback, death first: whoever the failed call wakes finds the engine already dead
                self._loop.call_soon_threadsafe(self._report_death, fut, died)
            except RuntimeError:  # the loop is already closed: nobody is waiting
                pass

    def _report_death(self, fut: asyncio.Future[Any] | None, died: WorkerDied) -> None:
        self._on_death(died)
        if fut is not None:
            settle(fut, None, died)


def settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
