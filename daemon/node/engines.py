"""The node's shared vLLM engines: one engine-host process per ``vllm-inprocess:MODEL`` server.

Started by the supervisor before its workers, in the vLLM environment when this one has no vLLM
(:func:`rolloutd.daemon.inference.vllm_server.vllm_python`); each spec in the node config is then
replaced by ``vllm-engine+ipc://WORKERS_DIR/engine-N.sock`` (in the workers' folder, and theirs:
workers of a root daemon run as the sandbox user), so every worker's pool talks to the one engine
instead of loading the model again. "Ready" is the host's ``READY`` line, printed once the
engine passed a health probe. Stopped after the workers: SIGTERM to the host's process group
(vLLM's engine core is a child), then SIGKILL; the rung reached is kept in ``stop_rungs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path

from rolloutd.daemon.inference.engine_client import SPEC_PREFIX
from rolloutd.daemon.inference.vllm_server import ENGINE_ENV, vllm_python
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_user import SandboxUser
from rolloutd.native_io.errors import ConfigError, InferenceError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail

log = logging.getLogger(__name__)

INPROCESS_PREFIX = "vllm-inprocess:"


class NodeEngines:
    def __init__(self, config: NodeConfig, socket_dir: Path, workers_user: SandboxUser | None) -> None:
        self.config = config
        self.socket_dir = socket_dir
        self.workers_user = workers_user
        self.procs: list[asyncio.subprocess.Process] = []
        self.stop_rungs: list[str] = []

    def _python(self) -> str:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        return vllm_python()

    async def start(self) -> None:
        specs = self.config.inference_servers
        for i, spec in enumerate(specs):
            if not spec.startswith(INPROCESS_PREFIX):
                continue
            model = spec.removeprefix(INPROCESS_PREFIX)
            if not model:
                raise ConfigError("vllm-inprocess: needs a model path or name, e.g. vllm-inprocess:/models/qwen")
            socket_path = self.socket_dir / f"engine-{i}.sock"
            log_path = self.config.run_path / f"engine-{i}.log"
            with open(log_path, "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    self._python(), "-m", "rolloutd.daemon.inference.engine_host", "--model", model, "--socket",
                    str(socket_path), "--engine-args", self.config.inference_engine_args,
                    stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True, env={**ENGINE_ENV, **os.environ})
            self.procs.append(proc)
            assert proc.stdout is not None
            timeout_s = self.config.inference_engine_ready_timeout_s
            try:
                async with asyncio.timeout(timeout_s):
                    line = (await proc.stdout.readline()).decode().strip()
                    if not line:  # standard output closed: the host is exiting
                        await proc.wait()
            except TimeoutError:
                line = ""
            if not line.startswith("READY "):
                why = (f"exited with {proc.returncode}" if proc.returncode is not None else
                       f"did not start within {timeout_s:.0f}s (inference_engine_ready_timeout_s)")
                text = await asyncio.to_thread(log_path.read_text, errors="replace")
                raise InferenceError(f"the node's vLLM engine for {model} {why}; its log {log_path} ends:\n"
                                     + tail(text, LOG_TAIL_CHARS))
            if self.workers_user is not None:
                os.chown(socket_path, self.workers_user.uid, self.workers_user.gid)
            specs[i] = f"{SPEC_PREFIX}ipc://{socket_path}"
            log.info("vLLM engine for %s serves the node's workers at %s (pid %d)", model, socket_path, proc.pid)

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            rung = "term"
            try:
                await asyncio.wait_for(proc.wait(), self.config.shutdown_timeout_s)
            except TimeoutError:
                rung = "kill"
            # The engine core may outlive its parent: the whole group goes either way.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            self.stop_rungs.append(rung)
        self.procs.clear()
