"""Memory caps per sandbox by cgroup: one memory cgroup per sandbox, under one this process may write.

The kernel then holds a sandbox's memory (its processes, and the tmpfs pages they write:
``/dev/shm``, the writable layer) to its cap: an allocation past it is OOM-killed inside the
sandbox, never elsewhere, and the watchdog sees the kill in the cgroup's counters and ends the
sandbox (SANDBOX_LIMIT ``memory_mb``).

Where the parent comes from:

- ``$ROLLOUTD_MEMORY_CGROUP``: a folder handed down. A root node daemon makes one under its own
  memory cgroup and gives it to the sandbox user its workers run as (:func:`delegate`).
- Otherwise this process's own memory cgroup, when it may write there (root; a user whose
  systemd delegated its slice).

Both cgroup v1 (a ``memory`` hierarchy) and v2 (a unified hierarchy whose ``cgroup.controllers``
lists ``memory``) work the same way through :class:`Flavor`; a parent is used only once a real
process was moved into a cgroup made there (:meth:`MemoryCgroups.can_join`). Where none passes (an
ordinary user on most clusters; v2 under a root daemon, whose workers live outside the folder it
hands them) there is none, and the watchdog falls back to the resident memory it reads from /proc
(see :mod:`.caps`). Only v1 is exercised by the tests. On the machine they were written on the
unified hierarchy (``/sys/fs/cgroup/unified``; another ``mount -t cgroup2`` shows the same one)
offers only ``hugetlb``: ``+memory`` in its ``subtree_control`` fails with ENOENT, since v1 holds
the memory controller, and v1's hierarchy holds the host's own cgroups, so it cannot be handed
over. What v2 delegation needs was checked there all the same, on a folder of that hierarchy
handed to the sandbox user: a process of that user outside the folder cannot be moved into it
(the write to ``cgroup.procs`` fails: v2 wants write access to the common ancestor), one inside a
leaf of it can move its children into a sibling. So a root daemon on v2 would have to start its
workers inside the folder it delegates; it does not yet, and the watchdog holds memory there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rolloutd.native_io.procfs import read_small

log = logging.getLogger(__name__)

CGROUP_ENV = "ROLLOUTD_MEMORY_CGROUP"
SANDBOX_PREFIX = "sb-"
"""Names of the sandboxes' cgroups: only in these are processes killed (see _rmdir_when_empty)."""
DELEGATED_PREFIX = "rolloutd-"
RECORD_FILE = "memory-cgroup"
"""In a root daemon's run folder: the path of the memory cgroup it delegated."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
REMOVE_WAIT_S = 2.0
"""How long a stopped sandbox's cgroup may stay busy (its processes exiting) before it is left."""


@dataclass(frozen=True)
class Flavor:
    """The files of one cgroup version's memory controller."""

    version: int
    limit_files: tuple[str, ...]
    events_file: str
    """Holds the ``oom_kill`` counter."""
    delegated_files: tuple[str, ...]
    """Besides the folder, what a delegate must own to make and fill children."""


V1 = Flavor(1, ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), "memory.oom_control", ("cgroup.procs", "tasks"))
V2 = Flavor(2, ("memory.max", "memory.swap.max"), "memory.events", ("cgroup.procs", "cgroup.subtree_control"))


@dataclass(frozen=True)
class SandboxCgroup:
    """One sandbox's memory cgroup."""

    path: Path
    flavor: Flavor
    limit_mb: int

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (what it starts stays there)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    @functools.cached_property
    def _events_path(self) -> bytes:
        return os.fsencode(self.path / self.flavor.events_file)

    def oom_kills(self) -> int:
        """Processes the kernel killed for going over the cap (0 when unreadable)."""
        # A path made once: the watchdog reads this for every sandbox every round, and a Path
        # join costs more than the read itself.
        text = read_small(self._events_path) or b""
        at = text.find(b"oom_kill ")
        return int(text[at + 9:].split(None, 1)[0]) if at >= 0 else 0

    def remove(self) -> None:
        """Remove the folder once its processes are gone (they are being killed)."""
        _rmdir_when_empty(self.path)


