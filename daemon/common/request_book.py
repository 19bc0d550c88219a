"""Exactly once, in one place: the book of accepted requests that the node's supervisor and the
router both keep.

A request id is accepted once; until its final answer leaves, a repeat of the id joins it (every
asker gets the one answer: the first as it came, the others what the owner says they may share);
after that, a repeat is answered from the cache of answers, which the owner keeps self-contained
(never naming shared memory that may hold another reply by then), or with DUPLICATE_REQUEST when
the answer was not kept. Every final answer leaves through :meth:`RequestBook.answer`, which takes
the id out of the book, so a second answer for one id cannot leave. Answers stay cached for
``completed_ttl_s``.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgpack

from rolloutd.native_io import framing
from rolloutd.native_io.errors import BadRequest, DuplicateRequest, RolloutdError
from rolloutd.native_io.wire import MsgType
from rolloutd.native_io.zmq_loop import LoopSocket

MAX_ID_LEN = 200
"""Characters of a request id."""
CACHE_ANSWER_MAX_BYTES = 1 << 20
"""Answers up to this size are kept for repeats of their id; larger ones are only marked answered."""
TYPE_ERROR = bytes((MsgType.ERROR,))


@dataclass(kw_only=True, slots=True)
class Accepted:
    """What the node and the router both record of an accepted request; each adds its own fields."""

    rid: str
    client: bytes
    """The asker's routing id."""
    socket: LoopSocket | None
    """Where the answer goes; None for a daemon's own housekeeping requests (answered to no one)."""
    op: str
    frames: list[Any]
    """As received, type onward; kept (not copied) to dispatch again."""
    joined: list[tuple[LoopSocket | None, bytes]] = field(default_factory=list)
    """Other askers of the same id while it ran: each gets the one answer too."""


P = TypeVar("P", bound=Accepted)
Send = Callable[[LoopSocket | None, bytes, list[Any]], None]


def as_bytes(frame: Any) -> bytes:
    """A frame as bytes, whether it came as bytes, a buffer (the worker link's) or a ``zmq.Frame``."""
    if isinstance(frame, bytes):
        return frame
    return bytes(frame) if isinstance(frame, (memoryview, bytearray)) else frame.bytes


def error_frames(rid: str, e: RolloutdError) -> list[bytes]:
    return framing.encode(MsgType.ERROR, {"id": rid, "code": e.code, "message": str(e), "details": {}})


def checked_id(msg_type: MsgType, header: dict[str, Any]) -> str:
    """The request id of a decoded client message; RELEASE needs none."""
    rid = header.get("id")
    if msg_type != MsgType.RELEASE and (not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LEN):
        raise BadRequest(f"request id must be a non-empty string of at most {MAX_ID_LEN} characters")
    return rid if isinstance(rid, str) else ""


def salvage_id(frames: list[Any]) -> str:
    """The id of a message we refuse, when its header can still be read."""
    with contextlib.suppress(Exception):
        header = msgpack.unpackb(as_bytes(frames[1]), raw=False)
        if isinstance(header, dict) and isinstance(header.get("id"), str):
            return header["id"][:MAX_ID_LEN]
    return ""


def nbytes(frame: Any) -> int:
    if isinstance(frame, memoryview):
        return frame.nbytes
    return len(frame) if isinstance(frame, (bytes, bytearray)) else len(frame.buffer)


def not_kept(rid: str) -> list[bytes]:
    return error_frames(rid, DuplicateRequest(
        f"request {rid} was already answered and its result (over {CACHE_ANSWER_MAX_BYTES} bytes, with arrays "
        "not kept, or its shared memory gone) was not kept; submit it again under a new id"))


class RequestBook(Generic[P]):
    """Accepted requests without their final answer yet, and the answers already given."""

    def __init__(self, send: Send, counters: dict[str, int], completed_ttl_s: float) -> None:
        self._send = send
        self._counters = counters
        """The owner's counters; the book counts ``duplicates``, ``replies`` and ``errors``."""
        self._ttl_s = completed_ttl_s
        self._pending: dict[str, P] = {}
        self._completed: OrderedDict[str, tuple[float, list[bytes] | None]] = OrderedDict()

    def repeat(self, rid: str, client: bytes, socket: LoopSocket | None) -> bool:
        """True when ``rid`` was accepted before: the asker joins it, or gets its kept answer."""
        p = self._pending.get(rid)
        if p is not None:
            self._counters["duplicates"] += 1
            if (socket, client) != (p.socket, p.client) and (socket, client) not in p.joined:
                p.joined.append((socket, client))  # every asker gets the one answer
            return True
        cached = self._completed.get(rid)
        if cached is None:
            return False
        self._counters["duplicates"] += 1
        self._send(socket, client, cached[1] if cached[1] is not None else not_kept(rid))
        return True

    def open(self, p: P) -> None:
        self._pending[p.rid] = p

    def get(self, rid: str) -> P | None:
        return self._pending.get(rid)

    def answer(self, p: P, frames: list[Any], *, kept: list[bytes] | None,
               for_joined: Callable[[], list[Any] | None] | None = None) -> None:
        """The one place a final answer leaves: exactly once per accepted id. ``kept``: what a
        later repeat of the id gets (self-contained), or None; ``for_joined``: what askers who
        joined while it ran get (default ``kept``; DUPLICATE_REQUEST when there is nothing)."""
        if self._pending.pop(p.rid, None) is None:
            return
        self._counters["errors" if as_bytes(frames[0]) == TYPE_ERROR else "replies"] += 1
        self._completed[p.rid] = (time.monotonic(), kept)
        self._send(p.socket, p.client, frames)
        if p.joined:
            shared = kept or (for_joined() if for_joined is not None else None) or not_kept(p.rid)
            for socket, client in p.joined:
                self._send(socket, client, shared)

    def answer_error(self, p: P, e: RolloutdError) -> None:
        frames = error_frames(p.rid, e)
        self.answer(p, frames, kept=frames)

    def forget_expired(self, now: float) -> None:
        """Drop kept answers older than ``completed_ttl_s``."""
        while self._completed:
            _, (t, _) = next(iter(self._completed.items()))
            if now - t < self._ttl_s:
                break
            self._completed.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[P]:
        """The open requests (a snapshot: answering while iterating is safe)."""
        return iter(list(self._pending.values()))
