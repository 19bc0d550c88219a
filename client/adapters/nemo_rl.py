"""NeMo-RL adapter: trajectories as per-sample message logs, and the rollout batch around them.

Read at NVIDIA-NeMo/RL 7ea279a: ``nemo_rl/data/interfaces.py`` (``LLMMessageLogType``,
``DatumSpec``), ``nemo_rl/experience/rollouts.py`` (assistant messages get ``token_ids`` and
``generation_logprobs``; the batch gains ``total_reward`` and ``truncated``),
``nemo_rl/environments/nemo_gym.py`` (token-level results become alternating non-assistant and
assistant messages, ``content`` left empty) and ``nemo_rl/algorithms/grpo.py``
(``add_grpo_token_loss_masks_and_generation_logprobs``: only assistant messages that carry
``generation_logprobs`` are trained on).

A trajectory becomes: one message holding the prompt, then one message per mask run of the
response: a run of model tokens is an ``assistant`` message with ``generation_logprobs``, a run
of observation tokens a message of ``observation_role``. Concatenating the messages' ``token_ids``
gives back the trajectory's tokens exactly (:func:`message_log_arrays` does that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rolloutd.client.adapters.common import (
    Decoder,
    TensorType,
    as_trajectory_list,
    decode,
    hit_token_limit,
    mask_runs,
    masked_logprobs,
    to_tensor,
    trained_mask,
    trainer_module,
    turn_versions,
)
from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.trajectory import Trajectory

BATCH_MODULE = "nemo_rl.distributed.batched_data_dict"
PACKAGE = "nemo-rl"


def trajectory_message_log(
    trajectory: Trajectory,
    *,
    tokenizer: Decoder | None = None,
    tensor_type: TensorType = "numpy",
    prompt_role: str = "user",
    observation_role: str = "user",
    as_generated: bool = False,
) -> list[dict[str, Any]]:
    """One trajectory as a NeMo-RL message log.

    ``token_ids`` are int64 and ``generation_logprobs`` float32, as numpy arrays or torch tensors.
    ``content`` is the decoded text when a tokenizer is given, else empty (NeMo-RL trains on the
    ids; NeMo-Gym leaves it empty too). ``observation_role`` defaults to ``user``, the role
    NeMo-Gym gives every non-trained message; pass ``tool`` if the trainer's code looks for it.
    ``as_generated`` keeps the model's turns as assistant messages even when the model did not end
    the trajectory, for a reader that drops such a sample by its own flag (the gateway's
    ``filter``); by default they become observations, so they never train (:func:`trained_mask`).
    """
    ids = np.asarray(trajectory.response_ids, dtype=np.int64)
    mask = np.asarray(trajectory.response_mask) if as_generated else trained_mask(trajectory)
    logprobs = masked_logprobs(trajectory, mask)
    prompt = np.asarray(trajectory.prompt_ids, dtype=np.int64)
    log: list[dict[str, Any]] = [
        {"role": prompt_role, "content": decode(tokenizer, prompt), "token_ids": to_tensor(prompt, tensor_type)}
    ]
    for start, end, is_model in mask_runs(mask):
        run = ids[start:end].copy()
        message: dict[str, Any] = {
            "role": "assistant" if is_model else observation_role,
            "content": decode(tokenizer, run),
            "token_ids": to_tensor(run, tensor_type),
        }
        if is_model:
            message["generation_logprobs"] = to_tensor(logprobs[start:end].copy(), tensor_type)
        log.append(message)
    return log


def to_nemo_rl_message_logs(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    tokenizer: Decoder | None = None,
    tensor_type: TensorType = "numpy",
    prompt_role: str = "user",
    observation_role: str = "user",
) -> list[list[dict[str, Any]]]:
    """One message log per trajectory (see :func:`trajectory_message_log`)."""
    return [
        trajectory_message_log(
            t, tokenizer=tokenizer, tensor_type=tensor_type, prompt_role=prompt_role, observation_role=observation_role
        )
        for t in as_trajectory_list(trajectories)
    ]


def to_nemo_rl_batch(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    tokenizer: Decoder | None = None,
    tensor_type: TensorType | None = None,
    prompt_role: str = "user",
    observation_role: str = "user",
    use_trainer_class: bool | None = None,
) -> Any:
    """The rollout batch NeMo-RL's multi-turn rollout returns: a ``BatchedDataDict`` when NeMo-RL
    imports, else a dict with the same keys.

    Keys: ``message_log``; ``length`` (int64, prompt + response tokens); ``total_reward``
    (float32); ``truncated`` (bool: the token budget ran out); ``loss_multiplier`` (float32, 0.0
    for trajectories the model did not end, ``reward_valid`` False: their reward is no score, and
    their model tokens are plain observation messages, so nothing of them trains); ``idx`` (int64
    position in this batch); ``straddled_turns`` (int64, turns that may mix weight versions).
    ``tensor_type`` defaults to torch when NeMo-RL imports (its batches hold torch tensors), else numpy.
    """
    mod = trainer_module(BATCH_MODULE, package=PACKAGE, use_trainer_class=use_trainer_class)
    kind: TensorType = tensor_type or ("torch" if mod is not None else "numpy")
    trajs = as_trajectory_list(trajectories)
    columns = {
        "length": np.array([len(t.prompt_ids) + len(t.response_ids) for t in trajs], dtype=np.int64),
        "loss_multiplier": np.array([1.0 if t.reward_valid else 0.0 for t in trajs], dtype=np.float32),
        "total_reward": np.array([t.reward for t in trajs], dtype=np.float32),
        "truncated": np.array([hit_token_limit(t) for t in trajs], dtype=np.bool_),
        "idx": np.arange(len(trajs), dtype=np.int64),
        "straddled_turns": np.array([len(turn_versions(t)["straddled_turns"]) for t in trajs], dtype=np.int64),
    }
    data: dict[str, Any] = {
        "message_log": to_nemo_rl_message_logs(
            trajs, tokenizer=tokenizer, tensor_type=kind, prompt_role=prompt_role, observation_role=observation_role
        ),
        **{k: to_tensor(v, kind) for k, v in columns.items()},
    }
    return mod.BatchedDataDict(data) if mod is not None else data


def message_log_arrays(message_log: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The inverse of :func:`trajectory_message_log`: the trajectory's four arrays.

    The first message is the prompt; after it, assistant messages with ``generation_logprobs``
    are model tokens (mask 1) and every other message observation tokens (mask 0, logprob 0.0).
    """
    if not message_log:
        raise BadRequest("an empty message log has no prompt message")
    ids, mask, logprobs = [], [], []
    for message in message_log[1:]:
        tokens = np.asarray(message["token_ids"], dtype=np.int64)
        trained = message["role"] == "assistant" and "generation_logprobs" in message
        ids.append(tokens)
        mask.append(np.full(len(tokens), int(trained), dtype=np.uint8))
        logprobs.append(
            np.asarray(message["generation_logprobs"], dtype=np.float32) if trained else np.zeros(len(tokens), np.float32)
        )
    return {
        "prompt_ids": np.asarray(message_log[0]["token_ids"], dtype=np.int64),
        "response_ids": np.concatenate(ids) if ids else np.zeros(0, np.int64),
        "response_mask": np.concatenate(mask) if mask else np.zeros(0, np.uint8),
        "response_logprobs": np.concatenate(logprobs) if logprobs else np.zeros(0, np.float32),
    }
