"""The asyncio client a trainer links: one DEALER socket to the node daemon (or the router).

Every call has a deadline; on timeout or cancellation the client tells the daemon (CANCEL) so
the work stops there too. A daemon that dies fails every pending call with DAEMON_LOST: at once
when its connection closes (a killed process's sockets close with it), or when it stops
answering ZeroMQ heartbeats (a frozen process, a lost network), within ``HEARTBEAT_TIMEOUT_MS``. Arrays of a reply are mapped from the node's shared memory without a
copy when the daemon is local (``ipc://``), or arrive as raw frames otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import zmq

from rolloutd.native_io import framing, shm
from rolloutd.native_io.curve import HANDSHAKE_FAILURES, CurveClient, handshake_reason
from rolloutd.native_io.errors import (
    Cancelled,
    DaemonLost,
    OperationTimeout,
    PermissionDenied,
    RolloutdError,
    error_from_code,
)
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.run_dir import default_run_dir
from rolloutd.native_io.unix_link import UnixLink
from rolloutd.native_io.wire import (
    ExecuteResult,
    MsgType,
    SandboxOpenArgs,
    to_fields,
)
from rolloutd.native_io.zmq_loop import LoopSocket, SocketEvents
from rolloutd.native_io.zmq_sockets import check_ipc_reachable, make_socket

from .rollout_calls import Reply, RolloutCalls, RolloutRequest, RolloutResult  # noqa: F401  (re-exported)
from .submitted import SubmittedRollouts
from .worker_links import WorkerLinks

DEFAULT_TIMEOUT_S = 600.0
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10000
"""A daemon whose ZeroMQ I/O thread answers no heartbeat for this long is taken for dead (the
I/O thread answers even while the daemon's event loop is busy, so load does not trip it)."""
SANDBOX_CLOSE_TIMEOUT_S = 60.0
"""Closing a sandbox stops its processes and resets it: seconds, even on a busy node."""
_ANSWER_TYPES = frozenset({MsgType.REPLY, MsgType.ERROR})


def default_address() -> str:
    explicit = os.environ.get("ROLLOUTD_ADDRESS")
    if explicit:
        return explicit
    return f"ipc://{default_run_dir() / 'node.sock'}"


class InferenceControl:
    """The node's inference servers and weights, as every worker of the node applies them (a
    part of :class:`AsyncRolloutClient`)."""

    async def request(self, op: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                      request_id: str | None = None) -> Reply:
        raise NotImplementedError

    async def add_inference_server(self, address: str, api_key: str | None = None) -> dict[str, Any]:
        """Every worker of the node adds ``address``; ``api_key`` is its bearer token when it is
        not the node's own ``inference_api_key``."""
        args = {"address": address, **({"api_key": api_key} if api_key else {})}
        return (await self.request("inference.add_server", args)).result

    async def remove_inference_server(self, address: str) -> dict[str, Any]:
        return (await self.request("inference.remove_server", {"address": address})).result

    async def set_weight_version(self, version: str) -> dict[str, Any]:
        return (await self.request("inference.set_weight_version", {"version": version})).result

    async def pause_inference(self, mode: str = "keep") -> dict[str, Any]:
        return (await self.request("inference.pause", {"mode": mode})).result

    async def resume_inference(self) -> dict[str, Any]:
        return (await self.request("inference.resume")).result


class AsyncRolloutClient(InferenceControl, RolloutCalls):
    def __init__(self, address: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 arrays: str = "auto", curve: Any = None, client_name: str | None = None,
                 worker_links: bool = True) -> None:
        """``worker_links``: a sandbox's commands straight to its worker when the node offers it
        (``worker_links.py``); False: all through the node."""
        self.address = address or default_address()
        self.client_name = client_name or uuid.uuid4().hex
        """Who asks, beside the key it proves: a router scopes request ids (and cancels) to it. Give
        a process that takes over another's work (a restarted trainer) the same name to collect it."""
        self.worker_links = worker_links and self.address.startswith("ipc://")
        self.timeout_s = timeout_s
        self.array_transport = ("shm" if self.address.startswith("ipc://") else "frames") if arrays == "auto" else arrays
        self._curve = curve
        """Keys for a tcp:// address (``rolloutd.native_io.curve.CurveClient``); default from ROLLOUTD_CURVE_*."""
        self._ctx: zmq.Context[Any] | None = None
        self._sock: LoopSocket | None = None
        self._events: SocketEvents | None = None
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._submitted: SubmittedRollouts[Reply] = SubmittedRollouts()
        self._held_segments: set[str] = set()
        self._segment_maps = shm.SegmentMaps()
        self._links = WorkerLinks(self._on_message, self._lost)
        """Straight to the worker holding a sandbox, for its commands (a client on the node)."""
        # Unique ids without a uuid4 per call: a random prefix per client and a counter.
        self._id_prefix = uuid.uuid4().hex[:16] + "-"
        self._ids = itertools.count()

    async def connect(self) -> "AsyncRolloutClient":
        if self._sock is not None:
            return self
        check_ipc_reachable(self.address)
        if self._curve is None and self.address.startswith("tcp://"):
            self._curve = CurveClient.from_env()
        self._ctx = zmq.Context()
        sock = make_socket(self._ctx, zmq.DEALER, identity=uuid.uuid4().bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        events = zmq.EVENT_DISCONNECTED
        if self._curve is not None:
            self._curve.apply_client(sock)
            events |= HANDSHAKE_FAILURES
        self._events = SocketEvents(sock, events, self._on_socket_event)
        sock.connect(self.address)
        self._sock = LoopSocket(sock, self._on_message)
        return self

    async def close(self) -> None:
        if self._held_segments:
            with contextlib.suppress(Exception):
                self._send(MsgType.RELEASE, {"segments": sorted(self._held_segments)})
            self._held_segments.clear()
        self._segment_maps.clear()
        self._links.close()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(Cancelled("client closed"))
                fut.exception()  # retrieved here: nobody may be awaiting it any more
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._sock is not None:
            self._sock.close(linger_ms=500)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> "AsyncRolloutClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _send(self, msg_type: MsgType, header: dict[str, Any], buffers: list[Any] | None = None) -> None:
        assert self._sock is not None
        self._sock.send(framing.encode(msg_type, header, buffers))

    def _on_message(self, frames: list[Any]) -> None:
        try:
            msg_type, header, buffers = framing.decode(frames, max_bytes=1 << 62, known_types=_ANSWER_TYPES)
        except RolloutdError:
            return
        fut = self._waiters.pop(header.get("id", ""), None)
        if msg_type == MsgType.ERROR and fut is None and not header.get("id"):
            # Refused before the daemon could read an id (e.g. wrong user): fail every call.
            for other in self._waiters.values():
                if not other.done():
                    other.set_exception(error_from_code(header.get("code", ""), header.get("message", "")))
            self._waiters.clear()
            return
        if fut is None or fut.done():
            return
        if msg_type == MsgType.ERROR:
            fut.set_exception(error_from_code(header.get("code", ""), header.get("message", ""),
                                              header.get("details")))
            return
        try:
            fut.set_result(_reply(header, buffers, self._segment_maps, self._held_segments))
        except RolloutdError as e:
            fut.set_exception(e)

    def _on_socket_event(self, event: dict[str, Any]) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            # Pending answers cannot come: the daemon's routing of them died with the connection.
            self._fail_pending(lambda: DaemonLost(
                f"the daemon at {self.address} went away (its connection closed or it stopped answering "
                f"heartbeats for {HEARTBEAT_TIMEOUT_MS / 1000:.0f} s) while this call was pending. See the "
                "daemon's log, then submit it again under the same id: behind a router, work a node finished "
                "or still runs is collected, not run again; a node daemon that restarted lost it"))
            return
        reason = handshake_reason(event)
        self._fail_pending(lambda: PermissionDenied(
            f"{self.address} refused this client: {reason}; its operator must add your public key "
            "(.key file) to the allowed-keys folder, and ROLLOUTD_CURVE_SERVER_KEY must be its key"))

    def _lost(self, rid: str, error: RolloutdError) -> None:
        fut = self._waiters.get(rid)
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def _fail_pending(self, error: Callable[[], RolloutdError]) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(error())

    async def request(self, op: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                      request_id: str | None = None, link: str | None = None) -> Reply:
        """``link``: a worker's socket to send it to instead (``worker_links``); the node otherwise."""
        rid, fut = await self._start(op, args, request_id, link)
        return await self._wait(op, rid, fut, self.timeout_s if timeout_s is None else timeout_s)

    async def _start(self, op: str, args: dict[str, Any] | None, request_id: str | None,
                     link: str | None = None) -> tuple[str, asyncio.Future[Reply]]:
        if self._sock is None:
            await self.connect()
        if self._events is not None:
            self._events.catch_up()  # a disconnect seen before this call is not this call's
        rid = request_id or self._new_id()
        joined = self._waiters.get(rid)
        if joined is not None and not joined.done():
            return rid, joined  # the same id in flight: one request, its one answer for every caller
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        frames = self._request_frames(rid, op, args)
        if link is None or not await self._links.send(link, rid, frames):
            self._sock.send(frames)  # type: ignore[union-attr]  # connected above
        return rid, fut

    def start_on_open_link(self, op: str, args: dict[str, Any], link: str,
                           loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Future[Reply], UnixLink] | None:
        """Send a new request on the worker link at ``link`` now, if it is open, for a caller
        whose event loop (``loop``) is not running: (its id, its answer, the link to read it
        from with ``UnixLink.read_until``; then :meth:`finished`). None when nothing was sent."""
        if self._sock is None:
            return None
        rid = self._new_id()
        on = self._links.send_now(link, rid, self._request_frames(rid, op, args))
        if on is None:
            return None
        fut: asyncio.Future[Reply] = loop.create_future()
        self._waiters[rid] = fut
        return rid, fut, on

    def _new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    def _request_frames(self, rid: str, op: str, args: dict[str, Any] | None) -> list[Any]:
        return framing.encode(MsgType.REQUEST, {"id": rid, "op": op, "args": args or {},
                                                "arrays": self.array_transport, "client": self.client_name})

    async def _wait(self, op: str, rid: str, fut: asyncio.Future[Reply], limit: float) -> Reply:
        # A bare timer on the future: asyncio.wait_for would wrap every call in a task.
        timer = asyncio.get_running_loop().call_later(limit, _expire, fut)
        try:
            return await fut
        except _Expired:
            await self.cancel(rid)
            raise timed_out(op, limit) from None
        except asyncio.CancelledError:
            await self.cancel(rid)
            raise
        finally:
            timer.cancel()
            self.finished(rid)

    def finished(self, rid: str) -> None:
        """The caller has taken ``rid``'s answer, or given up on it."""
        self._waiters.pop(rid, None)
        self._links.done(rid)

    async def cancel(self, request_id: str) -> None:
        frames = framing.encode(MsgType.CANCEL, {"id": request_id, "client": self.client_name})
        if self._sock is not None and not self._links.cancel(request_id, frames):
            self._sock.send(frames)

    async def release(self, reply: "Reply | RolloutResult") -> None:
        """Done with the reply's arrays: their shared memory goes back to the daemon for reuse, so
        copy anything you keep first."""
        if isinstance(reply, RolloutResult):
            if reply.reply is None:
                return
            reply = reply.reply
        if reply.segments:
            self._send(MsgType.RELEASE, {"segments": reply.segments})
            self._held_segments.difference_update(reply.segments)

    async def status(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return (await self.request("status", timeout_s=timeout_s)).result

    async def open_sandbox(self, **kwargs: Any) -> "AsyncSandbox":
        """Lease a sandbox (kwargs as ``SandboxOpenArgs``: image, network, ipython, writable, timeout_s)."""
        args = to_fields(SandboxOpenArgs(**kwargs))
        reply = await self.request("sandbox.open", args, timeout_s=args["timeout_s"] + 10)
        return AsyncSandbox(self, reply.result)


def _reply(header: dict[str, Any], buffers: list[Any], maps: shm.SegmentMaps, held: set[str]) -> Reply:
    """A REPLY's result and arrays: raw frames, or mapped from shared memory (whose segments
    join ``held`` until released)."""
    if not header.get("refs"):  # most answers: a command's, a status
        return Reply(header.get("result") or {}, {}, [])
    refs = [framing.ArrayRef.from_wire(r) for r in header["refs"]]
    shm_refs = [r for r in refs if r.segment is not None]
    arrays = framing.arrays_from_frames([r for r in refs if r.segment is None], buffers)
    segments = sorted({r.segment for r in shm_refs if r.segment})
    if shm_refs:
        arrays.update(maps.map(shm_refs))
        held.update(segments)
    return Reply(header.get("result") or {}, arrays, segments)


class _Expired(Exception):
    pass


def timed_out(op: str, limit: float) -> OperationTimeout:
    return OperationTimeout(f"{op} got no answer within {limit} s (timeout_s); it was cancelled")


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


@dataclass(frozen=True)
class CommandRequest:
    """A sandbox command as sent: its op and args, how long its caller waits for the answer, and
    the worker link it goes on (None: through the node)."""

    op: str
    args: dict[str, Any]
    wait_s: float | None
    link: str | None


def _wait_s(timeout_s: float | None) -> float | None:
    # The call's own deadline leaves the daemon time to interrupt the command and answer.
    return None if timeout_s is None else timeout_s + 15.0


class AsyncSandbox:
    """A sandbox leased through the daemon; close it (or use ``async with``) to give it back."""

    def __init__(self, client: AsyncRolloutClient, info: dict[str, Any]) -> None:
        self.client = client
        self.id: str = info["sandbox_id"]
        self.info = info
        self.closed = False
        self.link: str | None = info.get("link") if client.worker_links else None
        """The socket of the worker that holds it (a client on the node): its commands go there."""

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        return CommandResult(**(await self._send(self.run_request(command, timeout_s))).result)

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        return ExecuteResult(**(await self._send(self.ipython_request(code, timeout_s))).result)

    async def _send(self, req: "CommandRequest") -> Reply:
        return await self.client.request(req.op, req.args, timeout_s=req.wait_s, link=req.link)

    def run_request(self, command: str, timeout_s: float | None) -> "CommandRequest":
        return CommandRequest("sandbox.run", {"sandbox_id": self.id, "command": command, "timeout_s": timeout_s},
                              _wait_s(timeout_s), self.link)

    def ipython_request(self, code: str, timeout_s: float | None) -> "CommandRequest":
        return CommandRequest("sandbox.ipython", {"sandbox_id": self.id, "code": code, "timeout_s": timeout_s},
                              _wait_s(timeout_s), self.link)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.request("sandbox.close", {"sandbox_id": self.id}, timeout_s=SANDBOX_CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
