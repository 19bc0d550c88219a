"""An IPython kernel inside a sandbox, reached directly over its ZeroMQ sockets (no gateway, no TCP).

The kernel listens on ``ipc`` sockets in the sandbox's run folder, which is bound into the
container; the host and the kernel each get a connection file with the paths as they see them
and the same signing key. Readiness means a real ``kernel_info`` round trip with iopub
connected. A timed-out cell is interrupted over the control channel; a kernel that does not come
back, or dies, is restarted and the caller is told. The messages are Jupyter's wire protocol
(``jupyter_wire``); the kernel is stock ipykernel from the image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from rolloutd.native_io.errors import CommandTimeout, KernelDied, KernelError
from rolloutd.native_io.file_events import NamesAppear
from rolloutd.native_io.host_files import create_in, read_tail, write_new
from rolloutd.native_io.output import LOG_TAIL_CHARS, OutputCollector, tail
from rolloutd.native_io.spawn import Child, spawn
from rolloutd.native_io.wire import ExecuteResult

from .jupyter_wire import KernelChannels, KernelMessage

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LAUNCHER_SOURCE = Path(__file__).with_name("kernel_launcher.py").read_bytes()
"""Copied into each sandbox's run folder at a kernel's start (read once, not per start)."""
IOPUB_JOIN_RETRY_S = 0.02
"""While a starting kernel's iopub is not joined yet: how long to wait for the idle status of a
kernel_info before sending another (each costs the kernel about a millisecond)."""
_PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
_SOCKET_STEM = "k"
"""The kernel's ipc sockets are ``<run folder>/k-<port>`` (Jupyter names them ``<ip>-<port>``)."""


def _socket_file(port: int) -> str:
    return f"{_SOCKET_STEM}-{port}"


_CONNECTED_SOCKETS = [_socket_file(_PORTS[p]) for p in KernelChannels.PORTS]
"""The kernel's ipc socket files that ``KernelChannels`` connects to."""


