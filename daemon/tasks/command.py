"""``command`` tasks: a set-up script and an evaluation script whose last output line is the reward.

Record fields: ``instance_id``, ``problem_statement``, ``eval_script`` (bash; its last output line
must be a number, the reward), optional ``setup_script`` (bash, run in the working folder before
the agent starts), ``workdir`` (default: the sandbox's workspace) and ``image``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import TaskError
from rolloutd.native_io.output import tail

from .base import SHELL_STEP_TIMEOUT_S, EvalResult, Task, TaskType, require

if TYPE_CHECKING:
    from ..sandbox.lease import Lease


class CommandTaskType(TaskType):
    name = "command"

    def parse(self, record: dict[str, Any]) -> Task:
        iid = require(record, "instance_id", str)
        require(record, "eval_script", str)
        require(record, "setup_script", str, default="")
        require(record, "workdir", str, default="")
        return Task(iid, self.name, require(record, "problem_statement", str, default=""),
                    require(record, "image", str, default="default"), dict(record))

    async def setup(self, task: Task, lease: "Lease", *, cache_dir: Path) -> str:
        workdir = task.record.get("workdir") or lease.sandbox.workspace_inside
        script = task.record.get("setup_script", "")
        r = await lease.run(f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)}\n{script}", timeout_s=None)
        if r.exit_code != 0:
            raise TaskError(f"task {task.instance_id}: setup_script failed with {r.exit_code}: {tail(r.output)}")
        # The agent's shell starts where the set-up left it... unless the script cd'ed away.
        await lease.run(f"cd {shlex.quote(workdir)}", timeout_s=SHELL_STEP_TIMEOUT_S)
        return workdir

    async def evaluate(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        # A CommandTimeout goes up: the sample ends as ``eval_timeout``, never a reward of 0.
        r = await lease.run(f"cd {shlex.quote(workdir)}\n{task.record['eval_script']}", timeout_s=timeout_s)
        lines = r.output.strip().splitlines()
        try:
            reward = float(lines[-1]) if lines else float("nan")
        except ValueError:
            reward = float("nan")
        if r.exit_code != 0 or reward != reward:
            return EvalResult(0.0, {"error": f"eval_script exited {r.exit_code} without a numeric last line",
                                    "output_tail": tail(r.output)})
        return EvalResult(reward, {"eval_exit_code": r.exit_code})
