"""A hostile or careless job user against the Slurm hooks, on the real one-node cluster: whatever
the user plants in their run folder or home, root reads nothing of theirs, the node stays in
service (only its own faults drain it), and other jobs are left alone. Jobs and the attacks in
them run as the ordinary user; the test process (root) only checks."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from slurm_support import (
    CLIENT,
    PY,
    RUN_BASE,
    SlurmCluster,
    hold_script,
    processes_of,
    proc_alive,
    read_report,
    wait_for_file,
)

pytestmark = [pytest.mark.slurm, pytest.mark.unprivileged]


def hook_log_lines(slurm: SlurmCluster, job: int) -> list[str]:
    return [line for line in slurm.hook_log.read_text(errors="replace").splitlines() if f" job {job} " in line]


def assert_in_service(slurm: SlurmCluster) -> None:
    slurm.wait_node_idle()
    node = slurm.node_fields()
    assert "DRAIN" not in node["State"] and node["Reason"] in ("", "(null)", "none"), node


def sandbox_pids(run_dir: Path, worker: str) -> list[int]:
    """Live processes working inside worker ``worker``'s state folder (its warm local sandboxes)."""
    folder = f"{run_dir}/workers/{worker}/"
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"{entry.path}/cwd").startswith(folder) and proc_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def worker_pids(daemon: int) -> dict[int, int]:
    """Worker index -> pid of the daemon's live worker processes."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != daemon or not proc_alive(int(entry.name)):
                continue
            args = Path(f"{entry.path}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if b"--index" in args:
            found[int(args[args.index(b"--index") + 1])] = int(entry.name)
    return found


def wait_until(what: str, check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def root_secret() -> tuple[Path, str]:
    """A file only root may read, holding a token no user can know."""
    folder = Path("/root") / f"rld-secret-{secrets.token_hex(4)}"
    folder.mkdir(mode=0o700)
    token = f"ROOT-ONLY-{secrets.token_hex(8)}"
    path = folder / "secret"
    path.write_text("\n".join([token] * 30) + "\n")
    path.chmod(0o600)
    yield path, token
    shutil.rmtree(folder)


def test_symlinked_daemon_log_is_never_read_by_root(slurm: SlurmCluster, short_tmp: Path,
                                                    root_secret: tuple[Path, str]) -> None:
    """The user swaps node.log for a link to a root-only file and leaves a process behind, so the
    epilog has to force its way out; the old epilog appended `tail node.log` (as root) to a
    world-readable hooks.log."""
    secret, token = root_secret
    folder = slurm.job_dir(short_tmp)
    run = f"{RUN_BASE}/job$SLURM_JOB_ID"
    job = slurm.sbatch(folder, f"rm -f {run}/node.log && ln -s {secret} {run}/node.log\n"
                               f"cd {run} && setsid -f sleep 600\n")
    assert slurm.wait_done(job) == "COMPLETED", (folder / f"{job}.out").read_text()
    log = slurm.hook_log.read_text(errors="replace")
    assert token not in log
    assert stat.S_IMODE(slurm.hook_log.stat().st_mode) == 0o600
    lines = hook_log_lines(slurm, job)
    assert any("forcing leftover processes of the node daemon" in line for line in lines), lines
    assert processes_of(slurm.user.pw_uid, RUN_BASE / f"job{job}", -1) == []
    assert not (RUN_BASE / f"job{job}").exists()
    assert_in_service(slurm)


def test_fifo_pidfile_does_not_block_the_epilog(slurm: SlurmCluster, short_tmp: Path) -> None:
    """A FIFO in place of node.pid: the old epilog's `head node.pid` (as root) blocked until Slurm's
    epilog timeout, which drained the node and left the daemon running."""
    folder = slurm.job_dir(short_tmp)
    run = f"{RUN_BASE}/job$SLURM_JOB_ID"
    job = slurm.sbatch(folder, hold_script(folder) + f"rm -f {run}/node.pid && mkfifo {run}/node.pid\n"
                                                      f"touch {folder}/planted\n")
    report = read_report(folder, job)
    (folder / "release").touch()
    wait_for_file(folder / "planted")
    start = time.monotonic()
    assert slurm.wait_done(job, timeout_s=60) == "COMPLETED"
    assert time.monotonic() - start < 45, "the epilog waited on the FIFO"
    slurm.assert_daemon_gone(RUN_BASE / f"job{job}", report["daemon_pid"])
    assert_in_service(slurm)


def test_run_base_no_user_can_create_first(slurm: SlurmCluster, short_tmp: Path) -> None:
    """RUN_BASE in a folder users can write (as the old default /tmp/rolloutd-slurm was): a user
    creates it before the first prolog with hooks.log linked where root should write. The hooks
    refuse it as the node's fault, without writing anything there; the default location (under
    /run) cannot be created by a user at all."""
    out = slurm.as_user("mkdir", f"{RUN_BASE.parent}/rld-planted")
    assert out.returncode != 0 and not Path(f"{RUN_BASE.parent}/rld-planted").exists()
    base = Path(f"/tmp/rld-pre-{secrets.token_hex(3)}")
    planted = Path(f"/etc/rld-planted-{secrets.token_hex(3)}")
    out = slurm.as_user("bash", "-c", f"mkdir -m 0755 {base} && ln -s {planted} {base}/hooks.log")
    assert out.returncode == 0, out.stderr
    folder = slurm.job_dir(short_tmp)
    slurm.write_hook_config(RUN_BASE=str(base))
    job = slurm.sbatch(folder, "echo should not run\n")
    try:
        # The hook's own reason, not only DRAIN: slurmd's "Prolog error" can drain the node first,
        # and a resume before the hook's drain lands would leave the node drained for later tests.
        wait_until("the prolog drains the node with its reason",
                   lambda: slurm.node_fields()["Reason"].startswith("rolloutd prolog: RUN_BASE "), 60)
        assert not planted.exists() and not planted.is_symlink(), "root wrote through the user's link"
        reason = slurm.node_fields()["Reason"]
        assert "DRAIN" in slurm.node_fields().get("State", "") and "/tmp is writable by others" in reason, reason
        assert os.readlink(base / "hooks.log") == str(planted)
    finally:
        planted.unlink(missing_ok=True)
        slurm.write_hook_config()
        slurm.cancel(job)
        shutil.rmtree(base, ignore_errors=True)
        slurm.resume_node()


def test_stale_pid_of_another_job_is_left_alone(slurm: SlurmCluster, short_tmp: Path) -> None:
    """Job B's run folder left from before (a wiped cluster reuses job ids; an epilog that never
    ran) holds a pidfile naming job A's daemon and a lock file hard-linked to job A's: B's prolog,
    cleaning up that folder, must not stop A's daemon (the old one did, through `node stop`)."""
    first, second = slurm.job_dir(short_tmp, "a"), slurm.job_dir(short_tmp, "b")
    a = slurm.sbatch(first, hold_script(first))
    ra = read_report(first, a)
    b = slurm.sbatch(second, f"{PY} -c 'print(1)'\n", "--hold")
    stale = RUN_BASE / f"job{b}"
    stale.mkdir(mode=0o700)
    os.chown(stale, slurm.user.pw_uid, slurm.user.pw_gid)
    out = slurm.as_user("bash", "-c", f"echo {ra['daemon_pid']} > {stale}/node.pid && "
                                      f"ln {RUN_BASE}/job{a}/node.lock {stale}/node.lock")
    assert out.returncode == 0, out.stderr
    slurm.root("scontrol", "release", str(b))
    assert slurm.wait_done(b) == "COMPLETED", (second / f"{b}.out").read_text()
    assert proc_alive(ra["daemon_pid"]), "job B's prolog stopped job A's daemon"
    lines = hook_log_lines(slurm, b)
    assert any(f"pid {ra['daemon_pid']} holds {stale}/node.lock but is not the node daemon of {stale}" in line
               for line in lines), lines
    (first / "release").touch()
    assert slurm.wait_done(a) == "COMPLETED"
    slurm.assert_daemon_gone(RUN_BASE / f"job{a}", ra["daemon_pid"])
    assert_in_service(slurm)


