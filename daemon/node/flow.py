"""The node's request flow: accept a client's request, hand it to a worker (the sandbox's own for
ops on an open sandbox, every worker for broadcast ops, else the least busy), re-dispatch or fail
the requests of a worker that died, and answer each exactly once through the request book shared
with the router. No sockets here: the supervisor hands in the sender.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.common.request_book import (
    CACHE_ANSWER_MAX_BYTES,
    Accepted,
    RequestBook,
    Send,
    error_frames,
    fingerprint,
)
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.segments import Segments
from rolloutd.daemon.node.workers import WorkerHandle, Workers
from rolloutd.native_io import framing, shm
from rolloutd.native_io.errors import (
    Cancelled,
    PermissionDenied,
    RolloutdError,
    SandboxLost,
    ShuttingDown,
    WorkerLost,
    error_from_code,
)
from rolloutd.native_io.procfs import pid_alive
from rolloutd.native_io.wire import BROADCAST_OPS, CLIENT_TYPES, PINNED_OPS, MsgType, parse_args
from rolloutd.native_io.zmq_loop import LoopSocket

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Pending(Accepted):
    """An accepted request that has no final answer yet, as the node keeps it."""

    client_pid: int | None
    worker: int | None = None
    started: bool = False
    broadcast: dict[int, Any] | None = None
    """For ops every worker applies: worker index -> its answer header (None until it came)."""
    received_at: float = field(default_factory=time.monotonic)


class RequestFlow:
    def __init__(self, config: NodeConfig, workers: Workers, segments: Segments, send: Send,
                 counters: dict[str, int]) -> None:
        self.config = config
        self.workers = workers
        self.segments = segments
        self.counters = counters
        self.book: RequestBook[Pending] = RequestBook(send, counters, config.completed_ttl_s)
        self.queued: list[str] = []
        """Accepted ids waiting for a live worker."""
        self.sandbox_owner: dict[str, tuple[int, int]] = {}
        """sandbox id -> (worker index, worker generation)."""
        self.sandbox_client: dict[str, int | None] = {}
        self.stopping = False
        self._send = send

    # --- clients ---------------------------------------------------------------------------

    def accept(self, sock: LoopSocket | None, client: bytes, pid: int | None, is_tcp: bool, rid: str,
               header: dict[str, Any], frames: list[Any], status: Callable[[], dict[str, Any]]) -> None:
        asked = fingerprint(header, frames[1])
        if self.book.repeat(rid, client, sock, asked=asked):
            return
        try:
            if self.stopping:
                raise ShuttingDown("the node daemon is shutting down")
            op = header.get("op")
            args = parse_args(op, header.get("args"))
            if op.startswith("debug.") and not self.config.debug_ops:
                raise PermissionDenied(f"{op} is a debug operation, off on this node: start it with --debug-ops "
                                       "(node config debug_ops = true) to use it")
        except RolloutdError as e:
            self._send(sock, client, error_frames(rid, e))
            return
        self.counters["requests"] += 1
        if is_tcp and header.get("arrays") != "frames":
            # A client on another host cannot map this node's shared memory.
            header = {k: v for k, v in header.items() if k != "v"} | {"arrays": "frames"}
            frames = [frames[0], framing.pack_header(header), *frames[2:]]
        p = Pending(rid=rid, client=client, socket=sock, op=op, frames=frames, client_pid=pid, fingerprint=asked)
        if op == "status":  # taken before the book counts this request among those in flight
            answer = framing.encode(MsgType.REPLY, {"id": rid, "result": status(), "refs": []})
            self.book.open(p)
            self.deliver(p, answer)
            return
        self.book.open(p)
        if op in BROADCAST_OPS:
            self._broadcast(p)
        elif op in PINNED_OPS:
            owner = self.sandbox_owner.get(args.sandbox_id)
            w = self.workers[owner[0]] if owner is not None else None
            if w is None or not w.ready or w.generation != owner[1]:
                self.answer_error(p, SandboxLost(
                    f"no open sandbox {args.sandbox_id!r} on this node (closed, or its worker restarted)"))
            else:
                self._dispatch(p, w)
        else:
            self._dispatch_or_queue(p)

    def cancel(self, rid: str) -> None:
        p = self.book.get(rid)
        if p is None:
            return
        if p.worker is None:
            with contextlib.suppress(ValueError):
                self.queued.remove(rid)
            self.answer_error(p, Cancelled(f"request {rid} was cancelled before it started"))
            return
        with contextlib.suppress(ConnectionError):
            self.workers[p.worker].send(framing.encode(MsgType.CANCEL, {"id": rid}))

    def shut_down(self) -> None:
        self.stopping = True
        for p in self.book:
            self.answer_error(p, ShuttingDown("the node daemon is shutting down; resubmit elsewhere"))

    # --- workers ---------------------------------------------------------------------------

    def _dispatch(self, p: Pending, w: WorkerHandle) -> None:
        p.worker = w.index
        w.in_flight.add(p.rid)
        try:
            w.send(p.frames)
        except ConnectionError:
            # The worker's pipe is gone: it is dying; its exit handler re-dispatches.
            log.warning("could not hand %s to worker %d", p.rid, w.index)

    def _dispatch_or_queue(self, p: Pending) -> None:
        """To the least busy live worker, or into the queue until one is ready."""
        w = self.workers.pick()
        if w is None:
            self.queued.append(p.rid)
        else:
            self._dispatch(p, w)

    def flush_queue(self) -> None:
        queued, self.queued = self.queued, []
        for rid in queued:
            p = self.book.get(rid)
            if p is not None:
                self._dispatch_or_queue(p)

    def started(self, rid: str) -> None:
        p = self.book.get(rid)
        if p is not None:
            p.started = True

    def worker_answer(self, w: WorkerHandle, msg_type: int, header: dict[str, Any], frames: list[Any]) -> None:
        rid = header.get("id", "")
        w.in_flight.discard(rid)
        p = self.book.get(rid)
        if p is not None and p.broadcast is not None and w.index in p.broadcast:
            self._broadcast_answer(p, w, header)
            return
        refs = [ref[3] for ref in header.get("refs", []) if ref[3]]
        if p is None or p.worker != w.index:
            # A late answer for a request already answered (e.g. WORKER_LOST): drop it, and its arrays.
            self.segments.give_back(refs)
            return
        if msg_type == MsgType.REPLY:
            result = header.get("result") or {}
            if p.op == "sandbox.open" and "sandbox_id" in result:
                self.sandbox_owner[result["sandbox_id"]] = (w.index, w.generation)
                self.sandbox_client[result["sandbox_id"]] = p.client_pid
            elif p.op == "sandbox.close":
                self.sandbox_owner.pop(result.get("closed", ""), None)
                self.sandbox_client.pop(result.get("closed", ""), None)
            self.segments.handed_out(refs, p.client_pid, p.client)
        self.deliver(p, frames)

    def worker_died(self, w: WorkerHandle) -> None:
        for rid in list(w.in_flight):
            p = self.book.get(rid)
            if p is None:
                continue
            if p.broadcast is not None:
                # A worker that comes back starts from the config, which this change updates.
                self._broadcast_answer(p, w, {"result": {"restarted": True}})
                continue
            if p.started or p.op in PINNED_OPS:
                self.counters["worker_lost"] += 1
                self.answer_error(p, WorkerLost(
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
        self.segments.unlink_unheld(self.workers.shm_prefix_of(w))
        self.flush_queue()

    def close_sandboxes_of_gone_clients(self) -> None:
        for sid, pid in list(self.sandbox_client.items()):
            if pid is not None and not pid_alive(pid) and sid in self.sandbox_owner:
                log.info("closing sandbox %s of client pid %d, which is gone", sid, pid)
                idx, _ = self.sandbox_owner.pop(sid)
                self.sandbox_client.pop(sid, None)
                rid = f"reclaim-{sid}"
                close = Pending(rid=rid, client=b"", socket=None, op="sandbox.close", client_pid=None,
                                frames=framing.encode(MsgType.REQUEST, {"id": rid, "op": "sandbox.close",
                                                                        "args": {"sandbox_id": sid}}))
                self.book.open(close)
                self._dispatch(close, self.workers[idx])

    # --- broadcast ops ---------------------------------------------------------------------

    def _broadcast(self, p: Pending) -> None:
        live = [w for w in self.workers if w.ready]
        if not live:
            self.answer_error(p, ShuttingDown("no worker is running; retry in a moment"))
            return
        p.broadcast = {w.index: None for w in live}
        for w in live:
            w.in_flight.add(p.rid)
            try:
                w.send(p.frames)
            except ConnectionError:
                p.broadcast[w.index] = {"code": WorkerLost.code, "message": f"worker {w.index} is gone"}

    def _broadcast_answer(self, p: Pending, w: WorkerHandle, header: dict[str, Any]) -> None:
        broadcast = p.broadcast
        if broadcast is None:
            return
        broadcast[w.index] = header
        if any(v is None for v in broadcast.values()):
            return
        failed = [h for h in broadcast.values() if "code" in h]
        if failed:
            self.answer_error(p, error_from_code(failed[0]["code"], failed[0].get("message", "")))
            return
        self._remember_inference_change(p)
        results = {str(i): h.get("result") for i, h in broadcast.items()}
        self.deliver(p, framing.encode(MsgType.REPLY, {"id": p.rid, "result": {"workers": results}, "refs": []}))

    def _remember_inference_change(self, p: Pending) -> None:
        """Workers started later (restarts) get the same inference set-up through their config."""
        args = parse_args(p.op, framing.decode(p.frames, max_bytes=1 << 62, known_types=CLIENT_TYPES)[1]["args"])
        servers = self.config.inference_servers

        def url(spec: str) -> str:  # "sglang+http://h:p" and "http://h:p" name the same server
            return spec.split("+", 1)[1] if "+" in spec.split("://", 1)[0] else spec

        if p.op == "inference.add_server" and args.address not in servers:
            servers.append(args.address)
            if args.api_key:
                self.config.inference_server_keys[args.address] = args.api_key
        elif p.op == "inference.remove_server":
            servers[:] = [s for s in servers if url(s) != url(args.address)]
            for spec in [s for s in self.config.inference_server_keys if url(s) == url(args.address)]:
                del self.config.inference_server_keys[spec]
        elif p.op == "inference.set_weight_version":
            self.config.inference_weight_version = args.version

    # --- answers ---------------------------------------------------------------------------

    def answer_error(self, p: Pending, e: RolloutdError) -> None:
        self.deliver(p, error_frames(p.rid, e))

    def deliver(self, p: Pending, frames: list[Any]) -> None:
        if p.worker is not None:
            self.workers[p.worker].in_flight.discard(p.rid)
        # Kept with its arrays copied out of shared memory: the segments are reused once released.
        # The segments belong to the first asker (its release frees them): others get copies.
        kept = shm.self_contained(frames, max_bytes=CACHE_ANSWER_MAX_BYTES)
        self.book.answer(p, frames, kept=kept, for_joined=lambda: shm.self_contained(frames, max_bytes=None))
