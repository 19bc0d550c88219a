"""`rolloutd node start --detach` as a Slurm prolog calls it: no PATH, a failure in the exit code,
and nothing left running when the start fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from daemon_fixtures import assert_daemon_gone

from rolloutd.cli.lifecycle import DEFAULT_PATH
from rolloutd.cli.run_lock import RunFolderLock, running_pid

NODE = [sys.executable, "-m", "rolloutd.cli.main", "node"]


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


def test_two_starts_on_one_run_folder_leave_one_daemon_that_stop_finds(short_tmp: Path) -> None:
    args = [*NODE, "start", "--detach", "--run-dir", str(short_tmp), "--backend", "local", "--workers", "2",
            "--warm", "0"]
    starts = [subprocess.Popen(args, env=_bare_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in starts]
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    winner = running_pid(short_tmp, "node")
    assert winner is not None and int((short_tmp / "node.pid").read_text()) == winner
    loser_err = next(err for rc, _, err in results if rc != 0)
    assert f"already running (pid {winner}," in loser_err, loser_err
    # The winner was not harmed: it answers, and its workers are the ones it started with.
    status = subprocess.run([*NODE, "status", "--run-dir", str(short_tmp), "--json"], capture_output=True,
                            text=True, timeout=30)
    st = json.loads(status.stdout)
    assert st["pid"] == winner and all(w["ready"] and w["generation"] == 0 for w in st["workers"]), st
    (short_tmp / "node.pid").unlink()  # stop goes by the lock, not by a pidfile that may be stale
    stop = subprocess.run([*NODE, "stop", "--run-dir", str(short_tmp)], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and f"stopped node daemon pid {winner}" in stop.stdout, (stop.stdout, stop.stderr)
    assert_daemon_gone(short_tmp, winner)
    assert running_pid(short_tmp, "node") is None


def test_a_held_run_folder_is_refused_before_anything_is_touched(short_tmp: Path) -> None:
    lock = RunFolderLock.take(short_tmp, "node", "node daemon")
    try:
        (short_tmp / "node.sock").write_text("")  # stands for the holder's socket: must survive
        start = subprocess.run([*NODE, "start", "--run-dir", str(short_tmp), "--backend", "local"], env=_bare_env(),
                               capture_output=True, text=True, timeout=60)
        assert start.returncode == 2 and "DAEMON_RUNNING" in start.stderr, start.stderr
        assert f"already runs on {short_tmp} (pid {os.getpid()}" in start.stderr, start.stderr
        assert (short_tmp / "node.sock").exists() and not (short_tmp / "node.pid").exists()
    finally:
        lock.release()
    assert running_pid(short_tmp, "node") is None
