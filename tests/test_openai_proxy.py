"""The OpenAI proxy's protocol and token bookkeeping, driven by the official ``openai`` SDK in the
test process over the proxy's Unix socket, against the scripted reference policy: auth, models,
which re-sent histories extend a conversation and which are rewrites, interleaved conversations,
retries, limits, refused requests, log-probabilities."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai
import pytest

from agent_support import reference_tokenizer
from openai_proxy_inprocess import KEY, MODEL, PLANS, as_sent, conversation, httpx, proxy, tool_result, turn
from openai_proxy_support import BASH_TOOL, check_segment_fidelity, decode
from rolloutd.client.history_segments import split_history_segments

async def test_openai_proxy_auth_and_models(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        assert [m.id for m in (await p.client.models.list()).data] == [MODEL]
        assert (await p.client.models.retrieve(MODEL)).owned_by == "rolloutd"
        # Chat serves any model name, so every name is a model.
        assert (await p.client.models.retrieve("gpt-4o")).id == "gpt-4o"
        for wrong in ("not-the-key", KEY + "x"):
            intruder = p.client.with_options(api_key=wrong)
            with pytest.raises(openai.AuthenticationError) as e:
                await intruder.chat.completions.create(model=MODEL, messages=conversation())
            assert e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                await intruder.models.list()
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(short_tmp / "api.sock"))) as raw:
            assert (await raw.get("http://localhost/v1/models")).status_code == 401
        # Refused callers never reached the model.
        assert p.results == [] and p.session.history.requests == 0


async def test_openai_proxy_echoed_replies_extend_the_conversation(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        messages = conversation()
        first = await turn(p, messages)
        assert first.finish_reason == "tool_calls" and first.message.content == "I will list the files."
        (tool_call,) = first.message.tool_calls
        assert tool_call.function.name == "bash" and json.loads(tool_call.function.arguments) == {"command": "ls"}
        # A harness that trims the reply, re-serialises the arguments and renames the call id.
        echoed = as_sent(first.message)
        echoed["content"] = "  I will list the files.\n"
        echoed["tool_calls"][0]["id"] = "call_renamed"
        echoed["tool_calls"][0]["function"]["arguments"] = json.dumps({"command": "ls"}, separators=(",", ":"))
        messages += [echoed, {"role": "tool", "tool_call_id": "call_renamed", "content": "notes"}]
        second = await turn(p, messages)
        messages += [as_sent(second.message), tool_result(second, "the answer")]
        third = await turn(p, messages)
        assert third.finish_reason == "stop" and third.message.content == "Done." and not third.message.tool_calls
        outcome = p.session.outcome("completed")
    assert not outcome.metrics["history_rewritten"] and outcome.template_append_only
    assert outcome.num_turns == 3 and len(outcome.metrics["history_segments"]) == 1
    (only,) = split_history_segments(outcome)
    check_segment_fidelity(only)
    for t, r in zip(outcome.turns, p.results):
        assert np.array_equal(outcome.response_ids[t.start:t.end], r.token_ids)
    # The model saw its own words, not the harness's trimmed echo.
    assert "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}}" in decode(outcome.response_ids)


REWRITES = {
    "edited_tool_result": ("message 3 (tool) differs from the one sent before", 3),
    "edited_reply": ("message 2 differs from the model's reply", 2),
    "dropped_messages": ("drops messages 2..", 2),
    "other_tools": ("tools differ", 4),
    "injected_assistant": ("message 6 is an assistant message the model did not write", 5),
}


@pytest.mark.parametrize("kind", sorted(REWRITES))
async def test_openai_proxy_rewrites_start_a_new_segment(short_tmp: Path, kind: str) -> None:
    async with proxy(short_tmp) as p:
        messages = conversation()
        first = await turn(p, messages)
        messages += [as_sent(first.message), tool_result(first, "notes")]
        second = await turn(p, messages)
        tools = [BASH_TOOL]
        if kind == "edited_tool_result":
            messages[3] = {**messages[3], "content": "something else"}
        elif kind == "edited_reply":
            messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"command": "ls -la"})
        elif kind == "dropped_messages":
            messages = messages[:2]
        elif kind == "other_tools":
            tools = [BASH_TOOL, {"type": "function", "function": {"name": "python", "parameters": {}}}]
        else:
            messages += [as_sent(second.message), tool_result(second, "the answer"),
                         {"role": "assistant", "content": "I wrote this for the model."},
                         {"role": "user", "content": "Go on."}]
        await p.client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
        outcome = p.session.outcome("completed")
    reason, shared = REWRITES[kind]
    (rewrite,) = outcome.metrics["history_rewrites"]
    assert reason in rewrite["reason"] and rewrite["shared_messages"] == shared and rewrite["request"] == 3
    assert not outcome.template_append_only and len(outcome.segments) == 2
    first, second = split_history_segments(outcome)
    assert len(first.turns) == 2 and len(second.turns) == 1
    for segment in (first, second):
        check_segment_fidelity(segment)
    # The new segment's prompt is a fresh render of the request, never the old tokens spliced.
    rendered = reference_tokenizer().apply_chat_template(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                              for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages],
        tools=tools, tokenize=False, add_generation_prompt=True)
    assert decode(second.prompt_ids) == rendered
    assert np.array_equal(first.response_ids[first.turns[0].start:first.turns[0].end], p.results[0].token_ids)


async def test_openai_proxy_interleaved_conversations_keep_their_own_histories(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        a, b = conversation("p-1"), conversation("p-2")
        a1 = await turn(p, a)
        b1 = await turn(p, b)
        a += [as_sent(a1.message), tool_result(a1, "notes")]
        b += [as_sent(b1.message), {"role": "user", "content": "Continue."}]
        a2 = await turn(p, a)
        b2 = await turn(p, b)
        assert (b1.message.content, b2.message.content) == tuple(PLANS["p-2"])
        assert a2.message.content == "And the notes."
        outcome = p.session.outcome("completed")
    # Two segments, each extended by its own requests; the second began as a conversation that
    # does not extend the first.
    info = outcome.metrics["history_segments"]
    assert [(s["index"], s["turns"], s["first_request"]) for s in info] == [(0, 2, 1), (1, 2, 2)]
    assert "message 1 (user) differs" in outcome.metrics["history_rewrites"][0]["reason"]
    seg_a, seg_b = split_history_segments(outcome)
    for segment in (seg_a, seg_b):
        check_segment_fidelity(segment)
    assert "Task id: p-2" in decode(seg_b.prompt_ids) and "Task id: p-2" not in decode(seg_a.response_ids)
    assert [(t.end - t.start) for t in seg_a.turns] == [len(p.results[0].token_ids), len(p.results[2].token_ids)]


async def test_openai_proxy_retry_after_an_inference_failure(short_tmp: Path) -> None:
    async with proxy(short_tmp, max_retries=2) as p:
        p.fail_next = 1
        first = await turn(p, conversation())  # 502 first, the SDK retries the same request
        assert first.message.content == "I will list the files."
        p.fail_next = 3
        with pytest.raises(openai.InternalServerError) as e:
            await turn(p, conversation() + [as_sent(first.message), tool_result(first, "x")])
        assert e.value.status_code == 502
        outcome = p.session.outcome("completed")
    assert outcome.num_turns == 1 and not outcome.metrics["history_rewritten"]


async def test_openai_proxy_turn_and_context_limits_end_the_trajectory(short_tmp: Path) -> None:
    async with proxy(short_tmp, max_requests=1) as p:
        first = await turn(p, conversation())
        for _ in range(2):  # refused for good: the trajectory has ended
            with pytest.raises(openai.BadRequestError) as e:
                await turn(p, conversation() + [as_sent(first.message), tool_result(first, "x")])
            assert e.value.code == "rolloutd_trajectory_ended"
        assert p.session.stop_reason == "max_turns" and p.session.ended.is_set()
        assert p.session.outcome("max_turns").num_turns == 1
    tok = reference_tokenizer()
    prompt_len = len(tok.encode(tok.apply_chat_template(conversation(), tools=[BASH_TOOL], tokenize=False,
                                                        add_generation_prompt=True), add_special_tokens=False))
    async with proxy(short_tmp, max_context_tokens=prompt_len + 4, max_tokens_per_turn=4) as p:
        cut = await turn(p, conversation())
        assert cut.finish_reason == "length" and len(p.results[0].token_ids) == 4
        assert p.session.stop_reason == "max_tokens"
        with pytest.raises(openai.BadRequestError):
            await turn(p, conversation() + [as_sent(cut.message), {"role": "user", "content": "more"}])
    async with proxy(short_tmp, max_context_tokens=prompt_len) as p:
        with pytest.raises(openai.BadRequestError) as e:
            await turn(p, conversation())
        assert e.value.code == "context_length_exceeded" and p.session.stop_reason == "max_tokens"
        assert p.results == []


BAD = {
    "n": {"n": 2},
    "image": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "prefill": {"messages": conversation() + [{"role": "assistant", "content": "Sure"}]},
    "functions": {"functions": [{"name": "f"}]},
    "no_messages": {"messages": []},
}


async def test_openai_proxy_refuses_what_it_cannot_serve(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        for name, fields in BAD.items():
            body = {"model": MODEL, "messages": conversation(), **fields}
            with pytest.raises(openai.BadRequestError):
                await p.client.chat.completions.create(**body)
            with pytest.raises(openai.BadRequestError):  # before any event of a stream
                await p.client.chat.completions.create(stream=True, **body)
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(short_tmp / "api.sock"))) as raw:
            bad_json = await raw.post("http://localhost/v1/chat/completions", content=b"{not json",
                                      headers={"Authorization": f"Bearer {KEY}"})
        assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
        assert p.results == [] and p.session.history.segments == []
        # Sampling fields cannot be applied (the trainer's sampling rules): refused, naming the field.
        with pytest.raises(openai.BadRequestError) as e:
            await turn(p, conversation(), temperature=0.1, top_p=0.5)
        assert e.value.param == "temperature" and e.value.code == "unsupported_parameter"
        assert p.results == []
        # Fields that ask nothing of the reply are accepted.
        await turn(p, conversation(), user="me", metadata={"run": "1"}, store=False)
        # Accepted and reported where the agent's unapplied_fields setting allows it.
        p.session.unapplied_fields = "report"
        await turn(p, conversation(), temperature=0.1, top_p=0.5, user="me")
        assert p.session.outcome("completed").metrics["ignored_request_fields"] == ["temperature", "top_p"]


async def test_openai_proxy_logprobs_and_usage(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        reply = await p.client.chat.completions.create(model=MODEL, messages=conversation(), tools=[BASH_TOOL],
                                                      logprobs=True)
        (result,) = p.results
        content = reply.choices[0].logprobs.content
        # The reply's tokens: the end-of-turn token that closed it is not content.
        assert result.token_ids[-1] == reference_tokenizer().convert_tokens_to_ids("<|im_end|>")
        assert "".join(c.token for c in content) == decode(result.token_ids[:-1])
        assert np.allclose([c.logprob for c in content], result.logprobs[:-1], atol=1e-6)
        ledger = p.session.history.segments[0].ledger
        assert reply.usage.prompt_tokens == len(ledger.prompt_ids)
        assert reply.usage.completion_tokens == len(result.token_ids)
        assert reply.system_fingerprint == f"rolloutd-{result.weight_version}"
