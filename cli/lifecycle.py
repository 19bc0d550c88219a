"""The process lifecycle ``rolloutd node`` and ``rolloutd router`` share: run-folder lock and
pidfile, foreground run, detached start, stop by a ladder.

``start --detach`` is safe to call from a Slurm prolog: the daemon runs in a new session with
its standard streams on a log file (never on the caller's pipes), and the command returns only
once the daemon answers a real status request on its ipc socket, or fails with the log's tail
and a non-zero exit code, leaving nothing behind.

"This pid is the daemon of that run folder" has one definition (:func:`is_daemon`), which the
Slurm hooks implement the same way in shell (``rld_is_daemon``; tests/test_slurm_hooks.py runs
both on the same processes): alive, owned by the uid, and naming the run folder on its command
line. A detached daemon's command line always carries ``--run-dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import uvloop

from rolloutd.cli.run_lock import RunFolderLock, running_pid
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.errors import DaemonRunning, DaemonUnavailable, PermissionDenied, RolloutdError
from rolloutd.native_io.procfs import pid_alive

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROBE_TIMEOUT_S = 2.0
"""One readiness probe of a starting daemon (a status request on its ipc socket)."""
STATUS_TIMEOUT_S = 5.0
"""``rolloutd node|router status``: a running daemon answers status at once, even when busy."""
KILLED_GONE_TIMEOUT_S = 5.0
"""After SIGKILL, how long the process may take to disappear."""
POLL_S = 0.05
"""How often the command line looks again at a daemon it waits for."""


@dataclass(frozen=True)
class DaemonProcess:
    """One daemon as the command line sees it."""

    what: str
    """In messages: ``node daemon``, ``router``."""
    command: str
    """Its ``rolloutd`` subcommand: ``node``, ``router``."""
    run_path: Path
    pidfile: Path
    socket_path: Path
    """Its private ipc socket, probed for readiness."""
    config_env: str
    """The variable that hands the configuration (JSON) to the detached process."""
    config_json: str

    @property
    def address(self) -> str:
        return f"ipc://{self.socket_path}"


CMDLINE_READ_MAX = 65536
"""Bytes of /proc/PID/cmdline looked at (the shell side reads as many)."""


def is_daemon(pid: int, run_path: Path, uid: int) -> bool:
    """``pid`` is alive (not a zombie), owned by ``uid``, and one argument of its command line is
    ``run_path`` or a path inside it (``job1`` is no prefix of ``job10/``)."""
    run = os.path.abspath(run_path)
    if not pid_alive(pid):
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(CMDLINE_READ_MAX)
    except OSError:
        return False
    args = [a.decode(errors="surrogateescape") for a in raw.split(b"\0")[:-1]]
    return any(a == run or a.startswith(run + "/") for a in args)


def daemon_pid(run_path: Path, kind: str, uid: int | None = None) -> int | None:
    """The daemon of ``kind`` serving ``run_path``: the holder of its run-folder lock, when that
    process is the folder's daemon by :func:`is_daemon` (for ``uid``, default the folder's
    owner); None when none runs. A lock file linked to another folder's (a user can do that in
    their own folders) names the other daemon, which the rule refuses, so ``stop`` never signals it."""
    try:
        holder = running_pid(run_path, kind)
    except PermissionError as e:
        try:
            owner = f"uid {run_path.stat().st_uid}"
        except OSError:
            owner = "another user"
        raise PermissionDenied(f"cannot look into the run folder {run_path}: it belongs to {owner}, not to you "
                               f"(uid {os.getuid()}); run this as its owner") from e
    if holder is None:
        return None
    # A daemon runs as its run folder's owner (it made the folder, or the Slurm prolog made it
    # for the job's user): root stopping a user's daemon expects that user, not root.
    if not is_daemon(holder, run_path, run_path.stat().st_uid if uid is None else uid):
        raise DaemonRunning(
            f"pid {holder} holds {run_path}/{kind}.lock but is not the {kind} daemon of {run_path} (not run by "
            f"the folder's owner, or its command line does not name {run_path}); it was left untouched. Stop it "
            "yourself, or start daemons with --run-dir so that they can be told apart"
        )
    return holder


def raise_open_files_limit() -> int:
    """The soft limit on open descriptors raised to the hard one, for this process and every
    worker it starts; the new soft limit. A rollout in flight holds about a dozen descriptors
    between the daemon and its sandbox (terminal, pidfd, command file, sockets; 12,677 for 1,000
    in flight here), and many systems start processes with a soft limit of 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def run_foreground(d: DaemonProcess, serve: Callable[[], Coroutine[Any, Any, None]]) -> int:
    raise_open_files_limit()
    d.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = RunFolderLock.take(d.run_path, d.command, d.what)
    d.pidfile.write_text(f"{os.getpid()}\n")
    try:
        uvloop.run(serve())
    finally:
        with contextlib.suppress(FileNotFoundError):
            if d.pidfile.read_text().split()[0] == str(os.getpid()):
                d.pidfile.unlink()
        lock.release()
    return 0


