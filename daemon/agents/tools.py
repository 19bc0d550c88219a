"""Running the built-in agent's tool calls in the sandbox and writing what happened for the model.

Every outcome of a call becomes an observation: a malformed call, a non-zero exit, a command or
cell that timed out (it was interrupted; the shell or kernel may have been restarted), a failed
edit, a kernel that died (KernelDied: it was restarted, its variables are gone) or could not start
(KernelError: the next cell tries again). Only failures of the sandbox itself propagate:
SandboxLost (nothing more can run there) and other session errors, and OperationTimeout once the
trajectory's deadline has passed.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from rolloutd.native_io.errors import (
    CommandTimeout,
    KernelError,
    TaskError,
    ToolCallError,
)
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.wire import ExecuteResult

from .base import AgentContext
from .editor import SandboxEditor
from .toolcalls import CODEACT_TOOLS, ToolCall, ToolSpec, parse_tool_call

INVALID_CALL = "invalid_call"
"""The ToolStats key under which calls that could not be parsed are counted."""


@dataclass
class Observation:
    tool: str
    """The tool that ran, or ``invalid_call``."""
    role: str
    """``tool`` for a tool's answer (a malformed call included); ``user`` when the reply called no
    tool at all (there is no call to answer)."""
    content: str
    ok: bool
    duration_s: float = 0.0


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to its head and tail with a marker line when longer than ``max_chars``."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters omitted ...]\n{text[-tail:]}"


def format_command(result: CommandResult) -> str:
    notes = []
    if result.truncated:
        notes.append(f"[output cut in the middle: {result.output_bytes} bytes in total]")
    if result.shell_restarted:
        notes.append("[the command ended the shell; a new shell was started (cwd and environment reset)]")
    if result.exit_code != 0:
        notes.append(f"[exit code {result.exit_code}]")
    body = result.output.rstrip("\n")
    if not body and not notes:
        return "[no output]"
    return "\n".join([body, *notes] if body else notes)


def format_cell(result: ExecuteResult) -> str:
    parts = []
    if result.kernel_restarted:
        parts.append("[the kernel had died and was restarted before this cell: earlier variables are gone]")
    parts += [p.rstrip("\n") for p in (result.stdout, result.stderr, *result.displays) if p]
    if result.result is not None:
        parts.append(f"Out: {result.result}")
    if result.error is not None:
        trace = "\n".join(result.error.get("traceback") or [])
        parts.append(trace or f"{result.error.get('ename')}: {result.error.get('evalue')}")
    return "\n".join(parts) if parts else "[no output]"


def format_timeout(e: CommandTimeout, what: str, elapsed_s: float) -> str:
    """The limit that applied (the command's own, or less when the deadline cut it), not the time the
    call took (``elapsed_s``, shown only where the session did not say): on a loaded node the
    interrupt adds a varying tail, and the model's observation must not depend on the load."""
    restarted = e.details.get("shell_restarted") or e.details.get("kernel_restarted")
    lost = "cwd and environment were reset" if what == "command" else "its variables are gone"
    limit_s = float(e.details.get("limit_s") or elapsed_s)
    shown = f"{limit_s:.1f}" if limit_s < 10 else f"{limit_s:.0f}"
    note = f"[the {what} timed out after {shown} s and was interrupted"
    note += f"; it did not stop, so it was restarted and {lost}]" if restarted else "]"
    output = str(e.details.get("output") or "").rstrip("\n")
    return f"{output}\n{note}" if output else note


class ToolBox:
    """The tools of one trajectory, bound to its context."""

    def __init__(self, ctx: AgentContext, *, command_timeout_s: float, observation_max_chars: int,
                 tools: list[str] | None = None) -> None:
        """``tools``: the names offered (None: all; ipython only where the sandbox has a kernel)."""
        self._ctx = ctx
        self.command_timeout_s = command_timeout_s
        self.observation_max_chars = observation_max_chars
        self.specs: dict[str, ToolSpec] = {s.name: s for s in CODEACT_TOOLS if (s.name != "ipython" or ctx.has_ipython)
                                           and (tools is None or s.name in tools)}
        self.editor = SandboxEditor(self._run, ctx.workdir)
        self._shell_in_workdir = False
        self._kernel_in_workdir = False

    async def _run(self, command: str) -> CommandResult:
        return await self._ctx.run(command, timeout_s=self.command_timeout_s)

    # The tools promise the repository root as working directory, wherever the pipeline started
    # the shell and the kernel; each is moved there once, before its first use.

    async def _enter_workdir_shell(self) -> None:
        if not self._shell_in_workdir:
            result = await self._ctx.run(f"cd -- {shlex.quote(self._ctx.workdir)}", timeout_s=self.command_timeout_s)
            if result.exit_code != 0:
                raise TaskError(f"the repository root {self._ctx.workdir} is not a folder in the sandbox: {result.output}")
            self._shell_in_workdir = True

    async def _enter_workdir_kernel(self) -> None:
        if not self._kernel_in_workdir:
            cell = await self._ctx.ipython(f"__import__('os').chdir({self._ctx.workdir!r})",
                                           timeout_s=self.command_timeout_s)
            if cell.status != "ok":
                raise TaskError(f"the IPython kernel cannot enter the repository root {self._ctx.workdir}: {cell.error}")
            self._kernel_in_workdir = True

    def parse(self, text: str) -> ToolCall | Observation:
        """The turn's tool call, or the observation explaining why there is none to run."""
        try:
            return parse_tool_call(text, self.specs)
        except ToolCallError as e:
            role = "user" if e.details.get("kind") == "no_call" else "tool"
            return Observation(INVALID_CALL, role, str(e), ok=False)

    async def execute(self, call: ToolCall) -> Observation:
        t0 = time.monotonic()
        ok = True
        try:
            if call.name == "bash":
                await self._enter_workdir_shell()
                result = await self._ctx.run(call.arguments["command"], timeout_s=self.command_timeout_s)
                ok = result.exit_code == 0
                text = format_command(result)
                self._shell_in_workdir &= not result.shell_restarted
            elif call.name == "ipython":
                await self._enter_workdir_kernel()
                cell = await self._ctx.ipython(call.arguments["code"], timeout_s=self.command_timeout_s)
                ok = cell.status == "ok"
                text = format_cell(cell)
                self._kernel_in_workdir &= not cell.kernel_restarted
            elif call.name == "str_replace_editor":
                text = await self.editor.execute(call.arguments)
            else:
                raise ToolCallError(f"{call.name} cannot be run as a tool here")
        except ToolCallError as e:
            ok, text = False, f"Error: {e}"
        except CommandTimeout as e:
            ok, text = False, format_timeout(e, "command" if call.name != "ipython" else "cell", time.monotonic() - t0)
            self._shell_in_workdir &= not e.details.get("shell_restarted")
            self._kernel_in_workdir &= not e.details.get("kernel_restarted")
        except KernelError as e:  # died during the cell, or could not start
            ok, text = False, f"[{e}]"
            self._kernel_in_workdir = False
        return Observation(call.name, "tool", clip(text, self.observation_max_chars), ok, time.monotonic() - t0)
