"""Starting real node daemons and routers (separate processes) for tests, and stopping them with
``rolloutd node stop`` / ``rolloutd router stop``, which must succeed on their own: a daemon that
needed SIGKILL, or a stop that failed, fails the test (no fallback here hides a broken stop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from rolloutd.native_io import shm


CLI = [sys.executable, "-m", "rolloutd.cli.main"]


@contextmanager
def scripted_policy(plans: dict[str, list[str]], folder: Path, api_key: str, *args: str) -> Iterator[str]:
    """A reference policy server process following ``plans`` (task id -> oracle plan), behind
    ``api_key``, with ``args`` for its command line; yields its URL once it printed READY."""
    plans_file = folder / "plans.json"
    plans_file.write_text(json.dumps({"plans": plans}))
    proc = subprocess.Popen([*CLI, "policy-server", "--port", "0", "--scripted", str(plans_file), *args],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "ROLLOUTD_POLICY_API_KEY": api_key})
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("READY "), line
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


@contextmanager
def policy_and_node(plans: dict[str, list[str]], api_key: str, *node_args: str,
                    prefix: str = "rld-") -> Iterator[tuple[str, str]]:
    """(node address, policy URL): a scripted policy and a node daemon (``node_args``) holding
    its key, in a fresh private folder; the node starts with no inference server."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    tmp.chmod(0o700)
    with scripted_policy(plans, tmp, api_key) as url:
        with node_daemon(tmp / "n", *node_args, env={"ROLLOUTD_INFERENCE_API_KEY": api_key}) as address:
            yield address, url


@contextmanager
def node_daemon(run_dir: Path, *args: str, env: dict[str, str] | None = None,
                stop_rung: str | None = "sigterm") -> Iterator[str]:
    """A detached node daemon on ``run_dir``; yields its address; stops it (see :func:`stop_node`
    for ``stop_rung``: None when the test kills the daemon itself) and checks it leaves nothing."""
    (address,) = start_nodes([run_dir], *args, env=env)
    pid = int((run_dir / "node.pid").read_text())
    try:
        yield address
    finally:
        stop_node(run_dir, [pid], rung=stop_rung)


def start_nodes(run_dirs: list[Path], *args: str, env: dict[str, str] | None = None,
                prefixes: list[tuple[str, ...]] | None = None) -> list[str]:
    """Start detached node daemons, all at once; their addresses. ``prefixes[i]`` runs the i-th
    command under another (e.g. ``ip netns exec NS``)."""
    procs = [subprocess.Popen([*(prefixes[i] if prefixes else ()), *CLI, "node", "start", "--detach", "--run-dir",
                               str(d), "--ready-timeout-s", "120", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
             for i, d in enumerate(run_dirs)]
    addresses = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"daemon did not start: {err[-3000:]}"
        addresses.append(out.strip().splitlines()[-1])
    return addresses


def stop_node(run_dir: Path, pids: list[int], *, rung: str | None = "sigterm", timeout_s: float = 20.0) -> None:
    """``rolloutd node stop``, then check ``pids`` left nothing behind. ``rung``: how the stop
    must end the daemon, ``sigterm`` (it shut down by itself) unless a test wants the ladder to
    reach ``sigkill``; None when the test killed the daemon itself (then there is none to stop)."""
    stop = subprocess.run([*CLI, "node", "stop", "--run-dir", str(run_dir), "--timeout-s", str(timeout_s)],
                          capture_output=True, text=True, timeout=timeout_s + 60)
    _assert_stopped(stop, rung, "no node daemon running")
    for pid in pids:
        assert_daemon_gone(run_dir, pid)


def _assert_stopped(stop: subprocess.CompletedProcess[str], rung: str | None, none_running: str) -> None:
    assert stop.returncode == 0, f"stop failed ({stop.returncode}): {stop.stdout}{stop.stderr}"
    if rung is None:
        assert none_running in stop.stdout, f"the daemon was expected gone already: {stop.stdout}"
    else:
        assert f"({rung})" in stop.stdout, f"the stop was expected to end by {rung}: {stop.stdout}{stop.stderr}"


@contextmanager
def router_daemon(run_dir: Path, *args: str, prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """A detached ``rolloutd router`` on ``run_dir``; yields its local address; checks it is gone after."""
    pid = start_router(run_dir, *args, prefix=prefix)
    try:
        yield f"ipc://{run_dir}/router.sock"
    finally:
        stop_router(run_dir, pid)


def start_router(run_dir: Path, *args: str, prefix: tuple[str, ...] = ()) -> int:
    out = subprocess.run([*prefix, *CLI, "router", "start", "--detach", "--run-dir", str(run_dir), *args],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, f"router did not start: {out.stderr[-3000:]}"
    return int((run_dir / "router.pid").read_text())


def stop_router(run_dir: Path, pid: int, *, rung: str | None = "sigterm") -> None:
    """``rolloutd router stop`` (see :func:`stop_node` for ``rung``), then nothing may remain."""
    stop = subprocess.run([*CLI, "router", "stop", "--run-dir", str(run_dir)], capture_output=True, text=True,
                          timeout=60)
    _assert_stopped(stop, rung, "no router running")
    assert_daemon_gone(run_dir, pid, sockets=("router.sock", "nodes.sock"))


def daemon_processes(pid: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_daemon_gone(run_dir: Path, pid: int, timeout_s: float = 10.0,
                       sockets: tuple[str, ...] = ("node.sock",)) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in daemon_processes(pid) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"daemon processes still alive: {[p.cmdline() for p in alive]}")
    for name in sockets:
        assert not (run_dir / name).exists(), f"socket {name} left behind"
    assert shm.list_segments(f"rld{os.getuid()}-{pid}-") == [], "shared-memory segments left behind"
    leftovers = [p for p in psutil.process_iter(["cwd", "cmdline"])
                 if str(run_dir) in " ".join(p.info.get("cmdline") or []) + (p.info.get("cwd") or "")]
    assert leftovers == [], f"processes still using {run_dir}: {[p.info['cmdline'] for p in leftovers]}"
