"""SWE-bench-style tasks: a repository with a bug, a problem statement, tests that decide.

Record fields (JSONL, one task per line):
- ``instance_id``, ``problem_statement``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (pytest node ids,
  relative to the repository root);
- where the repository comes from, one of: ``files`` (path -> text), ``repo_dir`` (a host folder
  copied in), or ``workdir`` (a repository already in the image, e.g. ``/testbed``) with an
  optional ``base_commit`` to check out;
- what evaluation adds: ``eval_files`` (path -> text) and/or ``eval_dir`` (host folder) copied
  over the repository, and/or ``test_patch`` (a unified diff applied with ``git apply``);
- optional ``image`` (default ``default``) and ``test_command`` (default ``python3 -m pytest``).

Evaluation runs the listed tests in the sandbox the agent worked in: reward 1 when every
FAIL_TO_PASS test now passes and every PASS_TO_PASS test still passes, else 0.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import CommandTimeout, TaskError
from rolloutd.native_io.output import tail

from .base import SHELL_STEP_TIMEOUT_S, EvalResult, Task, TaskType, require
from .sandbox_files import IGNORED, copy_tree_in, write_file

if TYPE_CHECKING:
    from ..sandbox.pool import Lease

_RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.MULTILINE)
REPO_FOLDER = "repo"
GIT_CHECKOUT_TIMEOUT_S = 300.0
"""A checkout of ``base_commit`` in a large repository, with ``git clean``."""
GIT_APPLY_TIMEOUT_S = 60.0
GIT_DIFF_TIMEOUT_S = 60.0
"""The agent's change as a patch (``git add -A && git diff``), before the evaluation."""


