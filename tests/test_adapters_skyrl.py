"""SkyRL adapter: GeneratorOutput keys and the invariants SkyRL's trainer checks.

Keys are those of GeneratorOutput in skyrl/train/generators/base.py at NovaSky-AI/SkyRL a956457;
the row invariants are the ones skyrl/train/utils/trainer_utils.py::validate_generator_output
asserts (tests/test_trainer_skyrl.py runs SkyRL's own validator). Release 0.3.0 does not import
as is on Python 3.11 (a pydantic error), so the real-class test imports it as
adapters_support.skyrl_module says.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
from adapters_support import build, skyrl_module, trajectories

from rolloutd.client.adapters.skyrl import SkyRLTrajectoryID, to_skyrl_generator_output
from rolloutd.native_io.errors import BadRequest

GENERATOR_OUTPUT_KEYS_A956457 = {
    "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
    "rollout_logprobs", "trajectory_ids", "trajectory_generation_times", "trajectory_time_splits",
    "rollout_expert_indices", "is_last_step", "env_metrics", "pixel_values", "image_grid_thw",
}
VISION_KEYS = {"pixel_values", "image_grid_thw"}
PER_ROW_KEYS = {"response_ids", "loss_masks", "rewards", "rollout_logprobs", "stop_reasons", "trajectory_ids"}


def check_like_skyrl_trainer(out: dict, n: int) -> None:
    """What validate_generator_output asserts for a non-step-wise batch of n prompts."""
    assert len(out["response_ids"]) == n == len(out["prompt_token_ids"])
    for key in PER_ROW_KEYS:
        if isinstance(out[key], list):
            assert len(out[key]) == n, key
    for i, (ids, mask, reward) in enumerate(zip(out["response_ids"], out["loss_masks"], out["rewards"])):
        assert len(ids) == len(mask), i
        if isinstance(reward, list):
            assert len(reward) == len(ids), i
        if out["rollout_logprobs"]:
            assert len(out["rollout_logprobs"][i]) == len(ids), i
    kinds = {isinstance(r, list) for r in out["rewards"]}
    assert len(kinds) == 1, "rewards must be all floats or all per-token lists"


def test_keys_and_rows() -> None:
    trajs = trajectories()
    out = to_skyrl_generator_output(trajs, use_trainer_class=False)
    assert set(out) == GENERATOR_OUTPUT_KEYS_A956457 - VISION_KEYS
    check_like_skyrl_trainer(out, len(trajs))
    for i, t in enumerate(trajs):
        assert out["prompt_token_ids"][i] == t.prompt_ids.tolist()
        assert out["response_ids"][i] == t.response_ids.tolist()
        assert out["loss_masks"][i] == t.response_mask.tolist()
        lps = np.array(out["rollout_logprobs"][i], dtype=np.float32)
        assert lps.tolist() == t.response_logprobs.tolist()
        assert (lps[t.response_mask == 0] == 0.0).all()
        assert type(out["rewards"][i]) is float and out["rewards"][i] == t.reward
        tid = out["trajectory_ids"][i]
        assert (tid.instance_id, tid.repetition_id) == (t.task_id, t.sample_index)
        assert out["env_metrics"][i] == {**t.metrics, "weight_versions": t.weight_versions, "straddled_turns": [],
                                         "reward_valid": t.reward_valid}
    assert out["trajectory_ids"][1].to_string() == "task-b_1"
    assert {f.name for f in dataclasses.fields(SkyRLTrajectoryID)} == {"instance_id", "repetition_id"}
    # SkyRL zeroes rewards and (with overlong filtering) loss masks unless the reason is "stop"
    assert out["stop_reasons"] == ["stop", "stop", "length", "error"]
    assert out["trajectory_generation_times"] == [6.0] * 4
    assert out["trajectory_time_splits"] == {"llm": [2.75] * 4, "env": [1.25] * 4}
    assert out["rollout_expert_indices"] is None and out["is_last_step"] is None


def test_rollout_metrics() -> None:
    out = to_skyrl_generator_output(trajectories(), use_trainer_class=False)
    m = out["rollout_metrics"]
    lengths = [9, 2, 6, 0]
    assert m["generate/min_num_tokens"] == 0 and m["generate/max_num_tokens"] == 9
    assert m["generate/avg_num_tokens"] == pytest.approx(np.mean(lengths))
    assert m["generate/avg_assistant_tokens"] == pytest.approx((7 + 2 + 2 + 0) / 4)
    # turns: a has runs of 3 and 4, b of 2, c of 2
    assert m["generate/tokens_per_turn_mean"] == pytest.approx((3 + 4 + 2 + 2) / 4)
    assert m["generate/tokens_per_turn_max"] == 4
    # positive rewards: a (9 tokens) and b (2 tokens)
    assert m["generate/avg_tokens_non_zero_rewards"] == pytest.approx(5.5)


def test_token_level_rewards_sit_on_the_last_token() -> None:
    trajs = trajectories()
    out = to_skyrl_generator_output(trajs, token_level_rewards=True, use_trainer_class=False)
    check_like_skyrl_trainer(out, len(trajs))
    for t, rewards in zip(trajs, out["rewards"]):
        expected = [0.0] * len(t.response_ids)
        if expected:
            expected[-1] = t.reward
        assert rewards == expected


def test_options() -> None:
    trajs = trajectories()
    out = to_skyrl_generator_output(
        trajs, include_logprobs=False, stop_reasons={"completed": "stop"}, use_trainer_class=False
    )
    assert out["rollout_logprobs"] is None
    assert out["stop_reasons"] == ["stop", "stop", "max_tokens", "error"]
    check_like_skyrl_trainer(out, len(trajs))
    single = to_skyrl_generator_output(trajs[0], use_trainer_class=False)
    assert single["response_ids"] == [trajs[0].response_ids.tolist()]


def test_without_skyrl_the_default_is_plain_records() -> None:
    if importlib.util.find_spec("skyrl") is not None:
        pytest.skip("SkyRL is installed here")
    out = to_skyrl_generator_output(trajectories())
    assert set(out) == GENERATOR_OUTPUT_KEYS_A956457 - VISION_KEYS
    assert all(isinstance(t, SkyRLTrajectoryID) for t in out["trajectory_ids"])


def test_real_generator_output_keys() -> None:
    mod = skyrl_module("skyrl.train.generators.base")
    out = to_skyrl_generator_output(trajectories(), use_trainer_class=True)
    assert set(out) == set(mod.GeneratorOutput.__annotations__) - VISION_KEYS
    assert all(isinstance(t, mod.TrajectoryID) for t in out["trajectory_ids"])


def test_token_level_reward_of_an_empty_response_is_not_lost() -> None:
    """An empty response has no token to carry a reward: a valid non-zero reward is refused
    (a list of no tokens would silently score it 0); a reward of 0 or an invalid one passes."""
    scored = build("e", [1, 2], [], reward=1.0, finish_reason="context_length")
    with pytest.raises(BadRequest, match="token_level_rewards=False"):
        to_skyrl_generator_output([*trajectories(), scored], token_level_rewards=True, use_trainer_class=False)
    out = to_skyrl_generator_output([*trajectories(), scored], use_trainer_class=False)
    assert out["rewards"][-1] == 1.0
    zero = build("z", [1, 2], [], reward=0.0, finish_reason="context_length")
    out = to_skyrl_generator_output([*trajectories(), zero], token_level_rewards=True, use_trainer_class=False)
    check_like_skyrl_trainer(out, 5)
    assert out["rewards"][-1] == [] and sum(map(sum, out["rewards"])) == 1.0 + 0.5 - 0.25
