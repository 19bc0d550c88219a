"""The contract between the rollout pipeline and an agent, and the registry of agents by name.

The pipeline builds an :class:`AgentContext` for one trajectory (a leased sandbox, the inference
pool, the tokenizer, the sampling parameters, the deadline), calls ``await agent.run(ctx)`` and
gets an :class:`AgentOutcome`: the token arrays exactly as the inference server produced them plus
what the trainer and the logs need. Custom agents are Python classes registered by name with
:func:`register_agent`; :func:`make_agent` builds one from a plain config dict.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.trajectory import ToolStats, TurnRecord
from rolloutd.native_io.wire import ExecuteResult

from .content_text import check_mode
from .toolcalls import check_tool_names

TEMPLATE_CHECKS = ("every_turn", "final", "off")
AGENT_FINISH_REASONS = frozenset({"completed", "max_turns", "max_tokens", "context_length", "timeout", "cancelled",
                                  "special_token"})
_AGENT_NAME = re.compile(r"[a-z][a-z0-9_-]*")


@runtime_checkable
class AgentContext(Protocol):
    """What an agent may use during one trajectory; the pipeline implements it."""

    @property
    def instance_id(self) -> str:
        """The task's id (no whitespace); the agent writes it as ``Task id: <id>`` in its prompt."""

    @property
    def problem_statement(self) -> str: ...

    @property
    def workdir(self) -> str:
        """The repository root as the sandbox sees it; the shell starts there."""

    @property
    def tokenizer(self) -> Any:
        """The policy's Hugging Face tokenizer (its chat template renders the prompt)."""

    @property
    def has_ipython(self) -> bool:
        """True when the sandbox has an IPython kernel (otherwise do not offer the tool)."""

    @property
    def content_special_tokens(self) -> str:
        """The node's default for how text the model did not write treats added tokens' text
        (``text``, ``reject`` or ``special``; see :mod:`rolloutd.daemon.agents.content_text`)."""

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, top_logprobs: int = 0) -> GenerateResult:
        """One model turn for ``prompt_ids`` (the whole sequence so far), of at most
        ``max_tokens`` and at most the request's own ``sampling.max_tokens``, with the
        ``top_logprobs`` most likely tokens at each position where the backend reports them. Raises
        OperationTimeout once the trajectory's deadline has passed, ContextLengthExceeded when
        the server refuses the sequence as longer than its window."""

    def context_limit(self) -> int | None:
        """The inference servers' context window (prompt + generated), None when unknown."""

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        """A shell command in the sandbox's persistent shell. Raises CommandTimeout (output so
        far in ``details["output"]``), SandboxLost, OperationTimeout past the deadline."""

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        """A cell in the sandbox's IPython kernel. Raises CommandTimeout, KernelDied (the kernel
        was restarted), SandboxLost, OperationTimeout past the deadline."""


