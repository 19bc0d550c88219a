"""Ops every node must apply (``wire.BROADCAST_OPS``: inference servers, weight version, pause),
sent through the router: one request to every node, one answer once all have answered, and a
record of the resulting set-up that is replayed to any node that joins later, so a node that
restarts or comes back uses the same servers and weight version as the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rolloutd.daemon.common.request_book import as_bytes
from rolloutd.daemon.router.dispatch import NodeEntry
from rolloutd.daemon.router.nodes import NodeTable
from rolloutd.daemon.router.requests import Broadcast, Pending
from rolloutd.native_io import framing
from rolloutd.native_io.errors import RolloutdError
from rolloutd.native_io.wire import CLIENT_TYPES, FINAL_TYPES, MsgType

log = logging.getLogger(__name__)
TYPE_REPLY = bytes((MsgType.REPLY,))

REPLAY_PREFIX = b"\x00replay:"
"""Envelope of a replayed op: its answer is not for any trainer."""


class InferenceSetup:
    """The broadcast ops in effect, oldest first, compacted: per server its last add or remove,
    the last weight version, the last pause or resume."""

    def __init__(self) -> None:
        self._ops: OrderedDict[str, list[bytes]] = OrderedDict()

    def record(self, op: str, args: Any, frames: list[Any]) -> None:
        address = args.get("address") if isinstance(args, dict) else None
        key = {"inference.set_weight_version": "weight_version", "inference.pause": "pause",
               "inference.resume": "pause"}.get(op, f"server:{address}")
        self._ops.pop(key, None)
        self._ops[key] = [f if isinstance(f, bytes) else f.bytes for f in frames]

    def replay(self) -> list[tuple[bytes, list[bytes]]]:
        """(envelope, frames) of each op, in the order to apply them."""
        return [(REPLAY_PREFIX + key.encode(), frames) for key, frames in self._ops.items()]

    def __len__(self) -> int:
        return len(self._ops)


class Broadcasts:
    """The router's handling of broadcast ops: sent to every node, answered once all have."""

    def __init__(self, table: NodeTable, send_raw: Callable[[bytes, bytes, list[Any]], bool],
                 deliver: Callable[[Pending, list[Any]], None], node_lost: Callable[[NodeEntry, str], None]) -> None:
        self.table = table
        self.setup = InferenceSetup()
        self._send_raw = send_raw
        self._deliver = deliver
        self._node_lost = node_lost

    def start(self, p: Pending) -> None:
        if not self.table:
            # Nothing to apply it to yet: every node that joins gets it first thing.
            self.setup.record(p.op, _args(p.frames), p.frames)
            self._deliver(p, framing.encode(MsgType.REPLY, {"id": p.rid, "refs": [], "result": {
                "nodes": {}, "lost": {}, "note": "no node has joined yet; every node that joins applies it"}}))
            return
        nodes = list(self.table)
        broadcast = p.broadcast = Broadcast({n.identity: None for n in nodes}, {n.identity: n.name for n in nodes})
        for node in nodes:
            node.take(p.key, 0)
            if not self._send_raw(node.identity, p.key.encode(), p.frames):
                self._node_lost(node, "unreachable")  # which may finish it (see node_gone)
        if p.broadcast is broadcast and broadcast.complete:
            self._finish(p)

    def answer(self, node: NodeEntry, p: Pending, answer: list[Any]) -> None:
        assert p.broadcast is not None
        node.last_seen = time.monotonic()
        node.finish(p.key)
        try:
            _, header, _ = framing.decode(answer, max_bytes=1 << 62, known_types=FINAL_TYPES)
        except RolloutdError as e:
            header = {"code": e.code, "message": f"undecodable answer: {e}"}
        p.broadcast.answer(node.identity, header)
        if p.broadcast.complete:
            self._finish(p)

    def node_gone(self, node: NodeEntry, p: Pending, reason: str) -> None:
        """The node went away before it answered ``p``: wait no more for it."""
        assert p.broadcast is not None
        p.broadcast.drop(node.identity, reason)
        if p.broadcast.complete:
            self._finish(p)

    def replay_to(self, node_id: bytes) -> None:
        """A node that joins gets the set-up the others have, before any request, in order."""
        for envelope, frames in self.setup.replay():
            self._send_raw(node_id, envelope, frames)

    def _finish(self, p: Pending) -> None:
        assert p.broadcast is not None
        answer = p.broadcast.final(p.rid)
        if answer[0] == TYPE_REPLY:
            self.setup.record(p.op, _args(p.frames), p.frames)
            for node in self.table:  # those that joined while it was under way
                if node.identity not in p.broadcast.names:
                    self._send_raw(node.identity, REPLAY_PREFIX + p.key.encode(), p.frames)
        p.broadcast = None
        self._deliver(p, answer)

    def on_replay_answer(self, node_id: bytes, envelope: bytes, answer: list[Any]) -> None:
        node = self.table.get(node_id)
        if answer and as_bytes(answer[0]) == TYPE_REPLY:
            if node is not None:
                node.setup_applied += 1
            return
        with contextlib.suppress(RolloutdError):
            header = framing.decode(answer, max_bytes=1 << 20, known_types=FINAL_TYPES)[1]
            log.warning("node %r could not apply the inference set-up %s: %s", node_id,
                        envelope[len(REPLAY_PREFIX):].decode(errors="replace"), header.get("message"))


def _args(frames: list[Any]) -> Any:
    """The args of a request already accepted (so its header decodes)."""
    return framing.decode(frames, max_bytes=1 << 62, known_types=CLIENT_TYPES)[1].get("args")
