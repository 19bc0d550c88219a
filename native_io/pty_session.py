"""A persistent bash in a pseudo-terminal, driven from the event loop with sentinel framing.

Why this shape:
- One long-lived ``bash --norc --noprofile`` per sandbox keeps cwd and environment between
  commands and costs ~0.2 ms per command, against ~45 ms for a process per command.
- The command text is written to a file in a folder the shell can see and *sourced* with stdin
  from /dev/null: the PTY line discipline caps a line at 4 KiB, heredocs and multi-line text
  then need no quoting, and a command that reads stdin gets EOF instead of eating our framing.
- After the command the shell prints ``\\x1eRLD<token>:<exit code>\\x1e`` with a fresh random
  token, so no output can fake the end of a command. Echo and ``\\n``→``\\r\\n`` are off, so the
  output is byte-exact.
- The PTY file descriptor is attached to the loop with ``add_reader``; the child is started
  with vfork, not fork (see ``spawn``), and reaped through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CommandTimeout, SessionError
from .output import OutputCollector, tail
from .pty_command import COMMAND_FILE, CommandFile, OutputScanner, SentinelTokens, Turns
from .spawn import Child, spawn_pty, stop_group

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    """The command's exit status; 128+N when a signal ended it."""
    output: str
    """stdout and stderr interleaved as the terminal saw them, UTF-8 with invalid bytes replaced;
    when truncated, the head and the tail joined by a marker line."""
    truncated: bool
    output_bytes: int
    """Total bytes the command printed, kept or not."""
    duration_s: float
    shell_restarted: bool = False
    """True when the command ended the shell (``exit``) and a fresh one was started."""


@dataclass
class PtyShellConfig:
    argv: list[str]
    """How to start the shell, e.g. ``["bash", "--norc", "--noprofile"]`` or an
    ``apptainer exec instance://X bash ...`` prefix."""
    command_dir_host: Path
    """Folder where command files are written (host path)."""
    command_dir_shell: str
    """The same folder as the shell sees it (inside the container)."""
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    init_script: str = ""
    """Shell text run once after start-up (limits, environment) before the first command."""
    max_output_bytes: int = 64 * 1024
    """Output kept per command (half head, half tail); the rest is counted, not kept."""
    start_timeout_s: float = 30.0
    interrupt_grace_s: float = 1.0
    """After SIGINT, how long the shell has to come back before it is killed and respawned."""
    term_grace_s: float = 0.5


Done = Callable[["CommandResult | BaseException"], None]
"""Where :meth:`PtySession.start_now` sends what :meth:`PtySession.run` would return or raise."""


@dataclass
class _Command:
    """One command, from the write of its line to its sentinel."""

    collector: OutputCollector
    timeout_s: float
    waiter: asyncio.Future[int]
    """Gets the sentinel's exit code (the reader), or the timeout, the shell's exit, a cancel."""
    timer: asyncio.TimerHandle
    t0: float = field(default_factory=time.monotonic)

    def result(self, rc: int, *, restarted: bool) -> CommandResult:
        out, truncated = self.collector.text()
        return CommandResult(exit_code=rc, output=out, truncated=truncated, output_bytes=self.collector.total,
                             duration_s=time.monotonic() - self.t0, shell_restarted=restarted)


def _write_all(fd: int | None, data: bytes, name: str) -> None:
    assert fd is not None
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            # The line is tiny; a full PTY input queue means the shell is wedged.
            raise SessionError(f"shell {name!r} is not reading its input") from None
        view = view[n:]


