"""`rolloutd node start --detach` as a Slurm prolog calls it: no PATH, a failure in the exit code,
and nothing left running when the start fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from daemon_fixtures import assert_daemon_gone

from rolloutd.daemon.lifecycle import DEFAULT_PATH

NODE = [sys.executable, "-m", "rolloutd.daemon.cli", "node"]


def _bare_env() -> dict[str, str]:
    """What a prolog passes on: no PATH, no terminal, nothing of the caller's shell."""
    return {"HOME": "/", "ROLLOUTD_CACHE_DIR": os.environ["ROLLOUTD_CACHE_DIR"]}


def test_start_without_path(short_tmp: Path) -> None:
    start = subprocess.run([*NODE, "start", "--detach", "--run-dir", str(short_tmp), "--backend", "local",
                            "--workers", "1", "--warm", "0"], env=_bare_env(), capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
    assert start.returncode == 0, start.stderr[-3000:]
    assert start.stdout.strip() == f"ipc://{short_tmp}/node.sock"
    pid = int((short_tmp / "node.pid").read_text())
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"PATH={DEFAULT_PATH}".encode() in environ
    stop = subprocess.run([*NODE, "stop", "--run-dir", str(short_tmp)], env=_bare_env(), capture_output=True,
                          text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert_daemon_gone(short_tmp, pid)


def test_ready_timeout_leaves_nothing_running(short_tmp: Path) -> None:
    start = subprocess.run([*NODE, "start", "--detach", "--run-dir", str(short_tmp), "--backend", "local",
                            "--workers", "2", "--ready-timeout-s", "0.2"], env=_bare_env(), capture_output=True,
                           text=True, timeout=60)
    assert start.returncode == 2
    found = re.search(r"node daemon \(pid (\d+)\) did not answer within 0.2 s", start.stderr)
    assert found, start.stderr
    assert_daemon_gone(short_tmp, int(found.group(1)))


def test_unwritable_log_is_reported(short_tmp: Path) -> None:
    start = subprocess.run([*NODE, "start", "--detach", "--run-dir", str(short_tmp), "--log-file",
                            str(short_tmp / "missing" / "node.log")], env=_bare_env(), capture_output=True,
                           text=True, timeout=60)
    assert start.returncode == 2
    assert "cannot prepare the run folder" in start.stderr and "node.log" in start.stderr
