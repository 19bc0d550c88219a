"""Router configuration: defaults < TOML (``$ROLLOUTD_ROUTER_CONFIG``) < ``ROLLOUTD_ROUTER_*`` < flags.

The router always has a private ipc socket (``<run folder>/router.sock``, 0600 in a 0700 folder)
for trainers on its host and for ``rolloutd router status``. TCP is opt-in and never
unauthenticated: ``tcp_bind`` needs the router's key and a folder of trainer keys, a tcp
``node_bind`` a folder of node keys.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutd.daemon.common.config import load_typed_config
from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.run_dir import SOCKET_PATH_MAX, default_run_dir

ENV_PREFIX = "ROLLOUTD_ROUTER_"


@dataclass
class RouterConfig:
    run_dir: str = ""
    """Folder (mode 0700) for router.sock, nodes.sock, the pidfile and the log; empty = the node's default."""
    tcp_bind: str = ""
    """Also accept trainers on ``tcp://HOST:PORT`` (CURVE: needs the key and ``client_keys_dir``)."""
    node_bind: str = ""
    """Where node daemons connect: ``ipc://PATH`` or ``tcp://HOST:PORT`` (CURVE: needs ``node_keys_dir``);
    empty = ``ipc://<run folder>/nodes.sock``."""
    curve_secret_key_file: str = ""
    """The router's CURVE secret key file (``rolloutd keygen``); nodes and trainers get its ``.key``."""
    client_keys_dir: str = ""
    """Folder of trainers' public key files allowed on ``tcp_bind``."""
    node_keys_dir: str = ""
    """Folder of nodes' public key files allowed on a tcp ``node_bind``."""
    heartbeat_interval_s: float = 1.0
    """Nodes send a heartbeat this often (the router tells them when they register)."""
    heartbeat_timeout_s: float = 5.0
    """A node silent this long is dropped and its requests re-dispatched."""
    max_attempts: int = 3
    """Nodes a request may lose (die under it) before it is answered NODE_LOST instead."""
    no_node_timeout_s: float = 60.0
    """A request waiting while no node accepts work is answered DAEMON_UNAVAILABLE after this."""
    queue_limit: int = 65536
    """Requests waiting at the router for a free slot before new ones get BUSY."""
    completed_ttl_s: float = 600.0
    """How long an answered id is remembered: a repeat gets the same answer, not a rerun."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest request accepted from a trainer, all frames together (bytes)."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "no_node_timeout_s", "completed_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_attempts", "queue_limit", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                              f"({self.heartbeat_interval_s}); a few intervals is usual")
        if self.tcp_bind and not (self.tcp_bind.startswith("tcp://") and self.curve_secret_key_file
                                  and self.client_keys_dir):
            raise ConfigError("tcp_bind is tcp://HOST:PORT and needs curve_secret_key_file and client_keys_dir: "
                              "the router never listens on TCP without authentication (`rolloutd keygen`)")
        if not self.nodes_address.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"node_bind must be ipc://PATH or tcp://HOST:PORT, got {self.node_bind!r}")
        if self.nodes_address.startswith("tcp://") and not (self.curve_secret_key_file and self.node_keys_dir):
            raise ConfigError("a tcp node_bind needs curve_secret_key_file and node_keys_dir: "
                              "the router never listens on TCP without authentication (`rolloutd keygen`)")
        node_ipc = [Path(self.nodes_address[len("ipc://"):])] if self.nodes_address.startswith("ipc://") else []
        for path in (self.socket_path, *node_ipc):
            if len(str(path)) > SOCKET_PATH_MAX:
                raise ConfigError(f"socket path {path} is longer than {SOCKET_PATH_MAX} bytes (Unix socket limit); "
                                  "choose a shorter run_dir")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else default_run_dir()

    @property
    def socket_path(self) -> Path:
        return self.run_path / "router.sock"

    @property
    def address(self) -> str:
        """The local trainers' (and ``rolloutd router status``'s) address."""
        return f"ipc://{self.socket_path}"

    @property
    def nodes_address(self) -> str:
        return self.node_bind or f"ipc://{self.run_path / 'nodes.sock'}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RouterConfig":
        return cls(**json.loads(text))


def load_router_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                       environ: dict[str, str] | None = None) -> RouterConfig:
    config: RouterConfig = load_typed_config(RouterConfig, ENV_PREFIX, path, overrides, environ)
    return config
