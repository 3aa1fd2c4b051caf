"""Connections a slow or idle client cannot hold: a bound on how many, a deadline to send a request.

An asyncio server holds an open connection for free until the process runs out of file
descriptors, and uvicorn by itself waits forever for the rest of a request whose first
byte came (its keep-alive timeout applies only between requests, and any byte cancels it).
A client that opens connections and sends nothing, or one header byte now and then
("slowloris"), would then hold the server's descriptors without ever asking for work.
Two rules, in the HTTP protocol itself (below every route and middleware):

- **a deadline to read a request** (``read_timeout_s``): its headers and its body must
  have arrived within that many seconds of the connection opening, or of the previous
  response's end on a kept-alive connection. A connection past it is closed; a request
  whose body was still coming is then a client gone, for the route that was reading it.
  Time to compute and to stream an answer is not counted: the deadline ends when the
  request is read.
- **a bound on open connections** (``max_connections``): one past it gets a 503
  (``overloaded``, ``Retry-After``) and is closed, before anything is parsed.

This is uvicorn's httptools protocol (a dependency of labserver) with those two rules added.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import wire

__all__ = ["protocol_class", "refusal_bytes"]


def refusal_bytes() -> bytes:
    """The whole HTTP response a connection past the bound gets (no request was read)."""
    body = json.dumps({"error": {"type": "overloaded", "message": "too many open connections; retry later",
                                 "request_id": "-"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\n{wire.HEADER_REASON}: connections\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


class _Bounded(HttpToolsProtocol):
    read_timeout_s: float = 30.0
    max_connections: int = 4096

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        over = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if over:
            transport.write(refusal_bytes())
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        self._disarm()  # read: what follows (compute, the answer) is not this deadline's
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete  # (not a pipelined request, already read)
        if idle and not self.transport.is_closing():
            self._arm()  # the next request on this connection, idle time included

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _expired(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(read_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's ``http=`` protocol for a server with these two rules."""
    return type("BoundedHttpProtocol", (_Bounded,), {"read_timeout_s": read_timeout_s,
                                                     "max_connections": max_connections})