@dataclass
class AgentConfig:
    """Settings of the built-in agent (and the default config class of custom agents)."""

    max_turns: int = 30
    """Model turns at most; the trajectory then ends with finish reason ``max_turns``."""
    max_context_tokens: int = 32768
    """Bound on the whole sequence (prompt + response); reaching it ends with ``max_tokens``."""
    max_tokens_per_turn: int = 4096
    """Tokens one model turn may generate (fewer when the context has less room left)."""
    command_timeout_s: float = 60.0
    """Wall-time limit of one bash command or IPython cell; a timeout becomes an observation."""
    observation_max_chars: int = 10_000
    """Longer tool output is cut to its head and tail with a marker line between."""
    system_prompt: str | None = None
    """Replaces the built-in system prompt (the tools are still described by the template)."""
    tools: list[str] | None = None
    """The tools offered (names of the built-in ones; ``submit`` must be among them); None: all.
    A small policy learns faster on a short prompt: the schemas are most of it."""
    template_check: str = "final"
    """``every_turn``: re-render the conversation after each turn and check the template is
    append-only (costs a full render per turn); ``final``: check once at the end; ``off``."""
    content_special_tokens: str | None = None
    """How added tokens' text (``<|im_end|>``) in tool output, the task and other non-model text
    is encoded: ``text`` (as ordinary text), ``reject`` (the trajectory ends with finish reason
    ``special_token``), ``special`` (as the added token: the sandbox can forge the template);
    None: the node's ``content_special_tokens``."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "max_tokens_per_turn", "observation_max_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"agent config {name} must be an integer >= 1, got {value!r}")
        if self.max_tokens_per_turn > self.max_context_tokens:
            raise ConfigError(f"agent config max_tokens_per_turn ({self.max_tokens_per_turn}) exceeds "
                              f"max_context_tokens ({self.max_context_tokens})")
        if isinstance(self.command_timeout_s, bool) or not isinstance(self.command_timeout_s, (int, float)) \
                or not self.command_timeout_s > 0:
            raise ConfigError(f"agent config command_timeout_s must be a number > 0, got {self.command_timeout_s!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"agent config system_prompt must be a string or None, got {self.system_prompt!r}")
        if self.tools is not None:
            check_tool_names(self.tools)
        if self.template_check not in TEMPLATE_CHECKS:
            raise ConfigError(f"agent config template_check must be one of {TEMPLATE_CHECKS}, "
                              f"got {self.template_check!r}")
        if self.content_special_tokens is not None:
            check_mode(self.content_special_tokens, "agent config content_special_tokens")


@dataclass
class AgentOutcome:
    """One finished trajectory as the agent produced it (the pipeline adds reward and timings)."""

    prompt_ids: np.ndarray
    """int32, the chat-templated system + user prompt, encoded once."""
    response_ids: np.ndarray
    """int32, generated tokens and observation tokens, in order."""
    response_mask: np.ndarray
    """uint8, 1 where the model generated the token."""
    response_logprobs: np.ndarray
    """float32, the server's log-probability of each generated token; 0.0 where the mask is 0."""
    finish_reason: str
    """``completed`` (the model called submit), ``max_turns``, ``max_tokens``, ``timeout`` (the
    trajectory's deadline passed), ``cancelled`` (the server aborted a turn) or ``special_token``
    (non-model text held an added token's text under ``content_special_tokens = "reject"``;
    ``metrics["special_token_rejected"]`` names it)."""
    num_turns: int
    turns: list[TurnRecord] = field(default_factory=list)
    tools: dict[str, ToolStats] = field(default_factory=dict)
    template_append_only: bool = True
    """False when the chat template would render the history differently from the tokens the
    model saw (see ``segments`` and ``template_notes``)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """Ranges of ``response_ids``; a new range starts where the template's view of the history
    diverged from the token history (one range when the template is append-only)."""
    submitted: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)
    """The transcript as the chat template sees it (assistant content is the decoded model text,
    tool calls included), for debugging and decode checks."""
    template_notes: list[str] = field(default_factory=list)
    """What the template check found, in words (empty when all is well or the check was off)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The built-in agent fills in ``agent_cpu_s`` (its own CPU time: ids, decoding, parsing,
    encoding observations; inference and tools excluded), ``agent_setup_cpu_s`` (rendering the
    prompt, learning the framing), ``agent_final_cpu_s`` (final template check, arrays),
    ``agent_cpu_s_per_turn`` (one entry per turn), ``generate_s`` and ``tool_s`` (wall time)."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise ValueError(f"agent outcome arrays differ in length (ids {n}, mask {len(self.response_mask)}, "
                             f"logprobs {len(self.response_logprobs)})")
        if self.finish_reason not in AGENT_FINISH_REASONS:
            raise ValueError(f"agent finish reason {self.finish_reason!r} is not one of {sorted(AGENT_FINISH_REASONS)}")


class Agent(ABC):
    """An agent loop. Subclasses set ``name`` and implement :meth:`run`; ``config_class`` is the
    dataclass :func:`make_agent` builds from a config dict."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type] = AgentConfig

    def __init__(self, config: Any = None) -> None:
        self.config = config if config is not None else self.config_class()

    @abstractmethod
    async def run(self, ctx: AgentContext) -> AgentOutcome:
        """Run one trajectory in ``ctx``; tool failures become observations, while SandboxLost,
        inference errors and cancellation propagate."""


_REGISTRY: dict[str, type[Agent]] = {}


def register_agent(name: str, cls: type[Agent]) -> None:
    """Make ``cls`` available to :func:`make_agent` as ``name``."""
    if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
        raise ConfigError(f"agent name {name!r} must match {_AGENT_NAME.pattern}")
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise ConfigError(f"agent {name!r}: {cls!r} is not a subclass of rolloutd.daemon.agents.Agent")
    if not dataclasses.is_dataclass(cls.config_class):
        raise ConfigError(f"agent {name!r}: config_class {cls.config_class!r} must be a dataclass")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ConfigError(f"agent name {name!r} is already taken by {existing.__module__}.{existing.__qualname__}")
    _REGISTRY[name] = cls


def registered_agents() -> list[str]:
    return sorted(_REGISTRY)


def make_agent(name: str, config: dict[str, Any] | None = None) -> Agent:
    """The agent registered as ``name``, configured from ``config`` (its config class's fields)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConfigError(f"unknown agent {name!r}; registered agents: {registered_agents()} "
                          "(register custom ones with rolloutd.daemon.agents.register_agent)")
    config = dict(config or {})
    known = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown} for agent {name!r}; known fields: {sorted(known)}")
    try:
        built = cls.config_class(**config)
    except TypeError as e:
        raise ConfigError(f"agent {name!r} config: {e}") from e
    return cls(built)
