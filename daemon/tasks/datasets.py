"""Where task records come from: the bundled set, or a JSONL file on the node."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from rolloutd.native_io.errors import TaskError

from .base import Task, get_task_type, register_task_type
from .command import CommandTaskType
from .filecalc import FileCalcTaskType
from .harbor import HarborTaskType
from .swe import SweTaskType
from .swebench_task import SweBenchTaskType

register_task_type(SweTaskType())
register_task_type(CommandTaskType())
register_task_type(FileCalcTaskType())
register_task_type(HarborTaskType())
register_task_type(SweBenchTaskType())

BUNDLED = "bundled"


def bundled_dir() -> Path:
    """The bundled task set: data beside the code packages, ``bundled_tasks/`` in the source tree
    and ``rolloutd/bundled_tasks/`` once installed; each ``rolloutd.X`` lives in folder ``X/``
    (pyproject's package-dir), so the same relative path finds it in both."""
    return Path(__file__).resolve().parents[2] / "bundled_tasks"


@functools.cache
def _bundled_records() -> dict[str, dict[str, Any]]:
    records = {}
    for folder in sorted(p for p in bundled_dir().iterdir() if (p / "task.json").is_file()):
        meta = json.loads((folder / "task.json").read_text())
        records[meta["instance_id"]] = {
            **meta, "type": "swe", "repo_dir": str(folder / "repo"), "eval_dir": str(folder / "eval_tests"),
        }
    return records


@functools.lru_cache(maxsize=64)
def _jsonl_records(path: str, identity: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
    """The records of one version of the file (``identity``: inode, size, mtime), so an edited
    dataset is read again. Two records with one instance id are an error: which one a request
    meant cannot be known, and keeping either would train on the other's task."""
    records: dict[str, dict[str, Any]] = {}
    lines: dict[str, int] = {}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise TaskError(f"{path}:{n}: not valid JSON: {e}") from e
                    if not isinstance(rec, dict) or not isinstance(rec.get("instance_id"), str):
                        raise TaskError(f"{path}:{n}: a record must be a JSON object with a string instance_id")
                    key = rec["instance_id"]
                    if key in lines:
                        raise TaskError(f"{path}:{n}: instance_id {key!r} is already the record of line "
                                        f"{lines[key]}; give each record its own instance_id")
                    records[key], lines[key] = rec, n
    except OSError as e:
        raise TaskError(f"cannot read dataset {path}: {e}") from e
    return records


def _file_identity(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise TaskError(f"cannot read dataset {path}: {e}") from e
    return st.st_ino, st.st_size, st.st_mtime_ns


def dataset_records(dataset: str) -> dict[str, dict[str, Any]]:
    if dataset == BUNDLED:
        return _bundled_records()
    if not dataset.endswith(".jsonl") or not Path(dataset).is_absolute():
        raise TaskError(f"dataset {dataset!r}: use 'bundled' or an absolute path to a .jsonl file on the node")
    return _jsonl_records(dataset, _file_identity(dataset))


def resolve_task(dataset: str, instance_id: str, inline: dict[str, Any] | None) -> Task:
    """A validated Task from an inline record, or from ``dataset`` by ``instance_id``."""
    if inline is not None:
        record = inline
    else:
        records = dataset_records(dataset or BUNDLED)
        if instance_id not in records:
            raise TaskError(f"dataset {dataset or BUNDLED!r} has no instance {instance_id!r}")
        record = records[instance_id]
    if not isinstance(record, dict):
        raise TaskError("a task record must be a map")
    return get_task_type(str(record.get("type", "swe"))).parse(record)


def oracle_plans() -> dict[str, list[str]]:
    """The bundled tasks' scripted solves, keyed by instance id (for the scripted policy)."""
    plans = {}
    for folder in sorted(bundled_dir().iterdir()):
        oracle = folder / "oracle.json"
        if oracle.is_file():
            plans[folder.name] = json.loads(oracle.read_text())["replies"]
    return plans
