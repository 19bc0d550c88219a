"""Many rollouts in flight on one node: ``bench/in_flight.py`` at a moderate level (the bench
holds every rollout at a barrier inside its sandbox until all are in flight at once, then lets
them finish); every one must be in flight together and none may be lost."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from PIL import Image

from daemon_fixtures import start_nodes, stop_node

REPO = Path(__file__).resolve().parent.parent
IN_FLIGHT = 200
LIMIT_S = 150
"""Per step of the level (all held, all answered, idle again); about 30 s each on a loaded node."""

pytestmark = pytest.mark.timeout(4 * LIMIT_S)


def test_200_rollouts_in_flight_at_once_and_none_lost(tmp_path: Path) -> None:
    out, png = tmp_path / "in_flight.json", tmp_path / "in_flight.png"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "in_flight.py"), "--levels", str(IN_FLIGHT),
                          "--limit-s", str(LIMIT_S), "--json", str(out), "--plot", str(png)], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=4 * LIMIT_S)
    assert out.exists(), f"the bench wrote no results ({run.returncode}): {run.stdout[-2000:]}{run.stderr[-3000:]}"
    results = json.loads(out.read_text())
    (level,) = results["levels_detail"]
    # Three independent counts: run-stage slots, flock processes waiting in the sandboxes, and
    # the overlap of the trajectories' own stage times.
    assert (level["held_run_stage"], level["held_flock"], level["in_flight_exact"]) == (IN_FLIGHT,) * 3, level
    assert results["lost"] == 0 and level["completed"] == IN_FLIGHT, level["lost_reasons"]
    assert results["rss_mb_per_rollout"] > 0, results
    assert run.returncode == 0, run.stdout[-2000:]
    with Image.open(png) as image:  # a real PNG of the bench's three curves
        assert image.format == "PNG" and image.size[0] > 2 * image.size[1], image.size


def test_workers_may_open_as_many_descriptors_as_the_hard_limit_allows(short_tmp: Path) -> None:
    # A node started with the common soft limit of 1,024 open files: a worker holds about a dozen
    # per rollout in flight, so it must raise its soft limit to the hard one.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard > 1024, f"this test needs a hard limit above 1,024 open files (it is {hard})"
    start_nodes([short_tmp], "--backend", "local", "--workers", "1", "--warm", "0",
                prefixes=[("prlimit", f"--nofile=1024:{hard}", "--")])
    pid = int((short_tmp / "node.pid").read_text())
    try:
        daemon = psutil.Process(pid)
        procs = [daemon, *daemon.children()]
        assert len(procs) == 2
        for proc in procs:
            # /proc, not prlimit(2): the workers run as the sandbox user, whose limits root may not read that way.
            line = next(l for l in Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
                        if l.startswith("Max open files"))
            assert line.split()[3:5] == [str(hard), str(hard)], (proc.cmdline(), line)
    finally:
        stop_node(short_tmp, [pid])
