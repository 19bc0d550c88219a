"""The reaper of a dead worker's state folder kills what works there and nothing of a sibling
worker's: w1's folder is no string prefix of w10's (tests/test_slurm_attacks.py does the same
through a real node daemon with 11 workers under Slurm)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rolloutd.daemon.node.reaper import reap_state_dir
from rolloutd.native_io.procfs import pid_alive


def test_reaping_w1_spares_w10(short_tmp: Path) -> None:
    w1, w10 = short_tmp / "w1", short_tmp / "w10"
    for folder in (w1 / "sb", w10 / "sb"):
        folder.mkdir(parents=True)
    hold = "sleep 60; :"  # the ':' keeps bash from exec'ing sleep, so its argv stays as given
    mine = [subprocess.Popen(["bash", "-c", hold], cwd=w1 / "sb"),
            subprocess.Popen(["bash", "-c", hold, "x", "--bind", f"{w1}/sb:/workspace"])]
    theirs = [subprocess.Popen(["bash", "-c", hold], cwd=w10 / "sb"),
              subprocess.Popen(["bash", "-c", hold, "x", "--bind", f"{w10}/sb:/workspace"]),
              subprocess.Popen(["bash", "-c", hold, "x", f"--overlay={w10}/sb"])]
    try:
        assert reap_state_dir(w1) >= len(mine)  # and the sleep under the first bash (its cwd)
        for p in mine:
            p.wait(timeout=10)
        assert all(pid_alive(p.pid) for p in theirs), "reaping w1 killed w10's processes"
        assert not w1.exists() and w10.exists()
    finally:
        for p in mine + theirs:
            p.kill()
            p.wait()
