"""What a job of the published rollout server's HTTP API means here, and what it gets back.

A ``/process`` body is ``{"instance": {...}, "sampling_params": {...}, "job_id": "..."}``:

- ``instance["data_source"]`` says where the task comes from: ``bundled`` (the bundled set, by
  ``instance_id``), a name registered with the gateway (``--dataset NAME=/abs/file.jsonl`` on the
  node, by ``instance_id``), or a task type (``swe``, ``command`` or one installed under the
  ``rolloutd.task_types`` entry points), in which case the instance itself is the task record.
  Anything else is refused (HTTP 400), as the published server refuses an unregistered source.
- ``sampling_params``: the sampling fields (``temperature``, ``top_p``, ``top_k``, ``max_tokens``
  per model turn, ``seed``, ``stop_token_ids``, ``ignore_eos``) go to the inference server; every
  other key is agent config (``max_turns``, ``max_context_tokens``, ...), checked by the agent.

The answer is one trajectory: its token arrays as JSON lists (this is the compatibility path; the
client gets the same arrays without JSON), its scalar fields, the fields the published handlers
return (``instance_id``, ``trajectory_id``, ``resolved``, ``finish``, ``error``) and ``timing``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from rolloutd.client.async_client import RolloutRequest
from rolloutd.native_io.errors import BadRequest, ConfigError, TaskError
from rolloutd.native_io.trajectory import Trajectory

from ..inference.base import SamplingParams
from ..tasks.base import get_task_type
from ..tasks.datasets import BUNDLED

SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"extra"}
GATEWAY_KEYS = frozenset({"data_source", "trajectory_id"})
"""Instance keys that address the job rather than describe the task (left out of inline records)."""


@dataclass(frozen=True)
class DataSources:
    """Data-source names the gateway accepts besides task types: name -> dataset on the node."""

    datasets: dict[str, str] = field(default_factory=lambda: {BUNDLED: BUNDLED})

    @classmethod
    def parse(cls, specs: list[str]) -> DataSources:
        """From ``NAME=/absolute/path.jsonl`` strings (the path as the node daemon sees it)."""
        datasets = {BUNDLED: BUNDLED}
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path.endswith(".jsonl") or not PurePosixPath(path).is_absolute():
                raise ConfigError(f"--dataset {spec!r}: write NAME=/absolute/path/on/the/node.jsonl")
            datasets[name] = path
        return cls(datasets)

    def describe(self) -> str:
        return ", ".join(sorted(self.datasets))


def rollout_request(instance: Any, sampling_params: Any, sources: DataSources, *, timeout_s: float) -> RolloutRequest:
    """The rollout request (one sample) for a ``/process`` job; BadRequest says what is wrong."""
    if not isinstance(instance, dict):
        raise BadRequest("'instance' must be a JSON object with at least 'data_source'")
    if not isinstance(sampling_params, dict):
        raise BadRequest("'sampling_params' must be a JSON object")
    source = instance.get("data_source")
    if not isinstance(source, str) or not source:
        raise BadRequest("instance.data_source must be a non-empty string")
    sampling = {k: v for k, v in sampling_params.items() if k in SAMPLING_KEYS}
    try:
        SamplingParams(**{"max_tokens": 1024, **sampling})  # refused here, not as a failed trajectory
    except (ConfigError, TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling_params: {e}") from e
    agent_config = {k: v for k, v in sampling_params.items() if k not in SAMPLING_KEYS}
    common = {"n": 1, "sampling": sampling, "agent_config": agent_config, "timeout_s": timeout_s}
    if source in sources.datasets:
        instance_id = instance.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise BadRequest(f"instance.instance_id must name a task of data source {source!r}")
        return RolloutRequest(task_id=instance_id, dataset=sources.datasets[source], **common)
    try:
        task_type = get_task_type(source)
    except TaskError as e:
        raise BadRequest(f"unknown data_source {source!r}: not a registered data source ({sources.describe()}; "
                         f"add one with --dataset NAME=/path.jsonl) and not a task type ({e})") from e
    record = {k: v for k, v in instance.items() if k not in GATEWAY_KEYS} | {"type": source}
    try:
        task_type.parse(record)
    except TaskError as e:
        raise BadRequest(f"instance is not a valid {source!r} task: {e}") from e
    return RolloutRequest(task=record, **common)


def unstarted_trajectory(request_id: str, request: RolloutRequest) -> Trajectory:
    """The answer for a job cancelled before any of it ran: no tokens, finish reason ``cancelled``."""
    task_id = request.task_id or str((request.task or {}).get("instance_id", ""))
    arrays = {name: np.zeros(0, dtype=dtype) for name, dtype in Trajectory.ARRAY_DTYPES.items()}
    return Trajectory(request_id=request_id, sample_index=0, task_id=task_id, reward=0.0, finish_reason="cancelled",
                      num_turns=0, **arrays)


def timing(trajectory: Trajectory, wall_s: float) -> dict[str, Any]:
    """The published server's per-job timing: stage seconds count, queue waits do not."""
    stages = {name: float(trajectory.stage_s.get(name, 0.0)) for name in ("init", "run", "eval")}
    counted = sum(stages.values())
    return {"init_time": stages["init"], "run_time": stages["run"], "eval_time": stages["eval"],
            "others_time": max(0.0, wall_s - counted), "counted_elapsed": counted,
            "timeout_triggered": trajectory.finish_reason == "timeout"}


def result_json(trajectory: Trajectory, *, job_id: str, instance: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The ``/process`` answer: the trajectory with its arrays as lists, plus ``timing``."""
    body = trajectory.scalar_fields()
    body.update({name: getattr(trajectory, name).tolist() for name in Trajectory.ARRAY_FIELDS})
    body.update({
        "job_id": job_id,
        "instance_id": trajectory.task_id,
        "trajectory_id": instance.get("trajectory_id"),
        "data_source": instance.get("data_source"),
        "weight_versions": trajectory.weight_versions,
        "resolved": trajectory.finish_reason != "error" and trajectory.reward >= 1.0,
        "finish": trajectory.finish_reason == "completed",
        "error": trajectory.error_message,
        "timing": timing(trajectory, wall_s),
    })
    return body


def server_address(address: Any) -> str:
    """An inference server address as the node takes it: a bare ``host:port`` gets ``http://``, and
    an OpenAI base URL's ``/v1`` is dropped (the backends address the server's root)."""
    if not isinstance(address, str) or not address.strip():
        raise BadRequest('send {"address": "http://host:port"} (also host:port, sglang+http://..., vllm+http://...)')
    address = address.strip().rstrip("/")
    if "://" not in address:
        address = "http://" + address
    return address.removesuffix("/v1")
