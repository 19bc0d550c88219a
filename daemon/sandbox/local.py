"""The ``local`` backend: a scratch folder and plain host processes.

For laptops and machines without Apptainer. It isolates NOTHING: commands run as the daemon's
user with the host's files, network and software. It says so at creation time, loudly.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from .base import Sandbox, SandboxBackend, SandboxSpec

log = logging.getLogger(__name__)

_WARNED = False


class LocalSandbox(Sandbox):
    backend_name = "local"
    isolated = False

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
        self.prepare_folders()

    async def stop(self) -> None:
        pids = self.process_ids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.stop_rung = "sigkill" if pids else "exited"
        await self.remove_folders()

    def exec_argv(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> list[str]:
        # The daemon's own interpreter first on PATH: `python3` in a local sandbox is the one with
        # the daemon's packages (pytest, ipykernel), as in the default image.
        path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        prefix = ["env", f"PATH={path}"] + [f"{k}={v}" for k, v in (env or {}).items()]
        if cwd:
            return ["bash", "-c", 'cd "$1" && shift && exec "$@"', "bash", cwd, *prefix, *argv]
        return [*prefix, *argv]



class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)

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
        return LocalSandbox(sid, spec, self.state_dir / sid, self.shared_dir)
