"""OpenRLHF adapter: trajectories as agent-executor results, or as a batched ``Experience``.

Read at OpenRLHF/OpenRLHF 3c3be62 and release 0.11.2: ``openrlhf/utils/agent.py``
(``AgentExecutorBase.execute`` returns ``observation_tokens`` = prompt and response tokens,
``action_ranges`` = ``[(start, end)]`` of each generation in them, and ``rollout_log_probs``
aligned to ``observation_tokens`` with 0.0 outside actions),
``openrlhf/trainer/ppo_utils/samples_generator.py::_process_response_into_experience`` (how one
result becomes an ``Experience``: ``action_mask`` and ``rollout_log_probs`` drop the first
position, i.e. entry ``i`` describes token ``i + 1``, the one predicted from position ``i``) and
``openrlhf/trainer/ppo_utils/experience.py`` (``Experience``; samples are joined by right padding,
``sequences`` with the pad token and everything else with 0).

An action range is a run of model tokens (mask 1). Two turns separated by an empty observation
form one run; the tokens trained on are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutd.client.adapters.batching import length_mask, pad_sequences
from rolloutd.client.adapters.common import (
    Decoder,
    TensorType,
    as_trajectory_list,
    decode,
    hit_token_limit,
    masked_logprobs,
    model_spans,
    tensors,
    to_tensor,
    trained_mask,
    trainer_module,
    turn_versions,
)
from rolloutd.native_io.errors import BadRequest, ConfigError
from rolloutd.native_io.trajectory import Trajectory

EXPERIENCE_MODULE = "openrlhf.trainer.ppo_utils.experience"
PACKAGE = "openrlhf"


@dataclass
class OpenRLHFExperience:
    """Same fields as OpenRLHF's ``Experience``; the policy/value ones stay None until training."""

    sequences: Any = None
    attention_mask: Any = None
    action_mask: Any = None
    action_log_probs: Any = None
    base_action_log_probs: Any = None
    rollout_log_probs: Any = None
    values: Any = None
    returns: Any = None
    advantages: Any = None
    kl: Any = None
    rewards: Any = None
    scores: Any = None
    response_length: Any = None
    truncated: Any = None
    total_length: Any = None
    index: list[int] | None = None
    prompts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    mm_train_inputs: list[Any] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def _texts(given: Sequence[str] | None, default: list[str], name: str) -> list[str]:
    if given is None:
        return default
    if len(given) != len(default):
        raise BadRequest(f"{name} has {len(given)} entries for {len(default)} trajectories")
    return list(given)


def action_ranges(trajectory: Trajectory) -> list[tuple[int, int]]:
    """The model-token runs as ``(start, end)`` positions in prompt + response tokens."""
    offset = len(trajectory.prompt_ids)
    return [(offset + s, offset + e) for s, e in model_spans(trained_mask(trajectory))]


def observation_tokens(trajectory: Trajectory) -> np.ndarray:
    """int64 prompt tokens followed by response tokens."""
    return np.concatenate([trajectory.prompt_ids, trajectory.response_ids]).astype(np.int64)


def observation_log_probs(trajectory: Trajectory) -> np.ndarray:
    """float32 log-probabilities aligned to :func:`observation_tokens`, 0.0 outside actions."""
    return np.concatenate([np.zeros(len(trajectory.prompt_ids), np.float32), masked_logprobs(trajectory)])


def action_mask_from_ranges(ranges: Sequence[tuple[int, int]], length: int) -> np.ndarray:
    """int64 ``[length]``: 1 inside the action ranges (the inverse of :func:`action_ranges`)."""
    mask = np.zeros(length, dtype=np.int64)
    for start, end in ranges:
        mask[start:end] = 1
    return mask


