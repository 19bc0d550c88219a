"""The ``apptainer`` backend: one rootless Apptainer instance per sandbox.

- Rootless: started by an ordinary user, an instance lives in a user namespace that user owns,
  with no capability on the host. As root no flag gives that (under ``--userns`` container root
  is still host root), so the node daemon never starts sandboxes as root: its workers run as
  ``sandbox_user`` (:mod:`rolloutd.daemon.node.sandbox_user`). Used directly as root, this backend
  refuses to start unless told ``uncontained_root_ok`` (the tests); it then adds ``--userns``,
  which the default mode needs on machines that withhold a capability.
- ``--containall`` with explicit binds only (the host home is not mounted), optional
  ``--network none``, a writable layer per sandbox (tmpfs or an overlay folder).
- ``/workspace`` is a tmpfs of ``workspace_mb`` mounted in the instance's own namespaces
  (:mod:`.ns_mounts`): a hard cap (ENOSPC inside), in RAM and so charged to the sandbox's memory.
  Where the instance's namespaces are not its user's (a setuid Apptainer) it stays the bound lease
  folder, which the watchdog walks.
- The host's cgroup filesystem, which Apptainer's ``/sys`` shows, is read-only inside (the same
  helper), so the sandbox's processes cannot leave their memory cgroup; where that fails, the
  watchdog also sums their memory from /proc (``cgroup_leavable``).
- Instance state and logs live under the daemon's own ``APPTAINER_CONFIGDIR`` so they never mix
  with the user's instances and are removed with the sandbox.
- Processes are counted, for ``max_processes``, in the instance's own /proc (``procfs.namespace_proc``):
  it lists the PID namespaces its processes nest in it too (``unshare -p``), which a count by
  namespace would miss. Where that /proc is not the namespace's, the node-wide census by
  namespace stands in.
- Stop ladder: SIGTERM to the instance's init, then SIGKILL; killing a PID namespace's init kills
  every process in it, including those started with ``apptainer exec instance://``.
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
import uuid
from collections import Counter
from pathlib import Path
from typing import Literal

import psutil

from rolloutd.native_io.errors import ConfigError, SandboxStartError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail
from rolloutd.native_io.procfs import (
    ProcInfo,
    count_processes,
    live_processes,
    namespace_proc,
    pidns_of,
    resident_bytes,
)
from rolloutd.native_io.spawn import ProcessHandle, spawn

from .base import RUN_DIR_INSIDE, SHARED_INSIDE, WORKSPACE_INSIDE, Sandbox, SandboxBackend, SandboxSpec
from .images import resolve_image
from .ns_join import NamespaceJoin, namespace_join
from .ns_mounts import SEAL_FAILED, WORKSPACE_FAILED

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
MONITOR_EXIT_S = 2.0
"""How long a stop waits for Apptainer's instance monitor to follow the init out."""
NS_MOUNTS_SCRIPT = Path(__file__).with_name("ns_mounts.py")
MOUNT_TIMEOUT_S = 30.0


def apptainer_available() -> bool:
    return shutil.which("apptainer") is not None


