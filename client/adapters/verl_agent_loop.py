"""A veRL agent loop whose rollouts rolloutd runs, registered in veRL's registry as ``rolloutd``.

Read at verl 0.9.1, ``verl/experimental/agent_loop/agent_loop.py``: ``AgentLoopWorker`` builds one
agent loop per sample with ``hydra.utils.instantiate`` from the ``register``-ed entry (or an entry
of ``actor_rollout_ref.rollout.agent.agent_loop_config_path``, whose extra keys become constructor
arguments: ``rolloutd_address``, ``rolloutd_timeout_s``), calls ``run(sampling_params, **row)``
with the dataset row's fields, and pads and batches the ``AgentLoopOutput`` it returns.

The row's ``rolloutd_request`` field holds the rollout: a dict of ``RolloutRequest`` fields
(``task_id``/``dataset`` or ``task``, ``sampling``, ...); ``n`` is 1 (veRL repeats rows itself).
veRL's temperature/top_p/top_k fill the sampling keys the request leaves out.

Importing this module imports veRL: veRL configs name it, nothing in rolloutd does.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from rolloutd.client.adapters.verl import to_verl_agent_loop_outputs
from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest
from rolloutd.native_io.errors import BadRequest

AGENT_NAME = "rolloutd"
SAMPLING_FROM_VERL = ("temperature", "top_p", "top_k")


def rollout_request(fields: Any, sampling_params: dict[str, Any]) -> RolloutRequest:
    """The ``rolloutd_request`` of a dataset row as one sample's request."""
    if not isinstance(fields, dict):
        raise BadRequest(f"the row's rolloutd_request must be a dict of RolloutRequest fields, not {type(fields).__name__}")
    try:
        request = RolloutRequest(**{**fields, "n": 1})
    except TypeError as e:
        raise BadRequest(f"the row's rolloutd_request has a field RolloutRequest does not: {e}") from e
    # top_k -1 is veRL's "off"; rolloutd leaves an absent key at the server's default.
    inherited = {k: sampling_params[k] for k in SAMPLING_FROM_VERL
                 if k in sampling_params and not (k == "top_k" and sampling_params[k] == -1)}
    request.sampling = {**inherited, **request.sampling}
    return request


@register(AGENT_NAME)
class RolloutdAgentLoop(AgentLoopBase):
    """One sample: submitted to a rolloutd node or router, its trajectory as veRL's ``AgentLoopOutput``.

    The output's ``extra_fields`` carry ``reward_valid``: rows where it is False (the model did not
    end the sample) have an all-zero response mask and must leave the batch before advantages are
    computed (:func:`rolloutd.client.adapters.verl.drop_unscored`), so their reward is never a 0.
    """

    def __init__(self, *args: Any, rolloutd_address: str | None = None, rolloutd_timeout_s: float = 1800.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rolloutd_address = rolloutd_address
        self.rolloutd_timeout_s = rolloutd_timeout_s

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if "rolloutd_request" not in kwargs:
            raise BadRequest(f"agent loop {AGENT_NAME!r} needs a rolloutd_request field in each dataset row; "
                             f"this row has {sorted(kwargs)}")
        request = rollout_request(kwargs["rolloutd_request"], sampling_params)
        async with AsyncRolloutClient(self.rolloutd_address) as client:
            (request_id,) = await client.submit([request])
            results = await client.results([request_id], timeout_s=self.rolloutd_timeout_s)
            result = results[request_id]
            trajectories = [t.copy() for t in result.trajectories]
            await client.release(result)
        if result.error is not None:
            raise result.error
        (output,) = to_verl_agent_loop_outputs(trajectories, use_trainer_class=True)
        return output
