"""The node's worker processes as the supervisor sees them: start each as the workers' user,
restart it whenever it dies (with a growing delay), pick the least busy, stop them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.reaper import reap_state_dir
from rolloutd.daemon.node.sandbox_user import SandboxUser, own_folder
from rolloutd.daemon.sandbox import cgroups
from rolloutd.daemon.sandbox.apptainer import apptainer_available
from rolloutd.daemon.sandbox.images import cache_dir, resolve_image
from rolloutd.native_io.errors import ConfigError, RolloutdError
from rolloutd.native_io.output import tail
from rolloutd.native_io.unix_link import UnixLink

log = logging.getLogger(__name__)

RESTART_DELAY_MAX_S = 30.0
STABLE_RUN_S = 30.0
"""A worker that ran this long before dying restarts after the configured delay again."""
IMPORT_PROBE_TIMEOUT_S = 120.0
READY_POLL_S = 0.05
UNIX_PATH_MAX = 108
"""sun_path's size on Linux, its terminating NUL included."""
LISTEN_BACKLOG = 128


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


class Workers:
    def __init__(self, config: NodeConfig, workers_dir: Path, sandbox_user: SandboxUser | None, shm_prefix: str,
                 on_message: Callable[[WorkerHandle, list[Any]], None],
                 on_died: Callable[[WorkerHandle], None], counters: dict[str, int]) -> None:
        self.config = config
        self.dir = workers_dir
        self.sandbox_user = sandbox_user
        self.shm_prefix = shm_prefix
        self.handles = {i: WorkerHandle(i, restart_delay_s=config.worker_restart_delay_s)
                        for i in range(config.worker_count)}
        self.stopping = False
        self._spawning = asyncio.Lock()
        """Held from a start's check of ``stopping`` until its process is recorded, and by
        :meth:`stop` while it sets ``stopping``: a restart under way when a stop comes either
        finishes first (the stop then ends it too) or does not start at all."""
        self.memory_cgroup: Path | None = None
        """The memory cgroup folder handed to the sandbox user's workers (a root daemon's)."""
        self.client_uids = {os.getuid(), 0}
        """Who may connect to the workers' client links (as to the node's own socket)."""
        self._on_message = on_message
        self._on_died = on_died
        self._counters = counters

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(self.handles.values())

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, index: int) -> WorkerHandle:
        return self.handles[index]

    def get(self, index: int) -> WorkerHandle | None:
        return self.handles.get(index)

    def state_dir(self, index: int) -> Path:
        return self.dir / f"w{index}"

    @property
    def shared_dir(self) -> Path:
        """What every worker's sandboxes read (task templates): one per node, so each is built once."""
        return self.dir / "shared"

    def shm_prefix_of(self, w: WorkerHandle) -> str:
        return f"{self.shm_prefix}w{w.index}g{w.generation}-"

    def pick(self) -> WorkerHandle | None:
        """The live worker with the fewest requests in flight."""
        live = [w for w in self.handles.values() if w.ready]
        return min(live, key=lambda w: len(w.in_flight)) if live else None

    def _as_workers_user(self, argv: list[str]) -> list[str]:
        """``argv`` run as the workers' user (uvloop's subprocesses take no ``user=``)."""
        return argv if self.sandbox_user is None else self.sandbox_user.run_as(argv)

    async def check_can_start(self) -> None:
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
        _, err = await asyncio.wait_for(probe.communicate(), IMPORT_PROBE_TIMEOUT_S)
        if probe.returncode != 0:
            raise ConfigError(
                f"the workers run as the unprivileged user {self.sandbox_user.name!r} (sandbox_user), who cannot "
                f"run rolloutd from {sys.executable} or read the image cache {images}: make them readable by that "
                f"user (chmod -R o+rX on them, o+x on every parent folder; ROLLOUTD_CACHE_DIR moves the cache). "
                f"Its error: {tail(err.decode(errors='replace'))}")

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self.handles.values()):
            if time.monotonic() > deadline:
                raise RolloutdError(f"workers did not start within {timeout_s} s; see the daemon log")
            await asyncio.sleep(READY_POLL_S)

    def _clients_path(self, w: WorkerHandle) -> Path:
        return self.config.run_path / f"w{w.index}-{w.generation}.sock"

    async def _spawn(self, w: WorkerHandle) -> tuple[asyncio.subprocess.Process, socket.socket]:
        """Start ``w``'s process (also ``w.proc``), and the supervisor's end of its link."""
        env = {**os.environ, "ROLLOUTD_NODE_CONFIG_JSON": self.config.to_json()}
        if self.memory_cgroup is not None:
            env[cgroups.CGROUP_ENV] = str(self.memory_cgroup)
        state = self.state_dir(w.index)
        await asyncio.to_thread(reap_state_dir, state)
        for folder in (state, self.shared_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            own_folder(folder, self.sandbox_user)
        if self.sandbox_user is not None:
            # Root's home is closed to that user: tools get a home of their own, and the image
            # cache is named, not found through $HOME.
            env.update(HOME=str(state), ROLLOUTD_CACHE_DIR=str(cache_dir()))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        clients_path = self._clients_path(w)
        clients = bind_client_listener(clients_path)
        argv = [sys.executable, "-m", "rolloutd.daemon.node.worker", "--index", str(w.index),
                "--generation", str(w.generation), "--link-fd", str(theirs.fileno()),
                "--state-dir", str(state), "--shared-dir", str(self.shared_dir), "--shm-prefix", self.shm_prefix_of(w)]
        fds = [theirs.fileno()]
        if clients is not None:
            argv += ["--client-fd", str(clients.fileno()), "--client-path", str(clients_path),
                     "--client-uids", ",".join(map(str, sorted(self.client_uids)))]
            fds.append(clients.fileno())
        try:
            w.proc = proc = await asyncio.create_subprocess_exec(
                *self._as_workers_user(argv), env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=fds, cwd="/")
        finally:
            theirs.close()
            if clients is not None:
                clients.close()  # the worker's now: its death closes the socket for every client
        return proc, ours

    async def run(self, w: WorkerHandle) -> None:
        """Start the worker, and restart it whenever it dies, until shutdown."""
        while True:
            async with self._spawning:
                if self.stopping:
                    return
                proc, ours = await self._spawn(w)
            w.link = UnixLink(ours, lambda frames, w=w: self._on_message(w, frames))
            started = time.monotonic()
            code = await proc.wait()
            w.ready = False
            w.link.close()
            with contextlib.suppress(FileNotFoundError):
                self._clients_path(w).unlink()
            if self.stopping:
                return
            log.error("worker %d (pid %d) exited with %s; restarting", w.index, proc.pid, code)
            self._on_died(w)
            if time.monotonic() - started > STABLE_RUN_S:
                w.restart_delay_s = self.config.worker_restart_delay_s
            await asyncio.sleep(w.restart_delay_s)
            w.restart_delay_s = min(RESTART_DELAY_MAX_S, w.restart_delay_s * 2)
            w.generation += 1
            self._counters["worker_restarts"] += 1

    async def stop(self) -> None:
        """SIGTERM to every worker, SIGKILL after ``shutdown_timeout_s``; then reap their sandboxes."""
        async with self._spawning:
            self.stopping = True
        procs = [w.proc for w in self.handles.values() if w.proc and w.proc.returncode is None]
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
        for w in self.handles.values():
            await asyncio.to_thread(reap_state_dir, self.state_dir(w.index))

    def status(self) -> list[dict[str, Any]]:
        return [{"index": w.index, "pid": w.proc.pid if w.proc else None, "ready": w.ready,
                 "generation": w.generation, "in_flight": len(w.in_flight),
                 **{k: v for k, v in w.stats.items() if k != "pid"}} for w in self.handles.values()]


def bind_client_listener(path: Path) -> socket.socket | None:
    """A listening socket at ``path`` (owner only) for a worker's client links; None when the path
    is too long for a Unix socket: clients then send everything through the supervisor."""
    if len(os.fsencode(path)) >= UNIX_PATH_MAX:
        log.warning("no direct client links: %s is longer than a Unix socket path may be", path)
        return None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(LISTEN_BACKLOG)
    return sock