class ApptainerSandbox(Sandbox):
    backend_name = "apptainer"
    isolated = True

    def __init__(self, sandbox_id: str, spec: SandboxSpec, lease_dir: Path, backend: "ApptainerBackend") -> None:
        super().__init__(sandbox_id, spec, lease_dir, backend.shared_dir, backend.cgroups)
        self.backend = backend
        self.instance_name = f"rld-{sandbox_id}"
        self.init_pid: int | None = None
        self._init: ProcessHandle | None = None
        self._monitor: ProcessHandle | None = None
        self._pidns: int | None = None
        self._proc: str | None = None
        """The instance's own /proc, seen from the host (see the module's note)."""
        self.image_path: Path | None = None
        self.workspace_capped = False
        """``/workspace`` is the size-capped tmpfs (see the module's note), not the lease folder."""
        self._join: NamespaceJoin | None = None
        """How processes start inside, where the instance's namespaces can be joined (:mod:`.ns_join`)."""

    @property
    def run_dir_inside(self) -> str:
        return RUN_DIR_INSIDE

    @property
    def workspace_inside(self) -> str:
        return WORKSPACE_INSIDE

    @property
    def workspace(self) -> Path:
        # The capped tmpfs exists only in the instance's mount namespace; its init's root shows it.
        if self.workspace_capped and self.init_pid is not None:
            return Path(f"/proc/{self.init_pid}/root{WORKSPACE_INSIDE}")
        return self.lease_dir / "workspace"

    @property
    def shared_inside(self) -> str:
        return SHARED_INSIDE

    @property
    def python(self) -> str:
        return "python3"

    def _start_argv(self, image: Path) -> list[str]:
        spec = self.spec
        argv = ["apptainer", "-q", "instance", "start", "--containall"]
        if os.getuid() == 0:
            argv.append("--userns")
        if not spec.network:
            argv += ["--net", "--network", "none"]
        if spec.writable == "tmpfs":
            argv.append("--writable-tmpfs")
        else:
            overlay = self.lease_dir / "overlay"
            overlay.mkdir(mode=0o700, exist_ok=True)
            argv += ["--overlay", str(overlay)]
        argv += ["--bind", f"{self.run_dir}:{RUN_DIR_INSIDE}", "--bind", f"{self.workspace}:{WORKSPACE_INSIDE}",
                 "--bind", f"{self.shared_dir}:{SHARED_INSIDE}:ro"]
        for host, inside, mode in spec.binds:
            argv += ["--bind", f"{host}:{inside}:{mode}"]
        argv += ["--pid-file", str(self.lease_dir / "instance.pid"), str(image), self.instance_name]
        return argv

    async def start(self) -> None:
        self.prepare_host()
        self.image_path = await resolve_image(self.spec.image)
        argv = self.in_cgroup(self._start_argv(self.image_path))
        if self.background:
            argv = ["nice", "-n", "10", *argv]
        # Output goes to a file, not a pipe: the instance's daemon inherits the start command's
        # descriptors, and a pipe would then never reach EOF.
        start_log = self.lease_dir / "start.log"
        with open(start_log, "wb") as log_file:
            proc = await spawn(argv, cwd=self.lease_dir, env=self.backend.env(), stdout=log_file, stderr=log_file)
        pid_file = self.lease_dir / "instance.pid"
        try:
            await asyncio.wait_for(proc.wait(), self.backend.start_timeout_s)
        except BaseException as e:
            # Timed out or cancelled half-way: the instance may still come up after we leave.
            # A cancelled start is allowed to finish (it takes a fraction of a second) so that
            # its pidfile names what to stop; a timed-out one is killed and searched for.
            if not isinstance(e, TimeoutError):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), self.backend.start_timeout_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
            text = pid_file.read_text().strip() if pid_file.exists() else ""
            self._adopt_init(int(text) if text.isdigit() else self._find_init_pid())
            await asyncio.shield(self.stop())
            if isinstance(e, TimeoutError):
                raise SandboxStartError(
                    f"apptainer instance start took over {self.backend.start_timeout_s} s "
                    f"(sandbox start_timeout_s) for image {self.image_path}"
                ) from None
            raise
        pid_text = pid_file.read_text().strip() if pid_file.exists() else ""
        if proc.returncode != 0 or not pid_text.isdigit():
            output = tail((await asyncio.to_thread(start_log.read_text, errors="replace")).strip(), LOG_TAIL_CHARS)
            await self.stop()
            raise SandboxStartError(
                f"apptainer instance start failed (exit {proc.returncode}) for image {self.image_path}: "
                f"{output}\ncommand: {' '.join(argv)}"
            )
        self._adopt_init(int(pid_text))
        self._proc = namespace_proc(int(pid_text), self._pidns)
        if self.backend.exec_via == "nsenter":
            self._join = namespace_join(int(pid_text), image=str(self.image_path), instance=self.instance_name)
            if self._join is None:
                log.info("sandbox %s: its namespaces cannot be joined; processes start with apptainer exec", self.id)
        if self._proc is None:
            log.warning("sandbox %s: its /proc is not its PID namespace's; the watchdog counts its processes by "
                        "namespace, which misses namespaces they nest", self.id)
        await self._mount_inside(start_log)

    async def _mount_inside(self, log_path: Path) -> None:
        """The ``workspace_mb`` tmpfs at /workspace and the sealed cgroup filesystem (see
        :mod:`.ns_mounts`); failing those, the watchdog's slower checks stand in."""
        size_mb = self.spec.limits.workspace_mb
        args = ["--workspace", WORKSPACE_INSIDE, str(size_mb)] if size_mb is not None else []
        if self.cgroup is not None:
            args.append("--seal-cgroups")
        if not args:
            return
        with open(log_path, "ab") as log_file:
            proc = await spawn([sys.executable, "-I", "-S", str(NS_MOUNTS_SCRIPT), str(self.init_pid), *args],
                               stdout=log_file, stderr=log_file)
        try:
            code = await asyncio.wait_for(proc.wait(), MOUNT_TIMEOUT_S)
        except BaseException:
            proc.kill()
            await asyncio.shield(proc.wait())
            await asyncio.shield(self.stop())
            raise
        workspace_failed = size_mb is not None and (code < 0 or bool(code & WORKSPACE_FAILED))
        self.workspace_capped = size_mb is not None and not workspace_failed
        self.cgroup_leavable = self.cgroup is not None and (code < 0 or bool(code & SEAL_FAILED))
        if not (workspace_failed or self.cgroup_leavable):
            return
        output = tail((await asyncio.to_thread(log_path.read_text, errors="replace")).strip(), LOG_TAIL_CHARS)
        reason = output.splitlines()[-1] if output else f"exit {code}"
        if workspace_failed:
            log.warning("sandbox %s: no hard cap on /workspace (%s); the watchdog walks it for workspace_mb instead",
                        self.id, reason)
        if self.cgroup_leavable:
            log.warning("sandbox %s: its processes could leave their memory cgroup (%s); the watchdog also sums "
                        "their memory from /proc", self.id, reason)

    def _adopt_init(self, pid: int | None) -> None:
        self.init_pid = pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._init = ProcessHandle(pid)
        self._pidns = pidns_of(pid)
        self._monitor = _instance_monitor(pid)

    def _find_init_pid(self) -> int | None:
        """The instance's init, found by the name Apptainer gives its parent process."""
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info.get("cmdline") or [])
            if cmd.startswith("Apptainer instance:") and f"[{self.instance_name}]" in cmd:
                with contextlib.suppress(psutil.Error):
                    children = proc.children()
                    return children[0].pid if children else proc.pid
        return None

    def _exec_argv(self, argv: list[str], *, cwd: str | None, env: dict[str, str] | None) -> list[str]:
        if self._join is not None and self._init is not None and self._init.alive:
            return self._join.argv(argv, cwd=cwd or WORKSPACE_INSIDE, env=env)
        # The instance is registered under the daemon's own config dir, which exec must see too.
        cmd = ["env", f"APPTAINER_CONFIGDIR={self.backend.config_dir}", "apptainer", "-q", "exec", "--cleanenv"]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += ["--pwd", cwd or WORKSPACE_INSIDE, f"instance://{self.instance_name}", *argv]
        return cmd

    def tmpfs_bytes(self) -> int:
        # The instance's own tmpfs at /dev/shm (host-sized, uncapped) and its /workspace, seen
        # through its init.
        if self.init_pid is None:
            return 0
        total = 0
        for inside in ("/dev/shm", WORKSPACE_INSIDE) if self.workspace_capped else ("/dev/shm",):
            with contextlib.suppress(OSError):
                st = os.statvfs(f"/proc/{self.init_pid}/root{inside}")
                total += (st.f_blocks - st.f_bfree) * st.f_frsize
        return total

    def workspace_free_bytes(self) -> int | None:
        if not self.workspace_capped or self.init_pid is None:
            return None
        try:
            st = os.statvfs(self.workspace)
        except OSError:  # the instance is gone: the pool sees that, not the cap
            return None
        return st.f_bavail * st.f_frsize

    def disk_folders(self) -> list[Path]:
        folders = [] if self.workspace_capped else [self.workspace]
        return folders + [self.lease_dir / "overlay"] if self.spec.writable == "overlay" else folders

    def process_ids(self, procs: list[ProcInfo] | None = None) -> list[int]:
        """Every process in the instance's PID namespace (killing its init ends them all)."""
        if self._pidns is None:
            return []
        return [p.pid for p in (procs if procs is not None else live_processes()) if p.pidns == self._pidns]

    def census_keys(self) -> set[int]:
        return {self._pidns} if self._pidns is not None else set()

    @property
    def needs_census(self) -> bool:
        return self._proc is None

    def process_count(self, census: Counter[int]) -> int:
        count = count_processes(self._proc) if self._proc is not None else None
        return count if count is not None else super().process_count(census)

    def proc_memory_bytes(self, rss: Counter[int]) -> int:
        return resident_bytes(self._proc) if self._proc is not None else super().proc_memory_bytes(rss)

    async def halt(self) -> None:
        init = self._init
        rung = "exited"
        if init is not None and init.alive:
            rung = "sigterm"
            init.signal(signal.SIGTERM)
            if not await init.wait(STOP_GRACE_S):
                rung = "sigkill"
                init.signal(signal.SIGKILL)
                await init.wait(5.0)
        if init is not None:
            init.close()
            self._init = None
        # The monitor lives in the sandbox's memory cgroup: removing the cgroup while it is still
        # exiting would find it there and kill it as a straggler (about one stop in three).
        if self._monitor is not None:
            await self._monitor.wait(MONITOR_EXIT_S)
            self._monitor.close()
            self._monitor = None
        self.stop_rung = rung
        self.backend.forget_instance(self.instance_name)


