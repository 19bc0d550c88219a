"""Where a user's daemons keep their sockets by default, and how long a socket path may be."""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_PATH_MAX = 100
"""sun_path holds 108 bytes on Linux; keep a margin for suffixes."""


def default_run_dir() -> Path:
    """``$XDG_RUNTIME_DIR/rolloutd`` when that exists and is ours, else ``/tmp/rolloutd-$UID``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.stat(xdg).st_uid == os.getuid():
        return Path(xdg) / "rolloutd"
    return Path(f"/tmp/rolloutd-{os.getuid()}")
