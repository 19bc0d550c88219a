"""rolloutd sandboxes as a Harbor environment: Harbor's own Trial (its oracle and nop agents, its
verifier) runs the Harbor fixture tasks in sandboxes of a real node daemon (Apptainer, images
built from the tasks' Dockerfiles), in Harbor's environment (.venv-harbor: it needs Python 3.12)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from daemon_fixtures import node_daemon
from task_formats_support import HARBOR_TASKS

REPO = Path(__file__).resolve().parent.parent
HARBOR_PYTHON = Path(os.environ.get("ROLLOUTD_HARBOR_VENV", REPO / ".venv-harbor")) / "bin" / "python"
TRIAL_TIMEOUT_S = 300
"""One trial: the image is cached after the task-format tests; Harbor's own start-up takes seconds."""

pytestmark = [pytest.mark.apptainer, pytest.mark.slow, pytest.mark.timeout(4 * TRIAL_TIMEOUT_S + 120)]


def test_harbor_trials_run_on_rolloutd_sandboxes(short_tmp: Path) -> None:
    if not HARBOR_PYTHON.exists():
        pytest.fail(f"no Harbor environment at {HARBOR_PYTHON.parent.parent}: run scripts/install-harbor "
                    "(part of make setup)")
    rewards = {}
    with node_daemon(short_tmp / "n", "--backend", "apptainer", "--workers", "1", "--warm", "0") as address:
        for task in HARBOR_TASKS:
            for agent in ("oracle", "nop"):
                r = subprocess.run([str(HARBOR_PYTHON), str(REPO / "tests" / "harbor_env" / "run_trial.py"), str(task),
                                    agent, str(short_tmp / "trials"), address],
                                   capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S)
                assert r.returncode == 0, r.stderr[-3000:]
                result = json.loads(r.stdout.strip().splitlines()[-1])
                assert result["exception"] is None, result["exception"]
                rewards[task.name, agent] = result["rewards"]
    assert rewards == {(t.name, a): {"reward": 1.0 if a == "oracle" else 0.0}
                       for t in HARBOR_TASKS for a in ("oracle", "nop")}, rewards
