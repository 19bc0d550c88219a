"""``rolloutd router``: one address for trainers in front of many node daemons.

Two ROUTER sockets: trainers (``router.sock`` on this host, optionally TCP with CURVE) and node
daemons (``nodes.sock`` or TCP with CURVE). A node connects out with a DEALER, registers with its
capacity, heartbeats, and gets requests as ``[request id][type][header][buffers...]``; its
answers come back the same way and go to the trainer without their header being decoded (the
id in front is the routing key). Array frames are forwarded as they came, never copied or kept.

Promises kept here:
- an id belongs to its client (``scope``): another client's same id is another request, a cancel
  reaches only the owner's;
- every accepted id gets exactly one final answer; a repeated id is joined while in flight and
  answered again from the record after (if the answer had no arrays, or its trainer could not be
  reached: then it is kept whole until asked again), never run twice here; a repeat that asks
  something else is refused (DUPLICATE_REQUEST naming the field);
- a node's name is held by the live node that proved it first (its CURVE key, or over ipc a token
  this router issued): another peer registering under it is refused, a restarted node proves it;
- an answer is taken only from a node the request was sent to, under the key it was sent;
- a request whose node vanishes (its connection closes, or it misses heartbeats for
  ``heartbeat_timeout_s``, or it leaves) is re-dispatched to another node, up to
  ``max_attempts`` nodes; an op pinned to a sandbox of that node is answered SANDBOX_LOST;
- a node presumed dead that answers while the id is pending anywhere is believed (the copy
  elsewhere is cancelled); an answer for an id already answered is dropped with its arrays
  (``late_dropped``): the trainer never gets a second answer (see ``recovery`` for what a node
  that comes back, or a router that restarts, does with the rest);
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
from pathlib import Path
from typing import Any

import zmq

from rolloutd.daemon.common.request_book import checked_id, error_frames, salvage_id
from rolloutd.daemon.router import scope
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.flow import RequestFlow
from rolloutd.daemon.router.membership import Membership
from rolloutd.native_io import framing
from rolloutd.native_io.curve import CurveServer
from rolloutd.native_io.errors import PermissionDenied, RolloutdError
from rolloutd.native_io.wire import CLIENT_TYPES, MsgType, RouterPing, node_message
from rolloutd.native_io.zmq_loop import LoopSocket, SocketEvents
from rolloutd.native_io.zmq_sockets import bind_private_ipc, make_socket, peer_credentials

log = logging.getLogger(__name__)

TICK_MAX_S = 0.25
"""The router looks at heartbeats and waiting requests at least this often."""
PROBE_DELAYS_S = (0.02, 0.3)
"""After a node connection closes: its pipe goes away a moment after the event; probe once soon
and once later."""


class Router:
    """The router process: its sockets, its loop and heartbeat watch; node messages go through
    :class:`Membership`, the requests themselves through :class:`RequestFlow`."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.curve: CurveServer | None = None
        self.local: LoopSocket | None = None
        self.tcp: LoopSocket | None = None
        self.node_sock: LoopSocket | None = None
        self.node_watch: SocketEvents | None = None
        self.flow = RequestFlow(config, self._send, self._send_raw)
        self.table = self.flow.table
        self.counters = self.flow.counters
        self.local_peers: set[bytes] = set()
        """Routing ids on the ipc sockets whose uid was checked."""
        self.allowed_uids = {os.getuid(), 0}
        self.membership = Membership(config, self.flow, self._send_node)
        self.started_at = time.time()
        self._stop = asyncio.Event()

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
            self.flow.recovery.started()
            log.info("router ready: trainers at %s%s, nodes at %s", self.config.address,
                     f" and {self.config.tcp_bind}" if self.config.tcp_bind else "", self.config.nodes_address)
            if ready is not None:
                ready.set()
            async with asyncio.TaskGroup() as tg:
                tick = tg.create_task(self._tick_loop())
                await self._stop.wait()
                tick.cancel()
            self.flow.shut_down()
            self.flow.recovery.stopped()
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
            rid = checked_id(msg_type, header)
            proved = scope.principal(rest[0], local)
        except RolloutdError as e:
            self._send(sock, client, error_frames(salvage_id(rest), e))
            return
        if msg_type == MsgType.CANCEL:
            self.flow.cancel(proved, rid, header)
        elif msg_type == MsgType.REQUEST:
            self.flow.accept(sock, client, proved, rid, header, rest, self.status)
        # RELEASE: answers through the router carry arrays as frames; there is nothing to give back.

    def _local_peer_allowed(self, sock: LoopSocket, peer: bytes, rest: list[Any]) -> bool:
        creds = peer_credentials(rest[0]) if rest else None
        if creds is not None and creds[0] not in self.allowed_uids:
            self.counters["refused"] += 1
            log.warning("refused a message from uid %d (pid %d) on %s", creds[0], creds[2], self.config.address)
            self._send(sock, peer, error_frames("", PermissionDenied(
                f"uid {creds[0]} may not use this router (owner uid {os.getuid()})")))
            return False
        self.local_peers.add(peer)
        return True

    def _send(self, sock: LoopSocket | None, client: bytes, frames: list[Any]) -> bool:
        assert sock is not None
        try:
            sock.send([client, *frames])
            return True
        except zmq.ZMQError as e:
            # The trainer is gone (or reconnecting). Its answer is kept; a retry with the same id gets it.
            log.info("trainer %r unreachable (%s); answer kept for a retry", client, e)
            return False

    # --- nodes -----------------------------------------------------------------------------

    def _on_node(self, frames: list[Any]) -> None:
        if len(frames) >= 3:
            self.membership.on_message(frames)

    def _send_node(self, node_id: bytes, msg: Any) -> bool:
        return self._send_raw(node_id, b"", node_message(msg))

    def _send_raw(self, node_id: bytes, envelope: bytes, frames: list[Any]) -> bool:
        assert self.node_sock is not None
        try:
            self.node_sock.send([node_id, envelope, *frames])
            return True
        except zmq.ZMQError:
            return False

    def _on_node_disconnect(self) -> None:
        loop = asyncio.get_running_loop()
        for delay in PROBE_DELAYS_S:
            loop.call_later(delay, self._probe_nodes)

    def _probe_nodes(self) -> None:
        for node in self.table:
            if not self._send_node(node.identity, RouterPing()):
                self.flow.node_lost(node, "its connection closed")

    async def _tick_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(min(TICK_MAX_S, cfg.heartbeat_interval_s / 2))
            now = time.monotonic()
            for node in self.table:
                if now - node.last_seen > cfg.heartbeat_timeout_s:
                    self.flow.node_lost(node, f"no heartbeat for {now - node.last_seen:.1f} s (heartbeat_timeout_s)")
            if self.flow.waiting and not self.table.any_accepting:
                self.flow.expire_waiting(now)
            self.flow.book.forget_expired(now)
            self.flow.recovery.send_acks()
            self.flow.flush()  # also what waited while a restarted router heard from its nodes

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "role": "router", "pid": os.getpid(), "host": socket.gethostname(), "address": self.config.address,
            "tcp": self.config.tcp_bind or None, "nodes_address": self.config.nodes_address,
            "uptime_s": time.time() - self.started_at,
            "nodes": self.table.status(now),
            "in_flight": len(self.flow.book), "waiting": len(self.flow.waiting), "sandboxes": len(self.table.sandboxes),
            "inference_setup_ops": len(self.flow.broadcasts.setup),
            "counters": dict(self.counters),
        }
