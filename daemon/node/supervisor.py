"""The node supervisor: owns the public socket, dispatches to workers, keeps every promise.

Promises kept here, whatever a worker or client does:
- every accepted request id gets exactly one final answer (REPLY or ERROR); a repeated id is
  not run twice: in flight it is joined, finished it gets the same answer again;
- a request on a worker that dies is re-dispatched if it had not started, else answered
  WORKER_LOST; sandboxes of a dead worker answer SANDBOX_LOST;
- shared-memory results are unlinked when released, when their client's process is gone past
  the lease, and at shutdown; sandboxes of a dead client are closed;
- only the daemon's own user (or root) may talk to the ipc socket (SO_PEERCRED).
It does no slow work: decode a small header, pick a worker, forward frames without copying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from typing import Any

import psutil
import zmq

from rolloutd.daemon.common.request_book import checked_id, error_frames, salvage_id
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.engines import NodeEngines
from rolloutd.daemon.node.flow import RequestFlow
from rolloutd.daemon.node.router_link import RouterLink
from rolloutd.daemon.node.sandbox_user import prepare_workers_dir, sandbox_user, workers_dir
from rolloutd.daemon.node.segments import Segments
from rolloutd.daemon.node.workers import WorkerHandle, Workers
from rolloutd.daemon.sandbox import cgroups
from rolloutd.native_io import framing, shm
from rolloutd.native_io.curve import bind_curve_router
from rolloutd.native_io.errors import PermissionDenied, RolloutdError
from rolloutd.native_io.procfs import CENSUS_INTERVAL_S, CENSUSES
from rolloutd.native_io.wire import CLIENT_TYPES, FINAL_TYPES, WORKER_TYPES, MsgType
from rolloutd.native_io.zmq_loop import LoopSocket
from rolloutd.native_io.zmq_sockets import bind_private_ipc, make_socket, peer_credentials

log = logging.getLogger(__name__)

WORKERS_READY_TIMEOUT_S = 300.0
RECLAIM_INTERVAL_S = 1.0
"""How often kept answers expire, orphaned segments go back and dead clients' sandboxes close."""


