"""``rolloutd node start|stop|status``: the node daemon's process lifecycle.

``start --detach`` is safe to call from a Slurm prolog: the daemon runs in a new session with
its standard streams on a log file (never on the caller's pipes), and the command returns only
once the daemon answers a real status request on its socket, or fails with the log's tail and a
non-zero exit code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import uvloop

from rolloutd.native_io import shm
from rolloutd.native_io.errors import DaemonUnavailable, RolloutdError

from .config import NodeConfig
from .reaper import reap_state_dir
from .supervisor import Supervisor

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def pidfile_path(config: NodeConfig, pidfile: str | None) -> Path:
    return Path(pidfile) if pidfile else config.run_path / "node.pid"


def _daemon_pid(path: Path) -> int | None:
    """The pid in ``path`` if that process is alive and is a rolloutd node (not a reused pid)."""
    try:
        pid = int(path.read_text().split()[0])
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or "rolloutd" not in " ".join(proc.cmdline()):
            return None
        return pid
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def run_foreground(config: NodeConfig, pidfile: Path) -> int:
    config.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = _daemon_pid(pidfile)
    if existing is not None and existing != os.getpid():
        raise RolloutdError(f"a node daemon is already running (pid {existing}, {config.address}); "
                            "stop it with `rolloutd node stop`")
    pidfile.write_text(f"{os.getpid()}\n")
    try:
        uvloop.run(Supervisor(config).serve())
    finally:
        with contextlib.suppress(FileNotFoundError):
            if pidfile.read_text().split()[0] == str(os.getpid()):
                pidfile.unlink()
    return 0


def start_detached(config: NodeConfig, pidfile: Path, log_file: Path | None, ready_timeout_s: float) -> int:
    log_path = log_file or config.run_path / "node.log"
    try:
        config.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        out = open(log_path, "ab")
    except OSError as e:
        raise RolloutdError(f"cannot prepare the run folder {config.run_path} or log {log_path}: {e}") from e
    existing = _daemon_pid(pidfile)
    if existing is not None:
        out.close()
        raise RolloutdError(f"a node daemon is already running (pid {existing}, {config.address})")
    env = {**os.environ, "ROLLOUTD_NODE_CONFIG_JSON": config.to_json()}
    # A Slurm prolog (or cron, or systemd) may give no PATH; the daemon runs apptainer and env.
    env.setdefault("PATH", DEFAULT_PATH)
    with out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.daemon.cli", "node", "start", "--pidfile", str(pidfile),
             "--config-from-env"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True, close_fds=True,
        )
    deadline = time.monotonic() + ready_timeout_s
    from rolloutd.client.sync_client import RolloutClient

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _abort_start(proc, config, pidfile)
            raise RolloutdError(f"the node daemon (pid {proc.pid}) exited with {proc.returncode} during start-up; "
                                f"log {log_path}:\n{_tail(log_path)}")
        if config.socket_path.exists():
            try:
                with RolloutClient(config.address, timeout_s=2.0) as client:
                    client.status()
                print(config.address, flush=True)
                return 0
            except RolloutdError:
                pass
        time.sleep(0.1)
    _abort_start(proc, config, pidfile)
    raise RolloutdError(f"the node daemon (pid {proc.pid}) did not answer within {ready_timeout_s} s "
                        "(--ready-timeout-s); "
                        f"log {log_path}:\n{_tail(log_path)}")


def _abort_start(proc: subprocess.Popen[bytes], config: NodeConfig, pidfile: Path) -> None:
    """A failed start leaves nothing: every process of the daemon's session (it leads its own),
    its sandboxes, sockets, segments and pidfile."""
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.info["pid"]) == proc.pid:
                p.kill()
    proc.wait()
    _cleanup_after(config, proc.pid)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()


def stop(config: NodeConfig, pidfile: Path, timeout_s: float) -> int:
    pid = _daemon_pid(pidfile)
    if pid is None:
        print(f"no node daemon running for {config.run_path}")
        _cleanup_after(config, None)
        return 0
    os.kill(pid, signal.SIGTERM)
    rung = "sigterm"
    if not _wait_gone(pid, timeout_s):
        rung = "sigkill"
        with contextlib.suppress(ProcessLookupError):
            for child in psutil.Process(pid).children(recursive=True):
                child.kill()
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5.0)
    _cleanup_after(config, pid)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    print(f"stopped node daemon pid {pid} ({rung})")
    return 0


def _cleanup_after(config: NodeConfig, pid: int | None) -> None:
    """After a forced stop: no sandbox, segment or socket of that daemon may remain."""
    workers = config.run_path / "workers"
    if workers.exists():
        for state in workers.iterdir():
            reap_state_dir(state)
    if pid is not None:
        for name in shm.list_segments(f"rld{os.getuid()}-{pid}-"):
            shm.unlink(name)
    for path in (config.socket_path,):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def status(config: NodeConfig, as_json: bool) -> int:
    from rolloutd.client.sync_client import RolloutClient

    try:
        with RolloutClient(config.address, timeout_s=5.0) as client:
            st = client.status()
    except DaemonUnavailable as e:
        print(str(e), file=sys.stderr)
        return 3
    if as_json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"node daemon pid {st['pid']} at {st['address']}, up {st['uptime_s']:.0f} s, "
          f"memory {st['memory_rss_bytes'] / 2**20:.0f} MiB")
    print(f"requests in flight {st['in_flight']}, queued {st['queued']}, shm segments {st['shm_segments']}")
    print("sandboxes " + ", ".join(f"{k} {v}" for k, v in st["sandboxes"].items()))
    for w in st["workers"]:
        print(f"  worker {w['index']}: pid {w['pid']} {'ready' if w['ready'] else 'starting'} "
              f"gen {w['generation']} in flight {w['in_flight']}")
    for k, v in st.get("pipeline", {}).items():
        print(f"  stage {k}: {v}")
    return 0


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
