"""TRL adapter: rolloutd as the rollout function of TRL's ``GRPOTrainer``.

Read at trl 1.16.0, ``trl/trainer/grpo_trainer.py``: ``rollout_func(prompts, trainer)`` gets the
process's prompts (each already repeated ``num_generations`` times, consecutively, by TRL's
``RepeatSampler``) and returns ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per
prompt), plus optional ``env_mask`` (1 = a model token trained on, 0 = an environment token: TRL
multiplies it into the loss mask) and any other key, which TRL hands to the reward functions as a
keyword argument. A reward function that returns ``None`` for a completion makes it "unscorable":
TRL leaves it out of the group baseline and forces its advantage to 0.

So a sample the model did not end (``reward_valid`` False: infrastructure, a broken task, a
cancel) is dropped in TRL's own terms, never scored 0: :func:`rolloutd_reward` returns None for it
and its ``env_mask`` is all zeros (:func:`trained_mask`), so none of its tokens trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from itertools import groupby
from typing import Any

from rolloutd.client.adapters.common import as_trajectory_list, masked_logprobs, trained_mask
from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.trajectory import Trajectory

REWARD_KEY = "rolloutd_reward"
"""The extra rollout field (and reward-function argument) carrying each sample's reward or None."""


def to_trl_rollout(trajectories: Trajectory | Sequence[Trajectory], *,
                   pad_token_id: int | None = None) -> dict[str, list[Any]]:
    """What a TRL ``rollout_func`` returns, one row per trajectory in input order.

    ``prompt_ids``/``completion_ids`` are the trajectory's tokens exactly; ``logprobs`` the
    server's, 0.0 on environment tokens; ``env_mask`` the loss mask; ``rolloutd_reward`` the reward,
    or None where it is no score; ``rolloutd_request_id``/``rolloutd_ended_by`` say whose row it is.

    TRL reads the last token of every completion, so an empty response (a sample that failed
    before the model spoke) becomes the one token ``pad_token_id`` with mask 0: it never trains.
    """
    trajs = as_trajectory_list(trajectories)
    empty = [t for t in trajs if len(t.response_ids) == 0]
    if empty and pad_token_id is None:
        raise BadRequest(f"trajectory {empty[0].request_id}/{empty[0].sample_index} has no response tokens and TRL "
                         f"needs at least one per completion: pass pad_token_id (the tokenizer's) to stand in, masked")
    rows = [(t.response_ids.tolist(), masked_logprobs(t).tolist(), trained_mask(t).tolist())
            if len(t.response_ids) else ([pad_token_id], [0.0], [0]) for t in trajs]
    return {
        "prompt_ids": [t.prompt_ids.tolist() for t in trajs],
        "completion_ids": [ids for ids, _, _ in rows],
        "logprobs": [lps for _, lps, _ in rows],
        "env_mask": [mask for _, _, mask in rows],
        REWARD_KEY: [float(t.reward) if t.reward_valid else None for t in trajs],
        "rolloutd_request_id": [t.request_id for t in trajs],
        "rolloutd_ended_by": [t.ended_by for t in trajs],
    }


def rolloutd_reward(completions: list[Any], rolloutd_reward: list[float | None], **_: Any) -> list[float | None]:
    """A TRL reward function: the reward rolloutd's evaluation gave each sample (None: unscorable)."""
    if len(rolloutd_reward) != len(completions):
        raise BadRequest(f"{len(rolloutd_reward)} rolloutd rewards for {len(completions)} completions: use "
                         f"rolloutd_reward with a rollout function from rolloutd.client.adapters.trl")
    return list(rolloutd_reward)


@dataclasses.dataclass
class TRLRolloutFunc:
    """A TRL ``rollout_func`` backed by a rolloutd node or router.

    Each run of equal consecutive prompts (one TRL group of ``n`` samples) becomes the rollout
    requests ``requests_of(prompt, n)`` returns, whose ``n`` must add up to the group's (one
    request of ``n`` samples, or several, e.g. one task under several plans); the samples come back
    in that order. A request the daemon refused raises (TRL has no way to skip a whole group).
    """

    client: RolloutClient
    requests_of: Callable[[Any, int], list[RolloutRequest]]
    timeout_s: float = 600.0
    pad_token_id: int | None = None
    """Stands in for an empty response (see :func:`to_trl_rollout`); default: the trainer's tokenizer's."""

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        requests = []
        for prompt, group in groupby(prompts):
            n = len(list(group))
            asked = self.requests_of(prompt, n)
            if sum(r.n for r in asked) != n:
                raise BadRequest(f"requests_of({prompt!r}, {n}) asked for {sum(r.n for r in asked)} samples: "
                                 f"their n must add up to the group's {n}")
            requests += asked
        ids = self.client.submit(requests)
        results = self.client.results(ids, timeout_s=self.timeout_s)
        trajectories: list[Trajectory] = []
        for request_id in ids:
            result = results[request_id]
            trajectories += sorted((t.copy() for t in result.trajectories), key=lambda t: t.sample_index)
            self.client.release(result)
        refused = [results[r].error for r in ids if results[r].error is not None]
        if refused:
            raise refused[0]
        pad = self.pad_token_id if self.pad_token_id is not None else getattr(
            getattr(trainer, "processing_class", None), "pad_token_id", None)
        out = to_trl_rollout(trajectories, pad_token_id=pad)
        if len(out["completion_ids"]) != len(prompts):
            raise BadRequest(f"{len(out['completion_ids'])} samples for {len(prompts)} prompts: a trajectory with a "
                             f"rewritten history (several segments) cannot be one TRL completion")
        return out
