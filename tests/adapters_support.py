"""Trajectories with known arrays for the adapter tests, and a skip for absent trainer packages."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from types import ModuleType

import numpy as np
import pytest

from rolloutd.native_io.trajectory import ToolStats, Trajectory, TurnRecord

Run = tuple[int, list[int]]
"""(mask value, token ids) of one stretch of the response."""


def logprob_of(token: int) -> float:
    """A distinct, known, non-zero log-probability per token id (exact in float32)."""
    return -(token / 64.0)


def build(
    request_id: str,
    prompt: list[int],
    runs: list[Run],
    *,
    reward: float,
    finish_reason: str = "completed",
    sample_index: int = 0,
    ended_by: str = "model",
) -> Trajectory:
    ids, mask, logprobs, turns = [], [], [], []
    for value, tokens in runs:
        if value:
            turns.append(
                TurnRecord(start=len(ids), end=len(ids) + len(tokens), weight_version=f"w{len(turns)}",
                           finish_reason="length" if finish_reason == "max_tokens" else "stop")
            )
        ids += tokens
        mask += [value] * len(tokens)
        logprobs += [logprob_of(t) if value else 0.0 for t in tokens]
    return Trajectory(
        request_id=request_id,
        sample_index=sample_index,
        task_id=f"task-{request_id}",
        prompt_ids=np.array(prompt, dtype=np.int32),
        response_ids=np.array(ids, dtype=np.int32),
        response_mask=np.array(mask, dtype=np.uint8),
        response_logprobs=np.array(logprobs, dtype=np.float32),
        reward=reward,
        finish_reason=finish_reason,
        num_turns=len(turns),
        turns=turns,
        stage_s={"init": 0.5, "run": 4.0, "eval": 1.5},
        tools={"bash": ToolStats(count=2, total_s=1.25, max_s=1.0)},
        metrics={"tests_passed": len(prompt)},
        ended_by=ended_by,
    )


def trajectories() -> list[Trajectory]:
    """Four shapes: multi-turn ending on the model, single turn, starting and ending on an
    observation (cut by the token budget), and an empty response (a sandbox failure)."""
    return [
        build("a", [11, 12, 13, 14, 15], [(1, [21, 22, 23]), (0, [31, 32]), (1, [24, 25, 26, 27])], reward=1.0),
        build("b", [41, 42, 43], [(1, [51, 52])], reward=0.5, sample_index=1),
        build(
            "c", [61, 62, 63, 64, 65, 66, 67], [(0, [71]), (1, [81, 82]), (0, [72, 73, 74])],
            reward=-0.25, finish_reason="max_tokens", sample_index=2,
        ),
        build("d", [91, 92], [], reward=0.0, finish_reason="error", sample_index=3, ended_by="sandbox"),
    ]


def runs_of(t: Trajectory) -> list[tuple[int, int, int]]:
    """(start, end, value) runs of a trajectory's mask, computed the slow obvious way."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(t.response_mask.tolist()):
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], i + 1, v)
        else:
            out.append((i, i + 1, v))
    return out


def real_module(name: str) -> ModuleType:
    """The trainer's module; skip only when its package is not installed here. An installed
    trainer that fails to import (whatever broke it, rolloutd included) fails the test."""
    top = name.split(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{top} is not installed here; see tests/requirements-trainers.txt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def skyrl_module(name: str) -> ModuleType:
    """A module of the installed SkyRL release. skyrl 0.3.0 declares Python >= 3.11 but builds
    pydantic models from ``typing.TypedDict`` classes, which pydantic refuses before 3.12 (the
    next release requires 3.12). On 3.11 its modules are imported with ``typing.TypedDict`` bound
    to ``typing_extensions.TypedDict`` (what pydantic asks for, same behaviour) for the import
    only; nothing of SkyRL's code is changed or copied."""
    if sys.version_info >= (3, 12) or name in sys.modules:
        return real_module(name)
    import typing

    import typing_extensions

    plain = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    try:
        return real_module(name)
    finally:
        typing.TypedDict = plain  # type: ignore[misc]
