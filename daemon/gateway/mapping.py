"""What a job of the published rollout server's HTTP API means here, and what it gets back.

A ``/process`` body is ``{"instance": {...}, "sampling_params": {...}, "job_id": "..."}``:

- ``instance["data_source"]`` says where the task comes from: ``bundled`` (the bundled set, by
  ``instance_id``), a name registered with the gateway (``--dataset NAME=/abs/file.jsonl`` on the
  node, by ``instance_id``), a task type (``swe``, ``command`` or one installed under the
  ``rolloutd.task_types`` entry points), in which case the instance itself is the task record, or
  one of the published server's SWE source names (:data:`SWE_SOURCES`: SWE-Gym, SWE-bench, R2E-Gym
  instances), which become ``swe`` records (their JSON-string test lists parsed, the repository at
  ``/testbed`` in the instance's image unless the record says otherwise). In ``prorl`` mode a
  missing ``data_source`` means ``swebench``, as there. Anything else is refused (HTTP 400).
- ``sampling_params``: in ``prorl`` mode first translated from the published server's names
  (:mod:`.params`); then the sampling fields (``temperature``, ``top_p``, ``top_k``,
  ``max_tokens`` per model turn, ``seed``, ``stop_token_ids``, ``ignore_eos``) go to the inference
  server and every other key is agent config (``max_turns``, ``max_context_tokens``, ...), checked
  by the agent.

The answer is one trajectory: its token arrays as JSON lists (this is the compatibility path; the
client gets the same arrays without JSON), its scalar fields, the fields the published handlers
return (``instance_id``, ``trajectory_id``, ``resolved``, ``finish``, ``error``) and ``timing``;
in ``prorl`` mode also what :mod:`.compat` adds.
"""

from __future__ import annotations

import dataclasses
import json
import re
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


SWE_SOURCES = frozenset({"swebench", "swegym", "r2egym"})
"""The published server's SWE data sources, normalised (lower case, no '-', '_' or spaces):
``swebench`` is its SWE handler's name, ``swe-gym`` maps to it there, R2E-Gym instances use it."""
SWE_TESTBED = "/testbed"
"""Where SWE-bench and SWE-Gym images hold the repository."""


def rollout_request(instance: dict[str, Any], sampling: dict[str, Any], sources: DataSources, *, timeout_s: float,
                    prorl: bool) -> RolloutRequest:
    """The rollout request (one sample) for a ``/process`` job, ``sampling`` already in rolloutd's
    names; BadRequest says what is wrong."""
    source = instance.get("data_source", "swebench" if prorl else None)
    if not isinstance(source, str) or not source:
        raise BadRequest("instance.data_source must be a non-empty string")
    sampling_fields = {k: v for k, v in sampling.items() if k in SAMPLING_KEYS}
    try:
        SamplingParams(**{"max_tokens": 1024, **sampling_fields})  # refused here, not as a failed trajectory
    except (ConfigError, TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling_params: {e}") from e
    agent_config = {k: v for k, v in sampling.items() if k not in SAMPLING_KEYS}
    common = {"n": 1, "sampling": sampling_fields, "agent_config": agent_config, "timeout_s": timeout_s}
    if source in sources.datasets:
        instance_id = instance.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise BadRequest(f"instance.instance_id must name a task of data source {source!r}")
        return RolloutRequest(task_id=instance_id, dataset=sources.datasets[source], **common)
    record = {k: v for k, v in instance.items() if k not in GATEWAY_KEYS}
    if re.sub(r"[-_ ]", "", source.lower()) in SWE_SOURCES:
        source, record = "swe", swe_record(record)
    try:
        task_type = get_task_type(source)
    except TaskError as e:
        raise BadRequest(f"unknown data_source {source!r}: not one of the published server's SWE sources "
                         f"(swebench, swe-gym, SWE-Gym, SWE-bench, r2egym: rolloutd's swe task type), not a "
                         f"registered data source ({sources.describe()}; add one with --dataset NAME=/path.jsonl) "
                         f"and not a task type ({e})") from e
    record["type"] = source
    try:
        task_type.parse(record)
    except TaskError as e:
        raise BadRequest(f"instance is not a valid {source!r} task: {e}") from e
    return RolloutRequest(task=record, **common)


def swe_record(instance: dict[str, Any]) -> dict[str, Any]:
    """A SWE-bench / SWE-Gym instance as a ``swe`` task record: the test lists, which those
    datasets store as JSON strings, become lists; the repository is the image's ``/testbed``
    unless the record brings its own (``files``, ``repo_dir`` or ``workdir``)."""
    record = dict(instance)
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(record.get(key), str):
            try:
                record[key] = json.loads(record[key])
            except ValueError as e:
                raise BadRequest(f"instance.{key} is a string but not a JSON list of test ids: {e}") from e
    if not any(k in record for k in ("files", "repo_dir", "workdir")):
        record["workdir"] = SWE_TESTBED
    return record


def unstarted_trajectory(request_id: str, request: RolloutRequest) -> Trajectory:
    """The answer for a job cancelled before any of it ran: no tokens, finish reason ``cancelled``."""
    task_id = request.task_id or str((request.task or {}).get("instance_id", ""))
    arrays = {name: np.zeros(0, dtype=dtype) for name, dtype in Trajectory.ARRAY_DTYPES.items()}
    return Trajectory(request_id=request_id, sample_index=0, task_id=task_id, reward=0.0, finish_reason="cancelled",
                      num_turns=0, ended_by="client", **arrays)


def timing(trajectory: Trajectory, wall_s: float) -> dict[str, Any]:
    """The published server's per-job timing: stage seconds count, queue waits do not."""
    stages = {name: float(trajectory.stage_s.get(name, 0.0)) for name in ("init", "run", "eval")}
    counted = sum(stages.values())
    return {"init_time": stages["init"], "run_time": stages["run"], "eval_time": stages["eval"],
            "others_time": max(0.0, wall_s - counted), "counted_elapsed": counted,
            "timeout_triggered": trajectory.finish_reason in ("timeout", "eval_timeout")}


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
        "resolved": trajectory.reward_valid and trajectory.reward >= 1.0,
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
