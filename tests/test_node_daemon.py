"""The node daemon as real processes: lifecycle, clients, worker crashes, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_fixtures import daemon_processes, node_daemon
from rolloutd.client.async_client import AsyncRolloutClient
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.errors import CommandTimeout, DaemonUnavailable, SandboxLost, WorkerLost


def test_start_status_stop(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        assert address == f"ipc://{short_tmp}/node.sock"
        assert (short_tmp.stat().st_mode & 0o777) == 0o700
        assert ((short_tmp / "node.sock").stat().st_mode & 0o777) == 0o600
        out = subprocess.run([sys.executable, "-m", "rolloutd.daemon.cli", "node", "status", "--run-dir",
                              str(short_tmp), "--json"], capture_output=True, text=True, check=True)
        st = json.loads(out.stdout)
        assert len(st["workers"]) == 2 and all(w["ready"] for w in st["workers"])
        assert st["memory_rss_bytes"] > 0 and "sandboxes" in st
        again = subprocess.run([sys.executable, "-m", "rolloutd.daemon.cli", "node", "start", "--detach",
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
            st = await c.status()
        assert st["counters"]["errors"] == 0 and st["sandboxes"]["leased"] == 0


async def test_worker_killed_with_requests_in_flight(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        async with AsyncRolloutClient(address) as c:
            boxes = [await c.open_sandbox(ipython=False) for _ in range(4)]
            st = await c.status()
            victim = st["workers"][0]
            running = [asyncio.ensure_future(sb.run("sleep 20")) for sb in boxes]
            await asyncio.sleep(0.5)
            os.kill(victim["pid"], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 20)
            lost = [r for r in results if isinstance(r, WorkerLost)]
            assert lost, f"no request reported WORKER_LOST: {results}"
            assert all(isinstance(r, (WorkerLost, BaseException)) or r.exit_code == 0 for r in results)
            for _ in range(100):
                st = await c.status()
                if all(w["ready"] for w in st["workers"]) and st["workers"][0]["generation"] == 1:
                    break
                await asyncio.sleep(0.1)
            assert st["workers"][0]["generation"] == 1 and st["workers"][0]["pid"] != victim["pid"]
            assert st["counters"]["worker_lost"] == len(lost)
            async with await c.open_sandbox(ipython=False) as fresh:
                assert (await fresh.run("echo back")).output == "back\n"
            for sb, r in zip(boxes, results):
                if isinstance(r, WorkerLost):
                    with pytest.raises(SandboxLost):
                        await sb.run("echo gone")


def test_stop_leaves_nothing_even_when_killed(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "local", "--workers", "2", "--warm", "1") as address:
        with RolloutClient(address) as client:
            sb = client.open_sandbox(ipython=True)
            sb.run("sleep 100 &")
            reply = client.request("debug.make_arrays", {"n_tokens": 1000})
            assert reply.segments
        pid = int((short_tmp / "node.pid").read_text())
        assert len(daemon_processes(pid)) >= 3
    # node_daemon's exit asserted: no process, socket or segment remains


@pytest.mark.apptainer
def test_apptainer_sandbox_through_daemon(short_tmp: Path) -> None:
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "1", "--warm", "1") as address:
        with RolloutClient(address) as client:
            with client.open_sandbox(ipython=True) as sb:
                assert sb.info["isolated"] and sb.info["backend"] == "apptainer"
                assert sb.run("cat /etc/os-release | head -1").output.startswith('PRETTY_NAME="Debian')
                assert sb.ipython("import sys; sys.version_info[0]").result == "3"


@pytest.mark.apptainer
def test_fork_bomb_is_stopped_by_the_supervisors_census(short_tmp: Path) -> None:
    # Running as root, RLIMIT_NPROC does not apply: only the watchdog stops this, and on a node it
    # counts with the census the supervisor takes once for all workers.
    with node_daemon(short_tmp, "--backend", "apptainer", "--workers", "2", "--warm", "1") as address:
        with RolloutClient(address) as client:
            def own_censuses() -> int:
                return sum(w["pool"]["own_censuses"] for w in client.status()["workers"])

            with client.open_sandbox(ipython=False) as sb:
                time.sleep(3)  # until the supervisor's census flows (workers scan alone before it)
                before = own_censuses()
                with pytest.raises(SandboxLost):
                    # 600 sleepers, over the default limit of 512; the sandbox is destroyed under it.
                    sb.run("for i in $(seq 600); do sleep 60 & done; wait", timeout_s=60)
                with pytest.raises(SandboxLost, match="max_processes"):
                    sb.run("echo hi")
                time.sleep(1.5)  # workers report their counters once a second
                assert own_censuses() - before <= 1, "the workers scanned /proc themselves"
            assert sum(w["pool"]["watchdog_kills"] for w in client.status()["workers"]) == 1
