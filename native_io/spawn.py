"""Child processes for a long-lived event loop, started without fork().

A worker is a Python process of about 100 MB. fork() copies its page tables and write-protects
every page, so after each child the worker takes a copy-on-write fault on every page it touches
again: about 6-7 ms of worker CPU per child here, measured, for each shell, kernel and instance
started (uvloop's subprocesses and ``pty.fork`` both fork). ``subprocess.Popen`` starts children
with vfork (the child borrows the parent's memory until it execs), which costs the parent nothing
of the sort. These helpers put an asyncio face on it: the exit is watched through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import select
import signal
import struct
import subprocess
import termios
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

log = logging.getLogger(__name__)

DEVNULL = subprocess.DEVNULL
KILLED_EXIT_TIMEOUT_S = 5.0
"""After SIGKILL, how long a stopped process may take to be reaped."""
DEFAULTED_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
"""What a child starts with at its default action even where this process ignores it. A process
started in the background by a script (``cmd &``) ignores SIGINT and SIGQUIT, one under ``nohup``
SIGHUP, and an ignored signal stays ignored across exec: a shell's foreground command would then
shrug off the ^C that interrupts it (PtySession), and a sandbox's programs would inherit the
daemon's launch."""


class Child:
    """A started process: its pid, an awaitable exit, signals. Reaped by this object only."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = self._loop.create_future()
        """Resolves to the exit code (negative: killed by that signal) once the child is reaped."""
        self._on_exit: list[Callable[[int], None]] = []
        self._pidfd: int | None = os.pidfd_open(self.pid)
        self._loop.add_reader(self._pidfd, self._reap)

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit code)`` when the child is reaped, before ``exited`` resolves."""
        self._on_exit.append(callback)

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def send_signal(self, sig: int) -> None:
        if not self.exited.done():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal the child's process group (the child must lead one: a new session or group).
        Also after it exited: background jobs may still hold the group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return
        assert self._pidfd is not None
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        code = os.waitstatus_to_exitcode(status)
        # Popen must not reap (or warn about) a child it believes is still running.
        self._popen.returncode = code
        for callback in self._on_exit:
            callback(code)
        if not self.exited.done():
            self.exited.set_result(code)


async def spawn(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                stdin: int | IO[Any] | None = DEVNULL, stdout: int | IO[Any] | None = None,
                stderr: int | IO[Any] | None = None, start_new_session: bool = False) -> Child:
    """Start ``argv`` (OSError if it cannot be executed), with :data:`DEFAULTED_SIGNALS` at their
    default action."""
    with _ignored_signals_caught():
        popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                 start_new_session=start_new_session, close_fds=True)
    return Child(popen)


@contextlib.contextmanager
def _ignored_signals_caught() -> Iterator[None]:
    """Those of :data:`DEFAULTED_SIGNALS` this process ignores are caught, by a handler that does
    nothing, while a child starts: exec resets a caught signal to its default action, but keeps an
    ignored one ignored (and a preexec_fn, which could reset it in the child, would cost a fork).
    Only the main thread may set handlers; elsewhere the child inherits what this process has."""
    ignored = [s for s in DEFAULTED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    for sig in ignored:
        signal.signal(sig, _dropped)
    try:
        yield
    finally:
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)


def _dropped(_signum: int, _frame: Any) -> None:
    """Stands in for SIG_IGN while a child starts."""


async def spawn_pty(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                    rows: int = 50, cols: int = 250, echo: bool = False) -> tuple[Child, int]:
    """Start ``argv`` on a new pseudo-terminal as the leader of a new session whose controlling
    terminal it is (so ^C written to the terminal interrupts its foreground job). Returns the
    child and the terminal's controller side, which the caller owns."""
    controller, terminal = os.openpty()
    try:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        attrs = termios.tcgetattr(terminal)
        # NOFLSH: a ^C must not discard input already written after it (PtySession._interrupt).
        attrs[3] |= termios.NOFLSH
        if not echo:
            attrs[3] &= ~termios.ECHO
        termios.tcsetattr(terminal, termios.TCSANOW, attrs)
        # `setsid -c` (util-linux and BusyBox alike): a new session, then the terminal on stdin
        # becomes its controlling terminal (Popen has no such option; a preexec_fn would fork).
        child = await spawn(["setsid", "-c", *argv], env=env, cwd=cwd, stdin=terminal, stdout=terminal,
                            stderr=terminal)
    except BaseException:
        os.close(controller)
        raise
    finally:
        os.close(terminal)
    return child, controller


async def stop_group(proc: Child, exited: asyncio.Future[int], term_grace_s: float, *,
                     term_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> str:
    """``term_signals`` to the child's group, SIGKILL after ``term_grace_s``; the rung reached
    (``exited`` when it had already ended). Background jobs may hold the group after the leader
    died: the group always gets a last SIGKILL."""
    rung = "exited"
    if not exited.done():
        rung = "sigterm"
        for sig in term_signals:
            proc.signal_group(sig)
        try:
            await asyncio.wait_for(asyncio.shield(exited), term_grace_s)
        except TimeoutError:
            rung = "sigkill"
            proc.signal_group(signal.SIGKILL)
            try:
                await asyncio.wait_for(asyncio.shield(exited), KILLED_EXIT_TIMEOUT_S)
            except TimeoutError:
                log.error("process %d was not reaped within %.0f s of SIGKILL", proc.pid, KILLED_EXIT_TIMEOUT_S)
    proc.signal_group(signal.SIGKILL)
    return rung


class ProcessHandle:
    """A process we did not start (an instance's init), held by pidfd: signals and the exit wait
    reach that process even if its pid is reused meanwhile (pid_max is 32768 on many hosts)."""

    def __init__(self, pid: int) -> None:
        """Raises ProcessLookupError when ``pid`` is already gone."""
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)

    @property
    def alive(self) -> bool:
        if self._fd is None:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return not poller.poll(0)  # a pidfd turns readable when its process exits

    def signal(self, sig: int) -> None:
        if self._fd is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self._fd, sig)

    async def wait(self, timeout_s: float) -> bool:
        """Whether the process exited within ``timeout_s``."""
        if not self.alive:
            return True
        assert self._fd is not None
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
