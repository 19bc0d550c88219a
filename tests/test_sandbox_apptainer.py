"""Apptainer sandboxes for real: lifecycle, isolation, limits, teardown."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import psutil
import pytest

from proc_support import identities, named, still_running
from support.waits import async_wait_until
from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxLimits, SandboxSpec
from rolloutd.daemon.sandbox.caps import find_breaches
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.native_io.errors import ConfigError

pytestmark = pytest.mark.apptainer


def _instance_list(backend: ApptainerBackend) -> str:
    env = {**os.environ, "APPTAINER_CONFIGDIR": str(backend.config_dir)}
    return subprocess.run(["apptainer", "instance", "list"], env=env, capture_output=True, text=True, check=True).stdout


async def test_lifecycle_and_clean_stop(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    sb = backend.create(SandboxSpec(ipython=False))
    await sb.start()
    assert sb.instance_name in _instance_list(backend)
    assert sb.init_pid is not None and os.path.exists(f"/proc/{sb.init_pid}")
    await sb.stop()
    assert sb.stop_rung in ("sigterm", "sigkill")
    assert sb.instance_name not in _instance_list(backend)
    assert backend.leftover_instances() == []
    assert not list((backend.config_dir / "instances" / "logs").rglob(f"{sb.instance_name}*"))
    assert not sb.lease_dir.exists()


async def test_stop_waits_for_apptainers_instance_monitor(short_tmp: Path) -> None:
    # The monitor above the init is in the sandbox's memory cgroup: still exiting when the cgroup
    # is removed, it was killed there as a straggler, with a warning, about one stop in three.
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    for _ in range(3):
        sb = backend.create(SandboxSpec(ipython=False))
        await sb.start()
        assert sb.init_pid is not None
        monitor = psutil.Process(sb.init_pid).parent()
        assert monitor is not None and " ".join(monitor.cmdline()).startswith("Apptainer instance:")
        await sb.stop()
        with contextlib.suppress(psutil.NoSuchProcess):
            assert monitor.status() == psutil.STATUS_ZOMBIE  # exited; pid 1 reaps it
        await sb.remove_cgroup()


async def test_stop_leaves_no_process_behind(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)), start_kernel=True)
    await lease.run("sleep 300 & (setsid sleep 301 &) ; nohup sleep 302 >/dev/null 2>&1 &")
    seen = identities(lease.sandbox.process_ids())
    assert len(seen) >= 5  # init, shell, kernel, three sleeps
    # The watchdog's cheaper census counts the same processes (none are zombies here).
    assert lease.sandbox.process_count(backend.census()) == len(lease.sandbox.process_ids())
    await lease.destroy()
    assert still_running(seen) == []


async def test_leases_cannot_see_each_other(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    a = await open_lease(backend.create(SandboxSpec(ipython=False)))
    b = await open_lease(backend.create(SandboxSpec(ipython=False)))
    try:
        await a.run("echo secret > /workspace/a.txt && echo tmp > /tmp/a.tmp && echo root > /a.root")
        r = await b.run("ls /workspace /tmp; cat /a.root 2>&1; ps -e | wc -l")
        assert "a.txt" not in r.output and "a.tmp" not in r.output and "No such file" in r.output
        assert (a.sandbox.workspace / "a.txt").read_text() == "secret\n"
    finally:
        await a.destroy()
        await b.destroy()


async def test_host_is_not_visible_or_writable(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    marker = short_tmp / "host-marker"
    marker.write_text("host")
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    try:
        r = await lease.run(f"cat {marker}; echo x > {short_tmp}/escape; ls -A /root /home")
        assert "host" not in r.output.splitlines() and "No such file" in r.output
        assert not (short_tmp / "escape").exists()
        # The host home (with its dotfiles) is not mounted: --containall gives an empty one.
        assert ".bashrc" not in r.output and ".cache" not in r.output
    finally:
        await lease.destroy()


async def test_network_none_has_only_loopback(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    lease = await open_lease(backend.create(SandboxSpec(ipython=False, network=False)))
    try:
        r = await lease.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
        assert r.output.split() == ["lo"]
    finally:
        await lease.destroy()


@pytest.mark.parametrize("writable", ["tmpfs", "overlay"])
async def test_writable_layer(short_tmp: Path, writable: str) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    lease = await open_lease(backend.create(SandboxSpec(ipython=False, writable=writable)))  # type: ignore[arg-type]
    try:
        r = await lease.run("mkdir -p ~/w && echo ok > ~/w/f && cat ~/w/f && echo data > /tmp/x && cat /tmp/x")
        assert r.output == "ok\ndata\n"
    finally:
        await lease.destroy()


async def test_memory_hog_fails_alone(short_tmp: Path) -> None:
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    lease = await open_lease(backend.create(SandboxSpec(ipython=False, limits=SandboxLimits(process_memory_mb=256))))
    try:
        r = await lease.run("python3 -c 'x = bytearray(1 << 30)' 2>&1 | tail -1")
        assert "MemoryError" in r.output
        assert (await lease.run("echo still-here")).output == "still-here\n"
    finally:
        await lease.destroy()


NESTED = 60
NESTED_WAIT_S = 30
"""Named: how long the nested namespace's sleepers may take to start."""


