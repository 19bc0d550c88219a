"""The router's record of one accepted request, and of a broadcast's answers per node."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.common.request_book import Accepted
from rolloutd.daemon.router.dispatch import Hints, NodeEntry
from rolloutd.native_io import framing
from rolloutd.native_io.errors import NodeLost
from rolloutd.native_io.wire import MsgType


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


@dataclass(kw_only=True, slots=True)
class Pending(Accepted):
    """An accepted request without its final answer yet, as the router keeps it."""

    hints: Hints
    node: NodeEntry | None = None
    sent_to: set[bytes] = field(default_factory=set)
    """Nodes it was sent to whose answer is still taken: one presumed lost may answer late."""
    withdrawn: set[bytes] = field(default_factory=set)
    """Nodes it was cancelled on (another copy runs elsewhere): their answer is not taken."""
    attempts: int = 0
    """Nodes that died under it so far."""
    queued_at: float = field(default_factory=time.monotonic)
    broadcast: Broadcast | None = None
    """For ops every node applies: their answers so far."""
