"""A ZeroMQ socket driven straight from the event loop's reader callback.

``zmq.asyncio`` wraps every send and receive in futures and poller events (~0.1 ms a message in
Python); a daemon that forwards every message twice cannot afford that. Here the socket's
notification descriptor is watched with ``loop.add_reader``; messages are drained with
non-blocking receives and handed to a plain callback; sends are non-blocking too (the sockets
have no high-water mark, so a send never has to wait).

ZeroMQ's descriptor is edge-triggered: it signals a change, not readability. So the drain runs
until ``EVENTS`` has no POLLIN, and every send re-checks, because a send can consume the edge
that announced an incoming message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

BATCH = 256
"""Messages handled per callback before yielding to other loop work."""

# Plain ints: pyzmq's enum members build a new flag object on every ``&`` and ``|``.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_NOBLOCK_MORE = _NOBLOCK | int(zmq.SNDMORE)
_BUFFERS = (bytes, zmq.Frame, memoryview)
# The Cython backend (CPython's) tells on each received frame whether more follow; the cffi one
# leaves Frame.more unset, so there the socket is asked.
_FRAME_KNOWS_MORE = zmq.backend.Socket.__module__.startswith("zmq.backend.cython")


class LoopSocket:
    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[zmq.Frame]], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = loop or asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self.loop.add_reader(self._fd, self._drain)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        sock = self.sock
        for _ in range(BATCH):
            if sock.closed or not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = _recv_message(sock)
            except zmq.Again:
                return
            try:
                self.on_message(frames)
            except Exception:  # one bad message must not stop the socket
                log.exception("error handling a message")
        self._schedule()

    def send(self, frames: list[Any]) -> None:
        """Send now; raises zmq.ZMQError (e.g. EHOSTUNREACH on a ROUTER_MANDATORY socket, on the
        first frame) or TypeError (a frame that is not a buffer), with nothing sent.

        send_multipart's sends, with int flags: it ORs pyzmq's flag enums for every frame, which
        costs as much as the sends themselves for small frames. As there, every frame is checked
        before the first goes out: a half-sent message would be completed by the next send's
        frames (on a ROUTER, delivered to the wrong peer)."""
        for frame in frames:
            if not isinstance(frame, _BUFFERS):
                memoryview(frame)  # TypeError for what is not a buffer
        sock = self.sock
        *head, last = frames
        try:
            for frame in head:
                sock.send(frame, _NOBLOCK_MORE, copy=False)
            sock.send(last, _NOBLOCK, copy=False)
        finally:
            # A send, failed ones too, processes the socket's commands and so may take the edge
            # off its FD with a message already in: read it without waiting for the next edge.
            if not sock.closed and sock.getsockopt(_EVENTS) & _POLLIN:
                self._schedule()

    def close(self, linger_ms: int = 0) -> None:
        if not self.sock.closed:
            self.loop.remove_reader(self._fd)
            self.sock.close(linger=linger_ms)


def _recv_message(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """The next whole message (zmq.Again when there is none); its frames are all there once the
    first is. recv_multipart asks the socket for RCVMORE after every frame, where the frame knows."""
    if not _FRAME_KNOWS_MORE:
        return sock.recv_multipart(_NOBLOCK, copy=False)
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


class SocketEvents:
    """Calls ``on_event(event)`` (``zmq.utils.monitor`` dicts) for ``events`` of ``sock``, read on the loop.

    Close it before the socket's context is terminated.
    """

    def __init__(self, sock: zmq.Socket[Any], events: int, on_event: Callable[[Any], None]) -> None:
        self.sock = sock
        self.on_event = on_event
        self.monitor = LoopSocket(sock.get_monitor_socket(events),
                                  lambda frames: on_event(parse_monitor_message([f.bytes for f in frames])))

    def catch_up(self) -> None:
        """Handle the events already queued, now: a loop that only runs during calls (the blocking
        client's) must not take an event from before a call for one that happened during it."""
        self.monitor._drain()

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close()