class ApptainerBackend(SandboxBackend):
    name = "apptainer"
    census_kind = "pidns"  # each instance has a PID namespace of its own

    def __init__(self, state_dir: Path, *, shared_dir: Path | None = None, start_timeout_s: float = 120.0,
                 uncontained_root_ok: bool = False, exec_via: Literal["nsenter", "apptainer"] = "nsenter") -> None:
        """``uncontained_root_ok``: as root, start sandboxes anyway, whose root is host root (for
        trusted code only, such as the tests); refused otherwise. ``exec_via``: how shells and
        kernels start inside an instance: by joining its namespaces where it can
        (:mod:`.ns_join`), else, or with ``"apptainer"``, through ``apptainer exec``."""
        if not apptainer_available():
            raise SandboxStartError(
                "the apptainer backend needs the `apptainer` command (>= 1.1); install it "
                "(scripts/install-apptainer on Debian) or use backend 'local'"
            )
        if os.getuid() == 0:
            if not uncontained_root_ok:
                raise ConfigError(
                    "apptainer sandboxes started by root are not contained (container root is host root, even "
                    "with --userns): use this backend as an ordinary user, or the node daemon (`rolloutd node "
                    "start`, which runs its sandboxes as the unprivileged sandbox_user); for trusted code only, "
                    "ApptainerBackend(..., uncontained_root_ok=True)")
            log.warning("apptainer sandboxes started by root hold host root's privileges (uncontained_root_ok)")
        super().__init__(state_dir, shared_dir)
        self.start_timeout_s = start_timeout_s
        self.exec_via = exec_via
        self.config_dir = state_dir / "apptainer"
        self.config_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("APPTAINER_", "SINGULARITY_"))}
        env["APPTAINER_CONFIGDIR"] = str(self.config_dir)
        return env

    def create(self, spec: SandboxSpec) -> ApptainerSandbox:
        sid = uuid.uuid4().hex[:10]
        return ApptainerSandbox(sid, spec, self.state_dir / sid, self)

    async def resolve_image(self, image: str) -> str:
        return str(await resolve_image(image))

    def forget_instance(self, name: str) -> None:
        """Remove the instance's state file and logs (Apptainer never removes logs)."""
        host = socket.gethostname().split(".")[0]
        user = _username()
        for sub in (self.config_dir / "instances" / "app" / host / user / name,):
            shutil.rmtree(sub, ignore_errors=True)
        for suffix in (".out", ".err"):
            with contextlib.suppress(FileNotFoundError):
                (self.config_dir / "instances" / "logs" / host / user / f"{name}{suffix}").unlink()

    def leftover_instances(self) -> list[str]:
        """Instance state files still present (tests assert this is empty after shutdown)."""
        app = self.config_dir / "instances" / "app"
        return [p.name for p in app.glob("*/*/*") if p.is_dir()] if app.exists() else []


def _instance_monitor(init_pid: int) -> ProcessHandle | None:
    """Apptainer's process above an instance's init ("Apptainer instance: ..."), which exits after it."""
    try:
        parent = psutil.Process(init_pid).parent()
        if parent is None or not " ".join(parent.cmdline()).startswith("Apptainer instance:"):
            return None
        return ProcessHandle(parent.pid)
    except (psutil.Error, ProcessLookupError):
        return None


def _username() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
