"""The load generator's raw clients (labserver.load.clients) against small hand-written servers."""

from __future__ import annotations

import asyncio

from labserver.load.clients import StreamClient


def test_client_never_sends_on_a_connection_the_server_closed() -> None:
    """Connections the server drops while idle (keep-alive timeout) must not cost a request."""
    async def main() -> int:
        served = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal served
            await reader.readuntil(b"\r\n\r\n")
            served += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # keep-alive implied ...
            await writer.drain()
            writer.close()  # ... and the connection closed anyway, as after an idle timeout
            await writer.wait_closed()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = StreamClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", method="GET")
        try:
            for pause_s in (0.05, 0.0, 0.05):  # the close seen while idle, or only when used
                answers = await asyncio.gather(*(client.request() for _ in range(4)))
                assert [(a.status, a.body) for a in answers] == [(200, b"ok")] * 4
                await asyncio.sleep(pause_s)
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        return served

    assert asyncio.run(main()) == 12


def test_per_request_headers_and_the_sent_callback() -> None:
    """The soak sends its own request id per request and starts a leaver's patience once the request is out."""
    async def main() -> tuple[list[bytes], list[str]]:
        heads: list[bytes] = []
        events: list[str] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            events.append("server read")
            heads.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\nx-request-id: r-1\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = StreamClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", content_type="text/plain")
        try:
            answer = await client.request(b"hi", {"x-request-id": "r-1"}, lambda: events.append("sent"))
            assert answer.status == 200 and answer.headers["x-request-id"] == "r-1"
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()
        return heads, events

    heads, events = asyncio.run(main())
    assert b"x-request-id: r-1\r\n" in heads[0] and b"content-length: 2\r\n" in heads[0]
    assert events == ["sent", "server read"]
