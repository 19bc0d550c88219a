"""Mount a size-capped tmpfs inside a running instance, as the user who owns its namespaces.

    python -I -S ns_tmpfs.py PID PATH SIZE_MB

An unprivileged Apptainer instance lives in a user namespace its user owns, so that user may
enter it and gets every capability there (none on the host): enough to mount a tmpfs in the
instance's mount namespace, the one filesystem (with FUSE, whose ``/dev/fuse`` is often closed
to ordinary users) that an unprivileged user can mount with a size. Writes past the size then
fail with ENOSPC inside, a hard cap where a host folder has none an unprivileged user may set.

It runs as its own short process, standard library only, because ``setns`` into a user namespace
needs a single-threaded caller (a worker runs threads), and the capabilities it grants are lost
at the next ``execve`` (so ``nsenter ... mount`` cannot do it).
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4


def mount_tmpfs_in(pid: int, path: str, size_mb: int) -> None:
    """Join ``pid``'s user and mount namespaces, then mount the tmpfs over ``path`` there."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    for ns, flag in (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            check(libc.setns(fd, flag), f"setns into the {ns} namespace of process {pid}")
        finally:
            os.close(fd)
    os.chdir("/")
    check(libc.mount(b"rolloutd-workspace", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                     f"size={size_mb}m,mode=0700".encode()), f"mount a {size_mb} MiB tmpfs at {path}")


if __name__ == "__main__":
    try:
        mount_tmpfs_in(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    except OSError as e:
        print(f"ns_tmpfs: {e.strerror}", file=sys.stderr)
        sys.exit(1)
