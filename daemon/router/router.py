"""``rolloutd router``: one address for trainers in front of many node daemons.

Two ROUTER sockets: trainers (``router.sock`` on this host, optionally TCP with CURVE) and node
daemons (``nodes.sock`` or TCP with CURVE). A node connects out with a DEALER, registers with its
capacity, heartbeats, and gets requests as ``[request id][type][header][buffers...]``; its
answers come back the same way and go to the trainer without their header being decoded (the
id in front is the routing key). Array frames are forwarded as they came, never copied or kept.

Promises kept here:
- every accepted id gets exactly one final answer; a repeated id is joined while in flight and
  answered again from the record after (if the answer had no arrays), never run twice here;
- a request whose node vanishes (its connection closes, or it misses heartbeats for
  ``heartbeat_timeout_s``, or it leaves) is re-dispatched to another node, up to
  ``max_attempts`` nodes; an op pinned to a sandbox of that node is answered SANDBOX_LOST;
- an answer from a node presumed dead, or for an id no longer on that node, is dropped with its
  arrays (``late_dropped``): the trainer never gets a second answer;
- only the owner (or root) may use the ipc sockets (SO_PEERCRED); TCP peers need a listed key.
The router does no slow work: per message a small header decode at most, a dict lookup, a send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from rolloutd.daemon.node.supervisor import MAX_ID_LEN, _salvage_id
from rolloutd.daemon.router.broadcast import REPLAY_PREFIX, TYPE_ERROR, Broadcast, BroadcastOps, InferenceSetup, as_bytes
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.dispatch import Hints, NodeEntry, pick_node, routing_hints
from rolloutd.native_io import framing
from rolloutd.native_io.curve import CurveServer
from rolloutd.native_io.errors import (
    BadRequest,
    Busy,
    Cancelled,
    DaemonUnavailable,
    DuplicateRequest,
    NodeLost,
    PermissionDenied,
    RolloutdError,
    SandboxLost,
    ShuttingDown,
)
from rolloutd.native_io.wire import (
    BROADCAST_OPS,
    CLIENT_TYPES,
    MsgType,
    NodeBye,
    NodeHeartbeat,
    NodeRegister,
    RouterPing,
    RouterUnknown,
    RouterWelcome,
    node_message,
    parse_node_message,
)
from rolloutd.native_io.zmq_loop import LoopSocket, SocketEvents
from rolloutd.native_io.zmq_sockets import bind_private_ipc, make_socket, peer_credentials

log = logging.getLogger(__name__)

CACHE_ANSWER_MAX_BYTES = 64 * 1024
"""Answers without arrays up to this size are kept for repeats; others are only marked answered."""
AFFINITY_MAX = 65536
"""Task instances remembered -> node (oldest forgotten first)."""
NODE_TYPES = frozenset({MsgType.NODE})


@dataclass(slots=True)
class Pending:
    """An accepted request without its final answer yet."""

    rid: str
    client: bytes
    sock: LoopSocket
    """The trainer socket (local ipc or TCP) the answer goes out on."""
    op: str
    frames: list[Any]
    """As received from the trainer, type onward; kept (not copied) to re-dispatch."""
    hints: Hints
    node: NodeEntry | None = None
    attempts: int = 0
    """Nodes that died under it so far."""
    queued_at: float = field(default_factory=time.monotonic)
    broadcast: Broadcast | None = None
    """For ops every node applies: their answers so far."""


class Router(BroadcastOps):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.curve: CurveServer | None = None
        self.local: LoopSocket | None = None
        self.tcp: LoopSocket | None = None
        self.node_sock: LoopSocket | None = None
        self.node_watch: SocketEvents | None = None
        self.nodes: dict[bytes, NodeEntry] = {}
        self.pending: dict[str, Pending] = {}
        self.waiting: deque[str] = deque()
        """Accepted ids without a node yet, first come first served."""
        self.completed: OrderedDict[str, tuple[float, list[bytes] | None]] = OrderedDict()
        self.sandboxes: dict[str, NodeEntry] = {}
        self.affinity: OrderedDict[str, bytes] = OrderedDict()
        self.inference = InferenceSetup()
        self.local_peers: set[bytes] = set()
        """Routing ids on the ipc sockets whose uid was checked."""
        self.allowed_uids = {os.getuid(), 0}
        self.stopping = False
        self.started_at = time.time()
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "redispatched": 0, "node_lost": 0,
                         "late_dropped": 0, "duplicates": 0, "refused": 0, "nodes_joined": 0}
        self._stop = asyncio.Event()
        self._flushing = False

    # --- lifecycle -------------------------------------------------------------------------

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        run = self.config.run_path
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(run, 0o700)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            self._open_sockets()
            log.info("router ready: trainers at %s%s, nodes at %s", self.config.address,
                     f" and {self.config.tcp_bind}" if self.config.tcp_bind else "", self.config.nodes_address)
            if ready is not None:
                ready.set()
            async with asyncio.TaskGroup() as tg:
                tick = tg.create_task(self._tick_loop())
                await self._stop.wait()
                tick.cancel()
            self._shutdown()
        finally:
            self._close_sockets()


    def _open_sockets(self) -> None:
        cfg = self.config
        if cfg.tcp_bind or cfg.nodes_address.startswith("tcp://"):
            self.curve = CurveServer(self.ctx, cfg.curve_secret_key_file)
        local = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
        bind_private_ipc(local, cfg.socket_path)
        self.local = LoopSocket(local, lambda f: self._on_client(self.local, f, True))
        if cfg.tcp_bind:
            assert self.curve is not None
            tcp = self.curve.bind_router(cfg.tcp_bind, cfg.client_keys_dir, "trainers")
            self.tcp = LoopSocket(tcp, lambda f: self._on_client(self.tcp, f, False))
        # A closed node connection is found at once by probing (a send to a gone peer fails), not
        # only after heartbeat_timeout_s.
        if cfg.nodes_address.startswith("tcp://"):
            assert self.curve is not None
            nodes = self.curve.bind_router(cfg.nodes_address, cfg.node_keys_dir, "nodes", self._on_node_disconnect)
        else:
            nodes = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
            nodes.setsockopt(zmq.ROUTER_HANDOVER, 1)
            bind_private_ipc(nodes, Path(cfg.nodes_address[len("ipc://"):]))
            self.node_watch = SocketEvents(nodes, zmq.EVENT_DISCONNECTED, lambda _event: self._on_node_disconnect())
        self.node_sock = LoopSocket(nodes, self._on_node)

    def _close_sockets(self) -> None:
        if self.node_watch is not None:
            self.node_watch.close()
        for sock in (self.local, self.tcp, self.node_sock):
            if sock is not None:
                sock.close(linger_ms=200)
        if self.curve is not None:
            self.curve.close()
        self.ctx.term()
        paths = [self.config.socket_path]
        if self.config.nodes_address.startswith("ipc://"):
            paths.append(Path(self.config.nodes_address[len("ipc://"):]))
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _shutdown(self) -> None:
        self.stopping = True
        for p in list(self.pending.values()):
            self._answer_error(p, ShuttingDown("the router is shutting down; resubmit when it is back"))

    # --- trainers --------------------------------------------------------------------------

    def _on_client(self, sock: LoopSocket | None, frames: list[Any], local: bool) -> None:
        assert sock is not None
        client = frames[0].bytes
        rest = frames[1:]
        if local and client not in self.local_peers and not self._local_peer_allowed(sock, client, rest):
            return
        try:
            msg_type, header, _ = framing.decode(rest, max_bytes=self.config.max_message_bytes,
                                                 known_types=CLIENT_TYPES)
            rid = header.get("id")
            if msg_type != MsgType.RELEASE and (not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LEN):
                raise BadRequest(f"request id must be a non-empty string of at most {MAX_ID_LEN} characters")
        except RolloutdError as e:
            self._send(sock, client, _error_frames(_salvage_id(rest), e))
            return
        if msg_type == MsgType.CANCEL:
            self._cancel(rid)
        elif msg_type == MsgType.REQUEST:
            self._accept(sock, client, rid, header, rest)
        # RELEASE: answers through the router carry arrays as frames; there is nothing to give back.

    def _local_peer_allowed(self, sock: LoopSocket, peer: bytes, rest: list[Any]) -> bool:
        creds = peer_credentials(rest[0]) if rest else None
        if creds is not None and creds[0] not in self.allowed_uids:
            self.counters["refused"] += 1
            log.warning("refused a message from uid %d (pid %d) on %s", creds[0], creds[2], self.config.address)
            self._send(sock, peer, _error_frames("", PermissionDenied(
                f"uid {creds[0]} may not use this router (owner uid {os.getuid()})")))
            return False
        self.local_peers.add(peer)
        return True

    def _accept(self, sock: LoopSocket, client: bytes, rid: str, header: dict[str, Any], frames: list[Any]) -> None:
        p = self.pending.get(rid)
        if p is not None:
            self.counters["duplicates"] += 1
            p.client, p.sock = client, sock  # the newest asker gets the one answer
            return
        cached = self.completed.get(rid)
        if cached is not None:
            self.counters["duplicates"] += 1
            self._send(sock, client, cached[1] if cached[1] is not None else _error_frames(rid, DuplicateRequest(
                f"request {rid} was already answered with arrays, which the router does not keep; use a new id")))
            return
        op = header.get("op")
        if op == "status":
            self._send(sock, client, framing.encode(MsgType.REPLY, {"id": rid, "result": self.status(), "refs": []}))
            return
        try:
            if self.stopping:
                raise ShuttingDown("the router is shutting down")
            hints = routing_hints(op, header.get("args"))
            if hints.sandbox is None and len(self.waiting) >= self.config.queue_limit:
                raise Busy(f"{len(self.waiting)} requests already wait for a free node slot (queue_limit); "
                           "retry later, or add nodes")
        except RolloutdError as e:
            self._send(sock, client, _error_frames(rid, e))
            return
        self.counters["requests"] += 1
        p = Pending(rid, client, sock, op if isinstance(op, str) else repr(op), frames, hints)
        self.pending[rid] = p
        if op in BROADCAST_OPS:
            self._broadcast(p)
            return
        if hints.sandbox is not None:
            node = self.sandboxes.get(hints.sandbox)
            if node is None:
                self._answer_error(p, SandboxLost(
                    f"no open sandbox {hints.sandbox!r} behind this router (closed, or its node is gone); "
                    "open a new one"))
            else:
                self._send_to(p, node)
            return
        self.waiting.append(rid)
        self._flush()

    def _cancel(self, rid: str) -> None:
        p = self.pending.get(rid)
        if p is None or p.broadcast is not None:  # a broadcast is quick and must reach every node
            return
        if p.node is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(rid)
            self._answer_error(p, Cancelled(f"request {rid} was cancelled before it reached a node"))
            return
        assert self.node_sock is not None
        with contextlib.suppress(zmq.ZMQError):  # a gone node is found by the probe or the heartbeat
            self.node_sock.send([p.node.identity, rid.encode(), *framing.encode(MsgType.CANCEL, {"id": rid})])

    # --- dispatch --------------------------------------------------------------------------

    def _flush(self) -> None:
        """Hand waiting requests to nodes in order, until the first that fits nowhere."""
        if self._flushing:
            return
        self._flushing = True
        try:
            while self.waiting:
                p = self.pending.get(self.waiting[0])
                if p is None or p.node is not None:
                    self.waiting.popleft()
                    continue
                node = self._pick(p)
                if node is None:
                    return
                self.waiting.popleft()
                self._send_to(p, node)
        finally:
            self._flushing = False

    def _pick(self, p: Pending) -> NodeEntry | None:
        key = p.hints.affinity
        preferred = self.nodes.get(self.affinity.get(key, b"")) if key is not None else None
        node = pick_node(self.nodes.values(), p.hints, preferred)
        if node is not None and key is not None:
            self.affinity[key] = node.identity
            self.affinity.move_to_end(key)
            if len(self.affinity) > AFFINITY_MAX:
                self.affinity.popitem(last=False)
        return node

    def _send_to(self, p: Pending, node: NodeEntry) -> None:
        assert self.node_sock is not None
        p.node = node
        node.take(p.rid, p.hints.cost)
        try:
            self.node_sock.send([node.identity, p.rid.encode(), *p.frames])
        except zmq.ZMQError as e:
            self._node_lost(node, f"unreachable ({e})")

    # --- nodes -----------------------------------------------------------------------------

    def _on_node(self, frames: list[Any]) -> None:
        if len(frames) < 3:
            return
        node_id, envelope = frames[0].bytes, frames[1].bytes
        node = self.nodes.get(node_id)
        if not envelope:
            self._on_membership(node_id, node, frames[2:])
            return
        if envelope.startswith(REPLAY_PREFIX):
            self._on_replay_answer(node_id, envelope, frames[2:])
            return
        p = self.pending.get(envelope.decode(errors="replace"))
        if node is not None and p is not None and p.broadcast is not None and node_id in p.broadcast.answers:
            self._broadcast_answer(node, p, frames[2:])
            return
        if node is None or p is None or p.node is not node:
            # A presumed-dead node's late answer, or one for an id already answered elsewhere:
            # dropped here, arrays included, so the trainer never sees a second answer.
            self.counters["late_dropped"] += 1
            log.debug("dropped a late answer for %r from %r", envelope, node_id)
            return
        node.last_seen = time.monotonic()
        answer = frames[2:]
        if p.op in ("sandbox.open", "sandbox.close") or (p.hints.sandbox is not None and answer[0].bytes == TYPE_ERROR):
            self._track_sandbox(node, p, answer)
        node.finish(p.rid)
        p.node = None
        self._deliver(p, answer)

    def _track_sandbox(self, node: NodeEntry, p: Pending, answer: list[Any]) -> None:
        try:
            msg_type, header, _ = framing.decode(answer, max_bytes=1 << 62,
                                                 known_types=frozenset({MsgType.REPLY, MsgType.ERROR}))
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

    def _on_membership(self, node_id: bytes, node: NodeEntry | None, frames: list[Any]) -> None:
        try:
            _, header, _ = framing.decode(frames, max_bytes=1 << 20, known_types=NODE_TYPES)
            msg = parse_node_message(header)
        except RolloutdError as e:
            log.warning("bad membership message from %r: %s", node_id, e)
            return
        if isinstance(msg, NodeRegister):
            self._register(node_id, msg)
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
            self._flush()
        elif isinstance(msg, NodeBye) and node is not None:
            self._node_lost(node, f"it left ({msg.reason or 'no reason given'})")

    def _register(self, node_id: bytes, msg: NodeRegister) -> None:
        for other in list(self.nodes.values()):
            if other.name == msg.name and other.identity != node_id:
                self._node_lost(other, "it registered again as a new process")
        node = self.nodes.get(node_id)
        if node is None:
            node = NodeEntry(node_id, msg.name, msg.host, msg.pid, msg.capacity, msg.draining)
            self.nodes[node_id] = node
            self.counters["nodes_joined"] += 1
            log.info("node %s joined from %s (pid %d, %d slots%s)", msg.name, msg.host, msg.pid, msg.capacity.slots,
                     ", draining" if msg.draining else "")
            # Before any request: the inference set-up the others have (it keeps the order).
            for envelope, frames in self.inference.replay():
                self._send_raw(node_id, envelope, frames)
        node.capacity, node.draining, node.last_seen = msg.capacity, msg.draining, time.monotonic()
        self._send_node(node_id, RouterWelcome(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s))
        self._flush()

    def _send_node(self, node_id: bytes, msg: Any) -> bool:
        return self._send_raw(node_id, b"", node_message(msg))

    def _send_raw(self, node_id: bytes, envelope: bytes, frames: list[Any]) -> bool:
        assert self.node_sock is not None
        try:
            self.node_sock.send([node_id, envelope, *frames])
            return True
        except zmq.ZMQError:
            return False

    def _node_lost(self, node: NodeEntry, reason: str) -> None:
        if self.nodes.get(node.identity) is not node:
            return
        del self.nodes[node.identity]
        self.counters["node_lost"] += 1
        log.warning("node %s is gone: %s; re-dispatching its %d request(s)", node.name, reason, len(node.in_flight))
        for sid in node.sandboxes:
            self.sandboxes.pop(sid, None)
        requeue = []
        for rid in list(node.in_flight):
            p = self.pending.get(rid)
            if p is None:
                continue
            if p.broadcast is not None:
                p.broadcast.drop(node.identity, reason)
                if p.broadcast.complete:
                    self._finish_broadcast(p)
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
        self._flush()

    def _on_node_disconnect(self) -> None:
        # The peer's pipe goes away a moment after the event; probe once soon and once later.
        loop = asyncio.get_running_loop()
        for delay in (0.02, 0.3):
            loop.call_later(delay, self._probe_nodes)

    def _probe_nodes(self) -> None:
        for node in list(self.nodes.values()):
            if not self._send_node(node.identity, RouterPing()):
                self._node_lost(node, "its connection closed")

    async def _tick_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(min(0.25, cfg.heartbeat_interval_s / 2))
            now = time.monotonic()
            for node in list(self.nodes.values()):
                if now - node.last_seen > cfg.heartbeat_timeout_s:
                    self._node_lost(node, f"no heartbeat for {now - node.last_seen:.1f} s (heartbeat_timeout_s)")
            if self.waiting and not any(n.accepting for n in self.nodes.values()):
                self._expire_waiting(now)
            while self.completed:
                _, (t, _) = next(iter(self.completed.items()))
                if now - t < cfg.completed_ttl_s:
                    break
                self.completed.popitem(last=False)

    def _expire_waiting(self, now: float) -> None:
        keep: deque[str] = deque()
        for rid in self.waiting:
            p = self.pending.get(rid)
            if p is None:
                continue
            if now - p.queued_at > self.config.no_node_timeout_s:
                self._answer_error(p, DaemonUnavailable(
                    f"no rollout node took work for {self.config.no_node_timeout_s} s (no_node_timeout_s); start or "
                    f"resume nodes with `rolloutd node start --router {self.config.nodes_address}`"))
            else:
                keep.append(rid)
        self.waiting = keep

    # --- answers ---------------------------------------------------------------------------

    def _deliver(self, p: Pending, frames: list[Any]) -> None:
        """The one place a final answer leaves: exactly once per accepted id."""
        del self.pending[p.rid]
        type_byte = as_bytes(frames[0])
        self.counters["errors" if type_byte == TYPE_ERROR else "replies"] += 1
        keep = None
        if len(frames) == 2 and len(_view(frames[1])) <= CACHE_ANSWER_MAX_BYTES:
            keep = [type_byte, as_bytes(frames[1])]
        self.completed[p.rid] = (time.monotonic(), keep)
        self._send(p.sock, p.client, frames)
        if self.waiting:
            self._flush()

    def _answer_error(self, p: Pending, e: RolloutdError) -> None:
        if p.node is not None:
            p.node.finish(p.rid)
            p.node = None
        self._deliver(p, _error_frames(p.rid, e))

    def _send(self, sock: LoopSocket, client: bytes, frames: list[Any]) -> None:
        try:
            sock.send([client, *frames])
        except zmq.ZMQError as e:
            # The trainer is gone. Its answer is recorded; a retry with the same id gets it.
            log.info("trainer %r unreachable (%s); answer kept for a retry", client, e)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "role": "router", "pid": os.getpid(), "host": socket.gethostname(), "address": self.config.address,
            "tcp": self.config.tcp_bind or None, "nodes_address": self.config.nodes_address,
            "uptime_s": time.time() - self.started_at,
            "nodes": [n.status(now) for n in self.nodes.values()],
            "in_flight": len(self.pending), "waiting": len(self.waiting), "sandboxes": len(self.sandboxes),
            "inference_setup_ops": len(self.inference),
            "counters": dict(self.counters),
        }


def _error_frames(rid: str, e: RolloutdError) -> list[bytes]:
    return framing.encode(MsgType.ERROR, {"id": rid, "code": e.code, "message": str(e), "details": {}})


def _view(frame: Any) -> Any:
    return frame if isinstance(frame, bytes) else frame.buffer