def test_a_users_own_fault_fails_only_the_job(slurm: SlurmCluster, short_tmp: Path) -> None:
    """The user's inference key file is readable by others, so their daemon refuses to start: the
    job fails with the reason in its output; the node stays in service for the next job."""
    home = Path(slurm.user.pw_dir)
    out = slurm.as_user("bash", "-c", "mkdir -p ~/.rolloutd && echo k > ~/.rolloutd/inference_api_key && "
                                      "chmod 644 ~/.rolloutd/inference_api_key")
    assert out.returncode == 0, out.stderr
    try:
        folder = slurm.job_dir(short_tmp)
        job = slurm.sbatch(folder, "echo should not run\n")
        assert slurm.wait_done(job) == "FAILED"
        text = (folder / f"{job}.out").read_text()
        assert "should not run" not in text
        assert re.search(r"rolloutd: the Prolog could not start this job's node daemon on \S+: rolloutd node start "
                         r"failed \(exit 2\): .*inference_api_key_file: .* is readable by others \(mode 644\); "
                         "chmod 600 it", text), text
        assert not (RUN_BASE / f"job{job}.failed").exists()
        assert_in_service(slurm)
    finally:
        (home / ".rolloutd" / "inference_api_key").unlink(missing_ok=True)
    again = slurm.job_dir(short_tmp, "again")
    job = slurm.sbatch(again, f"{PY} {Path(__file__).with_name('slurm_job_client.py')}\n")
    assert slurm.wait_done(job) == "COMPLETED", (again / f"{job}.out").read_text()