class Supervisor:
    """The node process: its sockets and loop, the messages of clients and workers; the requests
    go through :class:`RequestFlow`, the worker processes through :class:`Workers`, result
    segments through :class:`Segments`."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.run_dir = config.run_path
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.public: LoopSocket | None = None
        self.tcp: LoopSocket | None = None
        self.clients: dict[bytes, tuple[int, int]] = {}
        """Routing id -> (uid, pid) of ipc clients."""
        self.allowed_uids = {os.getuid(), 0}
        self.started_at = time.time()
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "redispatched": 0, "worker_lost": 0,
                         "worker_restarts": 0, "duplicates": 0, "refused": 0, "segments_reclaimed": 0}
        self.shm_prefix = f"rld{os.getuid()}-{os.getpid()}-"
        self._me = psutil.Process()
        self._stop = asyncio.Event()
        self.extensions: list[Any] = []
        """Objects with async ``start(supervisor)``/``stop()`` (e.g. the router membership)."""
        if config.router:
            self.extensions.append(RouterLink(config))
        self.sandbox_user = sandbox_user(config)
        """Whom the workers run as (None: as this process); see :mod:`sandbox_user`."""
        self.workers_dir = workers_dir(config)
        self.engines = NodeEngines(config, self.workers_dir, self.sandbox_user)
        """The node's shared vLLM engines, started before the workers, stopped after them."""
        self.workers = Workers(config, self.workers_dir, self.sandbox_user, self.shm_prefix,
                               self._on_worker_message, self._on_worker_died, self.counters)
        self.segments = Segments(self.workers, config.shm_lease_timeout_s, self.counters)
        self.flow = RequestFlow(config, self.workers, self.segments, self._send, self.counters)
        self.curve: Any = None
        """The ZAP handler guarding ``self.tcp`` (closed after it, before the context)."""

    # --- lifecycle -------------------------------------------------------------------------

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            prepare_workers_dir(self.config, self.sandbox_user)
            if self.sandbox_user is not None:  # the workers cannot make memory cgroups: hand them a folder
                self.workers.memory_cgroup = cgroups.delegate(
                    self.workers_dir.name, self.sandbox_user.uid, self.sandbox_user.gid, self.run_dir / cgroups.RECORD_FILE)
            await self.workers.check_can_start()
            await self.engines.start()
            async with asyncio.TaskGroup() as tg:
                for w in self.workers:
                    tg.create_task(self.workers.run(w))
                for ext in self.extensions:
                    await ext.start(self)
                await self.workers.wait_ready(WORKERS_READY_TIMEOUT_S)
                public = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
                bind_private_ipc(public, self.config.socket_path)
                self.public = LoopSocket(public, lambda f: self.on_client_message(self.public, f, False))
                if self.config.tcp_bind:
                    tcp, self.curve = bind_curve_router(self.ctx, self.config)
                    self.tcp = LoopSocket(tcp, lambda f: self.on_client_message(self.tcp, f, True))
                tg.create_task(self._reclaim_loop())
                tg.create_task(self._census_loop())
                log.info("node daemon ready at %s with %d workers", self.config.address, len(self.workers))
                if ready is not None:
                    ready.set()
                await self._stop.wait()
                await self._shutdown()
                raise _Stopped()
        except* _Stopped:
            pass
        finally:
            await self.engines.stop()
            self._close_sockets()
            await asyncio.to_thread(shutil.rmtree, self.workers_dir, ignore_errors=True)
            cgroups.remove_delegated(self.run_dir / cgroups.RECORD_FILE)

    async def _shutdown(self) -> None:
        for ext in self.extensions:
            with contextlib.suppress(Exception):
                await ext.stop()
        self.flow.shut_down()
        await self.workers.stop()

    def _close_sockets(self) -> None:
        """Sockets before the context; the segments no client took back with them."""
        for name in shm.list_segments(self.shm_prefix):
            shm.unlink(name)
        for sock in (self.public, self.tcp):
            if sock is not None:
                sock.close(linger_ms=200)
        if self.curve is not None:
            self.curve.close()
        self.ctx.term()
        with contextlib.suppress(FileNotFoundError):
            self.config.socket_path.unlink()

    # --- workers ---------------------------------------------------------------------------

    def _on_worker_message(self, w: WorkerHandle, rest: list[Any]) -> None:
        try:
            msg_type, header, _ = framing.decode(rest, max_bytes=1 << 62, known_types=WORKER_TYPES)
        except RolloutdError:
            log.exception("undecodable message from worker %d", w.index)
            return
        if msg_type == MsgType.HELLO:
            w.ready = True
            w.census_kind = header.get("census")
            log.info("worker %d ready (pid %s)", w.index, header.get("pid"))
            self.flow.flush_queue()
        elif msg_type == MsgType.STATS:
            w.stats = header.get("stats", {})
        elif msg_type == MsgType.STARTED:
            self.flow.started(header.get("id", ""))
        elif msg_type in FINAL_TYPES:
            self.flow.worker_answer(w, msg_type, header, rest)

    def _on_worker_died(self, w: WorkerHandle) -> None:
        self.flow.worker_died(w)

    # --- clients ---------------------------------------------------------------------------

    def on_client_message(self, sock: LoopSocket | None, frames: list[Any], is_tcp: bool) -> None:
        """A message from a client: on the ipc socket, a TCP client, or through the router link."""
        client = frames[0].bytes
        rest = frames[1:]
        pid = None
        if not is_tcp:
            creds = self._peer(client, rest)
            if creds is not None:
                if creds[0] not in self.allowed_uids:
                    self.counters["refused"] += 1
                    log.warning("refused a message from uid %d (pid %d)", creds[0], creds[1])
                    self._send(sock, client, error_frames("", PermissionDenied(
                        f"uid {creds[0]} may not use this daemon (owner uid {os.getuid()})")))
                    return
                pid = creds[1]
        try:
            msg_type, header, _ = framing.decode(
                rest, max_bytes=self.config.max_message_bytes, known_types=CLIENT_TYPES)
            rid = checked_id(msg_type, header)
        except RolloutdError as e:
            self._send(sock, client, error_frames(salvage_id(rest), e))
            return
        if msg_type == MsgType.RELEASE:
            self.segments.release(client, header.get("segments"))
        elif msg_type == MsgType.CANCEL:
            self.flow.cancel(rid)
        else:
            self.flow.accept(sock, client, pid, is_tcp, rid, header, rest, self.status)

    def _peer(self, client: bytes, rest: list[Any]) -> tuple[int, int] | None:
        """(uid, pid) of an ipc client, from its first message's SO_PEERCRED."""
        creds = self.clients.get(client)
        if creds is None and len(rest) > 0:
            peer = peer_credentials(rest[0])
            if peer is not None:
                creds = self.clients[client] = (peer[0], peer[2])
        return creds

    def _send(self, sock: LoopSocket | None, client: bytes, frames: list[Any]) -> None:
        if sock is None:  # the daemon's own housekeeping request
            return
        try:
            sock.send([client, *frames])
        except zmq.ZMQError as e:
            # ROUTER_MANDATORY: the client is gone. Its answer is recorded; a retry gets it.
            log.info("client %r unreachable (%s); answer kept for a retry", client, e)

    # --- housekeeping ----------------------------------------------------------------------

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(RECLAIM_INTERVAL_S)
            now = time.monotonic()
            self.flow.book.forget_expired(now)
            self.segments.reclaim_orphans(now)
            self.flow.close_sandboxes_of_gone_clients()

    async def _census_loop(self) -> None:
        """One /proc pass per watchdog interval for the whole node, sent to the workers that have
        sandboxes that read it (Apptainer instances count their own processes): each would
        otherwise read every process of the host itself, so the cost grew with workers x
        processes. A worker whose census goes stale scans on its own."""
        while True:
            await asyncio.sleep(CENSUS_INTERVAL_S)
            workers = [w for w in self.workers if w.ready and w.census_kind in CENSUSES
                       and w.stats.get("pool", {}).get("needs_census")]
            for kind in {w.census_kind for w in workers}:
                census = await asyncio.to_thread(CENSUSES[kind])
                frames = framing.encode(MsgType.CENSUS, {"keys": list(census), "counts": list(census.values())})
                for w in workers:
                    if w.census_kind == kind:
                        with contextlib.suppress(ConnectionError):  # it died meanwhile: restarted elsewhere
                            w.send(frames)

    def status(self) -> dict[str, Any]:
        sandboxes: dict[str, int] = {"ready": 0, "starting": 0, "leased": 0}
        rss = self._me.memory_info().rss
        for w in self.workers:
            pool = w.stats.get("pool", {})
            for k in sandboxes:
                sandboxes[k] += int(pool.get(k, 0))
            rss += int(w.stats.get("rss_bytes", 0))
        return {"pid": os.getpid(), "address": self.config.address, "uptime_s": time.time() - self.started_at,
                "workers": self.workers.status(), "sandboxes": sandboxes, "in_flight": len(self.flow.book),
                "queued": len(self.flow.queued), "shm_segments": len(self.segments), "memory_rss_bytes": rss,
                "counters": dict(self.counters)}


class _Stopped(Exception):
    pass
