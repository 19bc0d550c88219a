"""A full rollout through the RolloutPipeline with the ``blackbox`` agent: the official ``openai``
SDK inside the sandbox fixes an inline task through the OpenAI proxy, the task's evaluation
rewards the fix, and the trajectory's tokens are the model's (log-probabilities recomputed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent_support import API_KEY, call
from openai_proxy_support import (
    BASH_TOOL,
    check_segment_fidelity,
    decode,
    harness_command,
    harness_env,
    sandbox_backend,
    sandbox_binds,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.daemon.inference import ServerPool
from rolloutd.daemon.pipeline.rollout import PipelineLimits, RolloutPipeline
from rolloutd.daemon.policy.server import PolicyServerConfig, serve_policy
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.native_io.wire import RolloutArgs, TaskRef

TASK = {"type": "command", "instance_id": "oa-pipe-001",
        "problem_statement": "value.py sets x to 1; it must be 2.",
        "setup_script": "printf 'x = 1\\n' > value.py",
        "eval_script": "python3 -c 'import value; print(1 if value.x == 2 else 0)'"}
PLAN = [call("bash", "I will fix value.py.", command="sed -i 's/1/2/' value.py"), "Fixed: x is 2 now."]


@pytest.mark.parametrize("backend", ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)])
async def test_openai_proxy_full_rollout_through_the_pipeline(short_tmp: Path, backend: str) -> None:
    plans = short_tmp / "plans.json"
    plans.write_text(json.dumps({"plans": {TASK["instance_id"]: PLAN}}))
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, scripted=plans)) as policy:
        sandboxes = WarmPool(sandbox_backend(backend, short_tmp / "sb"), warm_specs={})
        await sandboxes.start()
        inference = await ServerPool.create([policy.url], api_key=API_KEY)
        pipe = RolloutPipeline(sandboxes=sandboxes, inference=inference, tokenizer=load_tokenizer(),
                               limits=PipelineLimits(), cache_dir=short_tmp / "cache", binds=sandbox_binds(backend))
        try:
            args = RolloutArgs(task=TaskRef(inline=TASK), agent="blackbox", ipython=False, n=2,
                               agent_config={"command": harness_command(backend), "env": harness_env(backend)},
                               sampling={"max_tokens": 256, "seed": 1})
            trajs = await pipe.run_request("oa", args)
        finally:
            await inference.close()
            await sandboxes.close()
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