def to_openrlhf_agent_outputs(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    tokenizer: Decoder | None = None,
    prompts: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """What an OpenRLHF ``AgentExecutorBase.execute`` returns, one dict per trajectory.

    ``prompt`` is the given text, else the decoded prompt ids (empty without a tokenizer);
    ``label`` the given label, else the task id. ``reward`` and ``scores`` are the trajectory's
    reward; ``truncated`` says the token budget ended it.
    """
    trajs = as_trajectory_list(trajectories)
    prompt_texts = _texts(prompts, [decode(tokenizer, t.prompt_ids) for t in trajs], "prompts")
    label_texts = _texts(labels, [t.task_id for t in trajs], "labels")
    return [
        {
            "prompt": prompt,
            "label": label,
            "images": None,
            "mm_train_inputs": None,
            "reward": float(t.reward),
            "scores": float(t.reward),
            "observation_tokens": observation_tokens(t).tolist(),
            "action_ranges": action_ranges(t),
            "rollout_log_probs": observation_log_probs(t).tolist(),
            "truncated": hit_token_limit(t),
            "extra_logs": {"reward_valid": float(t.reward_valid),
                           "straddled_turns": float(len(turn_versions(t)["straddled_turns"]))},
        }
        for t, prompt, label in zip(trajs, prompt_texts, label_texts)
    ]


def to_openrlhf_experience(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    pad_token_id: int = 0,
    max_len: int | None = None,
    tokenizer: Decoder | None = None,
    prompts: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    tensor_type: TensorType | None = None,
    use_trainer_class: bool | None = None,
) -> Any:
    """A batched ``Experience`` (OpenRLHF's class when it imports, else :class:`OpenRLHFExperience`).

    ``sequences``/``attention_mask`` are ``[B, T]`` right-padded; ``action_mask`` and
    ``rollout_log_probs`` are ``[B, T - 1]``, shifted by one as OpenRLHF trains. ``max_len`` is
    OpenRLHF's ``--max_len``: a longer trajectory is an error (it is never cut), and one that
    reaches it counts in ``info['response_clip_ratio']``. ``tensor_type`` defaults to torch with
    OpenRLHF's class (it holds torch tensors), else numpy.
    """
    mod = trainer_module(EXPERIENCE_MODULE, package=PACKAGE, use_trainer_class=use_trainer_class)
    kind: TensorType = tensor_type or ("torch" if mod is not None else "numpy")
    trajs = as_trajectory_list(trajectories)
    prompt_texts = _texts(prompts, [decode(tokenizer, t.prompt_ids) for t in trajs], "prompts")
    label_texts = _texts(labels, [t.task_id for t in trajs], "labels")

    total = np.array([len(t.prompt_ids) + len(t.response_ids) for t in trajs], dtype=np.int64)
    width = int(total.max())
    if max_len is not None and width > max_len:
        raise ConfigError(
            f"a trajectory has {width} tokens, more than max_len={max_len}; raise max_len (OpenRLHF's "
            f"--max_len) or leave it unset"
        )
    # OpenRLHF pads a batch to its longest sample, not to max_len.
    sequences = pad_sequences(
        [observation_tokens(t) for t in trajs], side="right", length=width, pad_value=pad_token_id
    )
    full_mask = pad_sequences(
        [np.concatenate([np.zeros(len(t.prompt_ids), np.int64), trained_mask(t).astype(np.int64)]) for t in trajs],
        side="right", length=width,
    )
    full_logprobs = pad_sequences(
        [observation_log_probs(t) for t in trajs], side="right", length=width, pad_value=0.0, dtype=np.float32
    )
    spans = [action_ranges(t) for t in trajs]
    arrays = {
        "sequences": sequences,
        "attention_mask": length_mask(total, width, side="right"),
        "action_mask": full_mask[:, 1:],
        "rollout_log_probs": full_logprobs[:, 1:],
        "rewards": np.array([t.reward for t in trajs], dtype=np.float32),
        "scores": np.array([t.reward for t in trajs], dtype=np.float32),
        "response_length": np.array([s[-1][1] - s[0][0] if s else 0 for s in spans], dtype=np.int64),
        "truncated": np.array([hit_token_limit(t) for t in trajs], dtype=np.bool_),
        "total_length": total.astype(np.float32),
    }
    clipped = total >= max_len if max_len is not None else np.zeros(len(trajs), dtype=np.bool_)
    info = {
        "reward": arrays["rewards"].copy(),
        "score": arrays["scores"].copy(),
        "response_clip_ratio": clipped,
    }
    cls = mod.Experience if mod is not None else OpenRLHFExperience
    return cls(
        **tensors(arrays, kind),
        prompts=prompt_texts,
        labels=label_texts,
        images=[None] * len(trajs),
        mm_train_inputs=[None] * len(trajs),
        info={k: to_tensor(v, kind) for k, v in info.items()},
    )
