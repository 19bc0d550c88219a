"""SkyRL (the released skyrl 0.3.0, its own code) checks and batches rolloutd's generator output.

``RolloutdGenerator`` implements SkyRL's ``GeneratorInterface`` and runs real rollouts (node
daemon, local sandboxes, scripted policy); then SkyRL's own steps after ``generate``: the
trainer's ``validate_generator_output``, its padding into training tensors
(``convert_prompts_responses_to_batch_tensors``) and its GRPO estimator, after the unscored row is
dropped. On Python 3.11 SkyRL is imported as :func:`adapters_support.skyrl_module` says.
What is not run here: SkyRL's trainer loop itself (Ray actors and FSDP/Megatron policy workers).
"""

from __future__ import annotations

import asyncio

import pytest
from adapters_support import real_module, skyrl_module, trajectories
from trainer_support import (
    ROLLOUT_TIMEOUT_S, WRITE, expected_rewards, group_requests, rollout_client, tiny_model_dir,
)

from rolloutd.client.adapters.skyrl import drop_unscored, to_skyrl_generator_output
from rolloutd.native_io.errors import BadRequest

GROUP = 4


def generator_input(base: object) -> dict[str, object]:
    """One GRPO group as SkyRL's trainer builds it: the prompt repeated, repetition ids 0..n-1."""
    extras = []
    for r in group_requests(GROUP):
        fields = {"task": r.task, "sampling": r.sampling, "infra_retries": r.infra_retries}
        extras += [{"rolloutd_request": fields}] * r.n
    return {
        "prompts": [[{"role": "user", "content": "write hi"}]] * GROUP,
        "env_classes": ["rolloutd"] * GROUP,
        "env_extras": extras,
        "sampling_params": {"temperature": 1.0},
        "trajectory_ids": [base.TrajectoryID("write-hi", i) for i in range(GROUP)],  # type: ignore[attr-defined]
        "batch_metadata": base.BatchMetadata(global_step=1, training_phase="train"),  # type: ignore[attr-defined]
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_skyrl_validates_pads_and_groups_the_generators_rows() -> None:
    base = skyrl_module("skyrl.train.generators.base")
    trainer_utils = skyrl_module("skyrl.train.utils.trainer_utils")
    preprocess = skyrl_module("skyrl.train.dataset.preprocess")
    ppo_utils = skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils")
    torch = real_module("torch")
    transformers = real_module("transformers")
    from rolloutd.client.adapters.skyrl_generator import RolloutdGenerator

    assert issubclass(RolloutdGenerator, base.GeneratorInterface)
    model_dir = tiny_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = generator_input(base)
    with rollout_client() as client:
        generator = RolloutdGenerator(client.address, timeout_s=ROLLOUT_TIMEOUT_S, token_level_rewards=True)
        out = asyncio.run(generator.generate(batch))

    trainer_utils.validate_generator_output(GROUP, out)  # what SkyRL's trainer runs after generate
    assert set(out) == set(base.GeneratorOutput.__annotations__) - {"pixel_values", "image_grid_thw"}
    assert out["trajectory_ids"] == batch["trajectory_ids"]
    assert [m["reward_valid"] for m in out["env_metrics"]] == [r is not None for r in expected_rewards(GROUP)]
    assert [sum(r) for r in out["rewards"]][: GROUP - 1] == expected_rewards(GROUP)[: GROUP - 1]
    assert out["response_ids"][-1] == [] and out["loss_masks"][-1] == []  # the sandbox died before the model spoke
    reply = tokenizer.encode(WRITE, add_special_tokens=False)
    for i in range(GROUP - 2):
        assert out["response_ids"][i][: len(reply)] == reply and all(out["loss_masks"][i][: len(reply)])

    uids = [t.instance_id for t in out["trajectory_ids"]]
    kept, kept_uids = drop_unscored(out, uids)
    trainer_utils.validate_generator_output(GROUP - 1, kept)
    sequences, attention, action_mask, rewards, loss_masks, logprobs, _ = (
        preprocess.convert_prompts_responses_to_batch_tensors(
            tokenizer, kept["prompt_token_ids"], kept["response_ids"], kept["rewards"], kept["loss_masks"],
            kept["rollout_logprobs"]))
    for i in range(GROUP - 1):  # SkyRL's training rows are the rollouts' tokens exactly
        expected = kept["prompt_token_ids"][i] + kept["response_ids"][i]
        assert sequences[i][attention[i].bool()].tolist() == expected
        n = len(kept["response_ids"][i])
        assert loss_masks[i][-n:].tolist() == kept["loss_masks"][i]
        assert (logprobs[i][-n:][loss_masks[i][-n:] == 0] == 0).all()
    advantages, _ = ppo_utils.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=loss_masks,
                                                            index=kept_uids)
    scores = torch.tensor([1.0] * (GROUP - 2) + [0.0])
    expected_adv = (scores - scores.mean()) / (scores.std() + 1e-6)
    assert torch.allclose(advantages.sum(-1) / loss_masks.sum(-1), expected_adv, atol=1e-5)


def test_drop_unscored_keeps_rows_in_step() -> None:
    trajs = trajectories()  # the last one ended by the sandbox
    out = to_skyrl_generator_output(trajs, use_trainer_class=False)
    kept, uids = drop_unscored(out, ["g0", "g0", "g1", "g1"])
    assert uids == ["g0", "g0", "g1"] and len(kept["response_ids"]) == 3
    assert kept["trajectory_time_splits"] == {"llm": [2.75] * 3, "env": [1.25] * 3}
    assert kept["rollout_metrics"] == out["rollout_metrics"]
    assert [t.instance_id for t in kept["trajectory_ids"]] == ["task-a", "task-b", "task-c"]
    with pytest.raises(BadRequest, match="one uid per row"):
        drop_unscored(out, ["g0"])
