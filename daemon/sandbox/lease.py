"""A leased sandbox: its shell, its IPython kernel once a cell asks for one, and what it lost.

A command or a cell on a sandbox the watchdog destroyed fails with SandboxLost (SandboxLimit when
it went over a cap), whatever its session answered; :func:`open_lease` starts a sandbox with its
shell already answering, and leaves nothing running when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from rolloutd.native_io.errors import SandboxLimit, SandboxLost, SessionError
from rolloutd.native_io.pty_session import CommandResult, Done, PtySession, PtyShellConfig, default_shell_argv

from ..sessions.ipython import ExecuteResult, KernelSession
from .base import Sandbox
from .start_gate import StartGate

FIRST_COMMAND_TIMEOUT_S = 10.0
"""A new shell's first command (it loads the command path): slow only on a saturated node."""
OOM_NOTICE_S = 5.0
"""How long a call whose shell the OOM killer ended waits for the watchdog to name the cap."""

T = TypeVar("T")


@dataclass
class Lease:
    """A started sandbox with its sessions; what a rollout or a trainer's sandbox handle holds."""

    sandbox: Sandbox
    shell: PtySession
    offers_ipython: bool = False
    """Whether cells may start a kernel: the leased spec's ``ipython`` (a warm sandbox without a
    kernel serves either)."""
    kernel: KernelSession | None = None
    """Started by :meth:`start_kernel` (the first cell calls it); None before."""
    created_at: float = field(default_factory=time.monotonic)
    leased_at: float | None = None
    lost_reason: str | None = None
    lost_limit: str | None = None
    """The cap (e.g. ``max_processes``) a sandbox lost to the watchdog went over."""
    marked_lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set with ``lost_reason``."""
    sandbox_stopped: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set once the sandbox is stopped: nothing it ran is alive. ``lost_reason`` comes first (new
    commands are refused at once); the stop of a lost lease follows in the background."""
    start_wait_s: float = 0.0
    """Wall time the sandbox's start waited in the pool's start gate (``open_lease``), then took,
    then its shell took to answer."""
    instance_start_s: float = 0.0
    shell_start_s: float = 0.0
    kernel_start_s: float = 0.0
    """Wall time this lease's cells waited for their kernel to start (none when it was started
    ahead)."""
    _kernel_start: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def id(self) -> str:
        return self.sandbox.id

    def _lost(self) -> SandboxLost | None:
        if not self.lost_reason:
            return None
        error = SandboxLimit if self.lost_limit else SandboxLost
        return error(f"sandbox {self.id} is gone: {self.lost_reason}")

    def _check(self) -> None:
        if (lost := self._lost()) is not None:
            raise lost

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        self._check()
        return await self._unless_lost(self.shell.run(command, timeout_s=self._limit(timeout_s)))

    def run_now(self, command: str, *, timeout_s: float | None, done: Done) -> asyncio.Future[int] | None:
        """:meth:`run`, started at once when the shell is free (``PtySession.start_now``): ``done``
        gets its result or error; returns a future whose ``cancel()`` cancels it. None when
        nothing was started: the shell is busy or down, or the sandbox is lost (run() says so)."""
        if self.lost_reason:
            return None

        def ended(outcome: CommandResult | BaseException) -> None:
            done((self._lost() or outcome) if isinstance(outcome, CommandResult) else outcome)

        return self.shell.start_now(command, timeout_s=self._limit(timeout_s), done=ended, then=self._unless_lost)

    def _limit(self, timeout_s: float | None) -> float:
        return timeout_s if timeout_s is not None else self.sandbox.spec.limits.command_timeout_s

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        """Run a cell; the kernel's start-up, on the first cell, is not counted in ``timeout_s``."""
        waits, t0 = self.kernel is None, time.monotonic()
        try:
            kernel = await self.start_kernel()
        finally:
            if waits:
                self.kernel_start_s += time.monotonic() - t0
        return await self._unless_lost(kernel.execute(code, timeout_s=self._limit(timeout_s)))

    async def start_kernel(self) -> KernelSession:
        """The lease's IPython kernel, started now if it is not yet. KernelError when it cannot
        start (the next call tries again); the shell is unaffected."""
        self._check()
        if not self.offers_ipython:
            raise SessionError(f"sandbox {self.id} has no IPython kernel: open it with ipython=True "
                               "(the image needs ipykernel)")
        async with self._kernel_start:
            kernel = self.kernel
            if kernel is None:
                kernel = KernelSession(self.sandbox, max_output_bytes=self.sandbox.spec.limits.max_output_bytes,
                                       name=f"kernel-{self.id}")
                self.kernel = kernel  # a destroy() meanwhile stops it too
                try:
                    await self._unless_lost(kernel.start())
                except BaseException:
                    self.kernel = None
                    raise
            return kernel

    async def _unless_lost(self, call: Awaitable[T]) -> T:
        """``call``'s answer, or SandboxLost when the sandbox was lost while it ran (the watchdog
        destroyed it): its session then fails, or answers from a process it respawned outside."""
        try:
            result = await call
        except SessionError:
            cgroup = self.sandbox.cgroup
            if not self.lost_reason and cgroup is not None and cgroup.oom_kills():
                # Over its memory cap, the OOM killer may pick the shell itself (its processes are
                # the first choice): the watchdog names the cap within a round; wait for that.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.marked_lost.wait(), OOM_NOTICE_S)
            self._check()
            raise
        self._check()
        return result

    async def stop_sandbox(self) -> None:
        """Stop the sandbox, everything running in it and its folders (never raises); sets
        ``sandbox_stopped``. For the watchdog: a lost lease's folders go at once (a full disk is
        freed), before :meth:`destroy` closes the sessions' files."""
        await self.sandbox.stop()
        self.sandbox_stopped.set()

    async def destroy(self) -> None:
        # The sandbox first: killing an instance's init ends every process inside at once, so the
        # sessions below only have to reap and close their files. The folders after those closes,
        # so that rm, not this loop, frees the files' inodes (Sandbox.remove_folders).
        await self.sandbox.halt()
        self.sandbox_stopped.set()
        try:
            await self.shell.close()
            if self.kernel is not None:
                await self.kernel.close()
        finally:
            await self.sandbox.remove_folders()
            await self.sandbox.remove_cgroup()


