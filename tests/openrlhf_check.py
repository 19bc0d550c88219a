"""Run in the vLLM environment by test_trainer_openrlhf.py: OpenRLHF's rollout code imports vLLM
and Ray at import, which only that environment has together.

Loads rolloutd's executor through OpenRLHF's own loader (``_load_agent_executor``), executes one
group as OpenRLHF's engine does (one ``execute`` per sample, gathered), turns every result into an
``Experience`` with OpenRLHF's ``SamplesGenerator._process_response_into_experience``, and writes
what came out as JSON to the path given.

    python openrlhf_check.py SPEC.json OUT.json    (SPEC: {"executor", "labels", "max_len"})
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # their import-time deprecations
        from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
        from openrlhf.trainer.ray.vllm_engine import _load_agent_executor
        from vllm import SamplingParams

    executor = _load_agent_executor(spec["executor"])
    params = SamplingParams(temperature=1.0, max_tokens=256)

    async def group() -> list[dict[str, Any]]:
        return await asyncio.gather(*[
            executor.execute(prompt="write hi", label=label, sampling_params=params, max_length=spec["max_len"],
                             hf_tokenizer=None, llm_engine=None) for label in spec["labels"]])

    outputs = asyncio.run(group())
    # The method reads nothing of its instance: OpenRLHF's own conversion, called as it is.
    experiences = [SamplesGenerator._process_response_into_experience(None, o, max_len=spec["max_len"])
                   for o in outputs]
    Path(out_path).write_text(json.dumps({
        "executor": type(executor).__module__ + "." + type(executor).__qualname__,
        "outputs": outputs,
        "experiences": [{"sequences": e.sequences[0].tolist(), "action_mask": e.action_mask[0].tolist(),
                         "rollout_log_probs": e.rollout_log_probs[0].tolist(), "rewards": e.rewards.tolist(),
                         "reward_valid": e.info["reward_valid"].tolist()} for e in experiences],
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
