"""Reading /proc: which processes live, in which session and PID namespace.

One pass over /proc serves every sandbox (the watchdog scans once per interval, not once per
sandbox), and on a node every worker (the supervisor takes it and sends it to them). Zombies count
as dead in ``live_processes``: orphans can wait a long time for PID 1 to reap them.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    comm: str
    session: int
    pidns: int | None
    """Inode of the process's PID namespace (None when it cannot be read)."""


def read_small(path: str | bytes, limit: int = 4096) -> bytes | None:
    """Up to ``limit`` bytes of a kernel file (/proc, cgroups); None when it cannot be read.
    os.open/os.read, not open(): the watchdog reads such files for every process or sandbox once
    a second, and a file object costs as much again as the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def pids(proc: str = "/proc") -> list[str]:
    """The process folders a procfs lists (OSError when it cannot be read)."""
    with os.scandir(proc) as entries:
        return [entry.name for entry in entries if entry.name.isdigit()]


def _stat(pid: int | str) -> bytes | None:
    return read_small(f"/proc/{pid}/stat")


def pid_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def pidns_of(pid: int | str, proc: str = "/proc") -> int | None:
    """Inode of ``pid``'s PID namespace (``pid`` as ``proc`` numbers it); None when it cannot be
    read (gone, or not ours)."""
    try:
        # The link reads "pid:[<inode>]": cheaper than a stat of it.
        return int(os.readlink(f"{proc}/{pid}/ns/pid")[5:-1])
    except (OSError, ValueError):
        return None


def pidns_census() -> Counter[int]:
    """Processes per PID namespace inode, zombies included (they hold a pid until reaped).

    One readlink per process and no stat parse: a fifth of what ``live_processes`` costs, and the
    watchdog runs it every second on hosts with hundreds of sandbox processes."""
    census: Counter[int] = Counter()
    for pid in pids():
        if (ns := pidns_of(pid)) is not None:
            census[ns] += 1
    return census


def live_processes() -> list[ProcInfo]:
    out = []
    for pid in pids():
        stat = _stat(pid)
        if stat is None:
            continue
        # Field 2 (comm) may hold spaces and parentheses: split after the last ')'.
        close = stat.rfind(b")")
        rest = stat[close + 2 :].split()
        if rest[0] == b"Z":
            continue
        out.append(ProcInfo(int(pid), stat[stat.find(b"(") + 1 : close].decode(errors="replace"),
                            int(rest[3]), pidns_of(pid)))  # rest: state, ppid, pgrp, session
    return out


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: str, proc: str = "/proc") -> int:
    statm = read_small(f"{proc}/{pid}/statm", 256)
    try:
        return int(statm.split()[1]) * _PAGE if statm is not None else 0
    except (IndexError, ValueError):
        return 0


def _session_of(pid: str) -> int | None:
    stat = _stat(pid)
    return None if stat is None else int(stat[stat.rfind(b")") + 2 :].split()[3])


def rss_census(kind: str, keys: set[int]) -> Counter[int]:
    """Resident bytes per PID namespace (``kind`` "pidns") or session ("session"), for the keys
    asked: one pass over /proc that reads memory only of the processes in ``keys`` (pages two of
    them share count twice: an upper bound)."""
    key_of = pidns_of if kind == "pidns" else _session_of
    out: Counter[int] = Counter()
    for pid in pids():
        if (key := key_of(pid)) in keys:
            out[key] += _rss(pid)
    return out


def namespace_proc(init_pid: int, pidns: int | None) -> str | None:
    """The procfs of ``init_pid``'s PID namespace (inode ``pidns``), as its own root shows it: it
    lists every process of that namespace and of the namespaces nested in it, zombies included.
    None when that mount is not a procfs of the namespace (a host /proc bound in) or cannot be read."""
    proc = f"/proc/{init_pid}/root/proc"
    # Pid 1 there is the namespace's init when the mount belongs to the namespace.
    return proc if pidns is not None and pidns_of(1, proc) == pidns else None


def count_processes(proc: str) -> int | None:
    """Processes a procfs lists; None when it cannot be read (its namespace is gone)."""
    try:
        return len(pids(proc))
    except OSError:
        return None


def resident_bytes(proc: str) -> int:
    """Resident bytes of the processes a procfs lists (pages two of them share count twice)."""
    try:
        return sum(_rss(pid, proc) for pid in pids(proc))
    except OSError:
        return 0


def session_census() -> Counter[int]:
    """Live processes per session id."""
    return Counter(p.session for p in live_processes())


CENSUSES: dict[str, Callable[[], Counter[int]]] = {"pidns": pidns_census, "session": session_census}
"""The node-wide counts a sandbox backend's watchdog reads, by what they count processes per."""

CENSUS_INTERVAL_S = 1.0
"""How often the sandbox watchdogs count processes, and the supervisor takes its census for them."""
