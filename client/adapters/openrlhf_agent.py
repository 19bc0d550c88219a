"""An OpenRLHF agent executor whose rollouts rolloutd runs: point ``--agent_func_path`` at this file.

Read at openrlhf 0.11.2: ``openrlhf/trainer/ray/vllm_engine.py`` loads the file's
``AgentExecutor`` (an ``AgentExecutorBase`` subclass, built without arguments) and calls
``execute(prompt, label, sampling_params, ...)`` once per sample of a prompt; the result dict
becomes an ``Experience`` in ``SamplesGenerator._process_response_into_experience``.

The dataset's label is the rollout: a JSON object of ``RolloutRequest`` fields (``rows.row_request``;
``n`` is 1: OpenRLHF asks once per sample); the node is ``ROLLOUTD_ADDRESS`` (or the local one).
OpenRLHF has no way to drop one sample of a group (its advantages reshape rewards into groups of
``n_samples_per_prompt``): an unscored sample keeps its reward 0.0 with no action range, so no
token of it trains, and ``extra_logs["reward_valid"]`` 0 says so; the daemon's ``infra_retries``
refill is what keeps such samples rare.
"""

from __future__ import annotations

import json
from typing import Any

from openrlhf.utils.agent import AgentExecutorBase

from rolloutd.client.adapters.openrlhf import to_openrlhf_agent_outputs
from rolloutd.client.adapters.rows import SAMPLING_FROM_TRAINER, rollout_rows, row_request
from rolloutd.native_io.errors import BadRequest

TIMEOUT_S = 1800.0


class RolloutdAgentExecutor(AgentExecutorBase):
    """``execute`` runs one rolloutd sample of the label's request and returns OpenRLHF's dict."""

    async def execute(self, prompt: str, label: str, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any, images: Any = None) -> dict[str, Any]:
        try:
            fields = json.loads(label)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"the label must be a JSON object of RolloutRequest fields: {e}") from e
        sampling = {k: getattr(sampling_params, k) for k in SAMPLING_FROM_TRAINER if hasattr(sampling_params, k)}
        trajectories = await rollout_rows(None, [row_request(fields, sampling)], TIMEOUT_S)
        (output,) = to_openrlhf_agent_outputs(trajectories, prompts=[prompt], labels=[label])
        return output


AgentExecutor = RolloutdAgentExecutor
"""The name OpenRLHF's loader looks for."""
