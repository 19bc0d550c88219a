"""veRL adapter: trajectories as agent-loop outputs, or as the padded ``DataProto`` batch.

Field names, dtypes and layout follow veRL (read at verl-project/verl 1dda039 and release 0.9.1):
``verl/experimental/agent_loop/agent_loop.py`` (``AgentLoopOutput``, ``AgentLoopMetrics``,
``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``, ``AgentLoopManager``) and
``verl/protocol.py`` (``DataProto``).

- :func:`to_verl_agent_loop_outputs`: one unpadded ``AgentLoopOutput`` per trajectory, what a
  custom ``AgentLoopBase.run`` returns.
- :func:`to_verl_batch`: the batch ``AgentLoopManager.generate_sequences`` returns: tensors
  ``prompts`` (left-padded), ``responses`` (right-padded), ``response_mask``, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``rollout_log_probs``, ``rm_scores`` (the reward on the
  last response token) and the non-tensor ``__num_turns__``.

With veRL importable the real classes come back (``AgentLoopOutput``, ``DataProto`` with torch
tensors); otherwise dataclasses with the same field names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rolloutd.client.adapters.batching import collate
from rolloutd.client.adapters.common import (
    TensorType,
    as_trajectory_list,
    masked_logprobs,
    stage_times,
    tensors,
    trained_mask,
    trainer_module,
    turn_versions,
)
from rolloutd.native_io.errors import BadRequest, ConfigError
from rolloutd.native_io.trajectory import Trajectory

AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"
PROTOCOL_MODULE = "verl.protocol"
PACKAGE = "verl"


@dataclass
class VerlAgentLoopMetrics:
    """Same fields as veRL's ``AgentLoopMetrics`` (seconds, and a count)."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1
    """-1: not known (veRL's own convention)."""


@dataclass
class VerlAgentLoopOutput:
    """Same fields as veRL's ``AgentLoopOutput`` (a pydantic model there)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    metrics: VerlAgentLoopMetrics
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_output: list[dict[str, Any]] | None = None


@dataclass
class VerlBatch:
    """Same attributes as veRL's ``DataProto``: tensors, per-sample numpy arrays, batch info."""

    batch: dict[str, Any]
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return len(self.non_tensor_batch["__num_turns__"])


def verl_num_turns(trajectory: Trajectory) -> int:
    """veRL's ``num_turns``: chat messages including the prompt (user, assistant and tool ones).

    veRL's single-turn loop reports 2 and its tool loop ``user + assistant turns + 1``
    (``verl/experimental/agent_loop/{single_turn,tool}_agent_loop.py``); each mask run of the
    response is one assistant or one observation message, and the prompt is one more.
    """
    mask = np.asarray(trajectory.response_mask)
    runs = int(np.count_nonzero(np.diff(mask))) + 1 if mask.size else 0
    return 1 + runs


def verl_metrics(trajectory: Trajectory) -> VerlAgentLoopMetrics:
    times = stage_times(trajectory)
    return VerlAgentLoopMetrics(
        generate_sequences=times.model_s, tool_calls=times.tools_s, compute_score=times.eval_s
    )


def _extra_fields(trajectory: Trajectory) -> dict[str, Any]:
    return {
        "request_id": trajectory.request_id,
        "task_id": trajectory.task_id,
        "sample_index": trajectory.sample_index,
        "finish_reason": trajectory.finish_reason,
        **turn_versions(trajectory),
        "reward_valid": trajectory.reward_valid,
        "ended_by": trajectory.ended_by,
    }


def to_verl_agent_loop_outputs(
    trajectories: Trajectory | Sequence[Trajectory], *, use_trainer_class: bool | None = None
) -> list[Any]:
    """One unpadded ``AgentLoopOutput`` per trajectory (veRL's class when importable).

    ``response_logprobs`` are 0.0 on observation tokens; ``extra_fields`` carries the request id,
    task id, sample index, finish reason and the weight version of each model turn.
    """
    mod = trainer_module(AGENT_LOOP_MODULE, package=PACKAGE, use_trainer_class=use_trainer_class)
    out_cls, metrics_cls = (
        (mod.AgentLoopOutput, mod.AgentLoopMetrics) if mod else (VerlAgentLoopOutput, VerlAgentLoopMetrics)
    )
    outputs = []
    for t in as_trajectory_list(trajectories):
        outputs.append(
            out_cls(
                prompt_ids=np.asarray(t.prompt_ids).tolist(),
                response_ids=np.asarray(t.response_ids).tolist(),
                response_mask=trained_mask(t).tolist(),
                response_logprobs=masked_logprobs(t).tolist(),
                reward_score=float(t.reward),
                num_turns=verl_num_turns(t),
                metrics=metrics_cls(**asdict(verl_metrics(t))),
                extra_fields=_extra_fields(t),
            )
        )
    return outputs


