"""Exactly once, in one place: the book of accepted requests that the node's supervisor and the
router both keep.

A request is accepted once per key (the id as its client chose it, scoped to the client by the
router); until its final answer leaves, a repeat of the key joins it (every asker gets the one
answer: the first as it came, the others what the owner says they may share); after that, a
repeat is answered from the cache of answers, which the owner keeps self-contained (never naming
shared memory that may hold another reply by then), or with DUPLICATE_REQUEST when the answer was
not kept. A repeat that asks something else under the same key (another op or other arguments)
is refused with DUPLICATE_REQUEST naming the first field that differs. An answer whose asker
could not be reached (it was reconnecting) is kept whole, arrays included, until the next asker
of its key collects it. Every final answer leaves through :meth:`RequestBook.answer`, which takes
the key out of the book, so a second answer for one key cannot leave. Answers stay cached for
``completed_ttl_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
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


FINGERPRINT_FRAME_MAX_BYTES = 1024
"""A request's header up to this size is its own fingerprint; a larger one is digested per field."""


@dataclass(slots=True)
class Fingerprint:
    """What a request asked, to hold a repeat of its id to. A small header is kept as the frame it
    came in: a repeat that sends the same bytes asks the same, so the per-field digests that name
    what differs are made only for a repeat that does not, not for every request (they were 7% of a
    worker's handling of a shell command on its link)."""

    frame: bytes | None
    digests: dict[str, bytes] | None = None

    def fields(self) -> dict[str, bytes]:
        if self.digests is None:
            assert self.frame is not None
            self.digests = field_digests(msgpack.unpackb(self.frame, raw=False))
        return self.digests


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
    key: str = ""
    """Its key in the book: ``rid`` unless the owner scopes ids (the router: per client)."""
    fingerprint: Fingerprint | None = None
    """What was asked (see :func:`fingerprint`): a repeat must ask the same."""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.rid


@dataclass(slots=True)
class Done:
    """A key already answered, as the book remembers it for ``completed_ttl_s``."""

    at: float
    kept: list[bytes] | None
    """What a repeat gets (self-contained), or None: DUPLICATE_REQUEST."""
    fingerprint: Fingerprint | None
    held: list[Any] | None = None
    """The whole answer, arrays included, while no asker has had it: the next asker's, once."""


P = TypeVar("P", bound=Accepted)
Send = Callable[[LoopSocket | None, bytes, list[Any]], bool | None]
"""Sends an answer; False when the asker could not be reached (None: not known)."""


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


def fingerprint(header: dict[str, Any], header_frame: Any) -> Fingerprint:
    """What a request asks, from its decoded header and the header frame it came in."""
    frame = as_bytes(header_frame)
    if len(frame) <= FINGERPRINT_FRAME_MAX_BYTES:
        return Fingerprint(frame)
    return Fingerprint(None, field_digests(header))


def field_digests(header: dict[str, Any]) -> dict[str, bytes]:
    """A short digest per field of a request (``op``, and ``args.<name>`` per argument), so a
    repeat of its id can be checked against it and the first field that differs named."""
    args = header.get("args")
    fields = {"op": header.get("op"), **({f"args.{k}": v for k, v in args.items()} if isinstance(args, dict)
                                          else {"args": args})}
    return {k: hashlib.blake2b(msgpack.packb(v, use_bin_type=True), digest_size=8).digest()
            for k, v in fields.items()}


def difference(first: Fingerprint | None, then: Fingerprint | None) -> str | None:
    """The first field two requests under one id disagree on, or None (also when either is unknown)."""
    if first is None or then is None or (first.frame is not None and first.frame == then.frame):
        return None
    a, b = first.fields(), then.fields()
    return next((k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)), None)


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


def reused(rid: str, field_name: str, running: bool) -> list[bytes]:
    return error_frames(rid, DuplicateRequest(
        f"request {rid} was {'already asked' if running else 'already answered'} with another {field_name}; "
        "an id names one request: use a new id for new work"))


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

    def repeat(self, key: str, client: bytes, socket: LoopSocket | None, *, rid: str | None = None,
               asked: dict[str, bytes] | None = None) -> bool:
        """True when ``key`` was accepted before: the asker joins it, gets its answer, or (when it
        asks something else, ``asked`` being its :func:`fingerprint`) a refusal. ``rid``: the id
        as the asker knows it (default ``key``)."""
        rid = rid or key
        p = self._pending.get(key)
        if p is not None:
            self._counters["duplicates"] += 1
            field_name = difference(p.fingerprint, asked)
            if field_name is not None:
                self._send(socket, client, reused(rid, field_name, True))
            elif (socket, client) != (p.socket, p.client) and (socket, client) not in p.joined:
                p.joined.append((socket, client))  # every asker gets the one answer
            return True
        done = self._completed.get(key)
        if done is None:
            return False
        self._counters["duplicates"] += 1
        field_name = difference(done.fingerprint, asked)
        if field_name is not None:
            self._send(socket, client, reused(rid, field_name, False))
        elif done.held is not None:
            if self._send(socket, client, done.held) is not False:
                done.held = None  # collected
        else:
            self._send(socket, client, done.kept if done.kept is not None else not_kept(rid))
        return True

    def answered(self, key: str) -> bool:
        """Whether ``key`` got its final answer (and is still remembered)."""
        return key in self._completed

    def open(self, p: P) -> None:
        self._pending[p.key] = p

    def get(self, key: str) -> P | None:
        return self._pending.get(key)

    def answer(self, p: P, frames: list[Any], *, kept: list[bytes] | None,
               for_joined: Callable[[], list[Any] | None] | None = None, held: list[Any] | None = None) -> bool:
        """The one place a final answer leaves: exactly once per accepted key. ``kept``: what a
        later repeat of the key gets (self-contained), or None; ``for_joined``: what askers who
        joined while it ran get (default ``kept``; DUPLICATE_REQUEST when there is nothing);
        ``held``: the whole answer, kept for the next asker when this one cannot be reached.
        True when the asker was reached (or may have been)."""
        if self._pending.pop(p.key, None) is None:
            return False
        self._counters["errors" if as_bytes(frames[0]) == TYPE_ERROR else "replies"] += 1
        delivered = self._send(p.socket, p.client, frames) is not False
        self._completed[p.key] = Done(time.monotonic(), kept, p.fingerprint, None if delivered else held)
        if p.joined:
            shared = kept or (for_joined() if for_joined is not None else None) or not_kept(p.rid)
            for socket, client in p.joined:
                self._send(socket, client, shared)
        return delivered

    def answer_error(self, p: P, e: RolloutdError) -> None:
        frames = error_frames(p.rid, e)
        self.answer(p, frames, kept=frames)

    def forget_expired(self, now: float) -> None:
        """Drop kept answers older than ``completed_ttl_s``."""
        while self._completed:
            if now - next(iter(self._completed.values())).at < self._ttl_s:
                break
            self._completed.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[P]:
        """The open requests (a snapshot: answering while iterating is safe)."""
        return iter(list(self._pending.values()))
