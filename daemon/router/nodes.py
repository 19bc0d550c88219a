"""The router's table of registered nodes: who is there, which node holds which sandbox, which
node took which task instance; and the choice of a node for a request (pure, no sockets)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from rolloutd.daemon.router.dispatch import NodeEntry, pick_node
from rolloutd.daemon.router.requests import Pending
from rolloutd.native_io import framing
from rolloutd.native_io.errors import RolloutdError, SandboxLost
from rolloutd.native_io.wire import FINAL_TYPES, MsgType, NodeRegister

AFFINITY_MAX = 65536
"""Task instances remembered -> node (oldest forgotten first)."""


class NodeTable:
    def __init__(self) -> None:
        self.nodes: dict[bytes, NodeEntry] = {}
        self.sandboxes: dict[str, NodeEntry] = {}
        self.affinity: OrderedDict[str, bytes] = OrderedDict()

    def get(self, node_id: bytes) -> NodeEntry | None:
        return self.nodes.get(node_id)

    def __iter__(self) -> Iterator[NodeEntry]:
        """The nodes now (a snapshot: removing while iterating is safe)."""
        return iter(list(self.nodes.values()))

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def any_accepting(self) -> bool:
        return any(n.accepting for n in self.nodes.values())

    def claim_conflict(self, node_id: bytes, name: str, proof: str) -> NodeEntry | None:
        """The live node that holds ``name`` (or the link ``node_id``) with another proof: then the
        peer that registers is refused, so no node can evict another by taking its name."""
        for n in self.nodes.values():
            if (n.name == name or n.identity == node_id) and n.proof != proof:
                return n
        return None

    def replaced_by(self, node_id: bytes, name: str) -> list[NodeEntry]:
        """Older entries of a node that registers again as a new process (same name and proof, new link)."""
        return [n for n in self.nodes.values() if n.name == name and n.identity != node_id]

    def register(self, node_id: bytes, msg: NodeRegister, proof: str) -> NodeEntry:
        """The node's entry, new or refreshed from its registration."""
        node = self.nodes.get(node_id)
        if node is None:
            node = NodeEntry(node_id, msg.name, msg.host, msg.pid, msg.capacity, msg.draining, proof=proof)
            self.nodes[node_id] = node
        node.capacity, node.draining, node.last_seen = msg.capacity, msg.draining, time.monotonic()
        return node

    def remove(self, node: NodeEntry) -> bool:
        """Forget the node and its sandboxes; False when it was already gone."""
        if self.nodes.get(node.identity) is not node:
            return False
        del self.nodes[node.identity]
        for sid in node.sandboxes:
            self.sandboxes.pop(sid, None)
        return True

    def pick(self, p: Pending) -> NodeEntry | None:
        key = p.hints.affinity
        preferred = self.nodes.get(self.affinity.get(key, b"")) if key is not None else None
        node = pick_node(self.nodes.values(), p.hints, preferred)
        if node is not None and key is not None:
            self.affinity[key] = node.identity
            self.affinity.move_to_end(key)
            if len(self.affinity) > AFFINITY_MAX:
                self.affinity.popitem(last=False)
        return node

    def track_sandbox(self, node: NodeEntry, p: Pending, answer: list[Any]) -> None:
        """Which node holds a sandbox, from the answers to opening and closing it (or its loss)."""
        try:
            msg_type, header, _ = framing.decode(answer, max_bytes=1 << 62, known_types=FINAL_TYPES)
        except RolloutdError:
            return
        result = header.get("result") or {}
        if msg_type == MsgType.REPLY and p.op == "sandbox.open" and isinstance(result.get("sandbox_id"), str):
            self.sandboxes[result["sandbox_id"]] = node
            node.sandboxes.add(result["sandbox_id"])
        elif msg_type == MsgType.REPLY and p.op == "sandbox.close" or header.get("code") == SandboxLost.code:
            sid = p.hints.sandbox or ""
            self.sandboxes.pop(sid, None)
            node.sandboxes.discard(sid)

    def status(self, now: float) -> list[dict[str, Any]]:
        return [n.status(now) for n in self.nodes.values()]
