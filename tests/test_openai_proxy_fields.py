"""The chat-completions request fields the OpenAI proxy honours, driven by the official ``openai``
SDK over the proxy's socket against the scripted reference policy: tool calls only when offered
(``tools``, ``tool_choice``, ``parallel_tool_calls``), ``stop``, ``max_tokens`` and
``max_completion_tokens``, ``response_format``, log-probabilities; and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
import openai
import pytest

import numpy as np
import pydantic

from agent_support import call, reference_tokenizer
from openai_proxy_inprocess import MODEL, as_sent, conversation, proxy, turn
from openai_proxy_support import BASH_TOOL, decode
from rolloutd.daemon.policy.model import default_model

PYTHON_TOOL = {"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}
TWO_CALLS = "Both.\n" + "\n".join(
    f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': c}})}\n</tool_call>" for c in ("ls", "pwd"))
OBSERVING = "I will run it.\nObservation: an invented output\nThought: more."
UNICODE = "héllo ✓ 日本語"
PLANS = {
    "plain": [call("bash", "Looks like a call.", command="ls"), "Second reply."],
    "observing": [OBSERVING, "Thanks."],
    "counting": ["one two three four five six seven eight nine ten"],
    "json": ['{"answer": 42}', "not json at all", '{"answer": "forty-two"}', '[1, 2]'],
    "unicode": [UNICODE],
    "eos": ["Finished.<|endoftext|>", "Again."],
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



async def test_stop_cuts_the_ids_at_the_first_match(short_tmp: Path) -> None:
    eot = reference_tokenizer().convert_tokens_to_ids("<|im_end|>")
    stop = ["Thought:", "Observation:"]
    async with proxy(short_tmp, plans=PLANS) as p:
        messages = conversation("observing")
        first = await turn(p, messages, tools=None, stop=stop)
        assert first.finish_reason == "stop" and first.message.content == "I will run it.\n"
        echoed = {"role": "assistant", "content": "I will run it."}  # a harness that trims
        second = await turn(p, [*messages, echoed, {"role": "user", "content": "Go on."}], tools=None)
        assert second.message.content == "Thanks."
        # The same in a stream (another conversation: its own system message).
        other = [{"role": "system", "content": "Streaming."}, messages[1]]
        async with p.client.chat.completions.stream(model=MODEL, messages=other, stop="Observation:") as events:
            streamed = (await events.get_final_completion()).choices[0]
        assert streamed.finish_reason == "stop" and streamed.message.content == "I will run it.\n"
        outcome = p.session.outcome("completed")
    assert [s["turns"] for s in outcome.metrics["history_segments"]] == [2, 1]
    full = p.results[0].token_ids.tolist()
    cut = outcome.turns[0]
    kept = outcome.response_ids[cut.start:cut.end].tolist()
    # Cut right after the token that completes the first match; the rest was never the model's.
    assert kept == full[:len(kept)] and len(kept) < len(full) and cut.finish_reason == "stop"
    assert "Observation:" in decode(np.asarray(kept)) and "Observation:" not in decode(np.asarray(kept[:-1]))
    # The template's end of turn closes the cut turn (not the model's: mask 0), then the user.
    assert outcome.response_ids[cut.end] == eot and outcome.response_mask[cut.end] == 0
    assert not [n for n in outcome.template_notes if n.startswith("segment 0:")]


async def test_max_tokens_and_max_completion_tokens(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p:
        for fields, expected in (({"max_tokens": 3, "max_completion_tokens": None}, 3),
                                 ({"max_tokens": 5, "max_completion_tokens": 2}, 2)):
            choice = await turn(p, conversation("counting"), tools=None, **fields)
            assert choice.finish_reason == "length" and len(p.results[-1].token_ids) == expected
        for name in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(openai.BadRequestError) as e:
                await turn(p, conversation("counting"), **{name: 0})
            assert e.value.param == name


class Answer(pydantic.BaseModel):
    answer: int


async def test_response_format_is_validated_json_or_refused(short_tmp: Path) -> None:
    async with proxy(short_tmp, plans=PLANS) as p:
        messages = conversation("json")
        parsed = await p.client.chat.completions.parse(model=MODEL, messages=messages, response_format=Answer)
        assert parsed.choices[0].message.parsed == Answer(answer=42)
        messages += [as_sent(parsed.choices[0].message), {"role": "user", "content": "Again."}]
        # Turn 2 is not JSON, turn 3 does not match the schema, turn 4 is an array, not an object.
        for fmt in (Answer, Answer, {"type": "json_object"}):
            with pytest.raises(openai.BadRequestError) as e:
                if isinstance(fmt, dict):
                    await p.client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt)
                else:
                    await p.client.chat.completions.parse(model=MODEL, messages=messages, response_format=fmt)
            assert e.value.param == "response_format" and e.value.code == "reply_does_not_satisfy_request"
            # The refused reply is not the model's turn in the trajectory: the next request
            # samples the same turn again, so move the script on with a user message.
            messages += [{"role": "user", "content": "Once more."}]
        generated = len(p.results)
        for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}):
            with pytest.raises(openai.BadRequestError) as e:
                await p.client.chat.completions.create(model=MODEL, messages=messages, response_format=bad)
            assert e.value.param == "response_format"
        assert len(p.results) == generated


async def test_logprobs_carry_each_tokens_true_bytes_and_top_k_in_streams_too(short_tmp: Path) -> None:
    tok = reference_tokenizer()
    async with proxy(short_tmp, plans=PLANS) as p:
        reply = await p.client.chat.completions.create(model=MODEL, messages=conversation("unicode"), logprobs=True,
                                                       top_logprobs=3)
        content = reply.choices[0].logprobs.content
        prompt = p.session.history.segments[0].ledger.prompt_ids.tolist()
        other = [{"role": "system", "content": "Streaming."}, conversation("unicode")[1]]
        async with p.client.chat.completions.stream(model=MODEL, messages=other, logprobs=True,
                                                    top_logprobs=3) as events:
            streamed = (await events.get_final_completion()).choices[0].logprobs.content
        # A backend that reports no top log-probabilities: refused, never an empty list.
        generate = p.session._generate
        p.session._generate = lambda ids, n, k: generate(ids, n, 0)
        with pytest.raises(openai.BadRequestError) as e:
            await p.client.chat.completions.create(model=MODEL, messages=other, logprobs=True, top_logprobs=2)
        assert e.value.param == "top_logprobs"
    assert reply.choices[0].message.content == UNICODE
    result = p.results[0]
    assert result.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # Every token of the text, and not the end of turn; bytes joined are the text's bytes, with
    # characters split across tokens (their pieces alone are not UTF-8).
    assert len(content) == len(result.token_ids) - 1
    assert b"".join(bytes(c.bytes) for c in content) == UNICODE.encode()
    assert any(c.token == "\ufffd" for c in content) and all(c.bytes != list("\ufffd".encode()) for c in content)
    assert np.allclose([c.logprob for c in content], result.logprobs[:-1], atol=1e-6)
    assert [c.bytes for c in streamed] == [c.bytes for c in content]
    # The top 3 at each position are the model's own: recomputed from its whole distribution.
    model = default_model()
    full = [*prompt, *result.token_ids.tolist()]
    expected = model.next_logprobs(model.contexts(full)[len(prompt):len(full) - 1])
    for c, row in zip(content, expected, strict=True):
        best = np.argsort(-row, kind="stable")[:3]
        assert [t.token for t in c.top_logprobs] == [tok.decode([int(i)]) for i in best]
        assert np.allclose([t.logprob for t in c.top_logprobs], row[best], atol=1e-5)
    second = p.results[1]
    assert second.top_logprobs is not None
    assert np.allclose([[t.logprob for t in c.top_logprobs] for c in streamed], second.top_logprobs[:-1], atol=1e-6)


async def test_a_turn_ending_at_another_stop_token_does_not_return_it(short_tmp: Path) -> None:
    tok = reference_tokenizer()
    eos, eot = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    async with proxy(short_tmp, plans=PLANS) as p:
        messages = conversation("eos")
        first = await turn(p, messages, tools=None, logprobs=True)
        assert first.finish_reason == "stop" and first.message.content == "Finished."
        assert "".join(c.token for c in first.logprobs.content) == "Finished."
        messages += [as_sent(first.message), {"role": "user", "content": "Go on."}]
        assert (await turn(p, messages, tools=None)).message.content == "Again."
        outcome = p.session.outcome("completed")
    assert p.results[0].token_ids[-1] == eos
    end = outcome.turns[0].end
    # The model's own stop token stays in the ids (mask 1); the template closes the turn after it.
    assert outcome.response_ids[end - 1] == eos and outcome.response_ids[end] == eot
    assert outcome.response_mask[end - 1] == 1 and outcome.response_mask[end] == 0
    assert len(outcome.metrics["history_segments"]) == 1 and outcome.template_append_only