class SweTaskType(TaskType):
    name = "swe"

    def __init__(self) -> None:
        self._template_locks: dict[str, asyncio.Lock] = {}

    def parse(self, record: dict[str, Any]) -> Task:
        iid = require(record, "instance_id", str)
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", iid):
            raise TaskError(f"task {iid!r}: instance_id may only hold letters, digits, '_', '.', '-'")
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            tests = require(record, key, list, default=[])
            if not all(isinstance(t, str) for t in tests):
                raise TaskError(f"task {iid!r}: {key} must be a list of pytest node ids")
        if not record.get("FAIL_TO_PASS"):
            raise TaskError(f"task {iid!r}: FAIL_TO_PASS is empty; nothing would decide the reward")
        sources = [k for k in ("files", "repo_dir", "workdir") if k in record]
        if len(sources) != 1:
            raise TaskError(f"task {iid!r}: give exactly one of files, repo_dir or workdir (got {sources})")
        if "repo_dir" in record and not Path(require(record, "repo_dir", str)).is_dir():
            raise TaskError(f"task {iid!r}: repo_dir {record['repo_dir']} is not a folder on this node")
        require(record, "files", dict, default={})
        require(record, "eval_files", dict, default={})
        require(record, "test_patch", str, default="")
        if "eval_dir" in record and not Path(require(record, "eval_dir", str)).is_dir():
            raise TaskError(f"task {iid!r}: eval_dir {record['eval_dir']} is not a folder on this node")
        return Task(iid, self.name, require(record, "problem_statement", str), require(record, "image", str,
                    default="default"), dict(record))

    async def _template(self, task: Task, cache_dir: Path) -> Path:
        """The repository prepared once per task on the host (a git repo with one commit), shared by
        the task's samples: each sample copies it instead of rebuilding it."""
        folder = cache_dir / "swe" / task.instance_id / REPO_FOLDER
        async with self._template_locks.setdefault(str(folder), asyncio.Lock()):
            if not folder.exists():
                staging = folder.with_name(REPO_FOLDER + ".partial")
                await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
                await asyncio.to_thread(_build_template, task.record, staging)
                staging.rename(folder)
        return folder

    async def setup(self, task: Task, lease: "Lease", *, cache_dir: Path) -> str:
        rec = task.record
        if "workdir" in rec:
            workdir = rec["workdir"]
            if rec.get("base_commit"):
                commit = shlex.quote(rec["base_commit"])
                r = await lease.run(f"cd {shlex.quote(workdir)} && git checkout -q -f {commit} && git clean -fdq",
                                    timeout_s=GIT_CHECKOUT_TIMEOUT_S)
                if r.exit_code != 0:
                    raise TaskError(f"task {task.instance_id}: cannot check out {rec['base_commit']}: {tail(r.output)}")
        else:
            workdir = f"{lease.sandbox.workspace_inside}/{REPO_FOLDER}"
            await copy_tree_in(lease, await self._template(task, cache_dir), workdir)
        r = await lease.run(f"cd {shlex.quote(workdir)}", timeout_s=SHELL_STEP_TIMEOUT_S)
        if r.exit_code != 0:
            raise TaskError(f"task {task.instance_id}: working folder {workdir} is missing in the sandbox")
        return workdir

    async def evaluate(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        # The agent's change, taken before the evaluation's files and test patch go in (trainers
        # and the published server's clients read it as ``git_patch``).
        diff = await lease.run(f"cd {shlex.quote(workdir)} && git add -A && git diff --cached --no-color HEAD -- . "
                               "':(exclude)*.pyc'", timeout_s=GIT_DIFF_TIMEOUT_S)
        result = await self._grade(task, lease, workdir, timeout_s=timeout_s)
        result.details["git_patch"] = diff.output if diff.exit_code == 0 and not diff.truncated else None
        return result

    async def _grade(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        rec = task.record
        for rel, text in rec.get("eval_files", {}).items():
            await write_file(lease, f"{workdir}/{rel}", text.encode())
        if "eval_dir" in rec:
            await copy_tree_in(lease, Path(rec["eval_dir"]), workdir)
        if rec.get("test_patch"):
            # In the lease's own run folder: a fixed /tmp path is shared by every sandbox of the
            # local backend, so concurrent evaluations would apply each other's patches.
            patch = f"{lease.sandbox.run_dir_inside}/test.patch"
            await write_file(lease, patch, rec["test_patch"].encode())
            r = await lease.run(f"cd {shlex.quote(workdir)} && git apply {shlex.quote(patch)}",
                                timeout_s=GIT_APPLY_TIMEOUT_S)
            if r.exit_code != 0:
                return EvalResult(0.0, {"error": f"test patch does not apply: {tail(r.output)}"})
        f2p, p2p = rec["FAIL_TO_PASS"], rec.get("PASS_TO_PASS", [])
        tests = " ".join(shlex.quote(t) for t in [*f2p, *p2p])
        command = rec.get("test_command", "python3 -m pytest")
        try:
            r = await lease.run(
                f"cd {shlex.quote(workdir)} && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1 "
                f"{command} -rA -q -p no:cacheprovider {tests}", timeout_s=timeout_s)
        except CommandTimeout:
            return EvalResult(0.0, {"error": f"tests exceeded {timeout_s} s (eval_timeout_s)"})
        outcomes = {m.group(2): m.group(1) for m in _RESULT_LINE.finditer(r.output)}
        failed_f2p = [t for t in f2p if outcomes.get(t) != "PASSED"]
        failed_p2p = [t for t in p2p if outcomes.get(t) != "PASSED"]
        reward = 1.0 if not failed_f2p and not failed_p2p else 0.0
        return EvalResult(reward, {"failed_fail_to_pass": failed_f2p, "failed_pass_to_pass": failed_p2p,
                                   "test_exit_code": r.exit_code})


def _build_template(record: dict[str, Any], folder: Path) -> None:
    if "repo_dir" in record:
        shutil.copytree(record["repo_dir"], folder, ignore=IGNORED, symlinks=True)
    else:
        for rel, text in record.get("files", {}).items():
            path = folder / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise TaskError(f"task {record['instance_id']}: file path {rel!r} leaves the repository")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("git"):
        # One commit, so the agent (and the evaluator) can diff against the task's starting point.
        git = ["git", "-c", "user.name=rolloutd", "-c", "user.email=rolloutd@localhost", "-c", "init.defaultBranch=main"]
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "task base", "--allow-empty"]):
            subprocess.run([*git, *args], cwd=folder, check=True, capture_output=True)
