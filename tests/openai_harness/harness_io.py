"""What the test harnesses in this folder share: running a tool call's bash command, and writing
what the harness saw for the test to read."""

from __future__ import annotations

import json
import subprocess


def run_bash(command: str) -> str:
    """The command's output (stdout then stderr, stripped), as the model gets it back."""
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
    return (run.stdout + run.stderr).strip()


def write_output(path: str, seen: dict, messages: list[dict]) -> int:
    """Write ``seen`` with the final ``messages`` to ``path``; the harness's exit status."""
    seen["messages"] = messages
    with open(path, "w") as f:
        json.dump(seen, f)
    return 0
