"""A real single-node Slurm cluster for the ``slurm`` tests, driven as root and as an ordinary user.

``scripts/start-test-slurm`` starts it (munged, slurmctld, slurmd) with the project's Prolog,
Epilog and TaskProlog from ``slurm_templates/``; the tests rewrite the hooks' config file between
jobs, submit as ``TEST_USER``, and check what the node daemon left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from os_users import ensure_test_user
from support.descriptors import descriptor_targets

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "start-test-slurm"
CLIENT = Path(__file__).with_name("slurm_job_client.py")
CLUSTER_DIR = Path(os.environ.get("ROLLOUTD_TEST_SLURM_DIR", "/tmp/rld-slurm"))
RUN_BASE = Path("/run/rld-sj")
PY = sys.executable
CANCEL_RETRY_S = 5.0
"""How long a cancel waits for the job to leave the queue before it sends scancel again."""
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def default_hook_config() -> dict[str, str]:
    return {
        "ROLLOUTD": str(Path(sys.executable).with_name("rolloutd")),
        "RUN_BASE": str(RUN_BASE),
        "BACKEND": "local",
        "WORKERS": "1",
        "WARM": "1",
        "CACHE_DIR": os.environ["ROLLOUTD_CACHE_DIR"],
        "READY_TIMEOUT_S": "60",
        "STOP_TIMEOUT_S": "10",
    }


def script_env() -> dict[str, str]:
    return {**os.environ, "ROLLOUTD_TEST_SLURM_DIR": str(CLUSTER_DIR), "ROLLOUTD_SLURM_RUN_BASE": str(RUN_BASE),
            "ROLLOUTD_BIN": default_hook_config()["ROLLOUTD"]}


def proc_alive(pid: int) -> bool:
    """Exists and is not a zombie (orphans are reaped late by PID 1 in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def processes_of(uid: int, run_dir: Path, sid: int) -> list[str]:
    """Live processes of ``uid`` in session ``sid`` or naming ``run_dir`` (cmdline or cwd)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.stat(entry.path).st_uid != uid or not proc_alive(pid):
                continue
            with open(f"{entry.path}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"{entry.path}/cwd")
            if os.getsid(pid) == sid or str(run_dir) in cmd or cwd.startswith(str(run_dir)):
                found.append(f"{pid}: {cmd}")
        except OSError:
            continue
    return found


def _pipes(pid: int) -> set[str]:
    return {t for t in descriptor_targets(pid) if t.startswith("pipe:")}


def pipes_shared_outside_session(pid: int) -> set[str]:
    """Pipes open in ``pid`` that a process outside its session also holds (e.g. slurmd's
    end of a prolog's output pipe)."""
    mine = _pipes(pid)
    shared = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) != os.getsid(pid):
                    shared |= mine & _pipes(int(entry.name))
    return shared


@dataclass
class SlurmCluster:
    user: pwd.struct_passwd
    host: str

    @property
    def env(self) -> dict[str, str]:
        return {"PATH": SYSTEM_PATH, "SLURM_CONF": str(CLUSTER_DIR / "etc" / "slurm.conf"), "LANG": "C.UTF-8"}

    @property
    def hooks(self) -> Path:
        return CLUSTER_DIR / "hooks"

    @property
    def hook_log(self) -> Path:
        return RUN_BASE / "hooks.log"

    def write_hook_config(self, lines: list[str] | None = None, **overrides: str) -> None:
        """The admin's config file beside the hooks: the defaults with ``overrides``, plus raw ``lines``."""
        values = {**default_hook_config(), **overrides}
        text = "".join(f"{k}={v}\n" for k, v in values.items()) + "".join(f"{line}\n" for line in lines or [])
        path = self.hooks / "rolloutd-slurm.conf"
        path.write_text(text)
        path.chmod(0o644)

    def root(self, *argv: str, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s, check=check)

    def as_user(self, *argv: str, timeout_s: float = 60, cwd: str = "/tmp",
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` as the ordinary user, with a bare login-like environment (no ROLLOUTD_*) plus ``env``."""
        values = {**self.env, "HOME": self.user.pw_dir, "USER": self.user.pw_name, **(env or {})}
        env_args = [f"{k}={v}" for k, v in values.items()]
        return subprocess.run(["runuser", "-u", self.user.pw_name, "--", "env", "-i", *env_args, *argv],
                              capture_output=True, text=True, timeout=timeout_s, cwd=cwd)

    def job_dir(self, base: Path, name: str = "job") -> Path:
        """A folder the user's jobs write into."""
        base.chmod(0o755)
        path = base / name
        path.mkdir()
        os.chown(path, self.user.pw_uid, self.user.pw_gid)
        return path

    def sbatch(self, folder: Path, script: str | Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (a file, or the text of a bash script) as the user."""
        path = script
        if isinstance(script, str):
            path = folder / "job.sh"
            path.write_text("#!/bin/bash\n" + script)
            path.chmod(0o755)
        out = self.as_user("sbatch", "--parsable", f"--chdir={folder}", f"--output={folder}/%j.out", *args, str(path),
                           env=env)
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        return int(out.stdout.strip().split(";")[0])

    def job_fields(self, job: int) -> dict[str, str]:
        out = self.root("scontrol", "-o", "show", "job", str(job), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_done(self, job: int, timeout_s: float = 90) -> str:
        """Wait until the job left the queue (epilogs included: COMPLETING is still queued); its state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.root("squeue", "-h", "-j", str(job), "-o", "%T", check=False).stdout.strip():
                return self.job_fields(job).get("JobState", "")
            time.sleep(0.2)
        raise AssertionError(f"job {job} still queued after {timeout_s} s: {self.job_fields(job)}")

    def cancel(self, job: int, timeout_s: float = 90) -> str:
        """Cancel ``job`` and wait until it left the queue; its state. scancel is repeated: a job
        caught in the requeue that follows a failed prolog ignores a single one."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.root("scancel", str(job), check=False)
            try:
                return self.wait_done(job, timeout_s=min(CANCEL_RETRY_S, max(0.0, deadline - time.monotonic())))
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise

    def resume_node(self) -> str:
        """Put a drained node back in service and wait until it is idle; the drain reason it had ("" when none)."""
        node = self.node_fields()
        reason = node["Reason"] if "DRAIN" in node.get("State", "") else ""
        if reason:
            self.root("scontrol", "update", f"NodeName={self.host}", "State=RESUME", check=False)
        self.wait_node_idle()
        return reason

    def node_fields(self) -> dict[str, str]:
        out = self.root("scontrol", "-o", "show", "node", self.host).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        reason = re.search(r"Reason=(.*?)( \[\S+@\S+\])?$", out.strip())
        fields["Reason"] = reason.group(1) if reason else ""
        return fields

    def wait_node_idle(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.node_fields().get("State") == "IDLE":
                return
            time.sleep(0.2)
        raise AssertionError(f"node {self.host} not idle: {self.node_fields()}")

    def assert_daemon_gone(self, run_dir: Path, pid: int, timeout_s: float = 10) -> None:
        """No process, socket, run folder or shared-memory segment of the job's daemon remains."""
        uid = self.user.pw_uid
        deadline = time.monotonic() + timeout_s
        while proc_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not proc_alive(pid), f"node daemon {pid} still running after the job"
        assert processes_of(uid, run_dir, pid) == [], "daemon processes left behind"
        assert not run_dir.exists(), f"{run_dir} left behind: {list(run_dir.iterdir())}"
        assert list(Path("/dev/shm").glob(f"rld{uid}-{pid}-*")) == [], "shared-memory segments left behind"


def wait_for_file(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    user = ensure_test_user()
    probe = subprocess.run(["runuser", "-u", user.pw_name, "--", PY, "-c", "import rolloutd.client"],
                           capture_output=True, text=True, cwd="/tmp")
    assert probe.returncode == 0, (
        f"user {user.pw_name} cannot import rolloutd from {PY}: make the checkout and its venv readable "
        f"(chmod o+rX on every parent folder): {probe.stderr[-500:]}"
    )
    env = script_env()
    started_here = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True).returncode != 0
    # Also run when it is up: setup installs the current hooks.
    setup = subprocess.run([str(SCRIPT), "setup"], env=env, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, f"scripts/start-test-slurm setup failed:\n{setup.stderr[-3000:]}"
    try:
        yield SlurmCluster(user=user, host=socket.gethostname().split(".")[0])
    finally:
        if started_here:
            subprocess.run([str(SCRIPT), "teardown"], env=env, capture_output=True, timeout=120)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with the default hook config; afterwards no job of the test is left and the node is idle."""
    slurm_cluster.write_hook_config()
    yield slurm_cluster
    slurm_cluster.write_hook_config()
    leftover = slurm_cluster.root("squeue", "-h", "-u", slurm_cluster.user.pw_name, "-o", "%i").stdout.split()
    for job in leftover:
        slurm_cluster.cancel(int(job))
    # Put back in service whatever the test left, so that one failure does not fail every later test.
    drained = slurm_cluster.resume_node()
    assert leftover == [], f"the test left jobs {leftover}"
    assert not drained, f"the test left the node drained: {drained}"


def hold_script(folder: Path, command: str = "echo hi; id -u") -> str:
    """A batch script that reports through the client, then waits for ``folder/release``."""
    return (f"{PY} {CLIENT} '{command}' > {folder}/report.json 2> {folder}/client.err\n"
            f"touch {folder}/ready\n"
            f"while [ ! -e {folder}/release ]; do sleep 0.2; done\n")


def read_report(folder: Path, job: int) -> dict[str, Any]:
    wait_for_file(folder / "ready")
    text = (folder / "report.json").read_text()
    assert text, f"the job's client failed: {(folder / 'client.err').read_text()[-2000:]}"
    report: dict[str, Any] = json.loads(text)
    assert report["job"] == str(job)
    return report
