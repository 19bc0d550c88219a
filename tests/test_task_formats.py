"""Harbor task folders and SWE-bench instances as task types: records checked, and the offline
fixtures run end to end through the node daemon in Apptainer sandboxes (images built from the
Harbor tasks' Dockerfiles, SWE-bench logs graded by the ``swebench`` package): the oracle solution
scores 1, a wrong one 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from daemon_fixtures import node_daemon
from task_formats_support import FIXTURES, HARBOR_TASKS, harbor_record, swebench_records
from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.daemon.tasks import harbor, swebench_task
from rolloutd.daemon.tasks.base import get_task_type
from rolloutd.daemon.tasks.datasets import resolve_task
from rolloutd.native_io.errors import TaskError

E2E_TIMEOUT_S = 900
"""Two Dockerfile builds (about 20 s each here, cached afterwards) and eight short samples."""

WRONG = {
    # Harbor: a file with the wrong text; a median that is still wrong for even lengths.
    "greeting-file": ["echo 'hello harbor' > /app/greeting.txt"],
    "fix-median": ["printf 'def median(values):\\n    return sorted(values)[0]\\n' > /app/stats.py"],
    # SWE-bench: the failing test fixed but a passing one broken (PASS_TO_PASS must decide too);
    # nothing changed at all.
    "rolloutd-fixtures__textkit-1": ["sed -i 's/text.split())/text.split(\" \"))/; s/\"_\".join/\"-\".join/' "
                                     "textkit/case.py"],
    "rolloutd-fixtures__textkit-2": ["true"],
}


def test_harbor_records_are_checked(tmp_path: Path) -> None:
    task = resolve_task("", "", harbor_record(FIXTURES / "harbor" / "fix-median"))
    assert task.image == f"dockerfile:{FIXTURES}/harbor/fix-median/environment/Dockerfile"
    assert task.record["workdir"] == "/app" and task.record["verifier_env"] == {"STATS_MODULE": "stats"}
    assert task.record["verifier_timeout_s"] == 120.0 and "median" in task.problem_statement
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURES / "harbor" / "greeting-file", broken)
    (broken / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="no tests/test.sh"):
        resolve_task("", "", harbor_record(broken))
    (broken / "tests" / "test.sh").write_text("#!/bin/bash\n")
    (broken / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n")
    with pytest.raises(TaskError, match="timeout_sec must be a positive number"):
        resolve_task("", "", harbor_record(broken))
    (broken / "task.toml").write_text("[verifier\n")
    with pytest.raises(TaskError, match="not valid TOML"):
        resolve_task("", "", harbor_record(broken))


async def test_harbor_tasks_refuse_a_sandbox_that_isolates_nothing(short_tmp: Path) -> None:
    """Their paths are absolute: on the local backend /tests and /logs would be the host's."""
    task = resolve_task("", "", harbor_record(FIXTURES / "harbor" / "greeting-file"))
    existed = Path("/logs/verifier").exists()
    lease = await open_lease(LocalBackend(short_tmp).create(SandboxSpec(ipython=False)))
    try:
        with pytest.raises(TaskError, match="need an isolated sandbox"):
            await get_task_type("harbor").setup(task, lease, cache_dir=short_tmp / "cache")
        assert Path("/logs/verifier").exists() == existed, "the host's /logs was written"
    finally:
        await lease.destroy()


def test_swebench_records_are_checked() -> None:
    record = swebench_records()[0]
    task = resolve_task("", "", record)
    assert task.record["FAIL_TO_PASS"] == ["tests/test_case.py::test_title_case_keeps_spaces"]
    assert task.image == "default"
    assert resolve_task("", "", {**record, "image": "swebench/sweb.eval.x86_64.x:latest"}).image == \
        "docker://swebench/sweb.eval.x86_64.x:latest"
    remote = {k: v for k, v in record.items() if k != "repo_dir"}
    assert resolve_task("", "", remote).record["workdir"] == "/testbed"
    with pytest.raises(TaskError, match="Start Test Output"):
        resolve_task("", "", {**record, "eval_script": "pytest"})
    with pytest.raises(TaskError, match="not a JSON list"):
        resolve_task("", "", {**record, "FAIL_TO_PASS": "[oops"})


async def test_a_log_parser_swebench_does_not_have_is_refused_before_the_agent_runs(short_tmp: Path) -> None:
    task = resolve_task("", "", {**swebench_records()[0], "log_parser": "parse_log_nothing"})
    lease = await open_lease(LocalBackend(short_tmp).create(SandboxSpec(ipython=False)))
    try:
        with pytest.raises(TaskError, match="not in swebench's PARSER_REGISTRY"):
            await get_task_type("swebench").setup(task, lease, cache_dir=short_tmp / "cache")
    finally:
        await lease.destroy()


def _requests() -> list[tuple[str, str, RolloutRequest]]:
    """(instance, oracle|wrong, request) for every fixture."""
    out = []
    records: list[tuple[dict[str, Any], list[str]]] = []
    for folder in HARBOR_TASKS:
        record = harbor_record(folder)
        records.append((record, harbor.oracle_commands(resolve_task("", "", record))))
    for record in swebench_records():
        records.append((record, swebench_task.oracle_commands(resolve_task("", "", record))))
    for record, oracle in records:
        for kind, commands in (("oracle", oracle), ("wrong", WRONG[record["instance_id"]])):
            out.append((record["instance_id"], kind, RolloutRequest(
                task=record, agent="script", ipython=False, agent_config={"commands": commands},
                init_timeout_s=E2E_TIMEOUT_S)))
    return out


@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(E2E_TIMEOUT_S + 120)
def test_fixtures_through_the_daemon_oracle_scores_one_wrong_scores_zero(short_tmp: Path) -> None:
    requests = _requests()
    assert {i for i, _, _ in requests} == set(WRONG), "every fixture has a wrong solution here"
    with node_daemon(short_tmp / "n", "--backend", "apptainer", "--workers", "1", "--warm", "0") as address:
        with RolloutClient(address) as client:
            ids = client.submit([r for _, _, r in requests])
            results = client.results(ids, timeout_s=E2E_TIMEOUT_S)
            rewards = {}
            for (instance, kind, _), rid in zip(requests, ids):
                result = results[rid]
                assert result.error is None, (instance, kind, result.error)
                (t,) = result.trajectories
                assert t.finish_reason == "completed", (instance, kind, t.finish_reason, t.error_message)
                if kind == "oracle":
                    assert set(t.metrics["exit_codes"]) == {0}, (instance, t.metrics)
                rewards[instance, kind] = t.reward
                client.release(result)
    assert rewards == {(i, k): 1.0 if k == "oracle" else 0.0 for i, k, _ in requests}, json.dumps(
        {f"{i}/{k}": r for (i, k), r in rewards.items()})
