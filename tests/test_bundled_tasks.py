"""The bundled offline tasks: each fails before its fix, passes after it, and its oracle solves it.

A task is run the way the evaluator runs it: a copy of `repo/` with `eval_tests/` copied over it,
then `python -m pytest` in a subprocess from the copy's root, read back per node id from a JUnit
report. The oracle is replayed with the str_replace_editor semantics the agent tools have.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from rolloutd.daemon.agents.editor import EDITOR_REQUIRED_ARGS, insert_after, replace_once
from rolloutd.daemon.agents.toolcalls import CODEACT_TOOLS, ToolCall, parse_tool_call
from rolloutd.daemon.tasks.datasets import bundled_dir

BUNDLED = bundled_dir()
TASK_DIRS = sorted(p for p in BUNDLED.iterdir() if p.is_dir())

MIN_TASKS = 22
MIN_IPYTHON_ORACLES = 5
MAX_REPLY_CHARS = 1500
PYTEST_TIMEOUT_S = 60
# A line added by the fix that also appears in the problem statement gives the fix away; short
# lines ("return value") can appear there innocently.
LEAK_MIN_CHARS = 20

TASK_KEYS = {"instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "summary"}
INSTANCE_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
TOOLS = {spec.name: spec for spec in CODEACT_TOOLS}


def load_task(task_dir: Path) -> dict[str, Any]:
    return json.loads((task_dir / "task.json").read_text())


def load_replies(task_dir: Path) -> list[str]:
    return json.loads((task_dir / "oracle.json").read_text())["replies"]


def read_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def parse_reply(reply: str) -> ToolCall:
    """The single tool call of one oracle reply, checked against the tool schemas."""
    assert len(reply) <= MAX_REPLY_CHARS, f"reply of {len(reply)} chars: {reply[:80]!r}"
    # The agent's own parser: one block, valid JSON, a known tool, arguments that fit its schema.
    call = parse_tool_call(reply, TOOLS)
    before, _, after = reply.partition("<tool_call>")
    assert before.strip(), f"reply has no reasoning before its tool call: {reply[:120]!r}"
    assert not after.split("</tool_call>", 1)[1].strip(), f"text after the tool call: {reply[-120:]!r}"
    name, arguments = call.name, call.arguments
    if name == "str_replace_editor":
        command = arguments["command"]
        assert EDITOR_REQUIRED_ARGS[command] <= set(arguments), f"{command} arguments {sorted(arguments)}"
        path = arguments["path"]
        assert not path.startswith("/") and ".." not in Path(path).parts, f"path must stay in the repo: {path!r}"
        if "view_range" in arguments:
            assert len(arguments["view_range"]) == 2, arguments["view_range"]
    elif name == "bash":
        syntax = subprocess.run(["bash", "-n"], input=arguments["command"], capture_output=True, text=True)
        assert syntax.returncode == 0, f"bash syntax error in {arguments['command']!r}: {syntax.stderr}"
    elif name == "ipython":
        compile(arguments["code"], "<oracle ipython>", "exec")
    return call


def replay_edits(files: dict[str, str], calls: list[ToolCall]) -> dict[str, str]:
    """Apply the oracle's editor calls to *files*; returns the files that end up different.

    The edit rules are the agent's own (rolloutd.daemon.agents.editor): create refuses an existing
    file, str_replace needs exactly one occurrence, insert puts new_str's lines after line
    insert_line (0 = top), undo_edit restores the content before the file's last edit.
    """
    current = dict(files)
    # Contents before each edit, per path; None: the file did not exist yet.
    history: dict[str, list[str | None]] = {}
    for call in calls:
        if call.name != "str_replace_editor":
            continue
        args = call.arguments
        command, path = args["command"], args["path"]
        if command == "view":
            assert path in current or any(p.startswith(path.rstrip("/") + "/") for p in current), path
            continue
        if command == "create":
            assert path not in current, f"create would overwrite {path}"
            history.setdefault(path, []).append(None)
            current[path] = args["file_text"]
            continue
        assert path in current, f"{command} on a missing file {path}"
        text = current[path]
        if command == "undo_edit":
            assert history.get(path), f"nothing to undo in {path}"
            previous = history[path].pop()
            if previous is None:
                del current[path]
            else:
                current[path] = previous
            continue
        history.setdefault(path, []).append(text)
        if command == "str_replace":
            current[path] = replace_once(text, args["old_str"], args.get("new_str", ""), path)
        else:
            current[path] = insert_after(text, args["insert_line"], args["new_str"], path)
    return {p: t for p, t in current.items() if files.get(p) != t}


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) under which pytest's JUnit report lists *node_id*."""
    path, *scopes, name = node_id.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *scopes]), name


