"""The built-in CodeAct agent end to end: a real local sandbox, the reference policy server in
scripted mode over real HTTP, a ServerPool; the trajectories are checked as a trainer would."""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from agent_support import (
    BUNDLED,
    agent_context,
    call,
    check_outcome,
    load_task,
    oracle_replies,
    sandbox_python_env,
    tool_schemas,
)
from support.waits import async_wait_until
from rolloutd.daemon.agents import (
    Agent,
    AgentContext,
    AgentOutcome,
    CodeActAgent,
    TokenLedger,
    make_agent,
    register_agent,
    registered_agents,
)
from rolloutd.daemon.agents.base import AgentConfig
from rolloutd.daemon.policy.tokenizer import STRIP_THINK_TEMPLATE_PATH, load_tokenizer
from rolloutd.native_io.errors import ConfigError, SandboxLost

TURN_START_TIMEOUT_S = 10.0
"""The reference policy starts generating a turn well within this."""


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
        per_turn = outcome.metrics["agent_cpu_s_per_turn"]
        assert len(per_turn) == outcome.num_turns and all(c > 0 for c in per_turn)
        assert outcome.metrics["agent_cpu_s"] >= sum(per_turn) and outcome.metrics["generate_s"] > 0
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


def tool_messages(outcome: AgentOutcome) -> list[tuple[str, str]]:
    """(role, content) of every message after the prompt that the model did not write."""
    return [(m["role"], m["content"]) for m in outcome.messages[2:] if m["role"] != "assistant"]


async def test_malformed_tool_calls_become_observations(short_tmp: Path) -> None:
    replies = [
        'Bad JSON.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',
        call("rm_rf", path="/"),
        call("bash", cmd="ls"),
        "I will just think about it without calling anything.",
        call("bash", command="ls") + "\n" + call("bash", command="pwd"),
        'Unfinished.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}',
        call("str_replace_editor", command="view", path="x.py", view_range="1-3"),
        call("str_replace_editor", command="delete", path="x.py"),
        '<tool_call>\n["bash", "ls"]\n</tool_call>',
        call("str_replace_editor", command="insert", path="x.py", new_str="y"),
        call("submit"),
    ]
    async with agent_context(short_tmp, "malformed", replies) as ctx:
        outcome = await CodeActAgent(AgentConfig()).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns) == ("completed", len(replies))
        check_outcome(outcome, ctx, tool_schemas(ipython=False))
    observations = tool_messages(outcome)
    expected = [("tool", "not valid JSON"), ("tool", "Unknown tool 'rm_rf'"), ("tool", "bash needs the argument(s) command"),
                ("user", "did not call a tool"), ("tool", "2 tool calls"), ("tool", "no closing </tool_call>"),
                ("tool", "view_range must be an array of integers"), ("tool", 'command must be one of "view"'),
                ("tool", "must be a JSON object"), ("tool", "needs the argument(s) insert_line")]
    assert len(observations) == len(expected)
    for (role, content), (want_role, want_text) in zip(observations, expected):
        assert role == want_role and want_text in content, (role, content)
    assert outcome.tools["invalid_call"].count == 9 and outcome.tools["invalid_call"].errors == 9
    assert outcome.tools["str_replace_editor"].errors == 1  # insert without insert_line reached the editor


async def test_editor_plan_with_undo_and_errors(short_tmp: Path) -> None:
    (short_tmp / "repo").mkdir()
    (short_tmp / "repo" / "m.py").write_text("a = 1\nb = 2\n")
    replies = [
        call("str_replace_editor", command="create", path="pkg/new.py", file_text="x = 0\n"),
        call("str_replace_editor", command="create", path="m.py", file_text="clobber"),
        call("str_replace_editor", command="str_replace", path="m.py", old_str="b = 2", new_str="b = 3"),
        call("str_replace_editor", command="insert", path="m.py", insert_line=0, new_str="# head"),
        call("str_replace_editor", command="undo_edit", path="m.py"),
        call("str_replace_editor", command="str_replace", path="m.py", old_str="nowhere"),
        call("str_replace_editor", command="view", path="m.py", view_range=[2, -1]),
        call("submit"),
    ]
    async with agent_context(short_tmp / "state", "editor-plan", replies, repo=short_tmp / "repo") as ctx:
        outcome = await CodeActAgent(AgentConfig()).run(ctx)
        workspace = ctx.lease.sandbox.workspace
        assert (workspace / "m.py").read_text() == "a = 1\nb = 3\n"
        assert (workspace / "pkg" / "new.py").read_text() == "x = 0\n"
    contents = [c for _, c in tool_messages(outcome)]
    assert contents[0] == "File created: pkg/new.py"
    assert "already exists" in contents[1]
    assert "     2\tb = 3" in contents[2] and "     1\t# head" in contents[3]
    assert "undone" in contents[4] and "did not appear verbatim" in contents[5]
    assert contents[6].splitlines()[1:] == ["     2\tb = 3", "     3\t"]
    assert (outcome.tools["str_replace_editor"].count, outcome.tools["str_replace_editor"].errors) == (7, 2)