def test_workers_default_to_the_jobs_cpus(slurm: SlurmCluster, short_tmp: Path) -> None:
    """Without WORKERS, a one-CPU job on a node with more cores gets one worker, not one per core."""
    if (os.cpu_count() or 1) < 2:
        pytest.fail("this test needs a node with at least 2 CPUs")
    slurm.write_hook_config(WORKERS="")
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder), "--cpus-per-task=1")
    report = read_report(folder, job)
    assert sorted(worker_pids(report["daemon_pid"])) == [0]
    (folder / "release").touch()
    assert slurm.wait_done(job) == "COMPLETED"


def test_killing_worker_1_spares_worker_10(slurm: SlurmCluster, short_tmp: Path) -> None:
    """With 11 workers, the user kills worker 1: its sandboxes are reaped, worker 10's live on
    (the old reaper matched w1 as a string prefix of w10)."""
    slurm.write_hook_config(WORKERS="11", READY_TIMEOUT_S="100")
    folder = slurm.job_dir(short_tmp)
    job = slurm.sbatch(folder, hold_script(folder))
    report = read_report(folder, job)
    run_dir, daemon = RUN_BASE / f"job{job}", report["daemon_pid"]
    wait_until("warm sandboxes of workers 1 and 10", lambda: sandbox_pids(run_dir, "w1") and sandbox_pids(run_dir, "w10"),
               120)
    w1, w10 = sandbox_pids(run_dir, "w1"), sandbox_pids(run_dir, "w10")
    worker_1 = worker_pids(daemon)[1]
    assert slurm.as_user("kill", "-KILL", str(worker_1)).returncode == 0
    # The supervisor reaps w1's folder before it starts the next worker 1.
    wait_until("worker 1 restarted", lambda: worker_pids(daemon).get(1, worker_1) != worker_1, 60)
    assert not any(proc_alive(p) for p in w1), "worker 1's sandboxes survived it"
    assert all(proc_alive(p) for p in w10), "reaping worker 1 killed worker 10's sandboxes"
    (folder / "release").touch()
    assert slurm.wait_done(job) == "COMPLETED"
    slurm.assert_daemon_gone(run_dir, daemon)


