"""Mounts made inside a running instance, as the user who owns its namespaces.

    python -I -S ns_mounts.py PID [--workspace PATH SIZE_MB] [--seal-cgroups]

An unprivileged Apptainer instance lives in a user namespace its user owns, so that user may
enter it and gets every capability there (none on the host): enough to change the instance's
mount namespace, which its own processes (without capabilities) cannot undo, and which a
namespace they make themselves inherits locked.

- ``--workspace``: a tmpfs of SIZE_MB over PATH, the one filesystem (with FUSE, whose
  ``/dev/fuse`` is often closed to ordinary users) that an unprivileged user can mount with a
  size. Writes past it then fail with ENOSPC inside, a hard cap where a host folder has none an
  ordinary user may set.
- ``--seal-cgroups``: every mount at or under ``/sys/fs/cgroup`` made read-only. Apptainer binds
  the host's ``/sys``, and a sandbox's processes run as the user that owns its memory cgroup, its
  siblings' and (under a root daemon) the folder above them: through a writable cgroup
  filesystem they could move themselves out of their cgroup and its memory cap. Read-only, they
  still read their own limits.

Exit status: 0, or the sum of 1 (the workspace failed) and 2 (the seal failed), each failure
named on stderr; arguments it cannot read count as both failing.

It runs as its own short process, standard library only, because ``setns`` into a user namespace
needs a single-threaded caller (a worker runs threads), and the capabilities it grants are lost
at the next ``execve`` (so ``nsenter ... mount`` cannot do it).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_RELATIME = 0x200000
MS_STRICTATIME = 0x1000000
CGROUP_ROOT = "/sys/fs/cgroup"
# A remount in a namespace that is not the mount's own must keep the flags it was made with
# (they are locked): the ones mountinfo shows per mount.
_KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
WORKSPACE_FAILED = 1
SEAL_FAILED = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    # Made on first use: the worker imports this module only for its exit codes.
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(pid: int) -> None:
    """Join ``pid``'s user and mount namespaces."""
    for ns, flag in (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc().setns(fd, flag), f"setns into the {ns} namespace of process {pid}")
        finally:
            os.close(fd)
    os.chdir("/")


def mount_tmpfs(path: str, size_mb: int) -> None:
    _check(_libc().mount(b"rolloutd-workspace", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                       f"size={size_mb}m,mode=0700".encode()), f"mount a {size_mb} MiB tmpfs at {path}")


def cgroup_mounts(pid: int) -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount at or under /sys/fs/cgroup that ``pid`` sees,
    outermost first. Read from the host's /proc before entering: the instance's own /proc has no
    ``self`` for a process outside its PID namespace."""
    found = []
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point = fields[4]
            if point == CGROUP_ROOT or point.startswith(CGROUP_ROOT + "/"):
                options = fields[5].split(",")
                found.append((point, sum(_KEPT_FLAGS.get(o, 0) for o in options)))
    return found


def seal_cgroups(mounts: list[tuple[str, int]]) -> None:
    """Make every mount of ``cgroup_mounts`` read-only (inside the namespace)."""
    for point, kept in mounts:
        _check(_libc().mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None),
               f"make {point} read-only")


USAGE = "usage: ns_mounts.py PID [--workspace PATH SIZE_MB] [--seal-cgroups]"


def parse_args(argv: list[str]) -> tuple[int, tuple[str, int] | None, bool]:
    """(pid, (path, size in MB) or None, seal?); ValueError on anything else. Not argparse: its
    imports were half of this process's CPU, ~15 of 31 ms per sandbox start."""
    args = list(argv)
    seal = "--seal-cgroups" in args
    if seal:
        args.remove("--seal-cgroups")
    workspace = None
    if "--workspace" in args:
        at = args.index("--workspace")
        path, size_mb = args[at + 1:at + 3]
        workspace = (path, int(size_mb))
        del args[at:at + 3]
    (pid,) = args
    return int(pid), workspace, seal


def main(argv: list[str]) -> int:
    try:
        pid, workspace, seal = parse_args(argv)
    except ValueError:
        print(f"ns_mounts: cannot read the arguments {argv}; {USAGE}", file=sys.stderr)
        return WORKSPACE_FAILED + SEAL_FAILED
    try:
        cgroups = cgroup_mounts(pid) if seal else []
        enter(pid)
    except OSError as e:
        print(f"ns_mounts: {e.strerror}", file=sys.stderr)
        return (WORKSPACE_FAILED if workspace else 0) + (SEAL_FAILED if seal else 0)
    status = 0
    if workspace:
        try:
            mount_tmpfs(*workspace)
        except OSError as e:
            print(f"ns_mounts: workspace: {e.strerror}", file=sys.stderr)
            status += WORKSPACE_FAILED
    if seal:
        try:
            seal_cgroups(cgroups)
        except OSError as e:
            print(f"ns_mounts: cgroups: {e.strerror}", file=sys.stderr)
            status += SEAL_FAILED
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