async def test_max_turns_runs_the_last_tool_but_appends_nothing(short_tmp: Path) -> None:
    replies = [call("bash", command=f"echo turn{i} > turn{i}.txt") for i in range(6)]
    async with agent_context(short_tmp, "endless", replies) as ctx:
        outcome = await make_agent("codeact", {"max_turns": 3}).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns, outcome.submitted) == ("max_turns", 3, False)
        assert (ctx.lease.sandbox.workspace / "turn2.txt").read_text() == "turn2\n"
        assert not (ctx.lease.sandbox.workspace / "turn3.txt").exists()
        assert outcome.messages[-1]["role"] == "assistant"
        assert outcome.response_mask[-1] == 1 and outcome.tools["bash"].count == 3
        check_outcome(outcome, ctx, tool_schemas(ipython=False))


async def test_max_context_tokens_cuts_a_turn(short_tmp: Path) -> None:
    long_reply = "Let me explain at length. " * 40 + call("bash", command="ls")
    async with agent_context(short_tmp, "long", [call("bash", command="ls"), long_reply]) as ctx:
        probe = await make_agent("codeact", {"max_turns": 1}).run(ctx)
        first_turn = probe.turns[0].end
        ctx.results.clear()
        limit = len(probe.prompt_ids) + first_turn + 80
        outcome = await make_agent("codeact", {"max_context_tokens": limit, "max_tokens_per_turn": 60}).run(ctx)
        assert outcome.finish_reason == "max_tokens"
        assert len(outcome.prompt_ids) + len(outcome.response_ids) <= limit
        assert outcome.turns[-1].finish_reason == "length" and outcome.num_turns == 2
        check_outcome(outcome, ctx, tool_schemas(ipython=False))


async def test_turn_cut_by_max_tokens_per_turn_is_closed_and_explained(short_tmp: Path) -> None:
    replies = ["Let me explain at length. " * 40 + call("bash", command="ls"), call("submit")]
    async with agent_context(short_tmp, "chatty", replies) as ctx:
        outcome = await make_agent("codeact", {"max_tokens_per_turn": 50}).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns) == ("completed", 2)
        first = outcome.turns[0]
        assert (first.finish_reason, first.end - first.start) == ("length", 50)
        assert outcome.response_ids[first.end] == ctx.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert outcome.response_mask[first.end] == 0
        assert "cut off after 50 tokens" in tool_messages(outcome)[0][1]
        check_outcome(outcome, ctx, tool_schemas(ipython=False))


async def test_observation_that_does_not_fit_ends_with_max_tokens(short_tmp: Path) -> None:
    replies = [call("bash", command="ls"), call("bash", command="seq 1 2000"), call("submit")]
    async with agent_context(short_tmp, "big-output", replies) as ctx:
        probe = await make_agent("codeact", {"max_turns": 2}).run(ctx)
        ctx.results.clear()
        limit = len(probe.prompt_ids) + len(probe.response_ids) + 100
        outcome = await make_agent("codeact", {"max_context_tokens": limit, "max_tokens_per_turn": 64}).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns) == ("max_tokens", 2)
        assert outcome.messages[-1]["role"] == "assistant" and outcome.tools["bash"].count == 2
        check_outcome(outcome, ctx, tool_schemas(ipython=False))


async def test_command_timeout_and_failures_are_observations(short_tmp: Path) -> None:
    replies = [call("bash", command="sleep 5; echo never"), call("bash", command="echo alive; exit 3"),
               call("bash", command="echo still here"), call("submit")]
    async with agent_context(short_tmp, "slow", replies) as ctx:
        outcome = await make_agent("codeact", {"command_timeout_s": 0.3}).run(ctx)
        assert outcome.finish_reason == "completed"
    contents = [c for _, c in tool_messages(outcome)]
    assert "timed out after 0.3 s and was interrupted" in contents[0] and "never" not in contents[0]
    assert contents[1] == "alive\n[the command ended the shell; a new shell was started (cwd and environment reset)]\n[exit code 3]"
    assert contents[2] == "still here"
    assert (outcome.tools["bash"].count, outcome.tools["bash"].errors) == (3, 2)


