"""Node membership at the router: registration, heartbeats, leaving, and who may hold a name.

A node's name is held by the live node that registered it first with a proof: its CURVE key over
TCP, or over ipc a token this router issues in its welcome (the node keeps it in its run folder,
so a restarted node proves it is the same). Another peer registering under a live name is
refused (``RouterRefused``, logged once per link): no node can evict another, and two nodes
given one name cannot evict each other in turn. Over TCP every message of a link must come with
the key it registered with (ROUTER_HANDOVER lets a new connection take a link id over).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from rolloutd.daemon.router import scope
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.flow import RequestFlow
from rolloutd.native_io import framing
from rolloutd.native_io.errors import RolloutdError
from rolloutd.native_io.wire import (
    MsgType,
    NodeBye,
    NodeHeartbeat,
    NodeRegister,
    RouterRefused,
    RouterUnknown,
    RouterWelcome,
    parse_node_message,
)

log = logging.getLogger(__name__)

NODE_TYPES = frozenset({MsgType.NODE})


class Membership:
    def __init__(self, config: RouterConfig, flow: RequestFlow, send_node: Callable[[bytes, Any], bool]) -> None:
        self.config = config
        self.flow = flow
        self.table = flow.table
        self.counters = flow.counters
        self._send_node = send_node
        self.tcp = config.nodes_address.startswith("tcp://")
        self.proofs: dict[bytes, str] = {}
        """Node link id -> the proof it registered with, kept after it is lost (its late answers)."""
        self._refused_logged: set[bytes] = set()
        self._superseded: set[bytes] = set()
        """Links replaced by a newer process with the same proof: the old one, back from a stall,
        may not take the name back (two processes of one node would evict each other in turn)."""

    def on_message(self, frames: list[Any]) -> None:
        """``[link id][envelope][type][header]...`` from a node: an answer, or membership."""
        node_id, envelope = frames[0].bytes, frames[1].bytes
        if self.tcp and node_id in self.proofs and self._proof(frames[2], "") != self.proofs[node_id]:
            self.counters["bad_answers" if envelope else "names_refused"] += 1
            log.warning("dropped a message from node link %r: it comes with another key than it registered with",
                        node_id)
            return
        if envelope:
            self.flow.on_node_answer(node_id, envelope, frames[2:])
        else:
            self._on_membership(node_id, frames[2:])

    def _on_membership(self, node_id: bytes, frames: list[Any]) -> None:
        try:
            _, header, _ = framing.decode(frames, max_bytes=1 << 20, known_types=NODE_TYPES)
            msg = parse_node_message(header)
        except RolloutdError as e:
            log.warning("bad membership message from %r: %s", node_id, e)
            return
        node = self.table.get(node_id)
        if isinstance(msg, NodeRegister):
            self._register(node_id, msg, frames[0])
        elif isinstance(msg, NodeHeartbeat):
            if node is None:
                self._send_node(node_id, RouterUnknown("this router does not know the node (it restarted, or "
                                                       "dropped the node for missed heartbeats); register again"))
                return
            node.last_seen = time.monotonic()
            was_draining = node.draining
            node.capacity, node.draining = msg.capacity, msg.draining
            if was_draining != msg.draining:
                log.info("node %s %s", node.name, "drains: no new work" if msg.draining else "takes work again")
            self.flow.flush()
        elif isinstance(msg, NodeBye) and node is not None:
            self.flow.node_lost(node, f"it left ({msg.reason or 'no reason given'})")

    def _proof(self, frame: Any, token: str) -> str:
        if not self.tcp:
            return f"token:{token}"
        try:
            return scope.principal(frame, False)
        except RolloutdError:
            return ""  # proves nothing: matches no registered key

    def _register(self, node_id: bytes, msg: NodeRegister, frame: Any) -> None:
        known = self.table.get(node_id)
        token = "" if self.tcp else (msg.token or (known.proof[len("token:"):] if known else "")
                                     or secrets.token_hex(16))
        proof = self._proof(frame, token)
        holder = self.table.claim_conflict(node_id, msg.name, proof)
        if holder is not None or node_id in self._superseded:
            self.counters["names_refused"] += 1
            reason = (f"the name {msg.name!r} is held by a live node ({holder.host}, pid {holder.pid}) that proved "
                      "it first; give this node another --node-name, or stop the other" if holder is not None else
                      f"a newer process of node {msg.name!r} registered since; stop this one")
            if node_id not in self._refused_logged:
                self._refused_logged.add(node_id)
                log.warning("refused node %r from %s (pid %d): %s", node_id, msg.host, msg.pid, reason)
            self._send_node(node_id, RouterRefused(reason))
            return
        for other in self.table.replaced_by(node_id, msg.name):
            self._superseded.add(other.identity)
            self.flow.node_lost(other, "it registered again as a new process")
        self.proofs[node_id] = proof
        node = self.table.register(node_id, msg, proof)
        if known is None:
            self.counters["nodes_joined"] += 1
            log.info("node %s joined from %s (pid %d, %d slots%s)", msg.name, msg.host, msg.pid, msg.capacity.slots,
                     ", draining" if msg.draining else "")
            # Before any request: the inference set-up the others have (it keeps the order).
            self.flow.broadcasts.replay_to(node_id)
            self.flow.recovery.reconcile(node, msg.running, msg.finished, self.flow.send_to)
        self._send_node(node_id, RouterWelcome(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s,
                                               token))
        self.flow.flush()
