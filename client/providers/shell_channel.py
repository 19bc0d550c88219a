"""One leased sandbox as the providers use it: commands through the blocking client on a worker
thread (so a call works under whatever event loop its caller runs, SWE-agent's ``asyncio.run``
per call included), and files moved through the sandbox's shell as base64, in chunks."""

from __future__ import annotations

import asyncio
import base64
import io
import shlex
import tarfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rolloutd.client.sync_client import RolloutClient, Sandbox
from rolloutd.native_io.errors import SandboxError
from rolloutd.native_io.pty_session import CommandResult

T = TypeVar("T")
CHUNK_BYTES = 48 << 10
"""Bytes (base64 when written) moved per shell command: well under a PTY's line limits and a
command's output cap."""
FILE_TIMEOUT_S = 60.0
"""One chunk of a file moved through the shell."""


class ShellChannel:
    def __init__(self, client: RolloutClient, sandbox: Sandbox) -> None:
        self.client, self.sandbox = client, sandbox
        self._lock = threading.Lock()
        """The blocking client runs its own loop: one call at a time."""

    @classmethod
    async def open(cls, address: str | None, **sandbox_args: Any) -> "ShellChannel":
        def open_() -> ShellChannel:
            client = RolloutClient(address)
            try:
                return cls(client, client.open_sandbox(**sandbox_args))
            except BaseException:
                client.close()
                raise

        return await asyncio.to_thread(open_)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def locked() -> T:
            with self._lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(locked)

    async def run(self, command: str, timeout_s: float | None) -> CommandResult:
        """``command`` in the sandbox's shell; CommandTimeout past ``timeout_s``."""
        return await self.call(self.sandbox.run, command, timeout_s=timeout_s)

    async def run_split(self, command: str, timeout_s: float | None) -> tuple[CommandResult, str]:
        """``command`` in a subshell (its cd and variables stay there) with its stderr apart."""
        err = f"/tmp/.rolloutd-stderr-{uuid.uuid4().hex}"
        r = await self.run(f"( {command} ) 2>{err} </dev/null", timeout_s)
        return r, (await self.run(f"cat {err} 2>/dev/null; rm -f {err}", FILE_TIMEOUT_S)).output

    async def write_bytes(self, path: str, data: bytes) -> None:
        quoted = shlex.quote(path)
        encoded = base64.b64encode(data).decode()
        r = await self.run(f"mkdir -p \"$(dirname {quoted})\" && : > {quoted}", FILE_TIMEOUT_S)
        for start in range(0, len(encoded), CHUNK_BYTES):
            if r.exit_code != 0:
                break
            r = await self.run(f"echo {encoded[start:start + CHUNK_BYTES]} | base64 -d >> {quoted}", FILE_TIMEOUT_S)
        if r.exit_code != 0:
            raise SandboxError(f"cannot write {path} in sandbox {self.sandbox.id}: {r.output[-500:]}")

    async def read_bytes(self, path: str) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        quoted = shlex.quote(path)
        r = await self.run(f"test -f {quoted} || exit 44; stat -c %s {quoted}", FILE_TIMEOUT_S)
        if r.exit_code == 44:
            raise FileNotFoundError(f"no file {path} in sandbox {self.sandbox.id}")
        if r.exit_code != 0:
            raise SandboxError(f"cannot read {path} in sandbox {self.sandbox.id}: {r.output[-500:]}")
        size, data = int(r.output.strip()), bytearray()
        while len(data) < size:
            r = await self.run(f"tail -c +{len(data) + 1} {quoted} | head -c {CHUNK_BYTES} | base64 -w0", FILE_TIMEOUT_S)
            chunk = base64.b64decode(r.output.strip()) if r.exit_code == 0 and not r.truncated else b""
            if not chunk:
                raise SandboxError(f"cannot read {path} at byte {len(data)} in sandbox {self.sandbox.id}: "
                                   f"{r.output[-500:]}")
            data += chunk
        return bytes(data)

    async def upload_tree(self, source: Path, target: str) -> None:
        """The host folder ``source`` merged into ``target`` (one tar through the shell)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(source, arcname=".")
        archive = f"/tmp/.rolloutd-upload-{uuid.uuid4().hex}.tgz"
        await self.write_bytes(archive, buf.getvalue())
        quoted = shlex.quote(target)
        r = await self.run(f"mkdir -p {quoted} && tar xzf {archive} -C {quoted}; rc=$?; rm -f {archive}; exit $rc",
                           FILE_TIMEOUT_S)
        if r.exit_code != 0:
            raise SandboxError(f"cannot unpack {source} into {target} in sandbox {self.sandbox.id}: {r.output[-500:]}")

    async def download_tree(self, source: str, target: Path) -> None:
        """The sandbox folder ``source`` merged into the host folder ``target``."""
        archive = f"/tmp/.rolloutd-download-{uuid.uuid4().hex}.tgz"
        r = await self.run(f"tar czf {archive} -C {shlex.quote(source)} .", FILE_TIMEOUT_S)
        if r.exit_code != 0:
            raise SandboxError(f"cannot pack {source} in sandbox {self.sandbox.id}: {r.output[-500:]}")
        try:
            data = await self.read_bytes(archive)
        finally:
            await self.run(f"rm -f {archive}", FILE_TIMEOUT_S)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(target, filter="data")

    async def close(self) -> None:
        try:
            await self.call(self.sandbox.close)
        finally:
            await asyncio.to_thread(self.client.close)
