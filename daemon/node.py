"""``rolloutd node start|stop|status``: the node daemon's process lifecycle (see ``lifecycle``
for what ``start --detach`` promises); a stopped or failed node leaves no sandbox, segment or socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any


from rolloutd.native_io import shm

from . import lifecycle
from .config import NodeConfig
from .lifecycle import DaemonProcess, daemon_pid
from .reaper import reap_state_dir
from .sandbox import cgroups
from .sandbox_user import workers_dir
from .supervisor import Supervisor

log = logging.getLogger(__name__)


def pidfile_path(config: NodeConfig, pidfile: str | None) -> Path:
    return Path(pidfile) if pidfile else config.run_path / "node.pid"


def _process(config: NodeConfig, pidfile: Path) -> DaemonProcess:
    return DaemonProcess("node daemon", "node", config.run_path, pidfile, config.socket_path,
                         "ROLLOUTD_NODE_CONFIG_JSON", config.to_json())


def run_foreground(config: NodeConfig, pidfile: Path) -> int:
    return lifecycle.run_foreground(_process(config, pidfile), lambda: Supervisor(config).serve())


def start_detached(config: NodeConfig, pidfile: Path, log_file: Path | None, ready_timeout_s: float) -> int:
    return lifecycle.start_detached(_process(config, pidfile), log_file or config.run_path / "node.log",
                                    ready_timeout_s, lambda pid: _cleanup_after(config, pid))


def stop(config: NodeConfig, pidfile: Path, timeout_s: float) -> int:
    pid = daemon_pid(config.run_path, "node")
    if pid is None:
        print(f"no node daemon running for {config.run_path}")
        _cleanup_after(config, None)
        return 0
    rung = lifecycle.stop_ladder(pid, timeout_s)
    _cleanup_after(config, pid)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    print(f"stopped node daemon pid {pid} ({rung})")
    return 0


def _cleanup_after(config: NodeConfig, pid: int | None) -> None:
    """After a forced stop: no sandbox, segment or socket of that daemon may remain."""
    workers = workers_dir(config)
    if workers.exists():
        for state in workers.iterdir():
            reap_state_dir(state)
        shutil.rmtree(workers, ignore_errors=True)
    cgroups.remove_delegated(config.run_path / cgroups.RECORD_FILE)
    if pid is not None:
        for name in shm.list_segments(f"rld{os.getuid()}-{pid}-"):
            shm.unlink(name)
    for path in (config.socket_path,):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def status(config: NodeConfig, as_json: bool) -> int:
    return lifecycle.show_status(config.address, as_json, _describe)


def _describe(st: dict[str, Any]) -> None:
    print(f"node daemon pid {st['pid']} at {st['address']}, up {st['uptime_s']:.0f} s, "
          f"memory {st['memory_rss_bytes'] / 2**20:.0f} MiB")
    print(f"requests in flight {st['in_flight']}, queued {st['queued']}, shm segments {st['shm_segments']}")
    print("sandboxes " + ", ".join(f"{k} {v}" for k, v in st["sandboxes"].items()))
    for w in st["workers"]:
        print(f"  worker {w['index']}: pid {w['pid']} {'ready' if w['ready'] else 'starting'} "
              f"gen {w['generation']} in flight {w['in_flight']}")
    for k, v in st.get("pipeline", {}).items():
        print(f"  stage {k}: {v}")
