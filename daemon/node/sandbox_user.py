"""Who the workers, and so every sandbox, run as: never root.

Under a daemon running as root, container root is host root whatever Apptainer is told (with
``--userns`` the uid map is ``0 0 1`` with every capability: it wrote
``/proc/sys/kernel/core_pattern`` and made cgroups). So a root daemon runs its workers as an
unprivileged user (``sandbox_user``): every sandbox is then on the ordinary-user path, a user
namespace owned by that user with no capability on the host, where those writes are denied. The
supervisor stays root (it owns the sockets and the run folder, and it reaps). A daemon started by
an ordinary user is unprivileged already and changes nothing.

The workers' folders cannot stay in the run folder then (root's, 0700, and its parents may be
closed too, e.g. ``/run/user/0``), so they go to ``<tmp>/rolloutd-sandboxes-0/<hash of the run
folder>``: the base is root's (0711, checked, never a link, so nobody can plant it), the folder
under it the sandbox user's (0700). Same run folder, same folder: a restart reaps what a killed
daemon left there.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rolloutd.daemon.node.config import NodeConfig
from rolloutd.native_io.errors import ConfigError


@dataclass(frozen=True)
class SandboxUser:
    name: str
    uid: int
    gid: int

    def run_as(self, argv: list[str]) -> list[str]:
        """``argv`` under this user, with its own group only; changing uid from 0 drops every
        capability. The process keeps its pid, so a parent waiting on it sees it exit."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *argv]


def sandbox_user(config: NodeConfig) -> SandboxUser | None:
    """The user workers run as; None when the daemon is not root (it runs them as itself)."""
    if os.getuid() != 0:
        return None
    name = config.sandbox_user
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(
            f"the daemon runs as root, so its sandboxes run as the unprivileged user {name!r} "
            "(sandbox_user), which does not exist: create it with `scripts/add-sandbox-user` (or `useradd "
            f"--system --user-group --no-create-home --shell /usr/sbin/nologin {name}`), or set "
            "sandbox_user to another unprivileged user"
        ) from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise ConfigError(f"sandbox_user {name!r} has uid {pw.pw_uid} / gid {pw.pw_gid}: sandboxes must not run as "
                          "root or in its group; name an unprivileged user")
    return SandboxUser(name, pw.pw_uid, pw.pw_gid)


def workers_dir(config: NodeConfig) -> Path:
    """Where the workers keep their state and their sandboxes' folders."""
    if os.getuid() != 0:
        return config.run_path / "workers"
    key = hashlib.sha256(str(config.run_path.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "rolloutd-sandboxes-0" / key


def prepare_workers_dir(config: NodeConfig, user: SandboxUser | None) -> Path:
    """Create :func:`workers_dir`, owned by whoever the workers run as."""
    path = workers_dir(config)
    if user is None:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    base = path.parent
    base.mkdir(mode=0o711, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise ConfigError(f"{base} must be a folder owned by root and writable by root alone (it is mode "
                          f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): someone else made it; remove it")
    os.chmod(base, 0o711)
    path.mkdir(mode=0o700, exist_ok=True)
    own_folder(path, user)
    return path


def own_folder(path: Path, user: SandboxUser | None) -> None:
    """Give ``path`` (mode 0700) to ``user``, when there is one."""
    if user is not None:
        os.chown(path, user.uid, user.gid)
        os.chmod(path, 0o700)
