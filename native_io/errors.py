"""The one exception hierarchy of rolloutd.

Every error has a stable ``code`` that crosses the wire (never a pickled exception or a class
path); :func:`error_from_code` turns a code and message back into the matching class on the
client side. Each class also inherits the matching builtin, so ``except TimeoutError`` works
without knowing our names.
"""

from __future__ import annotations

from typing import ClassVar


class RolloutdError(Exception):
    """Root of every error rolloutd raises on purpose."""

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, details: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, object] = details or {}


# --- configuration and input -------------------------------------------------------------


class ConfigError(RolloutdError, ValueError):
    code = "CONFIG"


class BadRequest(RolloutdError, ValueError):
    """The request could not be understood: malformed frames, unknown fields, wrong types."""

    code = "BAD_REQUEST"


class UnsupportedVersion(BadRequest):
    code = "UNSUPPORTED_VERSION"


class MessageTooLarge(BadRequest):
    code = "MESSAGE_TOO_LARGE"


class InvalidBody(BadRequest):
    """An HTTP body that is not the route's JSON object (bad JSON, a missing or mistyped field);
    ``details["errors"]`` lists each fault as ``{"type", "loc", "msg"}``, the way FastAPI answers 422."""

    code = "INVALID_BODY"


class DuplicateRequest(RolloutdError, ValueError):
    code = "DUPLICATE_REQUEST"


class InvalidTrajectory(RolloutdError, ValueError):
    """A trajectory breaks an invariant a trainer relies on (``rolloutd.client.validate``)."""

    code = "INVALID_TRAJECTORY"


class PermissionDenied(RolloutdError, PermissionError):
    code = "PERMISSION_DENIED"


class NotFound(RolloutdError, LookupError):
    code = "NOT_FOUND"


class MissingDependency(RolloutdError, ImportError):
    """An optional package (a trainer, torch) is needed for what was asked and is not importable."""

    code = "MISSING_DEPENDENCY"


# --- capacity and lifecycle --------------------------------------------------------------


class Busy(RolloutdError, RuntimeError):
    """A bounded queue is full; retry later or raise the named limit."""

    code = "BUSY"


class ShuttingDown(RolloutdError, RuntimeError):
    code = "SHUTTING_DOWN"


class DaemonUnavailable(RolloutdError, ConnectionError):
    """The client cannot reach a daemon at the configured address."""

    code = "DAEMON_UNAVAILABLE"


class DaemonLost(RolloutdError, ConnectionError):
    """The daemon went away (its connection closed, or it stopped answering heartbeats) while
    this call was pending; what it was doing is lost."""

    code = "DAEMON_LOST"


class DaemonRunning(RolloutdError, RuntimeError):
    """Another daemon of the same kind already holds this run folder."""

    code = "DAEMON_RUNNING"


class WorkerLost(RolloutdError, RuntimeError):
    """The worker that was running this request died; the request may have had side effects."""

    code = "WORKER_LOST"


class NodeLost(RolloutdError, RuntimeError):
    code = "NODE_LOST"


class Cancelled(RolloutdError):
    code = "CANCELLED"


class OperationTimeout(RolloutdError, TimeoutError):
    code = "TIMEOUT"


# --- sandboxes and sessions --------------------------------------------------------------


class SandboxError(RolloutdError, RuntimeError):
    code = "SANDBOX"


class SandboxStartError(SandboxError):
    code = "SANDBOX_START"


class SandboxLost(SandboxError):
    """The sandbox (or the worker owning it) is gone; open a new one."""

    code = "SANDBOX_LOST"


class SandboxLimit(SandboxLost):
    """The sandbox went over one of its caps (the message names it) and was ended; the node's
    other sandboxes were not touched."""

    code = "SANDBOX_LIMIT"


class SandboxPathRefused(SandboxError):
    """A path the daemon was to write or read in a sandbox's workspace goes through a symbolic link
    (or names something other than a file): the sandbox made it, and could point it anywhere on
    the host, so the daemon does not follow it."""

    code = "SANDBOX_PATH_REFUSED"


class ImageError(SandboxError):
    code = "IMAGE"


class SessionError(SandboxError):
    code = "SESSION"


class CommandTimeout(SessionError, TimeoutError):
    code = "COMMAND_TIMEOUT"


class KernelError(SessionError):
    code = "KERNEL"


class KernelDied(KernelError):
    code = "KERNEL_DIED"


# --- inference -----------------------------------------------------------------------------


class InferenceError(RolloutdError, RuntimeError):
    code = "INFERENCE"


class NoInferenceServer(InferenceError):
    code = "NO_INFERENCE_SERVER"


class InferenceProtocolError(InferenceError):
    """A server answered with something that breaks the documented protocol."""

    code = "INFERENCE_PROTOCOL"


class InferenceTimeout(InferenceError, TimeoutError):
    code = "INFERENCE_TIMEOUT"


class InferenceRejected(InferenceError):
    """The server refused the request itself (HTTP 4xx: bad parameters, wrong API key); another
    server would refuse it too, so it is not retried."""

    code = "INFERENCE_REJECTED"


class ContextLengthExceeded(InferenceRejected):
    """The prompt plus the tokens asked for do not fit the server's context window
    (``max_model_len``); the agent ends the trajectory with finish reason ``context_length``."""

    code = "CONTEXT_LENGTH"


# --- rollouts --------------------------------------------------------------------------------


class TaskError(RolloutdError, ValueError):
    code = "TASK"


class SpecialTokenInContent(TaskError):
    """Text the model did not write (tool output, a task's instructions, a harness's message)
    holds an added token's text and the trajectory's ``content_special_tokens`` is ``reject``;
    ``details`` names the ``token`` and the message's ``role``."""

    code = "SPECIAL_TOKEN"


class AgentError(RolloutdError, RuntimeError):
    code = "AGENT"


class ToolCallError(AgentError):
    """The model's tool call could not be run as written (bad JSON, unknown tool, wrong
    arguments, a failed edit); the agent turns it into an observation for the model."""

    code = "TOOL_CALL"


def _all_subclasses(cls: type[RolloutdError]) -> list[type[RolloutdError]]:
    out: list[type[RolloutdError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[RolloutdError]] = {RolloutdError.code: RolloutdError}
for _cls in _all_subclasses(RolloutdError):
    assert _cls.code not in _BY_CODE, f"duplicate error code {_cls.code}"
    _BY_CODE[_cls.code] = _cls


def error_from_code(code: str, message: str, details: dict[str, object] | None = None) -> RolloutdError:
    """The exception a client raises for an error reply; unknown codes map to the root class."""
    exc = _BY_CODE.get(code, RolloutdError)(message, details=details)
    if exc.code != code:
        exc.details.setdefault("code", code)
    return exc


def known_codes() -> frozenset[str]:
    return frozenset(_BY_CODE)
