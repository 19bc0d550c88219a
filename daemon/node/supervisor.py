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
import socket
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq

from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.engines import NodeEngines
from rolloutd.daemon.node.reaper import reap_state_dir
from rolloutd.daemon.node.sandbox_user import own_folder, prepare_workers_dir, sandbox_user, workers_dir
from rolloutd.daemon.sandbox.apptainer import apptainer_available
from rolloutd.daemon.sandbox.images import cache_dir, resolve_image
from rolloutd.native_io import framing, shm
from rolloutd.native_io.errors import (
    BadRequest,
    Cancelled,
    ConfigError,
    PermissionDenied,
    RolloutdError,
    SandboxLost,
    ShuttingDown,
    WorkerLost,
    error_from_code,
)
from rolloutd.native_io.procfs import CENSUS_INTERVAL_S, CENSUSES, pid_alive
from rolloutd.native_io.unix_link import UnixLink
from rolloutd.native_io.wire import (
    BROADCAST_OPS,
    CLIENT_TYPES,
    FINAL_TYPES,
    PINNED_OPS,
    WORKER_TYPES,
    MsgType,
    parse_args,
)
from rolloutd.native_io.zmq_loop import LoopSocket
from rolloutd.native_io.zmq_sockets import bind_private_ipc, make_socket, peer_credentials

log = logging.getLogger(__name__)

MAX_ID_LEN = 200
CACHE_REPLY_MAX_BYTES = 1 << 20


@dataclass
class WorkerHandle:
    index: int
    generation: int = 0
    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    in_flight: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)
    restart_delay_s: float = 0.5
    link: UnixLink | None = None
    census_kind: str | None = None
    """What its sandbox backend counts processes per (``procfs.CENSUSES``), from its HELLO."""

    def send(self, frames: list[Any]) -> None:
        if self.link is None or self.link.closed:
            raise ConnectionError(f"worker {self.index} is not connected")
        self.link.send(frames)


@dataclass
class Pending:
    """An accepted request that has no final answer yet."""

    rid: str
    client: bytes
    socket: LoopSocket | None
    """Where the answer goes; None for the daemon's own housekeeping requests."""
    op: str
    frames: list[Any]
    """The original frames from type onward, kept for re-dispatch."""
    client_pid: int | None
    worker: int | None = None
    started: bool = False
    broadcast: dict[int, Any] | None = None
    """For ops every worker applies: worker index -> its answer header (None until it came)."""
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Segment:
    client_pid: int | None
    client: bytes
    created_at: float = field(default_factory=time.monotonic)
    orphaned_at: float | None = None


