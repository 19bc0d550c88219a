"""A harness on Anthropic's SDK inside the sandbox (what a Claude-Code-style agent does) fixes a
task through the ``blackbox`` agent: the client finds the proxy from ``ANTHROPIC_BASE_URL`` and
``ANTHROPIC_API_KEY`` alone, streams each reply from ``/v1/messages``, runs the ``tool_use`` and
sends back ``tool_result`` blocks; the task's evaluation rewards the fix and the trajectory is
one token history of the model's own ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openai_proxy_support import (
    check_segment_fidelity,
    decode,
    harness_command,
    harness_env,
    run_blackbox,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.native_io.wire import TaskRef
from test_openai_proxy_pipeline import PLAN
from test_openai_proxy_pipeline import TASK as PIPELINE_TASK

# The chat harness's task (tests/test_openai_proxy_pipeline.py) under its own id.
TASK = {**PIPELINE_TASK, "instance_id": "an-pipe-001"}


@pytest.mark.parametrize("backend", ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)])
async def test_anthropic_sdk_harness_fixes_a_task_through_the_proxy(short_tmp: Path, backend: str) -> None:
    command = harness_command(backend, script="anthropic_harness.py")
    (t,) = await run_blackbox(short_tmp, backend, TaskRef(inline=TASK), {TASK["instance_id"]: PLAN},
                              {"command": command, "env": harness_env(backend)}, sdk="anthropic")
    outcome = (t.finish_reason, t.reward, t.error_message)
    assert outcome == ("completed", 1.0, None), t.metrics.get("harness_output_tail")
    assert t.num_turns == 2 and t.metrics["tool_calls"] == {"bash": 1} and t.metrics["streamed_requests"] == 2
    assert not t.metrics["history_rewritten"], t.metrics["history_rewrites"]
    (segment,) = split_history_segments(t)
    check_segment_fidelity(segment)
    text = decode(np.concatenate([t.prompt_ids, t.response_ids]))
    assert "Task id: an-pipe-001" in text and "<|im_start|>user\n<tool_response>\n\n</tool_response>" in text
    assert text.endswith(PLAN[1] + "<|im_end|>")
