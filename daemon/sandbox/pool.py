"""Warm pool: sandboxes started ahead of time, with their shell already answering.

A cold sandbox costs 0.3-20 s (instance start); a lease from the pool costs one shell probe.
A lease's IPython kernel starts on its first cell (0.7-0.9 s then), unless the pool was told to
start kernels ahead too: a kernel costs its sandbox ~1 s of CPU to start and stays resident,
and most agents use the shell and the editor far more than IPython, or not at all.

Every lease gets a fresh sandbox: on release the sandbox is destroyed in the background and a
new one is started, so a lease never sees the files or processes of the previous one (an
overlay mounted in a live instance cannot be reset safely in place).
Cold starts and refills pass one :class:`~.start_gate.StartGate`: a few at a time, one image at a
bounded rate, a bounded queue (a burst of hundreds finishes at the machine's pace, none times out).
A watchdog destroys any sandbox over one of its caps (processes, memory, workspace disk: see
:mod:`.caps`), which also covers root, where the kernel ignores RLIMIT_NPROC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from rolloutd.native_io.errors import SandboxLimit, SandboxLost, SandboxStartError, SessionError
from rolloutd.native_io.procfs import CENSUS_INTERVAL_S
from rolloutd.native_io.pty_session import CommandResult, PtySession, PtyShellConfig, default_shell_argv

from ..sessions.ipython import ExecuteResult, KernelSession
from .base import Sandbox, SandboxBackend, SandboxSpec
from .caps import find_breaches, with_thread_cpu
from .start_gate import StartGate, StartGateConfig

log = logging.getLogger(__name__)

FIRST_COMMAND_TIMEOUT_S = 10.0
"""A new shell's first command (it loads the command path): slow only on a saturated node."""
PROBE_TIMEOUT_S = 2.0
"""A returned sandbox's shell must answer ``:`` this fast to be leased again."""

T = TypeVar("T")

DISK_CHECK_INTERVAL_S = 5.0
OOM_NOTICE_S = 5.0
"""How long a call whose shell the OOM killer ended waits for the watchdog to name the cap."""


@dataclass
class Lease:
    """A started sandbox with its sessions; what a rollout or a trainer's sandbox handle holds."""

    sandbox: Sandbox
    shell: PtySession
    offers_ipython: bool = False
    """Whether cells may start a kernel: the leased spec's ``ipython`` (a warm sandbox without a
    kernel serves either)."""
    kernel: KernelSession | None = None
    """Started by :meth:`start_kernel` (the first cell calls it); None before."""
    created_at: float = field(default_factory=time.monotonic)
    leased_at: float | None = None
    lost_reason: str | None = None
    lost_limit: str | None = None
    """The cap (e.g. ``max_processes``) a sandbox lost to the watchdog went over."""
    marked_lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set with ``lost_reason``."""
    sandbox_stopped: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set once the sandbox is stopped: nothing it ran is alive. ``lost_reason`` comes first (new
    commands are refused at once); the stop of a lost lease follows in the background."""
    start_wait_s: float = 0.0
    """Wall time the sandbox's start waited in the pool's start gate (``open_lease``), then took,
    then its shell took to answer."""
    instance_start_s: float = 0.0
    shell_start_s: float = 0.0
    kernel_start_s: float = 0.0
    """Wall time this lease's cells waited for their kernel to start (none when it was started
    ahead)."""
    _kernel_start: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def id(self) -> str:
        return self.sandbox.id

    def _check(self) -> None:
        if self.lost_reason:
            error = SandboxLimit if self.lost_limit else SandboxLost
            raise error(f"sandbox {self.id} is gone: {self.lost_reason}")

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        self._check()
        limit = timeout_s if timeout_s is not None else self.sandbox.spec.limits.command_timeout_s
        return await self._unless_lost(self.shell.run(command, timeout_s=limit))

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        """Run a cell; the kernel's start-up, on the first cell, is not counted in ``timeout_s``."""
        waits, t0 = self.kernel is None, time.monotonic()
        try:
            kernel = await self.start_kernel()
        finally:
            if waits:
                self.kernel_start_s += time.monotonic() - t0
        limit = timeout_s if timeout_s is not None else self.sandbox.spec.limits.command_timeout_s
        return await self._unless_lost(kernel.execute(code, timeout_s=limit))

    async def start_kernel(self) -> KernelSession:
        """The lease's IPython kernel, started now if it is not yet. KernelError when it cannot
        start (the next call tries again); the shell is unaffected."""
        self._check()
        if not self.offers_ipython:
            raise SessionError(f"sandbox {self.id} has no IPython kernel: open it with ipython=True "
                               "(the image needs ipykernel)")
        async with self._kernel_start:
            kernel = self.kernel
            if kernel is None:
                kernel = KernelSession(self.sandbox, max_output_bytes=self.sandbox.spec.limits.max_output_bytes,
                                       name=f"kernel-{self.id}")
                self.kernel = kernel  # a destroy() meanwhile stops it too
                try:
                    await self._unless_lost(kernel.start())
                except BaseException:
                    self.kernel = None
                    raise
            return kernel

    async def _unless_lost(self, call: Awaitable[T]) -> T:
        """``call``'s answer, or SandboxLost when the sandbox was lost while it ran (the watchdog
        destroyed it): its session then fails, or answers from a process it respawned outside."""
        try:
            result = await call
        except SessionError:
            cgroup = self.sandbox.cgroup
            if not self.lost_reason and cgroup is not None and cgroup.oom_kills():
                # Over its memory cap, the OOM killer may pick the shell itself (its processes are
                # the first choice): the watchdog names the cap within a round; wait for that.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.marked_lost.wait(), OOM_NOTICE_S)
            self._check()
            raise
        self._check()
        return result

    async def stop_sandbox(self) -> None:
        """Stop the sandbox, everything running in it and its folders (never raises); sets
        ``sandbox_stopped``. For the watchdog: a lost lease's folders go at once (a full disk is
        freed), before :meth:`destroy` closes the sessions' files."""
        await self.sandbox.stop()
        self.sandbox_stopped.set()

    async def destroy(self) -> None:
        # The sandbox first: killing an instance's init ends every process inside at once, so the
        # sessions below only have to reap and close their files. The folders after those closes,
        # so that rm, not this loop, frees the files' inodes (Sandbox.remove_folders).
        await self.sandbox.halt()
        self.sandbox_stopped.set()
        try:
            await self.shell.close()
            if self.kernel is not None:
                await self.kernel.close()
        finally:
            await self.sandbox.remove_folders()
            await self.sandbox.remove_cgroup()


