"""OpenRLHF adapter: agent-executor results and the batched Experience.

Field lists from OpenRLHF/OpenRLHF 3c3be62 (same in release 0.11.2): openrlhf/utils/agent.py (the
dicts AgentExecutorBase.execute returns) and openrlhf/trainer/ppo_utils/experience.py
(Experience). The shift by one of action_mask/rollout_log_probs is the one
openrlhf/trainer/ppo_utils/samples_generator.py::_process_response_into_experience applies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from adapters_support import real_module, runs_of, trajectories

from rolloutd.client.adapters.openrlhf import (
    OpenRLHFExperience,
    action_mask_from_ranges,
    to_openrlhf_agent_outputs,
    to_openrlhf_experience,
)
from rolloutd.native_io.errors import BadRequest, ConfigError

AGENT_OUTPUT_KEYS = {
    "prompt", "label", "images", "mm_train_inputs", "reward", "scores", "observation_tokens", "action_ranges",
    "rollout_log_probs", "truncated", "extra_logs",
}
EXPERIENCE_FIELDS = {
    "sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "rollout_log_probs",
    "values", "returns", "advantages", "kl", "rewards", "scores", "response_length", "truncated", "total_length",
    "index", "prompts", "labels", "images", "mm_train_inputs", "info",
}


def test_agent_outputs() -> None:
    trajs = trajectories()
    outs = to_openrlhf_agent_outputs(trajs)
    for t, o in zip(trajs, outs):
        assert set(o) == AGENT_OUTPUT_KEYS
        p = len(t.prompt_ids)
        assert o["observation_tokens"] == [*t.prompt_ids.tolist(), *t.response_ids.tolist()]
        assert o["action_ranges"] == [(p + s, p + e) for s, e, v in runs_of(t) if v]
        lps = o["rollout_log_probs"]
        assert len(lps) == len(o["observation_tokens"])
        inside = action_mask_from_ranges(o["action_ranges"], len(lps))
        assert all(lp == 0.0 for lp, a in zip(lps, inside) if not a)
        assert lps[p:] == t.response_logprobs.tolist()
        # round trip: the ranges give back the response mask
        assert inside[p:].tolist() == t.response_mask.tolist() and inside[:p].sum() == 0
        assert o["reward"] == o["scores"] == t.reward
        assert o["label"] == t.task_id and o["prompt"] == ""
    assert [o["truncated"] for o in outs] == [False, False, True, False]
    with pytest.raises(BadRequest, match="labels has 1 entries"):
        to_openrlhf_agent_outputs(trajs, labels=["x"])
    assert to_openrlhf_agent_outputs(trajs[0], prompts=["hi"])[0]["prompt"] == "hi"


def check_experience(exp, trajs: list, as_numpy, pad: int) -> None:
    n = len(trajs)
    totals = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    width = max(totals)
    seq = as_numpy(exp.sequences)
    assert seq.shape == (n, width) and seq.dtype == np.int64
    assert as_numpy(exp.attention_mask).shape == (n, width)
    action_mask, lps = as_numpy(exp.action_mask), as_numpy(exp.rollout_log_probs)
    assert action_mask.shape == (n, width - 1) and lps.shape == (n, width - 1) and lps.dtype == np.float32
    outs = to_openrlhf_agent_outputs(trajs)
    for i, (o, total) in enumerate(zip(outs, totals)):
        assert seq[i, :total].tolist() == o["observation_tokens"]  # right-padded
        assert (seq[i, total:] == pad).all()
        assert as_numpy(exp.attention_mask)[i].tolist() == [1] * total + [0] * (width - total)
        full = action_mask_from_ranges(o["action_ranges"], width)
        # entry j describes token j + 1: the one predicted from position j
        assert action_mask[i].tolist() == full[1:].tolist()
        expected_lps = np.zeros(width, np.float32)
        expected_lps[:total] = o["rollout_log_probs"]
        assert lps[i].tolist() == expected_lps[1:].tolist()
        ranges = o["action_ranges"]
        assert as_numpy(exp.response_length)[i] == (ranges[-1][1] - ranges[0][0] if ranges else 0)
    assert as_numpy(exp.rewards).dtype == np.float32 and as_numpy(exp.rewards).tolist() == [t.reward for t in trajs]
    assert as_numpy(exp.total_length).tolist() == totals
    assert as_numpy(exp.truncated).tolist() == [False, False, True, False]
    assert exp.labels == [t.task_id for t in trajs] and len(exp.prompts) == n
    assert set(exp.info) == {"reward", "score", "response_clip_ratio"}


def test_plain_experience() -> None:
    assert {f.name for f in dataclasses.fields(OpenRLHFExperience)} == EXPERIENCE_FIELDS
    trajs = trajectories()
    exp = to_openrlhf_experience(trajs, pad_token_id=5, use_trainer_class=False)
    assert isinstance(exp, OpenRLHFExperience)
    check_experience(exp, trajs, np.asarray, pad=5)
    assert exp.action_log_probs is None and exp.advantages is None
    clipped = to_openrlhf_experience(trajs, max_len=14, use_trainer_class=False)
    assert clipped.info["response_clip_ratio"].tolist() == [True, False, False, False]
    with pytest.raises(ConfigError, match="max_len=13"):
        to_openrlhf_experience(trajs, max_len=13, use_trainer_class=False)


def test_real_experience_class_and_batch_utilities() -> None:
    mod = real_module("openrlhf.trainer.ppo_utils.experience")
    torch = real_module("torch")
    assert {f.name for f in dataclasses.fields(mod.Experience)} == EXPERIENCE_FIELDS
    trajs = trajectories()
    exp = to_openrlhf_experience(trajs, pad_token_id=5)
    assert isinstance(exp, mod.Experience)
    assert exp.sequences.dtype == torch.int64 and exp.rewards.dtype == torch.float32
    check_experience(exp, trajs, lambda x: x.numpy(), pad=5)
    # OpenRLHF joins one-sample experiences by right padding: the same batch must come out.
    singles = [to_openrlhf_experience(t, pad_token_id=5) for t in trajs]
    joined = mod.Experience.concat_experiences(singles, pad_token_id=5)
    for name in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "rewards", "total_length"):
        assert getattr(joined, name).tolist() == getattr(exp, name).tolist(), name
    # and splits a batch into samples whose padding it strips by the attention mask
    items = mod.remove_padding_in_sequences(mod.split_experience_batch(exp))
    for item, o in zip(items, to_openrlhf_agent_outputs(trajs)):
        assert item.sequences.tolist() == o["observation_tokens"]
        assert item.action_mask.tolist() == action_mask_from_ranges(o["action_ranges"], len(item.sequences))[1:].tolist()
