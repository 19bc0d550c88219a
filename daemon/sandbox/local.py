"""The ``local`` backend: a scratch folder and plain host processes.

For laptops and machines without Apptainer. It isolates NOTHING: commands run as the daemon's
user with the host's files, network and software. It says so at creation time, loudly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from rolloutd.native_io.procfs import ProcInfo, live_processes

from .base import Sandbox, SandboxBackend, SandboxSpec

log = logging.getLogger(__name__)

_WARNED = False
_KILL_PASSES = 50


class SharedScan:
    """Scans of /proc shared by every stop waiting for one: a stop must see a scan begun after its
    kills, and any number of stops asking before a scan begins can share it. A node that ends a
    thousand rollouts at once then makes a few scans, not two per sandbox (each reads every
    process of the host: with 3,000 of them, stops alone took minutes of CPU)."""

    def __init__(self) -> None:
        self._next: asyncio.Future[list[ProcInfo]] | None = None
        """What the stops that asked since the running scan began wait for."""
        self._runner: asyncio.Task[None] | None = None

    async def processes(self) -> list[ProcInfo]:
        loop = asyncio.get_running_loop()
        if self._runner is not None and (self._runner.done() or self._runner.get_loop() is not loop):
            self._next = self._runner = None  # left by a loop that ended (a backend outlives it in tests)
        if self._next is None:
            self._next = loop.create_future()
            if self._runner is None:
                self._runner = loop.create_task(self._run())
        return await asyncio.shield(self._next)

    async def _run(self) -> None:
        """One scan at a time, while anyone waits for one."""
        try:
            while self._next is not None:
                future, self._next = self._next, None
                try:
                    future.set_result(await asyncio.to_thread(live_processes))
                except Exception as e:  # the askers get the error, the next scan may still work
                    future.set_exception(e)
        finally:
            self._runner = None


class LocalSandbox(Sandbox):
    backend_name = "local"
    isolated = False
    scan: SharedScan | None = None
    """The backend's shared scanner (None: each stop scans alone)."""

    @property
    def run_dir_inside(self) -> str:
        return str(self.run_dir)

    @property
    def workspace_inside(self) -> str:
        return str(self.workspace)

    @property
    def shared_inside(self) -> str:
        return str(self.shared_dir)

    @property
    def python(self) -> str:
        return sys.executable

    async def start(self) -> None:
        self.prepare_host()

    async def halt(self) -> None:
        # Without a PID namespace to tear down, killing is a race with whatever still forks: a
        # process started between a scan and the death of its parent escapes that pass. So kill
        # until a scan finds nothing; once the forking parents are dead, the next pass is the last.
        # Each pass reads every process of the host: off the event loop, as the watchdog's census.
        killed = False
        for _ in range(_KILL_PASSES):
            procs = await self.scan.processes() if self.scan else await asyncio.to_thread(live_processes)
            pids = self.process_ids(procs)
            if not pids:
                break
            killed = True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        else:
            log.warning("local sandbox %s: processes %s survived %d rounds of SIGKILL", self.id,
                        await asyncio.to_thread(self.process_ids), _KILL_PASSES)
        self.stop_rung = "sigkill" if killed else "exited"

    def _exec_argv(self, argv: list[str], *, cwd: str | None, env: dict[str, str] | None) -> list[str]:
        # The daemon's own interpreter first on PATH: `python3` in a local sandbox is the one with
        # the daemon's packages (pytest, ipykernel), as in the default image.
        path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        prefix = ["env", f"PATH={path}"] + [f"{k}={v}" for k, v in (env or {}).items()]
        if cwd:
            return ["bash", "-c", 'cd "$1" && shift && exec "$@"', "bash", cwd, *prefix, *argv]
        return [*prefix, *argv]



class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(self, state_dir: Path, *, shared_dir: Path | None = None) -> None:
        super().__init__(state_dir, shared_dir)
        self.scan = SharedScan()

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        global _WARNED
        if not _WARNED:
            log.warning(
                "sandbox backend 'local' ISOLATES NOTHING: agent commands run as uid %d with full "
                "access to this host's files and network. Use the 'apptainer' backend for real runs.",
                os.getuid(),
            )
            _WARNED = True
        sid = uuid.uuid4().hex[:10]
        sandbox = LocalSandbox(sid, spec, self.state_dir / sid, self.shared_dir, self.cgroups)
        sandbox.scan = self.scan
        return sandbox
