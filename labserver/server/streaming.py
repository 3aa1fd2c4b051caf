"""The one stream writer of ``/generate`` and the ``/v1`` routes: tokens as they come, then one ending.

A stream has begun as a 200 once its first token is ready, so how it ends is the part
both APIs must get right in the same way: every token once, in order; then exactly one
of

- answered: the API's last event (``done``; a usage chunk and ``[DONE]``), counted as a 200;
- failed mid-way: the API's error event, logged and counted as the status it would have
  had (500, 503), though the status line already said 200;
- the client left: nothing more to send; counted once as 499, and its sequences cancelled,
  so the engine drops them at the next step boundary.

``write_stream`` is that loop; an API only says how its pieces look (a ``Renderer``), and
``SeqStream`` is the HTTP response that runs it. Before it, both APIs wait the same way:
``wait_first_token`` (the deadline and the client may end it first: until then every failure
is an ordinary JSON error) and, for a one-piece answer, ``wait_all``; ``generation_engine``
is the server's engine, if it generates.

No orphans: a sequence nobody will read leaves the batch at the next step boundary. Once
a route has queued sequences, whatever fails before its response is handed over (a header
that cannot be built, anything raised while waiting) lets them go (``letting_go``), and a
stream response lets them go when it is over, also when it never began (the HTTP server
refused its headers, the client was gone before its first byte), which ``write_stream``
alone cannot see: a loop that never ran has no ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Protocol, cast

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .. import wire
from ..engine import GenEngine, Seq
from .handling import ClientError, ClientWatch, deadline_end_s, describe, log_failure
from .runtime import Runtime

__all__ = ["Renderer", "SeqStream", "failure", "generation_engine", "let_go", "letting_go", "wait_all",
           "wait_first_token", "write_stream"]


class Renderer(Protocol):
    """How one API writes a stream of sequences' tokens (bytes for HTTP; a replica's typed events)."""

    def pending(self) -> Any:
        """What the sequences made since the last call, ready to send (b"" or None for nothing yet)."""

    def open(self) -> list[Any]:
        """The sequences still streaming (after ``pending``): the writer waits on these."""

    def done(self) -> Any:
        """The end of an answered stream."""

    def failed(self, kind: str, message: str, error: BaseException) -> Any:
        """The end of a stream whose sequence failed mid-way (labserver's error ``kind``)."""


def failure(seqs: list[Any]) -> BaseException | None:
    """The first failure among the sequences (a cancelled one is not a failure: it was let go)."""
    for seq in seqs:
        if seq.future.done() and not seq.future.cancelled() and seq.future.exception() is not None:
            return seq.future.exception()  # type: ignore[no-any-return]
    return None


async def write_stream(rt: Runtime, seqs: list[Any], rid: str, t0: float,
                       render: Renderer) -> AsyncGenerator[Any, None]:
    """Every token once (all that are ready in one write), then one ending (see the module docstring).

    It waits on each sequence's next change only: a token and an ending both wake it (``Seq.emit``, ``Seq.settle``),
    and so does a future settled by anyone else (a client that left cancels it), through the callback added here.
    One future a token rather than ``asyncio.wait`` over two: this loop runs once per token per stream.
    """
    answered = False
    for seq in seqs:
        seq.future.add_done_callback(lambda _, seq=seq: seq.wake())
    try:
        while True:
            piece = render.pending()
            if piece:
                yield piece
            error = failure(seqs)
            if error is not None:
                log_failure(rid, error)
                kind, message, _ = describe(error)
                rt.statuses[wire.ERROR_TYPES[kind]] += 1  # counted by what it would have been, though it began 200
                answered = True
                yield render.failed(kind, message, error)
                return
            waiting = render.open()
            if not waiting:
                break
            if len(waiting) == 1:
                await waiting[0].next_change()
            else:
                await asyncio.wait({seq.next_change() for seq in waiting}, return_when=asyncio.FIRST_COMPLETED)
        answered = True
        rt.answered(time.perf_counter() - t0)
        yield render.done()
    finally:
        let_go(seqs)  # a no-op once answered; a client that left mid-stream frees its place
        if not answered:
            rt.statuses[499] += 1  # it began as a 200, but its client left: one outcome, counted once


def let_go(seqs: list[Any]) -> None:
    """Nobody will read these: queued, they are never prefilled; running, they leave at the next step (a no-op
    for one already answered)."""
    for seq in seqs:
        seq.future.cancel()


@contextlib.contextmanager
def letting_go(seqs: list[Any]) -> Iterator[None]:
    """Around everything a route does once it has queued ``seqs`` (the list may still grow): whatever it raises
    lets them go before the error is answered."""
    try:
        yield
    except BaseException:
        let_go(seqs)
        raise


class SeqStream(StreamingResponse):
    """``write_stream`` as an HTTP response (server-sent events) that lets its sequences go when it is over.

    Starlette runs the loop only once the headers are out, in a task it cancels when the
    client leaves; a start that fails, or a client gone before it, leaves the loop unrun
    and its sequences running for nobody. Here they are let go whatever happened; one
    whose client left before it began counts as 499 (one whose start raised is the error
    handler's 500).
    """

    def __init__(self, rt: Runtime, seqs: list[Seq], rid: str, t0: float, render: Renderer,
                 headers: dict[str, str]) -> None:
        self.rt, self.seqs, self.begun = rt, seqs, False
        super().__init__(write_stream(rt, seqs, rid, t0, render), media_type="text/event-stream",
                         headers={**headers, "cache-control": "no-cache"})

    async def stream_response(self, send: Send) -> None:
        """Starlette's, with ``begun`` set where the loop begins: its first step enters the ``try`` its ending is in,
        with nothing awaited in between."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.begun = True
        async for piece in self.body_iterator:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # a loop left at a write: its ending
            let_go(self.seqs)
        if not self.begun:
            self.rt.statuses[499] += 1


def generation_engine(rt: Runtime, why: str) -> GenEngine:
    """The server's engine, asked whether it generates; if not, a 400 that says ``why``."""
    if rt.engine is None or rt.engine.kind != "generate":
        raise ClientError("bad_request", why)
    return cast(GenEngine, rt.engine)


async def wait_first_token(rt: Runtime, request: Request, seq: Seq, t0: float) -> None:
    """Until the sequence has a token or an outcome; the deadline (timeout_ms) and the client may end it first."""
    why = f"no first token within timeout_ms={rt.config.limits.timeout_ms}"
    try:
        async with ClientWatch(request) as watch:
            while not seq.tokens:
                if seq.future.done():
                    seq.future.result()  # raises what ended it (504 in queue, 500, 503)
                    return
                await watch.first({seq.next_change(), seq.future}, deadline_end_s(rt, t0), why)
    except BaseException:
        seq.future.cancel()  # queued: never prefilled; running: dropped at the next step
        raise


async def wait_all(request: Request, seq: Seq) -> None:
    """Until the sequence is answered (finished, or failed mid-way); a client that leaves ends it."""
    try:
        async with ClientWatch(request) as watch:
            while not seq.future.done():
                await watch.first({seq.future})
        seq.future.result()
    except BaseException:
        seq.future.cancel()
        raise