async def test_ipython_errors_and_a_dying_kernel_are_observations(short_tmp: Path) -> None:
    (short_tmp / "src" / "repo").mkdir(parents=True)
    (short_tmp / "src" / "repo" / "m.py").write_text("VALUE = 7\n")
    replies = [call("ipython", code="x = 41\nx + 1"), call("ipython", code="1 / 0"),
               call("ipython", code="import os\nos._exit(1)"), call("ipython", code="print('x' in dir())"),
               call("ipython", code="import m\nm.VALUE"), call("bash", command="pwd"),
               call("str_replace_editor", command="view", path="m.py"), call("submit")]
    async with agent_context(short_tmp / "state", "kernel", replies, repo=short_tmp / "src", ipython=True) as ctx:
        # The repository sits in a sub-folder: the tools must work from there, not from the
        # folder the shell and the kernel were started in.
        ctx.workdir = f"{ctx.lease.sandbox.workspace_inside}/repo"
        outcome = await make_agent("codeact", {}).run(ctx)
        assert outcome.finish_reason == "completed"
        check_outcome(outcome, ctx, tool_schemas(ipython=True))
    contents = [c for _, c in tool_messages(outcome)]
    assert contents[0] == "Out: 42"
    assert "ZeroDivisionError" in contents[1]
    assert "kernel died" in contents[2] and "restarted" in contents[2]
    assert contents[3] == "False"
    assert contents[4] == "Out: 7"  # the restarted kernel was moved to the repository root again
    assert contents[5] == ctx.workdir
    assert "     1\tVALUE = 7" in contents[6]
    assert (outcome.tools["ipython"].count, outcome.tools["ipython"].errors) == (5, 2)


async def test_a_kernel_that_cannot_start_is_an_observation(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replies = [call("ipython", code="1 + 1"), call("bash", command="echo still-here"), call("submit")]
    async with agent_context(short_tmp, "no-start", replies, ipython=True) as ctx:
        monkeypatch.setattr(type(ctx.lease.sandbox), "python", property(lambda self: "/nonexistent/python3"))
        outcome = await make_agent("codeact", {}).run(ctx)
    assert outcome.finish_reason == "completed"
    first, second = [content for _, content in tool_messages(outcome)[:2]]
    assert "kernel exited during start-up" in first
    assert second.startswith("still-here")
    assert (outcome.tools["ipython"].count, outcome.tools["ipython"].errors) == (1, 1)


async def test_ipython_is_not_offered_without_a_kernel(short_tmp: Path) -> None:
    async with agent_context(short_tmp, "no-kernel", [call("ipython", code="1"), call("submit")]) as ctx:
        outcome = await make_agent("codeact", {}).run(ctx)
    assert "Unknown tool 'ipython'" in tool_messages(outcome)[0][1]
    assert '"ipython"' not in ctx.tokenizer.decode(outcome.prompt_ids.tolist())


async def test_a_lost_sandbox_propagates(short_tmp: Path) -> None:
    async with agent_context(short_tmp, "lost", [call("bash", command="ls"), call("submit")]) as ctx:
        ctx.lease.lost_reason = "its process limit was passed (test)"
        with pytest.raises(SandboxLost, match="process limit"):
            await make_agent("codeact", {}).run(ctx)


async def test_deadline_ends_the_trajectory_with_timeout(short_tmp: Path) -> None:
    replies = [call("bash", command="sleep 5"), call("submit")]
    async with agent_context(short_tmp, "deadline", replies) as ctx:
        ctx.deadline = time.monotonic() + 1.0
        outcome = await make_agent("codeact", {"command_timeout_s": 30}).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns) == ("timeout", 1)
        assert len(outcome.metrics["agent_cpu_s_per_turn"]) == 1
        # The command got only the time left (not its 30 s); the next turn then hit the deadline.
        assert re.fullmatch(r"\[the command timed out after [01]\.\d s and was interrupted\]", tool_messages(outcome)[0][1])
        check_outcome(outcome, ctx, tool_schemas(ipython=False))
    async with agent_context(short_tmp / "late", "late", replies, deadline=time.monotonic() - 1) as ctx:
        outcome = await make_agent("codeact", {}).run(ctx)
        assert (outcome.finish_reason, outcome.num_turns, len(outcome.response_ids)) == ("timeout", 0, 0)


