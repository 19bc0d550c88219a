"""What the watchdog checks each round: which sandboxes went over a cap, and which cap.

- ``max_processes``: the census of processes per sandbox (forks past it also fail: RLIMIT_NPROC).
- ``memory_mb``: with a memory cgroup (:mod:`.cgroups`) the kernel holds the sandbox to it and
  kills what goes over; the check reads that kill from the cgroup. Without one (or with one its
  processes could leave: ``Sandbox.cgroup_leavable``), also the resident
  memory of the sandbox's processes plus what its private ``/dev/shm`` holds, read from /proc:
  after the fact (once a round), so the per-process RLIMIT_AS (``process_memory_mb``) bounds the
  overshoot in between.
- ``workspace_mb``: where ``/workspace`` is a size-capped tmpfs (Apptainer), the kernel stops
  writes at the cap with ENOSPC and the check sees it full (a stat, every round). Where it is a
  host folder (the local backend; an ``overlay`` writable layer), the disk it holds, walked every
  ``disk_check_interval_s``; RLIMIT_FSIZE (one file at most ``workspace_mb``) bounds the overshoot
  in between, since no quota an unprivileged process may set exists for a host folder.

Everything here reads files: it runs in a thread, never on the loop.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rolloutd.native_io.procfs import rss_census

from .base import Sandbox

T = TypeVar("T")
MiB = 2**20
FULL_BYTES = 64 * 1024
"""A capped workspace with less room than this is full: writes past it fail."""


@dataclass(frozen=True)
class Breach:
    cap: str
    """The ``SandboxLimits`` field that was passed."""
    reason: str


def find_breaches(sandboxes: list[Sandbox], census: Counter[int], census_kind: str, *,
                  check_disk: bool) -> dict[str, Breach]:
    """The sandboxes over a cap, by id (one census, and one /proc pass for the memory of those
    whose cap no cgroup holds, for them all). ``census_kind``: what ``census`` counts by (``procfs.CENSUSES``)."""
    found: dict[str, Breach] = {}
    read = [sb for sb in sandboxes if _reads_proc_memory(sb) and sb.needs_census]
    rss = rss_census(census_kind, set().union(*(sb.census_keys() for sb in read))) if read else Counter()
    for sb in sandboxes:
        lim = sb.spec.limits
        count = sb.process_count(census)
        if count > lim.max_processes:
            found[sb.id] = Breach("max_processes", f"it ran {count} processes, over its limit of "
                                                   f"{lim.max_processes} (max_processes)")
            continue
        if lim.memory_mb is not None:
            if sb.cgroup is not None and (kills := sb.cgroup.oom_kills()):
                found[sb.id] = Breach("memory_mb", f"the kernel killed {kills} of its processes for going over "
                                                   f"its memory cap of {lim.memory_mb} MiB (memory_mb)")
                continue
            if _reads_proc_memory(sb):
                used = sb.proc_memory_bytes(rss) + sb.tmpfs_bytes()
                if used > lim.memory_mb * MiB:
                    found[sb.id] = Breach("memory_mb", f"its processes and tmpfs held {used // MiB} MiB, over "
                                                       f"its memory cap of {lim.memory_mb} MiB (memory_mb)")
                    continue
        free = sb.workspace_free_bytes() if lim.workspace_mb is not None else None
        if free is not None and free < FULL_BYTES:
            found[sb.id] = Breach("workspace_mb", f"it filled its {sb.workspace_inside} to its cap of "
                                                  f"{lim.workspace_mb} MiB (workspace_mb); writes past it failed")
            continue
        if check_disk and lim.workspace_mb is not None:
            used = sum(disk_usage(p) for p in sb.disk_folders())
            if used > lim.workspace_mb * MiB:
                found[sb.id] = Breach("workspace_mb", f"its files took {used // MiB} MiB of disk, over its cap of "
                                                      f"{lim.workspace_mb} MiB (workspace_mb)")
    return found


def with_thread_cpu(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``fn``'s answer and the CPU seconds this thread spent on it: a check run through
    ``asyncio.to_thread`` is timed in the thread it runs in, which nothing else uses meanwhile."""
    t0 = time.thread_time()
    return fn(*args, **kwargs), time.thread_time() - t0


def _reads_proc_memory(sb: Sandbox) -> bool:
    """Whether the memory cap is checked from /proc: no cgroup holds it, or one its processes may leave."""
    return sb.spec.limits.memory_mb is not None and (sb.cgroup is None or sb.cgroup_leavable)


def disk_usage(path: Path) -> int:
    """Bytes of disk the files under ``path`` take (links not followed; unreadable folders skipped)."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total
