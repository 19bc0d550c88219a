"""The ordinary user some tests act as (CI runs as root and creates it)."""

from __future__ import annotations

import os
import pwd
import subprocess

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