class KernelHost(Protocol):
    """What a kernel needs of the sandbox it runs in (a :class:`~rolloutd.daemon.sandbox.base.Sandbox`
    is one): sessions sit below the sandbox pool, which starts kernels, so they do not import it."""

    id: str
    session_ids: set[int]
    """Sessions started in it; the kernel's is added while it runs."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def run_dir_inside(self) -> str: ...

    @property
    def workspace_inside(self) -> str: ...

    @property
    def python(self) -> str: ...

    def limits_prelude(self) -> str: ...

    def exec_argv(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> list[str]: ...


class KernelSession:
    """One kernel process in one sandbox. Cells run one at a time."""

    def __init__(
        self,
        sandbox: KernelHost,
        *,
        ready_timeout_s: float = 60.0,
        interrupt_grace_s: float = 2.0,
        max_output_bytes: int = 64 * 1024,
        name: str = "kernel",
        transport: str = "ipc",
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.transport = transport
        """``ipc`` always, except in the bench, which measures ``tcp`` (needs network=True) for
        comparison."""
        self.sandbox = sandbox
        self.ready_timeout_s = ready_timeout_s
        self.interrupt_grace_s = interrupt_grace_s
        self.max_output_bytes = max_output_bytes
        self.name = name
        self._proc: Child | None = None
        self._channels: KernelChannels | None = None
        self._lock = asyncio.Lock()
        self._running_msg_id: str | None = None
        self.restarts = 0
        self.connection: dict[str, Any] = {}
        """The running kernel's connection info as the host sees it (another client can join)."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        sb = self.sandbox
        host_info, launch, env = _prepare_start(sb, self.transport)
        deadline = time.monotonic() + self.ready_timeout_s
        watch = _watch_sockets(sb.run_dir) if self.transport == "ipc" else None
        with watch if watch is not None else contextlib.nullcontext():
            with open(create_in(sb.run_dir, "kernel.log"), "wb") as log_file:
                self._proc = await spawn(sb.exec_argv(["bash", "-c", launch], cwd=sb.workspace_inside, env=env),
                                         stdout=log_file, stderr=log_file, start_new_session=True)
            sb.session_ids.add(self._proc.pid)
            try:
                if watch is not None:
                    await self._until_bound(watch, deadline)
                # No heartbeat channel: a dead kernel shows as the exit of its process, which we watch already.
                self.connection = host_info
                self._channels = KernelChannels(host_info)
                await self._wait_ready(deadline)
            except BaseException:
                await self._stop_process()
                raise

    async def _until_bound(self, bound: NamesAppear, deadline: float) -> None:
        """Until the kernel has bound the sockets we connect to: connected before, they would retry
        on a timer until then (see ``NamesAppear``)."""
        assert self._proc is not None
        waiting = asyncio.ensure_future(bound.wait())
        try:
            await asyncio.wait({waiting, self._proc.exited}, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if waiting.done() and not waiting.cancelled():
            waiting.result()  # raises what the watch raised, if anything
            return
        if not self.alive:
            raise self._exited_at_start()
        raise KernelError(f"kernel did not open its sockets within {self.ready_timeout_s} s (ready_timeout_s); "
                          f"log: {self._log_tail()}")

    async def _wait_ready(self, deadline: float) -> None:
        """kernel_info until it answers and iopub delivers (ZeroMQ SUB sockets join late)."""
        ch = self._channels
        assert ch is not None
        # ZeroMQ queues a request sent before the kernel binds and delivers it once connected, so
        # one kernel_info proves the shell channel; sending more while waiting would only make
        # the kernel answer each of them. Only a missed iopub status needs another request.
        sent = {ch.send(ch.shell, "kernel_info_request", {})}
        shell_ready = False
        while time.monotonic() < deadline:
            if not self.alive:
                raise self._exited_at_start()
            try:
                if not shell_ready:
                    shell_ready = (await ch.next(ch.shell_replies, 0.25)).parent_id in sent
                    continue
                # The kernel publishes an idle status after each request (the launcher drops busy);
                # seeing one proves iopub is joined.
                if (await ch.next(ch.iopub_messages, IOPUB_JOIN_RETRY_S)).parent_id in sent:
                    return
            except TimeoutError:
                if shell_ready:
                    sent.add(ch.send(ch.shell, "kernel_info_request", {}))
        raise KernelError(
            f"kernel did not answer kernel_info within {self.ready_timeout_s} s (ready_timeout_s); "
            f"log: {self._log_tail()}"
        )

    def _exited_at_start(self) -> KernelError:
        return KernelError(f"kernel exited during start-up; see {self.sandbox.run_dir / 'kernel.log'}: "
                           f"{self._log_tail()}")

    def _log_tail(self) -> str:
        return tail(read_tail(self.sandbox.run_dir, "kernel.log", 4 * LOG_TAIL_CHARS).decode(errors="replace"),
                    LOG_TAIL_CHARS)

    async def execute(self, code: str, *, timeout_s: float = 60.0) -> ExecuteResult:
        async with self._lock:
            restarted = False
            if not self.alive:
                await self._restart()
                restarted = True
            t0 = time.monotonic()
            try:
                result = await self._execute(code, timeout_s)
            except _KernelGone:
                code_ = self._proc.returncode if self._proc else None
                await self._restart()
                raise KernelDied(
                    f"the IPython kernel died while running the cell (exit {code_}); it was restarted "
                    "and its variables are gone"
                ) from None
            except CommandTimeout as e:
                if not await self._interrupt():
                    await self._restart()
                    e.details["kernel_restarted"] = True
                    e.args = (e.args[0] + "; the kernel did not stop and was restarted (variables lost)",)
                raise
            return ExecuteResult(**{**result, "duration_s": time.monotonic() - t0, "kernel_restarted": restarted})

    async def _execute(self, code: str, timeout_s: float) -> dict[str, Any]:
        ch = self._channels
        assert ch is not None
        # Replies and output of earlier requests (start-up probes, an interrupted cell) are stale.
        ch.drain(ch.shell_replies)
        ch.drain(ch.iopub_messages)
        msg_id = ch.execute(code)
        self._running_msg_id = msg_id
        out = OutputCollector(self.max_output_bytes)
        err = OutputCollector(self.max_output_bytes)
        result: str | None = None
        error: dict[str, Any] | None = None
        displays: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await self._next_iopub(deadline, timeout_s, out)
            if msg.parent_id != msg_id:
                continue
            kind, content = msg.msg_type, msg.content
            if kind == "stream":
                (out if content.get("name") == "stdout" else err).add(content.get("text", "").encode())
            elif kind == "execute_result":
                result = content.get("data", {}).get("text/plain")
            elif kind == "display_data":
                displays.append(content.get("data", {}).get("text/plain", ""))
            elif kind == "error":
                error = {"ename": content.get("ename", ""), "evalue": content.get("evalue", ""),
                         "traceback": [_ANSI.sub("", line) for line in content.get("traceback", [])]}
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        stdout, t1 = out.text()
        stderr, t2 = err.text()
        return {"status": "error" if error else "ok", "stdout": stdout, "stderr": stderr, "result": result,
                "error": error, "truncated": t1 or t2, "displays": displays}

    async def _next_iopub(self, deadline: float, timeout_s: float, out: OutputCollector) -> KernelMessage:
        ch = self._channels
        assert ch is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                text, truncated = out.text()
                raise CommandTimeout(
                    f"IPython cell exceeded its {timeout_s} s limit (timeout_s) and was interrupted",
                    details={"output": text, "truncated": truncated, "kernel_restarted": False, "limit_s": timeout_s},
                )
            try:
                return await ch.next(ch.iopub_messages, min(remaining, 0.5))
            except TimeoutError:
                if not self.alive:
                    raise _KernelGone() from None

    async def _interrupt(self) -> bool:
        """Interrupt over the control channel; True when the kernel went idle again."""
        ch = self._channels
        if ch is None or not self.alive:
            return False
        ch.send(ch.control, "interrupt_request", {})
        deadline = time.monotonic() + self.interrupt_grace_s
        try:
            while time.monotonic() < deadline:
                try:
                    msg = await ch.next(ch.iopub_messages, max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    break
                # The control request gets busy/idle of its own: only the cell's idle counts.
                if (msg.msg_type == "status" and msg.content.get("execution_state") == "idle"
                        and msg.parent_id == self._running_msg_id):
                    return True
        except Exception:  # a dying kernel can break the channel in several ways
            log.debug("interrupt of kernel %s failed", self.name, exc_info=True)
        return False

    async def _restart(self) -> None:
        self.restarts += 1
        log.warning("restarting IPython kernel %s in sandbox %s", self.name, self.sandbox.id)
        await self._stop_process()
        await self.start()

    async def _stop_process(self) -> None:
        if self._channels is not None:
            self._channels.close()
            self._channels = None
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            # The kernel runs in its own session: signal the whole group so the process inside
            # the container goes too, not just the `apptainer exec` parent.
            proc.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 1.0)
            except TimeoutError:
                proc.signal_group(signal.SIGKILL)
                await proc.wait()
        proc.signal_group(signal.SIGKILL)
        self.sandbox.session_ids.discard(proc.pid)
        self._proc = None

    async def close(self) -> None:
        async with self._lock:
            await self._stop_process()


class _KernelGone(Exception):
    pass


def _prepare_start(sb: KernelHost, transport: str) -> tuple[dict[str, Any], str, dict[str, str]]:
    """Write a kernel's connection file and launcher into the sandbox's run folder, where a previous
    kernel's sockets are removed. Returns the connection as the host sees it, and the shell command
    and environment that start the kernel inside."""
    key = secrets.token_hex(16)

    def connection(ip: str, ports: dict[str, int]) -> dict[str, Any]:
        return {"transport": transport, "ip": ip, "key": key, "signature_scheme": "hmac-sha256",
                "kernel_name": "", **ports}

    if transport == "ipc":
        host_info = connection(f"{sb.run_dir}/{_SOCKET_STEM}", _PORTS)
        inside_info = connection(f"{sb.run_dir_inside}/{_SOCKET_STEM}", _PORTS)
    else:
        host_info = inside_info = connection("127.0.0.1", dict(zip(_PORTS, _free_tcp_ports(len(_PORTS)))))
    # The run folder is the sandbox's to write too: these files are made afresh (host_files).
    write_new(sb.run_dir, "kernel.json", json.dumps(inside_info).encode())
    for port in _PORTS.values():  # stale sockets of a previous kernel
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{sb.run_dir}/{_socket_file(port)}")
    write_new(sb.run_dir, "kernel_launcher.py", _LAUNCHER_SOURCE, 0o644)
    launch = (
        f"{sb.limits_prelude()}; exec {sb.python} {sb.run_dir_inside}/kernel_launcher.py "
        f"-f {sb.run_dir_inside}/kernel.json --IPKernelApp.quiet=True --HistoryManager.enabled=False "
        "--IPythonKernel._execute_sleep=0"
    )
    env = {"IPYTHONDIR": f"{sb.run_dir_inside}/ipython", "JUPYTER_RUNTIME_DIR": f"{sb.run_dir_inside}/jupyter",
           "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    return host_info, launch, env


def _watch_sockets(run_dir: Path) -> NamesAppear | None:
    """A watch for the kernel's socket files; None (the channels then retry until the kernel binds)
    where the folder cannot be watched, e.g. when the user's inotify instances are all taken."""
    try:
        return NamesAppear(run_dir, _CONNECTED_SOCKETS)
    except OSError as e:
        log.warning("connecting to the kernel without waiting for its sockets: %s", e)
        return None


def _free_tcp_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
