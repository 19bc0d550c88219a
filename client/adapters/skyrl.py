"""SkyRL adapter: trajectories as the ``GeneratorOutput`` a SkyRL generator returns.

Read at NovaSky-AI/SkyRL a956457 and release 0.3.0: ``skyrl/train/generators/base.py``
(``GeneratorOutput`` TypedDict, ``TrajectoryID``), ``skyrl/train/generators/skyrl_gym_generator.py``
(how ``generate`` fills it) and ``skyrl/train/utils/trainer_utils.py::validate_generator_output``
(the invariants: one row per trajectory, ``loss_masks``/``rollout_logprobs``/token rewards as
long as ``response_ids``). Lists are unpadded: SkyRL pads itself.

``stop_reasons`` use the inference server's words, because SkyRL's ``zero_reward_on_non_stop`` and
DAPO overlong filtering treat anything but ``"stop"`` as unfinished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutd.client.adapters.common import (
    as_trajectory_list,
    masked_logprobs,
    model_spans,
    stage_times,
    trained_mask,
    trainer_module,
    turn_versions,
)
from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.trajectory import Trajectory

GENERATOR_MODULE = "skyrl.train.generators.base"
PACKAGE = "skyrl"

DEFAULT_STOP_REASONS: Mapping[str, str] = {"completed": "stop", "max_tokens": "length"}
"""rolloutd finish reason -> SkyRL stop reason; reasons not listed pass through unchanged."""

# Keys of GeneratorOutput at SkyRL a956457, less the vision-only pixel_values/image_grid_thw.
# With SkyRL importable, the installed class's own keys decide instead.
GENERATOR_OUTPUT_KEYS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "is_last_step",
    "env_metrics",
)
_VISION_KEYS = frozenset({"pixel_values", "image_grid_thw"})


@dataclass
class SkyRLTrajectoryID:
    """Same fields as SkyRL's ``TrajectoryID``: the task and which of its samples this is."""

    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def _rollout_metrics(responses: list[list[int]], loss_masks: list[list[int]], rewards: list[float]) -> dict[str, float]:
    """Batch token statistics under the ``generate/`` names SkyRL logs."""
    n_tokens = np.array([len(r) for r in responses], dtype=np.float64)
    n_model = np.array([sum(m) for m in loss_masks], dtype=np.float64)
    positive = np.array(rewards) > 0.0
    turn_lengths = np.array(
        [e - s for m in loss_masks for s, e in model_spans(np.asarray(m, dtype=np.int8))], dtype=np.float64
    )
    metrics = {
        "generate/min_num_tokens": float(n_tokens.min()),
        "generate/max_num_tokens": float(n_tokens.max()),
        "generate/avg_num_tokens": float(n_tokens.mean()),
        "generate/std_num_tokens": float(n_tokens.std()),
        "generate/avg_tokens_non_zero_rewards": float(n_tokens[positive].mean()) if positive.any() else 0.0,
        "generate/avg_tokens_zero_rewards": float(n_tokens[~positive].mean()) if (~positive).any() else 0.0,
        "generate/avg_assistant_tokens": float(n_model.mean()),
        "generate/min_assistant_tokens": float(n_model.min()),
        "generate/max_assistant_tokens": float(n_model.max()),
    }
    if turn_lengths.size:
        metrics["generate/tokens_per_turn_mean"] = float(turn_lengths.mean())
        metrics["generate/tokens_per_turn_max"] = float(turn_lengths.max())
    return metrics


def _token_rewards(t: Trajectory) -> list[float]:
    """The reward on the last response token; an empty response has no token to carry a reward,
    so one that is not zero is refused rather than silently scored 0."""
    n = len(t.response_ids)
    if n == 0 and t.reward != 0.0:
        raise BadRequest(f"trajectory {t.request_id}/{t.sample_index} has no response tokens to carry its reward "
                         f"{t.reward}: pass token_level_rewards=False (a reward per row), or drop it")
    out = [0.0] * n
    if n:
        out[-1] = float(t.reward)
    return out


