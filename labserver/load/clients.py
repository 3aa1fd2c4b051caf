"""The load generator's HTTP clients: a minimal raw HTTP/1.1 one and an httpx one.

Both send one fixed kind of request (method, path, content type) over keep-alive
connections, one request per connection at a time, and answer ``(status, headers)``
or raise ``RequestFailed(kind)`` with a short error kind. ``StreamClient``, the raw
one that also reads bodies, answers a ``labserver.load.sse.Answer`` (or, for OpenAI
streams, a ``labserver.load.openai_sse.OpenAIAnswer``) instead: the body read as it arrives, with the time of each token event of a stream (generation) or
the whole body (the soak reads ``/stats`` and its answers with it). They know nothing
of schedules or records; ``labserver.loadgen`` and the soak drive them.

Why a raw client at all: on a 2-core machine httpx tops out near 500-1000 requests/s
and gets slower as its pool grows (its pool scans every connection per request), so
it would measure itself rather than the server. The raw client parses responses
with httptools (which uvicorn uses too) and sustains several thousand requests/s on
one core. httpx stays available (``client="httpx"``) as a well-known reference and
for https.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

from .sse import Answer

logger = logging.getLogger(__name__)

__all__ = ["CLIENTS", "HttpxClient", "RawClient", "RequestFailed", "StreamClient", "check_target"]


class RequestFailed(Exception):
    """A request that got no (complete) HTTP response; ``kind`` is the short name recorded.
    ``partial`` is the ``Answer`` so far when the headers had come (a stream that broke off)."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.partial: Answer | None = None


def check_target(url: str, allow_remote: bool = False) -> tuple[str, str, int]:
    """Validate ``url`` and return (scheme, host, port); refuse non-loopback hosts
    unless ``allow_remote`` (a load generator aimed at the wrong host is an attack)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like 'http://127.0.0.1:8000/...', got {url!r}")
    host = parts.hostname
    if not allow_remote and not _is_loopback(host):
        raise ValueError(
            f"{host!r} is not a loopback address: the load generator only targets "
            "127.0.0.0/8, ::1 and localhost unless you pass allow_remote=True "
            "(do that only for servers you run or are allowed to load)")
    return parts.scheme, host, parts.port or (443 if parts.scheme == "https" else 80)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name could resolve anywhere


class _Connection(asyncio.Protocol):
    """One keep-alive connection; httptools calls the on_* methods while parsing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[int] | None = None
        self.headers: dict[str, str] = {}
        self.got_bytes = False  # any response byte since the request went out
        self.keep_alive = False
        self.lost = False
        self.answer: Answer | None = None  # read by _BodyConnection only

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, data: bytes, answer: Answer | None = None) -> asyncio.Future[int]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.got_bytes = False
        self.answer = answer
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RequestFailed("protocol", str(exc)))
            self.transport.abort()

    def on_message_begin(self) -> None:
        self.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only valid while still parsing
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(RequestFailed("disconnect", str(exc or "closed by peer")))

    def _fail(self, exc: RequestFailed) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)


class _BodyConnection(_Connection):
    """A connection that also reads bodies into the request's ``Answer``.

    A subclass, not a flag: httptools calls ``on_body`` only where it is defined, so
    the plain client pays nothing for it.
    """

    read_s = 0.0  # client clock of the socket read being parsed

    def data_received(self, data: bytes) -> None:
        self.read_s = time.perf_counter()  # once per read: events in one read share it
        super().data_received(data)

    def on_headers_complete(self) -> None:
        if self.answer is not None:
            self.answer.begin(self.parser.get_status_code(), self.headers)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer.feed(body, self.read_s)


