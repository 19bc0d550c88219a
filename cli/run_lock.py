"""One daemon of each kind per run folder: an exclusive ``flock`` on ``<run folder>/<kind>.lock``.

Taken before the daemon touches anything (pidfile, sockets, worker state) and held for its whole
life by an open descriptor that no child inherits, so the kernel releases it however the daemon
ends, ``kill -9`` included. A pidfile alone cannot give this: two starts at once both saw "none
running", and the loser's clean-up then killed the winner's workers and deleted its pidfile.

The holder's pid is read from ``/proc/locks`` (the kernel's own record, matched by the lock file's
device and inode), so asking who holds the lock never takes it, and a stale or missing pidfile
cannot mislead ``stop``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from rolloutd.native_io.errors import DaemonRunning


def lock_path(run_path: Path, kind: str) -> Path:
    return run_path / f"{kind}.lock"


def running_pid(run_path: Path, kind: str) -> int | None:
    """The daemon of ``kind`` (``node``, ``router``) holding ``run_path``, None when none runs."""
    return lock_holder(lock_path(run_path, kind))


def lock_holder(path: Path) -> int | None:
    """The pid holding ``path``'s flock, or None when nobody does (or the file does not exist)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as locks:
        for line in locks:
            # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; waiters are marked "->"
            fields = line.split()
            if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
                continue
            if fields[5] == wanted:
                return int(fields[4])
    return None


class RunFolderLock:
    """The held lock; ``release`` is only for a clean exit (the kernel drops it on any other)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def take(cls, run_path: Path, kind: str, what: str) -> RunFolderLock:
        """Hold ``kind``'s lock in ``run_path`` or raise DaemonRunning naming the holder."""
        path = lock_path(run_path, kind)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = lock_holder(path)
            raise DaemonRunning(f"a {what} already runs on {run_path} (pid {holder}, holding {path}); it was left "
                                f"untouched. Stop it with `rolloutd {kind} stop`, or give this one another run "
                                "folder (--run-dir)") from None
        return cls(path, fd)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
