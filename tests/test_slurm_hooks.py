"""The Slurm hooks' shell code without a cluster: the templates parse, and the admin's config file
is checked the way the prolog checks it (tests/test_slurm.py runs the hooks under real Slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parent.parent / "slurm_templates"
ROLLOUTD = str(Path(sys.executable).with_name("rolloutd"))


@pytest.mark.parametrize("script", sorted(p.name for p in TEMPLATES.glob("*.sh")))
def test_template_parses(script: str) -> None:
    out = subprocess.run(["bash", "-n", str(TEMPLATES / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def load(hooks: Path, text: str, mode: int = 0o644) -> subprocess.CompletedProcess[str]:
    """Source the library as a hook installed in ``hooks`` would, and load ``text`` as its config."""
    conf = hooks / "rolloutd-slurm.conf"
    conf.write_text(text)
    conf.chmod(mode)
    code = (f". {TEMPLATES}/rolloutd-slurm-lib.sh; "
            'if rld_load_config; then echo "$RLD_CONFIG_FILE|$RLD_ROLLOUTD|$RLD_RUN_BASE|$RLD_SHARE|$RLD_WORKERS|'
            '$RLD_HOOK_LOG"; else echo "ERROR: $RLD_ERROR"; fi')
    return subprocess.run(["bash", "-c", code, str(hooks / "prolog.sh")], capture_output=True, text=True,
                          env={"SLURM_JOB_ID": "7"})


def test_config_beside_the_hooks_is_read(short_tmp: Path) -> None:
    text = f'# admin settings\nROLLOUTD={ROLLOUTD}\n  RUN_BASE="/var/tmp/rld"  \nSHARE=user\nWORKERS=\n'
    out = load(short_tmp, text)
    assert out.stdout.strip() == (f"{short_tmp}/rolloutd-slurm.conf|{ROLLOUTD}|/var/tmp/rld|user||"
                                  "/var/tmp/rld/hooks.log"), out.stderr


@pytest.mark.parametrize(("text", "error"), [
    pytest.param(f"ROLLOUTD={ROLLOUTD}\nWORKERZ=2\n", "line 2: unknown key WORKERZ", id="unknown-key"),
    pytest.param("ROLLOUTD=rolloutd\n", "ROLLOUTD=rolloutd is not an executable absolute path", id="relative-program"),
    pytest.param("RUN_BASE=/tmp\n", "ROLLOUTD is not set", id="no-program"),
    pytest.param(f"ROLLOUTD={ROLLOUTD}\nRUN_BASE=/{'x' * 80}\n", "too long for a Unix socket path", id="long-base"),
    pytest.param(f"ROLLOUTD={ROLLOUTD}\nSHARE=node\n", "SHARE=node must be 'job' or 'user'", id="bad-share"),
    pytest.param(f"ROLLOUTD={ROLLOUTD}\nSTOP_TIMEOUT_S=0\n", "STOP_TIMEOUT_S=0 must be a positive whole number",
                 id="zero-timeout"),
    pytest.param(f"ROLLOUTD={ROLLOUTD}\nrun_base /tmp\n", "line 2: expected KEY=value", id="not-key-value"),
])
def test_bad_config_says_what_is_wrong(short_tmp: Path, text: str, error: str) -> None:
    out = load(short_tmp, text)
    assert out.stdout.startswith("ERROR: ") and error in out.stdout, out.stdout + out.stderr


def test_config_others_can_write_is_refused_as_root(short_tmp: Path) -> None:
    if os.getuid() != 0:
        pytest.fail("the prolog runs as root; this check needs root (CI runs as root)")
    out = load(short_tmp, f"ROLLOUTD={ROLLOUTD}\n", mode=0o666)
    assert "must be owned by root and writable by root only" in out.stdout, out.stdout + out.stderr


def test_node_config_others_can_write_is_refused_as_root(short_tmp: Path) -> None:
    if os.getuid() != 0:
        pytest.fail("the prolog runs as root; this check needs root (CI runs as root)")
    node = short_tmp / "node.toml"
    node.write_text("workers = 1\n")
    node.chmod(0o644)
    assert load(short_tmp, f"ROLLOUTD={ROLLOUTD}\nNODE_CONFIG={node}\n").stdout.startswith(f"{short_tmp}/"), \
        "a root-owned 0644 node config is accepted"
    node.chmod(0o666)
    out = load(short_tmp, f"ROLLOUTD={ROLLOUTD}\nNODE_CONFIG={node}\n")
    assert f"NODE_CONFIG={node} and its folder must be root's and writable by root only" in out.stdout, out.stdout


def shell_is_daemon(pid: int, run_dir: Path, uid: int) -> bool:
    code = f'. {TEMPLATES}/rolloutd-slurm-lib.sh; rld_is_daemon "$1" "$2" "$3"'
    return subprocess.run(["bash", "-c", code, "x", str(pid), str(run_dir), str(uid)]).returncode == 0


def test_one_pid_rule_in_python_and_shell(short_tmp: Path) -> None:
    """"This pid is the daemon of that run folder", asked of rolloutd.cli.lifecycle.is_daemon
    and the hooks' rld_is_daemon on the same real processes: both give the expected answer."""
    from rolloutd.cli.lifecycle import is_daemon

    from os_users import ensure_test_user

    user = ensure_test_user()
    run, run10 = short_tmp / "job1", short_tmp / "job10"
    hold = "sleep 60; :"  # the ':' keeps bash from exec'ing sleep, so its argv stays as given
    procs = {
        "pidfile-inside": subprocess.Popen(["bash", "-c", hold, "x", "--pidfile", f"{run}/node.pid"]),
        "the-folder-itself": subprocess.Popen(["bash", "-c", hold, "x", "--run-dir", str(run)]),
        "job10-not-job1": subprocess.Popen(["bash", "-c", hold, "x", "--pidfile", f"{run10}/node.pid"]),
        "inside-another-argument": subprocess.Popen(["bash", "-c", hold, "x", f"--pidfile={run}/node.pid"]),
        "another-user": subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                                          "--clear-groups", "bash", "-c", hold, "x", f"{run}/node.pid"]),
        "zombie": subprocess.Popen(["bash", "-c", "exit 0", "x", f"{run}/node.pid"]),
    }
    expected = {"pidfile-inside": True, "the-folder-itself": True, "job10-not-job1": False,
                "inside-another-argument": False, "another-user": False, "zombie": False}
    try:
        deadline = time.monotonic() + 10  # exited and not reaped (Popen.poll would reap it)
        while Path(f"/proc/{procs['zombie'].pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the zombie-to-be did not exit within 10 s"
            time.sleep(0.02)
        answers = {name: (is_daemon(p.pid, run, os.getuid()), shell_is_daemon(p.pid, run, os.getuid()))
                   for name, p in procs.items()}
        assert answers == {name: (want, want) for name, want in expected.items()}
        gone = procs["pidfile-inside"].pid
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert (is_daemon(gone, run, os.getuid()), shell_is_daemon(gone, run, os.getuid())) == (False, False)


def test_user_text_is_escaped_for_logs() -> None:
    """What a job's user can influence reaches hooks.log, drain reasons and job output on one line,
    control and non-ASCII bytes replaced, length capped."""
    code = f'. {TEMPLATES}/rolloutd-slurm-lib.sh; rld_clean "$1" 40'
    text = "fake line\n2026-12-05 rolloutd-slurm epilog job 1: \x1b[2Jok \u00e9" + "x" * 100
    out = subprocess.run(["bash", "-c", code, "x", text], capture_output=True).stdout
    assert out == b"fake line | 2026-12-05 rolloutd-slurm ep"
    out = subprocess.run(["bash", "-c", f'. {TEMPLATES}/rolloutd-slurm-lib.sh; rld_clean "$1"', "x", "a\x1b[2J\u00e9"],
                         capture_output=True).stdout
    assert out == b"a?[2J??"


def test_node_stop_on_another_users_folder_says_so(short_tmp: Path) -> None:
    from os_users import ensure_test_user

    user = ensure_test_user()
    run = short_tmp / "theirs"
    run.mkdir(mode=0o700)
    short_tmp.chmod(0o755)
    out = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                          ROLLOUTD, "node", "stop", "--run-dir", str(run)], capture_output=True, text=True, cwd="/")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"rolloutd: error [PERMISSION_DENIED]: cannot look into the run folder {run}: it "
                                  f"belongs to uid 0, not to you (uid {user.pw_uid}); run this as its owner")
