"""Task types in real sandboxes: set-up, evaluation, reward; records validated."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.lease import Lease, open_lease
from rolloutd.daemon.tasks.base import get_task_type
from rolloutd.daemon.tasks.datasets import bundled_dir, resolve_task
from rolloutd.daemon.tasks.swe import SweTaskType, _tree_files
from rolloutd.daemon.tasks.sandbox_files import read_file, write_file
from rolloutd.native_io.errors import SandboxPathRefused, TaskError


@pytest.fixture
async def lease(backend: SandboxBackend) -> AsyncIterator[Lease]:
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    yield lease
    await lease.destroy()


@pytest.mark.parametrize("cache_in", ["shared", "host"])
async def test_bundled_task_unsolved_gets_zero_and_solved_gets_one(lease: Lease, short_tmp: Path, cache_in: str) -> None:
    # "shared": the template lies where the sandbox can read it and its shell copies it (as in the
    # daemon); "host": anywhere else, and the host writes the files.
    cache = lease.sandbox.shared_dir / "task-cache" if cache_in == "shared" else short_tmp / "cache"
    task = resolve_task("bundled", "paginate-003", None)
    swe = get_task_type("swe")
    workdir = await swe.setup(task, lease, cache_dir=cache)
    r = await lease.run("pwd && git log --oneline | wc -l && git status --porcelain | wc -l && ls")
    lines = r.output.splitlines()
    assert lines[0] == workdir and lines[1] == "1" and lines[2] == "0" and "paginate" in r.output, r.output
    if lease.sandbox.isolated:
        assert (await lease.run(f"touch {lease.sandbox.shared_inside}/x")).exit_code != 0, \
            "the sandbox can write the shared folder"
    unsolved = await swe.evaluate(task, lease, workdir, timeout_s=120)
    assert unsolved.reward == 0.0 and unsolved.details["failed_fail_to_pass"]
    assert unsolved.details["failed_pass_to_pass"] == []
    # Apply the known fix the way an agent would: inside the sandbox.
    fixed = (bundled_dir() / "paginate-003" / "solution" / "paginate" / "pager.py").read_text()
    await lease.run(f"cat > paginate/pager.py <<'RLD'\n{fixed}RLD")
    solved = await swe.evaluate(task, lease, workdir, timeout_s=120)
    assert solved.reward == 1.0, solved.details


async def test_template_is_prepared_once_per_task(lease: Lease, short_tmp: Path) -> None:
    task = resolve_task("bundled", "wordwrap-001", None)
    swe = get_task_type("swe")
    await swe.setup(task, lease, cache_dir=short_tmp / "cache")
    (template,) = (short_tmp / "cache" / "swe").glob("wordwrap-001-*/repo")
    stamp = template.stat().st_mtime_ns
    await swe.setup(task, lease, cache_dir=short_tmp / "cache")
    assert template.stat().st_mtime_ns == stamp


async def test_templates_built_at_once_by_two_workers_leave_one(short_tmp: Path) -> None:
    """A node's workers share the task cache, each with its own task type and locks: two builds of
    one template at the same time leave one, and no staging folder."""
    task = resolve_task("bundled", "wordwrap-001", None)
    cache = short_tmp / "cache"
    first, second = await asyncio.gather(SweTaskType()._template(task, cache), SweTaskType()._template(task, cache))
    assert first == second
    (entry,) = (cache / "swe").iterdir()
    assert [p.name for p in entry.iterdir()] == ["repo"]
    assert (first / ".git").is_dir() and (first / "wordwrap").is_dir()


async def test_command_task(lease: Lease, short_tmp: Path) -> None:
    task = resolve_task("", "", {"type": "command", "instance_id": "cmd-1", "problem_statement": "make x",
                                 "setup_script": "echo 3 > x.txt", "eval_script": "echo ok; echo $(( $(cat x.txt) * 2 ))"})
    cmd = get_task_type("command")
    workdir = await cmd.setup(task, lease, cache_dir=short_tmp)
    assert (await lease.run("cat x.txt")).output == "3\n"
    result = await cmd.evaluate(task, lease, workdir, timeout_s=30)
    assert result.reward == 6.0
    bad = resolve_task("", "", {"type": "command", "instance_id": "cmd-2", "eval_script": "echo not-a-number"})
    assert (await cmd.evaluate(bad, lease, workdir, timeout_s=30)).reward == 0.0


def test_inline_and_jsonl_records_are_validated(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="FAIL_TO_PASS"):
        resolve_task("", "", {"instance_id": "x", "problem_statement": "p", "files": {"a.py": ""}})
    with pytest.raises(TaskError, match="exactly one of"):
        resolve_task("", "", {"instance_id": "x", "problem_statement": "p", "FAIL_TO_PASS": ["t"]})
    with pytest.raises(TaskError, match="unknown task type"):
        resolve_task("", "", {"type": "nope", "instance_id": "x"})
    with pytest.raises(TaskError, match="no instance"):
        resolve_task("bundled", "does-not-exist", None)
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"instance_id": "inline-1", "problem_statement": "p", "files": {"m.py": "X = 1\n"},
                                "FAIL_TO_PASS": ["tests/test_m.py::test_x"]}) + "\n")
    task = resolve_task(str(data), "inline-1", None)
    assert task.type == "swe" and task.record["files"] == {"m.py": "X = 1\n"}
    with pytest.raises(TaskError, match="absolute path"):
        resolve_task("relative.jsonl", "inline-1", None)


async def test_swe_task_from_files_with_test_patch(lease: Lease, short_tmp: Path) -> None:
    record = {
        "instance_id": "files-1", "problem_statement": "double() is wrong",
        "files": {"calc.py": "def double(x):\n    return x + 1\n", "tests/__init__.py": ""},
        "test_patch": ("--- /dev/null\n+++ b/tests/test_calc.py\n@@ -0,0 +1,4 @@\n+from calc import double\n+\n"
                       "+def test_double():\n+    assert double(4) == 8\n"),
        "FAIL_TO_PASS": ["tests/test_calc.py::test_double"],
    }
    task = resolve_task("", "", record)
    swe = get_task_type("swe")
    workdir = await swe.setup(task, lease, cache_dir=short_tmp)
    assert (await swe.evaluate(task, lease, workdir, timeout_s=60)).reward == 0.0
    await lease.run("git checkout -q -- . && git clean -fdq && sed -i 's/x + 1/x * 2/' calc.py")
    assert (await swe.evaluate(task, lease, workdir, timeout_s=60)).reward == 1.0
    shutil.rmtree(short_tmp / "swe", ignore_errors=True)


def test_a_dataset_with_a_repeated_instance_id_is_an_error(tmp_path: Path) -> None:
    """Two records with one id: which one a request meant cannot be known, so neither is used
    (it was the last one, silently); a file edited in place is read again."""
    def record(value: int) -> str:
        return json.dumps({"instance_id": "dup-1", "problem_statement": "p", "files": {"m.py": f"X = {value}\n"},
                           "FAIL_TO_PASS": ["tests/test_m.py::test_x"]}) + "\n"

    data = tmp_path / "tasks.jsonl"
    data.write_text(record(1) + record(2))
    with pytest.raises(TaskError, match=r"tasks.jsonl:2: instance_id 'dup-1' is already the record of line 1"):
        resolve_task(str(data), "dup-1", None)
    data.write_text(record(3))
    assert resolve_task(str(data), "dup-1", None).record["files"] == {"m.py": "X = 3\n"}
    data.write_text(record(4) + "\n")
    assert resolve_task(str(data), "dup-1", None).record["files"] == {"m.py": "X = 4\n"}


async def test_an_eval_that_times_out_is_no_score(lease: Lease, short_tmp: Path) -> None:
    """Tests that outlive the eval deadline raise a time-out (the sample ends ``eval_timeout``,
    untrained) instead of scoring 0.0 as if the model had failed them."""
    cmd = get_task_type("command")
    task = resolve_task("", "", {"type": "command", "instance_id": "slow-eval", "eval_script": "sleep 30; echo 1"})
    with pytest.raises(TimeoutError):
        await cmd.evaluate(task, lease, await cmd.setup(task, lease, cache_dir=short_tmp), timeout_s=0.5)
    record = {"instance_id": "slow-swe", "problem_statement": "p", "files": {"tests/__init__.py": "",
              "tests/test_slow.py": "import time\n\ndef test_slow():\n    time.sleep(30)\n"},
              "FAIL_TO_PASS": ["tests/test_slow.py::test_slow"]}
    swe, task = get_task_type("swe"), resolve_task("", "", record)
    with pytest.raises(TimeoutError):
        await swe.evaluate(task, lease, await swe.setup(task, lease, cache_dir=short_tmp), timeout_s=1.0)


TRICKY_TESTS = '''import pytest


@pytest.mark.parametrize("expr", ["1 + 1", "[x]", "\\u00e9", "a::b", "\\u4e2d \\u6587"])
def test_eval(expr):
    assert expr


class TestOuter:
    class TestInner:
        def test_deep(self):
            assert True


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")


def test_passes_then_breaks_teardown(broken_teardown):
    assert True


@pytest.mark.parametrize("n", [1, 2])
def test_odd(n):
    assert n % 2 == 1
'''


@pytest.mark.parametrize("ids, reward", [
    (["tests/test_ids.py::test_eval[1 + 1]", "tests/test_ids.py::test_eval[[x]]",
      "tests/test_ids.py::test_eval[a::b]", "tests/test_ids.py::TestOuter::TestInner::test_deep",
      "tests/test_ids.py::test_eval[\u00e9]", "tests/test_ids.py::test_eval[\\xe9]",
      "tests/test_ids.py::test_eval[\u4e2d \u6587]", "tests/test_ids.py::test_odd[1]"], 1.0),
    (["tests/test_ids.py::test_eval[1 + 1]", "tests/test_ids.py::test_odd[2]"], 0.0),
    (["tests/test_ids.py::test_passes_then_breaks_teardown"], 0.0),
    (["tests/test_ids.py::test_eval[1 +]"], 0.0),  # no such test: not a pass
])
async def test_swe_grading_reads_the_report_not_the_summary(lease: Lease, short_tmp: Path, ids: list[str],
                                                              reward: float) -> None:
    """Node ids with spaces, brackets, unicode and nested ``::`` are graded by what pytest ran
    (issue 27: the summary regex cut ``test_eval[1 + 1]`` at the space and scored 0.0)."""
    record = {"instance_id": "ids-1", "problem_statement": "p", "FAIL_TO_PASS": ids,
              "files": {"tests/__init__.py": "", "tests/test_ids.py": TRICKY_TESTS}}
    swe, task = get_task_type("swe"), resolve_task("", "", record)
    result = await swe.evaluate(task, lease, await swe.setup(task, lease, cache_dir=short_tmp), timeout_s=120)
    assert result.reward == reward, result.details
    if reward == 1.0:
        assert result.details["failed_fail_to_pass"] == []


async def test_two_records_with_one_id_never_share_a_cached_repository(lease: Lease, short_tmp: Path) -> None:
    """The template cache is keyed by content: a second record with the same instance id (another
    dataset, an edited task) gets its own files, not the first one's (issue 27); the same
    content is prepared once; an edited repo_dir is a new template."""
    swe = get_task_type("swe")
    cache = short_tmp / "cache"

    def record(**source: object) -> dict[str, object]:
        return {"instance_id": "same-id", "problem_statement": "p", "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
                **source}

    async def seen(rec: dict[str, object]) -> str:
        task = resolve_task("", "", rec)
        workdir = await swe.setup(task, lease, cache_dir=cache)
        return (await lease.run(f"cat {workdir}/m.py")).output.strip()

    assert await seen(record(files={"m.py": "X = 1\n"})) == "X = 1"
    assert await seen(record(files={"m.py": "X = 2\n"})) == "X = 2"
    assert await seen(record(files={"m.py": "X = 1\n"})) == "X = 1"
    repo = short_tmp / "host-repo"
    repo.mkdir()
    (repo / "m.py").write_text("X = 3\n")
    assert await seen(record(repo_dir=str(repo))) == "X = 3"
    (repo / "m.py").write_text("X = 4\n")
    assert await seen(record(repo_dir=str(repo))) == "X = 4"
    assert len(list((cache / "swe").glob("same-id-*/repo"))) == 4


def test_a_repo_dirs_key_follows_its_files_not_its_caches(short_tmp: Path) -> None:
    """What a repo_dir task's cache key is read from, at every set-up: its files in path order
    (pathlib's, folder by folder), links to files, not folders behind links, not Python's caches."""
    repo, outside = short_tmp / "repo", short_tmp / "outside"
    (repo / "pkg" / "__pycache__").mkdir(parents=True)
    outside.mkdir()
    (outside / "big.txt").write_text("x")
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "pkg-b.py").write_text("")
    (repo / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"x")
    (repo / "stale.pyc").write_bytes(b"x")
    (repo / "linked-folder").symlink_to(outside)
    (repo / "linked.py").symlink_to(repo / "pkg" / "a.py")
    assert [rel for rel, _ in _tree_files(repo)] == ["linked.py", "pkg/a.py", "pkg-b.py"]
    swe = SweTaskType()
    before = swe._tree_hash(repo)
    (repo / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"yy")
    assert swe._tree_hash(repo) == before
    (repo / "pkg" / "a.py").write_text("A = 20\n")  # another size: a same-size edit may keep a coarse mtime
    assert swe._tree_hash(repo) != before


async def test_links_a_sandbox_plants_are_not_followed_on_the_host(lease: Lease, short_tmp: Path) -> None:
    # The evaluation writes its hidden tests into the agent's repository. Had the agent made
    # tests/ a link to a host folder, the host would have written there with the daemon's rights.
    victim = short_tmp / "victim"
    victim.mkdir()
    victim.chmod(0o777)  # writable by the sandbox user too: only the link check may keep it empty
    task = resolve_task("bundled", "paginate-003", None)
    swe = get_task_type("swe")
    workdir = await swe.setup(task, lease, cache_dir=lease.sandbox.shared_dir / "task-cache")
    r = await lease.run(f"rm -rf tests && ln -s {victim} tests && ls -l tests")
    assert "->" in r.output, r.output
    with pytest.raises(SandboxPathRefused, match="symbolic link"):  # the pipeline scores it 0 (test_pipeline)
        await swe.evaluate(task, lease, workdir, timeout_s=120)
    assert list(victim.iterdir()) == []


async def test_a_planted_fifo_is_refused_not_waited_on(lease: Lease) -> None:
    ws = lease.sandbox.workspace_inside
    assert (await lease.run(f"mkfifo {ws}/report.json && ln -s /etc/hostname {ws}/linked")).exit_code == 0
    with pytest.raises(SandboxPathRefused, match="not a regular file"):
        await asyncio.wait_for(read_file(lease, f"{ws}/report.json", max_bytes=100), 10)
    with pytest.raises(SandboxPathRefused, match="symbolic link"):
        await read_file(lease, f"{ws}/linked", max_bytes=100)
    with pytest.raises(SandboxPathRefused, match="symbolic link"):
        await write_file(lease, f"{ws}/linked", b"x")
    assert await read_file(lease, f"{ws}/missing", max_bytes=100) is None