async def open_lease(sandbox: Sandbox, *, start_kernel: bool = False, gate: StartGate | None = None) -> Lease:
    """Start ``sandbox`` and its shell, and its kernel too with ``start_kernel`` (when its spec
    offers IPython; otherwise the first cell starts it). On any failure nothing is left running.
    ``gate`` admits the sandbox's start only: the instance start is what crowds a machine when
    hundreds go at once, and shells can start no faster than instances come out of the gate.
    A refill (``sandbox.background``) lets the starts someone waits for through the gate first."""
    slot = gate.slot(sandbox.spec.image, background=sandbox.background) if gate else contextlib.nullcontext(0.0)
    async with slot as waited_s:
        t0 = time.monotonic()
        try:
            await sandbox.start()
        except BaseException:
            await sandbox.remove_cgroup()
            raise
    t1 = time.monotonic()
    spec = sandbox.spec
    shell = PtySession(
        PtyShellConfig(
            argv=sandbox.exec_argv(default_shell_argv(), cwd=sandbox.workspace_inside,
                                   env={"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat"}
                                   if sandbox.isolated else None),
            command_dir_host=sandbox.run_dir / "sh",
            command_dir_shell=f"{sandbox.run_dir_inside}/sh",
            max_output_bytes=spec.limits.max_output_bytes,
            init_script=sandbox.limits_prelude(),
        ),
        name=f"shell-{sandbox.id}",
    )
    lease = Lease(sandbox, shell, offers_ipython=spec.ipython, start_wait_s=waited_s, instance_start_s=t1 - t0)
    try:
        await shell.start()
        if shell.pid is not None:
            sandbox.session_ids.add(shell.pid)
        # The first command of a new shell pays for loading the command path; pay it here.
        await shell.run(":", timeout_s=FIRST_COMMAND_TIMEOUT_S)
        lease.shell_start_s = time.monotonic() - t1
        if start_kernel and spec.ipython:
            await lease.start_kernel()
    except BaseException:
        await lease.destroy()
        raise
    return lease


