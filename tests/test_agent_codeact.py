"""The built-in CodeAct agent end to end: a real local sandbox, the reference policy server in
scripted mode over real HTTP, a ServerPool; the trajectories are checked as a trainer would."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rolloutd.daemon.agents import CodeActAgent, make_agent
from rolloutd.daemon.agents.base import AgentConfig

from agent_support import BUNDLED, agent_context, check_outcome, load_task, oracle_replies, sandbox_python_env, tool_schemas


@pytest.mark.parametrize("instance_id", ["wordwrap-001", "cliargs-009", "casing-017"])
async def test_oracle_plan_solves_the_task(instance_id: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox_python_env(monkeypatch)
    task = load_task(instance_id)
    replies = oracle_replies(instance_id)
    uses_ipython = any('"name": "ipython"' in r for r in replies)
    async with agent_context(short_tmp, instance_id, replies, repo=BUNDLED / instance_id / "repo",
                             problem=task["problem_statement"], ipython=uses_ipython) as ctx:
        outcome = await make_agent("codeact", {"max_turns": 10}).run(ctx)
        assert (outcome.finish_reason, outcome.submitted, outcome.num_turns) == ("completed", True, len(replies))
        assert outcome.template_append_only and outcome.template_notes == []
        assert outcome.segments == [(0, len(outcome.response_ids))]
        assert all(s.errors == 0 for name, s in outcome.tools.items()), outcome.tools
        check_outcome(outcome, ctx, tool_schemas(uses_ipython))
        # The edits made through the sandbox's shell are the solution's files.
        workspace = ctx.lease.sandbox.workspace
        for fixed in (BUNDLED / instance_id / "solution").rglob("*"):
            if fixed.is_file():
                rel = fixed.relative_to(BUNDLED / instance_id / "solution")
                assert (workspace / rel).read_text() == fixed.read_text(), rel
        # The evaluator's check: the hidden tests pass in the sandbox.
        shutil.copytree(BUNDLED / instance_id / "eval_tests", workspace, dirs_exist_ok=True)
        result = await ctx.run("python3 -m pytest -q -p no:cacheprovider " + " ".join(task["FAIL_TO_PASS"]),
                               timeout_s=60)
        assert result.exit_code == 0, result.output
