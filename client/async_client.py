"""The asyncio client a trainer links: one DEALER socket to the node daemon (or the router).

Every call has a deadline; on timeout or cancellation the client tells the daemon (CANCEL) so
the work stops there too. Arrays of a reply are mapped from the node's shared memory without a
copy when the daemon is local (``ipc://``), or arrive as raw frames otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from rolloutd.native_io import framing, shm
from rolloutd.native_io.errors import Cancelled, OperationTimeout, RolloutdError, error_from_code
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.zmq_loop import LoopSocket
from rolloutd.native_io.zmq_sockets import check_ipc_reachable, make_socket

from .wire import ExecuteResult, MsgType, SandboxOpenArgs, to_fields

DEFAULT_TIMEOUT_S = 600.0


def default_address() -> str:
    explicit = os.environ.get("ROLLOUTD_ADDRESS")
    if explicit:
        return explicit
    from rolloutd.daemon.config import default_run_dir

    return f"ipc://{default_run_dir() / 'node.sock'}"


@dataclass
class Reply:
    result: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    segments: list[str] = field(default_factory=list)
    """Shared-memory segments backing ``arrays``; give them back with ``release``."""


class AsyncRolloutClient:
    def __init__(self, address: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 arrays: str = "auto", curve: Any = None) -> None:
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self.array_transport = ("shm" if self.address.startswith("ipc://") else "frames") if arrays == "auto" else arrays
        self._curve = curve
        self._ctx: zmq.Context[Any] | None = None
        self._sock: LoopSocket | None = None
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._held_segments: set[str] = set()
        # Unique ids without a uuid4 per call: a random prefix per client and a counter.
        self._id_prefix = uuid.uuid4().hex[:16] + "-"
        self._ids = itertools.count()

    async def connect(self) -> "AsyncRolloutClient":
        if self._sock is not None:
            return self
        check_ipc_reachable(self.address)
        self._ctx = zmq.Context()
        sock = make_socket(self._ctx, zmq.DEALER, identity=uuid.uuid4().bytes)
        if self._curve is not None:
            self._curve.apply_client(sock)
        sock.connect(self.address)
        self._sock = LoopSocket(sock, self._on_message)
        return self

    async def close(self) -> None:
        if self._held_segments:
            with contextlib.suppress(Exception):
                self._send(MsgType.RELEASE, {"segments": sorted(self._held_segments)})
            self._held_segments.clear()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(Cancelled("client closed"))
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
            msg_type, header, buffers = framing.decode(
                frames, max_bytes=1 << 62, known_types=frozenset({MsgType.REPLY, MsgType.ERROR}))
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
            fut.set_result(self._reply(header, buffers))
        except RolloutdError as e:
            fut.set_exception(e)

    def _reply(self, header: dict[str, Any], buffers: list[Any]) -> Reply:
        refs = [framing.ArrayRef.from_wire(r) for r in header.get("refs", [])]
        shm_refs = [r for r in refs if r.segment is not None]
        arrays = framing.arrays_from_frames([r for r in refs if r.segment is None], buffers)
        segments = sorted({r.segment for r in shm_refs if r.segment})
        if shm_refs:
            arrays.update(shm.map_segments(shm_refs))
            self._held_segments.update(segments)
        return Reply(header.get("result") or {}, arrays, segments)

    async def request(self, op: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None,
                      request_id: str | None = None) -> Reply:
        if self._sock is None:
            await self.connect()
        rid = request_id or f"{self._id_prefix}{next(self._ids)}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        self._waiters[rid] = fut
        self._send(MsgType.REQUEST, {"id": rid, "op": op, "args": args or {}, "arrays": self.array_transport})
        limit = self.timeout_s if timeout_s is None else timeout_s
        # A bare timer on the future: asyncio.wait_for would wrap every call in a task.
        timer = loop.call_later(limit, _expire, fut)
        try:
            return await fut
        except _Expired:
            await self.cancel(rid)
            raise OperationTimeout(f"{op} got no answer within {limit} s (timeout_s); it was cancelled") from None
        except asyncio.CancelledError:
            await self.cancel(rid)
            raise
        finally:
            timer.cancel()
            self._waiters.pop(rid, None)

    async def cancel(self, request_id: str) -> None:
        if self._sock is not None:
            self._send(MsgType.CANCEL, {"id": request_id})

    async def release(self, reply: Reply) -> None:
        """Tell the daemon the reply's shared memory can go (mapped arrays stay valid here)."""
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


class _Expired(Exception):
    pass


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class AsyncSandbox:
    """A sandbox leased through the daemon; close it (or use ``async with``) to give it back."""

    def __init__(self, client: AsyncRolloutClient, info: dict[str, Any]) -> None:
        self.client = client
        self.id: str = info["sandbox_id"]
        self.info = info
        self.closed = False

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        # The call's own deadline leaves the daemon time to interrupt the command and answer.
        wait = None if timeout_s is None else timeout_s + 15.0
        reply = await self.client.request("sandbox.run", {"sandbox_id": self.id, "command": command,
                                                          "timeout_s": timeout_s}, timeout_s=wait)
        return CommandResult(**reply.result)

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        wait = None if timeout_s is None else timeout_s + 15.0
        reply = await self.client.request("sandbox.ipython", {"sandbox_id": self.id, "code": code,
                                                              "timeout_s": timeout_s}, timeout_s=wait)
        return ExecuteResult(**reply.result)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.request("sandbox.close", {"sandbox_id": self.id}, timeout_s=60)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
