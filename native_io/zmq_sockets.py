"""The one place ZeroMQ sockets are made, and the checks around ipc endpoints.

Every socket gets an explicit type, linger, high-water marks and (where given) a routing id, so
no socket silently blocks a shutdown or drops messages at a default limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from .errors import DaemonUnavailable, PermissionDenied


def make_socket(
    ctx: zmq.Context[Any] | zmq.asyncio.Context,
    socket_type: int,
    *,
    identity: bytes | None = None,
    linger_ms: int = 0,
    hwm: int = 0,
    router_mandatory: bool = False,
) -> Any:
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, linger_ms)
    # 0 = no limit: every message here is an answer someone waits for; dropping is never right.
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if router_mandatory:
        # Fail loudly on a send to a peer that is gone instead of dropping it silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def bind_private_ipc(sock: Any, path: Path) -> None:
    """Bind at ``path`` with the socket file readable by the owner only."""
    if path.exists():
        path.unlink()
    old = os.umask(0o177)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def check_ipc_reachable(address: str) -> None:
    """Raise an actionable error before connecting to an ipc socket that cannot work.

    ZeroMQ connects asynchronously and retries forever: without this a client of a daemon that
    is not running, or that belongs to another user, would just hang.
    """
    path = ipc_path(address)
    if path is None:
        return
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DaemonUnavailable(
            f"no rolloutd node daemon at {address} (socket missing); start one with `rolloutd node start` "
            "or set ROLLOUTD_ADDRESS"
        ) from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot reach {address}: its run folder belongs to another user (mode 0700); "
            "start your own daemon or use that user's account"
        ) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{path} is not a socket")
    if st.st_uid != os.getuid() and os.getuid() != 0:
        raise PermissionDenied(f"{address} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")


def peer_credentials(frame: Any) -> tuple[int, int, int] | None:
    """(uid, gid, pid) of the process that sent ``frame`` over ipc, from SO_PEERCRED.

    libzmq appends ``:uid:gid:pid`` to the Peer-Address property of Unix-socket peers.
    """
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
    parts = str(addr).rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])
