"""The stack the fault and soak benches run: a scripted reference policy server on a fixed port
(so a restart keeps its address) and a detached node daemon with Apptainer sandboxes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.net import free_port  # noqa: E402

from rolloutd.cli.demo import policy_server  # noqa: E402
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail  # noqa: E402

CLI = [sys.executable, "-m", "rolloutd.cli.main", "node"]
NODE_ARGS = ["--backend", "apptainer", "--workers", "2", "--warm", "2"]


def start_node(run_dir: Path, url: str, env: dict[str, str]) -> str:
    out = subprocess.run([*CLI, "start", "--detach", "--run-dir", str(run_dir), "--ready-timeout-s", "180",
                          *NODE_ARGS, "--inference-server", url], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=240)
    if out.returncode != 0:
        raise SystemExit(f"the node daemon did not start: {tail(out.stderr, LOG_TAIL_CHARS)}")
    return out.stdout.strip().splitlines()[-1]


class Policy:
    """The scripted policy server on a fixed port, so that a restart is the same address."""

    def __init__(self, plans_file: Path, api_key: str) -> None:
        self.plans_file, self.api_key, self.port = plans_file, api_key, free_port()
        self._ctx: Any = None
        self.url = ""

    def start(self) -> None:
        self._ctx = policy_server(self.plans_file, self.api_key, extra=["--port", str(self.port)])
        self.url = self._ctx.__enter__()

    def stop(self, hard: bool = False) -> None:
        if self._ctx is not None:
            if hard:
                for p in psutil.process_iter(["cmdline"]):
                    if "policy-server" in " ".join(p.info["cmdline"] or []) and str(self.port) in " ".join(
                            p.info["cmdline"] or []):
                        p.kill()
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def restart(self) -> None:
        self.stop(hard=True)
        self.start()
