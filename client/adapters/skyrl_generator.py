"""A SkyRL generator whose rollouts rolloutd runs (SkyRL's ``GeneratorInterface``).

Read at skyrl 0.3.0, ``skyrl/train/generators/base.py`` (``GeneratorInterface.generate``: one
output row per input prompt, in input order) and ``skyrl/train/trainer.py`` (the trainer checks
the rows with ``validate_generator_output`` right after ``generate``).

Each input row's ``env_extras[i]["rolloutd_request"]`` holds the rollout (:func:`rows.row_request`):
a dict of ``RolloutRequest`` fields; ``n`` is 1 (SkyRL repeats prompts for its groups itself), and
SkyRL's temperature/top_p/top_k fill the sampling keys the request leaves out. The output's
``trajectory_ids`` are the input's, so SkyRL's grouping is kept exactly.

Rows the model did not end keep their place (SkyRL wants one row per prompt) with an all-zero loss
mask; :func:`rolloutd.client.adapters.skyrl.drop_unscored` takes them out before advantages.

Importing this module imports SkyRL (Python >= 3.12 for skyrl 0.3.0; see the README).
"""

from __future__ import annotations

from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from rolloutd.client.adapters.rows import rollout_rows, row_request
from rolloutd.client.adapters.skyrl import to_skyrl_generator_output
from rolloutd.native_io.errors import BadRequest


class RolloutdGenerator(GeneratorInterface):
    """``generate`` submits one rolloutd request per input row and returns SkyRL's ``GeneratorOutput``."""

    def __init__(self, address: str | None = None, *, timeout_s: float = 1800.0, **output_options: Any) -> None:
        """``address``: a node or router (default ``ROLLOUTD_ADDRESS`` or the local node);
        ``output_options``: passed to ``to_skyrl_generator_output`` (``token_level_rewards``, ...)."""
        self.address = address
        self.timeout_s = timeout_s
        self.output_options = output_options

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        extras = input_batch.get("env_extras") or []
        if len(extras) != len(input_batch["prompts"]) or any(
                not isinstance(e, dict) or "rolloutd_request" not in e for e in extras):
            raise BadRequest("RolloutdGenerator needs env_extras with a rolloutd_request dict for every prompt")
        sampling = input_batch.get("sampling_params")
        requests = [row_request(e["rolloutd_request"], sampling) for e in extras]
        trajectories = await rollout_rows(self.address, requests, self.timeout_s)
        output: Any = to_skyrl_generator_output(trajectories, use_trainer_class=True, **self.output_options)
        if input_batch.get("trajectory_ids") is not None:
            output["trajectory_ids"] = list(input_batch["trajectory_ids"])
        return output
