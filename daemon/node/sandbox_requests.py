"""A worker's sandbox requests: open, run, ipython, close.

A ``sandbox.run`` whose shell is free starts in the callback that received it and is answered
from the shell's reader (``PtySession.start_now``): no task and no round of the event loop,
which cost ~25 us of a command's ~0.29 ms through the client here (`bench/client_latency.py`).
A busy shell's command waits its turn in a task, like every other request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.native_io.errors import RolloutdError
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.wire import (
    SandboxCloseArgs,
    SandboxIPythonArgs,
    SandboxOpenArgs,
    SandboxRunArgs,
    parse_args,
    to_fields,
)

from .answers import Answer, Handler, as_error, reply_frames, send_error

Reply = tuple[dict[str, Any], dict[str, np.ndarray]]


@dataclass
class _CommandNow:
    """A shell command started without a task, until it is answered."""

    handle: asyncio.Future[int]
    """Its ``cancel()`` cancels the command."""
    answered: asyncio.Future[None]


class SandboxRequests:
    def __init__(self, pool: WarmPool, default_spec: SandboxSpec, link_path: Path | None, worker_index: int) -> None:
        """``link_path``: the socket of this worker's client links, named to clients on the node."""
        self.pool = pool
        self.default_spec = default_spec
        self.link_path = link_path
        self.worker_index = worker_index
        self._now: dict[str, _CommandNow] = {}

    def handlers(self) -> dict[str, Handler]:
        return {"sandbox.open": self._open, "sandbox.run": self._run, "sandbox.ipython": self._ipython,
                "sandbox.close": self._close}

    def __contains__(self, rid: str) -> bool:
        return rid in self._now

    def __len__(self) -> int:
        return len(self._now)

    def run_now(self, rid: str, header: dict[str, Any], answer: Answer) -> bool:
        """Start the ``sandbox.run`` request ``rid`` now if its shell is free (``Lease.run_now``);
        its one answer goes to ``answer``. False when nothing was started (the shell is busy, the
        sandbox lost, the request bad): run it as a task, which waits its turn or gives the error."""
        try:
            args = parse_args("sandbox.run", header.get("args"))
            lease = self.pool.get(args.sandbox_id)
        except RolloutdError:
            return False
        answered = asyncio.get_running_loop().create_future()

        def done(outcome: CommandResult | BaseException) -> None:
            self._now.pop(rid, None)
            answered.set_result(None)
            if isinstance(outcome, CommandResult):
                answer(reply_frames(rid, to_fields(outcome)))
            else:
                send_error(answer, rid, as_error(rid, outcome, self.worker_index))

        handle = lease.run_now(args.command, timeout_s=args.timeout_s, done=done)
        if handle is None:
            return False
        self._now[rid] = _CommandNow(handle, answered)
        return True

    def cancel(self, rid: str) -> None:
        if (command := self._now.get(rid)) is not None:
            command.handle.cancel(msg="cancelled by the client")

    async def cancel_all(self) -> None:
        """Cancel the commands started by :meth:`run_now`; return once each is answered."""
        for command in self._now.values():
            command.handle.cancel()
        await asyncio.gather(*(c.answered for c in self._now.values()))

    async def _open(self, args: SandboxOpenArgs, header: dict[str, Any]) -> Reply:
        spec = SandboxSpec(image=args.image, network=args.network, ipython=args.ipython, writable=args.writable,
                           limits=self.default_spec.limits)
        lease = await asyncio.wait_for(self.pool.lease(spec), args.timeout_s)
        sb = lease.sandbox
        result = {"sandbox_id": lease.id, "backend": sb.backend_name, "isolated": sb.isolated,
                  "workspace": sb.workspace_inside, "ipython": lease.offers_ipython}
        # Only a client that shares this node's memory (the supervisor makes every other one
        # take arrays as frames) is on this node and can reach the link's socket.
        if self.link_path is not None and header.get("arrays") == "shm":
            result["link"] = str(self.link_path)
        return result, {}

    async def _run(self, args: SandboxRunArgs, header: dict[str, Any]) -> Reply:
        result = await self.pool.get(args.sandbox_id).run(args.command, timeout_s=args.timeout_s)
        return to_fields(result), {}

    async def _ipython(self, args: SandboxIPythonArgs, header: dict[str, Any]) -> Reply:
        result = await self.pool.get(args.sandbox_id).ipython(args.code, timeout_s=args.timeout_s)
        return to_fields(result), {}

    async def _close(self, args: SandboxCloseArgs, header: dict[str, Any]) -> Reply:
        await self.pool.release(self.pool.get(args.sandbox_id))
        return {"closed": args.sandbox_id}, {}
