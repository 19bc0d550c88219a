"""The proxy's other wire APIs, driven by the official SDKs over the proxy's Unix socket (real
HTTP) against the scripted reference policy: Anthropic's Messages API (the ``anthropic`` SDK:
tool use, streaming, stop sequences, errors) and OpenAI's Responses API (the ``openai`` SDK's
Responses client: function tools, streaming, errors). Each conversation lands in the same token
history as chat completions: one segment when the harness sends back what it got, its ids the
model's own, its text a fresh render of the conversation."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_support import call
from openai_proxy_inprocess import KEY, MODEL, Proxy, httpx, proxy
from openai_proxy_support import BASH_TOOL, check_segment_fidelity, decode, render_as_harness_sees_it
from rolloutd.client.history_segments import split_history_segments
from test_openai_proxy_errors import JSON

SYSTEM = "You are a test agent."
PLANS = {
    "tools": [call("bash", "I will list the files.", command="ls"), "Done: the folder holds two files."],
    "stop": ["First part. HALT and more words", "Second."],
    "bare": [call("bash", "", command="pwd"), "In /work."],
}
ANTHROPIC_BASH = {"name": "bash", "description": BASH_TOOL["function"]["description"],
                  "input_schema": BASH_TOOL["function"]["parameters"]}
RESPONSES_BASH = {"type": "function", "name": "bash", "description": BASH_TOOL["function"]["description"],
                  "parameters": BASH_TOOL["function"]["parameters"]}


@contextlib.asynccontextmanager
async def anthropic_client(p: Proxy, key: str = KEY) -> AsyncIterator[anthropic.AsyncAnthropic]:
    transport = httpx.AsyncHTTPTransport(uds=str(p.socket))
    client = anthropic.AsyncAnthropic(api_key=key, base_url="http://localhost", max_retries=0,
                                      http_client=anthropic.DefaultAsyncHttpxClient(transport=transport))
    try:
        yield client
    finally:
        await client.close()


def check_token_exact(p: Proxy, chat_messages: list[dict[str, Any]]) -> None:
    """One segment, no rewrite; each turn's ids are the server's; the whole trajectory decodes to
    a fresh render of ``chat_messages`` (the conversation in chat form) with the bash tool."""
    outcome = p.session.outcome("completed")
    assert not outcome.metrics["history_rewritten"], outcome.metrics["history_rewrites"]
    assert len(outcome.metrics["history_segments"]) == 1 and outcome.num_turns == len(p.results)
    for t, r in zip(outcome.turns, p.results):
        assert np.array_equal(outcome.response_ids[t.start:t.end], r.token_ids)
    whole = decode(np.concatenate([outcome.prompt_ids, outcome.response_ids]))
    assert whole == render_as_harness_sees_it(chat_messages, [BASH_TOOL], ends_with_eot=True)
    (only,) = split_history_segments(outcome)
    check_segment_fidelity(only)


async def test_anthropic_messages_tool_use_then_streamed_answer(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p, anthropic_client(p) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Task id: tools\nLook around."}]
        first = await client.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[ANTHROPIC_BASH],
                                             max_tokens=256)
        assert first.stop_reason == "tool_use" and first.type == "message" and first.role == "assistant"
        text, use = first.content
        assert text.type == "text" and text.text == "I will list the files."
        assert use.type == "tool_use" and use.name == "bash" and use.input == {"command": "ls"}
        assert first.usage.output_tokens == len(p.results[0].token_ids)
        # The harness sends the reply back as it got it, and the tool's result in a user message.
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": "a.txt b.txt"}]}]}]
        async with client.messages.stream(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=messages,
                                          tools=[ANTHROPIC_BASH], max_tokens=256) as stream:
            deltas = [e.delta.text async for e in stream if e.type == "content_block_delta"]
            final = await stream.get_final_message()
        assert "".join(deltas) == "Done: the folder holds two files." and len(deltas) > 1
        assert final.stop_reason == "end_turn"
        assert [b.text for b in final.content] == ["Done: the folder holds two files."]
        assert final.usage.output_tokens == len(p.results[1].token_ids)
        assert p.session.streamed == 1
        check_token_exact(p, [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": messages[0]["content"]},
            {"role": "assistant", "content": "I will list the files.",
             "tool_calls": [{"id": use.id, "type": "function",
                             "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "a.txt b.txt"},
            {"role": "assistant", "content": "Done: the folder holds two files."}])


async def test_anthropic_streamed_tool_use_stop_sequences_and_errors(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p, anthropic_client(p) as client:
        async with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Task id: bare\nGo."}],
                                          tools=[ANTHROPIC_BASH], max_tokens=256) as stream:
            final = await stream.get_final_message()
        # A reply of only a call: one tool_use block, its input rebuilt from the partial JSON.
        assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
        assert final.content[0].input == {"command": "pwd"}
        stopped = await client.messages.create(model=MODEL, max_tokens=64, stop_sequences=["HALT"],
                                               messages=[{"role": "user", "content": "Task id: stop\nGo."}])
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "HALT"
        assert stopped.content[0].text == "First part. "
        generated = len(p.results)
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=64, extra_body={"top_k": 5},
                                         messages=[{"role": "user", "content": "Task id: stop\nGo."}])
        assert e.value.body["error"]["type"] == "invalid_request_error" and "top_k" in e.value.message
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
        assert "messages[0].content[0] is a 'image' block" in e.value.message
        async with anthropic_client(p, key="not-the-key") as intruder:
            with pytest.raises(anthropic.AuthenticationError) as e:
                await intruder.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        # Refused requests never reached the model.
        assert len(p.results) == generated


async def test_responses_function_tools_then_streamed_answer(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p:
        items: list[dict[str, Any]] = [{"role": "user", "content": "Task id: tools\nLook around."}]
        first = await p.client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=[RESPONSES_BASH],
                                                max_output_tokens=256, store=False)
        assert first.status == "completed" and first.output_text == "I will list the files."
        message, fc = first.output
        assert message.type == "message" and fc.type == "function_call"
        assert fc.name == "bash" and json.loads(fc.arguments) == {"command": "ls"}
        assert first.usage.output_tokens == len(p.results[0].token_ids)
        # The harness sends back the output items and the function's output.
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "a.txt b.txt"})
        deltas, final = [], None
        async with p.client.responses.stream(model=MODEL, instructions=SYSTEM, input=items,
                                             tools=[RESPONSES_BASH]) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            final = await stream.get_final_response()
        assert "".join(deltas) == "Done: the folder holds two files." and len(deltas) > 1
        assert final.status == "completed" and final.output_text == "Done: the folder holds two files."
        check_token_exact(p, [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": items[0]["content"]},
            {"role": "assistant", "content": "I will list the files.",
             "tool_calls": [{"id": fc.call_id, "type": "function",
                             "function": {"name": "bash", "arguments": fc.arguments}}]},
            {"role": "tool", "tool_call_id": fc.call_id, "content": "a.txt b.txt"},
            {"role": "assistant", "content": "Done: the folder holds two files."}])


async def test_responses_streamed_call_and_refusals(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p:
        calls = []
        async with p.client.responses.stream(model=MODEL, input="Task id: bare\nGo.", tools=[RESPONSES_BASH]) as s:
            async for event in s:
                if event.type == "response.function_call_arguments.done":
                    calls.append(json.loads(event.arguments))
            final = await s.get_final_response()
        assert calls == [{"command": "pwd"}] and [i.type for i in final.output] == ["function_call"]
        generated = len(p.results)
        refused = {
            "previous_response_id": {"previous_response_id": final.id},
            "tools[0]": {"tools": [{"type": "web_search"}]},
            "temperature": {"temperature": 0.5},
        }
        for param, fields in refused.items():
            with pytest.raises(openai.BadRequestError) as e:
                await p.client.responses.create(model=MODEL, input="Task id: bare\nGo.", **fields)
            assert e.value.param == param, (param, e.value.message)
        assert len(p.results) == generated


async def test_rewritten_histories_are_flagged_on_both_apis(short_tmp: Path) -> None:
    """A harness that edits the model's reply before sending it back: a new segment from a fresh
    render, each segment still the model's exact ids, and the proxy says where it parted."""
    async with proxy(short_tmp, plans=PLANS) as p, anthropic_client(p) as client:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Task id: tools\nLook around."}]
        first = await client.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[ANTHROPIC_BASH],
                                             max_tokens=256)
        edited = [b.model_dump(exclude_none=True) for b in first.content]
        edited[0]["text"] = "I rewrote this reply."
        messages += [{"role": "assistant", "content": edited},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id,
                                                   "content": "a.txt"}]}]
        await client.messages.create(model=MODEL, system=SYSTEM, messages=messages, tools=[ANTHROPIC_BASH],
                                     max_tokens=256)
        items: list[Any] = [{"role": "user", "content": "Task id: tools\nLook around."}]
        reply = await p.client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=[RESPONSES_BASH])
        # The function call sent back without the text the model wrote before it.
        items += [i.model_dump(exclude_none=True) for i in reply.output if i.type == "function_call"]
        items.append({"type": "function_call_output", "call_id": reply.output[1].call_id, "output": "a.txt"})
        await p.client.responses.create(model=MODEL, instructions=SYSTEM, input=items, tools=[RESPONSES_BASH])
        outcome = p.session.outcome("completed")
    assert [r["reason"].split(": ", 1)[1] for r in outcome.metrics["history_rewrites"]] == [
        "message 2 differs from the model's reply there (content or tool calls edited)",
        "the request drops messages 2.. (history cut, or a reply asked for again)",  # the same task asked anew
        "message 2 differs from the model's reply there (content or tool calls edited)"]
    segments = split_history_segments(outcome)
    assert len(segments) == 4
    for segment in segments:
        check_segment_fidelity(segment)
    for t, r in zip(outcome.turns, p.results):
        assert np.array_equal(outcome.response_ids[t.start:t.end], r.token_ids)


BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image"]) | JSON}, optional={
    "text": st.text(max_size=8) | JSON, "id": JSON, "name": st.just("bash") | JSON, "input": JSON,
    "tool_use_id": st.text(max_size=4) | JSON, "content": st.text(max_size=8) | JSON})
ANTHROPIC_BODY = st.fixed_dictionaries({
    "model": st.just(MODEL), "max_tokens": st.integers(-1, 4) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | JSON,
                                                "content": st.text(max_size=8) | st.lists(BLOCK, max_size=3)}),
                         min_size=1, max_size=3) | JSON}, optional={
    "system": st.text(max_size=8) | JSON, "tools": st.just([ANTHROPIC_BASH]) | JSON, "tool_choice": JSON,
    "stop_sequences": JSON, "stream": st.booleans(), "metadata": JSON, "temperature": JSON})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | JSON,
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON,
    "content": st.text(max_size=8) | JSON, "call_id": st.text(max_size=4) | JSON, "name": st.just("bash") | JSON,
    "arguments": st.just('{"command": "ls"}') | JSON, "output": st.text(max_size=8) | JSON})
RESPONSES_BODY = st.fixed_dictionaries({
    "model": st.just(MODEL), "input": st.text(max_size=8) | st.lists(ITEM, min_size=1, max_size=4) | JSON}, optional={
    "instructions": st.text(max_size=8) | JSON, "tools": st.just([RESPONSES_BASH]) | JSON, "tool_choice": JSON,
    "max_output_tokens": JSON, "text": JSON, "stream": st.booleans(), "previous_response_id": JSON,
    "include": JSON, "truncation": JSON, "store": JSON})


@pytest.mark.parametrize("route,body,headers", [
    ("/v1/messages", ANTHROPIC_BODY, {"x-api-key": KEY}),
    ("/v1/responses", RESPONSES_BODY, {"Authorization": f"Bearer {KEY}"})])
async def test_fuzzed_bodies_are_never_a_server_error(short_tmp: Path, route: str, body: Any,
                                                      headers: dict[str, str]) -> None:
    seen: dict[int, int] = {}
    async with proxy(short_tmp, max_requests=100_000, max_tokens_per_turn=2) as p:
        def fuzz() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(p.socket)), base_url="http://localhost",
                              headers=headers, timeout=60) as raw:
                @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
                @given(body)
                def one(sent: dict[str, Any]) -> None:
                    answer = raw.post(route, content=json.dumps(sent).encode())
                    seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
                    assert answer.status_code in (200, 400), (answer.status_code, answer.text[:500])
                    if answer.status_code == 400:
                        error = answer.json()["error"]
                        assert isinstance(error["message"], str) and error["message"]
                    p.session.stop_reason = None  # a context or turn limit would refuse every later body

                one()

        await asyncio.to_thread(fuzz)
    assert seen.get(400, 0) > 30 and seen.get(200, 0) > 0, seen