def _timing(metrics: list[VerlAgentLoopMetrics]) -> dict[str, float]:
    """The batch statistics ``AgentLoopManager`` puts in ``meta_info['timing']``."""
    timing: dict[str, float] = {}
    for name in ("generate_sequences", "tool_calls", "compute_score", "num_preempted"):
        values = np.array([getattr(m, name) for m in metrics], dtype=np.float64)
        timing[f"agent_loop/{name}/min"] = float(values.min())
        timing[f"agent_loop/{name}/max"] = float(values.max())
        timing[f"agent_loop/{name}/mean"] = float(values.mean())
    return timing


def to_verl_batch(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
    tensor_type: TensorType | None = None,
    use_trainer_class: bool | None = None,
) -> Any:
    """The padded batch veRL's rollout returns: a ``DataProto`` when veRL imports, else :class:`VerlBatch`.

    ``prompt_length``/``response_length`` are veRL's ``rollout.prompt_length`` and
    ``rollout.response_length`` (unset: the longest in the batch). ``tensor_type`` defaults to
    torch for a ``DataProto`` (the only kind it holds) and to numpy for a :class:`VerlBatch`.
    """
    mod = trainer_module(PROTOCOL_MODULE, package=PACKAGE, use_trainer_class=use_trainer_class)
    if mod is not None and tensor_type == "numpy":
        raise ConfigError("a veRL DataProto holds torch tensors: ask for tensor_type='torch' or use_trainer_class=False")
    kind: TensorType = tensor_type or ("torch" if mod is not None else "numpy")
    trajs = as_trajectory_list(trajectories)
    padded = collate(trajs, prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id)

    # veRL puts the sequence reward on the last response token (index length - 1; an empty
    # response lands on the last column, as veRL's own indexing does).
    rm_scores = np.zeros(padded.responses.shape, dtype=np.float32)
    rm_scores[np.arange(len(trajs)), padded.response_lengths - 1] = [t.reward for t in trajs]

    arrays = {
        "prompts": padded.prompts,
        "responses": padded.responses,
        "response_mask": padded.response_mask,
        "input_ids": padded.input_ids,
        "attention_mask": padded.attention_mask,
        "position_ids": padded.position_ids,
        "rollout_log_probs": padded.response_logprobs,
        "rm_scores": rm_scores,
    }
    non_tensor: dict[str, np.ndarray] = {"__num_turns__": np.array([verl_num_turns(t) for t in trajs], dtype=np.int32)}
    extras = [_extra_fields(t) for t in trajs]
    for key in extras[0]:
        column = np.empty(len(trajs), dtype=object)
        for i, e in enumerate(extras):
            column[i] = e[key]  # one by one: a slice assignment would broadcast equal-length lists
        non_tensor[key] = column
    meta_info = {"timing": _timing([verl_metrics(t) for t in trajs])}

    batch = tensors(arrays, kind)
    if mod is not None:
        return mod.DataProto.from_dict(tensors=batch, non_tensors=non_tensor, meta_info=meta_info)
    return VerlBatch(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


def drop_unscored(batch: Any) -> Any:
    """The rows of a veRL batch (``DataProto`` or :class:`VerlBatch`) whose reward is a score.

    veRL's GRPO baseline is the mean score of every row sharing a ``uid``, whatever its response
    mask, so a row the model did not end (``reward_valid`` False) would enter its group as a 0.
    veRL has no per-row drop flag; it drops rows by selecting the others (``DataProto.select_idxs``,
    as its DAPO group filter does): call this between ``generate_sequences`` and the advantages.
    """
    valid = batch.non_tensor_batch.get("reward_valid")
    if valid is None:
        raise BadRequest("the batch has no reward_valid column: it did not come from a rolloutd adapter "
                         "or agent loop")
    keep = np.flatnonzero(np.asarray(valid, dtype=bool))
    if isinstance(batch, VerlBatch):
        return VerlBatch(batch={k: v[keep] for k, v in batch.batch.items()},
                         non_tensor_batch={k: v[keep] for k, v in batch.non_tensor_batch.items()},
                         meta_info=batch.meta_info)
    return batch.select_idxs(keep)
