"""The ``filecalc`` task family: the generator, the train / held-out split, and the grading in a
real sandbox (the oracle's own command graded 1, wrong and missing answers graded 0)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rolloutd.daemon.agents.base import make_agent
from rolloutd.daemon.agents.toolcalls import BASH, SUBMIT, parse_tool_call
from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.lease import Lease, open_lease
from rolloutd.daemon.tasks.base import get_task_type
from rolloutd.daemon.tasks.datasets import resolve_task
from rolloutd.daemon.tasks.filecalc import expected, generate, oracle_replies, split
from rolloutd.native_io.errors import ConfigError, TaskError


@pytest.fixture
async def lease(backend: SandboxBackend) -> AsyncIterator[Lease]:
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    yield lease
    await lease.destroy()


def test_generator_is_seeded_distinct_and_valid() -> None:
    records = generate(3000, seed=7)
    assert records == generate(3000, seed=7) and records != generate(3000, seed=8)
    assert len({r["instance_id"] for r in records}) == 3000
    assert len({(r["file"], r["op"], r["value"], r["operand"]) for r in records}) == 3000
    assert {r["op"] for r in records} == {"plus", "minus", "times"}
    for r in records[:50]:
        task = resolve_task("", "", r)
        assert task.type == "filecalc" and r["file"] in task.problem_statement and str(r["operand"]) in task.problem_statement
    with pytest.raises(TaskError, match="count must be"):
        generate(0)


def test_split_is_disjoint_stable_and_sized() -> None:
    records = generate(2000, seed=1)
    train, heldout = split(records, 0.2)
    ids_train, ids_held = {r["instance_id"] for r in train}, {r["instance_id"] for r in heldout}
    assert not ids_train & ids_held and len(ids_train) + len(ids_held) == 2000
    assert 0.16 < len(heldout) / 2000 < 0.24
    # An instance's side depends on its id only: a longer draw keeps the first ones where they were.
    more_train, more_held = split(generate(3000, seed=1), 0.2)
    assert ids_held <= {r["instance_id"] for r in more_held} and ids_train <= {r["instance_id"] for r in more_train}


def test_bad_records_are_refused_naming_the_field() -> None:
    good = generate(1)[0]
    for bad, field in [({"file": "../etc/passwd"}, "file"), ({"op": "divide"}, "op"), ({"value": "3"}, "value"),
                       ({"operand": True}, "operand")]:
        with pytest.raises(TaskError, match=field):
            resolve_task("", "", {**good, **bad})


def test_oracle_replies_are_valid_tool_calls() -> None:
    tools = {s.name: s for s in (BASH, SUBMIT)}
    record = generate(1, seed=3)[0]
    first, last = (parse_tool_call(text, tools) for text in oracle_replies(record))
    assert first.name == "bash" and record["file"] in first.arguments["command"] and last.name == "submit"


async def test_grading_in_a_sandbox(lease: Lease, short_tmp: Path) -> None:
    calc = get_task_type("filecalc")
    for record in [r for r in generate(60, seed=2) if r["op"] in ("minus", "times")][:2]:
        task = resolve_task("", "", record)
        workdir = await calc.setup(task, lease, cache_dir=short_tmp)
        assert (await lease.run(f"cat {record['file']}")).output.strip() == str(record["value"])
        assert (await calc.evaluate(task, lease, workdir, timeout_s=30)).reward == 0.0, "no answer yet"
        command = parse_tool_call(oracle_replies(record)[0], {"bash": BASH}).arguments["command"]
        assert (await lease.run(command)).exit_code == 0
        assert (await calc.evaluate(task, lease, workdir, timeout_s=30)).reward == 1.0
        await lease.run(f"echo {expected(record) + 1} > answer.txt")
        assert (await calc.evaluate(task, lease, workdir, timeout_s=30)).reward == 0.0, "a wrong answer"


def test_agent_tools_setting_is_checked() -> None:
    assert make_agent("codeact", {"tools": ["bash", "submit"]}).config.tools == ["bash", "submit"]
    with pytest.raises(ConfigError, match="include 'submit'"):
        make_agent("codeact", {"tools": ["bash"]})
    with pytest.raises(ConfigError, match="unknown tool"):
        make_agent("codeact", {"tools": ["bash", "submit", "curl"]})
