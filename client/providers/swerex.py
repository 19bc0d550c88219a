"""rolloutd sandboxes as a SWE-ReX deployment and runtime, so SWE-agent (or anything written
against ``swerex.runtime.abstract.AbstractRuntime``) runs its commands in them.

``RolloutdDeployment(address, image=...)`` leases one sandbox from a node daemon (or a router) on
``start()`` and gives it back on ``stop()``; its ``runtime`` maps SWE-ReX's requests onto the
sandbox's persistent shell:
- one bash session per sandbox (its PTY shell), named as the caller likes; ``BashAction`` runs in
  it with its ``timeout`` and ``check``; ``BashInterruptAction`` only checks the shell answers (a
  command never outlives its timeout here: the daemon interrupts it);
- ``execute(Command)`` runs in a subshell of that shell (its ``cd``/``env`` do not leak into the
  session), stdout and stderr apart unless ``merge_output_streams``; ``env`` adds to the
  environment rather than replacing it;
- ``read_file``/``write_file``/``upload`` move bytes through the shell (:mod:`shell_channel`).
SWE-agent calls each coroutine under its own ``asyncio.run``: every call here goes through the
blocking client on a worker thread, so no call depends on the loop it runs in.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (CommandTimeoutError, DeploymentNotStartedError, NonZeroExitCodeError,
                               SessionDoesNotExistError, SessionExistsError, SwerexException)
from swerex.runtime.abstract import (AbstractRuntime, BashAction, BashInterruptAction, BashObservation,
                                     CloseBashSessionResponse, CloseResponse, Command, CommandResponse,
                                     CreateBashSessionResponse, IsAliveResponse, ReadFileResponse, UploadResponse,
                                     WriteFileResponse)

from rolloutd.native_io.errors import CommandTimeout, RolloutdError
from rolloutd.native_io.pty_session import CommandResult

from .shell_channel import ShellChannel

OPEN_TIMEOUT_S = 600.0
"""Leasing the sandbox: its image may be built first (a Dockerfile image)."""


class RolloutdRuntime(AbstractRuntime):
    def __init__(self, channel: ShellChannel, *, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(__name__)
        self._channel = channel
        self._session: str | None = None

    async def _run(self, command: str, timeout: float | None) -> CommandResult:
        try:
            return await self._channel.run(command, timeout)
        except CommandTimeout as e:
            raise CommandTimeoutError(f"Timeout ({timeout}s) exceeded while running command: {e}") from e

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            r = await self._run("true", timeout)
        except (RolloutdError, SwerexException) as e:
            return IsAliveResponse(is_alive=False, message=str(e))
        return IsAliveResponse(is_alive=r.exit_code == 0, message="" if r.exit_code == 0 else r.output)

    async def create_session(self, request: Any) -> CreateBashSessionResponse:
        if self._session is not None:
            raise SessionExistsError(f"session {request.session!r}: a rolloutd sandbox has one shell, already open as "
                                     f"{self._session!r}; lease another sandbox for a second session")
        outputs = []
        for source in request.startup_source:
            outputs.append((await self._run(f"source {shlex.quote(source)}", request.startup_timeout)).output)
        self._session = request.session
        return CreateBashSessionResponse(output="".join(outputs))

    async def run_in_session(self, action: Any) -> BashObservation:
        if self._session is None or action.session != self._session:
            raise SessionDoesNotExistError(f"no session {action.session!r} (open: {self._session!r})")
        if isinstance(action, BashInterruptAction):
            r = await self._run("true", action.timeout + 10.0)
            return BashObservation(output="", exit_code=r.exit_code)
        assert isinstance(action, BashAction)
        if action.is_interactive_command or action.is_interactive_quit:
            raise SwerexException("interactive commands (is_interactive_command) are not supported by rolloutd "
                                  "sandboxes: each command runs to completion or to its timeout")
        r = await self._run(action.command, action.timeout)
        if action.check == "raise" and r.exit_code != 0:
            msg = (f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n"
                   f"{r.output!r}")
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=r.output, exit_code=None if action.check == "ignore" else r.exit_code)

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        if self._session is None or request.session != self._session:
            raise SessionDoesNotExistError(f"no session {request.session!r} (open: {self._session!r})")
        self._session = None
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        if isinstance(command.command, list):
            line = shlex.join(command.command)
        else:
            line = command.command if command.shell else shlex.quote(command.command)
        if command.env:
            line = f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in command.env.items())} {line}"
        if command.cwd:
            line = f"cd {shlex.quote(command.cwd)} && {line}"
        if command.merge_output_streams:
            r, err = await self._run(f"( {line} ) 2>&1 </dev/null", command.timeout), ""
        else:
            try:
                r, err = await self._channel.run_split(line, command.timeout)
            except CommandTimeout as e:
                raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command: {e}") from e
        response = CommandResponse(stdout=r.output, stderr=err, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. Stdout:\n{r.output!r}\n"
                   f"Stderr:\n{err!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: Any) -> ReadFileResponse:
        data = await self._channel.read_bytes(request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: Any) -> WriteFileResponse:
        await self._channel.write_bytes(request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: Any) -> UploadResponse:
        source = Path(request.source_path)
        if source.is_dir():
            await self._channel.upload_tree(source, request.target_path)
        elif source.is_file():
            await self._channel.write_bytes(request.target_path, source.read_bytes())
        else:
            raise FileNotFoundError(f"upload source {source} does not exist")
        return UploadResponse()

    async def close(self) -> CloseResponse:
        await self._channel.close()
        return CloseResponse()


class RolloutdDeployment(AbstractDeployment):
    """A SWE-ReX deployment on a rolloutd sandbox. ``address``: the node daemon's or router's
    (default: this node's daemon); the other arguments are the sandbox's (``SandboxOpenArgs``)."""

    def __init__(self, address: str | None = None, *, image: str = "default", network: bool = False,
                 open_timeout_s: float = OPEN_TIMEOUT_S, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(__name__)
        self._address, self._image, self._network, self._open_timeout_s = address, image, network, open_timeout_s
        self._hooks = CombinedDeploymentHook()
        self._runtime: RolloutdRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> RolloutdRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        self._hooks.on_custom_step(f"Leasing a rolloutd sandbox (image {self._image})")
        channel = await ShellChannel.open(self._address, image=self._image, network=self._network, ipython=False,
                                          timeout_s=self._open_timeout_s)
        self._runtime = RolloutdRuntime(channel, logger=self.logger)

    async def stop(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await runtime.close()
