"""``rolloutd router start|stop|status``: the router's process lifecycle, as ``rolloutd node``'s
(see ``lifecycle``); ``status`` asks the running router over its ipc socket, so it needs no keys.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from rolloutd.cli import lifecycle
from rolloutd.cli.lifecycle import DaemonProcess
from rolloutd.daemon.router.config import RouterConfig
from rolloutd.daemon.router.router import Router

CONFIG_ENV = "ROLLOUTD_ROUTER_CONFIG_JSON"


def pidfile_path(config: RouterConfig, pidfile: str | None) -> Path:
    return Path(pidfile) if pidfile else config.run_path / "router.pid"


def _process(config: RouterConfig, pidfile: Path) -> DaemonProcess:
    return DaemonProcess("router", "router", config.run_path, pidfile, config.socket_path, CONFIG_ENV,
                         config.to_json())


def run_foreground(config: RouterConfig, pidfile: Path) -> int:
    return lifecycle.run_foreground(_process(config, pidfile), lambda: Router(config).serve())


def start_detached(config: RouterConfig, pidfile: Path, log_file: Path | None, ready_timeout_s: float) -> int:
    return lifecycle.start_detached(_process(config, pidfile), log_file or config.run_path / "router.log",
                                    ready_timeout_s, lambda _pid: _remove_sockets(config))


def stop(config: RouterConfig, pidfile: Path, timeout_s: float) -> int:
    return lifecycle.stop(_process(config, pidfile), timeout_s, lambda _pid: _remove_sockets(config))


def _remove_sockets(config: RouterConfig) -> None:
    paths = [config.socket_path]
    if config.nodes_address.startswith("ipc://"):
        paths.append(Path(config.nodes_address[len("ipc://"):]))
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def status(config: RouterConfig, as_json: bool) -> int:
    if not config.socket_path.exists():
        print(f"no router at {config.address}; start one with `rolloutd router start`", file=sys.stderr)
        return 3
    return lifecycle.show_status(config.address, as_json, _describe)


def _describe(st: dict[str, Any]) -> None:
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