class MemoryCgroups:
    """Makes a memory cgroup per sandbox under ``parent``."""

    def __init__(self, parent: Path, flavor: Flavor) -> None:
        self.parent = parent
        self.flavor = flavor

    @classmethod
    def discover(cls) -> MemoryCgroups | None:
        """From ``$ROLLOUTD_MEMORY_CGROUP``, else this process's own memory cgroup; None when
        neither is writable."""
        handed = os.environ.get(CGROUP_ENV)
        for path in ([Path(handed)] if handed else own_memory_cgroups()):
            flavor = flavor_of(path)
            if flavor is not None and os.access(path, os.W_OK) and _enable_memory(path, flavor):
                found = cls(path, flavor)
                if found.can_join():
                    return found
        return None

    def can_join(self) -> bool:
        """Whether a child of this process may move into a cgroup made here: cgroup v2 also wants
        write access to the common ancestor, which a folder handed down without the workers in it
        does not give. Probed once, with a real process, rather than inferred."""
        probe = self.create(f"{SANDBOX_PREFIX}probe-{os.getpid()}", 64)
        try:
            done = subprocess.run(probe.join_argv(["true"]), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("no memory cgroups under %s (%s): the watchdog reads /proc instead", self.parent, e)
            return False
        finally:
            probe.remove()
        if done.returncode != 0:
            log.warning("no memory cgroups under %s (cannot move a process there: %s): the watchdog reads /proc "
                        "instead", self.parent, done.stderr.decode(errors="replace").strip()[-300:])
        return done.returncode == 0

    def create(self, name: str, limit_mb: int) -> SandboxCgroup:
        path = self.parent / name
        path.mkdir(exist_ok=True)
        limit = str(limit_mb * 2**20)
        for file in self.flavor.limit_files:  # memory, then memory with swap: no swapping past it
            with contextlib.suppress(FileNotFoundError):  # no swap accounting on this kernel
                (path / file).write_text(limit)
        return SandboxCgroup(path, self.flavor, limit_mb)

    def describe(self) -> str:
        return f"cgroup v{self.flavor.version} {self.parent}"


def flavor_of(path: Path) -> Flavor | None:
    if (path / "memory.limit_in_bytes").exists():
        return V1
    with contextlib.suppress(OSError):
        if "memory" in (path / "cgroup.controllers").read_text().split():
            return V2
    return None


def own_memory_cgroups() -> list[Path]:
    """This process's memory cgroup folders: the v2 one (when its hierarchy has the memory
    controller), then the v1 one."""
    found: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                if (mount / "cgroup.controllers").exists():
                    found.insert(0, mount / rel.lstrip("/"))
        elif "memory" in controllers.split(","):
            found.append(CGROUP_ROOT / "memory" / rel.lstrip("/"))
    return found


def _enable_memory(path: Path, flavor: Flavor) -> bool:
    """v2 gives children a controller only when the parent lists it in ``subtree_control``."""
    if flavor is V1:
        return True
    try:
        if "memory" not in (path / "cgroup.subtree_control").read_text().split():
            (path / "cgroup.subtree_control").write_text("+memory")
        return True
    except OSError:
        return False


def delegate(key: str, uid: int, gid: int, record: Path) -> Path | None:
    """A folder (``rolloutd-<key>``) under this (root) process's own memory cgroup that ``uid`` may
    fill with sandbox cgroups, for :data:`CGROUP_ENV`; None when there is no writable memory cgroup. Its path is
    written to ``record`` (in the run folder), so that whoever cleans up after the daemon, even a
    ``node stop`` after a kill -9 from another cgroup, finds it (:func:`remove_delegated`)."""
    remove_delegated(record)  # a killed daemon's leftovers
    own = MemoryCgroups.discover()
    if own is None:
        return None
    path = own.parent / f"{DELEGATED_PREFIX}{key}"
    remove_tree(path)
    path.mkdir(exist_ok=True)
    os.chown(path, uid, gid)
    for file in own.flavor.delegated_files:
        with contextlib.suppress(FileNotFoundError):
            os.chown(path / file, uid, gid)
    record.write_text(str(path))
    return path


def remove_delegated(record: Path) -> None:
    """Remove the folder :func:`delegate` recorded in ``record``, and the record."""
    try:
        path = Path(record.read_text().strip())
    except FileNotFoundError:
        return
    if path.is_relative_to(CGROUP_ROOT) and path.name.startswith(DELEGATED_PREFIX):  # whatever the file says
        remove_tree(path)
    record.unlink(missing_ok=True)


def remove_tree(path: Path) -> None:
    """Remove a cgroup folder and its children, deepest first, each once its processes are gone."""
    if not path.is_dir():
        return
    for child in path.iterdir():
        if child.is_dir():
            remove_tree(child)
    _rmdir_when_empty(path)


def _rmdir_when_empty(path: Path) -> None:
    """rmdir ``path``, which fails while processes are in it. Every process in a sandbox's cgroup
    is the sandbox's (its workers and the daemon live elsewhere), so what is still there once the
    sandbox was stopped is killed: stragglers exiting, and orphans no other record names (an
    instance whose start finished after its worker was gone). Left there (and said) after
    :data:`REMOVE_WAIT_S`."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    killed: set[int] = set()
    while True:
        try:
            path.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError as e:
            if time.monotonic() > deadline:
                log.warning("memory cgroup %s not removed (%s); the next start on this run folder removes it",
                            path, e)
                break
            if path.name.startswith(SANDBOX_PREFIX):  # never elsewhere, whatever a record says
                killed |= _kill_members(path)
            time.sleep(0.02)
    if killed:
        log.warning("killed %d processes left in memory cgroup %s", len(killed), path)


def _kill_members(path: Path) -> set[int]:
    try:
        pids = {int(line) for line in (path / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids
