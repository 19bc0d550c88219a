"""Waiting on an event loop for names to appear in a folder (Linux inotify through libc), instead
of polling for them.

A starting kernel binds its ipc sockets a few hundred milliseconds after it is spawned. ZeroMQ
sockets connected before that retry their connect on a timer in ZeroMQ's I/O thread, which cost
the worker about 4 ms of CPU per kernel start at a 10 ms retry. Connecting once the socket files
exist costs nothing while waiting.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_READ_BYTES = 64 * 1024

_libc = ctypes.CDLL(None, use_errno=True)


def _checked(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class NamesAppear:
    """Names that must appear in ``folder``. Watching starts when the object is made, so make it
    before starting what creates them; a name already there counts too."""

    def __init__(self, folder: Path, names: Iterable[str]) -> None:
        self._folder = folder
        self._missing = set(names)
        self._fd = _checked(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")
        try:
            # Not through a link: the folder may be one a sandbox can write to.
            _checked(_libc.inotify_add_watch(self._fd, os.fsencode(folder),
                                             _IN_CREATE | _IN_MOVED_TO | _IN_ONLYDIR | _IN_DONT_FOLLOW),
                     f"watching {folder}")
        except BaseException:
            os.close(self._fd)
            raise

    async def wait(self) -> None:
        """Until every name has appeared (bound the wait with a timeout)."""
        if not self._still_missing():
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            # The events only say when to look: the folder is asked, so an overflowed event queue
            # (a sandbox making many files there) or a name made and removed again cannot mislead.
            self._drain()
            if not self._still_missing() and not done.done():
                done.set_result(None)

        fd = self._fd
        loop.add_reader(fd, readable)
        try:
            await done
        finally:
            loop.remove_reader(fd)

    def _still_missing(self) -> set[str]:
        self._missing = {n for n in self._missing if not os.path.lexists(self._folder / n)}
        return self._missing

    def _drain(self) -> None:
        while True:
            try:
                os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return

    def close(self) -> None:
        """After any ``wait`` has returned: an event loop must not watch a closed descriptor, whose
        number the next one opened gets."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> NamesAppear:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
