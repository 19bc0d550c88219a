"""SWE-bench instances as a task type (``swebench``), graded by the ``swebench`` package itself.

A record is a SWE-bench (5.x) instance: ``instance_id``, ``repo``, ``version``, ``problem_statement``,
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (JSON-encoded lists, as in the published datasets, or lists),
``eval_script`` (the instance's bash evaluation, which brackets its test run between
``>>>>> Start Test Output`` and ``>>>>> End Test Output``), ``log_parser`` (a name in swebench's
``PARSER_REGISTRY``) and ``eval_type``. The repository is where the instance's image keeps it
(``/testbed``, checked out at ``base_commit``) unless the record gives ``repo_dir`` or ``files``
(offline fixtures; see :mod:`swe`). ``image``: a SWE-bench image name is pulled as ``docker://``;
rolloutd references (``default``, a path, ``dockerfile:``, ...) are used as they are.

Evaluation runs ``eval_script`` in the working folder of the sandbox the agent worked in and hands
its log to ``swebench.harness.grading.get_eval_report``, the harness's own parser and grading:
reward 1 when it reports the instance resolved, else 0. A log that swebench classifies as an
environment failure is the task's error, never a reward of 0.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import shlex
import tempfile
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import TaskError
from rolloutd.native_io.output import tail

from .base import EvalResult, Task, require
from .sandbox_files import read_file, write_file
from .swe import SweTaskType

if TYPE_CHECKING:
    from ..sandbox.lease import Lease

TESTBED = "/testbed"
LOG_MAX_BYTES = 64 << 20
OWN_IMAGE_PREFIXES = ("default", "/", "docker://", "dockerfile:", "docker-archive:", "oci:")
EVAL_TYPES = ("pass_and_fail", "fail_only")


@functools.cache
def _harness() -> Any:
    """swebench's grading module, imported once and off the event loop (it takes seconds:
    it imports datasets, docker and modal)."""
    from swebench.harness import grading, log_parsers, utils

    return grading, log_parsers.PARSER_REGISTRY, utils.make_test_spec


class SweBenchTaskType(SweTaskType):
    name = "swebench"

    def parse(self, record: dict[str, Any]) -> Task:
        iid = require(record, "instance_id", str)
        for key in ("repo", "version", "eval_script", "log_parser"):
            require(record, key, str)
        if ">>>>> Start Test Output" not in record["eval_script"]:
            raise TaskError(f"task {iid!r}: eval_script has no '>>>>> Start Test Output' marker; swebench could not "
                            "read its log")
        eval_type = require(record, "eval_type", str, default="pass_and_fail")
        if eval_type not in EVAL_TYPES:
            raise TaskError(f"task {iid!r}: eval_type must be one of {EVAL_TYPES}, got {eval_type!r}")
        normalized = {**record, "eval_type": eval_type}
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            value = require(record, key, (str, list), default=[])
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise TaskError(f"task {iid!r}: {key} is a string but not a JSON list: {e}") from e
            normalized[key] = value
        if not any(k in record for k in ("files", "repo_dir", "workdir")):
            normalized["workdir"] = TESTBED
        image = require(record, "image", str, default="default")
        if not image.startswith(OWN_IMAGE_PREFIXES):
            normalized["image"] = f"docker://{image}"
        return super().parse(normalized)

    async def setup(self, task: Task, lease: "Lease", *, cache_dir: Any) -> str:
        _, parsers, _ = await asyncio.to_thread(_harness)
        if task.record["log_parser"] not in parsers:
            raise TaskError(f"task {task.instance_id}: log_parser {task.record['log_parser']!r} is not in swebench's "
                            f"PARSER_REGISTRY ({len(parsers)} names, e.g. parse_log_pytest)")
        return await super().setup(task, lease, cache_dir=cache_dir)

    async def _grade(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        folder = f"{lease.sandbox.workspace_inside}/.rolloutd-eval"
        script, log = f"{folder}/eval.sh", f"{folder}/swebench.log"
        await write_file(lease, script, task.record["eval_script"].encode())
        # A CommandTimeout goes up: the sample ends as ``eval_timeout``, never a reward of 0.
        await lease.run(f"cd {shlex.quote(workdir)} && bash {shlex.quote(script)} > {shlex.quote(log)} 2>&1",
                        timeout_s=timeout_s)
        content = await read_file(lease, log, max_bytes=LOG_MAX_BYTES)
        if content is None:
            raise TaskError(f"task {task.instance_id}: the evaluation wrote no log at {log}")
        report = await asyncio.to_thread(_report, task.record, content)
        if report.get("infra_failure"):
            raise TaskError(f"task {task.instance_id}: swebench reads the evaluation log as an environment failure "
                            f"({report.get('infra_failure_reason')}); the log ends: "
                            f"{tail(content.decode(errors='replace'))}")
        status = report.get("tests_status", {})
        return EvalResult(1.0 if report["resolved"] else 0.0, {
            "swebench_resolved": report["resolved"],
            "patch_successfully_applied": report["patch_successfully_applied"],
            "failed_fail_to_pass": status.get("FAIL_TO_PASS", {}).get("failure", []),
            "failed_pass_to_pass": status.get("PASS_TO_PASS", {}).get("failure", [])})


def _report(record: dict[str, Any], log: bytes) -> dict[str, Any]:
    """swebench's own report for this log (blocking: runs in a thread)."""
    grading, _, make_test_spec = _harness()
    spec = make_test_spec({**record, "image": record.get("image", "")})
    with tempfile.NamedTemporaryFile("wb", suffix=".log") as f:
        f.write(log)
        f.flush()
        # The agent's change is already in the sandbox's tree; the prediction only has to exist.
        prediction = {"instance_id": record["instance_id"], "model_name_or_path": "rolloutd",
                      "model_patch": "(applied in the sandbox)"}
        return grading.get_eval_report(spec, prediction, f.name, include_tests_status=True)[record["instance_id"]]


def oracle_commands(task: Task) -> list[str]:
    """Shell commands that apply the instance's gold ``patch`` in its working folder (for the
    ``script`` agent: checks a dataset, and its evaluation, end to end)."""
    patch = task.record.get("patch")
    if not isinstance(patch, str) or not patch:
        raise TaskError(f"task {task.instance_id}: no gold patch to apply")
    return [f"echo {base64.b64encode(patch.encode()).decode()} | base64 -d | git apply -v"]
