"""Processes started inside a running instance by joining its namespaces (``nsenter``), not
through ``apptainer exec instance://``.

``apptainer exec`` starts Apptainer's Go runtime twice over to find the instance, check it and
join it: 80-97 ms of CPU and as much wall time per shell or kernel, measured here, several times
what the rest of a sandbox's life costs the node. Joining the instance's namespaces with
util-linux's ``nsenter`` does the same for about 2 ms.

What a process gets, as with ``apptainer exec``:

- the instance's user, mount, PID, network and IPC namespaces (every one in which the instance
  differs from the daemon), its root, and the daemon's uid and gids (``--preserve-credentials``);
- ``no_new_privs`` (``setpriv``, on the host before the join): setuid and file-capability
  binaries inside grant nothing, and an unprivileged process ends with no capability once it
  executes anything (its uid is not 0 in the instance's user namespace);
- the instance's cleaned environment (home, ``PATH``, ``LANG``, ``TERM`` and the
  ``APPTAINER_*`` names of the image and instance), then the image's own environment scripts,
  sourced as Apptainer's action scripts do, then the caller's variables;
- the working folder, entered inside by the shell (``cd``), so a symlink the sandbox planted
  resolves within its own root. ``nsenter --wd=PATH`` would open PATH on the host before the
  join: a link to ``/`` would hand the process a working folder outside the container's root.

Only where the instance's user namespace is the daemon user's own (rootless Apptainer, or
root); a setuid Apptainer's namespaces belong to root, and ``apptainer exec`` stays the way in.

The join names the instance by its init's pid. A pid is given again only after the kernel's
counter has wrapped past every other one (``pid_max``: 32,768 or more): the watchdog drops a
sandbox whose init died long before, and a start checks the init is alive (by pidfd) first.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shlex
import shutil
import struct
from dataclasses import dataclass

_NS_GET_OWNER_UID = 0xB704
"""``ioctl(2)`` on a user namespace file: the uid that owns it (linux/nsfs.h)."""

_NSENTER_FLAGS = {"user": "--user", "mnt": "--mount", "pid": "--pid", "net": "--net", "ipc": "--ipc",
                  "uts": "--uts", "cgroup": "--cgroup"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The ``PATH`` Apptainer gives a container process when the image sets none."""

# Run by the image's /bin/sh once inside: $0 is the working folder, "$@" the command.
_ENTER = ('cd -- "$0" || exit 126; unset OLDPWD; '
          'for s in /.singularity.d/env/*.sh; do if [ -f "$s" ]; then . "$s"; fi; done; ')


def _tools() -> tuple[str, str] | None:
    setpriv, nsenter = shutil.which("setpriv"), shutil.which("nsenter")
    return (setpriv, nsenter) if setpriv and nsenter else None


def _owner_uid(ns_file: str) -> int:
    fd = os.open(ns_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = bytearray(4)
        fcntl.ioctl(fd, _NS_GET_OWNER_UID, out)
        return int(struct.unpack("I", out)[0])
    finally:
        os.close(fd)


@dataclass(frozen=True)
class NamespaceJoin:
    """How to start processes in one instance: its init and the namespaces to enter."""

    init_pid: int
    flags: tuple[str, ...]
    base_env: dict[str, str]
    tools: tuple[str, str]

    def argv(self, argv: list[str], *, cwd: str, env: dict[str, str] | None) -> list[str]:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        script = _ENTER + (f"export {exports}; " if exports else "") + 'exec "$@"'
        setpriv, nsenter = self.tools
        return ["env", "-i", *(f"{k}={v}" for k, v in self.base_env.items()),
                setpriv, "--no-new-privs", nsenter, f"--target={self.init_pid}", *self.flags,
                "--preserve-credentials", "--root", "--wd", "--", "/bin/sh", "-c", script, cwd, *argv]


def namespace_join(init_pid: int, *, image: str, instance: str) -> NamespaceJoin | None:
    """The join into the instance whose init is ``init_pid``; None where it cannot be made (its user
    namespace is not this user's, or ``nsenter``/``setpriv`` are missing), or ``init_pid`` is gone."""
    tools = _tools()
    if tools is None:
        return None
    try:
        differ = [name for name in _NSENTER_FLAGS
                  if os.readlink(f"/proc/{init_pid}/ns/{name}") != os.readlink(f"/proc/self/ns/{name}")]
        # An instance always has a mount and PID namespace of its own: joining nothing would start
        # the process on the host.
        if not {"mnt", "pid"} <= set(differ):
            return None
        if os.geteuid() != 0 and ("user" not in differ or _owner_uid(f"/proc/{init_pid}/ns/user") != os.geteuid()):
            return None
    except OSError:
        return None
    home = pwd.getpwuid(os.getuid()).pw_dir
    base_env = {"HOME": home, "LANG": "C", "TERM": "xterm", "PATH": DEFAULT_PATH}
    for prefix in ("APPTAINER", "SINGULARITY"):
        base_env |= {f"{prefix}_CONTAINER": image, f"{prefix}_NAME": os.path.basename(image.rstrip("/")),
                     f"{prefix}_INSTANCE": instance}
    return NamespaceJoin(init_pid, tuple(_NSENTER_FLAGS[n] for n in differ), base_env, tools)
