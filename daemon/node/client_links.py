"""A worker's own links to the clients of its node: the commands of a leased sandbox
(``wire.DIRECT_OPS``) come here straight from the client, not through the supervisor.

Why: through the supervisor a command crosses two more processes and ZeroMQ's I/O threads each
way, which cost several times the command itself (`bench/client_latency.py`). The supervisor
still accepts, books and answers every other request, the leases (``sandbox.open``/``close``)
included; it binds this worker's listening socket (its run folder, mode 0600) and hands it over
at spawn, and names it in the answer to ``sandbox.open`` when the client is on this node.

Promises, as on the supervisor's socket: only the daemon's user (or root) may connect
(SO_PEERCRED); every accepted id gets exactly one answer and a repeat is not run twice (the same
:class:`RequestBook`); a worker that dies closes its links, and the client fails what was pending
on them with WORKER_LOST; a worker that stops answers them SHUTTING_DOWN first.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from rolloutd.daemon.common.request_book import (
    CACHE_ANSWER_MAX_BYTES,
    Accepted,
    RequestBook,
    checked_id,
    error_frames,
    fingerprint,
    nbytes,
    salvage_id,
)
from rolloutd.native_io import framing
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.native_io.errors import BadRequest, DaemonLost, PermissionDenied, RolloutdError, ShuttingDown
from rolloutd.native_io.unix_link import UnixLink
from rolloutd.native_io.wire import DIRECT_OPS, MsgType

log = logging.getLogger(__name__)

LINK_TYPES = frozenset({MsgType.REQUEST, MsgType.CANCEL})
_UCRED = struct.Struct("3i")
"""struct ucred: pid, uid, gid."""

Answer = Callable[[list[Any]], None]
Start = Callable[[str, dict[str, Any], list[Any], Answer], None]
"""Runs a request: (id, header, buffers, where its one answer goes)."""


class ClientLinks:
    def __init__(self, listener: socket.socket, *, allowed_uids: set[int], config: NodeConfig, start: Start,
                 cancel: Callable[[str], None]) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.allowed_uids = allowed_uids
        self.max_message_bytes = config.max_message_bytes
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "duplicates": 0, "refused": 0, "links": 0}
        self.book: RequestBook[Accepted] = RequestBook(_send, self.counters, config.completed_ttl_s)
        self._start = start
        self._cancel = cancel
        self._links: set[UnixLink] = set()
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        link = UnixLink(conn, lambda frames: self._on_message(link, frames),
                        on_close=lambda: self._links.discard(link), loop=self.loop)
        if uid not in self.allowed_uids:
            self.counters["refused"] += 1
            log.warning("refused a link from uid %d (pid %d)", uid, pid)
            link.send(error_frames("", PermissionDenied(f"uid {uid} may not use this daemon")))
            link.close()
            return
        self.counters["links"] += 1
        self._links.add(link)

    def _on_message(self, link: UnixLink, frames: list[Any]) -> None:
        try:
            msg_type, header, buffers = framing.decode(frames, max_bytes=self.max_message_bytes,
                                                       known_types=LINK_TYPES)
            rid = checked_id(msg_type, header)
            op = header.get("op")
            if msg_type == MsgType.REQUEST and op not in DIRECT_OPS:
                raise BadRequest(f"{op!r} cannot be sent on a worker link (only {sorted(DIRECT_OPS)}); "
                                 "send it to the node's socket")
        except RolloutdError as e:
            link.send(error_frames(salvage_id(frames), e))
            return
        if msg_type == MsgType.CANCEL:
            if rid in self.book:  # only this link's own requests
                self._cancel(rid)
            return
        asked = fingerprint(header, frames[1])
        if self.book.repeat(rid, b"", link, asked=asked):  # type: ignore[arg-type]
            return
        self.counters["requests"] += 1
        p = Accepted(rid=rid, client=b"", socket=link, op=op, frames=[], fingerprint=asked)  # type: ignore[arg-type]
        self.book.open(p)
        self._start(rid, header, buffers, lambda answer: self._answer(p, answer))

    def _answer(self, p: Accepted, frames: list[Any]) -> None:
        kept = frames if sum(nbytes(f) for f in frames) <= CACHE_ANSWER_MAX_BYTES else None
        self.book.answer(p, frames, kept=kept)

    def forget_expired(self, now: float) -> None:
        self.book.forget_expired(now)

    def shut_down(self, *, supervisor_died: bool) -> None:
        """Answer what is open, then close the links and the listener: SHUTTING_DOWN when the
        supervisor asked for the stop, DAEMON_LOST when it died (for the clients, the daemon is lost)."""
        error: RolloutdError = ShuttingDown("the node daemon is shutting down; resubmit elsewhere")
        if supervisor_died:
            error = DaemonLost("the node daemon went away (its supervisor died) while this ran; its worker stopped "
                               "it. See the daemon's log, then submit again")
        for p in self.book:
            self.book.answer_error(p, error)
        self.loop.remove_reader(self.listener.fileno())
        self.listener.close()
        for link in list(self._links):
            link.close()


def _send(link: Any, _client: bytes, frames: list[Any]) -> None:
    if link is not None and not link.closed:  # a client gone: nobody to tell
        link.send(frames)
