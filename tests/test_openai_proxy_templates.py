"""Harness loops through the OpenAI proxy on chat templates other than the reference one: a
Qwen2.5-style template that groups consecutive tool results into one user turn, and a template
that renders each tool result's ``name`` and ``tool_call_id``. Ten turns with one history
rewrite: every segment's ids are exactly the template's tokenization of the conversation the
harness sent, and every model turn's ids are the server's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent_support import call, reference_tokenizer
from openai_proxy_inprocess import as_sent, conversation, proxy, tool_result, turn
from openai_proxy_support import BASH_TOOL, check_segment_fidelity, template_messages
from rolloutd.client.history_segments import split_history_segments
from rolloutd.daemon.policy.tokenizer import load_tokenizer

REFERENCE_TOOL_BRANCH = ("{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
                         "'\\n</tool_response><|im_end|>\\n' }}")
TOOL_BRANCHES = {
    # Qwen2.5's own tool branch: consecutive results share one user turn.
    "qwen25_grouping": (
        "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
        "{%- endif %}{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"),
    # Mistral-style: the result names its tool and the call it answers.
    "tool_name_and_id": (
        "{{- '<|im_start|>user\\n<tool_response>\\n[' ~ message.name ~ ' ' ~ message.tool_call_id ~ '] ' + "
        "message.content + '\\n</tool_response><|im_end|>\\n' }}"),
}
PARALLEL_TURNS = {2, 5, 8}
"""Turns whose reply holds two tool calls (their results are consecutive tool messages)."""
TURNS = 10
REWRITE_AT = 6
"""The request before which the harness shortens an old tool result (its context manager)."""


def plan() -> list[str]:
    replies = []
    for k in range(1, TURNS):
        if k in PARALLEL_TURNS:
            replies.append(f"Step {k}, two at once.\n" + "\n".join(
                f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': f'echo {k}{c}'}})}\n</tool_call>"
                for c in "ab"))
        else:
            replies.append(call("bash", f"Step {k}.", command=f"echo {k}"))
    return [*replies, "Done: every step ran."]


def tokenizer_for(kind: str) -> Any:
    tok = load_tokenizer()
    template = str(reference_tokenizer().chat_template)
    assert REFERENCE_TOOL_BRANCH in template
    tok.chat_template = template.replace(REFERENCE_TOOL_BRANCH, TOOL_BRANCHES[kind])
    return tok


def segment_render(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The template's tokenization of a conversation ending in the model's turn, cut after its
    end-of-turn token (where a trajectory's ids end)."""
    text = tok.apply_chat_template(template_messages(messages), tools=[BASH_TOOL], tokenize=False)
    return list(tok.encode(text.removesuffix("\n"), add_special_tokens=False))


@pytest.mark.parametrize("kind", sorted(TOOL_BRANCHES))
async def test_harness_loop_keeps_every_turns_ids_exact(short_tmp: Path, kind: str) -> None:
    tok = tokenizer_for(kind)
    async with proxy(short_tmp, plans={"p-1": plan()}, tokenizer=tok) as p:
        messages = conversation()
        ends: list[list[dict[str, Any]]] = []
        """The harness's conversation after the last turn of each segment."""
        for k in range(1, TURNS + 1):
            if k == REWRITE_AT:
                last_reply = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
                ends.append(messages[:last_reply + 1])
                messages[3] = {**messages[3], "content": "[output elided]"}
            choice = await turn(p, messages)
            messages.append(as_sent(choice.message))
            if k < TURNS:
                assert choice.finish_reason == "tool_calls"
                messages += [tool_result(choice, f"output of step {k}{i}", i, name=True)
                             for i in range(len(choice.message.tool_calls))]
            else:
                assert choice.finish_reason == "stop" and choice.message.content == "Done: every step ran."
        ends.append(messages)
        outcome = p.session.outcome("completed")
    assert [(s["turns"], s["first_request"]) for s in outcome.metrics["history_segments"]] == [
        (REWRITE_AT - 1, 1), (TURNS - REWRITE_AT + 1, REWRITE_AT)]
    (rewrite,) = outcome.metrics["history_rewrites"]
    assert rewrite["request"] == REWRITE_AT and "message 3 (tool) differs" in rewrite["reason"]
    assert outcome.template_notes == [rewrite["reason"]]
    segments = split_history_segments(outcome)
    turns_seen = 0
    for segment, end in zip(segments, ends, strict=True):
        ids = np.concatenate([segment.prompt_ids, segment.response_ids]).tolist()
        assert ids == segment_render(tok, end)
        check_segment_fidelity(segment)
        for t in segment.turns:
            assert segment.response_ids[t.start:t.end].tolist() == p.results[turns_seen].token_ids.tolist()
            turns_seen += 1
    assert turns_seen == TURNS


async def test_a_template_that_cannot_be_extended_is_said_once_and_served(short_tmp: Path) -> None:
    tok = load_tokenizer()
    system = "{{- messages[0].content + '\\n\\n' }}"
    template = str(reference_tokenizer().chat_template)
    assert system in template
    # The system text counts the tool results: each new one re-renders the start.
    tok.chat_template = template.replace(system, "{{- messages[0].content + ' (' ~ (messages | selectattr('role', "
                                                 "'equalto', 'tool') | list | length) ~ ')\\n\\n' }}")
    async with proxy(short_tmp, plans={"p-1": plan()[:3]}, tokenizer=tok) as p:
        messages = conversation()
        for k in range(1, 4):
            choice = await turn(p, messages)
            messages += [as_sent(choice.message)]
            messages += [tool_result(choice, f"output {k}{i}", i) for i in range(len(choice.message.tool_calls))]
        outcome = p.session.outcome("completed")
    assert "re-render" in outcome.metrics["template_unextendable"]
    assert [s["reason"].endswith("template_unextendable says why)") for s in outcome.metrics["history_segments"]] == [
        False, True, True]
    assert sum("cannot append observations" in note for note in outcome.template_notes) == 1
    for segment, result in zip(split_history_segments(outcome), p.results, strict=True):
        assert segment.response_ids[segment.turns[0].start:].tolist() == result.token_ids.tolist()
