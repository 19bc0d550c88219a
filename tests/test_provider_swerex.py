"""rolloutd sandboxes as a SWE-ReX deployment, driven through swe-rex's own request types the way
SWE-agent drives a runtime (each call under its own ``asyncio.run``), against a real node daemon
and Apptainer sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from swerex.exceptions import CommandTimeoutError, NonZeroExitCodeError, SessionExistsError
from swerex.runtime.abstract import (BashAction, BashInterruptAction, CloseBashSessionRequest, Command,
                                     CreateBashSessionRequest, ReadFileRequest, UploadRequest, WriteFileRequest)

from minisweagent.environments.extra.swerex_docker import SwerexDockerEnvironment, SwerexDockerEnvironmentConfig
from minisweagent.exceptions import Submitted

from daemon_fixtures import node_daemon
from rolloutd.client.providers.swerex import RolloutdDeployment
from rolloutd.client.sync_client import RolloutClient
from support.waits import wait_until

pytestmark = [pytest.mark.apptainer, pytest.mark.timeout(300)]
STATS_TIMEOUT_S = 10.0
"""Workers report their pools once a second; a report this late means something is stuck."""


class _MiniSweAgentEnvironment(SwerexDockerEnvironment):
    """mini-swe-agent's SWE-ReX environment on a started rolloutd deployment (its own __init__
    starts a Docker one)."""

    def __init__(self, deployment: RolloutdDeployment) -> None:
        self.config = SwerexDockerEnvironmentConfig(image="default", cwd="/workspace", timeout=60)
        self.deployment = deployment


def _leased(address: str) -> int:
    with RolloutClient(address) as client:
        return int(client.status()["sandboxes"]["leased"])


def test_swerex_runtime_on_a_rolloutd_sandbox(short_tmp: Path) -> None:
    with node_daemon(short_tmp / "n", "--backend", "apptainer", "--workers", "1", "--warm", "1") as address:
        deployment = RolloutdDeployment(address)
        asyncio.run(deployment.start())
        try:
            runtime = deployment.runtime
            assert asyncio.run(deployment.is_alive())
            asyncio.run(runtime.create_session(CreateBashSessionRequest()))
            with pytest.raises(SessionExistsError):
                asyncio.run(runtime.create_session(CreateBashSessionRequest(session="second")))
            # The session is one persistent shell: cd and variables carry over between actions.
            asyncio.run(runtime.run_in_session(BashAction(command="cd /workspace && export X=kept")))
            obs = asyncio.run(runtime.run_in_session(BashAction(command="pwd; echo $X")))
            assert obs.output.split() == ["/workspace", "kept"] and obs.exit_code == 0
            with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
                asyncio.run(runtime.run_in_session(BashAction(command="(exit 3)")))
            assert asyncio.run(runtime.run_in_session(BashAction(command="(exit 3)", check="silent"))).exit_code == 3
            with pytest.raises(CommandTimeoutError):
                asyncio.run(runtime.run_in_session(BashAction(command="sleep 30", timeout=1.0)))
            assert asyncio.run(runtime.run_in_session(BashInterruptAction())).exit_code == 0
            assert asyncio.run(runtime.run_in_session(BashAction(command="echo alive"))).output.strip() == "alive"
            # execute: a subshell with its own cwd and env, stdout and stderr apart.
            r = asyncio.run(runtime.execute(Command(
                command=["python3", "-c", "import os,sys; print(os.getcwd(), os.environ['Y']); "
                         "print('oops', file=sys.stderr); sys.exit(4)"], cwd="/tmp", env={"Y": "why"})))
            assert (r.stdout.strip(), r.stderr.strip(), r.exit_code) == ("/tmp why", "oops", 4)
            assert asyncio.run(runtime.run_in_session(BashAction(command="pwd"))).output.strip() == "/workspace"
            with pytest.raises(NonZeroExitCodeError, match="exit code 1"):
                asyncio.run(runtime.execute(Command(command="false", shell=True, check=True)))
            # Files: written and read back through SWE-ReX's requests; a folder uploaded.
            text = "héllo\n" + "x" * 200_000 + "\nend\n"
            asyncio.run(runtime.write_file(WriteFileRequest(content=text, path="/workspace/sub/a.txt")))
            assert asyncio.run(runtime.read_file(ReadFileRequest(path="/workspace/sub/a.txt"))).content == text
            with pytest.raises(FileNotFoundError):
                asyncio.run(runtime.read_file(ReadFileRequest(path="/workspace/none.txt")))
            tree = short_tmp / "tools"
            (tree / "bin").mkdir(parents=True)
            (tree / "bin" / "hello").write_text("#!/bin/sh\necho hello from tools\n")
            (tree / "bin" / "hello").chmod(0o755)
            asyncio.run(runtime.upload(UploadRequest(source_path=str(tree), target_path="/workspace/tools")))
            obs = asyncio.run(runtime.run_in_session(BashAction(command="/workspace/tools/bin/hello")))
            assert obs.output.strip() == "hello from tools"
            # mini-swe-agent's own SWE-ReX environment, its deployment swapped for ours: its execute()
            # (Command with shell, cwd, merged streams, under asyncio.run) and its submit check.
            env = _MiniSweAgentEnvironment(deployment)
            out = env.execute({"command": "pwd && echo to-stderr >&2 && (exit 2)"}, cwd="/workspace/tools")
            assert (out["output"].split(), out["returncode"]) == (["/workspace/tools", "to-stderr"], 2), out
            with pytest.raises(Submitted) as submitted:
                env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo the patch"})
            assert submitted.value.messages[0]["extra"]["submission"].strip() == "the patch"
            asyncio.run(runtime.close_session(CloseBashSessionRequest()))
            wait_until(lambda: _leased(address) == 1, STATS_TIMEOUT_S, "the deployment's sandbox shown leased")
        finally:
            asyncio.run(deployment.stop())
        wait_until(lambda: _leased(address) == 0, STATS_TIMEOUT_S, "the sandbox back from lease after stop()")
