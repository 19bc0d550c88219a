"""The Slurm integration against a real slurmctld/slurmd: the project's Prolog starts a node daemon
for each job, the TaskProlog points the job's tasks at it, the Epilog leaves nothing behind
(normal end, scancel, time-out, a wedged daemon), and a broken config drains the node with a
readable reason. Jobs are submitted as an ordinary user."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from slurm_support import (
    CLIENT,
    CLUSTER_DIR,
    RUN_BASE,
    PY,
    SlurmCluster,
    hold_script,
    pipes_shared_outside_session,
    read_report,
)
from support.net import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.unprivileged]

TEMPLATES = Path(__file__).resolve().parent.parent / "slurm_templates"


def test_batch_job_and_its_tasks_use_the_daemon(slurm: SlurmCluster, short_tmp: Path) -> None:
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, f"{PY} {CLIENT}\nsrun -n 2 {PY} {CLIENT}\n", "-n", "2")
    assert slurm.wait_done(job) == "COMPLETED", (folder / f"{job}.out").read_text()
    reports = [json.loads(line) for line in (folder / f"{job}.out").read_text().splitlines() if line.startswith("{")]
    assert len(reports) == 3  # the batch script and two tasks of a step
    run_dir = RUN_BASE / f"job{job}"
    uid = slurm.user.pw_uid
    for r in reports:
        assert r["address"] == f"ipc://{run_dir}/node.sock"
        assert (r["output"], r["exit_code"]) == (f"hi\n{uid}\n", 0)
        assert r["uid"] == uid and r["daemon_uid"] == uid  # the daemon runs as the job's user
        # Its own session: slurmd kills the prolog's process group, and the job's steps do not own it.
        assert r["daemon_sid"] == r["daemon_pid"]
    assert len({r["daemon_pid"] for r in reports}) == 1
    slurm.assert_daemon_gone(run_dir, reports[0]["daemon_pid"])


def test_daemon_holds_no_pipe_of_the_prolog(slurm: SlurmCluster, short_tmp: Path) -> None:
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder))
    report = read_report(folder, job)
    pid, run_dir = report["daemon_pid"], RUN_BASE / f"job{job}"
    fds = {n: os.readlink(f"/proc/{pid}/fd/{n}") for n in ("0", "1", "2")}
    assert fds == {"0": "/dev/null", "1": str(run_dir / "node.log"), "2": str(run_dir / "node.log")}
    assert pipes_shared_outside_session(pid) == set(), "the daemon shares a pipe with a process outside it"
    (folder / "release").touch()
    assert slurm.wait_done(job) == "COMPLETED"
    slurm.assert_daemon_gone(run_dir, pid)


def test_scancel_stops_the_daemon(slurm: SlurmCluster, short_tmp: Path) -> None:
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder))
    report = read_report(folder, job)
    assert report["output"].startswith("hi\n")
    slurm.as_user("scancel", str(job))
    assert slurm.wait_done(job) == "CANCELLED"
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])


def test_time_limit_stops_the_daemon(slurm: SlurmCluster, short_tmp: Path) -> None:
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder), "--time=1")
    report = read_report(folder, job)
    # Slurm counts limits in minutes; lowering this job's to zero makes its own limit check end it
    # at the next pass instead of a minute from now.
    slurm.root("scontrol", "update", f"JobId={job}", "TimeLimit=0")
    assert slurm.wait_done(job) == "TIMEOUT"
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])


@pytest.mark.parametrize("stop_works", [True, False], ids=["deaf-daemon", "stop-broken"])
def test_epilog_forces_a_wedged_daemon(slurm: SlurmCluster, short_tmp: Path, stop_works: bool) -> None:
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder))
    report = read_report(folder, job)
    pid = report["daemon_pid"]
    os.kill(pid, signal.SIGSTOP)  # deaf to SIGTERM
    if stop_works:
        slurm.write_hook_config(STOP_TIMEOUT_S="2")
    else:  # `rolloutd node stop` broken too: only the epilog's own forced path is left
        slurm.write_hook_config(ROLLOUTD="/bin/false", STOP_TIMEOUT_S="2")
    (folder / "release").touch()
    assert slurm.wait_done(job) == "COMPLETED"
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", pid)
    log = [line for line in slurm.hook_log.read_text().splitlines() if f" epilog job {job} " in line]
    if stop_works:
        assert f"node daemon {pid} of {slurm.user.pw_name} stopped: stopped node daemon pid {pid} (sigkill)" \
            in log[-1], log
    else:
        assert any("rolloutd node stop failed" in line for line in log), log
        assert any("forcing leftover processes of the node daemon: " in line and str(pid) in line for line in log)


@pytest.mark.parametrize("broken", ["hook-config", "node-config"])
def test_bad_config_drains_the_node_with_the_reason(slurm: SlurmCluster, short_tmp: Path, broken: str) -> None:
    folder = slurm.job_dir(short_tmp)
    if broken == "hook-config":
        slurm.write_hook_config(lines=["WORKERZ=2"])
        expected = "unknown key WORKERZ"
    else:  # the hooks' file is fine, but `rolloutd node check` (run as nobody) refuses the node settings
        node_config = short_tmp / "node.toml"
        node_config.write_text("max_sandboxes = 3\n")
        node_config.chmod(0o644)
        short_tmp.chmod(0o755)
        slurm.write_hook_config(NODE_CONFIG=str(node_config))
        expected = (f"NODE_CONFIG {node_config} is refused: rolloutd: error [CONFIG]: "
                    "node config: unknown field(s) ['max_sandboxes']")
    job = slurm.sbatch(folder, "echo should not run\n")
    try:
        for _ in range(150):  # the job goes back to the queue, held, once its epilog ran
            node, fields = slurm.node_fields(), slurm.job_fields(job)
            if "DRAIN" in node.get("State", "") and fields.get("JobState") == "PENDING":
                break
            time.sleep(0.2)
        assert "DRAIN" in node["State"], node
        assert node["Reason"].startswith("rolloutd prolog: ") and expected in node["Reason"], node
        assert fields["JobState"] == "PENDING" and "held" in fields.get("Reason", "").lower(), fields
        slurmd_log = (CLUSTER_DIR / "log" / "slurmd.log").read_text(errors="replace")
        assert f"[job {job}] prolog failed" in slurmd_log and expected in slurmd_log
        assert not (folder / f"{job}.out").exists() or "should not run" not in (folder / f"{job}.out").read_text()
    finally:
        slurm.write_hook_config()
        slurm.cancel(job)
        slurm.resume_node()


def test_salloc_session_finds_the_daemon(slurm: SlurmCluster, short_tmp: Path) -> None:
    # PrologFlags=Alloc: the daemon is up at allocation, before any step; steps get the address.
    check = f'test -S {RUN_BASE}/job$SLURM_JOB_ID/node.sock && srun {PY} {CLIENT} "echo salloc"'
    out = slurm.as_user("salloc", "-N1", "-n1", "--time=1", "bash", "-c", check)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["output"] == "salloc\n" and report["daemon_uid"] == slurm.user.pw_uid
    job = int(report["job"])
    slurm.wait_done(job)
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])


def test_jobs_share_one_daemon_per_user_when_configured(slurm: SlurmCluster, short_tmp: Path) -> None:
    slurm.write_hook_config(SHARE="user")
    first, second = slurm.job_dir(short_tmp, "a"), slurm.job_dir(short_tmp, "b")
    a = slurm.sbatch(first, hold_script(first))
    ra = read_report(first, a)
    b = slurm.sbatch(second, hold_script(second))
    rb = read_report(second, b)
    run_dir = RUN_BASE / f"u{slurm.user.pw_uid}"
    assert ra["address"] == rb["address"] == f"ipc://{run_dir}/node.sock"
    assert ra["daemon_pid"] == rb["daemon_pid"]
    (first / "release").touch()
    assert slurm.wait_done(a) == "COMPLETED"
    os.kill(ra["daemon_pid"], 0)  # the second job still holds a reference
    assert (run_dir / "node.sock").exists()
    (second / "release").touch()
    assert slurm.wait_done(b) == "COMPLETED"
    slurm.assert_daemon_gone(run_dir, ra["daemon_pid"])


@pytest.mark.apptainer
def test_job_with_apptainer_sandboxes(slurm: SlurmCluster, short_tmp: Path) -> None:
    slurm.write_hook_config(BACKEND="apptainer")
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, f"{PY} {CLIENT} 'test -d /.singularity.d && echo contained; id -u'\n")
    assert slurm.wait_done(job, timeout_s=120) == "COMPLETED", (folder / f"{job}.out").read_text()
    report = json.loads((folder / f"{job}.out").read_text().strip().splitlines()[-1])
    assert report["output"] == f"contained\n{slurm.user.pw_uid}\n"
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])


def test_single_node_template(slurm: SlurmCluster, short_tmp: Path) -> None:
    """slurm_templates/sbatch-single-node.sh as shipped, with the reference CPU policy (scripted,
    key-protected) standing in for vLLM and the test client for the trainer: the template hands
    the server and its key to the prolog's daemon, and a rollout runs end to end through it."""
    from rolloutd.daemon.tasks.datasets import oracle_plans

    folder = slurm.job_dir(short_tmp)
    plans = folder / "plans.json"
    plans.write_text(json.dumps({"plans": oracle_plans()}))
    plans.chmod(0o644)
    task = sorted(oracle_plans())[0]
    port = free_port()
    rolloutd = Path(PY).with_name("rolloutd")
    job = slurm.sbatch(folder, TEMPLATES / "sbatch-single-node.sh", "--cpus-per-task=1", "--gres=none", env={
        "INFERENCE_PORT": str(port),
        "INFERENCE_CMD": f"{rolloutd} policy-server --port {port} --scripted {plans}",
        "INFERENCE_API_KEY": "sekrit-of-this-job",
        "TRAINER_CMD": f"env ROLLOUTD_POLICY_API_KEY= ROLLOUTD_TEST_ROLLOUT_TASK={task} {PY} {CLIENT}",
        "ROLLOUTD_POLICY_API_KEY": "sekrit-of-this-job",
        "ROLLOUTD_PYTHON": PY,
    })
    out = folder / f"{job}.out"
    assert slurm.wait_done(job, timeout_s=240) == "COMPLETED", out.read_text()
    report = json.loads(out.read_text().strip().splitlines()[-1])
    assert report["inference_health"] == [200]
    assert report["output"] == f"hi\n{slurm.user.pw_uid}\n"
    assert report["rollout"] == {"task": task, "reward": 1.0, "ended_by": "model", "turns": report["rollout"]["turns"]}
    assert report["rollout"]["turns"] >= 1
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])
