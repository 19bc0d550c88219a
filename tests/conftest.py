"""Shared fixtures: real sandboxes of every backend, short run folders, leak checks."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Tests share the image cache the Makefile and CI build into (readable by the unprivileged user).
os.environ.setdefault("ROLLOUTD_CACHE_DIR", str(REPO / ".cache"))

from rolloutd.daemon.sandbox.apptainer import ApptainerBackend  # noqa: E402
from rolloutd.daemon.sandbox.base import SandboxBackend  # noqa: E402
from rolloutd.daemon.sandbox.local import LocalBackend  # noqa: E402
from rolloutd.native_io.procfs import live_processes  # noqa: E402

BACKENDS = ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short folder: ipc socket paths must stay under the ~107-byte Unix-socket limit."""
    path = Path(tempfile.mkdtemp(prefix="rld-"))
    path.chmod(0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_backend(kind: str, state_dir: Path) -> SandboxBackend:
    return ApptainerBackend(state_dir, uncontained_root_ok=True) if kind == "apptainer" else LocalBackend(state_dir)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[SandboxBackend]:
    be = make_backend(request.param, short_tmp)
    yield be
    if isinstance(be, ApptainerBackend):
        assert be.leftover_instances() == [], "a test left an Apptainer instance registered"


def instance_inits() -> set[int]:
    """PIDs of live Apptainer instance init processes on this machine."""
    return {p.pid for p in live_processes() if p.comm == "appinit"}


@pytest.fixture(autouse=True)
def no_leaked_instances() -> Iterator[None]:
    before = instance_inits()
    yield
    # Stops are synchronous in our code, but the kernel may take a moment to tear a namespace down.
    for _ in range(50):
        leaked = instance_inits() - before
        if not leaked:
            return
        import time

        time.sleep(0.05)
    pytest.fail(f"test leaked Apptainer instances (init PIDs {sorted(leaked)})")


@pytest.fixture(autouse=True)
def every_trajectory_is_valid(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every trajectory a test makes (a daemon's results as the client unpacks them, the
    pipeline's, the adapters' and the fixtures') goes through ``rolloutd.client.validate`` when it
    is built (shared-memory views may be refilled later); the test fails naming what broke. A test
    that builds broken ones on purpose is marked ``invalid_trajectories``."""
    if request.node.get_closest_marker("invalid_trajectories"):
        yield
        return
    from rolloutd.native_io.trajectory import Trajectory
    from rolloutd.client.validate import trajectory_problems

    built = Trajectory.__post_init__
    problems: list[str] = []

    def checked(self: Trajectory) -> None:
        built(self)
        problems.extend(f"{self.request_id}/{self.sample_index} ({self.task_id}): {p}"
                        for p in trajectory_problems(self))

    monkeypatch.setattr(Trajectory, "__post_init__", checked)
    yield
    if problems:
        pytest.fail(f"{len(problems)} invalid trajectories: " + "; ".join(problems[:10]))


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Async tests run on uvloop, the daemon's loop."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}

# The real Slurm cluster of the `slurm` tests (test_slurm.py, test_slurm_attacks.py), set up once.
from slurm_support import slurm, slurm_cluster  # noqa: E402,F401