class Supervisor:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.run_dir = config.run_path
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.public: LoopSocket | None = None
        self.tcp: LoopSocket | None = None
        self.workers = {i: WorkerHandle(i, restart_delay_s=config.worker_restart_delay_s)
                        for i in range(config.worker_count)}
        self.pending: dict[str, Pending] = {}
        self.queued: list[str] = []
        """Accepted ids waiting for a live worker."""
        self.completed: OrderedDict[str, tuple[float, list[bytes] | None]] = OrderedDict()
        self.sandbox_owner: dict[str, tuple[int, int]] = {}
        """sandbox id -> (worker index, worker generation)."""
        self.sandbox_client: dict[str, int | None] = {}
        self.segments: dict[str, Segment] = {}
        self.clients: dict[bytes, tuple[int, int]] = {}
        """Routing id -> (uid, pid) of ipc clients."""
        self.allowed_uids = {os.getuid(), 0}
        self.stopping = False
        self.started_at = time.time()
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "redispatched": 0, "worker_lost": 0,
                         "worker_restarts": 0, "duplicates": 0, "refused": 0, "segments_reclaimed": 0}
        self.shm_prefix = f"rld{os.getuid()}-{os.getpid()}-"
        self._me = psutil.Process()
        self._stop = asyncio.Event()
        self.extensions: list[Any] = []
        """Objects with async ``start(supervisor)``/``stop()`` (e.g. the router membership)."""
        if config.router:
            from rolloutd.daemon.node.router_link import RouterLink

            self.extensions.append(RouterLink(config))
        self.sandbox_user = sandbox_user(config)
        """Whom the workers run as (None: as this process); see :mod:`sandbox_user`."""
        self.workers_dir = workers_dir(config)
        self.engines = NodeEngines(config, self.workers_dir, self.sandbox_user)
        """The node's shared vLLM engines, started before the workers, stopped after them."""
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
            await self._check_workers_can_start()
            await self.engines.start()
            async with asyncio.TaskGroup() as tg:
                for w in self.workers.values():
                    tg.create_task(self._run_worker(w))
                for ext in self.extensions:
                    await ext.start(self)
                await self._wait_workers_ready(timeout_s=300)
                public = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
                bind_private_ipc(public, self.config.socket_path)
                self.public = LoopSocket(public, lambda f: self._on_client_message(self.public, f, False))
                if self.config.tcp_bind:
                    from rolloutd.native_io.curve import bind_curve_router

                    tcp, self.curve = bind_curve_router(self.ctx, self.config)
                    self.tcp = LoopSocket(tcp, lambda f: self._on_client_message(self.tcp, f, True))
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
            self._cleanup_files()


    async def _wait_workers_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self.workers.values()):
            if time.monotonic() > deadline:
                raise RolloutdError(f"workers did not start within {timeout_s} s; see the daemon log")
            await asyncio.sleep(0.05)

    async def _shutdown(self) -> None:
        self.stopping = True
        for ext in self.extensions:
            with contextlib.suppress(Exception):
                await ext.stop()
        for rid in list(self.pending):
            self._answer_error(rid, ShuttingDown("the node daemon is shutting down; resubmit elsewhere"))
        procs = [w.proc for w in self.workers.values() if w.proc and w.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), self.config.shutdown_timeout_s)
        except TimeoutError:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        for w in self.workers.values():
            await asyncio.to_thread(reap_state_dir, self._worker_state(w.index))

    def _cleanup_files(self) -> None:
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
        shutil.rmtree(self.workers_dir, ignore_errors=True)

    # --- workers ---------------------------------------------------------------------------

    def _worker_state(self, index: int) -> Path:
        return self.workers_dir / f"w{index}"

    def _worker_shm_prefix(self, w: WorkerHandle) -> str:
        return f"{self.shm_prefix}w{w.index}g{w.generation}-"

    def _as_workers_user(self, argv: list[str]) -> list[str]:
        """``argv`` run as the workers' user (uvloop's subprocesses take no ``user=``)."""
        return argv if self.sandbox_user is None else self.sandbox_user.run_as(argv)

    async def _check_workers_can_start(self) -> None:
        """A worker its user cannot even import would only crash-loop: say why, once, at start.
        The default image is built here, if it must be, since that needs root."""
        if self.sandbox_user is None:
            return
        if self.config.image == "default" and self.config.backend != "local" and apptainer_available():
            await resolve_image("default")  # building it needs root, which the workers have not
        images = cache_dir() / "images"
        probe = await asyncio.create_subprocess_exec(
            *self._as_workers_user([
                sys.executable, "-c", "import os, sys, rolloutd.daemon.node.worker; sys.argv[1] and os.listdir(sys.argv[1])",
                str(images) if images.is_dir() else ""]),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd="/")
        _, err = await asyncio.wait_for(probe.communicate(), 120)
        if probe.returncode != 0:
            raise ConfigError(
                f"the workers run as the unprivileged user {self.sandbox_user.name!r} (sandbox_user), who cannot "
                f"run rolloutd from {sys.executable} or read the image cache {images}: make them readable by that "
                f"user (chmod -R o+rX on them, o+x on every parent folder; ROLLOUTD_CACHE_DIR moves the cache). "
                f"Its error: {err.decode(errors='replace')[-600:]}")

    async def _run_worker(self, w: WorkerHandle) -> None:
        """Start the worker, and restart it whenever it dies, until shutdown."""
        while not self.stopping:
            env = {**os.environ, "ROLLOUTD_NODE_CONFIG_JSON": self.config.to_json()}
            state = self._worker_state(w.index)
            await asyncio.to_thread(reap_state_dir, state)
            state.mkdir(mode=0o700, parents=True, exist_ok=True)
            own_folder(state, self.sandbox_user)
            if self.sandbox_user is not None:
                # Root's home is closed to that user: tools get a home of their own, and the image
                # cache is named, not found through $HOME.
                env.update(HOME=str(state), ROLLOUTD_CACHE_DIR=str(cache_dir()))
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                w.proc = await asyncio.create_subprocess_exec(
                    *self._as_workers_user([
                        sys.executable, "-m", "rolloutd.daemon.node.worker", "--index", str(w.index),
                        "--generation", str(w.generation), "--link-fd", str(theirs.fileno()),
                        "--state-dir", str(state), "--shm-prefix", self._worker_shm_prefix(w)]),
                    env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),), cwd="/",
                )
            finally:
                theirs.close()
            w.link = UnixLink(ours, lambda frames, w=w: self._on_worker_message(w, frames))
            started = time.monotonic()
            code = await w.proc.wait()
            w.ready = False
            w.link.close()
            if self.stopping:
                return
            log.error("worker %d (pid %d) exited with %s; restarting", w.index, w.proc.pid, code)
            self._worker_died(w)
            if time.monotonic() - started > 30:
                w.restart_delay_s = self.config.worker_restart_delay_s
            await asyncio.sleep(w.restart_delay_s)
            w.restart_delay_s = min(30.0, w.restart_delay_s * 2)
            w.generation += 1
            self.counters["worker_restarts"] += 1

    def _worker_died(self, w: WorkerHandle) -> None:
        for rid in list(w.in_flight):
            p = self.pending.get(rid)
            if p is None:
                continue
            if p.broadcast is not None:
                # A worker that comes back starts from the config, which this change updates.
                self._broadcast_answer(p, w, {"result": {"restarted": True}})
                continue
            if p.started or p.op in PINNED_OPS:
                self.counters["worker_lost"] += 1
                self._answer_error(rid, WorkerLost(
                    f"worker {w.index} died while running request {rid} ({p.op}); it may have had effects, "
                    "so it was not retried automatically"))
            else:
                p.worker = None
                self.queued.append(rid)
                self.counters["redispatched"] += 1
        w.in_flight.clear()
        for sid, (idx, _gen) in list(self.sandbox_owner.items()):
            if idx == w.index:
                del self.sandbox_owner[sid]
                self.sandbox_client.pop(sid, None)
        for name in shm.list_segments(self._worker_shm_prefix(w)):
            if name not in self.segments:
                shm.unlink(name)
        self._flush_queue()

    def _pick_worker(self) -> WorkerHandle | None:
        live = [w for w in self.workers.values() if w.ready]
        return min(live, key=lambda w: len(w.in_flight)) if live else None

    def _on_worker_message(self, w: WorkerHandle, rest: list[Any]) -> None:
        try:
            msg_type, header, buffers = framing.decode(rest, max_bytes=1 << 62, known_types=WORKER_TYPES)
        except RolloutdError:
            log.exception("undecodable message from worker %d", w.index)
            return
        if msg_type == MsgType.HELLO:
            w.ready = True
            w.census_kind = header.get("census")
            log.info("worker %d ready (pid %s)", w.index, header.get("pid"))
            self._flush_queue()
        elif msg_type == MsgType.STATS:
            w.stats = header.get("stats", {})
        elif msg_type == MsgType.STARTED:
            p = self.pending.get(header.get("id", ""))
            if p is not None:
                p.started = True
        elif msg_type in FINAL_TYPES:
            self._worker_answer(w, msg_type, header, rest, buffers)

    def _worker_answer(self, w: WorkerHandle, msg_type: int, header: dict[str, Any],
                             frames: list[Any], buffers: list[Any]) -> None:
        rid = header.get("id", "")
        w.in_flight.discard(rid)
        p = self.pending.get(rid)
        if p is not None and p.broadcast is not None and w.index in p.broadcast:
            self._broadcast_answer(p, w, header)
            return
        if p is None or p.worker != w.index:
            # A late answer for a request already answered (e.g. WORKER_LOST): drop it, and its arrays.
            self._return_segments([ref[3] for ref in header.get("refs", []) if ref[3]])
            return
        if msg_type == MsgType.REPLY:
            result = header.get("result") or {}
            if p.op == "sandbox.open" and "sandbox_id" in result:
                self.sandbox_owner[result["sandbox_id"]] = (w.index, w.generation)
                self.sandbox_client[result["sandbox_id"]] = p.client_pid
            elif p.op == "sandbox.close":
                self.sandbox_owner.pop(result.get("closed", ""), None)
                self.sandbox_client.pop(result.get("closed", ""), None)
            for ref in header.get("refs", []):
                if ref[3]:
                    self.segments[ref[3]] = Segment(p.client_pid, p.client)
        self._deliver(p, frames)

    # --- clients ---------------------------------------------------------------------------

    def _on_client_message(self, sock: LoopSocket | None, frames: list[Any], is_tcp: bool) -> None:
        client = frames[0].bytes
        rest = frames[1:]
        pid = None
        if not is_tcp:
            creds = self.clients.get(client)
            if creds is None and len(rest) > 0:
                creds = peer_credentials(rest[0])
                if creds is not None:
                    self.clients[client] = (creds[0], creds[2])
                    creds = self.clients[client]
            if creds is not None:
                if creds[0] not in self.allowed_uids:
                    self.counters["refused"] += 1
                    log.warning("refused a message from uid %d (pid %d)", creds[0], creds[1])
                    self._send(sock, client, framing.encode(MsgType.ERROR, {
                        "id": "", "code": PermissionDenied.code,
                        "message": f"uid {creds[0]} may not use this daemon (owner uid {os.getuid()})"}))
                    return
                pid = creds[1]
        try:
            msg_type, header, buffers = framing.decode(
                rest, max_bytes=self.config.max_message_bytes, known_types=CLIENT_TYPES)
            rid = header.get("id")
            if msg_type != MsgType.RELEASE and (not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LEN):
                raise BadRequest(f"request id must be a non-empty string of at most {MAX_ID_LEN} characters")
        except RolloutdError as e:
            rid = _salvage_id(rest)
            self._send(sock, client, framing.encode(MsgType.ERROR, {
                "id": rid, "code": e.code, "message": str(e), "details": {}}))
            return
        if msg_type == MsgType.RELEASE:
            self._release(client, header.get("segments"))
        elif msg_type == MsgType.CANCEL:
            self._cancel(rid)
        else:
            self._accept(sock, client, pid, is_tcp, rid, header, rest)

    def _accept(self, sock: LoopSocket | None, client: bytes, pid: int | None, is_tcp: bool, rid: str,
                      header: dict[str, Any], frames: list[Any]) -> None:
        if rid in self.pending:
            self.counters["duplicates"] += 1
            self.pending[rid].client, self.pending[rid].socket = client, sock  # answer the newest asker
            return
        cached = self.completed.get(rid)
        if cached is not None:
            self.counters["duplicates"] += 1
            if cached[1] is not None:
                self._send(sock, client, cached[1])
            else:
                self._send(sock, client, framing.encode(MsgType.ERROR, {
                    "id": rid, "code": "DUPLICATE_REQUEST",
                    "message": f"request {rid} was already answered and its large result not kept; use a new id"}))
            return
        try:
            if self.stopping:
                raise ShuttingDown("the node daemon is shutting down")
            op = header.get("op")
            args = parse_args(op, header.get("args"))
        except RolloutdError as e:
            self._send(sock, client, framing.encode(MsgType.ERROR, {
                "id": rid, "code": e.code, "message": str(e), "details": {}}))
            return
        self.counters["requests"] += 1
        if is_tcp and header.get("arrays") != "frames":
            # A client on another host cannot map this node's shared memory.
            header = {k: v for k, v in header.items() if k != "v"} | {"arrays": "frames"}
            frames = [frames[0], framing.pack_header(header), *frames[2:]]
        p = Pending(rid, client, sock, op, frames, pid)
        if op == "status":
            result = self.status()
            self.pending[rid] = p
            self._deliver(p, framing.encode(MsgType.REPLY, {"id": rid, "result": result, "refs": []}))
            return
        self.pending[rid] = p
        if op in BROADCAST_OPS:
            self._broadcast(p)
            return
        if op in PINNED_OPS:
            owner = self.sandbox_owner.get(args.sandbox_id)
            if owner is None or not self.workers[owner[0]].ready or self.workers[owner[0]].generation != owner[1]:
                self._answer_error(rid, SandboxLost(
                    f"no open sandbox {args.sandbox_id!r} on this node (closed, or its worker restarted)"))
                return
            self._dispatch(p, self.workers[owner[0]])
            return
        w = self._pick_worker()
        if w is None:
            self.queued.append(rid)
        else:
            self._dispatch(p, w)

    def _broadcast(self, p: Pending) -> None:
        live = [w for w in self.workers.values() if w.ready]
        if not live:
            self._answer_error(p.rid, ShuttingDown("no worker is running; retry in a moment"))
            return
        p.broadcast = {w.index: None for w in live}
        for w in live:
            w.in_flight.add(p.rid)
            try:
                w.send(p.frames)
            except ConnectionError:
                p.broadcast[w.index] = {"code": WorkerLost.code, "message": f"worker {w.index} is gone"}

    def _broadcast_answer(self, p: Pending, w: WorkerHandle, header: dict[str, Any]) -> None:
        assert p.broadcast is not None
        p.broadcast[w.index] = header
        if any(v is None for v in p.broadcast.values()):
            return
        failed = [h for h in p.broadcast.values() if "code" in h]
        if failed:
            self._answer_error(p.rid, error_from_code(failed[0]["code"], failed[0].get("message", "")))
            return
        self._remember_inference_change(p)
        results = {str(i): h.get("result") for i, h in p.broadcast.items()}
        self._deliver(p, framing.encode(MsgType.REPLY, {"id": p.rid, "result": {"workers": results}, "refs": []}))

    def _remember_inference_change(self, p: Pending) -> None:
        """Workers started later (restarts) get the same inference set-up through their config."""
        args = parse_args(p.op, framing.decode(p.frames, max_bytes=1 << 62, known_types=CLIENT_TYPES)[1]["args"])
        servers = self.config.inference_servers

        def url(spec: str) -> str:  # "sglang+http://h:p" and "http://h:p" name the same server
            return spec.split("+", 1)[1] if "+" in spec.split("://", 1)[0] else spec

        if p.op == "inference.add_server" and args.address not in servers:
            servers.append(args.address)
        elif p.op == "inference.remove_server":
            servers[:] = [s for s in servers if url(s) != url(args.address)]
        elif p.op == "inference.set_weight_version":
            self.config.inference_weight_version = args.version

    def _dispatch(self, p: Pending, w: WorkerHandle) -> None:
        p.worker = w.index
        w.in_flight.add(p.rid)
        try:
            w.send(p.frames)
        except ConnectionError:
            # The worker's pipe is gone: it is dying; its exit handler re-dispatches.
            log.warning("could not hand %s to worker %d", p.rid, w.index)

    def _flush_queue(self) -> None:
        queued, self.queued = self.queued, []
        for rid in queued:
            p = self.pending.get(rid)
            if p is None:
                continue
            w = self._pick_worker()
            if w is None:
                self.queued.append(rid)
            else:
                self._dispatch(p, w)

    def _cancel(self, rid: str) -> None:
        p = self.pending.get(rid)
        if p is None:
            return
        if p.worker is None:
            with contextlib.suppress(ValueError):
                self.queued.remove(rid)
            self._answer_error(rid, Cancelled(f"request {rid} was cancelled before it started"))
            return
        with contextlib.suppress(ConnectionError):
            self.workers[p.worker].send(framing.encode(MsgType.CANCEL, {"id": rid}))

    def _release(self, client: bytes, names: Any) -> None:
        if not isinstance(names, list):
            return
        mine = [n for n in names if isinstance(n, str) and n in self.segments and self.segments[n].client == client]
        for name in mine:
            del self.segments[name]
        self._return_segments(mine)

    def _return_segments(self, names: list[str]) -> None:
        """Hand segments back to the worker arena that made them; unlink those of a dead worker."""
        by_worker: dict[int, list[str]] = {}
        for name in names:
            owner = name[len(self.shm_prefix):].split("-", 1)[0] if name.startswith(self.shm_prefix) else ""
            w = None
            if owner.startswith("w") and "g" in owner:
                index, _, gen = owner[1:].partition("g")
                w = self.workers.get(int(index)) if index.isdigit() else None
                if w is not None and not (w.ready and gen.isdigit() and int(gen) == w.generation):
                    w = None
            if w is None:
                shm.unlink(name)
            else:
                by_worker.setdefault(w.index, []).append(name)
        for index, group in by_worker.items():
            try:
                self.workers[index].send(framing.encode(MsgType.RELEASE, {"segments": group}))
            except ConnectionError:
                for name in group:
                    shm.unlink(name)

    def _answer_error(self, rid: str, e: RolloutdError) -> None:
        p = self.pending.get(rid)
        if p is None:
            return
        self._deliver(p, framing.encode(MsgType.ERROR, {
            "id": rid, "code": e.code, "message": str(e), "details": {}}))

    def _deliver(self, p: Pending, frames: list[Any]) -> None:
        """The one place a final answer leaves: exactly once per accepted id."""
        self.pending.pop(p.rid, None)
        if p.worker is not None:
            self.workers[p.worker].in_flight.discard(p.rid)
        is_error = frames[0] == bytes((MsgType.ERROR,)) or (
            hasattr(frames[0], "bytes") and frames[0].bytes == bytes((MsgType.ERROR,)))
        self.counters["errors" if is_error else "replies"] += 1
        size = sum(_nbytes(f) for f in frames)
        keep = [bytes(f) if not hasattr(f, "bytes") else f.bytes for f in frames] if size <= CACHE_REPLY_MAX_BYTES else None
        self.completed[p.rid] = (time.monotonic(), keep)
        self._send(p.socket, p.client, frames)

    def _send(self, sock: LoopSocket | None, client: bytes, frames: list[Any]) -> None:
        if sock is None:  # the daemon's own housekeeping request
            return
        try:
            sock.send([client, *frames])
        except zmq.ZMQError as e:
            # ROUTER_MANDATORY: the client is gone. Its answer is recorded; a retry gets it.
            log.info("client %r unreachable (%s); answer kept for a retry", client, e)

    # --- housekeeping --------------------------------------------------------------------------

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            while self.completed:
                rid, (t, _) = next(iter(self.completed.items()))
                if now - t < self.config.completed_ttl_s:
                    break
                self.completed.popitem(last=False)
            for name, seg in list(self.segments.items()):
                if seg.client_pid is not None and not pid_alive(seg.client_pid):
                    seg.orphaned_at = seg.orphaned_at or now
                    if now - seg.orphaned_at >= self.config.shm_lease_timeout_s:
                        del self.segments[name]
                        self._return_segments([name])
                        self.counters["segments_reclaimed"] += 1
            for sid, pid in list(self.sandbox_client.items()):
                if pid is not None and not pid_alive(pid) and sid in self.sandbox_owner:
                    log.info("closing sandbox %s of client pid %d, which is gone", sid, pid)
                    idx, _ = self.sandbox_owner.pop(sid)
                    self.sandbox_client.pop(sid, None)
                    rid = f"reclaim-{sid}"
                    close = Pending(rid, b"", None, "sandbox.close", framing.encode(
                        MsgType.REQUEST, {"id": rid, "op": "sandbox.close", "args": {"sandbox_id": sid}}), None)
                    self.pending[rid] = close
                    self._dispatch(close, self.workers[idx])

    async def _census_loop(self) -> None:
        """One /proc pass per watchdog interval for the whole node, sent to the workers that have
        sandboxes: each would otherwise read every process of the host itself, so the cost grew
        with workers x processes. A worker whose census goes stale scans on its own."""
        while True:
            await asyncio.sleep(CENSUS_INTERVAL_S)
            workers = [w for w in self.workers.values() if w.ready and w.census_kind in CENSUSES
                       and any(w.stats.get("pool", {}).get(k) for k in ("ready", "starting", "leased"))]
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
        workers = []
        for w in self.workers.values():
            pool = w.stats.get("pool", {})
            for k in sandboxes:
                sandboxes[k] += int(pool.get(k, 0))
            rss += int(w.stats.get("rss_bytes", 0))
            workers.append({"index": w.index, "pid": w.proc.pid if w.proc else None, "ready": w.ready,
                            "generation": w.generation, "in_flight": len(w.in_flight), **{
                                k: v for k, v in w.stats.items() if k not in ("pid",)}})
        return {"pid": os.getpid(), "address": self.config.address, "uptime_s": time.time() - self.started_at,
                "workers": workers, "sandboxes": sandboxes, "in_flight": len(self.pending),
                "queued": len(self.queued), "shm_segments": len(self.segments), "memory_rss_bytes": rss,
                "counters": dict(self.counters)}


class _Stopped(Exception):
    pass


def _nbytes(frame: Any) -> int:
    if isinstance(frame, memoryview):
        return frame.nbytes
    return len(frame) if isinstance(frame, (bytes, bytearray)) else len(frame.buffer)


def _salvage_id(frames: list[Any]) -> str:
    """The id of a message we refuse, when its header can still be read."""
    with contextlib.suppress(Exception):
        import msgpack

        header = msgpack.unpackb(frames[1].bytes if hasattr(frames[1], "bytes") else frames[1], raw=False)
        if isinstance(header, dict) and isinstance(header.get("id"), str):
            return header["id"][:MAX_ID_LEN]
    return ""