async def test_processes_in_a_nested_pid_namespace_count_towards_max_processes(short_tmp: Path) -> None:
    """A sandbox's processes may make PID namespaces of their own (``unshare -p``). Counted by
    namespace, what ran in those was missed, and a fork bomb there went past max_processes."""
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    lease = await open_lease(backend.create(SandboxSpec(ipython=False, limits=SandboxLimits(max_processes=40))))
    try:
        sb = lease.sandbox
        assert not sb.needs_census
        await lease.run(f"unshare -Urpf sh -c 'for i in $(seq {NESTED}); do sleep 300 & done; wait' >/dev/null 2>&1 &")
        await async_wait_until(lambda: sb.process_count(backend.census()) > NESTED, NESTED_WAIT_S,
                               "the nested namespace's sleepers counted as the sandbox's")
        (breach,) = find_breaches([sb], backend.census(), backend.census_kind, check_disk=False).values()
        assert breach.cap == "max_processes", breach
    finally:
        await lease.destroy()


HOLD_MB = 96
ESCAPE_WAIT_S = 30
"""Named: how long the escaped process may take to start, and to take its memory."""


async def test_memory_taken_outside_a_leavable_cgroup_still_counts(short_tmp: Path) -> None:
    """Where a sandbox's processes could leave its memory cgroup (the seal failed), the watchdog
    also sums their memory from /proc: one that left and then took more than the cap is seen."""
    backend = ApptainerBackend(short_tmp, uncontained_root_ok=True)
    if backend.cgroups is None:
        pytest.skip("no memory cgroup this process may write")
    lease = await open_lease(backend.create(SandboxSpec(ipython=False, limits=SandboxLimits(memory_mb=64))))
    try:
        sb = lease.sandbox
        assert sb.cgroup is not None and not sb.cgroup_leavable
        # It takes its memory once the FIFO is written to, then holds it until the sandbox stops.
        await lease.run("mkfifo /workspace/go && nohup python3 -c \"open('/workspace/go').read()"
                        f"\nx = b'x' * ({HOLD_MB} << 20)\nimport signal\nsignal.pause()\" rld-hold > /dev/null 2>&1 &")
        held = await async_wait_until(lambda: named(sb.process_ids(), "rld-hold"), ESCAPE_WAIT_S,
                                      "the holding process's start")
        # What the sandbox could do itself with a writable cgroup filesystem, done from the host.
        (sb.cgroup.path.parent / "cgroup.procs").write_text(str(held[0].pid))
        await lease.run("echo go > /workspace/go")
        await async_wait_until(lambda: held[0].memory_info().rss >= HOLD_MB << 20, ESCAPE_WAIT_S,
                               f"the escaped process taking {HOLD_MB} MiB")
        assert find_breaches([sb], backend.census(), backend.census_kind, check_disk=False) == {}
        sb.cgroup_leavable = True
        (breach,) = find_breaches([sb], backend.census(), backend.census_kind, check_disk=False).values()
        assert breach.cap == "memory_mb" and "its processes and tmpfs held" in breach.reason, breach
    finally:
        await lease.destroy()


def test_root_is_refused_without_the_opt_in(short_tmp: Path) -> None:
    # Under root, container root is host root even with --userns: a library caller gets an error
    # naming the ways out, not sandboxes that look contained and are not.
    if os.getuid() != 0:
        pytest.skip("the refusal is root's; an ordinary user's sandboxes are contained")
    with pytest.raises(ConfigError, match=r"not contained.*ordinary user.*rolloutd node start.*uncontained_root_ok"):
        ApptainerBackend(short_tmp)
    assert list(short_tmp.iterdir()) == []  # refused before it made anything