async def open_lease(sandbox: Sandbox, *, start_kernel: bool = False, gate: StartGate | None = None) -> Lease:
    """Start ``sandbox`` and its shell, and its kernel too with ``start_kernel`` (when its spec
    offers IPython; otherwise the first cell starts it). On any failure nothing is left running.
    ``gate`` admits the sandbox's start only: the instance start is what crowds a machine when
    hundreds go at once, and shells can start no faster than instances come out of the gate.
    A refill (``sandbox.background``) lets the starts someone waits for through the gate first."""
    slot = gate.slot(sandbox.spec.image, background=sandbox.background) if gate else contextlib.nullcontext(0.0)
    async with slot as waited_s:
        t0 = time.monotonic()
        try:
            await sandbox.start()
        except BaseException:
            await sandbox.remove_cgroup()
            raise
    t1 = time.monotonic()
    spec = sandbox.spec
    shell = PtySession(
        PtyShellConfig(
            argv=sandbox.exec_argv(default_shell_argv(), cwd=sandbox.workspace_inside,
                                   env={"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat"}
                                   if sandbox.isolated else None),
            command_dir_host=sandbox.run_dir / "sh",
            command_dir_shell=f"{sandbox.run_dir_inside}/sh",
            max_output_bytes=spec.limits.max_output_bytes,
            init_script=sandbox.limits_prelude(),
        ),
        name=f"shell-{sandbox.id}",
    )
    lease = Lease(sandbox, shell, offers_ipython=spec.ipython, start_wait_s=waited_s, instance_start_s=t1 - t0)
    try:
        await shell.start()
        if shell.pid is not None:
            sandbox.session_ids.add(shell.pid)
        # The first command of a new shell pays for loading the command path; pay it here.
        await shell.run(":", timeout_s=FIRST_COMMAND_TIMEOUT_S)
        lease.shell_start_s = time.monotonic() - t1
        if start_kernel and spec.ipython:
            await lease.start_kernel()
    except BaseException:
        await lease.destroy()
        raise
    return lease
