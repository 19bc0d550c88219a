"""A node's membership at a router: the supervisor extension behind ``rolloutd node start --router``.

The node connects out (a DEALER; CURVE for a tcp router), registers with its capacity once its
workers are ready, and heartbeats. Requests arrive as ``[request id][type][header][buffers...]``
and go to the supervisor as if from a TCP client (arrays as raw frames, never shared memory); the
supervisor's answer leaves through this socket with the id in front. When the router does not
know the node (it restarted, or dropped the node for silence) the node registers again.

Exactly once across router faults (the router's ``recovery``): every answer sent this way is kept
here, arrays included, until the router acknowledges it (or ``completed_ttl_s`` passes), and a
registration lists what is kept and what still runs; a router asking again for a kept id gets it
from here. Over ipc the node proves its name with the token the router issued at its first
registration, kept in ``<run folder>/router-token`` so a restarted node is known as the same.

Drain (finish what it has, take nothing new) and resume are signals, so no new socket or op is
needed: SIGUSR1 drains, SIGUSR2 resumes (``rolloutd node drain [--resume]``). The link's state is
written to ``<run folder>/router-link.json`` for that command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import zmq

from rolloutd.daemon.common.request_book import as_bytes
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.native_io import framing
from rolloutd.native_io.curve import CurveClient, watch_handshakes
from rolloutd.native_io.errors import RolloutdError
from rolloutd.native_io.wire import (
    FINAL_TYPES,
    MsgType,
    NodeBye,
    NodeCapacity,
    NodeHeartbeat,
    NodeRegister,
    RouterAck,
    RouterRefused,
    RouterUnknown,
    RouterWelcome,
    node_message,
    parse_node_message,
)
from rolloutd.native_io.zmq_loop import LoopSocket, SocketEvents
from rolloutd.native_io.zmq_sockets import make_socket

log = logging.getLogger(__name__)

STATE_FILE = "router-link.json"
TOKEN_FILE = "router-token"
DRAIN_SIGNAL = signal.SIGUSR1
RESUME_SIGNAL = signal.SIGUSR2
FIRST_INTERVAL_S = 1.0
"""Heartbeat interval until the router's welcome names its own."""
READY_TIMEOUT_S = 300.0


def capacity_report(supervisor: Any) -> NodeCapacity:
    """What this node offers the router; extend here as the node learns to report more.

    ``slots`` (what the router may have in flight here): ``router_slots``, else the samples the
    node's stages hold at once (init + run + eval concurrency); 0 until a worker is ready.
    ``free``: per stage, the slots neither in use nor promised to a waiting sample, summed over
    the ready workers' pipelines. ``images``: the warm image, while sandboxes of it are ready.
    """
    config: NodeConfig = supervisor.config
    ready = [w for w in supervisor.workers if w.ready]
    slots = config.router_slots or (config.init_concurrency + config.run_concurrency + config.eval_concurrency)
    free: dict[str, int] = {}
    warm = 0
    for w in ready:
        warm += int(w.stats.get("pool", {}).get("ready", 0))
        for stage, st in w.stats.get("pipeline", {}).get("stages", {}).items():
            free[stage] = free.get(stage, 0) + max(0, int(st["limit"]) - int(st["in_use"]) - int(st["waiting"]))
    return NodeCapacity(slots=slots if ready else 0, workers_ready=len(ready), in_flight=len(supervisor.flow.book),
                        free=free, images=[config.image] if warm else [])


class KeptAnswers:
    """The link's sender for the supervisor: it keeps every final answer until the router
    acknowledges it (copied to bytes: the frames may be buffers of the worker link, reused)."""

    def __init__(self, ttl_s: float) -> None:
        self.sock: LoopSocket | None = None
        self.kept: OrderedDict[bytes, tuple[float, list[bytes]]] = OrderedDict()
        self._ttl_s = ttl_s
        self._final = {bytes((t,)) for t in FINAL_TYPES}

    def send(self, frames: list[Any]) -> None:
        if len(frames) > 1 and as_bytes(frames[1]) in self._final:
            self.kept[as_bytes(frames[0])] = (time.monotonic(), [as_bytes(f) for f in frames[1:]])
        assert self.sock is not None
        self.sock.send(frames)

    def resend(self, envelope: bytes) -> bool:
        """The kept answer of ``envelope`` sent again; False when none is kept."""
        kept = self.kept.get(envelope)
        if kept is None:
            return False
        with contextlib.suppress(zmq.ZMQError):  # not connected now: the next registration lists it
            self.send([envelope, *kept[1]])
        return True

    def acked(self, ids: list[str]) -> None:
        for rid in ids:
            self.kept.pop(rid.encode(), None)

    def expire(self, now: float) -> None:
        while self.kept and now - next(iter(self.kept.values()))[0] > self._ttl_s:
            self.kept.popitem(last=False)


