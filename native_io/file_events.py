"""Waiting on an event loop for names to appear in a folder (Linux inotify through libc), instead
of polling for them.

A starting kernel binds its ipc sockets a few hundred milliseconds after it is spawned. ZeroMQ
sockets connected before that retry their connect on a timer in ZeroMQ's I/O thread, which cost
the worker about 4 ms of CPU per kernel start at a 10 ms retry. Connecting once the socket files
exist costs nothing while waiting.

A user may hold only 128 inotify instances by default (``fs.inotify.max_user_instances``), and
a worker runs as the user its sandboxes run as, whose processes may hold some too; watches are
plentiful. So the waits of one event loop share one instance, open while any wait is; it is
closed off the loop (see ``_Instance.close``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_EVENT = struct.Struct("iIII")
"""struct inotify_event: watch descriptor, mask, cookie, length of the name that follows."""
_OVERFLOW_WD = -1
"""The watch descriptor of IN_Q_OVERFLOW: events were lost, of any watch."""
_READ_BYTES = 64 * 1024

_libc = ctypes.CDLL(None, use_errno=True)


def _checked(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class _Instance:
    """One inotify instance on one event loop; calls a watch's listeners on any event of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fd = _checked(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")
        self._listeners: dict[int, list[Callable[[], None]]] = defaultdict(list)
        loop.add_reader(self._fd, self._readable)

    def listen(self, folder: Path, listener: Callable[[], None]) -> int:
        # Not through a link: the folder may be one a sandbox can write to. A folder watched
        # already gets the same descriptor back.
        wd = _checked(_libc.inotify_add_watch(self._fd, os.fsencode(folder),
                                              _IN_CREATE | _IN_MOVED_TO | _IN_ONLYDIR | _IN_DONT_FOLLOW),
                      f"watching {folder}")
        self._listeners[wd].append(listener)
        return wd

    def forget(self, wd: int, listener: Callable[[], None]) -> None:
        listeners = self._listeners[wd]
        listeners.remove(listener)
        if not listeners:
            del self._listeners[wd]
            _libc.inotify_rm_watch(self._fd, wd)  # fails harmlessly where the folder is gone already

    @property
    def idle(self) -> bool:
        """No listener is left: the instance can close."""
        return not self._listeners

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        # Not on the loop: closing an instance that had watches waits for the kernel to free them
        # (an SRCU grace period), which held the loop 3-17 ms per kernel start here.
        try:
            self._loop.run_in_executor(None, os.close, self._fd)
        except RuntimeError:  # the loop's executor is shut down: the loop is ending anyway
            os.close(self._fd)

    def _readable(self) -> None:
        woken: set[int] = set()
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                break
            at = 0
            while at < len(data):
                wd, _, _, size = _EVENT.unpack_from(data, at)
                woken.add(wd)
                at += _EVENT.size + size
        everyone = _OVERFLOW_WD in woken
        for wd, listeners in list(self._listeners.items()):
            if everyone or wd in woken:
                for listener in list(listeners):
                    listener()


_instances: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Instance] = weakref.WeakKeyDictionary()


class NamesAppear:
    """Names that must appear in ``folder``. Watching starts when the object is made (on the
    running loop), so make it before starting what creates them; a name already there counts too.
    OSError when the folder cannot be watched."""

    def __init__(self, folder: Path, names: Iterable[str]) -> None:
        self._missing = {os.path.join(folder, n) for n in names}
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        instance = _instances.get(self._loop)
        if instance is None:
            instance = _instances[self._loop] = _Instance(self._loop)
        self._instance: _Instance | None = instance
        try:
            self._wd = instance.listen(folder, self._changed.set)
        except BaseException:
            self._instance = None
            self._close_if_idle(instance)
            raise

    async def wait(self) -> None:
        """Until every name has appeared (bound the wait with a timeout)."""
        # The events only say when to look: the folder is asked, so an overflowed event queue
        # (a sandbox making many files there) or a name made and removed again cannot mislead.
        while self._still_missing():
            await self._changed.wait()
            self._changed.clear()

    def _still_missing(self) -> set[str]:
        self._missing = {path for path in self._missing if not os.path.lexists(path)}
        return self._missing

    def close(self) -> None:
        instance, self._instance = self._instance, None
        if instance is not None:
            instance.forget(self._wd, self._changed.set)
            self._close_if_idle(instance)

    def _close_if_idle(self, instance: _Instance) -> None:
        if instance.idle:
            instance.close()
            del _instances[self._loop]

    def __enter__(self) -> NamesAppear:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
