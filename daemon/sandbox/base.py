"""What every sandbox backend provides: a folder tree per sandbox and a way to run processes in it.

A sandbox owns one *lease folder* on the host (mode 0700)::

    <lease>/run/        bound at /run/rolloutd inside: command files, kernel connection files
                        and the kernel's ipc sockets (Unix sockets, never TCP)
    <lease>/workspace/  bound at /workspace inside: where tasks put their repositories
    <lease>/overlay/    the writable layer of an ``overlay`` Apptainer sandbox

Backends differ only in how a process is started inside (``exec_argv``) and how the sandbox is
created and destroyed.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.procfs import CENSUSES, ProcInfo, live_processes
from rolloutd.native_io.spawn import DEVNULL, spawn

from .cgroups import SANDBOX_PREFIX, MemoryCgroups, SandboxCgroup

log = logging.getLogger(__name__)

RUN_DIR_INSIDE = "/run/rolloutd"
WORKSPACE_INSIDE = "/workspace"
SHARED_INSIDE = "/run/rolloutd-shared"
NPROC_SLACK = 16
"""Processes a sandbox may start past ``max_processes`` before forks fail (see limits_prelude)."""
NPROC_NODE_HEADROOM = 8192
"""Processes the rest of the node may add under the sandbox user after a shell starts, before that
shell's forks fail (see limits_prelude): every sandbox of a node runs as one user, and a thousand
rollouts in flight are some 2,000 processes of it."""


@dataclass(frozen=True)
class SandboxLimits:
    command_timeout_s: float = 120.0
    """Default wall-time limit of one shell command or IPython cell."""
    max_output_bytes: int = 64 * 1024
    """Output kept per command (head and tail); the total is still reported."""
    max_processes: int = 512
    """Processes a sandbox may run at once; beyond it the watchdog destroys the sandbox (every
    mode), and forks fail further out (unprivileged, RLIMIT_NPROC: see limits_prelude)."""
    memory_mb: int | None = 8192
    """Memory of the whole sandbox: its processes and the tmpfs it writes. A memory cgroup holds it
    where one is writable (see :mod:`.cgroups`); otherwise the watchdog sums resident memory and
    ``/dev/shm``. Over it, the sandbox is destroyed. None for no cap."""
    process_memory_mb: int | None = 8192
    """Address space of each process inside (RLIMIT_AS); None for no limit."""
    workspace_mb: int | None = 10240
    """What the sandbox's ``/workspace`` (and an ``overlay`` layer) may hold. Apptainer: a tmpfs of
    this size, so writes past it fail with ENOSPC (RAM, counted in ``memory_mb``); elsewhere disk,
    walked by the watchdog. One file at most this (RLIMIT_FSIZE). None for no cap (and a
    ``/workspace`` on disk)."""
    min_free_disk_mb: int = 256
    """A sandbox does not start while its backend's folder has less free space than this: a
    clear error then, where a full disk would fail every sandbox half-way with ENOSPC."""

    def __post_init__(self) -> None:
        if self.command_timeout_s <= 0:
            raise ConfigError(f"command_timeout_s must be > 0, got {self.command_timeout_s}")
        if self.max_output_bytes < 1024:
            raise ConfigError(f"max_output_bytes must be >= 1024, got {self.max_output_bytes}")
        if self.max_processes < 8:
            raise ConfigError(f"max_processes must be >= 8, got {self.max_processes}")
        if self.min_free_disk_mb < 0:
            raise ConfigError(f"min_free_disk_mb must be >= 0, got {self.min_free_disk_mb}")
        for name in ("memory_mb", "process_memory_mb", "workspace_mb"):
            value = getattr(self, name)
            if value is not None and value < 16:
                raise ConfigError(f"{name} must be >= 16 (MiB) or None for no cap, got {value}")


@dataclass(frozen=True)
class SandboxSpec:
    """What a caller asks for. Two equal specs can share a warm pool."""

    image: str = "default"
    """``default`` (the bundled Debian image), a SIF file, a sandbox folder or ``docker://...``."""
    network: bool = False
    """False: no network at all inside (``--network none``); the kernel still works over ipc."""
    writable: Literal["tmpfs", "overlay"] = "tmpfs"
    """Writable layer over the image: ``tmpfs`` (RAM; capped at 64 MiB for unprivileged users)
    or ``overlay`` (a folder in the lease, on disk)."""
    ipython: bool = True
    """Start an IPython kernel with the sandbox (needs ipykernel in the image)."""
    binds: tuple[tuple[str, str, str], ...] = ()
    """Extra ``(host path, container path, "ro"|"rw")`` binds."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __post_init__(self) -> None:
        if self.writable not in ("tmpfs", "overlay"):
            raise ConfigError(f"writable must be 'tmpfs' or 'overlay', got {self.writable!r}")
        for bind in self.binds:
            if len(bind) != 3 or bind[2] not in ("ro", "rw") or not bind[1].startswith("/"):
                raise ConfigError(f"bind {bind!r} must be (host path, absolute container path, 'ro'|'rw')")


class Sandbox(abc.ABC):
    """One isolated place to run a shell, a kernel and test suites."""

    backend_name: str = ""
    isolated: bool = True

    def __init__(self, sandbox_id: str, spec: SandboxSpec, lease_dir: Path, shared_dir: Path,
                 cgroups: MemoryCgroups | None = None) -> None:
        """``cgroups``: where its memory cgroup goes (its backend's; None: no cgroup)."""
        self.id = sandbox_id
        self.spec = spec
        self.lease_dir = lease_dir
        self.shared_dir = shared_dir
        """The backend's read-only shared folder (see ``SandboxBackend.shared_dir``)."""
        self.stop_rung: str | None = None
        """How the last stop ended (``sigterm``/``sigkill``/``exited``), for tests and logs."""
        self.session_ids: set[int] = set()
        """Sessions of the shells and kernels started here (the watchdog and stop use them)."""
        self._cgroups = cgroups
        self.cgroup: SandboxCgroup | None = None
        """Its memory cgroup while it runs, where the backend has one (see :mod:`.cgroups`)."""
        self.cgroup_leavable = False
        """Its processes could move themselves out of ``cgroup`` (an Apptainer instance whose cgroup
        filesystem could not be sealed): the watchdog then sums their memory from /proc as well.
        Not tracked for the ``local`` backend, which isolates nothing (trusted code only)."""
        self.background = False
        """Started ahead of need by the warm pool: its start-up runs at a lower CPU priority so it
        does not slow the rollouts in progress (set before ``start``)."""

    # Paths as seen from the host and from inside (the run folder's made once: a kernel's start asks often).
    @functools.cached_property
    def run_dir(self) -> Path:
        return self.lease_dir / "run"

    @property
    def workspace(self) -> Path:
        return self.lease_dir / "workspace"

    @property
    @abc.abstractmethod
    def run_dir_inside(self) -> str: ...

    @property
    @abc.abstractmethod
    def workspace_inside(self) -> str: ...

    @property
    @abc.abstractmethod
    def shared_inside(self) -> str:
        """Where ``shared_dir`` is seen inside."""

    def visible_path(self, host: Path) -> str | None:
        """Where the host path ``host`` can be read inside, when it lies in the shared folder."""
        if not host.is_relative_to(self.shared_dir):
            return None
        rel = host.relative_to(self.shared_dir).as_posix()
        return self.shared_inside if rel == "." else f"{self.shared_inside}/{rel}"

    @property
    @abc.abstractmethod
    def python(self) -> str:
        """The python interpreter to start kernels with, as seen inside."""

    def prepare_host(self) -> None:
        """The lease folders, and the memory cgroup that holds ``memory_mb`` where there is one."""
        for d in (self.lease_dir, self.run_dir, self.workspace):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._cgroups is not None and self.spec.limits.memory_mb is not None:
            self.cgroup = self._cgroups.create(f"{SANDBOX_PREFIX}{self.id}", self.spec.limits.memory_mb)

    async def remove_cgroup(self) -> None:
        """Remove the memory cgroup, once nothing runs in it: after the sandbox is stopped and its
        sessions are closed (a shell respawned after a stop lands in it too)."""
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None

    async def remove_folders(self) -> None:
        """Remove the lease's folders (again, after the watchdog's stop: rm -rf of nothing). Call
        it once nothing of this process holds a file there open: the last close of a removed file
        frees its inode in the closing process, which on a busy disk held the event loop for up to
        29 ms a close."""
        # rm(1) in a child: shutil.rmtree in a worker thread takes the GIL back between its
        # hundreds of unlinks and stalls the loop (measured: the loop's p99 round trip 0.14 ms
        # against 0.05 ms with rm, its worst 8-14 ms against 3-5). rm spends about the same CPU,
        # in its own process.
        rm = await spawn(["rm", "-rf", "--", str(self.lease_dir)], stderr=DEVNULL)
        if code := await rm.wait():
            log.warning("rm -rf %s exited %d: some of the sandbox's files are left there", self.lease_dir, code)

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the sandbox; raise SandboxStartError with an actionable message on failure."""

    async def stop(self) -> None:
        """Destroy the sandbox, everything running in it and its folders; never raises."""
        await self.halt()
        await self.remove_folders()

    @abc.abstractmethod
    async def halt(self) -> None:
        """End the sandbox and everything running in it, leaving its folders; never raises."""

    def exec_argv(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> list[str]:
        """The host command line that runs ``argv`` inside the sandbox (and its memory cgroup)."""
        return self.in_cgroup(self._exec_argv(argv, cwd=cwd, env=env))

    def in_cgroup(self, argv: list[str]) -> list[str]:
        """``argv`` started in the sandbox's memory cgroup, where it has one (what it starts stays there)."""
        return argv if self.cgroup is None else self.cgroup.join_argv(argv)

    @abc.abstractmethod
    def _exec_argv(self, argv: list[str], *, cwd: str | None, env: dict[str, str] | None) -> list[str]:
        """What :meth:`exec_argv` runs, before it is put in the cgroup."""

    def tmpfs_bytes(self) -> int:
        """Bytes the sandbox's own tmpfs mounts (``/dev/shm``, a capped ``/workspace``) hold: RAM
        (0 where it has none of its own)."""
        return 0

    def workspace_free_bytes(self) -> int | None:
        """Room left under a hard ``workspace_mb`` cap (writes past it fail with ENOSPC); None where
        the workspace is a host folder the watchdog walks instead (see ``disk_folders``)."""
        return None

    def disk_folders(self) -> list[Path]:
        """Host folders whose files count towards ``workspace_mb``, walked by the watchdog."""
        return [self.workspace]

    def process_ids(self, procs: list[ProcInfo] | None = None) -> list[int]:
        """Host PIDs of every process running in the sandbox, from ``procs`` (one /proc scan
        shared by all sandboxes) or a fresh scan. Every process a shell or kernel starts keeps
        its session unless it calls setsid, so sessions find fork bombs without cgroups."""
        return [p.pid for p in (procs if procs is not None else live_processes()) if p.session in self.session_ids]

    def census_keys(self) -> set[int]:
        """What its processes are counted by in its backend's :meth:`SandboxBackend.census`."""
        return self.session_ids

    @property
    def needs_census(self) -> bool:
        """Whether :meth:`process_count` and :meth:`proc_memory_bytes` read the backend's census;
        a sandbox that counts its own processes without one says False."""
        return True

    def process_count(self, census: Counter[int]) -> int:
        """Processes of this sandbox in its backend's :meth:`SandboxBackend.census`."""
        return sum(census[k] for k in self.census_keys())

    def proc_memory_bytes(self, rss: Counter[int]) -> int:
        """Resident bytes of its processes, from ``rss`` (``procfs.rss_census`` by its census keys)."""
        return sum(rss[k] for k in self.census_keys())

    def limits_prelude(self) -> str:
        """Shell text that applies the process limits to whatever the shell starts next.

        RLIMIT_NPROC counts every process of the user, and every sandbox of the node runs as the
        same user, so the limit is set above what the user already runs, plus ``max_processes``
        and a little, plus what the node's other sandboxes may start later
        (``NPROC_NODE_HEADROOM``): set to the count at start alone, a shell started early saw its
        forks fail once the node filled up (measured: 686 against 1,911 at 1,000 in flight), and
        an interactive bash whose fork fails drops the rest of the line, sentinel included, so
        its command hung until its time-out. The rlimit stops a fork bomb at once, and the
        watchdog, which sees the sandbox past its cap, then ends it (SANDBOX_LIMIT) rather than
        leaving a shell whose forks fail. The kernel ignores it for root; the watchdog covers
        that case.
        """
        lim = self.spec.limits
        parts = []
        if os.getuid() != 0:
            allowed = lim.max_processes + NPROC_SLACK + NPROC_NODE_HEADROOM
            parts.append(f"ulimit -u $(( $(ps -U $(id -u) -o pid= 2>/dev/null | wc -l) + {allowed} )) 2>/dev/null")
        if lim.process_memory_mb is not None:
            parts.append(f"ulimit -v {lim.process_memory_mb * 1024} 2>/dev/null")
        if lim.workspace_mb is not None:
            parts.append(f"ulimit -f {lim.workspace_mb * 1024} 2>/dev/null")  # in KiB, as -v
        # Make the kernel's OOM killer pick sandbox processes before the daemon.
        parts.append("echo 1000 > /proc/self/oom_score_adj 2>/dev/null")
        return "; ".join(parts)


class SandboxBackend(abc.ABC):
    name: str = ""
    census_kind = "session"
    """What :meth:`census` counts processes per (a key of ``procfs.CENSUSES``): session ids here."""

    def __init__(self, state_dir: Path, shared_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.shared_dir = shared_dir or state_dir / "shared"
        """A host folder every sandbox of this backend can read (never write): what is prepared
        once on the host, such as task templates, each sandbox copies in with its own processes,
        so the daemon spends no CPU per file. A node's workers share one (``shared_dir``), so a
        task's template is built once per node, not once per worker."""
        self.shared_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cgroups = MemoryCgroups.discover()
        """Where sandboxes get a memory cgroup each; None: the watchdog reads /proc instead."""

    def census(self) -> Counter[int]:
        """One pass over /proc that the watchdog hands to every sandbox's ``process_count``."""
        return CENSUSES[self.census_kind]()

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> Sandbox:
        """A new, not yet started sandbox with its own lease folder."""

    async def resolve_image(self, image: str) -> str:
        """The concrete image a spec's ``image`` names (built or converted if needed)."""
        return image

    async def close(self) -> None:
        """Release backend-wide resources."""
