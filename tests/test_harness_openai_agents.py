"""The OpenAI Agents SDK (``openai-agents``) runs a tool-using agent through the proxy: its own
Runner and agent loop, over the Responses API (its default, plain and streamed) and over chat
completions, on real HTTP (the proxy's Unix socket) against the scripted reference policy. The
agent calls its function tool, gets the tool's result back and answers from it; the proxy keeps
the run as one token history (no rewrite), each turn's ids the model's own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

from agent_support import call
from openai_proxy_inprocess import MODEL, proxy
from openai_proxy_support import check_segment_fidelity, decode
from rolloutd.client.history_segments import split_history_segments

SECRET = "the vault code is 4711"
PLANS = {"vault": [call("read_note", "I will read the note.", note="vault"), "The code is 4711."]}
INSTRUCTIONS = "You answer questions from notes."
notes_read: list[str] = []


@function_tool
def read_note(note: str) -> str:
    """Read a note by its name."""
    notes_read.append(note)
    return SECRET


@pytest.mark.parametrize("api,streamed", [("responses", False), ("responses", True), ("chat_completions", False)])
async def test_openai_agents_sdk_runs_a_tool_using_agent(short_tmp: Path, api: str, streamed: bool) -> None:
    notes_read.clear()
    async with proxy(short_tmp, plans=PLANS) as p:
        provider = OpenAIProvider(openai_client=p.client, use_responses=api == "responses")
        agent = Agent(name="reader", instructions=INSTRUCTIONS, tools=[read_note], model=MODEL)
        config = RunConfig(model_provider=provider, tracing_disabled=True)
        task = "Task id: vault\nWhat is the vault code?"
        if streamed:
            run = Runner.run_streamed(agent, task, run_config=config, max_turns=4)
            kinds = [event.type async for event in run.stream_events()]
            assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
            result = run
        else:
            result = await Runner.run(agent, task, run_config=config, max_turns=4)
        assert result.final_output == "The code is 4711."
        assert notes_read == ["vault"]  # the SDK ran the tool the model called, with its arguments
        outcome = p.session.outcome("completed")
    assert outcome.metrics["streamed_requests"] == (2 if streamed else 0)
    assert not outcome.metrics["history_rewritten"], outcome.metrics["history_rewrites"]
    assert outcome.num_turns == 2 and len(outcome.metrics["history_segments"]) == 1
    assert outcome.metrics["tool_calls"] == {"read_note": 1}
    for t, r in zip(outcome.turns, p.results):
        assert np.array_equal(outcome.response_ids[t.start:t.end], r.token_ids)
    (only,) = split_history_segments(outcome)
    check_segment_fidelity(only)
    text = decode(np.concatenate([outcome.prompt_ids, outcome.response_ids]))
    # What the model saw: the SDK's instructions and tool schema, the tool's result as a tool turn.
    assert text.startswith(f"<|im_start|>system\n{INSTRUCTIONS}")
    assert json.dumps(read_note.params_json_schema)[:40] in text
    assert f"<|im_start|>user\n<tool_response>\n{SECRET}\n</tool_response>" in text
    assert text.endswith("The code is 4711.<|im_end|>")
