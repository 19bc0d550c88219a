"""Padding, masks, position ids and collation shared by the trainer adapters."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from adapters_support import build, real_module, runs_of, trajectories
from hypothesis import given
from hypothesis import strategies as st

from rolloutd.client.adapters import (
    PaddedBatch,
    collate,
    length_mask,
    pad_sequences,
    position_ids,
    message_log_arrays,
    to_nemo_rl_batch,
    to_openrlhf_agent_outputs,
    to_openrlhf_experience,
    to_skyrl_generator_output,
    to_verl_agent_loop_outputs,
    to_verl_batch,
    unpad,
)
from rolloutd.client.adapters.common import mask_runs, masked_logprobs, model_spans, to_tensor
from rolloutd.native_io.errors import BadRequest, ConfigError


def test_pad_sequences_left_and_right() -> None:
    seqs = [np.array([1, 2, 3]), np.array([4]), np.array([], dtype=np.int32)]
    left = pad_sequences(seqs, side="left", pad_value=9)
    right = pad_sequences(seqs, side="right", pad_value=9)
    assert left.dtype == np.int64 and right.dtype == np.int64
    assert left.tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert right.tolist() == [[1, 2, 3], [4, 9, 9], [9, 9, 9]]
    fixed = pad_sequences(seqs, side="left", length=5)
    assert fixed.tolist() == [[0, 0, 1, 2, 3], [0, 0, 0, 0, 4], [0, 0, 0, 0, 0]]


def test_pad_sequences_refuses_to_cut_and_names_the_knob() -> None:
    with pytest.raises(ConfigError, match="prompt_length=2"):
        pad_sequences([np.array([1, 2, 3])], side="left", length=2, length_name="prompt_length")
    with pytest.raises(ConfigError, match="side"):
        pad_sequences([np.array([1])], side="middle")  # type: ignore[arg-type]


def test_length_mask_and_position_ids() -> None:
    assert length_mask([3, 1, 0], 4, side="left").tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert length_mask([3, 1, 0], 4, side="right").tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    # The layout drawn in batching's docstring: left-padded prompt, right-padded response.
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6, 6]]
    assert position_ids(mask).dtype == np.int64


def test_collate_layout_and_dtypes() -> None:
    trajs = trajectories()
    b = collate(trajs, pad_token_id=7)
    n, p, r = len(trajs), max(len(t.prompt_ids) for t in trajs), max(len(t.response_ids) for t in trajs)
    assert isinstance(b, PaddedBatch) and len(b) == n
    assert b.prompts.shape == (n, p) and b.responses.shape == (n, r)
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert getattr(b, name).shape == (n, p + r), name
    for name in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert getattr(b, name).dtype == np.int64, name
    assert b.response_logprobs.dtype == np.float32
    for i, t in enumerate(trajs):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        # prompts end at column p (left padding), responses start at column 0 (right padding)
        assert b.prompts[i, p - lp :].tolist() == t.prompt_ids.tolist()
        assert (b.prompts[i, : p - lp] == 7).all()
        assert b.responses[i, :lr].tolist() == t.response_ids.tolist()
        assert (b.responses[i, lr:] == 7).all()
        assert b.response_mask[i, :lr].tolist() == t.response_mask.tolist()
        assert (b.response_mask[i, lr:] == 0).all()
        assert b.response_logprobs[i, :lr].tolist() == t.response_logprobs.tolist()
        assert (b.response_logprobs[i][b.response_mask[i] == 0] == 0.0).all()
        assert b.attention_mask[i].sum() == lp + lr
        real_positions = b.position_ids[i][b.attention_mask[i] == 1]
        assert real_positions.tolist() == list(range(lp + lr))
    assert (b.input_ids == np.concatenate([b.prompts, b.responses], axis=1)).all()
    assert b.prompt_lengths.tolist() == [len(t.prompt_ids) for t in trajs]
    assert b.response_lengths.tolist() == [len(t.response_ids) for t in trajs]


def test_collate_round_trips_through_unpad() -> None:
    trajs = trajectories()
    b = collate(trajs, prompt_length=10, response_length=12)
    assert b.prompts.shape == (4, 10) and b.responses.shape == (4, 12)
    p = b.prompts.shape[1]
    prompts = unpad(b.prompts, b.attention_mask[:, :p])
    responses = unpad(b.responses, b.attention_mask[:, p:])
    masks = unpad(b.response_mask, b.attention_mask[:, p:])
    for t, pr, rs, mk in zip(trajs, prompts, responses, masks):
        assert pr.tolist() == t.prompt_ids.tolist()
        assert rs.tolist() == t.response_ids.tolist()
        assert mk.tolist() == t.response_mask.tolist()


def test_collate_fixed_length_too_small_is_an_error() -> None:
    with pytest.raises(ConfigError, match="response_length=3"):
        collate(trajectories(), response_length=3)


def test_masked_logprobs_zero_where_mask_is_zero() -> None:
    t = build("x", [1], [(1, [2, 3]), (0, [4])], reward=0.0)
    t.response_logprobs[2] = -5.0  # a producer bug: a logprob on an observation token
    assert masked_logprobs(t).tolist() == [t.response_logprobs[0], t.response_logprobs[1], 0.0]
    assert collate(t).response_logprobs[0, 2] == 0.0


def test_as_tensors_shares_memory_with_numpy() -> None:
    torch = real_module("torch")
    b = collate(trajectories())
    out = b.as_tensors("torch")
    assert out["input_ids"].dtype == torch.int64 and out["response_logprobs"].dtype == torch.float32
    b.input_ids[0, 0] = 12345
    assert int(out["input_ids"][0, 0]) == 12345
    assert b.as_tensors("numpy")["input_ids"] is b.input_ids
    with pytest.raises(ConfigError):
        to_tensor(b.input_ids, "jax")  # type: ignore[arg-type]


def test_empty_input_is_refused() -> None:
    with pytest.raises(BadRequest):
        collate([])
    with pytest.raises(BadRequest, match="not a rolloutd Trajectory"):
        collate([{"prompt_ids": [1]}])  # type: ignore[list-item]


@given(st.lists(st.integers(0, 1), max_size=40))
def test_mask_runs_partition_the_mask(values: list[int]) -> None:
    mask = np.array(values, dtype=np.uint8)
    runs = mask_runs(mask)
    rebuilt = [v for s, e, v in runs for _ in range(e - s)]
    assert rebuilt == values
    assert all(a[2] != b[2] and a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert model_spans(mask) == [(s, e) for s, e, v in runs if v == 1]


def test_mask_runs_match_the_obvious_computation() -> None:
    for t in trajectories():
        assert mask_runs(t.response_mask) == runs_of(t)


def test_importing_the_adapters_imports_no_trainer_and_no_torch() -> None:
    code = (
        "import sys, rolloutd.client.adapters\n"
        "heavy = ('torch', 'verl', 'skyrl', 'nemo_rl', 'openrlhf', 'ray')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_infra_failed_samples_are_marked_so_no_trainer_learns_from_them() -> None:
    good = build("ok", [1, 2], [(1, [3, 4]), (0, [5]), (1, [6])], reward=0.0)  # a real 0: trained on
    lost = build("lost", [1, 2], [(1, [3, 4]), (0, [5]), (1, [6])], reward=0.0, finish_reason="error",
                 sample_index=1, ended_by="inference")
    nemo = to_nemo_rl_batch([good, lost], tensor_type="numpy", use_trainer_class=False)
    assert nemo["loss_multiplier"].tolist() == [1.0, 0.0]
    skyrl = to_skyrl_generator_output([good, lost], use_trainer_class=False)
    assert skyrl["loss_masks"] == [[1, 1, 0, 1], [0, 0, 0, 0]]
    verl = to_verl_agent_loop_outputs([good, lost], use_trainer_class=False)
    assert [(o.extra_fields["reward_valid"], o.extra_fields["ended_by"]) for o in verl] == [
        (True, "model"), (False, "inference")]
    openrlhf = to_openrlhf_agent_outputs([good, lost])
    assert [o["extra_logs"]["reward_valid"] for o in openrlhf] == [1.0, 0.0]


def test_an_installed_trainer_that_does_not_import_fails_not_skips() -> None:
    """Only an absent trainer package skips; a broken import of an installed one is an error."""
    with pytest.raises(ModuleNotFoundError):
        real_module("torch.no_such_module_here")
    with pytest.raises(pytest.skip.Exception):
        real_module("no_such_trainer_package_here")
def trainable_tokens(trajs: list) -> dict[str, list[int]]:
    """Per adapter, the tokens of each row its trainer would put a loss on."""
    verl_batch = to_verl_batch(trajs, tensor_type="numpy", use_trainer_class=False)
    experience = to_openrlhf_experience(trajs, use_trainer_class=False)
    nemo = to_nemo_rl_batch(trajs, tensor_type="numpy", use_trainer_class=False)
    return {
        "collate": collate(trajs).response_mask.sum(axis=1).tolist(),
        "verl": [sum(o.response_mask) for o in to_verl_agent_loop_outputs(trajs, use_trainer_class=False)],
        "verl_batch": np.asarray(verl_batch.batch["response_mask"]).sum(axis=1).tolist(),
        "skyrl": [sum(m) for m in to_skyrl_generator_output(trajs, use_trainer_class=False)["loss_masks"]],
        "openrlhf": [sum(e - s for s, e in o["action_ranges"]) for o in to_openrlhf_agent_outputs(trajs)],
        "openrlhf_experience": np.asarray(experience.action_mask).sum(axis=1).tolist(),
        # NeMo-RL trains assistant messages with generation log-probabilities, times loss_multiplier.
        "nemo_rl": [int(m * message_log_arrays(log)["response_mask"].sum())
                    for m, log in zip(nemo["loss_multiplier"], nemo["message_log"])],
    }


@pytest.mark.parametrize("finish, ended", [("cancelled", "client"), ("timeout", "deadline"),
                                           ("eval_timeout", "deadline"), ("error", "sandbox"),
                                           ("error", "inference"), ("error", "daemon"), ("error", "task")])
def test_infrastructure_outcomes_have_no_trainable_token_in_any_adapter(finish: str, ended: str) -> None:
    """One rule for every adapter: a trajectory the model did not end keeps its tokens for
    inspection, but no trainer gets a loss on any of them (issue 27: veRL and OpenRLHF kept the
    full mask of a cancelled or timed-out sample, NeMo-RL zeroed only errors)."""
    runs = [(1, [3, 4]), (0, [5]), (1, [6])]
    good = build("ok", [1, 2], runs, reward=0.0)  # a real 0: trained on
    stopped = build("stopped", [1, 2], runs, reward=0.0, finish_reason=finish, sample_index=1, ended_by=ended)
    for adapter, counts in trainable_tokens([good, stopped]).items():
        assert counts == [3, 0], adapter