class RouterLink:
    """Supervisor extension (``async start(supervisor)`` / ``async stop()``)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.name = config.node_name or f"{socket.gethostname()}:{config.run_path}"
        self.incarnation = uuid.uuid4().hex[:12]
        self.identity = f"{self.name[:200]}/{self.incarnation}".encode()
        self.registered = False
        self.draining = False
        self.interval_s = FIRST_INTERVAL_S
        self.supervisor: Any = None
        self.ctx: zmq.Context[Any] | None = None
        self.sock: LoopSocket | None = None
        self.watch: SocketEvents | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        """Set when there is news for the router (drain, resume, re-register) or for the state file."""
        self._state_dirty = True
        self._state_file = config.run_path / STATE_FILE
        self._token_file = config.run_path / TOKEN_FILE
        self.token = _read_token(self._token_file)
        self.answers = KeptAnswers(config.completed_ttl_s)
        self.refused = ""

    async def start(self, supervisor: Any) -> None:
        self.supervisor = supervisor
        # Its own context: the supervisor's context can terminate even if this link was never stopped.
        self.ctx = zmq.Context()
        sock = make_socket(self.ctx, zmq.DEALER, identity=self.identity, linger_ms=500)
        # No queueing while disconnected: an answer the router cannot get now is kept by the
        # supervisor for a retry (it catches the error), not piled up for a router that may be new.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.config.router.startswith("tcp://"):
            CurveClient(self.config.curve_secret_key_file, self.config.router_public_key_file).apply_client(sock)
            self.watch = watch_handshakes(sock, lambda reason: log.error(
                "the router at %s refused this node: %s; give the router this node's public key (.key next to %s)",
                self.config.router, reason, self.config.curve_secret_key_file))
        sock.connect(self.config.router)
        self.sock = self.answers.sock = LoopSocket(sock, self._on_message)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(DRAIN_SIGNAL, self.set_draining, True)
        loop.add_signal_handler(RESUME_SIGNAL, self.set_draining, False)
        self._task = loop.create_task(self._run())
        log.info("joining router %s as %s", self.config.router, self.identity.decode())

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (DRAIN_SIGNAL, RESUME_SIGNAL):
            loop.remove_signal_handler(sig)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.registered:
            self._send_node(NodeBye("the node daemon is stopping"))
        if self.watch is not None:
            self.watch.close()
        if self.sock is not None:
            self.sock.close(linger_ms=500)
        if self.ctx is not None:
            await asyncio.to_thread(self.ctx.term)  # waits out the linger of the goodbye
        await asyncio.to_thread(_remove, self._state_file)

    def set_draining(self, draining: bool) -> None:
        if draining != self.draining:
            self.draining = draining
            log.info("%s", "draining: finishing what this node has, taking nothing new" if draining
                     else "resuming: taking new work again")
            self._state_changed()

    # --- messages ----------------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        if frames and len(frames[0]) == 0:
            self._on_membership(frames[1:])
        elif not (len(frames) > 1 and frames[1].bytes == bytes((MsgType.REQUEST,))
                  and self.answers.resend(frames[0].bytes)):
            self.supervisor.on_client_message(self.answers, frames, True)

    def _on_membership(self, frames: list[Any]) -> None:
        try:
            _, header, _ = framing.decode(frames, max_bytes=1 << 20, known_types=frozenset({MsgType.NODE}))
            msg = parse_node_message(header)
        except RolloutdError as e:
            log.warning("bad membership message from the router: %s", e)
            return
        if isinstance(msg, RouterWelcome):
            if not self.registered:
                log.info("registered at router %s", self.config.router)
                self.registered = True
                self.refused = ""
                self._state_changed()
            self.interval_s = msg.heartbeat_interval_s
            if msg.token and msg.token != self.token:
                self.token = msg.token
                self._state_changed()  # written with the state, off the loop
        elif isinstance(msg, RouterAck):
            self.answers.acked(msg.ids)
        elif isinstance(msg, RouterRefused):
            if msg.reason != self.refused:  # it tries again every beat: said once
                log.error("the router at %s refused this node: %s", self.config.router, msg.reason)
                self.refused = msg.reason
            self.registered = False
        elif isinstance(msg, RouterUnknown):
            log.info("the router does not know this node (%s); registering again", msg.reason)
            self.registered = False
            self._state_changed()

    def _send_node(self, msg: Any) -> None:
        assert self.sock is not None
        try:
            self.sock.send([b"", *node_message(msg)])
        except zmq.ZMQError as e:  # not connected now (IMMEDIATE): the next beat tries again
            log.debug("router not reachable: %s", e)

    async def _run(self) -> None:
        # Registering before any worker is ready would only offer 0 slots; past the timeout the
        # node registers anyway, so the router knows it exists.
        with contextlib.suppress(RolloutdError):
            await self.supervisor.workers.wait_ready(READY_TIMEOUT_S)
        while True:
            self._wake.clear()
            if self._state_dirty:
                self._state_dirty = False
                await asyncio.to_thread(_write_json, self._state_file, self.state())
                if self.token:
                    await asyncio.to_thread(_write_token, self._token_file, self.token)
            capacity = capacity_report(self.supervisor)
            self.answers.expire(time.monotonic())
            if self.registered:
                self._send_node(NodeHeartbeat(capacity, self.draining))
            else:
                running = [p.key for p in self.supervisor.flow.book if p.socket is self.answers]
                self._send_node(NodeRegister(self.name, self.incarnation, socket.gethostname(), os.getpid(),
                                             capacity, self.draining, self.token, running,
                                             [e.decode() for e in self.answers.kept]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    def _state_changed(self) -> None:
        self._state_dirty = True
        self._wake.set()

    def state(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "router": self.config.router, "identity": self.identity.decode(),
                "registered": self.registered, "draining": self.draining}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _write_token(path: Path, token: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The link state a node daemon on ``run_dir`` wrote, or None when it has no router link."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None

