"""The router's request flow: accept a trainer's request under its owner's key, let it wait for a
node with room, send it there, send it again elsewhere when that node vanishes, take only the
answer of a node it was sent to for that very key, and answer it exactly once (through the
request book shared with the node daemon). No sockets here: the process hands in two senders.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rolloutd.daemon.common.request_book import (
    CACHE_ANSWER_MAX_BYTES,
    RequestBook,
    Send,
    as_bytes,
    error_frames,
    fingerprint,
    nbytes,
)
from rolloutd.daemon.router import scope
from rolloutd.daemon.router.broadcast import REPLAY_PREFIX, Broadcasts
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.dispatch import NodeEntry, routing_hints
from rolloutd.daemon.router.nodes import NodeTable
from rolloutd.daemon.router.recovery import Recovery
from rolloutd.daemon.router.requests import Pending
from rolloutd.native_io import framing
from rolloutd.native_io.errors import (
    Busy,
    Cancelled,
    DaemonUnavailable,
    NodeLost,
    RolloutdError,
    SandboxLost,
    ShuttingDown,
)
from rolloutd.native_io.wire import BROADCAST_OPS, MsgType
from rolloutd.native_io.zmq_loop import LoopSocket

log = logging.getLogger(__name__)

SendRaw = Callable[[bytes, bytes, list[Any]], bool]
"""(node id, envelope, frames) -> False when the node is unreachable."""


class RequestFlow:
    def __init__(self, config: RouterConfig, send: Send, send_raw: SendRaw) -> None:
        self.config = config
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "redispatched": 0, "node_lost": 0,
                         "late_dropped": 0, "duplicates": 0, "refused": 0, "nodes_joined": 0, "names_refused": 0,
                         "bad_answers": 0, "cancelled_on_return": 0, "resumed_on_return": 0, "late_taken": 0}
        self.book: RequestBook[Pending] = RequestBook(send, self.counters, config.completed_ttl_s)
        self.table = NodeTable()
        self.broadcasts = Broadcasts(self.table, send_raw, self._deliver, self.node_lost)
        self.recovery = Recovery(config.run_path, config.heartbeat_timeout_s, self.book, self.counters, send_raw)
        self.waiting: deque[str] = deque()
        """Accepted ids without a node yet, first come first served."""
        self.stopping = False
        self._send = send
        self._send_raw = send_raw
        self._flushing = False

    # --- trainers --------------------------------------------------------------------------

    def accept(self, sock: LoopSocket, client: bytes, proved: str, rid: str, header: dict[str, Any],
               frames: list[Any], status: Callable[[], dict[str, Any]]) -> None:
        """``proved``: who the transport says sent it (``scope.principal``)."""
        op = header.get("op")
        if op == "status":
            self._send(sock, client, framing.encode(MsgType.REPLY, {"id": rid, "result": status(), "refs": []}))
            return
        try:
            key = scope.owner_key(proved, header, rid)
        except RolloutdError as e:
            self._send(sock, client, error_frames(rid, e))
            return
        asked = fingerprint(header, frames[1])
        if self.book.repeat(key, client, sock, rid=rid, asked=asked):
            return
        try:
            if self.stopping:
                raise ShuttingDown("the router is shutting down")
            hints = routing_hints(op, header.get("args"))
            if hints.sandbox is None and len(self.waiting) >= self.config.queue_limit:
                raise Busy(f"{len(self.waiting)} requests already wait for a free node slot (queue_limit); "
                           "retry later, or add nodes")
        except RolloutdError as e:
            self._send(sock, client, error_frames(rid, e))
            return
        self.counters["requests"] += 1
        p = Pending(rid=rid, key=key, client=client, socket=sock, op=op if isinstance(op, str) else repr(op),
                    frames=scope.to_node(frames, header, key), hints=hints, fingerprint=asked)
        self.book.open(p)
        if op in BROADCAST_OPS:
            self.broadcasts.start(p)
            return
        if hints.sandbox is not None:
            node = self.table.sandboxes.get(hints.sandbox)
            if node is None:
                self._answer_error(p, SandboxLost(
                    f"no open sandbox {hints.sandbox!r} behind this router (closed, or its node is gone); "
                    "open a new one"))
            else:
                self.send_to(p, node)
            return
        self.waiting.append(key)
        self.flush()

    def cancel(self, proved: str, rid: str, header: dict[str, Any]) -> None:
        """Only the owner's request of that id: another client's ``rid`` is another key."""
        try:
            key = scope.owner_key(proved, header, rid)
        except RolloutdError:
            return
        p = self.book.get(key)
        if p is None or p.broadcast is not None:  # a broadcast is quick and must reach every node
            return
        if p.node is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(key)
            self._answer_error(p, Cancelled(f"request {rid} was cancelled before it reached a node"))
            return
        # A gone node is found by the probe or the heartbeat.
        self.recovery.cancel_on(p.node.identity, key)

    def shut_down(self) -> None:
        self.stopping = True
        for p in self.book:
            self._answer_error(p, ShuttingDown("the router is shutting down; resubmit when it is back"))

    # --- dispatch --------------------------------------------------------------------------

    def flush(self) -> None:
        """Hand waiting requests to nodes in order, until the first that fits nowhere."""
        if self._flushing or self.recovery.holding_back:
            return
        self._flushing = True
        try:
            while self.waiting:
                p = self.book.get(self.waiting[0])
                if p is None or p.node is not None:
                    self.waiting.popleft()
                    continue
                node = self.recovery.holder(p.key, self.table.get) or self.table.pick(p)
                if node is None:
                    return
                self.waiting.popleft()
                self.send_to(p, node)
        finally:
            self._flushing = False

    def send_to(self, p: Pending, node: NodeEntry) -> None:
        p.node = node
        p.sent_to.add(node.identity)
        node.take(p.key, p.hints.cost)
        if not self._send_raw(node.identity, p.key.encode(), p.frames):
            self.node_lost(node, "unreachable")

    def expire_waiting(self, now: float) -> None:
        """With no node taking work, requests wait at most ``no_node_timeout_s``."""
        keep: deque[str] = deque()
        for rid in self.waiting:
            p = self.book.get(rid)
            if p is None:
                continue
            if now - p.queued_at > self.config.no_node_timeout_s:
                self._answer_error(p, DaemonUnavailable(
                    f"no rollout node took work for {self.config.no_node_timeout_s} s (no_node_timeout_s); start or "
                    f"resume nodes with `rolloutd node start --router {self.config.nodes_address}`"))
            else:
                keep.append(rid)
        self.waiting = keep

    # --- nodes -----------------------------------------------------------------------------

    def on_node_answer(self, node_id: bytes, envelope: bytes, answer: list[Any]) -> None:
        if envelope.startswith(REPLAY_PREFIX):
            self.broadcasts.on_replay_answer(node_id, envelope, answer)
            self.recovery.ack(node_id, envelope.decode(errors="replace"))
            return
        node = self.table.get(node_id)
        key = envelope.decode(errors="replace")
        p = self.book.get(key)
        if p is None:
            # Answered already (a copy elsewhere, or a repeat): dropped here, arrays included, so
            # the trainer never sees a second one. Or this router never took it (it restarted).
            self.counters["late_dropped"] += 1
            self.recovery.unasked(node_id, key)
            return
        if node is not None and p.broadcast is not None and node_id in p.broadcast.answers:
            self.broadcasts.answer(node, p, answer)
            self.recovery.ack(node_id, key)
            return
        if node_id in p.withdrawn:  # its copy was cancelled: the answer that says so, or a late one
            self.counters["late_dropped"] += 1
            self.recovery.ack(node_id, key)
            return
        if node_id not in p.sent_to and not self.recovery.claim(key, node_id):
            self._bad_answer(node_id, key, "the request was not sent there")
            return
        frames = scope.to_client(answer, key, p.rid)
        if frames is None:
            self._bad_answer(node_id, key, "its header names another request")
            return
        if node is not None:
            node.last_seen = time.monotonic()
            if p.op in ("sandbox.open", "sandbox.close") or (
                    p.hints.sandbox is not None and as_bytes(answer[0]) == bytes((MsgType.ERROR,))):
                self.table.track_sandbox(node, p, answer)
            node.finish(key)
        if p.node is not None and p.node is not node:
            # A node presumed lost answered after all: the copy sent elsewhere is not needed.
            self.counters["late_taken"] += 1
            self.recovery.cancel_on(p.node.identity, key)
            p.withdrawn.add(p.node.identity)
            p.node.finish(key)
        p.node = None
        if self._deliver(p, frames):
            self.recovery.ack(node_id, key)

    def _bad_answer(self, node_id: bytes, key: str, why: str) -> None:
        self.counters["bad_answers"] += 1
        log.warning("dropped an answer for %r from node %r: %s", key, node_id, why)

    def node_lost(self, node: NodeEntry, reason: str) -> None:
        if not self.table.remove(node):
            return
        self.recovery.forget_node(node.identity)
        self.counters["node_lost"] += 1
        log.warning("node %s is gone: %s; re-dispatching its %d request(s)", node.name, reason, len(node.in_flight))
        requeue = []
        for rid in list(node.in_flight):
            p = self.book.get(rid)
            if p is None:
                continue
            if p.broadcast is not None:
                self.broadcasts.node_gone(node, p, reason)
                continue
            p.node = None
            if p.hints.sandbox is not None:
                self._answer_error(p, SandboxLost(
                    f"node {node.name}, which held sandbox {p.hints.sandbox}, is gone ({reason}); open a new sandbox"))
            elif p.attempts + 1 >= self.config.max_attempts:
                self._answer_error(p, NodeLost(
                    f"request {p.rid} ({p.op}) lost {p.attempts + 1} nodes (max_attempts), "
                    f"the last {node.name}: {reason}"))
            else:
                p.attempts += 1
                p.queued_at = time.monotonic()
                self.counters["redispatched"] += 1
                requeue.append(rid)
        node.in_flight.clear()
        node.cost_in_flight = 0
        self.waiting.extendleft(reversed(requeue))  # they were accepted before anything waiting now
        self.flush()

    # --- answers ---------------------------------------------------------------------------

    def _deliver(self, p: Pending, frames: list[Any]) -> bool:
        """True when it reached the trainer. Answers with arrays are kept only while the trainer
        cannot be reached (it reconnects): the next asker of the id collects them. Arrays come
        from nodes as frames: the same frames serve every asker who joined."""
        small = len(frames) == 2 and sum(nbytes(f) for f in frames) <= CACHE_ANSWER_MAX_BYTES
        delivered = self.book.answer(p, frames, kept=[as_bytes(f) for f in frames] if small else None,
                                     for_joined=lambda: frames, held=frames)
        if self.waiting:
            self.flush()
        return delivered

    def _answer_error(self, p: Pending, e: RolloutdError) -> None:
        if p.node is not None:
            p.node.finish(p.key)
            p.node = None
        self._deliver(p, error_frames(p.rid, e))
