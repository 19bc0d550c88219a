"""A full rollout through the RolloutPipeline with the ``blackbox`` agent: the official ``openai``
SDK inside the sandbox fixes an inline task through the OpenAI proxy, the task's evaluation
rewards the fix, and the trajectory's tokens are the model's (log-probabilities recomputed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent_support import call
from openai_proxy_support import (
    BASH_TOOL,
    check_segment_fidelity,
    decode,
    harness_command,
    harness_env,
    run_blackbox,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.native_io.wire import TaskRef

TASK = {"type": "command", "instance_id": "oa-pipe-001",
        "problem_statement": "value.py sets x to 1; it must be 2.",
        "setup_script": "printf 'x = 1\\n' > value.py",
        "eval_script": "python3 -c 'import value; print(1 if value.x == 2 else 0)'"}
PLAN = [call("bash", "I will fix value.py.", command="sed -i 's/1/2/' value.py"), "Fixed: x is 2 now."]


@pytest.mark.parametrize("backend", ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)])
async def test_openai_proxy_full_rollout_through_the_pipeline(short_tmp: Path, backend: str) -> None:
    trajs = await run_blackbox(short_tmp, backend, TaskRef(inline=TASK), {TASK["instance_id"]: PLAN},
                               {"command": harness_command(backend), "env": harness_env(backend)}, n=2)
    assert len(trajs) == 2
    for t in trajs:
        assert (t.finish_reason, t.reward, t.error_message) == ("completed", 1.0, None)
        assert t.agent == "blackbox" and t.num_turns == 2 and t.template_append_only
        assert t.metrics["tool_calls"] == {"bash": 1} and t.metrics["harness_exit_code"] == 0
        assert t.weight_versions == ["0", "0"]
        (segment,) = split_history_segments(t)
        check_segment_fidelity(segment)
        text = decode(np.concatenate([t.prompt_ids, t.response_ids]))
        assert "Task id: oa-pipe-001" in text and TASK["problem_statement"] in text
        assert json.dumps(BASH_TOOL["function"]) in text  # the harness's tool reached the template
        assert text.endswith(PLAN[1] + "<|im_end|>")
