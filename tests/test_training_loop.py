"""The CPU GRPO example (examples/grpo_cpu.py): its torch port of the reference model, and two real
training steps through a node daemon and the policy server (weight push, new version, the
token-in/token-out log-probability check)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from rolloutd.daemon.policy.model import ReferenceModel

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
from torch_policy import TorchReferencePolicy  # noqa: E402


def test_torch_port_matches_the_numpy_model_and_round_trips(short_tmp: Path) -> None:
    model = ReferenceModel.init(seed=5)
    policy = TorchReferencePolicy.from_model(model)
    rng = np.random.default_rng(1)
    prompt, response = rng.integers(0, 2048, 3), rng.integers(0, 2048, 400)  # prompt shorter than the context
    ours = policy.token_logprobs(prompt, response)
    assert np.max(np.abs(ours.detach().numpy() - model.token_logprobs(prompt, response))) <= 1e-5
    positions = np.array([0, 17, 399])
    assert np.allclose(policy.token_logprobs(prompt, response, positions).detach().numpy(), ours.detach().numpy()[positions])

    ours.sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in policy.weights.values())
    with_grad_step = {n: p.detach().clone() for n, p in policy.weights.items()}
    for p in policy.weights.values():
        p.data += 1e-3 * p.grad  # type: ignore[operator]
    policy.round_to_float32()
    assert any(not bool((p == with_grad_step[n]).all()) for n, p in policy.weights.items())
    policy.save(short_tmp / "w.npz")
    loaded = ReferenceModel.load(short_tmp / "w.npz")  # what the policy server loads
    assert np.max(np.abs(policy.token_logprobs(prompt, response).detach().numpy()
                         - loaded.token_logprobs(prompt, response))) <= 1e-5


def test_two_grpo_steps_push_weights_and_keep_logprobs_exact(short_tmp: Path) -> None:
    # The vLLM protocol: its answers carry no weight version, so the example also has to tell the
    # daemon the new version; the step-2 log-probability check proves the server loaded the push.
    out = short_tmp / "steps.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpo_cpu.py"), "--steps", "2", "--tasks", "1", "--n", "2",
                           "--backend", "local", "--protocol", "vllm", "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("loss" in line and "mean reward" in line and "weight version" in line for line in lines)
    steps = json.loads(out.read_text())["steps"]
    assert [(s["weight_version"], s["next_version"]) for s in steps] == [("0", "1"), ("1", "2")]
    for s in steps:
        assert s["max_logprob_diff"] <= 1e-5
        assert sorted(s["rewards"]) == [0.0, 1.0] and s["mean_reward"] == 0.5
        assert math.isfinite(s["loss"]) and s["model_tokens"] > 0
    # The pushed weights serve step 2: the solved sample's tokens gained log-probability.
    assert steps[1]["logp_solved"] > steps[0]["logp_solved"] + 0.1