def to_skyrl_generator_output(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    token_level_rewards: bool = False,
    include_logprobs: bool = True,
    stop_reasons: Mapping[str, str] = DEFAULT_STOP_REASONS,
    use_trainer_class: bool | None = None,
) -> dict[str, Any]:
    """A ``GeneratorOutput`` dict, one row per trajectory in input order.

    ``token_level_rewards`` gives each row a per-token reward list (the reward on the last token)
    instead of a float. ``include_logprobs=False`` leaves ``rollout_logprobs`` None, as SkyRL does
    when sampling asked for no logprobs. ``trajectory_ids`` use SkyRL's ``TrajectoryID`` when
    SkyRL imports (``instance_id`` = task id, ``repetition_id`` = sample index).
    """
    mod = trainer_module(GENERATOR_MODULE, package=PACKAGE, use_trainer_class=use_trainer_class)
    id_cls = mod.TrajectoryID if mod else SkyRLTrajectoryID
    trajs = as_trajectory_list(trajectories)

    responses = [np.asarray(t.response_ids).tolist() for t in trajs]
    loss_masks = [trained_mask(t).tolist() for t in trajs]
    rewards = [float(t.reward) for t in trajs]
    times = [stage_times(t) for t in trajs]
    recorded = all(t.stage_s for t in trajs)
    values: dict[str, Any] = {
        "prompt_token_ids": [np.asarray(t.prompt_ids).tolist() for t in trajs],
        "response_ids": responses,
        "rewards": [_token_rewards(t) for t in trajs] if token_level_rewards else rewards,
        "loss_masks": loss_masks,
        "stop_reasons": [stop_reasons.get(t.finish_reason, t.finish_reason) for t in trajs],
        "rollout_metrics": _rollout_metrics(responses, loss_masks, rewards),
        "rollout_logprobs": [masked_logprobs(t).tolist() for t in trajs] if include_logprobs else None,
        "trajectory_ids": [id_cls(instance_id=t.task_id, repetition_id=t.sample_index) for t in trajs],
        "trajectory_generation_times": [sum(t.stage_s.values()) for t in trajs] if recorded else None,
        "trajectory_time_splits": (
            {"llm": [x.model_s for x in times], "env": [x.tools_s for x in times]} if recorded else None
        ),
        "rollout_expert_indices": None,
        "is_last_step": None,
        "env_metrics": [{**t.metrics, **turn_versions(t), "reward_valid": t.reward_valid} for t in trajs],
    }
    keys = [k for k in mod.GeneratorOutput.__annotations__ if k not in _VISION_KEYS] if mod else GENERATOR_OUTPUT_KEYS
    return {k: values.get(k) for k in keys}


def drop_unscored(generator_output: dict[str, Any], uids: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The rows of a ``GeneratorOutput`` (and their uids) whose reward is a score.

    SkyRL's GRPO baseline is the mean reward of every row sharing a uid, whatever its loss mask,
    so a row the model did not end (``env_metrics[i]["reward_valid"]`` False) would enter its group
    as a 0. SkyRL drops rows the way its dynamic-sampling filter does, by handing on a shorter
    ``(generator_output, uids)``: call this where that filter runs, after ``generate`` and before
    ``postprocess_generator_output``.
    """
    rows = len(generator_output["response_ids"])
    metrics = generator_output.get("env_metrics")
    if not metrics or any("reward_valid" not in m for m in metrics) or len(uids) != rows:
        raise BadRequest(f"drop_unscored needs one uid per row ({len(uids)} for {rows}) and env_metrics with "
                         f"reward_valid: pass a GeneratorOutput from to_skyrl_generator_output or RolloutdGenerator")
    keep = [i for i, m in enumerate(metrics) if m["reward_valid"]]

    def rows_of(value: Any) -> Any:
        if isinstance(value, list) and len(value) == rows:
            return [value[i] for i in keep]
        if isinstance(value, dict) and all(isinstance(v, list) and len(v) == rows for v in value.values()):
            return {k: [v[i] for i in keep] for k, v in value.items()}  # trajectory_time_splits
        return value  # batch-level: rollout_metrics, None

    return {k: rows_of(v) for k, v in generator_output.items()}, [uids[i] for i in keep]
