"""``rolloutd node start|stop|status``: the node daemon's process lifecycle (see ``lifecycle``
for what ``start --detach`` promises); a stopped or failed node leaves no sandbox, segment or socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rolloutd.cli import lifecycle
from rolloutd.cli.lifecycle import DaemonProcess, daemon_pid
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.reaper import reap_state_dir
from rolloutd.daemon.node.router_link import DRAIN_SIGNAL, RESUME_SIGNAL, read_state
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.daemon.node.supervisor import Supervisor
from rolloutd.daemon.sandbox import cgroups
from rolloutd.native_io import shm
from rolloutd.native_io.errors import RolloutdError

log = logging.getLogger(__name__)
DRAIN_CONFIRM_TIMEOUT_S = 10.0
"""A node confirms a drain or resume signal in its link state file within its next heartbeat."""
DRAIN_POLL_S = 0.2
"""How often ``node drain --wait-s`` asks the node whether it is empty."""


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
    return lifecycle.stop(_process(config, pidfile), timeout_s, lambda pid: _cleanup_after(config, pid))


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


def drain(config: NodeConfig, *, resume: bool, wait_s: float) -> int:
    """``rolloutd node drain [--resume] [--wait-s S]``: signal the node, wait for the router to know."""
    pid = daemon_pid(config.run_path, "node")
    state = read_state(config.run_path)
    if pid is None:
        raise RolloutdError(f"no node daemon running for {config.run_path}")
    if state is None or state.get("pid") != pid:
        raise RolloutdError(f"the node daemon (pid {pid}) has no router link; it was started without --router")
    os.kill(pid, RESUME_SIGNAL if resume else DRAIN_SIGNAL)
    deadline = time.monotonic() + DRAIN_CONFIRM_TIMEOUT_S
    while (state or {}).get("draining") != (not resume):
        if time.monotonic() > deadline:
            raise RolloutdError(f"node pid {pid} did not confirm within {DRAIN_CONFIRM_TIMEOUT_S:g} s; see its log")
        time.sleep(lifecycle.POLL_S)
        state = read_state(config.run_path)
    print(f"node {state['identity'] if state else pid} {'takes work again' if resume else 'is draining'}")
    if resume or wait_s <= 0:
        return 0
    deadline = time.monotonic() + wait_s
    with RolloutClient(config.address, timeout_s=lifecycle.STATUS_TIMEOUT_S) as client:
        while True:
            st = client.status()
            if st["in_flight"] == 0 and st["sandboxes"]["leased"] == 0:
                print("drained: no request in flight, no sandbox leased")
                return 0
            if time.monotonic() > deadline:
                print(f"still busy after {wait_s} s: {st['in_flight']} request(s), "
                      f"{st['sandboxes']['leased']} sandbox(es) leased", file=sys.stderr)
                return 1
            time.sleep(DRAIN_POLL_S)
