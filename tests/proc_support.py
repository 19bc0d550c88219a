"""Checking that processes are gone when pids get reused.

pid_max is 32768 on these machines and the suite starts thousands of processes, so a pid seen
in a sandbox may belong to an unrelated new process a moment later: a process is identified by
its pid and its start time (field 22 of /proc/<pid>/stat).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import psutil


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()  # fields from 3 (state) on


def identities(pids: Iterable[int]) -> dict[int, bytes]:
    """pid -> start time, for the pids alive now."""
    out = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = fields[19]
    return out


def still_running(seen: dict[int, bytes]) -> list[int]:
    """The processes of ``seen`` that still run (zombies count as gone)."""
    alive = []
    for pid, started in seen.items():
        fields = _stat_fields(pid)
        if fields is not None and fields[19] == started and fields[0] != b"Z":
            alive.append(pid)
    return alive


def named(pids: Iterable[int], word: str) -> list[psutil.Process]:
    """The processes of ``pids`` with ``word`` in their command line; one that exits while they
    are read (a sandbox's short-lived commands do) is left out, not an error."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if word in process.cmdline():
                found.append(process)
    return found
