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
- ``read_file``/``write_file``/``upload`` move bytes through the shell as base64.
SWE-agent calls each coroutine under its own ``asyncio.run``: every call here goes through the
blocking client on a worker thread, so no call depends on the loop it runs in.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import shlex
import tarfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (CommandTimeoutError, DeploymentNotStartedError, NonZeroExitCodeError,
                               SessionDoesNotExistError, SessionExistsError, SwerexException)
from swerex.runtime.abstract import (AbstractRuntime, BashAction, BashInterruptAction, BashObservation,
                                     CloseBashSessionResponse, CloseResponse, Command, CommandResponse,
                                     CreateBashSessionResponse, IsAliveResponse, ReadFileResponse, UploadResponse,
                                     WriteFileResponse)

from rolloutd.client.sync_client import RolloutClient, Sandbox
from rolloutd.native_io.errors import CommandTimeout, RolloutdError
from rolloutd.native_io.pty_session import CommandResult

T = TypeVar("T")
CHUNK_BYTES = 48 << 10
"""Bytes (base64 when written) moved per shell command: well under a PTY's line limits and a
command's output cap."""
FILE_TIMEOUT_S = 60.0
"""One chunk of a file moved through the shell."""
OPEN_TIMEOUT_S = 600.0
"""Leasing the sandbox: its image may be built first (a Dockerfile image)."""


class RolloutdRuntime(AbstractRuntime):
    def __init__(self, client: RolloutClient, sandbox: Sandbox, *, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(__name__)
        self._client, self._sandbox = client, sandbox
        self._lock = threading.Lock()
        """The blocking client runs its own loop: one call at a time."""
        self._session: str | None = None

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def locked() -> T:
            with self._lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(locked)

    async def _run(self, command: str, timeout: float | None) -> CommandResult:
        try:
            return await self._call(self._sandbox.run, command, timeout_s=timeout)
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
        stderr = f"/tmp/.rolloutd-swerex-{uuid.uuid4().hex}"
        merged = command.merge_output_streams
        r = await self._run(f"( {line} ) 2>{'&1' if merged else stderr} </dev/null", command.timeout)
        err = "" if merged else (await self._run(f"cat {stderr} 2>/dev/null; rm -f {stderr}", FILE_TIMEOUT_S)).output
        response = CommandResponse(stdout=r.output, stderr=err, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. Stdout:\n{r.output!r}\n"
                   f"Stderr:\n{err!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: Any) -> ReadFileResponse:
        path = shlex.quote(request.path)
        r = await self._run(f"test -f {path} || exit 44; stat -c %s {path}", FILE_TIMEOUT_S)
        if r.exit_code == 44:
            raise FileNotFoundError(f"no file {request.path} in rolloutd sandbox {self._sandbox.id}")
        if r.exit_code != 0:
            raise SwerexException(f"cannot read {request.path}: {r.output[-500:]}")
        size, data = int(r.output.strip()), bytearray()
        # In chunks: a command's output is capped (the sandbox's output limit).
        while len(data) < size:
            r = await self._run(f"tail -c +{len(data) + 1} {path} | head -c {CHUNK_BYTES} | base64 -w0", FILE_TIMEOUT_S)
            chunk = base64.b64decode(r.output.strip()) if r.exit_code == 0 and not r.truncated else b""
            if not chunk:
                raise SwerexException(f"cannot read {request.path} at byte {len(data)}: {r.output[-500:]}")
            data += chunk
        return ReadFileResponse(content=bytes(data).decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: Any) -> WriteFileResponse:
        await self._write_bytes(request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: Any) -> UploadResponse:
        source = Path(request.source_path)
        if source.is_dir():
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                tar.add(source, arcname=".")
            archive = f"/tmp/.rolloutd-swerex-{uuid.uuid4().hex}.tgz"
            await self._write_bytes(archive, buf.getvalue())
            target = shlex.quote(request.target_path)
            r = await self._run(f"mkdir -p {target} && tar xzf {archive} -C {target}; rc=$?; rm -f {archive}; "
                                "exit $rc", FILE_TIMEOUT_S)
            if r.exit_code != 0:
                raise SwerexException(f"cannot unpack {source} into {request.target_path}: {r.output[-500:]}")
        elif source.is_file():
            await self._write_bytes(request.target_path, source.read_bytes())
        else:
            raise FileNotFoundError(f"upload source {source} does not exist")
        return UploadResponse()

    async def _write_bytes(self, path: str, data: bytes) -> None:
        quoted = shlex.quote(path)
        encoded = base64.b64encode(data).decode()
        r = await self._run(f"mkdir -p \"$(dirname {quoted})\" && : > {quoted}", FILE_TIMEOUT_S)
        for start in range(0, len(encoded), CHUNK_BYTES):
            if r.exit_code != 0:
                break
            r = await self._run(f"echo {encoded[start:start + CHUNK_BYTES]} | base64 -d >> {quoted}", FILE_TIMEOUT_S)
        if r.exit_code != 0:
            raise SwerexException(f"cannot write {path} in rolloutd sandbox {self._sandbox.id}: {r.output[-500:]}")

    async def close(self) -> CloseResponse:
        await self._call(self._sandbox.close)
        return CloseResponse()


class RolloutdDeployment(AbstractDeployment):
    """A SWE-ReX deployment on a rolloutd sandbox. ``address``: the node daemon's or router's
    (default: this node's daemon); the other arguments are the sandbox's (``SandboxOpenArgs``)."""

    def __init__(self, address: str | None = None, *, image: str = "default", network: bool = False,
                 open_timeout_s: float = OPEN_TIMEOUT_S, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(__name__)
        self._address, self._image, self._network, self._open_timeout_s = address, image, network, open_timeout_s
        self._hooks = CombinedDeploymentHook()
        self._client: RolloutClient | None = None
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

        def open_() -> tuple[RolloutClient, Sandbox]:
            client = RolloutClient(self._address)
            try:
                return client, client.open_sandbox(image=self._image, network=self._network, ipython=False,
                                                   timeout_s=self._open_timeout_s)
            except BaseException:
                client.close()
                raise

        self._client, sandbox = await asyncio.to_thread(open_)
        self._runtime = RolloutdRuntime(self._client, sandbox, logger=self.logger)

    async def stop(self) -> None:
        runtime, client = self._runtime, self._client
        self._runtime = self._client = None
        if runtime is not None:
            await runtime.close()
        if client is not None:
            await asyncio.to_thread(client.close)
