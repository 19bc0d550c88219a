"""Per-sandbox caps (memory, workspace disk, tmpfs) hold as root and as an ordinary user; a sandbox
over one is ended with SANDBOX_LIMIT naming it, and the others are untouched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from caps_smoke import MEMORY_MB, WORKSPACE_MB
from daemon_fixtures import node_daemon
from os_users import run_json_script
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.cli.run_lock import running_pid
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.daemon.sandbox import ns_mounts
from rolloutd.daemon.sandbox.apptainer import NS_MOUNTS_SCRIPT
from rolloutd.native_io.errors import SandboxLimit

SCRIPT = Path(__file__).with_name("caps_smoke.py")
TMPFS_MB = 64
"""Apptainer's ``sessiondir max size`` (apptainer.conf): the writable tmpfs of a sandbox."""
EXIT_WAIT_S = 30
"""Named: how long killed sandbox processes may take to exit."""


def _smoke(backend: str, as_user: bool) -> dict[str, object]:
    return run_json_script(SCRIPT, backend, as_user=as_user)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", [pytest.param("apptainer", marks=pytest.mark.apptainer), "local"])
@pytest.mark.parametrize("who", ["root", "ordinary user"])
def test_a_sandbox_over_a_cap_is_ended_naming_it_and_no_other(backend: str, who: str) -> None:
    if who == "root" and os.getuid() != 0:
        pytest.skip("the root case needs root (CI runs as root)")
    seen = _smoke(backend, as_user=who == "ordinary user")
    memory, workspace = seen["memory"], seen["workspace"]
    assert memory["error"] == "SANDBOX_LIMIT" and memory["cap"] == "memory_mb", memory
    assert f"memory cap of {MEMORY_MB} MiB (memory_mb)" in memory["message"]
    if seen["cgroup"]:  # the kernel held it to the cap and killed the allocation
        assert "the kernel killed" in memory["message"]
    else:  # the watchdog saw it over the cap in /proc
        assert "its processes and tmpfs held" in memory["message"]
    assert workspace["error"] == "SANDBOX_LIMIT" and workspace["cap"] == "workspace_mb", workspace
    if backend == "apptainer":  # a hard cap: the kernel refused the writes past it, the sandbox was full
        assert f"filled its /workspace to its cap of {WORKSPACE_MB} MiB (workspace_mb)" in workspace["message"]
        error, code, used_kib, filesystem = seen["enospc"].splitlines()
        assert error == "head: error writing 'standard output': No space left on device" and code == "exit 1", seen["enospc"]
        assert int(used_kib) <= WORKSPACE_MB * 1024 and filesystem.split() == ["tmpfs", str(WORKSPACE_MB * 1024)]
    else:  # a host folder, walked: seen past the cap
        assert f"over its cap of {WORKSPACE_MB} MiB (workspace_mb)" in workspace["message"]
    # One file can never pass the cap: the write is stopped there (SIGXFSZ: exit 128 + 25).
    assert seen["one_big_file"] == ["exit", "153", str(WORKSPACE_MB * 2**20)]
    if backend == "apptainer":  # its own /dev/shm, a tmpfs the size of the host's, counts as memory
        assert seen["shm"]["error"] == "SANDBOX_LIMIT" and seen["shm"]["cap"] == "memory_mb", seen["shm"]
    assert seen["bystander"] == "unaffected\n"
    passed = dict(seen["caps_passed"])
    # The file stopped at the cap, plus its folder's own blocks, may be seen over it: ended too.
    assert passed.pop("one_big_file") in (None, "workspace_mb") and passed.pop("bystander") is None
    assert set(passed.values()) == {"memory_mb", "workspace_mb"}
    assert seen["watchdog_kills"] == sum(v is not None for v in seen["caps_passed"].values())
    assert seen["cgroup_left"] is False and seen["state_left"] == []
    if who == "root":
        assert seen["cgroup"], "root may write its memory cgroup: the cap must be the kernel's"


@pytest.mark.apptainer
def test_caps_hold_for_the_sandboxes_of_a_root_daemon(short_tmp: Path) -> None:
    """As root the workers run as the sandbox user: the supervisor hands them a memory cgroup,
    and Apptainer's tmpfs cap applies to that user's sandboxes."""
    if os.getuid() != 0:
        pytest.skip("the root daemon's case; test_a_sandbox_over_a_cap_... covers an ordinary user")
    env = {"ROLLOUTD_SANDBOX_MEMORY_MB": str(MEMORY_MB), "ROLLOUTD_SANDBOX_WORKSPACE_MB": str(WORKSPACE_MB),
           "ROLLOUTD_SANDBOX_DISK_CHECK_INTERVAL_S": "0.2"}
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "0", env=env) as address:
        with RolloutClient(address) as client:
            with client.open_sandbox(ipython=False) as bystander, client.open_sandbox(ipython=False) as sb:
                cgroup = sb.run("grep memory /proc/self/cgroup").output
                assert "/rolloutd-" in cgroup and "/sb-" in cgroup, cgroup
                (worker,) = client.status()["workers"]
                assert worker["pool"]["memory_caps"].startswith("cgroup v1 ") and "/rolloutd-" in worker["pool"]["memory_caps"]
                tmpfs = sb.run(f"head -c {2 * TMPFS_MB}M /dev/zero > /tmp/big; echo \"exit $?\"; stat -c %s /tmp/big")
                code, size = tmpfs.output.split()[-2:]
                assert code != "0" and int(size) <= TMPFS_MB * 2**20, tmpfs.output
                # The sandbox user's instances have the hard cap too (the smoke sees its ENOSPC).
                assert sb.run("df -k --output=fstype,size /workspace | tail -1").output.split() == [
                    "tmpfs", str(WORKSPACE_MB * 1024)]
                with pytest.raises(SandboxLimit, match=r"memory cap of 128 MiB \(memory_mb\)"):
                    sb.run(f"python3 -c \"x = b'x' * ({4 * MEMORY_MB} << 20)\"; sleep 60", timeout_s=90)
                with client.open_sandbox(ipython=False) as filler:
                    with pytest.raises(SandboxLimit, match=r"filled its /workspace to its cap of 32 MiB \(workspace_mb\)"):
                        filler.run("for i in $(seq 16); do head -c 8M /dev/zero > f$i || break; done; sleep 60",
                                   timeout_s=90)
                assert bystander.run("echo unaffected").output == "unaffected\n"