async def test_an_aborted_turn_ends_the_trajectory_as_cancelled(short_tmp: Path) -> None:
    replies = ["Step one. " * 30 + call("submit")]
    async with agent_context(short_tmp, "aborted", replies, server_options={"ms_per_token": 20.0}) as ctx:
        assert ctx.server is not None
        engine = ctx.server.engine
        run = asyncio.create_task(make_agent("codeact", {}).run(ctx))
        # Abort part-way: the turn has generated some tokens and not all.
        await async_wait_until(lambda: engine.running == 1 and engine.steps >= 3, TURN_START_TIMEOUT_S,
                               "the turn generating")
        assert engine.abort(None) == 1
        outcome = await asyncio.wait_for(run, 10)
        assert (outcome.finish_reason, outcome.num_turns, outcome.turns[0].finish_reason) == ("cancelled", 1, "abort")
        assert 0 < outcome.response_mask.sum() < 100
        check_outcome(outcome, ctx, tool_schemas(ipython=False))


@pytest.mark.parametrize("check", ["every_turn", "final", "off"])
async def test_template_check_modes_give_the_same_tokens(check: str, short_tmp: Path) -> None:
    replies = [call("bash", command="printf 'é ✓\\t<tag>\\n'"), "No call here.", call("submit")]
    async with agent_context(short_tmp, "modes", replies) as ctx:
        outcome = await make_agent("codeact", {"template_check": check}).run(ctx)
        reference = await make_agent("codeact", {"template_check": "final"}).run(ctx)
    assert outcome.template_append_only and outcome.template_notes == []
    assert np.array_equal(outcome.response_ids, reference.response_ids)
    assert np.array_equal(outcome.response_mask, reference.response_mask)


@pytest.mark.parametrize("check", ["every_turn", "final"])
async def test_strip_think_template_is_flagged_end_to_end(check: str, short_tmp: Path) -> None:
    tokenizer = load_tokenizer()
    tokenizer.chat_template = STRIP_THINK_TEMPLATE_PATH.read_text()
    replies = ["<think>\nFirst look.\n</think>\n" + call("bash", command="ls"),
               "<think>\nNot sure what to do.\n</think>\nI wonder.", call("submit")]
    async with agent_context(short_tmp, "think", replies, tokenizer=tokenizer) as ctx:
        outcome = await make_agent("codeact", {"template_check": check}).run(ctx)
        assert outcome.finish_reason == "completed" and not outcome.template_append_only
        nudge_at = outcome.turns[1].end
        assert outcome.segments == [(0, nudge_at), (nudge_at, len(outcome.response_ids))]
        # The tokens are still exactly what the server produced, log-probabilities included.
        for turn, result in zip(outcome.turns, ctx.results):
            assert np.array_equal(outcome.response_ids[turn.start:turn.end], result.token_ids)
            assert np.array_equal(outcome.response_logprobs[turn.start:turn.end], result.logprobs)


class EchoAgent(Agent):
    """A custom agent: one model turn, one shell command, its own observation format."""

    name = "echo"

    async def run(self, ctx: AgentContext) -> AgentOutcome:
        base = [{"role": "user", "content": f"Task id: {ctx.instance_id}\nSay something."}]
        ledger = TokenLedger(ctx.tokenizer, base, max_total_tokens=4096, template_check="every_turn")
        text = ledger.add_turn(await ctx.generate(ledger.ids, max_tokens=256))
        result = await ctx.run(f"printf '%s' {shlex.quote(text)} | wc -c")
        ledger.add_message("user", f"You wrote {result.output.strip()} bytes in {ctx.workdir}.")
        ledger.add_turn(await ctx.generate(ledger.ids, max_tokens=256))
        return ledger.outcome(finish_reason="completed", submitted=True)


async def test_custom_agent_registered_by_name(short_tmp: Path) -> None:
    register_agent("echo", EchoAgent)
    register_agent("echo", EchoAgent)  # the same class again is fine
    assert "echo" in registered_agents()
    async with agent_context(short_tmp, "custom", ["Hello there.", "Thanks."]) as ctx:
        outcome = await make_agent("echo", {}).run(ctx)
    assert outcome.num_turns == 2 and outcome.template_append_only
    assert outcome.messages[1] == {"role": "assistant", "content": "Hello there."}
    assert outcome.messages[2]["content"] == f"You wrote 12 bytes in {ctx.workdir}."
    check_outcome(outcome, ctx, tools=None)


def test_registry_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match=r"unknown agent 'nope'; registered agents: \[.*'codeact'"):
        make_agent("nope", {})
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['max_turn'\] for agent 'codeact'"):
        make_agent("codeact", {"max_turn": 3})
    with pytest.raises(ConfigError, match="max_turns must be an integer >= 1"):
        make_agent("codeact", {"max_turns": 0})
    with pytest.raises(ConfigError, match="template_check must be one of"):
        make_agent("codeact", {"template_check": "sometimes"})
    with pytest.raises(ConfigError, match="already taken"):
        register_agent("codeact", EchoAgent)
    with pytest.raises(ConfigError, match="not a subclass"):
        register_agent("plain", dict)  # type: ignore[arg-type]
