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

Evaluation runs the test files of the listed tests in the sandbox the agent worked in, with a
small pytest plugin (:mod:`pytest_report`) that writes each test's outcome under its node id:
reward 1 when every FAIL_TO_PASS test now passes and every PASS_TO_PASS test still passes, else 0.
Ids are matched exactly (spaces, brackets, nested ``::``), with non-ASCII characters compared in
pytest's escaped form (``test_x[é]`` and ``test_x[\\xe9]`` are one test). Tests that outlive
``eval_timeout_s`` raise (the sample ends ``eval_timeout``, no score); a run that writes no report
is the task's error (its ``test_command`` must be pytest), never a reward of 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import TaskError
from rolloutd.native_io.output import tail

from .base import SHELL_STEP_TIMEOUT_S, EvalResult, Task, TaskType, require
from .sandbox_files import IGNORED, copy_tree_in, read_file, write_file

if TYPE_CHECKING:
    from ..sandbox.lease import Lease

REPO_FOLDER = "repo"
GIT_CHECKOUT_TIMEOUT_S = 300.0
"""A checkout of ``base_commit`` in a large repository, with ``git clean``."""
GIT_APPLY_TIMEOUT_S = 60.0
GIT_DIFF_TIMEOUT_S = 60.0
"""The agent's change as a patch (``git add -A && git diff``), before the evaluation."""
IGNORED_PARTS = frozenset({"__pycache__", ".pytest_cache"})
"""Folders the template copy leaves out (``sandbox_files.IGNORED``), so they do not change its key."""
REPORT_PLUGIN = Path(__file__).with_name("pytest_report.py")
PLUGIN_MODULE = "rolloutd_pytest_report"
"""Its module name in the sandbox: one no project has (the test run's folder comes first on sys.path)."""
REPORT_MAX_BYTES = 64 << 20


