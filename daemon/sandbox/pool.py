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
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rolloutd.native_io.errors import SandboxLost, SandboxStartError, SessionError
from rolloutd.native_io.procfs import CENSUS_INTERVAL_S

from .base import SandboxBackend, SandboxSpec
from .caps import find_breaches, with_thread_cpu
from .lease import Lease, open_lease
from .start_gate import StartGate, StartGateConfig

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
"""A returned sandbox's shell must answer ``:`` this fast to be leased again."""

DISK_CHECK_INTERVAL_S = 5.0


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
