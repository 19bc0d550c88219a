"""A message link over one Unix stream socket, driven from the event loop.

Used between the supervisor and each worker (a socketpair made at spawn). Compared with a ZeroMQ
ipc socket it saves the two I/O-thread hand-offs per message: a send is one ``sendmsg`` that
wakes the peer's event loop directly. On a machine with few cores that halves the context
switches of a request, which is most of its latency.

Message encoding: ``<u32 frame count><u64 length>... <frame bytes>...``; frames are sent with
scatter-gather, so large array frames are not joined into one buffer on the sending side.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")
MAX_IOV = 1024
READ_CHUNK = 1 << 18
"""Bytes one read takes at most, into a buffer kept for the link's life: ``recv(n)`` would
allocate ``n`` bytes for every read, which at 1 MiB cost ~50 us a message (most of a small
request's handling)."""


@functools.lru_cache(maxsize=64)
def _head(count: int) -> struct.Struct:
    """A message's head: its frame count and each frame's length."""
    return struct.Struct(f"<I{count}Q")


@functools.lru_cache(maxsize=64)
def _lengths(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")


class UnixLink:
    def __init__(self, sock: socket.socket, on_message: Callable[[list[memoryview]], None],
                 on_close: Callable[[], None] | None = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.on_message = on_message
        self.on_close = on_close
        self.loop = loop or asyncio.get_running_loop()
        self._rbuf = bytearray()
        self._chunk = memoryview(bytearray(READ_CHUNK))
        self._pending: deque[memoryview] = deque()
        self._writing = False
        self._poller: select.poll | None = None
        """For :meth:`read_until`, made on its first call."""
        self.closed = False
        self.loop.add_reader(sock.fileno(), self._on_readable)

    # --- sending -----------------------------------------------------------------------------

    def send(self, frames: list[Any]) -> None:
        if self.closed:
            raise ConnectionError("link closed")
        views = [memoryview(f if isinstance(f, (bytes, bytearray, memoryview)) else f.buffer).cast("B")
                 for f in frames]
        lengths = [len(v) for v in views]
        head = memoryview(_head(len(views)).pack(len(views), *lengths))
        if not self._pending and len(views) < MAX_IOV:
            # The usual case, nothing queued: one sendmsg, and nothing to queue when it took all.
            try:
                sent = self.sock.sendmsg([head, *views])
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close()
                return
            if sent == len(head) + sum(lengths):
                return
            self._pending.append(head)
            self._pending.extend(v for v in views if len(v))
            self._consume(sent)
        else:
            self._pending.append(head)
            self._pending.extend(v for v in views if len(v))
        if not self._writing:
            self._flush()

    def _consume(self, sent: int) -> None:
        """Drop ``sent`` bytes from the front of the queue."""
        while sent and self._pending:
            first = self._pending[0]
            if sent >= len(first):
                sent -= len(first)
                self._pending.popleft()
            else:
                self._pending[0] = first[sent:]
                sent = 0

    def _flush(self) -> None:
        while self._pending:
            batch = [self._pending[i] for i in range(min(MAX_IOV, len(self._pending)))]
            try:
                sent = self.sock.sendmsg(batch)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close()
                return
            self._consume(sent)
            if self._pending and not sent:
                break
        want_write = bool(self._pending)
        if want_write and not self._writing:
            self.loop.add_writer(self.sock.fileno(), self._flush)
        elif not want_write and self._writing:
            self.loop.remove_writer(self.sock.fileno())
        self._writing = want_write

    # --- receiving ---------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            n = self.sock.recv_into(self._chunk)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if not n:
            self._close()
            return
        self._rbuf += self._chunk[:n]
        self._parse()

    def _parse(self) -> None:
        buf = self._rbuf
        pos = 0
        while True:
            if len(buf) - pos < _COUNT.size:
                break
            (count,) = _COUNT.unpack_from(buf, pos)
            lens_end = pos + _COUNT.size + count * _LEN.size
            if len(buf) < lens_end:
                break
            lengths = _lengths(count).unpack_from(buf, pos + _COUNT.size)
            end = lens_end + sum(lengths)
            if len(buf) < end:
                break
            # Frames are copied out of the read buffer once (it is reused for the next messages);
            # through a view, since a slice of a bytearray is a copy of its own.
            data = bytes(memoryview(buf)[lens_end:end])
            view, frames, off = memoryview(data), [], 0
            for n in lengths:
                frames.append(view[off : off + n])
                off += n
            pos = end
            try:
                self.on_message(frames)
            except Exception:
                log.exception("error handling a message")
        if pos:
            del buf[:pos]

    def read_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Read and handle this link's messages in the caller's thread, outside the event loop,
        until ``done()`` or ``timeout_s``; whether done. For a blocking caller whose loop is not
        running: a round of the loop per message (a task, the selector, the stop callback) costs
        more than the message itself. A link that closes meanwhile ends the wait: its ``on_close``
        has told the waiters."""
        deadline = time.monotonic() + timeout_s
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock.fileno(), select.POLLIN)
        poller = self._poller
        while not done() and not self.closed:
            left_ms = math.ceil(1e3 * (deadline - time.monotonic()))
            if left_ms <= 0:
                return False
            if poller.poll(left_ms):
                self._on_readable()
        return done()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        if self._writing:
            self.loop.remove_writer(self.sock.fileno())
        self.sock.close()
        if self.on_close is not None:
            self.on_close()

    def close(self) -> None:
        self._close()
