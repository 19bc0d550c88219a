"""What a process's open file descriptors point at, read from /proc."""

from __future__ import annotations

import os


def descriptor_targets(pid: int | str = "self") -> list[str]:
    """The targets of ``pid``'s open descriptors (``/proc/PID/fd`` links: paths, ``pipe:[n]``,
    ``anon_inode:inotify``...); descriptors closed while they are read are left out, and a process
    gone (or not ours to read) has none."""
    folder = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(folder)
    except OSError:
        return []
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"{folder}/{fd}"))
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return targets
