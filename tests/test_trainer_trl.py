"""TRL's own GRPOTrainer trains a tiny Qwen2 model on the CPU on rolloutd rollouts.

The rollouts are real (a node daemon, local sandboxes, the scripted reference policy, whose
tokenizer the tiny model shares); the trainer is TRL's, run through ``rollout_func``. The test
watches what TRL feeds the model and its loss: the tokens are the rollouts' exactly, the
infrastructure-failed sample is dropped in TRL's terms (unscorable: advantage 0, no loss token),
and the step moved the weights with a finite loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from adapters_support import build, real_module, trajectories
from trainer_support import (
    ROLLOUT_TIMEOUT_S, expected_rewards, group_requests, rollout_client, tiny_model_dir,
)

from rolloutd.client.adapters.trl import TRLRolloutFunc, rolloutd_reward, to_trl_rollout
from rolloutd.native_io.errors import BadRequest

GROUP = 4
STEPS = 2
"""Optimizer steps on one generated group (TRL's steps_per_generation): one round of rollouts."""


class Seen:
    """What TRL's training step handed the model and the loss (filled by the hooks below)."""

    def __init__(self) -> None:
        self.rollouts: list[dict[str, list[Any]]] = []
        self.forward: list[tuple[Any, Any]] = []
        self.loss_inputs: list[dict[str, Any]] = []


@pytest.mark.slow
@pytest.mark.timeout(900)
# TRL 1.16 calls transformers 5.25 by its deprecated gradient_checkpointing names: theirs to fix.
@pytest.mark.filterwarnings("ignore:`[a-z_]*gradient_checkpointing[a-z_]*` is deprecated:FutureWarning")
def test_grpo_trainer_steps_on_rolloutd_rollouts(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trl = real_module("trl")
    torch = real_module("torch")
    transformers = real_module("transformers")
    datasets = real_module("datasets")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    model_dir = tiny_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = Seen()

    class WatchedGRPOTrainer(trl.GRPOTrainer):  # type: ignore[misc, name-defined]
        """TRL's trainer unchanged; records the batch its loss is computed on."""

        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            seen.loss_inputs.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    def record_forward(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled():  # the training forward, not a no-grad log-prob pass
            seen.forward.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    model.register_forward_pre_hook(record_forward, with_kwargs=True)
    config = trl.GRPOConfig(
        output_dir=str(short_tmp / "out"), use_cpu=True, per_device_train_batch_size=GROUP // STEPS,
        steps_per_generation=STEPS, num_generations=GROUP, max_steps=STEPS, learning_rate=1e-2, beta=0.0,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["write hi"]})

    with rollout_client() as client:
        inner = TRLRolloutFunc(client, lambda _prompt, n: group_requests(n), timeout_s=ROLLOUT_TIMEOUT_S)

        def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            out = inner(prompts, trainer)
            seen.rollouts.append(out)
            return out

        trainer = WatchedGRPOTrainer(model=model, reward_funcs=rolloutd_reward, args=config, train_dataset=dataset,
                                     processing_class=tokenizer, rollout_func=rollout_func)
        trainer.train()

    assert trainer.state.global_step == STEPS and len(seen.rollouts) == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), trainer.state.log_history
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no weight moved in two GRPO steps"

    assert len(seen.loss_inputs) == STEPS and len(seen.forward) == STEPS
    (rollout,) = seen.rollouts
    assert rollout["rolloutd_reward"] == expected_rewards(GROUP), rollout["rolloutd_ended_by"]
    assert rollout["rolloutd_ended_by"][-1] == "sandbox"
    # it failed before the model spoke: TRL needs a token per completion, the pad token stands in
    assert rollout["completion_ids"][-1] == [tokenizer.pad_token_id] and rollout["env_mask"][-1] == [0]
    check_trained_rows(rollout, seen.loss_inputs, seen.forward)


def unpadded(ids: Any, mask: Any) -> list[int]:
    return ids[mask.bool()].tolist()


def check_trained_rows(rollout: dict[str, list[Any]], loss_inputs: list[dict[str, Any]],
                       forwards: list[tuple[Any, Any]]) -> None:
    """Every row TRL trained on, over all steps, against the rollout's rows. TRL shuffles a
    generated batch before splitting it into steps, so rows are matched by their tokens."""
    by_tokens: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[int], float | None]] = {}
    for prompt, completion, mask, reward in zip(rollout["prompt_ids"], rollout["completion_ids"],
                                                rollout["env_mask"], rollout["rolloutd_reward"]):
        by_tokens[(tuple(prompt), tuple(completion))] = (mask, reward)
    rows = []
    for inputs, (input_ids, attention) in zip(loss_inputs, forwards):
        trained = inputs["completion_mask"] * inputs["tool_mask"]
        for i in range(len(inputs["prompt_ids"])):
            prompt = unpadded(inputs["prompt_ids"][i], inputs["prompt_mask"][i])
            completion = unpadded(inputs["completion_ids"][i], inputs["completion_mask"][i])
            # the model ran on exactly these tokens: the rollout's prompt, then its completion
            assert unpadded(input_ids[i], attention[i]) == prompt + completion, i
            rows.append((tuple(prompt), tuple(completion)))
            mask, reward = by_tokens[rows[-1]]
            assert unpadded(trained[i], inputs["completion_mask"][i]) == mask, i
            advantage = float(inputs["advantages"][i])
            if reward is None:  # TRL's own verdict: unscorable, advantage 0, and no token of it trains
                assert advantage == 0.0 and trained[i].sum() == 0
            else:
                assert (advantage > 0) == (reward == 1.0) and advantage != 0.0, (reward, advantage)
                assert sum(mask) > 0
    expected = sorted((tuple(p), tuple(c)) for p, c in zip(rollout["prompt_ids"], rollout["completion_ids"]))
    assert sorted(rows) == expected  # every rollout row trained once, none made up


def test_rows_keep_the_trajectory_tokens_and_drop_infra_endings() -> None:
    trajs = trajectories()
    with pytest.raises(BadRequest, match="pass pad_token_id"):  # the last one has no response token
        to_trl_rollout(trajs)
    out = to_trl_rollout(trajs, pad_token_id=7)
    for i, t in enumerate(trajs[:3]):
        assert out["prompt_ids"][i] == t.prompt_ids.tolist() and out["completion_ids"][i] == t.response_ids.tolist()
        assert out["env_mask"][i] == t.response_mask.tolist()
        assert out["logprobs"][i] == t.response_logprobs.tolist()
    assert (out["completion_ids"][3], out["env_mask"][3], out["logprobs"][3]) == ([7], [0], [0.0])
    assert out["rolloutd_reward"] == [1.0, 0.5, -0.25, None]
    assert rolloutd_reward(completions=[""] * 4, rolloutd_reward=out["rolloutd_reward"]) == [1.0, 0.5, -0.25, None]
    # a sample the model did not end keeps its tokens in view but trains none of them
    failed = build("f", [1, 2], [(1, [5, 6])], reward=0.0, finish_reason="error", ended_by="inference")
    out = to_trl_rollout([failed])
    assert out["completion_ids"] == [[5, 6]] and out["env_mask"] == [[0, 0]] and out["rolloutd_reward"] == [None]
