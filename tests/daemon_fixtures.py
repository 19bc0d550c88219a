"""Starting real node daemons (separate processes) for tests, and stopping them by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from rolloutd.native_io import shm


@contextmanager
def node_daemon(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A detached node daemon on ``run_dir``; yields its address; checks it leaves nothing behind."""
    cmd = [sys.executable, "-m", "rolloutd.daemon.cli", "node", "start", "--detach", "--run-dir", str(run_dir),
           "--ready-timeout-s", "120", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"daemon did not start: {out.stderr[-3000:]}"
    address = out.stdout.strip().splitlines()[-1]
    pid = int((run_dir / "node.pid").read_text())
    try:
        yield address
    finally:
        stop = subprocess.run([sys.executable, "-m", "rolloutd.daemon.cli", "node", "stop", "--run-dir", str(run_dir)],
                              capture_output=True, text=True, timeout=60)
        if stop.returncode != 0:
            os.kill(pid, signal.SIGKILL)
        assert_daemon_gone(run_dir, pid)


def daemon_processes(pid: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def assert_daemon_gone(run_dir: Path, pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in daemon_processes(pid) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"daemon processes still alive: {[p.cmdline() for p in alive]}")
    assert not (run_dir / "node.sock").exists(), "public socket left behind"
    assert shm.list_segments(f"rld{os.getuid()}-{pid}-") == [], "shared-memory segments left behind"
    leftovers = [p for p in psutil.process_iter(["cwd", "cmdline"])
                 if str(run_dir) in " ".join(p.info.get("cmdline") or []) + (p.info.get("cwd") or "")]
    assert leftovers == [], f"processes still using {run_dir}: {[p.info['cmdline'] for p in leftovers]}"