class SweTaskType(TaskType):
    name = "swe"

    def __init__(self) -> None:
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._tree_hashes: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], str] = {}
        """(repo_dir, its files' path, size, mtime, mode) -> content hash: a folder is read again
        only when a file in it changed."""

    def _content_key(self, record: dict[str, Any]) -> str:
        """A hash of what defines the task's repository: its files or repo_dir contents, base
        commit and set-up fields."""
        defining = {k: record.get(k) for k in ("files", "base_commit", "setup_script", "workdir")}
        if "repo_dir" in record:
            defining["repo_dir"] = self._tree_hash(Path(record["repo_dir"]))
        blob = json.dumps(defining, sort_keys=True, ensure_ascii=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]

    def _tree_hash(self, root: Path) -> str:
        stats = tuple((rel, st.st_size, st.st_mtime_ns, st.st_mode) for rel, st in _tree_files(root))
        cached = self._tree_hashes.get((str(root), stats))
        if cached is None:
            digest = hashlib.sha256()
            for rel, _, _, mode in stats:
                digest.update(f"{rel}\0{mode}\0".encode())
                digest.update(hashlib.sha256((root / rel).read_bytes()).digest())
            if len(self._tree_hashes) > 1000:  # folders edited again and again: forget the old versions
                self._tree_hashes.clear()
            cached = self._tree_hashes[(str(root), stats)] = digest.hexdigest()
        return cached

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
        the task's samples: each sample copies it instead of rebuilding it. Its folder is named by
        a hash of everything the template is made of, not by the instance id alone: two records
        with one id (another dataset, an edited task file, an inline task) never share one."""
        key = await asyncio.to_thread(self._content_key, task.record)
        folder = cache_dir / "swe" / f"{task.instance_id}-{key}" / REPO_FOLDER
        async with self._template_locks.setdefault(str(folder), asyncio.Lock()):
            if not folder.exists():
                await asyncio.to_thread(_build_template_once, task.record, folder)
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
        # Whole files, not ids: pytest splits an argument at every "::", inside brackets too.
        files = " ".join(shlex.quote(f) for f in sorted({t.split("::", 1)[0] for t in [*f2p, *p2p]}))
        command = rec.get("test_command", "python3 -m pytest")
        folder = f"{lease.sandbox.workspace_inside}/.rolloutd-eval"
        report = f"{folder}/report.json"
        await write_file(lease, f"{folder}/{PLUGIN_MODULE}.py", REPORT_PLUGIN.read_bytes())
        # A CommandTimeout goes up: the sample ends as ``eval_timeout``, never a reward of 0.
        r = await lease.run(
            f"rm -f {shlex.quote(report)} && cd {shlex.quote(workdir)} && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "
            f"PYTHONDONTWRITEBYTECODE=1 ROLLOUTD_PYTEST_REPORT={shlex.quote(report)} "
            f"PYTHONPATH={shlex.quote(folder)}${{PYTHONPATH:+:$PYTHONPATH}} "
            f"{command} -p {PLUGIN_MODULE} -q -p no:cacheprovider {files}", timeout_s=timeout_s)
        outcomes = _outcomes(await read_file(lease, report, max_bytes=REPORT_MAX_BYTES), task, r.output)
        failed_f2p = [t for t in f2p if outcomes.get(_canonical(t)) != "passed"]
        failed_p2p = [t for t in p2p if outcomes.get(_canonical(t)) != "passed"]
        reward = 1.0 if not failed_f2p and not failed_p2p else 0.0
        return EvalResult(reward, {"failed_fail_to_pass": failed_f2p, "failed_pass_to_pass": failed_p2p,
                                   "test_exit_code": r.exit_code})


def _canonical(node_id: str) -> str:
    """A node id with non-ASCII characters escaped as pytest escapes parameter ids."""
    return node_id.encode("ascii", "backslashreplace").decode("ascii")


def _outcomes(raw: bytes | None, task: Task, output: str) -> dict[str, str]:
    """Canonical node id -> outcome, from the plugin's report."""
    if raw is None:
        raise TaskError(f"task {task.instance_id}: its test command wrote no report (it must be pytest, which "
                        f"gets -p {PLUGIN_MODULE}); its output ends: {tail(output)}")
    try:
        outcomes = json.loads(raw)["outcomes"]
    except (ValueError, KeyError, TypeError) as e:
        raise TaskError(f"task {task.instance_id}: the test report is not the plugin's JSON: {e}") from e
    return {_canonical(str(k)): str(v) for k, v in outcomes.items()}


def _tree_files(root: Path) -> list[tuple[str, os.stat_result]]:
    """The files that define a repository folder, as (path under ``root``, its lstat), in path
    order: links to files count, folders behind links are not entered, caches are left out. Read
    at every set-up of a ``repo_dir`` task, so with os.scandir: pathlib's rglob and two stats a
    file took 174 ms for a 5,903-file folder."""
    found = []
    folders = [""]
    while folders:
        folder = folders.pop()
        try:
            entries = list(os.scandir(root / folder))
        except PermissionError:  # as rglob: a folder it cannot list holds nothing
            continue
        for entry in entries:
            if entry.name in IGNORED_PARTS:
                continue
            rel = f"{folder}/{entry.name}" if folder else entry.name
            if entry.is_dir(follow_symlinks=False):
                folders.append(rel)
            elif entry.is_file() and os.path.splitext(entry.name)[1] != ".pyc":
                found.append((rel, entry.stat(follow_symlinks=False)))
    found.sort(key=lambda item: item[0].split("/"))
    return found


def _build_template_once(record: dict[str, Any], folder: Path) -> None:
    """Build into a staging folder of this build's own, then move it to ``folder``. The node's
    other workers share the cache and may build the same template at the same time: the first
    move wins, and the later build's copy is dropped (a move onto a folder with files fails)."""
    staging = folder.with_name(f"{REPO_FOLDER}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _build_template(record, staging)
        try:
            staging.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
