"""Harbor task folders as a task type (``harbor``): ``instruction.md``, ``task.toml``,
``environment/``, ``tests/`` and ``solution/``, run the way Harbor runs them.

Record fields: ``instance_id``, ``task_dir`` (an absolute folder on the node), optional ``image``
(overrides the task's environment). What follows mirrors harbor 0.26
(``harbor.models.task.paths.TaskPaths``, ``harbor.verifier.verifier.Verifier``,
``harbor.agents.oracle.OracleAgent``):
- the image: ``environment/Dockerfile``, built offline (``dockerfile:`` images, see
  :mod:`rolloutd.daemon.sandbox.image_build`), else ``[environment].docker_image`` as ``docker://``;
- the agent starts in ``[environment].workdir``, else the Dockerfile's last ``WORKDIR``;
- evaluation copies ``tests/`` to ``/tests``, removes old rewards, runs ``/tests/test.sh`` with
  ``[verifier].env`` and its output in ``/logs/verifier/test-stdout.txt``, within
  ``[verifier].timeout_sec`` (and the request's eval timeout), and reads ``/logs/verifier/reward.json``
  (its ``reward`` key, or its one key) else ``reward.txt``. No reward file is the task's error, as
  in Harbor, never a reward of 0;
- :func:`oracle_commands`: what Harbor's oracle agent does, ``solution/`` copied to ``/solution``
  and ``solve.sh`` run with ``[solution].env``.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shlex
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import TaskError
from rolloutd.native_io.output import tail

from .base import SHELL_STEP_TIMEOUT_S, EvalResult, Task, TaskType, require
from .sandbox_files import copy_tree_in, read_file

if TYPE_CHECKING:
    from ..sandbox.lease import Lease

TESTS_INSIDE = "/tests"
SOLUTION_INSIDE = "/solution"
VERIFIER_LOGS = "/logs/verifier"
AGENT_LOGS = "/logs/agent"
REWARD_MAX_BYTES = 1 << 16
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's ``[verifier].timeout_sec`` default."""
WORKDIR_LINE = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)