def test_users_inference_key_reaches_the_daemon_not_its_sandboxes(slurm: SlurmCluster, short_tmp: Path) -> None:
    """The user's key in ~/.rolloutd/inference_api_key (0600): the prolog's daemon authenticates
    with it to the job's key-protected inference server (a bundled task rolls out to reward 1),
    while a local-backend sandbox sees neither the key nor the daemon's configuration."""
    from rolloutd.daemon.tasks.datasets import oracle_plans

    key = f"user-key-{secrets.token_hex(6)}"
    home = Path(slurm.user.pw_dir)
    out = slurm.as_user("bash", "-c", f"umask 077 && mkdir -p ~/.rolloutd && echo {key} > ~/.rolloutd/inference_api_key")
    assert out.returncode == 0, out.stderr
    folder = slurm.job_dir(short_tmp)
    plans = folder / "plans.json"
    plans.write_text(json.dumps({"plans": oracle_plans()}))
    plans.chmod(0o644)
    task = sorted(oracle_plans())[0]
    rolloutd = Path(PY).with_name("rolloutd")
    script = (
        f"ROLLOUTD_POLICY_API_KEY={key} {rolloutd} policy-server --port 0 --scripted {plans} > {folder}/policy.out &\n"
        f"while ! grep -q READY {folder}/policy.out; do sleep 0.2; done\n"
        f"url=$(awk '/READY/ {{print $2}}' {folder}/policy.out)\n"
        f"{PY} -c 'import sys; from rolloutd.client.sync_client import RolloutClient; "
        f"RolloutClient().add_inference_server(sys.argv[1])' \"$url\"\n"
        f"ROLLOUTD_TEST_ROLLOUT_TASK={task} {PY} {CLIENT} 'env; echo end-of-env'\n"
        "kill %1\n"
    )
    try:
        job = slurm.sbatch(folder, script, "--time=5")
        text_of = lambda: (folder / f"{job}.out").read_text()  # noqa: E731
        assert slurm.wait_done(job, timeout_s=240) == "COMPLETED", text_of()
    finally:
        (home / ".rolloutd" / "inference_api_key").unlink(missing_ok=True)
    (line,) = [line for line in text_of().splitlines() if line.startswith('{"address"')]
    report = json.loads(line)
    assert report["output"].endswith("end-of-env\n")
    assert key not in report["output"] and "ROLLOUTD_NODE_CONFIG_JSON" not in report["output"], report["output"]
    assert report["rollout"]["reward"] == 1.0 and report["rollout"]["ended_by"] == "model", report["rollout"]


def test_multi_node_job_without_keys_fails_only_that_job(slurm: SlurmCluster) -> None:
    """A job on two nodes from a user who never made CURVE keys. The one-node cluster cannot
    allocate two nodes, so the installed hooks run as slurmd runs them, with a two-node job's
    variables: the Prolog keeps the node in service, the TaskProlog (as the user) prints why and
    fails the task, the Epilog cleans up. The old Prolog drained the node."""
    shutil.rmtree(Path(slurm.user.pw_dir) / ".rolloutd" / "keys", ignore_errors=True)
    slurm.write_hook_config(ROUTER_PORT_BASE="7100")
    job = 900000 + secrets.randbelow(99999)
    env = {**slurm.env, "SLURM_JOB_ID": str(job), "SLURM_JOB_USER": slurm.user.pw_name,
           "SLURM_JOB_UID": str(slurm.user.pw_uid), "SLURM_NODELIST": f"{slurm.host},{slurm.host}-b",
           "SLURMD_NODENAME": slurm.host, "SLURM_JOB_CPUS_PER_NODE": "1(x2)"}
    try:
        prolog = subprocess.run([str(slurm.hooks / "prolog.sh")], env=env, capture_output=True, text=True,
                                timeout=120, cwd="/")
        assert prolog.returncode == 0, prolog.stderr
        assert_in_service(slurm)
        task = slurm.as_user(str(slurm.hooks / "taskprolog.sh"), env=env)
        keys = f"{slurm.user.pw_dir}/.rolloutd/keys"
        assert task.returncode == 1
        assert task.stdout.startswith(
            f"print rolloutd: the Prolog could not start this job's node daemon on {slurm.host}: this multi-node job "
            f"needs your CURVE keys in {keys} (run once: rolloutd keygen router --dir {keys}"), task.stdout
        assert "export ROLLOUTD_ADDRESS" not in task.stdout
        assert not (RUN_BASE / f"job{job}").exists()
    finally:
        epilog = subprocess.run([str(slurm.hooks / "epilog.sh")], env=env, capture_output=True, text=True,
                                timeout=120, cwd="/")
        if "DRAIN" in slurm.node_fields().get("State", ""):
            slurm.root("scontrol", "update", f"NodeName={slurm.host}", "State=RESUME", check=False)
    assert epilog.returncode == 0, epilog.stderr
    assert not (RUN_BASE / f"job{job}.failed").exists()
    assert_in_service(slurm)