class RawClient:
    """HTTP/1.1 over asyncio, keep-alive, no pipelining; plain http only.

    Connections are opened on demand (the caller bounds concurrency) and reused
    last-in-first-out, so a steady load runs on as few sockets as it needs.
    """

    _protocol: type[_Connection] = _Connection

    def __init__(self, url: str, *, method: str = "POST", content_type: str | None = None,
                 timeout_s: float = 60.0, headers: Mapping[str, str] | None = None):
        scheme, self.host, self.port = check_target(url, allow_remote=True)
        if scheme != "http":
            raise ValueError("the raw client speaks plain http; use client='httpx' for https")
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\nuser-agent: labserver-loadgen\r\n"
        if content_type:
            head += f"content-type: {content_type}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())  # (an API key: every request)
        self._head = head.encode("latin-1")
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._address: str | None = None  # resolved once, so new connections skip DNS

    async def request(self, body: bytes = b"", headers: Mapping[str, str] | None = None,
                      on_sent: Callable[[], None] | None = None) -> tuple[int, Mapping[str, str]]:
        """Send one request (``headers`` add to the fixed ones; ``on_sent`` runs once it is written)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._request(body, None, headers, on_sent)
        except TimeoutError:
            raise RequestFailed("timeout", f"no response within {self.timeout_s} s") from None

    async def _request(self, body: bytes, answer: Answer | None = None, headers: Mapping[str, str] | None = None,
                       on_sent: Callable[[], None] | None = None) -> tuple[int, Mapping[str, str]]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1") if headers else b""
        data = self._head + extra + b"content-length: %d\r\n\r\n" % len(body) + body
        for attempt in (0, 1):
            # The retry always takes a fresh connection: the other idle ones may have hit
            # the same keep-alive timeout on the server and be just as dead.
            conn = self._idle_connection() if attempt == 0 else None
            reused = conn is not None
            conn = conn or await self._connect()
            self._busy.add(conn)
            try:
                waiter = conn.send(data, answer)
                if on_sent is not None:
                    on_sent()
                status = await waiter
            except RequestFailed as exc:
                # A kept-alive socket the server closed while idle fails before any
                # byte comes back; like other clients, retry that once on a new one.
                if exc.kind == "disconnect" and reused and not conn.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.transport.abort()  # timeout or cancellation: the socket's state is unknown
                raise
            finally:
                self._busy.discard(conn)
            if conn.keep_alive and not conn.lost:
                self._idle.append(conn)
            else:
                conn.transport.close()
            return status, conn.headers
        raise AssertionError("unreachable")

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and not conn.transport.is_closing():
                return conn  # else the server closed it while idle (its keep-alive timeout)
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await loop.create_connection(self._protocol, self._address or self.host, self.port)
        except OSError as exc:
            raise RequestFailed("connect", str(exc)) from None
        if self._address is None:
            self._address = transport.get_extra_info("peername")[0]
        return conn

    def drop_idle(self) -> None:
        """Close the kept-alive connections not in use (they would count as the server's state)."""
        while self._idle:
            self._idle.pop().transport.close()

    async def aclose(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.transport.abort()
        self._idle.clear()
        self._busy.clear()


class StreamClient(RawClient):
    """The raw client that reads bodies: ``request(body)`` answers an ``Answer`` (status,
    headers, token times and final event of a stream, or the whole body). ``timeout_s``
    runs to the last byte.

    A failure after the headers came (the server dropped the connection mid-stream,
    the timeout struck mid-stream) raises ``RequestFailed`` with the answer so far in
    ``partial``, so the tokens already received are kept.
    """

    _protocol = _BodyConnection

    def __init__(self, url: str, *, answer: Callable[[], Answer] = Answer, **options: Any) -> None:
        """``answer``: what reads the body (``Answer``, or ``openai_sse.OpenAIAnswer`` for OpenAI streams)."""
        super().__init__(url, **options)
        self._answer = answer

    async def request(self, body: bytes = b"", headers: Mapping[str, str] | None = None,  # type: ignore[override]
                      on_sent: Callable[[], None] | None = None) -> Answer:
        answer = self._answer()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._request(body, answer, headers, on_sent)
        except TimeoutError:
            exc = RequestFailed("timeout", f"no complete answer within {self.timeout_s} s")
            exc.partial = answer if answer.status else None
            raise exc from None
        except RequestFailed as exc:
            exc.partial = answer if answer.status else None
            raise
        return answer


class HttpxClient:
    """The same interface over ``httpx.AsyncClient``, configured for load generation."""

    def __init__(self, url: str, *, method: str = "POST", content_type: str | None = None,
                 timeout_s: float = 60.0, max_connections: int = 1000, headers: Mapping[str, str] | None = None):
        import httpx  # only when chosen: importing it costs ~0.2 s in each spawned process

        self._httpx = httpx
        self.url, self.method = url, method
        self._headers = {**({"content-type": content_type} if content_type else {}), **(headers or {})}
        self._client = httpx.AsyncClient(
            # the default caps at 100 connections, which would queue requests inside the client
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections, keepalive_expiry=30.0),
            # pool=None: waiting for a free connection is the caller's business (it bounds
            # concurrency itself); the default 5 s would turn server queueing into client errors
            timeout=httpx.Timeout(timeout_s, pool=None),
            trust_env=False,  # no proxies from the environment between us and the server
        )

    async def request(self, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> tuple[int, Mapping[str, str]]:
        httpx = self._httpx
        try:
            r = await self._client.request(self.method, self.url, content=body or None,
                                           headers={**self._headers, **headers} if headers else self._headers)
        except httpx.TimeoutException as exc:
            raise RequestFailed("timeout", str(exc)) from None
        except httpx.ConnectError as exc:
            raise RequestFailed("connect", str(exc)) from None
        except httpx.RemoteProtocolError as exc:
            raise RequestFailed("disconnect", str(exc)) from None
        except httpx.ReadError as exc:
            raise RequestFailed("read", str(exc)) from None
        except httpx.WriteError as exc:
            raise RequestFailed("write", str(exc)) from None
        except httpx.HTTPError as exc:
            raise RequestFailed("http", str(exc)) from None
        return r.status_code, r.headers

    async def aclose(self) -> None:
        await self._client.aclose()


CLIENTS = {"raw": RawClient, "httpx": HttpxClient}
