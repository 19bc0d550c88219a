"""Who ended a sample: the model, or something that must not be scored as the model's.

A trainer that scores an infrastructure failure as reward 0 learns that the model did badly
when a sandbox died or an inference server restarted (NeMo Gym PR 2552, rLLM PR 710 report
exactly that). So every trajectory names who ended it (``Trajectory.ended_by``), and the
pipeline refills samples that infrastructure ended (``RolloutArgs.infra_retries``).

Time-outs: a sample that ran out of time getting its sandbox (the init stage) was ended by the
sandbox (and is refilled); one that ran out while the agent worked (``timeout``) or the tests ran
(``eval_timeout``) was ended by its ``deadline``: a slow inference server or a loaded node looks
exactly like a slow model there, so it is not scored (issue 27: a 0.0 would train the model on
the node's load). Its tokens are not trained on either; a task whose tests can hang should cap
them itself (pytest-timeout), so a hang fails the test and is the model's.
"""

from __future__ import annotations

from rolloutd.native_io.errors import (
    AgentError,
    BadRequest,
    ConfigError,
    InferenceError,
    InferenceRejected,
    RolloutdError,
    SandboxError,
    TaskError,
)


def ended_by(finish: str, error: RolloutdError | None, timed_out_stage: str | None) -> str:
    """The ``Trajectory.ended_by`` of a sample that finished with ``finish``."""
    if finish == "cancelled":
        return "client"
    if finish == "special_token":
        return "task"  # the task's environment showed text the policy refuses; a rerun meets it again
    if finish in ("timeout", "eval_timeout"):
        return "sandbox" if timed_out_stage == "init" else "deadline"
    if finish != "error":
        return "model"
    if isinstance(error, SandboxError):
        return "sandbox"
    if isinstance(error, (BadRequest, ConfigError, InferenceRejected)):
        return "request"  # the same input fails the same way again: not worth a refill
    if isinstance(error, InferenceError):
        return "inference"
    if isinstance(error, TaskError):
        return "task"
    if isinstance(error, AgentError):
        return "agent"
    return "daemon"
