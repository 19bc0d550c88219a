"""The ``/process`` answer as the published server's clients read it (the gateway's default mode).

Read at NVIDIA-NeMo/ProRL-Agent-Server 40c1d8a (``openhands/nvidia/utils.py``:
``process_messages_from_agent_state``, the ``*_exception`` helpers and ``final_result``) and in
the clients that parse it (``scripts/tests/test_server*.py``, NeMo-RL-ProRL's
``OpenhandsEnvironment``). What those clients need, and what it is here:

- ``messages``: one per chat turn, ``role`` and ``content``; every message has ``token_ids`` (its
  own tokens, template framing included), model turns also ``input_ids`` (the whole context the
  server was given for that turn) and ``logprobs``. Here the prompt is one ``user`` message, each
  run of model tokens an ``assistant`` message and each run of observation tokens a ``tool``
  message, all cut from the recorded arrays, so concatenated ``token_ids`` are exactly
  ``prompt_ids + response_ids`` up to the last model turn. ``content`` is those ids decoded with
  the gateway's ``--tokenizer`` (the node's), special tokens and the template's framing included,
  and empty without one: rolloutd keeps ids, not text, and a wrong tokenizer would give wrong
  text silently. Trailing
  observations are left out as the published server leaves them out (NeMo-RL's reader asserts the
  last message is the assistant's); the flat arrays keep them.
- ``critical_error``: None when the sample is the model's to be scored; ``"timeout"`` when its
  time ran out or it was cancelled (the published server marks a cancel as a time-out); else the
  stage infrastructure failed in (``"init"``, ``"run"``, ``"eval"``), with ``ended_by`` saying
  what failed. ``filter`` is true when the sample must not be trained on: a critical error, or an
  ending that was not the model's own ``submit`` (``success`` false), as their ``final_result``
  decides. An infrastructure failure is thus never a silent reward of 0.
- ``tools``: the tool schemas the model was shown (theirs: the schemas passed to the chat
  template); rolloutd's per-tool statistics move to ``tool_stats``.
- ``git_patch``: the agent's diff of the repository, for SWE tasks (None elsewhere).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rolloutd.client.adapters.common import Decoder, hit_token_limit
from rolloutd.client.adapters.nemo_rl import trajectory_message_log
from rolloutd.native_io.trajectory import Trajectory

TIMEOUT = "timeout"


def critical_error(trajectory: Trajectory) -> str | None:
    if trajectory.finish_reason in ("timeout", "cancelled"):
        return TIMEOUT
    if trajectory.reward_valid:
        return None
    events = trajectory.metrics.get("stage_events") or []
    return str(events[-1][0]) if events else "init"


def messages(trajectory: Trajectory, tokenizer: Decoder | None = None) -> list[dict[str, Any]]:
    """The chat turns with their recorded ids (see the module docstring)."""
    log = trajectory_message_log(trajectory, tokenizer=tokenizer, prompt_role="user", observation_role="tool",
                                 as_generated=True)
    while log and log[-1]["role"] != "assistant":
        log.pop()
    context = np.concatenate([trajectory.prompt_ids, trajectory.response_ids]).astype(np.int64)
    out, offset = [], 0
    for message in log:
        ids = message["token_ids"]
        turn: dict[str, Any] = {"role": message["role"], "content": message["content"], "token_ids": ids.tolist()}
        if message["role"] == "assistant":
            turn["input_ids"] = context[:offset].tolist()
            turn["logprobs"] = message["generation_logprobs"].tolist()
        else:
            turn["input_ids"] = None
            turn["logprobs"] = None
        out.append(turn)
        offset += len(ids)
    return out


def prorl_answer(native: dict[str, Any], trajectory: Trajectory, notes: list[str],
                 tokenizer: Decoder | None = None) -> dict[str, Any]:
    """``native`` (the gateway's own answer) with the published server's fields laid over it."""
    critical = critical_error(trajectory)
    success = critical is None and trajectory.finish_reason == "completed"
    error = trajectory.error_message
    if error is None and not success:
        error = f"the trajectory ended with finish_reason {trajectory.finish_reason!r} (ended_by {trajectory.ended_by})"
    evaluation = trajectory.metrics.get("eval")
    answer = dict(native)
    answer["tool_stats"] = answer.pop("tools")
    answer.update({
        "messages": messages(trajectory, tokenizer),
        "tools": list(trajectory.metrics.get("tool_schemas") or []),
        "critical_error": critical,
        "success": success,
        "end_properly": not hit_token_limit(trajectory),
        "finish": trajectory.finish_reason == "completed",
        "resolved": critical is None and trajectory.reward >= 1.0,
        "filter": critical is not None or not success,
        "error": error,
        "git_patch": evaluation.get("git_patch") if isinstance(evaluation, dict) else None,
        "notes": notes,
    })
    return answer
