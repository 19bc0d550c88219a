"""OpenRLHF's own rollout code runs rolloutd's agent executor on real rollouts.

OpenRLHF's loader picks the executor out of ``client/adapters/openrlhf_agent.py`` (what
``--agent_func_path`` names), its engine's way of calling it runs one group, and its
``SamplesGenerator`` turns each result into an ``Experience``. That code imports vLLM and Ray, so
it runs in the vLLM environment (``scripts/install-vllm`` adds Ray and OpenRLHF there); the
rollouts come from a node daemon with the scripted policy. Not run: the Ray actors, DeepSpeed
training and the advantage code (``experience_maker`` needs GPU workers).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from adapters_support import real_module
from trainer_support import (
    ROLLOUT_TIMEOUT_S, WRITE, expected_rewards, group_requests, rollout_client, tiny_model_dir,
)

from rolloutd.daemon.inference.vllm_server import vllm_python

REPO = Path(__file__).resolve().parent.parent
GROUP = 4
MAX_LEN = 4096


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_openrlhf_samples_generator_on_the_executors_results(short_tmp: Path) -> None:
    transformers = real_module("transformers")
    labels = []
    for r in group_requests(GROUP):
        labels += [json.dumps({"task": r.task, "sampling": r.sampling, "infra_retries": r.infra_retries})] * r.n
    spec = short_tmp / "spec.json"
    spec.write_text(json.dumps({"executor": str(REPO / "client/adapters/openrlhf_agent.py"), "labels": labels,
                                "max_len": MAX_LEN}))
    out = short_tmp / "out.json"
    with rollout_client() as client:
        done = subprocess.run([vllm_python(), str(REPO / "tests/openrlhf_check.py"), str(spec), str(out)],
                              env={**os.environ, "ROLLOUTD_ADDRESS": client.address}, capture_output=True,
                              text=True, timeout=ROLLOUT_TIMEOUT_S + 120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["executor"] == "agent_module.RolloutdAgentExecutor"  # loaded by OpenRLHF from the file
    rewards = expected_rewards(GROUP)
    for o, e, reward in zip(result["outputs"], result["experiences"], rewards):
        tokens = o["observation_tokens"]
        assert e["sequences"] == tokens  # OpenRLHF's training sequence is the rollout's tokens exactly
        trained = [0] * len(tokens)
        for start, end in o["action_ranges"]:
            trained[start:end] = [1] * (end - start)
        assert e["action_mask"] == trained[1:]  # shifted by one, as OpenRLHF predicts token i+1 at i
        assert all(lp == 0.0 for lp, m in zip(e["rollout_log_probs"], e["action_mask"]) if not m)
        assert e["reward_valid"] == [float(reward is not None)]
        assert e["rewards"] == [reward if reward is not None else 0.0]
    # an oracle of its own: the first action of a solved sample is the scripted reply, token for token
    reply = transformers.AutoTokenizer.from_pretrained(tiny_model_dir()).encode(WRITE, add_special_tokens=False)
    for o in result["outputs"][: GROUP - 2]:
        start, end = o["action_ranges"][0]
        assert o["observation_tokens"][start:start + len(reply)] == reply and end - start >= len(reply)
    # the infra-failed sample: no token of it trains (OpenRLHF cannot leave it out of its group)
    assert sum(result["experiences"][-1]["action_mask"]) == 0
