"""Node daemon configuration: defaults < TOML file < ``ROLLOUTD_*`` variables < command-line flags.

Every field names its unit; unknown keys and wrong types are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rolloutd.daemon.common.config import load_typed_config
from rolloutd.daemon.sandbox.base import SandboxLimits
from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.run_dir import SOCKET_PATH_MAX, default_run_dir

SECRET_FILE_MAX_BYTES = 4096


def read_secret_file(path: str, name: str) -> str:
    """The stripped text of a secret file that only its owner can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{name}: cannot open {path}: {e}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{name}: {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"{name}: {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
        text = f.read(SECRET_FILE_MAX_BYTES + 1).decode(errors="replace").strip()
    if not text or len(text) > SECRET_FILE_MAX_BYTES:
        raise ConfigError(f"{name}: {path} must hold one key of 1 to {SECRET_FILE_MAX_BYTES} bytes")
    return text


@dataclass
class NodeConfig:
    run_dir: str = ""
    """Folder (mode 0700) for the sockets, pidfile, worker state and sandboxes; empty = default."""
    workers: int = 0
    """Worker processes; 0 = one per core."""
    backend: Literal["auto", "apptainer", "local"] = "auto"
    """Sandbox backend; ``auto`` = apptainer when installed, else local (which isolates nothing)."""
    image: str = "default"
    """Image of the warm sandboxes."""
    warm_sandboxes_per_worker: int = 2
    """Ready sandboxes each worker keeps for ``image``."""
    warm_ipython: bool = False
    """Warm sandboxes start their IPython kernel before they are leased; otherwise a lease starts
    it on its first cell (0.7-0.9 s then), and a rollout that never calls IPython never pays for one."""
    sandbox_max_age_s: float = 3600.0
    """An idle warm sandbox older than this is replaced."""
    sandbox_memory_mb: int = 8192
    """Memory of each sandbox, its tmpfs writes included (a memory cgroup where one is writable,
    else the watchdog reading /proc); over it, SANDBOX_LIMIT. 0 = no cap."""
    sandbox_process_memory_mb: int = 8192
    """Address space of each process in a sandbox (RLIMIT_AS). 0 = no limit."""
    sandbox_workspace_mb: int = 10240
    """What each sandbox's /workspace may hold: apptainer, a tmpfs of this size (writes past it fail
    with ENOSPC; RAM, so within sandbox_memory_mb); local, disk the watchdog walks. Full or over it,
    SANDBOX_LIMIT. 0 = no cap (and a /workspace on the host disk)."""
    sandbox_max_processes: int = 512
    """Processes each sandbox may run at once; over it, SANDBOX_LIMIT."""
    sandbox_disk_check_interval_s: float = 5.0
    """How often the watchdog walks workspaces on disk for sandbox_workspace_mb (a stat per file)."""
    sandbox_user: str = "rolloutd-sandbox"
    """When the daemon runs as root, the unprivileged user its workers and so every sandbox run as
    (``scripts/add-sandbox-user`` creates it); ignored for a daemon started by an ordinary user."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest message accepted, all frames together (bytes)."""
    shm_lease_timeout_s: float = 30.0
    """Shared-memory results of a client whose process is gone are unlinked after this."""
    completed_ttl_s: float = 600.0
    """How long a finished request id is remembered: a repeat gets the same answer, not a rerun."""
    worker_restart_delay_s: float = 0.5
    """Pause before restarting a dead worker (doubles, up to 30 s, while it keeps dying)."""
    shutdown_timeout_s: float = 15.0
    """Graceful stop budget before processes are killed."""
    tcp_bind: str = ""
    """Also listen on this ``tcp://host:port`` (CURVE only: needs the two key settings)."""
    curve_secret_key_file: str = ""
    """This node's CURVE secret key file (``rolloutd keygen``)."""
    curve_allowed_keys_dir: str = ""
    """Folder of public key files allowed to connect over TCP."""
    router: str = ""
    """Join this router (``tcp://host:port`` or ``ipc://path``) as a rollout node."""
    router_public_key_file: str = ""
    """The router's CURVE public key file; with ``curve_secret_key_file``, needed for a tcp router."""
    router_slots: int = 0
    """Requests (samples) the router may have in flight here at once; 0 = init + run + eval concurrency."""
    node_name: str = ""
    """Name at the router; empty = hostname and run folder."""
    inference_servers: list[str] = field(default_factory=list)
    """Inference servers, e.g. ``http://127.0.0.1:8000`` (protocol detected) or ``sglang+http://...``."""
    inference_api_key: str = ""
    """Bearer token sent to inference servers."""
    inference_server_keys: dict[str, str] = field(default_factory=dict)
    """Bearer tokens of single servers (spec -> token), for those added with their own key
    (``add_inference_server(address, api_key)``); the others use ``inference_api_key``."""
    inference_api_key_file: str = ""
    """File holding that token (mode 0600, read when the node starts; ``inference_api_key`` wins).
    The Slurm prolog passes ``~/.rolloutd/inference_api_key`` of the job's user when it exists."""
    inference_engine_args: str = "{}"
    """For ``vllm-inprocess:MODEL`` servers: vLLM ``AsyncEngineArgs`` fields as a JSON object
    (e.g. ``{"max_model_len": 16384, "dtype": "float32"}``); one engine per node serves all workers."""
    inference_engine_ready_timeout_s: float = 600.0
    """How long the node waits for each in-process vLLM engine to start (seconds)."""
    inference_server_wait_s: float = 120.0
    """How long a model turn waits for an inference server when none is usable (one restarting),
    within the turn's own deadline, before it fails with NO_INFERENCE_SERVER."""
    inference_weight_version: str = "0"
    """Weight version recorded for servers whose protocol reports none (vLLM); set at run time
    with the ``inference.set_weight_version`` op."""
    tokenizer: str = ""
    """Hugging Face tokenizer folder; empty = the reference policy's bundled tokenizer."""
    content_special_tokens: Literal["text", "reject", "special"] = "text"
    """How added tokens' text (``<|im_end|>``) in text the model did not write (tool output, task,
    a harness's messages) is encoded: ``text``, ``reject`` or ``special``; a request's agent config
    may override it (README, "Tokens"; the agents' side is ``agents.content_text``, which the
    config does not import: it would pull the agents into every process that reads a config)."""
    init_concurrency: int = 16
    """Rollouts in the init stage at once (per node)."""
    run_concurrency: int = 256
    """Rollouts in the run (agent) stage at once (per node)."""
    eval_concurrency: int = 32
    """Rollouts in the eval stage at once (per node)."""
    queue_limit: int = 4096
    """Rollout samples waiting for a stage slot before new submissions get BUSY."""
    debug_ops: bool = False
    """Answer the ``debug.*`` operations (synthetic arrays, sleeps; for tests and benchmarks) on the
    node's sockets; off, they are refused with PERMISSION_DENIED."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.inference_api_key_file and not self.inference_api_key:
            self.inference_api_key = read_secret_file(self.inference_api_key_file, "inference_api_key_file")
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        for name in ("warm_sandboxes_per_worker", "init_concurrency", "run_concurrency", "eval_concurrency",
                     "queue_limit", "max_message_bytes"):
            if getattr(self, name) < (0 if name == "warm_sandboxes_per_worker" else 1):
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tcp_bind and not (self.curve_secret_key_file and self.curve_allowed_keys_dir):
            raise ConfigError(
                "tcp_bind needs curve_secret_key_file and curve_allowed_keys_dir: rolloutd never listens "
                "on TCP without authentication (create keys with `rolloutd keygen`)"
            )
        if self.router.startswith("tcp://") and not (self.curve_secret_key_file and self.router_public_key_file):
            raise ConfigError(
                "a tcp router needs curve_secret_key_file (this node's key) and router_public_key_file: "
                "node and router only talk over TCP encrypted and authenticated (`rolloutd keygen`)"
            )
        if not self.sandbox_disk_check_interval_s > 0:
            raise ConfigError(f"sandbox_disk_check_interval_s must be > 0 seconds, got {self.sandbox_disk_check_interval_s}")
        for name in ("sandbox_memory_mb", "sandbox_process_memory_mb", "sandbox_workspace_mb"):
            if getattr(self, name) != 0 and getattr(self, name) < 16:
                raise ConfigError(f"{name} must be >= 16 (MiB), or 0 for no cap, got {getattr(self, name)}")
        if self.sandbox_max_processes < 8:
            raise ConfigError(f"sandbox_max_processes must be >= 8, got {self.sandbox_max_processes}")
        if self.router_slots < 0:
            raise ConfigError(f"router_slots must be >= 0, got {self.router_slots}")
        try:
            engine_args = json.loads(self.inference_engine_args)
        except ValueError as e:
            raise ConfigError(f"inference_engine_args must be a JSON object, got {self.inference_engine_args!r}: {e}") from e
        if not isinstance(engine_args, dict):
            raise ConfigError(f"inference_engine_args must be a JSON object, got {self.inference_engine_args!r}")
        if not self.inference_engine_ready_timeout_s > 0:
            raise ConfigError(f"inference_engine_ready_timeout_s must be > 0 seconds, got "
                              f"{self.inference_engine_ready_timeout_s}")
        if not self.inference_server_wait_s >= 0:  # NaN fails too
            raise ConfigError(f"inference_server_wait_s must be >= 0 seconds, got {self.inference_server_wait_s}")
        if len(str(self.socket_path)) > SOCKET_PATH_MAX:
            raise ConfigError(
                f"socket path {self.socket_path} is longer than {SOCKET_PATH_MAX} bytes (Unix socket limit); "
                "choose a shorter run_dir"
            )

    def sandbox_limits(self) -> SandboxLimits:
        """Every sandbox's caps (0 in a field: no cap)."""
        return SandboxLimits(max_processes=self.sandbox_max_processes, memory_mb=self.sandbox_memory_mb or None,
                             process_memory_mb=self.sandbox_process_memory_mb or None,
                             workspace_mb=self.sandbox_workspace_mb or None)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else default_run_dir()

    @property
    def socket_path(self) -> Path:
        return self.run_path / "node.sock"

    @property
    def address(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def worker_count(self) -> int:
        return self.workers or (os.cpu_count() or 1)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "NodeConfig":
        return cls(**json.loads(text))



def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> NodeConfig:
    """The node's configuration: defaults < TOML file (``path`` or ``$ROLLOUTD_CONFIG``) <
    ``ROLLOUTD_*`` variables < ``overrides``."""
    config: NodeConfig = load_typed_config(NodeConfig, "ROLLOUTD_", path, overrides, environ)
    return config
