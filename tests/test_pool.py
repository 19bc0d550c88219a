"""Warm pool: ready leases, fresh sandbox per lease, limits watchdog, clean shutdown."""

from __future__ import annotations

import asyncio
from collections import Counter
import os
import subprocess
import time
from pathlib import Path

import pytest
from support.descriptors import descriptor_targets
from support.waits import async_wait_until

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxLimits, SandboxSpec
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.native_io.errors import SandboxLost, SandboxStartError, SessionError

WAIT_S = 30.0
"""How long a test waits for a state of the pool or its sandboxes (a shell's exit, processes started, a watchdog round): generous, for a loaded node."""


async def test_lease_comes_warm_and_is_fresh(backend: SandboxBackend) -> None:
    spec = SandboxSpec(ipython=True)
    pool = WarmPool(backend, warm_specs={spec: 2})
    await pool.start()
    try:
        await pool.wait_ready(120)
        first = await pool.lease(spec)
        await first.run("echo from-first > leftover.txt")
        await first.ipython("leftover = 1")
        await pool.release(first)
        second = await pool.lease(spec)
        assert second.id != first.id
        r = await second.run("ls")
        assert "leftover.txt" not in r.output
        assert (await second.ipython("'leftover' in dir()")).result == "False"
        assert pool.counters["cold_starts"] == 0
        await pool.release(second)
    finally:
        await pool.close()
    assert pool.stats()["ready"] == 0 and pool.stats()["leased"] == 0


@pytest.mark.parametrize("start_kernels", [False, True])
async def test_warm_kernels_only_when_asked(backend: SandboxBackend, start_kernels: bool) -> None:
    spec = SandboxSpec(ipython=True)
    pool = WarmPool(backend, warm_specs={spec: 1}, start_kernels=start_kernels)
    await pool.start()
    try:
        await pool.wait_ready(120)
        lease = await pool.lease(spec)
        assert (lease.kernel is not None and lease.kernel.alive) is start_kernels
        assert (await lease.ipython("6 * 7")).result == "42"
        assert (lease.kernel_start_s > 0) is not start_kernels  # what the first cell waited for
        await pool.release(lease)
    finally:
        await pool.close()


async def test_without_warm_kernels_one_warm_spec_serves_leases_with_and_without_ipython(
        backend: SandboxBackend) -> None:
    pool = WarmPool(backend, warm_specs={SandboxSpec(ipython=True): 2})
    await pool.start()
    try:
        await pool.wait_ready(120)
        with_kernel, without = await pool.lease(SandboxSpec(ipython=True)), await pool.lease(SandboxSpec(ipython=False))
        assert pool.counters["cold_starts"] == 0
        assert (await with_kernel.ipython("6 * 7")).result == "42"
        with pytest.raises(SessionError, match="no IPython kernel"):
            await without.ipython("1")
        assert without.kernel is None
        await pool.release(with_kernel)
        await pool.release(without)
    finally:
        await pool.close()


async def test_unknown_spec_starts_cold(backend: SandboxBackend) -> None:
    pool = WarmPool(backend, warm_specs={})
    await pool.start()
    try:
        lease = await pool.lease(SandboxSpec(ipython=False))
        assert pool.counters["cold_starts"] == 1
        assert (await lease.run("echo cold")).output == "cold\n"
    finally:
        await pool.close()


async def test_dead_ready_lease_is_replaced(backend: SandboxBackend) -> None:
    spec = SandboxSpec(ipython=False)
    pool = WarmPool(backend, warm_specs={spec: 1})
    await pool.start()
    try:
        await pool.wait_ready(60)
        broken = pool._ready[spec][0]
        assert broken.shell.pid is not None
        os.killpg(broken.shell.pid, 9)
        await async_wait_until(lambda: not broken.shell.alive, WAIT_S, "the killed shell seen to exit")
        lease = await pool.lease(spec)
        assert lease.id != broken.id
        assert (await lease.run("echo ok")).output == "ok\n"
    finally:
        await pool.close()


async def test_max_age_recycles_idle_sandboxes(backend: SandboxBackend) -> None:
    spec = SandboxSpec(ipython=False)
    pool = WarmPool(backend, warm_specs={spec: 1}, max_age_s=0.5)
    await pool.start()
    try:
        await pool.wait_ready(60)
        old = pool._ready[spec][0]
        await async_wait_until(lambda: time.monotonic() - old.created_at > pool.max_age_s, WAIT_S,
                               "the warm sandbox older than max_age_s")
        lease = await pool.lease(spec)
        assert lease.id != old.id and pool.counters["recycled_old"] >= 1
    finally:
        await pool.close()


async def test_fork_bomb_is_contained(backend: SandboxBackend) -> None:
    spec = SandboxSpec(ipython=False, limits=SandboxLimits(max_processes=40))
    pool = WarmPool(backend, warm_specs={}, watchdog_interval_s=0.2)
    await pool.start()
    try:
        victim = await pool.lease(spec)
        bystander = await pool.lease(spec)
        # A bounded bomb: 200 long sleepers, far over the limit of 40.
        with pytest.raises(SandboxLost):
            await victim.run("for i in $(seq 200); do sleep 60 & done; wait", timeout_s=20)
        # The command fails as soon as the lease is marked lost; its stop may still be killing.
        await asyncio.wait_for(victim.sandbox_stopped.wait(), timeout=30)
        assert victim.lost_reason and "max_processes" in victim.lost_reason
        with pytest.raises(SandboxLost):
            await victim.run("echo hi")
        assert victim.sandbox.process_ids() == []
        assert (await bystander.run("echo unaffected")).output == "unaffected\n"
        assert pool.counters["watchdog_kills"] == 1
    finally:
        await pool.close()


