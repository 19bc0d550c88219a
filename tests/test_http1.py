"""The lean HTTP/1.1 client against a raw TCP server that writes answers byte by byte as each
test scripts them: every framing (Content-Length, chunked with extensions and trailers, read to
close), keep-alive reuse, the stale-connection retry, the connection bound, cancel closing the
connection, and answers that are not HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from inference_support import wait_until
from support.loop import run

from rolloutd.daemon.inference.http1 import BadResponse, HTTP1Client

Handler = Callable[[bytes, asyncio.StreamWriter, "RawServer"], Awaitable[bool]]
"""Answers one request (its head and body); returns False to close the connection afterwards."""


class RawServer:
    """A TCP server on 127.0.0.1 that reads HTTP/1.1 requests and lets ``handler`` write raw bytes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.requests: list[bytes] = []
        self.eofs = 0
        self.generation = 0
        """Raised to play a restart: older connections close on their next request, unanswered."""
        self.unanswered = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        self.writers.append(writer)
        generation = self.generation
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.eofs += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if generation < self.generation:
                    self.unanswered += 1
                    return
                if not await self.handler(request, writer, self):
                    return
        except ConnectionError:
            self.eofs += 1
        finally:
            self.open -= 1
            writer.close()


async def _bytewise(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write one byte at a time with a flush in between, so every parse state meets a split."""
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        await writer.drain()
        await asyncio.sleep(0)


def _answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def _echo(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
    writer.write(_answer(request.split(b"\r\n", 1)[0]))
    return True


def test_content_length_chunked_and_read_to_close_bodies_split_anywhere() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;ext=1\r\nhello\r\n19\r\n, chunked world of twenty\r\n0\r\nX-Trailer: t\r\n\r\n")
    answers = {
        b"/length": _answer(b'{"a": 1}', b"X-Other: y\r\n"),
        b"/chunked": chunked,
        b"/close": b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
        b"/continue": b"HTTP/1.1 100 Continue\r\n\r\n" + _answer(b"after 100"),
        b"/empty": b"HTTP/1.1 204 No Content\r\n\r\n",
    }

    async def handler(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
        path = request.split(b" ")[1]
        await _bytewise(writer, answers[path])
        return path != b"/close"

    async def scenario() -> None:
        async with RawServer(handler) as server:
            client = HTTP1Client(server.url, headers={"Authorization": "Bearer k"})
            try:
                assert await client.request("POST", "/length", b"{}") == (200, b'{"a": 1}')
                assert await client.request("GET", "/chunked") == (200, b"hello, chunked world of twenty")
                assert await client.request("GET", "/continue") == (200, b"after 100")
                assert await client.request("GET", "/empty") == (204, b"")
                assert server.connections == 1  # all four on one keep-alive connection
                assert await client.request("GET", "/close") == (200, b"until the end")
                assert await client.request("POST", "/length", b"{}") == (200, b'{"a": 1}')
                assert server.connections == 2  # a body read to the close ends its connection
            finally:
                client.close()
            first = server.requests[0]
            assert first.startswith(b"POST /length HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"Authorization: Bearer k\r\n" in first and first.endswith(b"Content-Length: 2\r\n\r\n{}")
    run(scenario())


def test_connection_close_header_is_honoured_and_keep_alive_reuses() -> None:
    async def handler(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
        close = b"/close" in request.split(b"\r\n", 1)[0]
        writer.write(_answer(b"x", b"Connection: close\r\n" if close else b""))
        return not close

    async def scenario() -> None:
        async with RawServer(handler) as server:
            client = HTTP1Client(server.url)
            try:
                for _ in range(5):
                    assert await client.request("GET", "/a") == (200, b"x")
                assert server.connections == 1
                await client.request("GET", "/close")
                await client.request("GET", "/a")
                assert server.connections == 2
            finally:
                client.close()
    run(scenario())


def test_a_stale_keep_alive_connection_is_retried_once_on_a_fresh_one() -> None:
    """The server "restarts": every connection it had closes, unanswered, when a request arrives
    on it (the race a reused keep-alive socket loses). The request goes again on a new connection,
    and the other idle connections, stale too, are dropped rather than failing one call each."""
    async def scenario() -> None:
        async with RawServer(_echo) as server:
            client = HTTP1Client(server.url)
            try:
                await asyncio.gather(*(client.request("GET", "/a") for _ in range(3)))
                assert server.connections == 3
                server.generation += 1
                assert await client.request("GET", "/a") == (200, b"GET /a HTTP/1.1")
                assert server.unanswered == 1 and server.connections == 4
                answers = await asyncio.gather(*(client.request("GET", "/b") for _ in range(2)))
                assert answers == [(200, b"GET /b HTTP/1.1")] * 2
                assert server.unanswered == 1  # the two other stale connections were not tried
            finally:
                client.close()
    run(scenario())


def test_a_reset_after_part_of_the_answer_is_an_error_not_a_retry() -> None:
    async def handler(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async def scenario() -> None:
        async with RawServer(handler) as server:
            client = HTTP1Client(server.url)
            try:
                with pytest.raises(ConnectionResetError, match="after 47 bytes"):
                    await client.request("POST", "/a", b"{}")
                assert len(server.requests) == 1  # not sent twice
            finally:
                client.close()
    run(scenario())


@pytest.mark.parametrize("answer,message", [
    (b"SSH-2.0-OpenSSH_9\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "Content-Length is not a number"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "several Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n", "not followed by CRLF"),
    (b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", "without ':'"),
])
def test_answers_that_are_not_http_are_clear_errors(answer: bytes, message: str) -> None:
    async def handler(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async def scenario() -> None:
        async with RawServer(handler) as server:
            client = HTTP1Client(server.url)
            try:
                with pytest.raises(BadResponse, match=message):
                    await client.request("GET", "/a")
                assert client.open_connections == 0
            finally:
                client.close()
    run(scenario())


def test_connections_are_bounded_and_requests_past_the_bound_wait() -> None:
    async def handler(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
        await asyncio.sleep(0.05)
        writer.write(_answer(b"ok"))
        return True

    async def scenario() -> None:
        async with RawServer(handler) as server:
            client = HTTP1Client(server.url, max_connections=2)
            try:
                answers = await asyncio.gather(*(client.request("GET", "/a") for _ in range(8)))
                assert answers == [(200, b"ok")] * 8
                assert server.max_open == 2 and server.connections == 2
            finally:
                client.close()
    run(scenario())


async def _slow_or_ok(request: bytes, writer: asyncio.StreamWriter, server: RawServer) -> bool:
    """Holds ``/slow`` unanswered (30 s, past every test's wait); answers anything else at once."""
    if b"/slow" in request:
        await asyncio.sleep(30)
    writer.write(_answer(b"ok"))
    return True


def test_cancel_closes_the_connection_so_the_server_sees_it() -> None:
    async def scenario() -> None:
        async with RawServer(_slow_or_ok) as server:
            client = HTTP1Client(server.url)
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await client.request("GET", "/slow")
                assert client.open_connections == 0
                assert await client.request("GET", "/fast") == (200, b"ok")
                assert server.connections == 2  # the cancelled one was not reused
            finally:
                client.close()
    run(scenario())


def test_closing_the_client_fails_waiting_requests_without_sending_them_again() -> None:
    """What the inference pool relies on when it closes a removed server: a request waiting on a
    reused keep-alive connection fails, and is not taken for a stale connection and sent again."""
    async def scenario() -> None:
        async with RawServer(_slow_or_ok) as server:
            client = HTTP1Client(server.url)
            assert await client.request("GET", "/fast") == (200, b"ok")
            waiting = asyncio.create_task(client.request("GET", "/slow"))  # on the same, reused connection
            await wait_until(lambda: len(server.requests) == 2, what="the server holding /slow")
            client.close()
            with pytest.raises(ConnectionError, match="client of .* is closed"):
                await asyncio.wait_for(waiting, 5)
            assert server.connections == 1 and len(server.requests) == 2
    run(scenario())


def test_refused_and_unreachable_are_connection_errors() -> None:
    async def scenario() -> None:
        async with RawServer(_echo) as server:
            url = server.url
        client = HTTP1Client(url)
        with pytest.raises(ConnectionError, match="cannot connect"):
            await client.request("GET", "/a")
        # 192.0.2.0/24 is reserved for documentation: nothing answers there.
        client = HTTP1Client("http://192.0.2.1:9", connect_timeout_s=0.2)
        with pytest.raises(ConnectionError, match=r"within 0.2s|cannot connect"):
            await client.request("GET", "/a")
        with pytest.raises(ValueError, match="not an http"):
            HTTP1Client("ftp://h/")
    run(scenario())
