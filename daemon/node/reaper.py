"""Cleaning up after a worker that died: its sandboxes must not outlive it.

A killed worker cannot stop its sandboxes, so the supervisor does it from what the worker left
on disk: every Apptainer instance whose pidfile lies in the worker's state folder is killed
through its init (which ends the whole PID namespace), and every host process that still works
in that folder (local-backend shells and kernels) is killed. Then the folder goes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


def _instance_pids(state_dir: Path) -> set[int]:
    pids = set()
    for pidfile in state_dir.glob("*/instance.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(pidfile.read_text().strip()))
    for meta in state_dir.glob("apptainer/instances/app/*/*/*/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pids.add(int(json.loads(meta.read_text())["pid"]))
    return pids


def _processes_using(state_dir: Path) -> set[int]:
    folder = str(state_dir.resolve())
    # The folder as whole path components, alone or inside an argument (--bind SRC:DST,
    # --flag=PATH): worker w1's folder names w1/x, never w10/x.
    named = re.compile(rf"(?:^|[=:,\s]){re.escape(folder)}(?:$|[/:,\s])")
    found = set()
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        if proc.info["pid"] == os.getpid():
            continue
        cwd = proc.info.get("cwd") or ""
        if cwd == folder or cwd.startswith(folder + "/") or any(named.search(a) for a in proc.info.get("cmdline") or []):
            found.add(proc.info["pid"])
    return found


def reap_state_dir(state_dir: Path) -> int:
    """Kill everything a (dead) worker left running under ``state_dir`` and remove it."""
    if not state_dir.exists():
        return 0
    victims = _instance_pids(state_dir) | _processes_using(state_dir)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if victims:
        log.warning("reaped %d leftover sandbox processes under %s", len(victims), state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    return len(victims)
