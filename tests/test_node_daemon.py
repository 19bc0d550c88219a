"""The node daemon as real processes: lifecycle, clients, worker crashes, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import uvloop

from daemon_fixtures import CLI, daemon_processes, node_daemon, start_nodes, stop_node
from privilege_probe import PROBE, assert_unprivileged
from support.waits import async_poll, wait_until
from rolloutd.client.async_client import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, AsyncRolloutClient, RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.cli.run_lock import running_pid
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.native_io.errors import (
    CommandTimeout,
    DaemonLost,
    DaemonUnavailable,
    PermissionDenied,
    SandboxLimit,
    SandboxLost,
    WorkerLost,
)

STATS_TIMEOUT_S = 5.0
"""Workers report their pools once a second; a report this late means something is stuck."""
RESTART_TIMEOUT_S = 10.0
"""A killed worker restarts after worker_restart_delay_s and its start-up."""
CENSUS_WAIT_S = 30.0
"""Until the supervisor's census, and then a watchdog kill, show in the workers' once-a-second
reports (their first census waits for both workers to be up, on a loaded node)."""


def test_start_status_stop(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        assert address == f"ipc://{short_tmp}/node.sock"
        assert (short_tmp.stat().st_mode & 0o777) == 0o700
        assert ((short_tmp / "node.sock").stat().st_mode & 0o777) == 0o600
        out = subprocess.run([sys.executable, "-m", "rolloutd.cli.main", "node", "status", "--run-dir",
                              str(short_tmp), "--json"], capture_output=True, text=True, check=True)
        st = json.loads(out.stdout)
        assert len(st["workers"]) == 2 and all(w["ready"] for w in st["workers"])
        assert st["memory_rss_bytes"] > 0 and "sandboxes" in st
        again = subprocess.run([sys.executable, "-m", "rolloutd.cli.main", "node", "start", "--detach",
                                "--run-dir", str(short_tmp)], capture_output=True, text=True)
        assert again.returncode != 0 and "already running" in again.stderr


def test_no_daemon_is_a_clear_error(short_tmp: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="rolloutd node start"):
        RolloutClient(f"ipc://{short_tmp}/node.sock")


def test_sandbox_through_client(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        with RolloutClient(address) as client:
            with client.open_sandbox(ipython=True) as sb:
                r = sb.run("cd /tmp && echo hi && pwd")
                assert (r.exit_code, r.output) == (0, "hi\n/tmp\n")
                assert sb.run("pwd").output == "/tmp\n"
                assert sb.ipython("21 * 2").result == "42"
                with pytest.raises(CommandTimeout):
                    sb.run("sleep 30", timeout_s=0.5)
                assert sb.run("echo alive").output == "alive\n"
            with pytest.raises(SandboxLost):
                sb.run("echo closed")


async def test_many_concurrent_clients(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "2") as address:
        async def one(i: int) -> str:
            async with AsyncRolloutClient(address) as c:
                async with await c.open_sandbox(ipython=False) as sb:
                    outs = [(await sb.run(f"echo {i}-{k}")).output for k in range(5)]
                    return "".join(outs)

        results = await asyncio.gather(*(one(i) for i in range(12)))
        assert results == ["".join(f"{i}-{k}\n" for k in range(5)) for i in range(12)]
        async with AsyncRolloutClient(address) as c:
            # Workers report their pools once a second: the last closes show up within that.
            st = await async_poll(c.status, lambda st: st["sandboxes"]["leased"] == 0, STATS_TIMEOUT_S,
                                  "every sandbox back from lease in the workers' reports")
        assert st["counters"]["errors"] == 0


@pytest.mark.parametrize("worker_links", [True, False], ids=["worker-links", "through-node"])
async def test_worker_killed_with_requests_in_flight(short_tmp: Path, worker_links: bool) -> None:
    """Commands on the worker's own links or through the supervisor: each pending one is answered
    WORKER_LOST (by the client when its link closes, by the supervisor otherwise)."""
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        async with AsyncRolloutClient(address, worker_links=worker_links) as c:
            boxes = [await c.open_sandbox(ipython=False) for _ in range(4)]
            assert all(bool(sb.info.get("link")) for sb in boxes)  # offered either way; the client chooses
            st = await c.status()
            victim = st["workers"][0]
            running = [asyncio.ensure_future(sb.run("sleep 20")) for sb in boxes]
            await async_poll(c.status, lambda st: st["workers"][0]["in_flight"] == len(boxes), STATS_TIMEOUT_S,
                             "every run handed to the victim worker")
            os.kill(victim["pid"], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 20)
            # The least busy worker took each open in turn, so all four sandboxes are the victim's:
            # each run must be answered WORKER_LOST, nothing else.
            assert all(isinstance(r, WorkerLost) for r in results), results
            st = await async_poll(c.status, lambda st: all(w["ready"] for w in st["workers"])
                                  and st["workers"][0]["generation"] == 1, RESTART_TIMEOUT_S, "the victim restarted")
            assert st["workers"][0]["generation"] == 1 and st["workers"][0]["pid"] != victim["pid"]
            # The supervisor answered those it carried; a link's are the client's own answers.
            assert st["counters"]["worker_lost"] == (0 if worker_links else len(boxes))
            async with await c.open_sandbox(ipython=False) as fresh:
                assert (await fresh.run("echo back")).output == "back\n"
            for sb in boxes:
                with pytest.raises(SandboxLost):
                    await sb.run("echo gone")


def test_debug_operations_are_refused_unless_the_node_turns_them_on(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "0") as address:
        with RolloutClient(address) as client:
            for op, args in (("debug.sleep", {"seconds": 0}), ("debug.make_arrays", {"n_tokens": 10})):
                with pytest.raises(PermissionDenied, match=r"debug operation.*--debug-ops.*debug_ops = true"):
                    client.request(op, args)
            assert len(client.status()["workers"]) == 1  # the daemon keeps serving


def test_stop_leaves_nothing_even_when_killed(short_tmp: Path) -> None:
    """A daemon that cannot shut down by itself (frozen, so SIGTERM waits) is SIGKILLed by the
    stop ladder, and still leaves no process, sandbox, segment or socket."""
    (address,) = start_nodes([short_tmp], "--backend", "local", "--workers", "2", "--warm", "1", "--debug-ops")
    pid = int((short_tmp / "node.pid").read_text())
    with RolloutClient(address) as client:
        sb = client.open_sandbox(ipython=True)
        sb.run("sleep 100 &")
        reply = client.request("debug.make_arrays", {"n_tokens": 1000})
        assert reply.segments
    assert len(daemon_processes(pid)) >= 3
    os.kill(pid, signal.SIGSTOP)
    stop_node(short_tmp, [pid], rung="sigkill", timeout_s=1.0)


@pytest.mark.apptainer
def test_apptainer_sandbox_through_daemon(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as client:
            with client.open_sandbox(ipython=True) as sb:
                assert sb.info["isolated"] and sb.info["backend"] == "apptainer"
                assert sb.run("cat /etc/os-release | head -1").output.startswith('PRETTY_NAME="Debian')
                assert sb.ipython("import sys; sys.version_info[0]").result == "3"


@pytest.mark.parametrize("backend,census", [pytest.param("apptainer", False, marks=pytest.mark.apptainer),
                                             ("local", True)])
def test_fork_bomb_is_stopped_by_the_watchdog(short_tmp: Path, backend: str, census: bool) -> None:
    # RLIMIT_NPROC stops the forks a little past the cap; the watchdog ends the sandbox. Local
    # sandboxes are counted by session, in the census the supervisor takes once for all workers;
    # an Apptainer instance counts its own /proc, and no census is taken.
    with node_daemon(short_tmp, "--backend", backend, "--workers", "2", "--warm", "1") as address:
        with RolloutClient(address) as client:
            def counted(name: str) -> list[int]:
                return [w["pool"][name] for w in client.status()["workers"]]

            with client.open_sandbox(ipython=False) as sb:
                if census:
                    # Workers scan /proc alone until the supervisor's first census reaches them.
                    wait_until(lambda: len(given := counted("given_censuses")) == 2 and min(given) > 0, CENSUS_WAIT_S,
                               "both workers reporting a census from the supervisor")
                before = sum(counted("own_censuses"))
                with pytest.raises(SandboxLost):
                    # 600 sleepers, over the default limit of 512; the sandbox is destroyed under it.
                    sb.run("for i in $(seq 600); do sleep 60 & done; wait", timeout_s=60)
                with pytest.raises(SandboxLimit, match="max_processes"):
                    sb.run("echo hi")
                # Workers report their counters once a second: the report that holds the kill
                # holds the scans made up to it.
                wait_until(lambda: sum(counted("watchdog_kills")) == 1, CENSUS_WAIT_S,
                           "the kill in the workers' report")
                assert sum(counted("own_censuses")) - before <= 1, "the workers scanned /proc themselves"
                if not census:
                    assert sum(counted("given_censuses")) == sum(counted("own_censuses")) == 0
            assert sum(counted("watchdog_kills")) == 1


def _supervisor(run_dir: Path) -> int:
    pid = running_pid(run_dir, "node")
    assert pid is not None, f"no node daemon holds {run_dir}"
    return pid


async def _running(command: str, count: int, timeout_s: float = 30.0) -> None:
    """Until ``count`` processes run exactly ``command`` (so a call is under way, not just sent)."""
    async with asyncio.timeout(timeout_s):
        while sum(" ".join(p.info["cmdline"] or []) == command for p in psutil.process_iter(["cmdline"])) < count:
            await asyncio.sleep(0.05)


async def _lost_within(call: asyncio.Task[object], limit_s: float) -> float:
    """Seconds until ``call`` failed with DaemonLost; fails the test past ``limit_s``."""
    started = time.monotonic()
    with pytest.raises(DaemonLost, match="went away"):
        await asyncio.wait_for(call, limit_s)
    return time.monotonic() - started


def test_a_killed_daemon_fails_every_pending_call_with_daemon_lost(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1", stop_rung=None) as address:
        async def scenario() -> None:
            async with AsyncRolloutClient(address) as client:  # default timeouts: 600 s and more
                sb = await client.open_sandbox(ipython=False)
                running = asyncio.create_task(sb.run("sleep 300"))
                slow = {"type": "command", "instance_id": "slow-setup", "setup_script": "sleep 300",
                        "eval_script": "echo 1"}
                (rid,) = await client.submit([RolloutRequest(task=slow)])
                await _running("sleep 300", 2)  # the command and the rollout's set-up both run
                assert not running.done()
                os.kill(_supervisor(short_tmp), signal.SIGKILL)
                await _lost_within(running, 10.0)
                async with asyncio.timeout(10.0):  # named: the rollout's result comes as promptly
                    results = [r async for r in client.as_completed([rid])]
                assert isinstance(results[0].error, DaemonLost)

        uvloop.run(scenario())


def test_a_frozen_daemon_is_lost_after_the_heartbeat_timeout_and_found_again(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "1", "--warm", "1") as address:
        pid = _supervisor(short_tmp)

        async def scenario() -> None:
            async with AsyncRolloutClient(address) as client:
                sb = await client.open_sandbox(ipython=False)
                running = asyncio.create_task(sb.run("sleep 300"))
                await _running("sleep 300", 1)
                os.kill(pid, signal.SIGSTOP)
                try:
                    waited = await _lost_within(running, HEARTBEAT_TIMEOUT_MS / 1000 + 15.0)
                finally:
                    os.kill(pid, signal.SIGCONT)
                assert waited >= HEARTBEAT_IVL_MS / 1000  # by the heartbeat, not by a closed connection
                assert (await client.status(timeout_s=30))["pid"] == pid  # the same client reconnects

        uvloop.run(scenario())


@pytest.mark.apptainer
def test_a_start_reaps_the_instances_a_killed_daemon_left(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as client:
            sb = client.open_sandbox(ipython=False)
            sb.run("sleep 300 >/dev/null 2>&1 &")
            sb.run("echo started")
        states = workers_dir(NodeConfig(run_dir=str(short_tmp)))
        instance = psutil.Process(int(next(states.glob("*/*/instance.pid")).read_text()))
        doomed = daemon_processes(_supervisor(short_tmp))
        for proc in doomed:  # the supervisor and its workers at once: nobody is left to clean up
            with contextlib.suppress(psutil.NoSuchProcess):  # a worker that saw its parent die first
                proc.kill()
        psutil.wait_procs(doomed, timeout=10)
        assert instance.is_running(), "the instance should outlive a killed daemon (it is its own process)"
        restart = subprocess.run([*CLI, "node", "start", "--detach", "--run-dir", str(short_tmp), "--backend",
                                  "apptainer", "--workers", "1", "--warm", "0"], capture_output=True, text=True,
                                 timeout=180)
        assert restart.returncode == 0, restart.stderr[-3000:]
        psutil.wait_procs([instance], timeout=10)
        assert not instance.is_running()
        assert "reaped" in (short_tmp / "node.log").read_text()
    # node_daemon's exit stops the new daemon and checks that nothing is left


@pytest.mark.apptainer
def test_sandboxes_of_a_root_daemon_hold_no_host_privilege(short_tmp: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("covered by test_unprivileged for an ordinary user; this is the root daemon's case")
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as client, client.open_sandbox(ipython=False) as sb:
            output = sb.run(PROBE).output
            worker_uids = {psutil.Process(w["pid"]).uids().real for w in client.status()["workers"]}
    user = pwd.getpwnam(NodeConfig().sandbox_user)
    assert worker_uids == {user.pw_uid}
    assert_unprivileged(output, user.pw_uid)
