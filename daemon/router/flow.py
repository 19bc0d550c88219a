"""The router's request flow: accept a trainer's request, let it wait for a node with room, send
it there, send it again elsewhere when that node vanishes, and answer it exactly once (through the
request book shared with the node daemon). No sockets here: the process hands in two senders.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rolloutd.daemon.common.request_book import CACHE_ANSWER_MAX_BYTES, RequestBook, Send, as_bytes, error_frames, nbytes
from rolloutd.daemon.router.broadcast import REPLAY_PREFIX, Broadcasts
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.dispatch import NodeEntry, routing_hints
from rolloutd.daemon.router.nodes import NodeTable
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
                         "late_dropped": 0, "duplicates": 0, "refused": 0, "nodes_joined": 0}
        self.book: RequestBook[Pending] = RequestBook(send, self.counters, config.completed_ttl_s)
        self.table = NodeTable()
        self.broadcasts = Broadcasts(self.table, send_raw, self._deliver, self.node_lost)
        self.waiting: deque[str] = deque()
        """Accepted ids without a node yet, first come first served."""
        self.stopping = False
        self._send = send
        self._send_raw = send_raw
        self._flushing = False

    # --- trainers --------------------------------------------------------------------------

    def accept(self, sock: LoopSocket, client: bytes, rid: str, header: dict[str, Any], frames: list[Any],
               status: Callable[[], dict[str, Any]]) -> None:
        if self.book.repeat(rid, client, sock):
            return
        op = header.get("op")
        if op == "status":
            self._send(sock, client, framing.encode(MsgType.REPLY, {"id": rid, "result": status(), "refs": []}))
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
        p = Pending(rid=rid, client=client, socket=sock, op=op if isinstance(op, str) else repr(op), frames=frames,
                    hints=hints)
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
                self._send_to(p, node)
            return
        self.waiting.append(rid)
        self.flush()

    def cancel(self, rid: str) -> None:
        p = self.book.get(rid)
        if p is None or p.broadcast is not None:  # a broadcast is quick and must reach every node
            return
        if p.node is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(rid)
            self._answer_error(p, Cancelled(f"request {rid} was cancelled before it reached a node"))
            return
        # A gone node is found by the probe or the heartbeat.
        self._send_raw(p.node.identity, rid.encode(), framing.encode(MsgType.CANCEL, {"id": rid}))

    def shut_down(self) -> None:
        self.stopping = True
        for p in self.book:
            self._answer_error(p, ShuttingDown("the router is shutting down; resubmit when it is back"))

    # --- dispatch --------------------------------------------------------------------------

    def flush(self) -> None:
        """Hand waiting requests to nodes in order, until the first that fits nowhere."""
        if self._flushing:
            return
        self._flushing = True
        try:
            while self.waiting:
                p = self.book.get(self.waiting[0])
                if p is None or p.node is not None:
                    self.waiting.popleft()
                    continue
                node = self.table.pick(p)
                if node is None:
                    return
                self.waiting.popleft()
                self._send_to(p, node)
        finally:
            self._flushing = False

    def _send_to(self, p: Pending, node: NodeEntry) -> None:
        p.node = node
        node.take(p.rid, p.hints.cost)
        if not self._send_raw(node.identity, p.rid.encode(), p.frames):
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
            return
        node = self.table.get(node_id)
        p = self.book.get(envelope.decode(errors="replace"))
        if node is not None and p is not None and p.broadcast is not None and node_id in p.broadcast.answers:
            self.broadcasts.answer(node, p, answer)
            return
        if node is None or p is None or p.node is not node:
            # A presumed-dead node's late answer, or one for an id already answered elsewhere:
            # dropped here, arrays included, so the trainer never sees a second answer.
            self.counters["late_dropped"] += 1
            log.debug("dropped a late answer for %r from %r", envelope, node_id)
            return
        node.last_seen = time.monotonic()
        if p.op in ("sandbox.open", "sandbox.close") or (
                p.hints.sandbox is not None and as_bytes(answer[0]) == bytes((MsgType.ERROR,))):
            self.table.track_sandbox(node, p, answer)
        node.finish(p.rid)
        p.node = None
        self._deliver(p, answer)

    def node_lost(self, node: NodeEntry, reason: str) -> None:
        if not self.table.remove(node):
            return
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
                    f"request {rid} ({p.op}) lost {p.attempts + 1} nodes (max_attempts), "
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

    def _deliver(self, p: Pending, frames: list[Any]) -> None:
        # Answers with arrays are not kept: the router forwards array frames, never stores them.
        # Arrays come from nodes as frames: the same frames serve every asker who joined.
        small = len(frames) == 2 and sum(nbytes(f) for f in frames) <= CACHE_ANSWER_MAX_BYTES
        self.book.answer(p, frames, kept=[as_bytes(f) for f in frames] if small else None, for_joined=lambda: frames)
        if self.waiting:
            self.flush()

    def _answer_error(self, p: Pending, e: RolloutdError) -> None:
        if p.node is not None:
            p.node.finish(p.rid)
            p.node = None
        self._deliver(p, error_frames(p.rid, e))
