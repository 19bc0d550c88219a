"""The OpenAI proxy with the official ``openai`` SDK running inside a real sandbox as the agent
(the ``blackbox`` agent runs tests/openai_harness/harness.py): multi-turn tool calls, streaming,
the Unix-socket transport, a history rewrite that must be flagged, token fidelity against the
reference model, and how a harness's end (time limit, failure, turn limit) ends the trajectory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent_support import EOT, check_outcome, mask_runs, reference_tokenizer
from openai_proxy_support import (
    BASH_TOOL,
    TOOLS_PLAN,
    check_segment_fidelity,
    decode,
    harness_command,
    harness_env,
    harness_output,
    proxy_context,
    render_as_harness_sees_it,
    template_messages,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.daemon.agents.base import AgentOutcome, make_agent
from rolloutd.native_io.errors import AgentError

BACKENDS = ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)]
NOTES = {"notes.txt": "the answer is 42\n"}


def blackbox(backend: str, *flags: str, **config: Any) -> Any:
    return make_agent("blackbox", {"command": harness_command(backend, *flags), "env": harness_env(backend),
                                   **config})


def check_tools_run(outcome: AgentOutcome, seen: dict[str, Any], ctx: Any) -> None:
    """What the harness saw and what the trajectory holds agree, token for token."""
    assert outcome.finish_reason == "completed", outcome.metrics.get("harness_output_tail")
    assert seen["finish_reasons"] == ["tool_calls", "tool_calls", "stop"]
    assert seen["models"] == ["rolloutd-policy"] and seen["wrong_key"] == "AuthenticationError 401"
    ls, notes, echo = seen["tool_outputs"]
    assert "notes.txt" in ls.split() and notes == "the answer is 42" and echo == "checked"
    replies = [m for m in seen["messages"] if m["role"] == "assistant"]
    assert [len(m.get("tool_calls", [])) for m in replies] == [1, 2, 0]
    assert replies[0]["content"] == "I will list the files."
    assert replies[2]["content"] == TOOLS_PLAN[2]
    assert outcome.num_turns == 3 and outcome.segments == [(0, len(outcome.response_ids))]
    assert outcome.template_append_only and not outcome.metrics["history_rewritten"]
    assert outcome.metrics["tool_calls"] == {"bash": 3} and outcome.metrics["harness_exit_code"] == 0
    check_outcome(outcome, ctx, [BASH_TOOL])
    # The tokens are exactly a fresh render of the conversation the harness ended with.
    full = np.concatenate([outcome.prompt_ids, outcome.response_ids])
    assert decode(full) == render_as_harness_sees_it(seen["messages"], [BASH_TOOL], ends_with_eot=True)
    assert "Task id: oa-tools" in decode(outcome.prompt_ids)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_openai_proxy_sdk_tool_calls_over_loopback_url(short_tmp: Path, backend: str) -> None:
    async with proxy_context(backend, short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES) as ctx:
        outcome = await blackbox(backend).run(ctx)
        seen = harness_output(ctx)
    check_tools_run(outcome, seen, ctx)
    assert [u["completion_tokens"] for u in seen["usage"]] == [len(r.token_ids) for r in ctx.results]
    assert outcome.metrics["streamed_requests"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_openai_proxy_sdk_streaming(short_tmp: Path, backend: str) -> None:
    async with proxy_context(backend, short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES) as ctx:
        outcome = await blackbox(backend, "--stream").run(ctx)
        seen = harness_output(ctx)
    check_tools_run(outcome, seen, ctx)
    stream = seen["stream"]
    # Content and arguments arrive in several deltas each; one usage chunk per request.
    assert stream["content_deltas"] >= 4 and stream["tool_call_deltas"] >= 6 and stream["usage_chunks"] == 3
    assert outcome.metrics["streamed_requests"] == 3


async def test_openai_proxy_sdk_over_the_unix_socket(short_tmp: Path) -> None:
    async with proxy_context("local", short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES) as ctx:
        outcome = await blackbox("local", "--uds", loopback=False).run(ctx)
        seen = harness_output(ctx)
    check_tools_run(outcome, seen, ctx)
    assert not (ctx.lease.sandbox.run_dir / "openai" / "forwarder.py").exists()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_openai_proxy_history_rewrite_is_flagged(short_tmp: Path, backend: str) -> None:
    async with proxy_context(backend, short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES) as ctx:
        outcome = await blackbox(backend, "--rewrite-at", "3").run(ctx)
        seen = harness_output(ctx)
    assert outcome.finish_reason == "completed", outcome.metrics.get("harness_output_tail")
    assert seen["finish_reasons"] == ["tool_calls", "tool_calls", "stop"]
    # Flagged, in two segments: never spliced into the first one.
    assert not outcome.template_append_only and outcome.metrics["history_rewritten"]
    (rewrite,) = outcome.metrics["history_rewrites"]
    assert rewrite["request"] == 3 and rewrite["segment"] == 1 and rewrite["shared_messages"] == 2
    assert "message 2 differs from the model's reply" in rewrite["reason"]
    assert any("message 2 differs" in n for n in outcome.template_notes)
    first, second = split_history_segments(outcome)
    assert [s["turns"] for s in outcome.metrics["history_segments"]] == [2, 1]
    assert len(outcome.segments) == 2 and outcome.segments[1][0] == outcome.segments[0][1]
    # Segment 0 holds the first two turns exactly as generated; segment 1 starts from a fresh
    # render of the rewritten request and holds the third turn.
    assert mask_runs(first.response_mask) == [(t.start, t.end) for t in first.turns]
    turns = [(first, t) for t in first.turns] + [(second, t) for t in second.turns]
    assert len(turns) == len(ctx.results) == 3
    for (seg, turn), result in zip(turns, ctx.results):
        assert np.array_equal(seg.response_ids[turn.start:turn.end], result.token_ids)
        assert np.array_equal(seg.response_logprobs[turn.start:turn.end], result.logprobs)
    tok = reference_tokenizer()
    request3 = seen["messages"][:-1]
    fresh = tok.apply_chat_template(template_messages(request3), tools=[BASH_TOOL], tokenize=False,
                                    add_generation_prompt=True)
    assert decode(second.prompt_ids) == fresh and "I rewrote this reply." in fresh
    assert "I rewrote this reply." not in decode(first.response_ids)
    for segment in (first, second):
        check_segment_fidelity(segment)
    assert decode(np.concatenate([second.prompt_ids, second.response_ids])) == render_as_harness_sees_it(
        seen["messages"], [BASH_TOOL], ends_with_eot=True)


async def test_openai_proxy_rewrite_keep_last_segment(short_tmp: Path) -> None:
    async with proxy_context("local", short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES) as ctx:
        outcome = await blackbox("local", "--rewrite-at", "3", keep_segments="last").run(ctx)
    assert outcome.metrics["history_rewritten"]
    assert [s["in_arrays"] for s in outcome.metrics["history_segments"]] == [False, True]
    # Only the last segment: one history a trainer can use as it is.
    assert outcome.num_turns == 1 and outcome.segments == [(0, len(outcome.response_ids))]
    assert "I rewrote this reply." in decode(outcome.prompt_ids)
    (only,) = split_history_segments(outcome)
    check_segment_fidelity(only)
    assert np.array_equal(outcome.response_ids[:-1], ctx.results[-1].token_ids[:-1])


async def test_openai_proxy_harness_past_its_deadline_is_stopped(short_tmp: Path) -> None:
    async with proxy_context("local", short_tmp, "oa-tools", TOOLS_PLAN, files=NOTES,
                             deadline=time.monotonic() + 6.0) as ctx:
        agent = make_agent("blackbox", {"command": harness_command("local") + " && echo $$ > pid && exec sleep 60"})
        t0 = time.monotonic()
        outcome = await agent.run(ctx)
        pid = int((ctx.lease.sandbox.workspace / "pid").read_text())
    assert outcome.finish_reason == "timeout" and time.monotonic() - t0 < 15
    assert outcome.num_turns == 3  # the turns before the deadline are kept
    assert not Path(f"/proc/{pid}").exists(), "the harness outlived its trajectory"


async def test_openai_proxy_failing_harness_is_an_error(short_tmp: Path) -> None:
    async with proxy_context("local", short_tmp, "oa-fail", TOOLS_PLAN) as ctx:
        with pytest.raises(AgentError, match=r"(?s)status 3.*broken harness"):
            await make_agent("blackbox", {"command": "echo broken harness >&2; exit 3"}).run(ctx)
        outcome = await make_agent("blackbox", {"command": "exit 3", "allow_nonzero_exit": True}).run(ctx)
    assert outcome.finish_reason == "completed" and outcome.num_turns == 0
    assert outcome.metrics["harness_exit_code"] == 3


async def test_openai_proxy_turn_limit_ends_the_harness(short_tmp: Path) -> None:
    looping = [TOOLS_PLAN[0]] * 5
    async with proxy_context("local", short_tmp, "oa-loop", looping, files=NOTES) as ctx:
        outcome = await blackbox("local", max_requests=2).run(ctx)
    # The third request is refused for good; the SDK raises and the harness exits.
    assert outcome.finish_reason == "max_turns" and outcome.num_turns == 2
    assert outcome.metrics["refused_requests"] == 1
    assert "BadRequestError: Error code: 400" in outcome.metrics["harness_output_tail"]
    assert "(max_requests)" in outcome.metrics["harness_output_tail"]
    assert outcome.response_ids[-1] == reference_tokenizer().convert_tokens_to_ids(EOT)
