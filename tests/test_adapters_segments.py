"""Adapters never train across a rewritten history: each proxy segment becomes its own sample."""

from __future__ import annotations

import numpy as np

from rolloutd.client.adapters.batching import collate
from rolloutd.client.adapters.common import as_trajectory_list
from rolloutd.native_io.trajectory import Trajectory, TurnRecord


def rewritten() -> Trajectory:
    # Segment 0: prompt [1,2], response [10,11 (model), 12 (obs)]. Segment 1 (a rewrite): its own
    # prompt [1,2,99] (mask 0) then its response [20,21 (model)].
    response = np.array([10, 11, 12, 1, 2, 99, 20, 21], dtype=np.int32)
    mask = np.array([1, 1, 0, 0, 0, 0, 1, 1], dtype=np.uint8)
    logprobs = np.where(mask == 1, -0.5, 0.0).astype(np.float32)
    return Trajectory(
        request_id="r", sample_index=0, task_id="t", prompt_ids=np.array([1, 2], dtype=np.int32),
        response_ids=response, response_mask=mask, response_logprobs=logprobs, reward=1.0,
        finish_reason="completed", num_turns=2,
        turns=[TurnRecord(0, 2, "0", "stop"), TurnRecord(6, 8, "0", "stop")],
        template_append_only=False, segments=[(0, 3), (3, 8)],
        metrics={"history_segments": [{"in_arrays": True, "prompt_tokens": 2},
                                      {"in_arrays": True, "prompt_tokens": 3}]})


def test_rewritten_history_is_split_into_samples() -> None:
    first, second = as_trajectory_list([rewritten()])
    assert first.prompt_ids.tolist() == [1, 2] and first.response_ids.tolist() == [10, 11, 12]
    assert second.prompt_ids.tolist() == [1, 2, 99] and second.response_ids.tolist() == [20, 21]
    assert second.response_mask.tolist() == [1, 1] and [(t.start, t.end) for t in second.turns] == [(0, 2)]
    batch = collate([rewritten()])
    assert batch.prompts.shape[0] == 2  # two samples, none conditioned on the other's tokens


def test_plain_trajectories_pass_through_unchanged() -> None:
    t = rewritten()
    plain = Trajectory(**{**t.__dict__, "segments": [(0, 8)], "template_append_only": True, "metrics": {}})
    (same,) = as_trajectory_list(plain)
    assert same is plain
