"""The request book the node and the router share: each accepted id is answered exactly once, a
repeat joins it in flight and gets the kept answer after, an answer not kept is DUPLICATE_REQUEST."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutd.daemon.common.request_book import (
    CACHE_ANSWER_MAX_BYTES,
    Accepted,
    MAX_ID_LEN,
    RequestBook,
    checked_id,
    salvage_id,
)
from rolloutd.native_io import framing
from rolloutd.native_io.errors import BadRequest, Cancelled
from rolloutd.native_io.wire import MsgType


def Asked(rid: str, client: bytes) -> Accepted:
    return Accepted(rid=rid, client=client, socket=None, op="status", frames=[])


class Outbox:
    """Where the book's answers go: (client, decoded header) per answer sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, int, dict[str, Any]]] = []

    def __call__(self, socket: Any, client: bytes, frames: list[Any]) -> None:
        msg_type, header, _ = framing.decode(frames, max_bytes=1 << 30,
                                             known_types=frozenset({MsgType.REPLY, MsgType.ERROR}))
        self.sent.append((client, msg_type, header))


def reply(rid: str, payload: str = "ok") -> list[bytes]:
    return framing.encode(MsgType.REPLY, {"id": rid, "result": payload, "refs": []})


@pytest.fixture
def book() -> tuple[RequestBook[Accepted], Outbox, dict[str, int]]:
    counters = {"duplicates": 0, "replies": 0, "errors": 0}
    out = Outbox()
    return RequestBook(out, counters, completed_ttl_s=60.0), out, counters


def test_an_id_is_answered_once_and_a_second_answer_never_leaves(book: Any) -> None:
    b, out, counters = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, reply("r1", "first"))
    b.answer(p, reply("r1", "second"))
    b.answer_error(p, Cancelled("late"))
    assert [(c, h["result"]) for c, _, h in out.sent] == [(b"c1", "first")]
    assert (counters["replies"], counters["errors"], len(b)) == (1, 0, 0)


def test_a_repeat_in_flight_joins_and_the_newest_asker_gets_the_answer(book: Any) -> None:
    b, out, counters = book
    p = Asked("r1", b"c1")
    b.open(p)
    assert b.repeat("r1", b"c2", None)
    b.answer(p, reply("r1"))
    assert [c for c, _, _ in out.sent] == [b"c2"] and counters["duplicates"] == 1


def test_a_repeat_after_the_answer_gets_the_kept_answer_again(book: Any) -> None:
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, reply("r1", "done"))
    assert b.repeat("r1", b"c3", None)
    assert [(c, h["result"]) for c, _, h in out.sent] == [(b"c1", "done"), (b"c3", "done")]
    assert not b.repeat("r2", b"c3", None), "an unknown id is no repeat"


@pytest.mark.parametrize("keep, size", [(False, 10), (True, CACHE_ANSWER_MAX_BYTES + 1)])
def test_an_answer_not_kept_makes_a_repeat_duplicate_request(book: Any, keep: bool, size: int) -> None:
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, reply("r1", "x" * size), keep=keep)
    assert b.repeat("r1", b"c2", None)
    _, msg_type, header = out.sent[-1]
    assert (msg_type, header["code"]) == (MsgType.ERROR, "DUPLICATE_REQUEST") and "use a new id" in header["message"]


def test_kept_answers_expire(book: Any) -> None:
    b, _, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, reply("r1"))
    b.forget_expired(now=float("inf"))
    assert not b.repeat("r1", b"c2", None)


def test_ids_are_checked_and_salvaged() -> None:
    assert checked_id(MsgType.REQUEST, {"id": "a"}) == "a"
    assert checked_id(MsgType.RELEASE, {}) == ""
    for bad in ("", None, 7, "x" * (MAX_ID_LEN + 1)):
        with pytest.raises(BadRequest, match="request id"):
            checked_id(MsgType.REQUEST, {"id": bad})
    frames = framing.encode(MsgType.REQUEST, {"id": "y" * (MAX_ID_LEN + 5), "op": "status"})
    assert salvage_id(frames) == "y" * MAX_ID_LEN
    assert salvage_id([bytes((MsgType.REQUEST,)), b"\xc1not msgpack"]) == ""


def test_answers_as_buffers_are_kept_as_bytes(book: Any) -> None:
    """A worker's answer comes off its Unix link as memoryviews, not bytes or zmq frames."""
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, [memoryview(f) for f in reply("r1", "viewed")])
    assert b.repeat("r1", b"c2", None)
    assert [h["result"] for _, _, h in out.sent] == ["viewed", "viewed"]
