"""The trajectory validator bites: each invariant fed a trajectory that breaks it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from adapters_support import build, trajectories

from rolloutd.native_io.trajectory import Trajectory, TurnRecord
from rolloutd.client.validate import trajectory_problems, validate_batch, validate_trajectory
from rolloutd.native_io.errors import InvalidTrajectory

pytestmark = pytest.mark.invalid_trajectories

RUNS = [(1, [3, 4]), (0, [5]), (1, [6, 7, 8])]


def good() -> Trajectory:
    return build("g", [1, 2], RUNS, reward=1.0)


def test_sound_trajectories_pass() -> None:
    validate_batch(trajectories())
    straddled = good()
    straddled.turns[1] = dataclasses.replace(straddled.turns[1], weight_spans=[("v1", 0, 1), ("v2", 1, 3)],
                                             straddled=True)
    validate_trajectory(straddled)


def broken(change: str) -> Trajectory:
    t = good()
    if change == "lengths":
        object.__setattr__(t, "response_mask", t.response_mask[:-1])
    elif change == "logprob under mask 0":
        t.response_logprobs[2] = -0.5
    elif change == "positive logprob":
        t.response_logprobs[0] = 0.5
    elif change == "mask value":
        t.response_mask[2] = 2
    elif change == "turn outside":
        t.turns[1] = dataclasses.replace(t.turns[1], end=9)
    elif change == "turn over observation":
        t.turns[0] = dataclasses.replace(t.turns[0], end=3)
    elif change == "tokens outside turns":
        t.turns.pop()
    elif change == "no version":
        t.turns[0] = dataclasses.replace(t.turns[0], weight_version="")
    elif change == "spans gap":
        t.turns[1] = dataclasses.replace(t.turns[1], weight_spans=[("v1", 0, 1), ("v2", 2, 3)], straddled=True)
    elif change == "unmarked straddle":
        t.turns[1] = dataclasses.replace(t.turns[1], weight_spans=[("v1", 0, 1), ("v2", 1, 3)])
    elif change == "reward of infra":
        t.ended_by, t.finish_reason = "sandbox", "error"
    elif change == "model ended a timeout":
        t.finish_reason = "timeout"
    elif change == "nan reward":
        t.reward = float("nan")
    return t


CASES = {
    "lengths": "differ in length", "logprob under mask 0": "mask 0", "positive logprob": "not finite values <= 0",
    "mask value": "other than 0 and 1", "turn outside": "not inside the response", "turn over observation":
    "covers tokens with mask 0", "tokens outside turns": "the turns hold", "no version": "no weight version",
    "spans gap": "do not cover", "unmarked straddle": "not marked straddled", "reward of infra":
    "only model outcomes carry a reward", "model ended a timeout": "is not the model's", "nan reward": "not a finite",
}


@pytest.mark.parametrize("change", sorted(CASES))
def test_each_broken_invariant_is_named(change: str) -> None:
    t = broken(change)
    with pytest.raises(InvalidTrajectory, match=CASES[change]):
        validate_trajectory(t)
    with pytest.raises(InvalidTrajectory, match="problem"):
        validate_batch([good(), t])


def test_a_batch_with_a_sample_twice_is_refused() -> None:
    with pytest.raises(InvalidTrajectory, match="g/0 appears more than once"):
        validate_batch([good(), good()])
    assert trajectory_problems(good()) == []


def test_an_empty_trajectory_of_a_failure_is_sound() -> None:
    empty = np.zeros(0, dtype=np.int32)
    t = Trajectory(request_id="r", sample_index=0, task_id="t", prompt_ids=empty, response_ids=empty,
                   response_mask=np.zeros(0, np.uint8), response_logprobs=np.zeros(0, np.float32), reward=0.0,
                   finish_reason="cancelled", num_turns=0, ended_by="client")
    validate_trajectory(t)
    assert TurnRecord(0, 0, "v", "stop").weight_spans == []


def test_the_gateways_unstarted_job_is_a_client_outcome() -> None:
    """A job cancelled before it ran was labelled as ended by the model (trainable, reward 0.0)."""
    from rolloutd.client.async_client import RolloutRequest
    from rolloutd.daemon.gateway.mapping import unstarted_trajectory

    t = unstarted_trajectory("job-1", RolloutRequest(task_id="wordwrap-001"))
    validate_trajectory(t)
    assert not t.reward_valid