def start_detached(d: DaemonProcess, log_path: Path, ready_timeout_s: float,
                   cleanup: Callable[[int], None]) -> int:
    """Start ``rolloutd <command> start --config-from-env`` in its own session; print its address
    once it answers. On failure every process of that session is killed and ``cleanup(pid)`` runs."""
    try:
        d.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        out = open(log_path, "ab")
    except OSError as e:
        raise RolloutdError(f"cannot prepare the run folder {d.run_path} or log {log_path}: {e}") from e
    existing = running_pid(d.run_path, d.command)
    if existing is not None:
        out.close()
        raise DaemonRunning(f"a {d.what} is already running (pid {existing}, {d.address}); "
                            f"stop it with `rolloutd {d.command} stop`")
    env = {**os.environ, d.config_env: d.config_json}
    # A Slurm prolog (or cron, or systemd) may give no PATH; the daemon runs apptainer and env.
    env.setdefault("PATH", DEFAULT_PATH)
    with out:
        proc = subprocess.Popen(
            # --run-dir is ignored with --config-from-env: it is there so the command line names
            # the run folder (is_daemon).
            [sys.executable, "-m", "rolloutd.cli.main", d.command, "start", "--run-dir",
             os.path.abspath(d.run_path), "--pidfile", str(d.pidfile), "--config-from-env"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True, close_fds=True,
        )
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            holder = running_pid(d.run_path, d.command)
            _abort_start(proc, d, cleanup)
            if holder is not None:
                raise DaemonRunning(f"a {d.what} is already running (pid {holder}, {d.address}); it started "
                                    "while this one was starting and was left untouched")
            raise RolloutdError(f"the {d.what} (pid {proc.pid}) exited with {proc.returncode} during start-up; "
                                f"log {log_path}:\n{tail(log_path)}")
        if d.socket_path.exists():
            try:
                with RolloutClient(d.address, timeout_s=PROBE_TIMEOUT_S) as client:
                    answering = client.status()["pid"]
                if answering == proc.pid:  # not another daemon that won the run folder
                    print(d.address, flush=True)
                    return 0
            except RolloutdError:
                pass
        time.sleep(POLL_S)
    _abort_start(proc, d, cleanup)
    raise RolloutdError(f"the {d.what} (pid {proc.pid}) did not answer within {ready_timeout_s} s "
                        f"(--ready-timeout-s); log {log_path}:\n{tail(log_path)}")


def _abort_start(proc: subprocess.Popen[bytes], d: DaemonProcess, cleanup: Callable[[int], None]) -> None:
    """A failed start leaves nothing: every process of the daemon's session (it leads its own),
    what ``cleanup`` removes, and the pidfile; unless another daemon holds the run folder (this
    one lost a race to it), whose files are its own and are left alone."""
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.info["pid"]) == proc.pid:
                p.kill()
    proc.wait()
    if running_pid(d.run_path, d.command) is not None:
        return
    cleanup(proc.pid)
    with contextlib.suppress(FileNotFoundError):
        d.pidfile.unlink()


def stop(d: DaemonProcess, timeout_s: float, cleanup: Callable[[int | None], None]) -> int:
    """``rolloutd node|router stop``: the stop ladder to the running daemon, then ``cleanup`` of
    what it may have left (given its pid; None when none was running, for a crashed one's), then
    its pid file."""
    pid = daemon_pid(d.run_path, d.command)
    rung = stop_ladder(pid, timeout_s) if pid is not None else None
    cleanup(pid)
    with contextlib.suppress(FileNotFoundError):
        d.pidfile.unlink()
    print(f"no {d.what} running for {d.run_path}" if pid is None else f"stopped {d.what} pid {pid} ({rung})")
    return 0


def stop_ladder(pid: int, timeout_s: float) -> str:
    """SIGTERM, then after ``timeout_s`` SIGKILL to the process and its children; the rung reached."""
    os.kill(pid, signal.SIGTERM)
    if wait_gone(pid, timeout_s):
        return "sigterm"
    with contextlib.suppress(ProcessLookupError, psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            child.kill()
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid, KILLED_GONE_TIMEOUT_S)
    return "sigkill"


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(POLL_S)
    return False


def show_status(address: str, as_json: bool, describe: Callable[[dict[str, Any]], None]) -> int:
    """Print the running daemon's status (JSON, or ``describe``'s lines); 3 when there is none."""
    try:
        with RolloutClient(address, timeout_s=STATUS_TIMEOUT_S) as client:
            st = client.status()
    except DaemonUnavailable as e:
        print(str(e), file=sys.stderr)
        return 3
    if as_json:
        print(json.dumps(st, indent=2))
    else:
        describe(st)
    return 0


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