@pytest.mark.apptainer
def test_a_sandbox_cannot_leave_its_memory_cgroup(short_tmp: Path) -> None:
    """Apptainer shows the host's cgroup filesystem, and a sandbox's processes run as the user that
    owns its cgroup, its siblings' and the folder the root daemon delegated: unsealed, one could
    move itself out from under its memory cap. Sealed, it still reads its own limit."""
    if os.getuid() != 0:
        pytest.skip("the root daemon's case: it delegates a memory cgroup to the sandbox user")
    env = {"ROLLOUTD_SANDBOX_MEMORY_MB": str(MEMORY_MB)}
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "0", env=env) as address:
        with RolloutClient(address) as client:
            with client.open_sandbox(ipython=False) as sibling, client.open_sandbox(ipython=False) as sb:
                own = sb.run("grep :memory: /proc/self/cgroup | cut -d: -f3").output.strip()
                other = sibling.run("grep :memory: /proc/self/cgroup | cut -d: -f3").output.strip()
                assert "/sb-" in own and "/sb-" in other and own != other, (own, other)
                root = "/sys/fs/cgroup/memory"
                assert sb.run(f"cat {root}{own}/memory.limit_in_bytes").output == f"{MEMORY_MB << 20}\n"
                for target in (own.rsplit("/", 1)[0], other):
                    moved = sb.run(f"sh -c 'echo $$ > {root}{target}/cgroup.procs && grep :memory: /proc/self/cgroup'")
                    assert moved.exit_code != 0 and "Read-only file system" in moved.output, moved.output
                # A namespace of its own inherits the read-only mounts locked.
                undone = sb.run(f"unshare -Urm sh -c 'mount -o remount,bind,rw {root} && echo $$ > {root}{own}/../cgroup.procs'")
                assert undone.exit_code != 0, undone.output
                assert sb.run("grep :memory: /proc/self/cgroup | cut -d: -f3").output.strip() == own
                (worker,) = client.status()["workers"]
                assert worker["pool"]["memory_caps"].startswith("cgroup v1 ")


def test_the_mount_helper_reads_its_arguments_or_reports_both_mounts_failed() -> None:
    assert ns_mounts.parse_args(["12"]) == (12, None, False)
    assert ns_mounts.parse_args(["12", "--workspace", "/workspace", "64", "--seal-cgroups"]) == (
        12, ("/workspace", 64), True)
    assert ns_mounts.parse_args(["--seal-cgroups", "12"]) == (12, None, True)
    for bad in ([], ["x"], ["12", "13"], ["12", "--workspace", "/w"], ["12", "--workspace", "/w", "big"],
                ["12", "--seal"]):
        with pytest.raises(ValueError):
            ns_mounts.parse_args(bad)
    # As the sandbox starts it: an exit that clears neither failure bit would read as both mounts made.
    run = subprocess.run([sys.executable, "-I", "-S", str(NS_MOUNTS_SCRIPT), "12", "--workspace"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == ns_mounts.WORKSPACE_FAILED + ns_mounts.SEAL_FAILED and "usage" in run.stderr, run


@pytest.mark.apptainer
def test_a_root_daemons_memory_cgroups_are_removed_even_after_a_kill(short_tmp: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("only a root daemon makes a memory cgroup for its workers")
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "1", stop_rung=None) as address:
        with RolloutClient(address) as client:
            deadline = time.monotonic() + 60  # named: until the warm sandbox is up, in its own cgroup
            while client.status()["sandboxes"]["ready"] < 1:
                assert time.monotonic() < deadline, "the warm sandbox did not start within 60 s"
                time.sleep(0.1)
            (worker,) = client.status()["workers"]
            folder = Path(worker["pool"]["memory_caps"].split(" ", 2)[2])
            (sandbox,) = [p for p in folder.iterdir() if p.is_dir()]
            assert sandbox.name.startswith("sb-")
            members = [psutil.Process(int(pid)) for pid in (sandbox / "cgroup.procs").read_text().split()]
        for pid in (worker["pid"], running_pid(short_tmp, "node")):  # nobody left to stop the sandbox
            os.kill(pid, signal.SIGKILL)
        # Without its state folder no other record names the warm sandbox: its cgroup still does.
        shutil.rmtree(workers_dir(NodeConfig(run_dir=str(short_tmp))))
    # node_daemon's exit ran `node stop`, which cleans up after a dead daemon
    assert not folder.exists() and not (short_tmp / "memory-cgroup").exists()
    # Killed, each is gone once it exits: the namespace's init (appinit) leaves the cgroup first and
    # then waits for the namespace's other processes to be reaped by the host's init.
    _, alive = psutil.wait_procs(members, timeout=EXIT_WAIT_S)
    assert members and not [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
