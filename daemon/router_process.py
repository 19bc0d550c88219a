"""``rolloutd router start|stop|status``: the router's process lifecycle, as ``rolloutd node``'s.

``start --detach`` returns once the router answers a real status request on its ipc socket (or
fails with the log's tail); ``stop`` is SIGTERM, then SIGKILL after the timeout; ``status`` asks
the running router over its ipc socket, so it needs no keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import uvloop

from rolloutd.native_io.errors import DaemonUnavailable, RolloutdError

from .node import _daemon_pid, _tail, _wait_gone
from .router import Router
from .router_config import RouterConfig

CONFIG_ENV = "ROLLOUTD_ROUTER_CONFIG_JSON"


def pidfile_path(config: RouterConfig, pidfile: str | None) -> Path:
    return Path(pidfile) if pidfile else config.run_path / "router.pid"


def run_foreground(config: RouterConfig, pidfile: Path) -> int:
    config.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = _daemon_pid(pidfile)
    if existing is not None and existing != os.getpid():
        raise RolloutdError(f"a router is already running (pid {existing}, {config.address}); "
                            "stop it with `rolloutd router stop`")
    pidfile.write_text(f"{os.getpid()}\n")
    try:
        uvloop.run(Router(config).serve())
    finally:
        with contextlib.suppress(FileNotFoundError):
            if pidfile.read_text().split()[0] == str(os.getpid()):
                pidfile.unlink()
    return 0


def start_detached(config: RouterConfig, pidfile: Path, log_file: Path | None, ready_timeout_s: float) -> int:
    config.run_path.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = _daemon_pid(pidfile)
    if existing is not None:
        raise RolloutdError(f"a router is already running (pid {existing}, {config.address})")
    log_path = log_file or config.run_path / "router.log"
    env = {**os.environ, CONFIG_ENV: config.to_json()}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.daemon.cli", "router", "start", "--pidfile", str(pidfile),
             "--config-from-env"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True, close_fds=True,
        )
    from rolloutd.client.sync_client import RolloutClient

    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RolloutdError(f"the router exited with {proc.returncode} during start-up; "
                                f"log {log_path}:\n{_tail(log_path)}")
        if config.socket_path.exists():
            try:
                with RolloutClient(config.address, timeout_s=2.0) as client:
                    client.status()
                print(config.address, flush=True)
                return 0
            except RolloutdError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RolloutdError(f"the router did not answer within {ready_timeout_s} s (ready_timeout_s); "
                        f"log {log_path}:\n{_tail(log_path)}")


def stop(config: RouterConfig, pidfile: Path, timeout_s: float) -> int:
    pid = _daemon_pid(pidfile)
    if pid is None:
        print(f"no router running for {config.run_path}")
    else:
        os.kill(pid, signal.SIGTERM)
        rung = "sigterm"
        if not _wait_gone(pid, timeout_s):
            rung = "sigkill"
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)
        print(f"stopped router pid {pid} ({rung})")
    paths = [pidfile, config.socket_path]
    if config.nodes_address.startswith("ipc://"):
        paths.append(Path(config.nodes_address[len("ipc://"):]))
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return 0


def status(config: RouterConfig, as_json: bool) -> int:
    from rolloutd.client.sync_client import RolloutClient

    if not config.socket_path.exists():
        print(f"no router at {config.address}; start one with `rolloutd router start`", file=sys.stderr)
        return 3
    try:
        with RolloutClient(config.address, timeout_s=5.0) as client:
            st = client.status()
    except DaemonUnavailable as e:
        print(str(e), file=sys.stderr)
        return 3
    if as_json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"router pid {st['pid']} on {st['host']}, up {st['uptime_s']:.0f} s; trainers at {st['address']}"
          f"{' and ' + st['tcp'] if st['tcp'] else ''}; nodes at {st['nodes_address']}")
    print(f"requests in flight {st['in_flight']}, waiting for a slot {st['waiting']}, open sandboxes {st['sandboxes']}")
    print("counters " + ", ".join(f"{k} {v}" for k, v in st["counters"].items()))
    header = f"  {'node':<32} {'state':<9} {'slots':>5} {'used':>5} {'load':>5} {'in flight':>9} {'heartbeat':>9}"
    print(header)
    for n in st["nodes"]:
        load = "-" if n["load"] is None else f"{n['load']:.2f}"
        print(f"  {n['name'][:32]:<32} {n['state']:<9} {n['slots']:>5} {n['used']:>5} {load:>5} "
              f"{n['in_flight']:>9} {n['heartbeat_age_s']:>8.1f}s")
    return 0
