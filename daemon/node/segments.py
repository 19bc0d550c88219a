"""Shared-memory result segments on their way to clients: who holds which, their return to the
worker arena that made them when released, and their reclaim when the client's process is gone."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.node.workers import Workers
from rolloutd.native_io import framing, shm
from rolloutd.native_io.procfs import pid_alive
from rolloutd.native_io.wire import MsgType


@dataclass
class Segment:
    client_pid: int | None
    client: bytes
    created_at: float = field(default_factory=time.monotonic)
    orphaned_at: float | None = None


class Segments:
    def __init__(self, workers: Workers, lease_timeout_s: float, counters: dict[str, int]) -> None:
        self._workers = workers
        self._lease_timeout_s = lease_timeout_s
        self._counters = counters
        self._held: dict[str, Segment] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def handed_out(self, names: list[str], client_pid: int | None, client: bytes) -> None:
        for name in names:
            self._held[name] = Segment(client_pid, client)

    def release(self, client: bytes, names: Any) -> None:
        """A client's RELEASE: only its own segments, and only names that are strings."""
        if not isinstance(names, list):
            return
        mine = [n for n in names if isinstance(n, str) and n in self._held and self._held[n].client == client]
        for name in mine:
            del self._held[name]
        self.give_back(mine)

    def give_back(self, names: list[str]) -> None:
        """Hand segments back to the worker arena that made them; unlink those of a dead worker."""
        prefix = self._workers.shm_prefix
        by_worker: dict[int, list[str]] = {}
        for name in names:
            owner = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
            w = None
            if owner.startswith("w") and "g" in owner:
                index, _, gen = owner[1:].partition("g")
                w = self._workers.get(int(index)) if index.isdigit() else None
                if w is not None and not (w.ready and gen.isdigit() and int(gen) == w.generation):
                    w = None
            if w is None:
                shm.unlink(name)
            else:
                by_worker.setdefault(w.index, []).append(name)
        for index, group in by_worker.items():
            try:
                self._workers[index].send(framing.encode(MsgType.RELEASE, {"segments": group}))
            except ConnectionError:
                for name in group:
                    shm.unlink(name)

    def reclaim_orphans(self, now: float) -> None:
        """Segments of a client whose process is gone go back after ``shm_lease_timeout_s``."""
        for name, seg in list(self._held.items()):
            if seg.client_pid is not None and not pid_alive(seg.client_pid):
                seg.orphaned_at = seg.orphaned_at or now
                if now - seg.orphaned_at >= self._lease_timeout_s:
                    del self._held[name]
                    self.give_back([name])
                    self._counters["segments_reclaimed"] += 1

    def unlink_unheld(self, prefix: str) -> None:
        """A dead worker's segments that no client holds (those held are unlinked on release)."""
        for name in shm.list_segments(prefix):
            if name not in self._held:
                shm.unlink(name)
