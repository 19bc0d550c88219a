"""A harness on Anthropic's SDK inside the sandbox (what a Claude-Code-style agent does) fixes a
task through the ``blackbox`` agent: the client finds the proxy from ``ANTHROPIC_BASE_URL`` and
``ANTHROPIC_API_KEY`` alone, streams each reply from ``/v1/messages``, runs the ``tool_use`` and
sends back ``tool_result`` blocks; the task's evaluation rewards the fix and the trajectory is
one token history of the model's own ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent_support import API_KEY, call
from openai_proxy_support import (
    check_segment_fidelity,
    decode,
    harness_command,
    harness_env,
    sandbox_backend,
    sandbox_binds,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.client.wire import RolloutArgs, TaskRef
from rolloutd.daemon.inference import ServerPool
from rolloutd.daemon.pipeline.rollout import PipelineLimits, RolloutPipeline
from rolloutd.daemon.policy.server import PolicyServerConfig, serve_policy
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.pool import WarmPool

TASK = {"type": "command", "instance_id": "an-pipe-001",
        "problem_statement": "value.py sets x to 1; it must be 2.",
        "setup_script": "printf 'x = 1\\n' > value.py",
        "eval_script": "python3 -c 'import value; print(1 if value.x == 2 else 0)'"}
PLAN = [call("bash", "I will fix value.py.", command="sed -i 's/1/2/' value.py"), "Fixed: x is 2 now."]


@pytest.mark.parametrize("backend", ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)])
async def test_anthropic_sdk_harness_fixes_a_task_through_the_proxy(short_tmp: Path, backend: str) -> None:
    plans = short_tmp / "plans.json"
    plans.write_text(json.dumps({"plans": {TASK["instance_id"]: PLAN}}))
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, scripted=plans)) as policy:
        sandboxes = WarmPool(sandbox_backend(backend, short_tmp / "sb"), warm_specs={})
        await sandboxes.start()
        inference = await ServerPool.create([policy.url], api_key=API_KEY)
        pipe = RolloutPipeline(sandboxes=sandboxes, inference=inference, tokenizer=load_tokenizer(),
                               limits=PipelineLimits(), cache_dir=short_tmp / "cache",
                               binds=sandbox_binds(backend, "anthropic"))
        try:
            command = harness_command(backend, script="anthropic_harness.py")
            args = RolloutArgs(task=TaskRef(inline=TASK), agent="blackbox", ipython=False,
                               agent_config={"command": command, "env": harness_env(backend)},
                               sampling={"max_tokens": 256, "seed": 1})
            (t,) = await pipe.run_request("an", args)
        finally:
            await inference.close()
            await sandboxes.close()
    assert (t.finish_reason, t.reward, t.error_message) == ("completed", 1.0, None), t.metrics.get("harness_output_tail")
    assert t.num_turns == 2 and t.metrics["tool_calls"] == {"bash": 1} and t.metrics["streamed_requests"] == 2
    assert not t.metrics["history_rewritten"], t.metrics["history_rewrites"]
    (segment,) = split_history_segments(t)
    check_segment_fidelity(segment)
    text = decode(np.concatenate([t.prompt_ids, t.response_ids]))
    assert "Task id: an-pipe-001" in text and "<|im_start|>user\n<tool_response>\n\n</tool_response>" in text
    assert text.endswith(PLAN[1] + "<|im_end|>")
