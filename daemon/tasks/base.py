"""Task types: how a task record is checked, set up in a sandbox, and evaluated into a reward.

A task type is a small class registered by name (``register_task_type``) or through the
``rolloutd.task_types`` entry-point group, so new benchmarks plug in without touching the
pipeline. Datasets are JSONL files of records (or the bundled set); records are validated when a
request names them, and bad ones are refused with the field at fault.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import TaskError

if TYPE_CHECKING:
    from ..sandbox.lease import Lease

log = logging.getLogger(__name__)

SHELL_STEP_TIMEOUT_S = 30.0
"""A shell built-in in a task's set-up (``cd``): anything longer means the shell is stuck."""


@dataclass(frozen=True)
class Task:
    instance_id: str
    type: str
    problem_statement: str
    image: str
    record: dict[str, Any] = field(hash=False, compare=False)
    """The full validated record; type-specific fields live here."""


@dataclass
class EvalResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


class TaskType(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def parse(self, record: dict[str, Any]) -> Task:
        """Validate a record; raise TaskError naming the field at fault."""

    @abc.abstractmethod
    async def setup(self, task: Task, lease: "Lease", *, cache_dir: Path) -> str:
        """Prepare the task in a fresh sandbox; return the working folder (as the sandbox sees it).

        ``cache_dir`` is a host folder private to the caller for work shared by a task's samples."""

    @abc.abstractmethod
    async def evaluate(self, task: Task, lease: "Lease", workdir: str, *, timeout_s: float) -> EvalResult:
        """Run the task's evaluation in the sandbox the agent worked in."""


_TYPES: dict[str, TaskType] = {}


def register_task_type(task_type: TaskType) -> None:
    _TYPES[task_type.name] = task_type


def get_task_type(name: str) -> TaskType:
    if name not in _TYPES:
        for ep in entry_points(group="rolloutd.task_types"):
            if ep.name == name:
                register_task_type(ep.load()())
    try:
        return _TYPES[name]
    except KeyError:
        raise TaskError(f"unknown task type {name!r}; known: {sorted(_TYPES)} (or install one under the "
                        "'rolloutd.task_types' entry-point group)") from None


def require(record: dict[str, Any], key: str, kind: type | tuple[type, ...], *, default: Any = ...) -> Any:
    """``record[key]`` checked against ``kind``; TaskError names the instance and field."""
    if key not in record:
        if default is ...:
            raise TaskError(f"task {record.get('instance_id', '?')!r}: missing field {key!r}")
        return default
    value = record[key]
    if not isinstance(value, kind):
        raise TaskError(f"task {record.get('instance_id', '?')!r}: field {key!r} must be "
                        f"{getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value
