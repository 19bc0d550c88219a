"""A veRL agent loop whose rollouts rolloutd runs, registered in veRL's registry as ``rolloutd``.

Read at verl 0.9.1, ``verl/experimental/agent_loop/agent_loop.py``: ``AgentLoopWorker`` builds one
agent loop per sample with ``hydra.utils.instantiate`` from the ``register``-ed entry (or an entry
of ``actor_rollout_ref.rollout.agent.agent_loop_config_path``, whose extra keys become constructor
arguments: ``rolloutd_address``, ``rolloutd_timeout_s``), calls ``run(sampling_params, **row)``
with the dataset row's fields, and pads and batches the ``AgentLoopOutput`` it returns.

The row's ``rolloutd_request`` field holds the rollout (:func:`rows.row_request`): a dict of
``RolloutRequest`` fields; ``n`` is 1 (veRL repeats rows itself).

Importing this module imports veRL: veRL configs name it, nothing in rolloutd does.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from rolloutd.client.adapters.rows import rollout_rows, row_request
from rolloutd.client.adapters.verl import to_verl_agent_loop_outputs
from rolloutd.native_io.errors import BadRequest

AGENT_NAME = "rolloutd"


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
        request = row_request(kwargs["rolloutd_request"], sampling_params)
        trajectories = await rollout_rows(self.rolloutd_address, [request], self.rolloutd_timeout_s)
        (output,) = to_verl_agent_loop_outputs(trajectories, use_trainer_class=True)
        return output