class HarborTaskType(TaskType):
    name = "harbor"

    def parse(self, record: dict[str, Any]) -> Task:
        iid = require(record, "instance_id", str)
        folder = Path(require(record, "task_dir", str))
        if not folder.is_absolute() or not folder.is_dir():
            raise TaskError(f"task {iid!r}: task_dir {folder} is not an absolute folder on this node")
        for needed in ("instruction.md", "task.toml", "tests/test.sh"):
            if not (folder / needed).is_file():
                raise TaskError(f"task {iid!r}: {folder} has no {needed}, so it is not a Harbor task folder")
        try:
            config = tomllib.loads((folder / "task.toml").read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise TaskError(f"task {iid!r}: {folder}/task.toml is not valid TOML: {e}") from e
        environment, verifier = _table(iid, config, "environment"), _table(iid, config, "verifier")
        dockerfile = folder / "environment" / "Dockerfile"
        image = record.get("image")
        if image is None:
            if dockerfile.is_file():
                image = f"dockerfile:{dockerfile}"
            elif isinstance(environment.get("docker_image"), str):
                image = f"docker://{environment['docker_image']}"
            else:
                raise TaskError(f"task {iid!r}: no environment/Dockerfile and no [environment].docker_image")
        workdir = environment.get("workdir")
        if workdir is None and dockerfile.is_file():
            found = WORKDIR_LINE.findall(dockerfile.read_text())
            workdir = found[-1] if found else None
        timeout = verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise TaskError(f"task {iid!r}: [verifier].timeout_sec must be a positive number, got {timeout!r}")
        derived = {"workdir": workdir, "verifier_timeout_s": float(timeout),
                   "verifier_env": _env(iid, verifier, "verifier"),
                   "solution_env": _env(iid, _table(iid, config, "solution"), "solution")}
        return Task(iid, self.name, (folder / "instruction.md").read_text(), require(
            {**record, "image": image}, "image", str), {**record, **derived})

    async def setup(self, task: Task, lease: "Lease", *, cache_dir: Path) -> str:
        if not lease.sandbox.isolated:
            # Its paths are absolute (/tests, /logs, /solution): on the local backend, the host's.
            raise TaskError(f"task {task.instance_id}: Harbor tasks need an isolated sandbox (the apptainer backend), "
                            f"not {lease.sandbox.backend_name!r}")
        workdir = task.record["workdir"] or lease.sandbox.workspace_inside
        folders = " ".join(shlex.quote(f) for f in (VERIFIER_LOGS, AGENT_LOGS, workdir))
        r = await lease.run(f"mkdir -p {folders} && cd {shlex.quote(workdir)}", timeout_s=SHELL_STEP_TIMEOUT_S)
        if r.exit_code != 0:
            raise TaskError(f"task {task.instance_id}: cannot make {folders} in the sandbox (an image built from the "
                            f"task's environment/Dockerfile lets the sandbox user write them): {tail(r.output)}")
        return workdir

    async def evaluate(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        rec = task.record
        await copy_tree_in(lease, Path(rec["task_dir"]) / "tests", TESTS_INSIDE)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rec["verifier_env"].items())
        stdout = f"{VERIFIER_LOGS}/test-stdout.txt"
        # A CommandTimeout goes up: the sample ends as ``eval_timeout``, never a reward of 0.
        r = await lease.run(
            f"rm -f {VERIFIER_LOGS}/reward.txt {VERIFIER_LOGS}/reward.json && chmod +x {TESTS_INSIDE}/test.sh && "
            f"cd {shlex.quote(workdir)} && {env} {TESTS_INSIDE}/test.sh > {stdout} 2>&1; echo \"exit $?\"",
            timeout_s=min(timeout_s, rec["verifier_timeout_s"]))
        details: dict[str, Any] = {"test_exit": r.output.strip().rsplit("exit ", 1)[-1]}
        raw_json = await read_file(lease, f"{VERIFIER_LOGS}/reward.json", max_bytes=REWARD_MAX_BYTES)
        raw_text = None if raw_json is not None else await read_file(lease, f"{VERIFIER_LOGS}/reward.txt",
                                                                      max_bytes=REWARD_MAX_BYTES)
        if raw_json is None and raw_text is None:
            log_tail = await read_file(lease, stdout, max_bytes=REWARD_MAX_BYTES)
            raise TaskError(f"task {task.instance_id}: tests/test.sh wrote no {VERIFIER_LOGS}/reward.txt or reward.json "
                            f"(Harbor's RewardFileNotFoundError); its output ends: "
                            f"{tail((log_tail or b'').decode(errors='replace'))}")
        rewards = _rewards(task, raw_json, raw_text)
        details["rewards"] = rewards
        return EvalResult(rewards["reward"] if "reward" in rewards else next(iter(rewards.values())), details)


def oracle_commands(task: Task) -> list[str]:
    """Shell commands that do what Harbor's oracle agent does: ``solution/`` into ``/solution``,
    then ``solve.sh`` run there with ``[solution].env`` (for the ``script`` agent)."""
    folder = Path(task.record["task_dir"]) / "solution"
    if not (folder / "solve.sh").is_file():
        raise TaskError(f"task {task.instance_id}: no solution/solve.sh in {folder.parent}")
    commands = [f"mkdir -p {SOLUTION_INSIDE}"]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        inside = shlex.quote(f"{SOLUTION_INSIDE}/{path.relative_to(folder).as_posix()}")
        encoded = base64.b64encode(path.read_bytes()).decode()
        commands.append(f"mkdir -p \"$(dirname {inside})\" && echo {encoded} | base64 -d > {inside}")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in task.record["solution_env"].items())
    commands.append(f"chmod +x {SOLUTION_INSIDE}/solve.sh && {env} {SOLUTION_INSIDE}/solve.sh")
    return commands


def _table(iid: str, config: dict[str, Any], key: str) -> dict[str, Any]:
    table = config.get(key, {})
    if not isinstance(table, dict):
        raise TaskError(f"task {iid!r}: task.toml [{key}] must be a table")
    return table


def _env(iid: str, table: dict[str, Any], section: str) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                            and isinstance(v, str) for k, v in env.items()):
        raise TaskError(f"task {iid!r}: task.toml [{section}].env must map variable names to strings")
    return env


def _rewards(task: Task, raw_json: bytes | None, raw_text: bytes | None) -> dict[str, float]:
    """Harbor's reading of the reward files: reward.json a map of names to finite numbers,
    reward.txt one number."""
    try:
        if raw_json is not None:
            values = json.loads(raw_json)
            if not isinstance(values, dict) or not values:
                raise ValueError("reward.json must be a non-empty object of name -> number")
            rewards = {str(k): float(v) for k, v in values.items() if not isinstance(v, bool)}
            if len(rewards) != len(values):
                raise ValueError("reward.json values must be numbers")
        else:
            rewards = {"reward": float((raw_text or b"").decode().strip())}
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise TaskError(f"task {task.instance_id}: the reward file is not Harbor's format: {e}") from e
    if not all(math.isfinite(v) for v in rewards.values()):
        raise TaskError(f"task {task.instance_id}: non-finite reward {rewards}")
    if "reward" not in rewards and len(rewards) != 1:
        raise TaskError(f"task {task.instance_id}: reward.json has several rewards {sorted(rewards)} and no 'reward'")
    return rewards