async def test_stop_kills_what_is_still_forking(backend: SandboxBackend) -> None:
    # The lease's shell keeps starting sleepers while the sandbox is stopped: nothing it started,
    # before or during the stop, may outlive it.
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    try:
        await lease.run("(while :; do sleep 60 & done) >/dev/null 2>&1 &", timeout_s=10)
        await async_wait_until(lambda: len(lease.sandbox.process_ids()) > 5, WAIT_S, "the shell forking sleepers")
        await lease.sandbox.stop()
        assert lease.sandbox.process_ids() == []
    finally:
        await lease.destroy()


async def test_a_released_lease_holds_no_file_open_when_its_folders_are_removed(backend: SandboxBackend) -> None:
    # A file removed while this process holds it open is freed by the last close, on the event
    # loop; closed first, rm frees it in its own process.
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))
    lease_dir = lease.sandbox.lease_dir
    held_at_removal: list[list[str]] = []
    remove_folders = lease.sandbox.remove_folders

    async def remove_folders_noting_open_files() -> None:
        held_at_removal.append(_open_files_under(lease_dir))
        await remove_folders()

    lease.sandbox.remove_folders = remove_folders_noting_open_files  # type: ignore[method-assign]
    try:
        assert (await lease.run("echo hi")).output.strip() == "hi"
        assert (await lease.ipython("6 * 7")).result == "42"
        assert _open_files_under(lease_dir), "the shell's command file is held open while the lease lives"
    finally:
        await lease.destroy()
    assert held_at_removal == [[]]
    assert not lease_dir.exists()


def _open_files_under(folder: Path) -> list[str]:
    """The files and folders under ``folder`` that this process holds open."""
    return [t for t in descriptor_targets() if Path(t.removesuffix(" (deleted)")).is_relative_to(folder)]


async def test_watchdog_uses_a_given_census_while_fresh(backend: SandboxBackend) -> None:
    # What a node's supervisor sends: one census for every worker. A census that says the lease's
    # processes are far over its limit must be acted on without a scan of the pool's own.
    spec = SandboxSpec(ipython=False, limits=SandboxLimits(max_processes=40))
    pool = WarmPool(backend, warm_specs={}, watchdog_interval_s=0.05)
    await pool.start()
    try:
        lease = await pool.lease(spec)
        if not lease.sandbox.needs_census:
            assert not pool.stats()["needs_census"]
            pytest.skip(f"{backend.name} sandboxes count their own processes")
        assert pool.stats()["needs_census"]
        assert lease.sandbox.process_count(backend.census()) < 40
        over = Counter({key: 1000 for key in backend.census()})

        def lost_under_a_fresh_census() -> str | None:
            pool.take_census(over)  # kept fresh, as the supervisor sends one every interval
            return lease.lost_reason

        await async_wait_until(lost_under_a_fresh_census, WAIT_S, "the watchdog acting on the given census")
        assert lease.lost_reason and "max_processes" in lease.lost_reason
        assert pool.counters["own_censuses"] == 0
        healthy = await pool.lease(spec)
        # No census given any more: once the last one is stale the watchdog counts for itself.
        await async_wait_until(lambda: pool.counters["own_censuses"] > 0, WAIT_S, "the watchdog's own census")
        assert not healthy.lost_reason
    finally:
        await pool.close()


async def test_the_watchdog_reports_the_cpu_its_checks_take(backend: SandboxBackend) -> None:
    pool = WarmPool(backend, warm_specs={}, watchdog_interval_s=0.05)
    t0 = time.monotonic()
    await pool.start()
    try:
        await pool.lease(SandboxSpec(ipython=False))
        await async_wait_until(lambda: pool.counters["watchdog_cpu_s"] > 0, WAIT_S, "a watchdog round timed")
        # Its own thread's time over the rounds, not the process's: less than their wall time.
        assert pool.counters["watchdog_cpu_s"] < time.monotonic() - t0
        assert pool.stats()["watchdog_cpu_s"] == pool.counters["watchdog_cpu_s"]
    finally:
        await pool.close()


async def test_a_full_disk_is_a_clear_error_before_a_sandbox_starts(short_tmp: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    state = short_tmp / "small"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(state)], check=True)
    try:
        pool = WarmPool(LocalBackend(state), warm_specs={})
        await pool.start()
        try:
            with pytest.raises(SandboxStartError, match="min_free_disk_mb=64"):
                await pool.lease(SandboxSpec(ipython=False, limits=SandboxLimits(min_free_disk_mb=64)))
            lease = await pool.lease(SandboxSpec(ipython=False, limits=SandboxLimits(min_free_disk_mb=4)))
            assert (await lease.run("echo fits")).output == "fits\n"
            await pool.release(lease)
        finally:
            await pool.close()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=True)
