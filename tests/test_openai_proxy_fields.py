"""The chat-completions request fields the OpenAI proxy honours, driven by the official ``openai``
SDK over the proxy's socket against the scripted reference policy: tool calls only when offered
(``tools``, ``tool_choice``, ``parallel_tool_calls``), ``stop``, ``max_tokens`` and
``max_completion_tokens``, ``response_format``, log-probabilities; and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
import openai
import pytest

from agent_support import call
from openai_proxy_inprocess import as_sent, conversation, proxy, turn
from openai_proxy_support import BASH_TOOL

PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
TWO_CALLS = "Both.\n" + "\n".join(
    f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': c}})}\n</tool_call>" for c in ("ls", "pwd"))
PLANS = {
    "plain": [call("bash", "Looks like a call.", command="ls"), "Second reply."],
    "calls": [call("bash", "One call.", command="ls")],
    "answer": ["Just an answer."],
    "two": [TWO_CALLS],
}


async def test_tool_calls_are_parsed_only_when_tools_are_offered(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p:
        for tools in ({"tools": None}, {"tools": [BASH_TOOL], "tool_choice": "none"}):
            messages = conversation("plain")
            first = await turn(p, messages, **tools)
            # The model's text as it wrote it: a plain-chat harness loses nothing.
            assert first.finish_reason == "stop" and not first.message.tool_calls
            assert first.message.content == PLANS["plain"][0]
            messages += [as_sent(first.message), {"role": "user", "content": "Go on."}]
            second = await turn(p, messages, **tools)
            assert second.message.content == "Second reply."
        outcome = p.session.outcome("completed")
    # Each plain conversation's echo extended its segment: two segments of two turns (the second
    # conversation is a new one), no rewrite inside either.
    assert [s["turns"] for s in outcome.metrics["history_segments"]] == [2, 2]
    assert outcome.metrics["ignored_request_fields"] == []


async def test_tool_choice_and_parallel_tool_calls_are_honoured_or_refused(short_tmp: Path) -> None:
    tools = [BASH_TOOL, PYTHON_TOOL]
    async with proxy(short_tmp, plans=PLANS) as p:
        ok = await turn(p, conversation("calls"), tools=tools, tool_choice="required")
        assert [c.function.name for c in ok.message.tool_calls] == ["bash"]
        named = {"type": "function", "function": {"name": "bash"}}
        assert (await turn(p, conversation("calls"), tools=tools, tool_choice=named)).finish_reason == "tool_calls"
        refused = {
            "required": ({"tool_choice": "required"}, "answer", "tool_choice"),
            "named other": ({"tool_choice": {"type": "function", "function": {"name": "python"}}}, "calls",
                            "tool_choice"),
            "not parallel": ({"parallel_tool_calls": False}, "two", "parallel_tool_calls"),
        }
        for what, (fields, task, param) in refused.items():
            before = len(p.results)
            with pytest.raises(openai.BadRequestError) as e:
                await turn(p, conversation(task), tools=tools, **fields)
            assert e.value.code == "reply_does_not_satisfy_request" and e.value.param == param, what
            assert len(p.results) == before + 1  # generated, then refused
        two = await turn(p, conversation("two"), tools=tools, parallel_tool_calls=True)
        assert len(two.message.tool_calls) == 2
        generated = len(p.results)
        # Refused before any generation: a choice the request itself makes impossible.
        for fields, param in (({"tool_choice": "required", "tools": None}, "tool_choice"),
                              ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                              ({"tool_choice": "sometimes"}, "tool_choice"),
                              ({"parallel_tool_calls": "yes"}, "parallel_tool_calls")):
            with pytest.raises(openai.BadRequestError) as e:
                await turn(p, conversation("calls"), **{"tools": tools, **fields})
            assert e.value.param == param, fields
        assert len(p.results) == generated
        outcome = p.session.outcome("completed")
    # A refused reply is not in the trajectory: the harness never saw it.
    assert outcome.num_turns == 3


async def test_a_refused_reply_is_sampled_again_in_the_same_segment(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans={"retry": ["No tool this time.", call("bash", command="ls")]}) as p:
        messages = conversation("retry")
        tools = [BASH_TOOL, PYTHON_TOOL]
        first = await turn(p, messages, tools=tools)
        messages += [as_sent(first.message), {"role": "user", "content": "Use the tool."}]
        # The scripted plan's second reply is the same prompt's next turn: a retry of the same
        # request continues the segment it refused.
        with pytest.raises(openai.BadRequestError):
            await turn(p, messages, tools=tools, tool_choice={"type": "function", "function": {"name": "python"}})
        again = await turn(p, messages, tools=tools, tool_choice="required")
        assert again.message.tool_calls[0].function.name == "bash"
        outcome = p.session.outcome("completed")
    assert len(outcome.metrics["history_segments"]) == 1 and outcome.num_turns == 2

