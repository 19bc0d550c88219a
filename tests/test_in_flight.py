"""Many rollouts in flight on one node: ``bench/in_flight.py`` at a moderate level (the bench
holds every rollout at a barrier inside its sandbox until all are in flight at once, then lets
them finish); every one must be in flight together and none may be lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_FLIGHT = 200
LIMIT_S = 150
"""Per step of the level (all held, all answered, idle again); about 30 s each on a loaded node."""

pytestmark = pytest.mark.timeout(4 * LIMIT_S)


def test_200_rollouts_in_flight_at_once_and_none_lost(tmp_path: Path) -> None:
    out = tmp_path / "in_flight.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "in_flight.py"), "--levels", str(IN_FLIGHT),
                          "--limit-s", str(LIMIT_S), "--json", str(out)], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=4 * LIMIT_S)
    assert out.exists(), f"the bench wrote no results ({run.returncode}): {run.stdout[-2000:]}{run.stderr[-3000:]}"
    results = json.loads(out.read_text())
    (level,) = results["levels_detail"]
    # Three independent counts: run-stage slots, flock processes waiting in the sandboxes, and
    # the overlap of the trajectories' own stage times.
    assert (level["held_run_stage"], level["held_flock"], level["in_flight_exact"]) == (IN_FLIGHT,) * 3, level
    assert results["lost"] == 0 and level["completed"] == IN_FLIGHT, level["lost_reasons"]
    assert results["rss_mb_per_rollout"] > 0, results
    assert run.returncode == 0, run.stdout[-2000:]
