"""The published server's ``sampling_params``, in rolloutd's terms.

That server builds its LLM client's config (OpenHands' ``LLMConfig`` plus NVIDIA's token-level
fields) from ``sampling_params`` after taking out the agent's keys (``max_iterations``, ...). Here:

- the fields that shape generation map onto rolloutd's: ``temperature``, ``top_p``, ``top_k`` and
  ``seed`` as they are, ``max_output_tokens`` (tokens per LLM call) onto ``max_tokens`` (tokens per
  model turn), ``max_iterations`` (agent steps) onto ``max_turns``, ``max_model_len`` onto
  ``max_context_tokens``;
- the fields that only configured how their LLM client reached the server or formatted its
  calls (:data:`CLIENT_ONLY`) are accepted and ignored, and the answer lists them;
- rolloutd's own keys (sampling fields and agent config) still work; anything else is refused by
  the agent's config check with the list of known fields (HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutd.native_io.errors import BadRequest

RENAMED = {"max_output_tokens": "max_tokens", "max_iterations": "max_turns", "max_model_len": "max_context_tokens"}
"""Their name -> rolloutd's (sampling or agent config); temperature, top_p, top_k, seed keep theirs."""

CLIENT_ONLY = frozenset({
    # how their LLM client reached the inference server (the gateway's /add_llm_server does that here)
    "model", "api_key", "base_url", "api_version", "custom_llm_provider", "ollama_base_url", "timeout",
    "num_retries", "retry_multiplier", "retry_min_wait", "retry_max_wait", "aws_access_key_id",
    "aws_secret_access_key", "aws_region_name", "openrouter_site_url", "openrouter_app_name",
    # how it rendered, logged and priced calls (rolloutd is always token-in/token-out with the
    # policy's own chat template, and records every token, so these have nothing to change)
    "modify_params", "drop_params", "log_completions", "log_completions_folder", "native_tool_calling",
    "token_level_generation", "custom_tokenizer", "enable_thinking", "caching_prompt", "disable_vision",
    "input_cost_per_token", "output_cost_per_token", "max_message_chars", "max_input_tokens",
    "reasoning_effort", "safety_settings", "completion_kwargs",
    # their agent's output repair and loop detector (rolloutd's agent keeps the model's tokens as made)
    "ensure_thinking_end_properly", "strict_loop_detector",
})


@dataclass
class Translated:
    params: dict[str, Any]
    """rolloutd's names: sampling fields and agent config, split later by the request mapping."""
    ignored: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        if not self.ignored:
            return None
        return (f"sampling_params {', '.join(self.ignored)} only configured the published server's LLM client; "
                "rolloutd talks token-in/token-out to the servers given to /add_llm_server and ignores them")


def translate(sampling_params: dict[str, Any]) -> Translated:
    """Their ``sampling_params`` in rolloutd's names; BadRequest when one setting is given twice."""
    params: dict[str, Any] = {}
    ignored = []
    for key, value in sampling_params.items():
        if key in CLIENT_ONLY:
            ignored.append(key)
            continue
        name = RENAMED.get(key, key)
        if name in params:
            raise BadRequest(f"sampling_params give {name} twice ({key} is rolloutd's {name}): send one of them")
        params[name] = value
    return Translated(params, sorted(ignored))