class ShellTerminal:
    """A bash on a pseudo-terminal: its process (started, stopped, restarted), the terminal's
    output, and control lines that each end with a sentinel. :class:`PtySession` runs commands
    on it."""

    def __init__(self, config: PtyShellConfig, *, name: str = "shell") -> None:
        self.config = config
        self.name = name
        self._proc: Child | None = None
        self._fd: int | None = None
        """The terminal's controller side."""
        self._exited: asyncio.Future[int] | None = None
        self._output = OutputScanner()
        self._waiter: asyncio.Future[int] | None = None
        self._token = ""
        self._tokens = SentinelTokens()
        self._lock = Turns()
        self._now: Callable[[int], None] | None = None
        """Called with the exit code in place of the waiter's result (``PtySession.start_now``)."""
        self._command_file = CommandFile(config.command_dir_host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.restarts = 0
        self.stop_rung: str | None = None
        """How the last stop ended: ``exited``, ``sigterm`` or ``sigkill`` (tests assert it)."""

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        return self._exited is not None and not self._exited.done()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        cfg.command_dir_host.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {**os.environ, "PS1": "", "PS2": "", "TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", **cfg.env}
        try:
            self._proc, fd = await spawn_pty(cfg.argv, env=env, cwd=cfg.cwd, rows=50, cols=250)
        except OSError as e:
            raise SessionError(f"cannot start shell {cfg.argv[0]!r}: {e}") from e
        self._fd = fd
        os.set_blocking(fd, False)
        self._exited = self._loop.create_future()
        proc = self._proc
        self._proc.on_exit(lambda code: self._on_child_exit(proc, code))
        self._loop.add_reader(fd, self._on_readable)
        # Belt and braces: echo may be re-enabled by the first exec in the container; job control
        # off so background jobs print no "[1] 1234" notices; noflsh as set by spawn_pty.
        try:
            await self._roundtrip(
                "stty -echo -onlcr noflsh 2>/dev/null; set +m; unset HISTFILE PROMPT_COMMAND; PS1=''; PS2=''",
                timeout=cfg.start_timeout_s,
            )
            if cfg.init_script:
                await self._roundtrip(cfg.init_script, timeout=cfg.start_timeout_s)
        except (CommandTimeout, SessionError, _ShellExited) as e:
            await self._kill()
            raise SessionError(
                f"shell {self.name!r} did not answer within {cfg.start_timeout_s} s "
                f"(start_timeout_s); command: {' '.join(cfg.argv)}: {e}"
            ) from e

    async def close(self) -> None:
        async with self._lock:
            await self._kill()
            self._command_file.close()

    async def _kill(self) -> None:
        """Stop ladder sent to the shell's process group: SIGTERM, then SIGKILL."""
        if self._proc is None:
            return
        assert self._exited is not None
        self.stop_rung = await stop_group(self._proc, self._exited, self.config.term_grace_s)
        self._detach()

    def _detach(self) -> None:
        if self._proc is None:
            return
        assert self._loop is not None and self._fd is not None
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._proc = None
        self._fd = None

    def _on_child_exit(self, proc: Child, code: int) -> None:
        if proc is not self._proc:
            return  # a shell already given up on (killed, detached, maybe replaced)
        assert self._exited is not None
        # Drain what the shell printed before it died; no sentinel can follow now.
        self._on_readable()
        self._output.flush()
        if not self._exited.done():
            self._exited.set_result(code)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(_ShellExited(code))

    # --- I/O -------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        assert self._fd is not None and self._loop is not None
        while True:
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError:  # EIO: the shell side of the PTY is closed
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_reader(self._fd)
                return
            if not chunk:
                return
            self._output.feed(chunk, self._on_sentinel)
            if len(chunk) < _READ_SIZE:  # all there was; more wakes the loop's reader again
                return

    def _on_sentinel(self, token: str, rc: int) -> None:
        if token == self._token and self._waiter is not None and not self._waiter.done():
            if self._now is not None:
                self._now(rc)
            else:
                self._waiter.set_result(rc)

    def _send_line(self, line: str, *, timeout: float) -> tuple[asyncio.Future[int], asyncio.TimerHandle]:
        """Send one control line followed by a sentinel; the future gets the sentinel's exit code,
        or _Expired from the timer after ``timeout``."""
        assert self._loop is not None
        if not self.alive:
            raise SessionError(f"shell {self.name!r} is not running")
        self._token = self._tokens.next()
        waiter = self._waiter = self._loop.create_future()
        suffix = f"printf '\\036RLD{self._token}:%d\\036\\n' $?"
        _write_all(self._fd, f"{line}\n{suffix}\n".encode(), self.name)
        # A bare timer on the future: asyncio.wait_for would wrap it in a task per command.
        return waiter, self._loop.call_later(timeout, _expire, waiter)

    async def _roundtrip(self, line: str, *, timeout: float) -> int:
        return await self._wait(*self._send_line(line, timeout=timeout), timeout)

    async def _wait(self, waiter: asyncio.Future[int], timer: asyncio.TimerHandle, timeout: float) -> int:
        try:
            return await waiter
        except _Expired:
            raise CommandTimeout(f"no answer within {timeout} s") from None
        finally:
            timer.cancel()
            self._waiter = None

    async def _interrupt(self, *, respawn: bool = True) -> bool:
        """SIGINT through the terminal; returns True when the shell had to be killed (and, with
        ``respawn``, started again)."""
        self._command_file.disarm()
        with contextlib.suppress(SessionError):
            _write_all(self._fd, b"\x03", self.name)
        try:
            await self._roundtrip(":", timeout=self.config.interrupt_grace_s)
            return False
        except (CommandTimeout, SessionError, _ShellExited):
            log.warning("shell %s ignored SIGINT; killing%s it", self.name, " and respawning" if respawn else "")
            await self._kill()
            if respawn:
                await self._respawn()
            return True

    async def _respawn(self) -> None:
        self._detach()
        self.restarts += 1
        await self.start()


class PtySession(ShellTerminal):
    """One persistent shell for commands, run one at a time, in arrival order."""

    def __init__(self, config: PtyShellConfig, *, name: str = "shell") -> None:
        super().__init__(config, name=name)
        self._finishing: set[asyncio.Future[CommandResult]] = set()
        """Commands of :meth:`start_now` that did not end plainly, finished in a task (held here:
        the loop holds tasks only weakly)."""

    async def run(self, command: str, *, timeout_s: float = 60.0) -> CommandResult:
        """Run ``command`` (any bash text: multi-line, heredocs, pipes) and return its result.

        On timeout the command gets SIGINT; if the shell does not come back within
        ``interrupt_grace_s`` it is killed and respawned. Either way :class:`CommandTimeout` is
        raised with the output so far in ``details["output"]``. A cancelled call interrupts its
        command the same way before it returns.
        """
        async with self._lock:
            if not self.alive:
                await self._respawn()
            return await self._outcome(self._begin(command, timeout_s))

    def start_now(self, command: str, *, timeout_s: float, done: Done,
                  then: Callable[[Awaitable[CommandResult]], Awaitable[CommandResult]]) -> asyncio.Future[int] | None:
        """:meth:`run` for a caller that cannot wait: the command starts at once if the shell is up
        and free, and None (nothing started) otherwise. ``done`` gets what run() would return or
        raise: from the terminal's reader when the command ends with its sentinel, with no task
        and no round of the event loop (~25 us of a command's ~0.29 ms through the client here,
        ``bench/client_latency.py``); from a task when it timed out, ended the shell or was
        cancelled, through ``then`` (which may check or replace that outcome). The returned
        future's ``cancel()`` cancels the command as cancelling run() does."""
        if not self.alive or not self._lock.take_now():
            return None
        try:
            cmd = self._begin(command, timeout_s)
        except BaseException:
            self._lock.give()
            raise

        def ended(rc: int) -> None:
            cmd.timer.cancel()
            self._waiter = self._output.collector = self._now = None
            self._lock.give()
            done(cmd.result(rc, restarted=False))

        def not_plain(_: asyncio.Future[int]) -> None:
            self._now = None
            task = asyncio.ensure_future(then(self._outcome_in_turn(cmd)))
            self._finishing.add(task)
            task.add_done_callback(lambda t: (self._finishing.discard(t), done(_settled(t))))

        self._now = ended
        cmd.waiter.add_done_callback(not_plain)  # only a timeout, the shell's exit or a cancel completes it
        return cmd.waiter

    def _begin(self, command: str, timeout_s: float) -> _Command:
        payload = (command if command.endswith("\n") else command + "\n").encode("utf-8", "surrogateescape")
        self._command_file.write(payload)
        collector = OutputCollector(self.config.max_output_bytes)
        # What the shell wrote since the last command ended (a late notice after its sentinel,
        # a background job) may still sit in the terminal, unread: it is not this command's.
        self._on_readable()
        self._output.start(collector)
        try:
            waiter, timer = self._send_line(f". {self.config.command_dir_shell}/{COMMAND_FILE} </dev/null",
                                            timeout=timeout_s)
        except BaseException:
            self._output.collector = None
            raise
        return _Command(collector, timeout_s, waiter, timer)

    async def _outcome_in_turn(self, cmd: _Command) -> CommandResult:
        try:
            return await self._outcome(cmd)
        finally:
            self._lock.give()

    async def _outcome(self, cmd: _Command) -> CommandResult:
        """Wait for ``cmd``'s end, and recover the shell when it does not end plainly."""
        timeout_s, collector = cmd.timeout_s, cmd.collector
        restarted = False
        try:
            try:
                rc = await self._wait(cmd.waiter, cmd.timer, timeout_s)
            except CommandTimeout:
                restarted = await self._interrupt()
                raise _timed_out(timeout_s, collector, restarted=restarted) from None
            except asyncio.CancelledError:
                # Its caller gave up: the command must not hold the shell for the next one
                # (nor its queued line source the next one's file). Killed if it ignores ^C.
                if self.alive:
                    await self._interrupt(respawn=False)
                raise
            except _ShellExited as e:
                rc = e.code
                restarted = True
                # The new shell's first prompt is not this command's output.
                self._output.collector = None
                await self._respawn()
        finally:
            self._output.collector = None
        return cmd.result(rc, restarted=restarted)


class _Expired(Exception):
    pass


def _timed_out(timeout_s: float, collector: OutputCollector, *, restarted: bool) -> CommandTimeout:
    out, truncated = collector.text()
    return CommandTimeout(
        f"command exceeded its {timeout_s} s limit (timeout_s) and was interrupted"
        + ("; the shell did not recover and was restarted (cwd and environment reset)" if restarted else "")
        + (f"; last output: {tail(out)!r}" if out else ""),
        details={"output": out, "truncated": truncated, "shell_restarted": restarted,
                 "output_bytes": collector.total, "limit_s": timeout_s},
    )


def _settled(task: asyncio.Future[CommandResult]) -> CommandResult | BaseException:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


def _expire(waiter: asyncio.Future[int]) -> None:
    if not waiter.done():
        waiter.set_exception(_Expired())


class _ShellExited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"shell exited with {code}")
        self.code = code


def default_shell_argv() -> list[str]:
    # --noediting: without readline, bash reads a whole line at once instead of a byte at a
    # time with terminal mode switches, which halves the round trip.
    return ["bash", "--norc", "--noprofile", "--noediting"]
