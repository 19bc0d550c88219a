"""The request book the node and the router share: each accepted id is answered exactly once, every
asker of an id in flight gets the one answer, a repeat after gets the kept answer, and an answer
not kept is DUPLICATE_REQUEST."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutd.daemon.common import request_book
from rolloutd.daemon.common.request_book import (
    FINGERPRINT_FRAME_MAX_BYTES,
    MAX_ID_LEN,
    Accepted,
    Fingerprint,
    RequestBook,
    as_bytes,
    checked_id,
    difference,
    fingerprint,
    nbytes,
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


def answer(book: RequestBook[Accepted], p: Accepted, frames: list[Any]) -> None:
    """As an owner whose answers are self-contained: kept as they are."""
    book.answer(p, frames, kept=[bytes(f) for f in frames])


@pytest.fixture
def book() -> tuple[RequestBook[Accepted], Outbox, dict[str, int]]:
    counters = {"duplicates": 0, "replies": 0, "errors": 0}
    out = Outbox()
    return RequestBook(out, counters, completed_ttl_s=60.0), out, counters


def test_an_id_is_answered_once_and_a_second_answer_never_leaves(book: Any) -> None:
    b, out, counters = book
    p = Asked("r1", b"c1")
    b.open(p)
    answer(b, p, reply("r1", "first"))
    answer(b, p, reply("r1", "second"))
    b.answer_error(p, Cancelled("late"))
    assert [(c, h["result"]) for c, _, h in out.sent] == [(b"c1", "first")]
    assert (counters["replies"], counters["errors"], len(b)) == (1, 0, 0)


def test_every_asker_of_an_id_in_flight_gets_the_one_answer(book: Any) -> None:
    b, out, counters = book
    p = Asked("r1", b"c1")
    b.open(p)
    assert b.repeat("r1", b"c2", None) and b.repeat("r1", b"c2", None) and b.repeat("r1", b"c1", None)
    b.answer(p, reply("r1", "first's"), kept=None, for_joined=lambda: reply("r1", "a copy"))
    assert [(c, h["result"]) for c, _, h in out.sent] == [(b"c1", "first's"), (b"c2", "a copy")]
    assert counters["duplicates"] == 3


def test_a_joined_asker_with_nothing_to_share_gets_duplicate_request(book: Any) -> None:
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.repeat("r1", b"c2", None)
    b.answer(p, reply("r1"), kept=None, for_joined=lambda: None)
    assert [(c, h.get("code")) for c, _, h in out.sent] == [(b"c1", None), (b"c2", "DUPLICATE_REQUEST")]


def test_a_repeat_after_the_answer_gets_the_kept_answer_again(book: Any) -> None:
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    answer(b, p, reply("r1", "done"))
    assert b.repeat("r1", b"c3", None)
    assert [(c, h["result"]) for c, _, h in out.sent] == [(b"c1", "done"), (b"c3", "done")]
    assert not b.repeat("r2", b"c3", None), "an unknown id is no repeat"


def test_an_answer_not_kept_makes_a_repeat_duplicate_request(book: Any) -> None:
    b, out, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    b.answer(p, reply("r1"), kept=None)
    assert b.repeat("r1", b"c2", None)
    _, msg_type, header = out.sent[-1]
    assert (msg_type, header["code"]) == (MsgType.ERROR, "DUPLICATE_REQUEST") and "new id" in header["message"]


def test_kept_answers_expire(book: Any) -> None:
    b, _, _ = book
    p = Asked("r1", b"c1")
    b.open(p)
    answer(b, p, reply("r1"))
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


def test_frames_of_every_kind_count_and_size() -> None:
    """A worker's answer comes off its Unix link as memoryviews, a node's as zmq frames."""
    data = reply("r1")
    assert [as_bytes(memoryview(f)) for f in data] == data and as_bytes(data[0]) == data[0]
    assert [nbytes(memoryview(f)) for f in data] == [len(f) for f in data]


def fingerprint_of(header: dict[str, Any]) -> Fingerprint:
    return fingerprint(header, framing.pack_header(header))


@pytest.mark.parametrize("frame_max", [FINGERPRINT_FRAME_MAX_BYTES, 0], ids=["frame kept", "digested at once"])
def test_a_reused_id_asking_something_else_is_refused_naming_the_field(book: Any, frame_max: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_book, "FINGERPRINT_FRAME_MAX_BYTES", frame_max)
    b, out, _ = book
    asked = fingerprint_of({"id": "r1", "op": "debug.sleep", "args": {"seconds": 1, "n_tokens": 4}})
    other = fingerprint_of({"id": "r1", "op": "debug.sleep", "args": {"seconds": 2, "n_tokens": 4}})
    p = Accepted(rid="r1", client=b"c1", socket=None, op="debug.sleep", frames=[], fingerprint=asked)
    b.open(p)
    assert b.repeat("r1", b"c1", None, asked=other)  # in flight
    # The same request, sent with its fields in another order: joins
    assert b.repeat("r1", b"c2", None, asked=fingerprint_of(
        {"args": {"n_tokens": 4, "seconds": 1}, "op": "debug.sleep", "id": "r1"}))
    answer(b, p, reply("r1"))
    assert b.repeat("r1", b"c1", None, asked=other)  # answered
    assert b.repeat("r1", b"c1", None, asked=fingerprint_of({"id": "r1", "op": "debug.sleep2",
                                                              "args": {"seconds": 1, "n_tokens": 4}}))
    kinds = [(c, t, h.get("code"), "args.seconds" in h.get("message", "")) for c, t, h in out.sent]
    assert kinds[0] == (b"c1", MsgType.ERROR, "DUPLICATE_REQUEST", True), "refused while in flight"
    assert kinds[1:3] == [(b"c1", MsgType.REPLY, None, False), (b"c2", MsgType.REPLY, None, False)]
    assert kinds[3] == (b"c1", MsgType.ERROR, "DUPLICATE_REQUEST", True), "and after"
    assert "another op" in out.sent[4][2]["message"]
    assert difference(asked, None) is None, "a repeat that says nothing of what it asks is not refused"


def test_an_answer_its_asker_could_not_take_is_held_whole_until_collected() -> None:
    counters = {"duplicates": 0, "replies": 0, "errors": 0}
    reachable = {b"c1": False}
    got: list[tuple[bytes, list[Any]]] = []

    def send(socket: Any, client: bytes, frames: list[Any]) -> bool:
        if not reachable.get(client, True):
            return False
        got.append((client, frames))
        return True

    b: RequestBook[Accepted] = RequestBook(send, counters, completed_ttl_s=60.0)
    p = Asked("r1", b"c1")
    b.open(p)
    whole = [*reply("r1"), b"\x01" * 64]  # with an array frame: not kept for later repeats
    assert b.answer(p, whole, kept=None, held=whole) is False and b.answered("r1")
    reachable[b"c1"] = True  # it reconnected
    assert b.repeat("r1", b"c1", None)
    assert got == [(b"c1", whole)], "collected with its array"
    assert b.repeat("r1", b"c1", None)
    assert got[-1][1][0] == bytes((MsgType.ERROR,)), "collected once: after that, as any answer not kept"
