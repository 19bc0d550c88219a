"""The ordinary user some tests act as (CI runs as root and creates it)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TEST_USER = "rolloutd-test"


def ensure_test_user() -> pwd.struct_passwd:
    """``TEST_USER``'s passwd entry, creating the user if missing; needs root."""
    if os.getuid() != 0:
        pytest.fail(f"this test needs root to act as the ordinary user {TEST_USER} (CI runs as root)")
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", TEST_USER], check=True)
        return pwd.getpwnam(TEST_USER)


def run_json_script(script: Path, *args: str, as_user: bool, timeout_s: float = 240) -> Any:
    """Run a test script of this folder with this Python, as root or as ``TEST_USER`` (who gets
    the image cache and this folder on PYTHONPATH), and return the JSON of its last output line."""
    argv = [sys.executable, str(script), *args]
    if as_user:
        user = ensure_test_user()
        argv = ["runuser", "-u", TEST_USER, "--", "env", f"ROLLOUTD_CACHE_DIR={os.environ['ROLLOUTD_CACHE_DIR']}",
                f"HOME={user.pw_dir}", f"PYTHONPATH={script.parent}", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
