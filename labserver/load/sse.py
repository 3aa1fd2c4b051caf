"""One answer as the load generator reads it off the socket.

``Answer`` is fed the decoded body of an answer (``POST /generate``, or any other) piece by piece
(httptools hands over each chunk of a chunked body) with the client-clock time of
the socket read it came in. For a ``text/event-stream`` answer it notes when each
token event completed and keeps the final ``done`` or ``error`` event; for any other
answer it keeps the body. It is not an SSE library: it reads the wire format of
``labserver.wire`` (events separated by a blank line, ``event:`` then ``data:``) and
nothing more, and it never parses a token event's JSON — a token is found by its
``event: token`` line, so thousands of tokens a second cost a ``bytes.count`` each.

Timing is honest about reads: token events that complete in the same read share
that read's timestamp (a gap of 0 between them), since the client cannot know
when, inside the kernel's buffer, each one arrived.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .. import wire

__all__ = ["Answer"]

_SEP = b"\n\n"  # the blank line that ends an event
_TOKEN_AFTER_SEP = _SEP + wire.SSE_TOKEN
_FINALS = ((wire.SSE_DONE, _SEP + wire.SSE_DONE, "done"), (wire.SSE_ERROR, _SEP + wire.SSE_ERROR, "error"))


class Answer:
    """Status, headers, token arrival times and the final event of one answer."""

    __slots__ = ("status", "headers", "event_stream", "token_s", "end", "final", "_rest", "_body")

    def __init__(self) -> None:
        self.status = 0  # HTTP status, 0 until the headers came
        self.headers: Mapping[str, str] = {}
        self.event_stream = False  # the answer is text/event-stream (else one body)
        self.token_s: list[float] = []  # client clock (time.perf_counter) each token event completed
        self.end = ""  # "done" or "error" once the final event came; "" before
        self.final: dict[str, Any] | None = None  # that event's JSON (a one-piece answer: its body's)
        self._rest = b""  # the unfinished event at the end of the last read
        self._body: list[bytes] = []

    def begin(self, status: int, headers: Mapping[str, str]) -> None:
        self.status, self.headers = status, headers
        self.event_stream = headers.get("content-type", "").startswith("text/event-stream")

    def feed(self, data: bytes, t_s: float) -> None:
        """A piece of decoded body that arrived in the read timed ``t_s``."""
        if not self.event_stream:
            self._body.append(data)
            return
        buf = self._rest + data if self._rest else data
        cut = buf.rfind(_SEP)
        if cut < 0:
            self._rest = buf
            return
        events, self._rest = buf[: cut + 2], buf[cut + 2:]
        # every complete piece starts at an event's start: the previous one ended at a blank line
        n = events.count(_TOKEN_AFTER_SEP) + events.startswith(wire.SSE_TOKEN)
        if n:
            self.token_s.extend([t_s] * n)
        if self.end == "":
            self._find_final(events)

    def _find_final(self, events: bytes) -> None:
        for kind, after_sep, name in _FINALS:
            if events.startswith(kind):
                start = 0
            elif (at := events.find(after_sep)) >= 0:
                start = at + 2
            else:
                continue
            event = events[start: events.find(_SEP, start)]
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            self.end = name
            try:
                self.final = json.loads(b"\n".join(data))
            except ValueError:
                self.final = None  # a final event we cannot read still ends the stream
            return

    @property
    def body(self) -> bytes:
        """The whole body of an answer that is not an event stream."""
        return b"".join(self._body)

    def result(self) -> dict[str, Any] | None:
        """The answer's JSON: the ``done`` or ``error`` event of a stream, else the body parsed
        (None when it is not a JSON object)."""
        if self.event_stream:
            return self.final
        if self.final is None:  # parsed once, kept in final
            try:
                doc = json.loads(self.body)
            except ValueError:
                doc = None
            self.final = doc if isinstance(doc, dict) else {}
        return self.final or None

    def outcome(self, done_s: float, t0: float = 0.0) -> tuple[str, float, int, str]:
        """What a finished answer adds to its row: (error kind, first token time, tokens,
        finish reason). Times are seconds from ``t0`` in the client clock, as ``done_s`` is.

        A stream counts its token events; without a ``done`` event it is an error
        (``stream_error`` after an ``error`` event, ``stream_incomplete`` if it just
        ended) and keeps the tokens it got. A one-piece 2xx answer has its first token
        at ``done_s`` and the ``generated_tokens`` it reports. A non-2xx answer is not
        an error kind here: its status says what went wrong, as for any request.
        """
        if self.event_stream:
            first_s = self.token_s[0] - t0 if self.token_s else math.nan
            done = self.final if self.end == "done" and isinstance(self.final, dict) else {}
            error = {"done": "", "error": "stream_error"}.get(self.end, "stream_incomplete")
            return error, first_s, len(self.token_s), str(done.get("finish_reason") or "")
        if not 200 <= self.status < 300:
            return "", math.nan, 0, ""
        doc = self.result()
        n = doc.get("generated_tokens") if doc else None
        if not isinstance(n, int):
            return "bad_answer", math.nan, 0, ""
        return "", done_s, n, str(doc.get("finish_reason") or "")

    def timing(self) -> dict[str, Any]:
        """The server's ``timing`` (``wire.TIMING_FIELDS``, ms) from the final event or body, or {}."""
        doc = self.result()
        timing = doc.get("timing") if isinstance(doc, dict) else None
        return timing if isinstance(timing, dict) else {}
