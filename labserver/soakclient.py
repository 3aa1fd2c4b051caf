"""The soak's own HTTP client and per-request record (see ``labserver.soak``).

Separate from the load generator's clients because the soak needs a request id per
request, the body read in full, and a cancel that closes the socket the way a client
that gives up does.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

@dataclass
class Record:
    i: int
    text: str
    poisoned: bool
    leave_after_s: float | None  # a leaver closes its connection this long after sending
    scheduled_s: float  # time.monotonic() it was due
    sent_s: float = math.nan
    done_s: float = math.nan
    status: int | None = None  # None: no response (it left, or an error)
    left_s: float = math.nan  # when a leaver closed its connection, time.monotonic()
    server_ms: float = math.nan  # x-server-ms
    rid_ok: bool = True  # the response carried this request's own x-request-id
    error: str = ""


class _Client:
    """Keep-alive HTTP/1.1 on asyncio streams, one request per connection at a time.

    Just enough for the soak: per-request headers (its id), the body read in full,
    and a cancel that closes the socket, which is what a client that gives up does.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def request(self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
                      on_written: Callable[[], None] | None = None) -> tuple[int, dict[str, str], bytes]:
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        data = head.encode("latin-1") + b"\r\n" + body
        for attempt in (0, 1):
            while self._idle and self._idle[-1][0].at_eof():  # the server closed it while idle
                self._close(self._idle.pop()[1])
            reused = bool(self._idle) and attempt == 0  # a retry always gets a fresh connection
            reader, writer = self._idle.pop() if reused else await self._connect()
            try:
                writer.write(data)
                if on_written is not None:
                    on_written()
                raw = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                self._close(writer)
                if reused and attempt == 0:  # an idle socket the server had closed: once more, fresh
                    continue
                raise
            except BaseException:  # cancelled (the client leaves) or worse: close, never reuse
                self._close(writer)
                raise
            try:
                status, fields = _parse_head(raw)
                payload = await reader.readexactly(int(fields.get("content-length", "0")))
            except BaseException:
                self._close(writer)
                raise
            if fields.get("connection", "").lower() == "close":
                self._close(writer)
            else:
                self._idle.append((reader, writer))
            return status, fields, payload
        raise AssertionError("unreachable")

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._open.add(writer)
        return reader, writer

    def _close(self, writer: asyncio.StreamWriter) -> None:
        writer.close()  # FIN: the server reads the request it has, then sees the client gone

    def drop_idle(self) -> None:
        while self._idle:
            self._close(self._idle.pop()[1])

    async def aclose(self) -> None:
        self.drop_idle()
        for writer in self._open:
            writer.close()
        for writer in self._open:
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self._open.clear()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    return status, fields
