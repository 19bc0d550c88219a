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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rolloutd.native_io import framing
from rolloutd.native_io.errors import NodeLost, RolloutdError
from rolloutd.native_io.wire import CLIENT_TYPES, FINAL_TYPES, MsgType

if TYPE_CHECKING:
    from rolloutd.daemon.router.router import Pending
    from rolloutd.daemon.router.dispatch import NodeEntry

log = logging.getLogger(__name__)
TYPE_REPLY = bytes((MsgType.REPLY,))
TYPE_ERROR = bytes((MsgType.ERROR,))

REPLAY_PREFIX = b"\x00replay:"
"""Envelope of a replayed op: its answer is not for any trainer."""


@dataclass
class Broadcast:
    """One broadcast request's answers, per node identity (None until it came)."""

    answers: dict[bytes, dict[str, Any] | None]
    names: dict[bytes, str]
    lost: dict[str, str] = field(default_factory=dict)
    """Names of nodes that went away before answering -> why (they get the replay if they return)."""

    def answer(self, node_id: bytes, header: dict[str, Any]) -> None:
        if node_id in self.answers:
            self.answers[node_id] = header

    def drop(self, node_id: bytes, reason: str) -> None:
        """The node went away: wait no more for its answer."""
        if node_id in self.answers and self.answers[node_id] is None:
            del self.answers[node_id]
            self.lost[self.names[node_id]] = reason

    @property
    def complete(self) -> bool:
        return all(h is not None for h in self.answers.values())

    def final(self, rid: str) -> list[bytes]:
        """The one answer: the first node's error if any failed, else every node's result."""
        done = {self.names[nid]: h for nid, h in self.answers.items() if h is not None}
        failed = [(name, h) for name, h in done.items() if "code" in h]
        if failed:
            name, h = failed[0]
            return framing.encode(MsgType.ERROR, {"id": rid, "code": h["code"], "details": {"node": name},
                                                  "message": f"node {name}: {h.get('message', '')}"})
        if not done:
            e = NodeLost(f"every node went away before applying it ({self.lost}); it will be applied when they join")
            return framing.encode(MsgType.ERROR, {"id": rid, "code": e.code, "message": str(e), "details": {}})
        result = {"nodes": {name: h.get("result") for name, h in done.items()}, "lost": self.lost}
        return framing.encode(MsgType.REPLY, {"id": rid, "result": result, "refs": []})


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


class BroadcastOps:
    """The router's handling of broadcast ops (a part of ``Router``, kept here to keep it short)."""

    nodes: dict[bytes, NodeEntry]
    pending: dict[str, Pending]
    inference: InferenceSetup

    def _send_raw(self, node_id: bytes, envelope: bytes, frames: list[Any]) -> bool:
        raise NotImplementedError

    def _node_lost(self, node: NodeEntry, reason: str) -> None:
        raise NotImplementedError

    def _deliver(self, p: Pending, frames: list[Any]) -> None:
        raise NotImplementedError

    def _broadcast(self, p: Pending) -> None:
        if not self.nodes:
            # Nothing to apply it to yet: every node that joins gets it first thing.
            self.inference.record(p.op, _args(p.frames), p.frames)
            self._deliver(p, framing.encode(MsgType.REPLY, {"id": p.rid, "refs": [], "result": {
                "nodes": {}, "lost": {}, "note": "no node has joined yet; every node that joins applies it"}}))
            return
        p.broadcast = Broadcast({nid: None for nid in self.nodes}, {nid: n.name for nid, n in self.nodes.items()})
        for node in list(self.nodes.values()):
            node.take(p.rid, 0)
            if not self._send_raw(node.identity, p.rid.encode(), p.frames):
                self._node_lost(node, "unreachable")
        if p.rid in self.pending and p.broadcast.complete:
            self._finish_broadcast(p)

    def _broadcast_answer(self, node: NodeEntry, p: Pending, answer: list[Any]) -> None:
        assert p.broadcast is not None
        node.last_seen = time.monotonic()
        node.finish(p.rid)
        try:
            _, header, _ = framing.decode(answer, max_bytes=1 << 62, known_types=FINAL_TYPES)
        except RolloutdError as e:
            header = {"code": e.code, "message": f"undecodable answer: {e}"}
        p.broadcast.answer(node.identity, header)
        if p.broadcast.complete:
            self._finish_broadcast(p)

    def _finish_broadcast(self, p: Pending) -> None:
        assert p.broadcast is not None
        answer = p.broadcast.final(p.rid)
        if answer[0] == TYPE_REPLY:
            self.inference.record(p.op, _args(p.frames), p.frames)
            for nid in self.nodes.keys() - p.broadcast.names.keys():  # joined while it was under way
                self._send_raw(nid, REPLAY_PREFIX + p.rid.encode(), p.frames)
        self._deliver(p, answer)

    def _on_replay_answer(self, node_id: bytes, envelope: bytes, answer: list[Any]) -> None:
        node = self.nodes.get(node_id)
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


def as_bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes
