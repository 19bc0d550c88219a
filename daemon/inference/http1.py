"""A lean HTTP/1.1 client on the event loop for the inference calls to one server: keep-alive
connections, an optional bound on how many, a connect deadline, and Content-Length, chunked and
read-to-close bodies.

Why not aiohttp here: a generate call through aiohttp costs several times the client CPU of this
``asyncio.Protocol`` that parses the one answer it waits for (bench/inference_overhead.py measures
both in one run). One request per connection at a time, never pipelined, so a server that closes
early costs only that request. The caller's deadline (``asyncio.timeout``) bounds the exchange; an
exchange that is cancelled or times out closes its connection, which is how vLLM and SGLang learn
to drop the request. A reused keep-alive connection that the server had already closed (as after
its restart) raises nothing: the request goes again, once, on a fresh connection, and the other
idle connections, stale together, are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from typing import cast
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})


class StaleConnection(ConnectionError):
    """A reused keep-alive connection closed before any byte of the answer: the server had closed
    it while idle, so the request can go again on a fresh connection."""


class BadResponse(ConnectionError):
    """The bytes on the connection are not an HTTP/1.x answer (the connection is closed)."""


class _Connection(asyncio.Protocol):
    """One TCP connection and the parse state of the answer it waits for."""

    def __init__(self, client: HTTP1Client) -> None:
        self._client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._keep_alive = True
        self._length = -1
        """Content-Length of the body; -1 chunked or read to close."""
        self._chunked = False
        self._in_body = False
        self._parts: list[bytes] = []
        self._received = 0
        self._head_only = False

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            # Bytes nobody asked for: the connection no longer frames answers we can trust.
            self.close()
            return
        self._received += len(data)
        self._buf += data
        try:
            self._parse()
        except BadResponse as e:
            self._fail(e)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost finishes or fails the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client._forget(self)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._in_body and not self._chunked and self._length < 0:
            self._parts.append(bytes(self._buf))
            waiter.set_result((self._status, b"".join(self._parts)))
        elif self._received == 0 and self.reused:
            waiter.set_exception(StaleConnection("the server had closed the idle keep-alive connection"))
        else:
            waiter.set_exception(ConnectionResetError(
                f"the server closed the connection after {self._received} bytes of the answer"
                + (f" ({exc})" if exc else "")))

    # --- one exchange ------------------------------------------------------------------------

    async def exchange(self, request: bytes, *, head_only: bool) -> tuple[int, bytes, bool]:
        """Send ``request``; return (status, body, keep-alive)."""
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self._parts = []
        self._received = 0
        self._in_body = False
        self._head_only = head_only
        self.transport.write(request)
        try:
            status, body = await self._waiter
        except BaseException:
            self.close()  # a cancelled or failed exchange never leaves a half-read answer behind
            raise
        finally:
            self._waiter = None
        return status, body, self._keep_alive and not self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._client._forget(self)
            if self.transport is not None:
                self.transport.abort()

    def _fail(self, error: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)
        self.close()

    def _finish(self) -> None:
        if self._buf:
            self._keep_alive = False  # bytes past the answer: not safe to reuse
        assert self._waiter is not None
        self._waiter.set_result((self._status, b"".join(self._parts)))

    # --- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        while not self._in_body:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD_BYTES:
                    raise BadResponse(f"no end of the answer's head within {_MAX_HEAD_BYTES} bytes")
                return
            head = bytes(self._buf[:end])
            del self._buf[:end + 4]
            if not self._read_head(head):
                continue  # an informational 1xx answer; the real one follows
            self._in_body = True
        if self._chunked:
            self._parse_chunks()
        elif self._length >= 0:
            if len(self._buf) >= self._length:
                self._parts.append(bytes(self._buf[:self._length]))
                del self._buf[:self._length]
                self._finish()

    def _read_head(self, head: bytes) -> bool:
        """Take the status and framing from the head; False for a 1xx answer."""
        lines = head.split(b"\r\n")
        fields = lines[0].split(b" ", 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(fields[1])
        if 100 <= status < 200:
            return False
        self._status = status
        self._keep_alive = fields[0] == b"HTTP/1.1"
        self._length = -1
        self._chunked = False
        lengths = set()
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise BadResponse(f"a header line without ':' in the answer: {line[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit():
                    raise BadResponse(f"Content-Length is not a number: {value[:40]!r}")
                lengths.add(int(value))
            elif name == b"transfer-encoding":
                self._chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                if b"close" in tokens:
                    self._keep_alive = False
                elif b"keep-alive" in tokens:
                    self._keep_alive = True
        if len(lengths) > 1:
            raise BadResponse(f"the answer gives several Content-Length values: {sorted(lengths)}")
        if self._head_only or status in _NO_BODY_STATUS:
            self._chunked, self._length = False, 0
        elif not self._chunked:
            if lengths:
                self._length = lengths.pop()
            else:
                self._keep_alive = False  # the body ends when the server closes
        return True

    def _parse_chunks(self) -> None:
        buf = self._buf
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                return
            size_text = bytes(buf[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise BadResponse(f"not a chunk size: {size_text[:40]!r}") from None
            if size == 0:
                # Trailers (ignored) end with an empty line; with none, it follows at once.
                rest = line_end + 2
                if buf[rest:rest + 2] == b"\r\n":
                    del buf[:rest + 2]
                else:
                    trailers_end = buf.find(b"\r\n\r\n", rest)
                    if trailers_end < 0:
                        return
                    del buf[:trailers_end + 4]
                self._finish()
                return
            start = line_end + 2
            if len(buf) < start + size + 2:
                return
            if buf[start + size:start + size + 2] != b"\r\n":
                raise BadResponse("a chunk is not followed by CRLF")
            self._parts.append(bytes(buf[start:start + size]))
            del buf[:start + size + 2]


class HTTP1Client:
    """Keep-alive HTTP/1.1 to one server (``base_url``: http or https, host, port, optional path
    prefix). ``max_connections`` 0 means unlimited: every request in flight holds one connection;
    otherwise requests past the bound wait for a free one."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None, max_connections: int = 0,
                 connect_timeout_s: float = 5.0, idle_timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl_module.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        lines = [f"Host: {host}:{self._port}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._headers = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._slots = asyncio.Semaphore(max_connections) if max_connections > 0 else None
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._closed = False

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """(status, body) of one exchange. Raises ``ConnectionError`` (an ``OSError``) when the
        server cannot be reached, drops the connection mid-answer or answers outside HTTP/1.x."""
        length = f"Content-Length: {len(body)}\r\n" if body or method != "GET" else ""
        request = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._headers \
            + length.encode() + b"\r\n" + body
        head_only = method == "HEAD"
        if self._slots is None:
            return await self._send(request, head_only)
        async with self._slots:
            return await self._send(request, head_only)

    async def _send(self, request: bytes, head_only: bool) -> tuple[int, bytes]:
        conn = self._idle_connection()
        if conn is None:
            conn = await self._connect()
        try:
            status, body, keep = await conn.exchange(request, head_only=head_only)
        except StaleConnection as e:
            logger.info("%s:%s had closed %d idle connection(s) (%s); sending again on a fresh one",
                        self._host, self._port, len(self._idle) + 1, e)
            self._drop_idle()  # closed together (the server restarted): each would fail once more
            conn = await self._connect()
            status, body, keep = await conn.exchange(request, head_only=head_only)
        if keep:
            conn.reused = True
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()
        return status, body

    def _idle_connection(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be stale
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self._idle_timeout_s:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            # A request still waiting when the client closed must fail, not reopen the server
            # (its stale-connection retry would otherwise send it again).
            raise ConnectionError(f"the client of {self._host}:{self._port} is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self), self._host, self._port,
                                                       ssl=self._ssl)
        except TimeoutError as e:
            raise ConnectionError(f"no connection to {self._host}:{self._port} within "
                                  f"{self._connect_timeout_s}s (connect_timeout_s)") from e
        except OSError as e:
            raise ConnectionError(f"cannot connect to {self._host}:{self._port}: {e}") from e
        self._all.add(conn)
        return conn

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @property
    def open_connections(self) -> int:
        return len(self._all)

    def close(self) -> None:
        """Close every connection: requests waiting on one fail with ``ConnectionError``."""
        self._closed = True
        self._idle = []
        for conn in list(self._all):
            conn.close()
