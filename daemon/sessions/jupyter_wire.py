"""The Jupyter messaging protocol (v5.3), spoken straight over ZeroMQ from the event loop.

A message on the wire is ``[*routing, b"<IDS|MSG>", signature, header, parent_header, metadata,
content, *buffers]``: the four dicts as JSON, the signature the hex HMAC-SHA256 of those four
frames under the connection file's key. The kernel drops a message whose signature is wrong and
so do we.

jupyter_client's ``AsyncKernelClient`` does the same job, but each client brings a ZeroMQ context
with two threads, traitlets objects, a future-and-poller per receive and an ISO-date parse of
every header: about 22 ms of daemon CPU to reach a started kernel and 3 ms per cell, measured in
the daemon during a rollout run. Every rollout starts a kernel, so that cost is per rollout.
Here the sockets share the process's context and are read by the loop's reader callback
(``LoopSocket``); headers stay plain dicts. The tests check the framing and signatures against
jupyter_client's own ``Session``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import zmq

from rolloutd.native_io.zmq_loop import LoopSocket
from rolloutd.native_io.zmq_sockets import make_socket

log = logging.getLogger(__name__)

DELIMITER = b"<IDS|MSG>"
PROTOCOL_VERSION = "5.3"
RECONNECT_IVL_MS = 10
"""How often a channel retries a connect that failed: over ipc the session connects once the
kernel's socket files exist (``ipython``), but bind() makes the file a moment before listen()
accepts, and over tcp nothing tells when the kernel has bound. ZeroMQ's default, 100 ms, kept a
starting kernel's first answer waiting up to that long after the kernel was up."""


@dataclass(slots=True)
class KernelMessage:
    msg_type: str
    msg_id: str
    parent_id: str | None
    """``msg_id`` of the request this message answers or reports on (None for unsolicited ones)."""
    content: dict[str, Any]


class MessageSigner:
    """Builds and checks signed messages for one connection key and session."""

    def __init__(self, key: bytes, *, username: str = "rolloutd") -> None:
        self._key = key
        self.session = uuid.uuid4().hex
        self._username = username
        self._counter = itertools.count()

    def _sign(self, parts: list[bytes]) -> bytes:
        if not self._key:
            return b""
        # One C call over the joined frames: hmac.new() + update() per frame is 4x the Python work.
        return hmac.digest(self._key, b"".join(parts), "sha256").hex().encode()

    def request(self, msg_type: str, content: dict[str, Any]) -> tuple[str, list[bytes]]:
        """(msg_id, frames) of a new request."""
        msg_id = f"{self.session}_{next(self._counter)}"
        header = {"msg_id": msg_id, "msg_type": msg_type, "session": self.session, "username": self._username,
                  "date": datetime.now(timezone.utc).isoformat(), "version": PROTOCOL_VERSION}
        parts = [_dump(header), b"{}", b"{}", _dump(content)]
        return msg_id, [DELIMITER, self._sign(parts), *parts]

    def parse(self, frames: list[bytes]) -> KernelMessage | None:
        """The message in ``frames``; None (logged) when it is malformed or wrongly signed."""
        try:
            at = frames.index(DELIMITER)
            signature, header, parent, _metadata, content = frames[at + 1:at + 6]
        except ValueError:
            log.warning("dropping a kernel message without the %r delimiter or its 5 frames", DELIMITER)
            return None
        if self._key and not hmac.compare_digest(signature, self._sign(frames[at + 2:at + 6])):
            log.warning("dropping a kernel message with a bad signature")
            return None
        try:
            h, p = json.loads(header), json.loads(parent)
            return KernelMessage(h["msg_type"], h["msg_id"], p.get("msg_id"), json.loads(content))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("dropping an unreadable kernel message: %s", e)
            return None


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def channel_address(connection: dict[str, Any], port_key: str) -> str:
    """ZeroMQ address of one channel, as jupyter_client writes it (ipc: ``<ip>-<port>``)."""
    ip, port = connection["ip"], connection[port_key]
    return f"ipc://{ip}-{port}" if connection["transport"] == "ipc" else f"tcp://{ip}:{port}"


class KernelChannels:
    """The shell, iopub and control channels of one kernel; replies wait in per-channel queues."""

    PORTS = ("shell_port", "iopub_port", "control_port")
    """The connection's ports these channels use, in that order."""

    def __init__(self, connection: dict[str, Any]) -> None:
        if connection.get("signature_scheme", "hmac-sha256") != "hmac-sha256":
            raise ValueError(f"unsupported signature scheme {connection['signature_scheme']!r}")
        self.signer = MessageSigner(connection["key"].encode())
        ctx = zmq.Context.instance()
        self.shell_replies: asyncio.Queue[KernelMessage] = asyncio.Queue()
        self.iopub_messages: asyncio.Queue[KernelMessage] = asyncio.Queue()
        self._sockets: list[LoopSocket] = []
        sub = make_socket(ctx, zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock, port_key, queue in zip((make_socket(ctx, zmq.DEALER), sub, make_socket(ctx, zmq.DEALER)),
                                         self.PORTS, (self.shell_replies, self.iopub_messages, None)):
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.connect(channel_address(connection, port_key))
            self._sockets.append(LoopSocket(sock, self._receiver(queue)))
        self.shell, self.iopub, self.control = self._sockets

    def _receiver(self, queue: asyncio.Queue[KernelMessage] | None) -> Callable[[list[zmq.Frame]], None]:
        """Parse into ``queue``; None: read and drop (control replies: an interrupt is judged by the
        cell's own idle status on iopub)."""
        def on_message(frames: list[zmq.Frame]) -> None:
            msg = self.signer.parse([f.bytes for f in frames])
            if msg is not None and queue is not None:
                queue.put_nowait(msg)
        return on_message

    def send(self, channel: LoopSocket, msg_type: str, content: dict[str, Any]) -> str:
        msg_id, frames = self.signer.request(msg_type, content)
        channel.send(frames)
        return msg_id

    def execute(self, code: str) -> str:
        """Send ``code`` as a cell on the shell channel (no stdin, not stopping the queue on an
        error); its message id."""
        return self.send(self.shell, "execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False,
            "stop_on_error": False})

    @staticmethod
    async def next(queue: asyncio.Queue[KernelMessage], timeout_s: float) -> KernelMessage:
        """The next message of ``queue``; TimeoutError after ``timeout_s``."""
        if not queue.empty():
            return queue.get_nowait()
        async with asyncio.timeout(timeout_s):
            return await queue.get()

    @staticmethod
    def drain(queue: asyncio.Queue[KernelMessage]) -> None:
        while not queue.empty():
            queue.get_nowait()

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