def run_pytest(repo: Path) -> dict[tuple[str, str], str]:
    """Run the repo's tests as the evaluator does; outcome ("passed"/"failed") per JUnit key."""
    report = repo.parent / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST_")}
    # The sandbox image has a bare pytest; this venv's plugins (hypothesis alone imports for a
    # second) would only slow every run down.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S,
    )
    assert report.exists(), f"pytest wrote no report (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        outcomes[(case.get("classname", ""), case.get("name", ""))] = "failed" if failed else "passed"
    report.unlink()
    return outcomes


def checkout(task_dir: Path, dest: Path, with_solution: bool) -> Path:
    repo = dest / "repo"
    shutil.copytree(task_dir / "repo", repo)
    shutil.copytree(task_dir / "eval_tests", repo, dirs_exist_ok=True)
    if with_solution:
        shutil.copytree(task_dir / "solution", repo, dirs_exist_ok=True)
    return repo


def test_bundled_set_is_large_and_varied() -> None:
    assert len(TASK_DIRS) >= MIN_TASKS, [p.name for p in TASK_DIRS]
    uses_ipython = [
        d.name for d in TASK_DIRS if any(parse_reply(r).name == "ipython" for r in load_replies(d))
    ]
    assert len(uses_ipython) >= MIN_IPYTHON_ORACLES, uses_ipython


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=lambda p: p.name)
def test_task_metadata(task_dir: Path) -> None:
    task = load_task(task_dir)
    assert set(task) == TASK_KEYS
    assert task["instance_id"] == task_dir.name and INSTANCE_ID.fullmatch(task_dir.name)
    assert task["problem_statement"].strip() and task["summary"].strip()
    assert "\n" not in task["summary"]
    fail_to_pass, pass_to_pass = task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
    assert fail_to_pass and not set(fail_to_pass) & set(pass_to_pass)
    assert len(set(fail_to_pass)) == len(fail_to_pass) and len(set(pass_to_pass)) == len(pass_to_pass)
    repo_files, eval_files = read_tree(task_dir / "repo"), read_tree(task_dir / "eval_tests")
    assert "README.md" in repo_files
    for node_id in fail_to_pass:
        assert node_id.split("::")[0] in eval_files, f"FAIL_TO_PASS test outside eval_tests/: {node_id}"
    for node_id in pass_to_pass:
        assert node_id.split("::")[0] in eval_files or node_id.split("::")[0] in repo_files, node_id
    visible = [n for n in pass_to_pass if n.split("::")[0] in repo_files and n.split("::")[0] not in eval_files]
    assert len(visible) >= 2, f"the agent should see at least two passing tests: {visible}"


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=lambda p: p.name)
def test_oracle_replays_to_solution(task_dir: Path) -> None:
    calls = [parse_reply(r) for r in load_replies(task_dir)]
    assert calls[-1].name == "submit" and all(c.name != "submit" for c in calls[:-1])
    original, solution = read_tree(task_dir / "repo"), read_tree(task_dir / "solution")
    assert solution, "solution/ is empty"
    assert replay_edits(original, calls) == solution
    problem = load_task(task_dir)["problem_statement"]
    for path, text in solution.items():
        added = set(text.splitlines()) - set(original.get(path, "").splitlines())
        for line in added:
            code = line.strip()
            if len(code) >= LEAK_MIN_CHARS and not code.startswith("#"):
                assert code not in problem, f"problem statement shows the fix: {code!r}"


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=lambda p: p.name)
def test_buggy_repo_fails_only_fail_to_pass(task_dir: Path, tmp_path: Path) -> None:
    task = load_task(task_dir)
    outcomes = run_pytest(checkout(task_dir, tmp_path, with_solution=False))
    got = {n: outcomes.get(junit_key(n), "missing") for n in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]}
    want = {**{n: "failed" for n in task["FAIL_TO_PASS"]}, **{n: "passed" for n in task["PASS_TO_PASS"]}}
    assert got == want


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=lambda p: p.name)
def test_solution_passes_every_test(task_dir: Path, tmp_path: Path) -> None:
    task = load_task(task_dir)
    outcomes = run_pytest(checkout(task_dir, tmp_path, with_solution=True))
    listed = {junit_key(n) for n in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]}
    assert listed <= set(outcomes), f"not collected: {sorted(listed - set(outcomes))}"
    assert {k: v for k, v in outcomes.items() if v != "passed"} == {}
