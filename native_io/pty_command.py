"""What a PTY session needs for each command besides the terminal: the file the shell sources,
the sentinels' tokens, and the turns that keep its commands one at a time."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .host_files import create, open_folder
from .output import OutputCollector

COMMAND_FILE = "cmd.sh"
_SENTINEL_RE = re.compile(rb"\x1eRLD([0-9a-f]{16}):(-?\d+)\x1e\n")
# Longest tail that can still be the start of a sentinel: \x1eRLD + 16 hex + : + rc + \x1e\n
_SENTINEL_HOLD = 4 + 16 + 1 + 12 + 2


class CommandFile:
    """The file the shell sources for each command (the PTY carries only a short line naming it)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._dir_fd: int | None = None
        """The folder, held from the first write on: the sandbox can write in it (see host_files)."""
        self._fd: int | None = None
        self._size = 0

    def write(self, payload: bytes) -> None:
        # One descriptor held open and rewritten in place: open(O_TRUNC) costs ~0.3 ms on ext4
        # with discard, more than the whole command round trip.
        if self._fd is None:
            self._fd = self._create(COMMAND_FILE)
            self._size = 0
        os.pwrite(self._fd, payload, 0)
        if len(payload) < self._size:  # a longer or equal payload covers the last one whole
            os.ftruncate(self._fd, len(payload))
        self._size = len(payload)

    def disarm(self) -> None:
        # On a loaded node the ^C can land before the shell has read the line that sources the
        # command file; that line then still runs after the interrupt (the terminal keeps it,
        # see NOFLSH in spawn_pty). An empty file renamed over the command makes that late run a
        # no-op; a shell that already opened the old file is running it, and the ^C stops it.
        # A rename, not a truncation: a shell reading the file sees all of it or none.
        fd = self._create(f"{COMMAND_FILE}.next")
        os.rename(f"{COMMAND_FILE}.next", COMMAND_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._size = 0

    def _create(self, name: str) -> int:
        if self._dir_fd is None:
            self._dir_fd = open_folder(self._folder)
        # Readable by the shell's user whoever writes it; the folder (0700) keeps everyone else out.
        return create(self._dir_fd, name, mode=0o644)

    def close(self) -> None:
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dir_fd = None


class SentinelTokens:
    """Each command's sentinel carries a token of its own, so a late sentinel (of a command that was
    interrupted) never ends the next one: the session's random half, then a count (a random token
    per command cost a getrandom(2) each)."""

    def __init__(self) -> None:
        self._key = secrets.token_hex(4)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._key}{next(self._count) & 0xFFFFFFFF:08x}"


class OutputScanner:
    """The terminal's output as it comes: the sentinels that end commands, and what comes before
    them, which goes to the running command's collector (none: nobody's, dropped)."""

    def __init__(self) -> None:
        self._scan = bytearray()
        self.collector: OutputCollector | None = None

    def start(self, collector: OutputCollector) -> None:
        """A new command: what was read so far is not its output."""
        self._scan.clear()
        self.collector = collector

    def feed(self, chunk: bytes, on_sentinel: Callable[[str, int], None]) -> None:
        """Take ``chunk``; ``on_sentinel(token, exit code)`` for each sentinel it completes."""
        self._scan += chunk
        while True:
            m = _SENTINEL_RE.search(self._scan)
            if m is None:
                break
            before = memoryview(self._scan)[: m.start()]
            if self.collector is not None:
                self.collector.add(before)
            before.release()
            token, rc = m.group(1).decode(), int(m.group(2))
            del self._scan[: m.end()]
            on_sentinel(token, rc)
            # Whatever follows belongs to no command yet (a background job's output).
        if len(self._scan) > _SENTINEL_HOLD:
            # Keep the last bytes back: they may be the start of a sentinel still arriving.
            cut = len(self._scan) - _SENTINEL_HOLD
            if self.collector is not None:
                self.collector.add(memoryview(self._scan)[:cut])
            del self._scan[:cut]

    def flush(self) -> None:
        """No sentinel can follow (the shell died): what is held back goes to the collector."""
        if self.collector is not None:
            self.collector.add(self._scan)
        self._scan.clear()


class Turns:
    """A session's commands one at a time, in arrival order. Unlike ``asyncio.Lock`` it can be
    taken without awaiting (:meth:`take_now`), so a command that finds the shell free starts in
    the callback that received it, with no task and no round of the event loop."""

    def __init__(self) -> None:
        self._busy = False
        self._queue: deque[asyncio.Future[None]] = deque()
        """Callers waiting for a turn; when ``_busy`` is False it is empty."""

    def locked(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> int:
        """Callers queued for a turn (cancelled ones not yet skipped included)."""
        return len(self._queue)

    def take_now(self) -> bool:
        """Take the turn if nobody has it; False (nothing taken) otherwise."""
        if self._busy:
            return False
        self._busy = True
        return True

    async def take(self) -> None:
        if self.take_now():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                if waiter in self._queue:  # give() may have skipped it already
                    self._queue.remove(waiter)
            else:  # handed the turn, then cancelled before it ran: pass the turn on
                self.give()
            raise

    def give(self) -> None:
        """End the current turn: the next live waiter gets it, or nobody."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the turn passes on; _busy stays True
                return
        self._busy = False

    async def __aenter__(self) -> None:
        await self.take()

    async def __aexit__(self, *exc: object) -> None:
        self.give()