class WarmPool:
    """Keeps ``size`` ready leases for each warm spec; other specs are started cold on demand."""

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        warm_specs: dict[SandboxSpec, int] | None = None,
        max_age_s: float = 3600.0,
        start_gate: StartGateConfig | None = None,
        watchdog_interval_s: float = CENSUS_INTERVAL_S,
        disk_check_interval_s: float = DISK_CHECK_INTERVAL_S,
        start_kernels: bool = False,
    ) -> None:
        """``start_kernels``: sandboxes whose spec offers IPython start their kernel before they
        are leased (see the module's note). ``disk_check_interval_s``: how often the watchdog
        walks the workspaces for ``workspace_mb`` (a walk costs a stat per file). ``start_gate``: how starts are
        admitted (defaults of :class:`StartGateConfig`)."""
        self.backend = backend
        self.start_kernels = start_kernels
        self.warm_specs = {self._key(s): n for s, n in (warm_specs or {}).items()}
        self.max_age_s = max_age_s
        self.watchdog_interval_s = watchdog_interval_s
        self.disk_check_interval_s = disk_check_interval_s
        self._ready: dict[SandboxSpec, deque[Lease]] = {s: deque() for s in self.warm_specs}
        self._starting: dict[SandboxSpec, int] = {s: 0 for s in self.warm_specs}
        self._leased: dict[str, Lease] = {}
        self.start_gate = StartGate(start_gate)
        self._wakeup = asyncio.Event()
        self._ready_changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._destroying: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.counters = {"started": 0, "start_failures": 0, "cold_starts": 0, "leases": 0,
                         "recycled_old": 0, "watchdog_kills": 0, "destroyed": 0, "own_censuses": 0,
                         "given_censuses": 0, "start_wait_s": 0.0, "watchdog_cpu_s": 0.0}
        self._given_census = GivenCensus(max_age_s=3 * watchdog_interval_s)
        self.last_start_error: str | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._spawn(self._replenish_loop())
        self._spawn(self._watchdog_loop())
        self._wakeup.set()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every warm spec has its full count of ready leases (or a start keeps failing)."""
        async with self._ready_changed:
            await asyncio.wait_for(
                self._ready_changed.wait_for(
                    lambda: all(len(self._ready[s]) >= n for s, n in self.warm_specs.items())
                    or self.counters["start_failures"] > 0
                ),
                timeout_s,
            )
        if self.counters["start_failures"] and self.last_start_error:
            raise SandboxStartError(f"warm pool could not start a sandbox: {self.last_start_error}")

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Destructions already under way are finished, never cancelled half-way.
        await asyncio.gather(*self._destroying, return_exceptions=True)
        leases = [l for q in self._ready.values() for l in q] + list(self._leased.values())
        for q in self._ready.values():
            q.clear()
        self._leased.clear()
        await asyncio.gather(*(self._destroy(l) for l in leases), return_exceptions=True)

    # --- leasing --------------------------------------------------------------------------

    def _key(self, spec: SandboxSpec) -> SandboxSpec:
        """The warm spec that serves ``spec``: without kernels started ahead, a sandbox is the same
        whether its lease offers IPython or not."""
        return spec if self.start_kernels else replace(spec, ipython=False)

    async def lease(self, spec: SandboxSpec) -> Lease:
        key = self._key(spec)
        queue = self._ready.get(key)
        try:
            while queue:
                lease = queue.popleft()
                if await self._healthy(lease):
                    return self._hand_out(lease, spec)
                self._destroy_later(lease)
            self.counters["cold_starts"] += 1
            return self._hand_out(await self._start_one(key), spec)
        finally:
            # Replenish only after the lease is out: starting processes forks in this loop.
            self._wakeup.set()

    def _hand_out(self, lease: Lease, spec: SandboxSpec) -> Lease:
        lease.offers_ipython = spec.ipython
        lease.leased_at = time.monotonic()
        self._leased[lease.id] = lease
        self.counters["leases"] += 1
        return lease

    async def release(self, lease: Lease) -> None:
        """Give a lease back: its sandbox is destroyed in the background and replaced."""
        self._leased.pop(lease.id, None)
        self._destroy_later(lease)
        self._wakeup.set()

    def get(self, sandbox_id: str) -> Lease:
        try:
            return self._leased[sandbox_id]
        except KeyError:
            raise SandboxLost(f"no open sandbox {sandbox_id!r} (closed, expired, or its worker restarted)") from None

    async def _healthy(self, lease: Lease) -> bool:
        if lease.lost_reason or not lease.shell.alive:
            return False
        if lease.kernel is not None and not lease.kernel.alive:
            return False
        if time.monotonic() - lease.created_at > self.max_age_s:
            self.counters["recycled_old"] += 1
            return False
        try:
            return (await lease.shell.run(":", timeout_s=PROBE_TIMEOUT_S)).exit_code == 0
        except SessionError:
            return False

    # --- background work --------------------------------------------------------------------

    async def _start_one(self, spec: SandboxSpec, *, background: bool = False) -> Lease:
        try:
            check_free_space(self.backend.state_dir, spec.limits.min_free_disk_mb)
        except SandboxStartError:
            self.counters["start_failures"] += 1
            raise
        sandbox = self.backend.create(spec)
        sandbox.background = background
        try:
            lease = await open_lease(sandbox, start_kernel=self.start_kernels, gate=self.start_gate)
        except Exception as e:
            self.counters["start_failures"] += 1
            self.last_start_error = str(e)
            raise
        self.counters["started"] += 1
        self.counters["start_wait_s"] += lease.start_wait_s
        return lease

    async def _replenish_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            now = time.monotonic()
            for spec, queue in self._ready.items():
                for lease in [l for l in queue if now - l.created_at > self.max_age_s]:
                    queue.remove(lease)
                    self.counters["recycled_old"] += 1
                    self._destroy_later(lease)
                missing = self.warm_specs[spec] - len(queue) - self._starting[spec]
                for _ in range(max(0, missing)):
                    self._starting[spec] += 1
                    self._spawn(self._fill(spec))

    async def _fill(self, spec: SandboxSpec) -> None:
        try:
            lease = await self._start_one(spec, background=True)
        except Exception as e:
            log.error("warm pool: sandbox start failed: %s", e)
            await asyncio.sleep(1.0)  # do not spin on a broken image
            lease = None
        finally:
            self._starting[spec] -= 1
        if lease is not None:
            if self._closing:
                await self._destroy(lease)
                return
            self._ready[spec].append(lease)
        else:
            self._wakeup.set()
        async with self._ready_changed:
            self._ready_changed.notify_all()

    def _destroy_later(self, lease: Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._destroy(lease))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)

    async def _destroy(self, lease: Lease) -> None:
        try:
            await lease.destroy()
        except Exception:
            log.exception("destroying sandbox %s failed", lease.id)
        self.counters["destroyed"] += 1

    async def _watchdog_loop(self) -> None:
        next_disk_check = time.monotonic() + self.disk_check_interval_s
        while True:
            await asyncio.sleep(self.watchdog_interval_s)
            leases = self._checked_leases()
            if not leases:
                continue
            census = self._given_census.fresh() if needs_census(leases) else Counter()
            if census is None:
                self.counters["own_censuses"] += 1
                census, cpu_s = await asyncio.to_thread(with_thread_cpu, self.backend.census)
                self.counters["watchdog_cpu_s"] += cpu_s
            check_disk = time.monotonic() >= next_disk_check
            if check_disk:
                next_disk_check = time.monotonic() + self.disk_check_interval_s
            breaches, cpu_s = await asyncio.to_thread(with_thread_cpu, find_breaches, [l.sandbox for l in leases],
                                                      census, self.backend.census_kind, check_disk=check_disk)
            self.counters["watchdog_cpu_s"] += cpu_s
            for lease in leases:
                breach = breaches.get(lease.id)
                if breach is None:
                    continue
                lease.lost_limit = breach.cap
                lease.lost_reason = f"{breach.reason}, and was destroyed"
                lease.marked_lost.set()
                log.warning("sandbox %s: %s", lease.id, lease.lost_reason)
                self.counters["watchdog_kills"] += 1
                for queue in self._ready.values():
                    with contextlib.suppress(ValueError):
                        queue.remove(lease)
                await lease.stop_sandbox()

    def take_census(self, census: Counter[int]) -> None:
        """A census of the backend's kind taken elsewhere: the supervisor's one pass over /proc for all the
        workers of a node (each would read every process of the host). Used while fresh, else the watchdog scans."""
        self._given_census.give(census)
        self.counters["given_censuses"] += 1

    def _checked_leases(self) -> list[Lease]:
        """What the watchdog checks: the leases out and the ready ones, none lost yet."""
        return [l for l in (*self._leased.values(), *(l for q in self._ready.values() for l in q)) if not l.lost_reason]

    def stats(self) -> dict[str, Any]:
        return {
            "ready": sum(len(q) for q in self._ready.values()),
            "starting": sum(self._starting.values()),
            "leased": len(self._leased), "destroying": len(self._destroying),
            "memory_caps": self.backend.cgroups.describe() if self.backend.cgroups else "watchdog reading /proc",
            "starts_waiting": self.start_gate.waiting,
            "needs_census": needs_census(self._checked_leases()),
            **self.counters,
        }


def needs_census(leases: Iterable[Lease]) -> bool:
    """Whether a sandbox of ``leases`` reads its backend's node-wide census (``Sandbox.needs_census``):
    Apptainer instances count their own processes."""
    return any(l.sandbox.needs_census for l in leases)


class GivenCensus:
    """A census taken elsewhere (the supervisor's one pass over /proc for all the workers of a
    node), used while fresh; after that the watchdog scans for itself."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._given: tuple[float, Counter[int]] | None = None

    def give(self, census: Counter[int]) -> None:
        self._given = (time.monotonic(), census)

    def fresh(self) -> Counter[int] | None:
        if self._given is None:
            return None
        taken_at, census = self._given
        return census if time.monotonic() - taken_at <= self.max_age_s else None


def check_free_space(folder: Path, needed_mb: int) -> None:
    """SANDBOX_START naming the folder when its disk has less than ``needed_mb`` free."""
    st = os.statvfs(folder)
    free_mb = st.f_bavail * st.f_frsize // 2**20
    if free_mb < needed_mb:
        raise SandboxStartError(
            f"no sandbox started: {folder} has {free_mb} MiB free, under min_free_disk_mb="
            f"{needed_mb}; free space there (old workspaces, logs) or move the run folder")
