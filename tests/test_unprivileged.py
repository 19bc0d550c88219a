"""The cluster case: an ordinary user (no root, no --userns) runs real Apptainer sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from os_users import TEST_USER as USER
from privilege_probe import assert_unprivileged
from os_users import ensure_test_user

pytestmark = [pytest.mark.apptainer, pytest.mark.unprivileged]

SCRIPT = Path(__file__).with_name("unprivileged_smoke.py")


def _as_user_command() -> list[str]:
    if os.getuid() != 0:
        return [sys.executable, str(SCRIPT)]
    user = ensure_test_user()
    probe = subprocess.run(["runuser", "-u", USER, "--", sys.executable, "-c", "import rolloutd.daemon"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, (
        f"user {USER} cannot import rolloutd from {sys.executable}: make the checkout and its venv "
        f"readable (chmod o+rX on every parent folder): {probe.stderr[-500:]}"
    )
    env = ["env", f"ROLLOUTD_CACHE_DIR={os.environ['ROLLOUTD_CACHE_DIR']}", "HOME=" + user.pw_dir]
    return ["runuser", "-u", USER, "--", *env, sys.executable, str(SCRIPT)]


def test_sandbox_as_ordinary_user() -> None:
    proc = subprocess.run(_as_user_command(), capture_output=True, text=True, timeout=150, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    uid = seen["host_uid"]
    assert uid != 0
    lines = seen["shell_output"].splitlines()
    assert lines[0] == str(uid)  # no fake root: the same uid inside
    assert "Permission denied" in lines[1] or "Read-only" in lines[1]
    assert lines[2] == "ws"
    assert seen["kernel_uid"] == str(uid)
    assert_unprivileged(seen["privileges"], uid)
    assert seen["task_repo"].splitlines() == ["1", "0", "read-only"], seen["task_repo"]
    assert seen["leftover_instances"] == [] and seen["alive_after_close"] == []
    assert seen["state_dir_mode"] == "0o700"
