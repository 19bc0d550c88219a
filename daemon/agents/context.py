"""The AgentContext the pipeline gives an agent: one leased sandbox and the inference pool.

Everything an agent call waits on is bounded by the trajectory's deadline: a model turn gets at
most the time left (and at most ``inference_timeout_s``), a command at most its own limit and the
time left. Once the deadline has passed, calls raise OperationTimeout and the agent ends the
trajectory with finish reason ``timeout``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rolloutd.daemon.inference.base import GenerateResult, SamplingParams
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.sandbox.lease import Lease
from rolloutd.native_io.errors import InferenceTimeout, OperationTimeout
from rolloutd.native_io.pty_session import CommandResult
from rolloutd.native_io.wire import ExecuteResult


@dataclass
class SandboxAgentContext:
    lease: Lease
    pool: ServerPool
    tokenizer: Any
    sampling: SamplingParams
    """Sampling for every turn, as the request gave it; a turn generates at most the smaller of
    its ``max_tokens`` and what the agent asks (its per-turn cap, the context's room)."""
    trajectory_id: str
    """Keeps the trajectory's turns on one server (its prefix cache)."""
    instance_id: str
    problem_statement: str
    workdir: str = ""
    """The repository root inside the sandbox; empty: the sandbox's workspace (the shell's cwd)."""
    deadline: float | None = None
    """``time.monotonic()`` by which the trajectory must end; None: no deadline."""
    inference_timeout_s: float = 600.0
    """Limit of one model turn, all retries included."""
    content_special_tokens: str = "text"
    """The node's default for non-model text holding added tokens' text (agents may override it)."""

    def __post_init__(self) -> None:
        if not self.workdir:
            self.workdir = self.lease.sandbox.workspace_inside

    @property
    def has_ipython(self) -> bool:
        return self.lease.offers_ipython

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _limit(self, limit: float, what: str) -> tuple[float, bool]:
        """(the limit to use, whether the deadline is what binds it)."""
        left = self.time_left()
        if left is None:
            return limit, False
        if left <= 0:
            raise OperationTimeout(f"trajectory {self.trajectory_id} passed its deadline before {what}; "
                                   "raise the rollout's timeout to give it more time")
        return (left, True) if left < limit else (limit, False)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, top_logprobs: int = 0) -> GenerateResult:
        limit, by_deadline = self._limit(self.inference_timeout_s, "a model turn")
        params = dataclasses.replace(self.sampling, max_tokens=min(max_tokens, self.sampling.max_tokens),
                                     top_logprobs=top_logprobs)
        try:
            return await self.pool.generate(prompt_ids, params, trajectory_id=self.trajectory_id, timeout_s=limit)
        except InferenceTimeout as e:
            if by_deadline:
                raise OperationTimeout(f"trajectory {self.trajectory_id} reached its deadline during a model "
                                       "turn; raise the rollout's timeout to give it more time") from e
            raise

    def context_limit(self) -> int | None:
        return self.pool.context_limit()

    async def run(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        base = timeout_s if timeout_s is not None else self.lease.sandbox.spec.limits.command_timeout_s
        limit, _ = self._limit(base, "a command")
        return await self.lease.run(command, timeout_s=limit)

    async def ipython(self, code: str, *, timeout_s: float | None = None) -> ExecuteResult:
        base = timeout_s if timeout_s is not None else self.lease.sandbox.spec.limits.command_timeout_s
        limit, _ = self._limit(base, "an IPython cell")
        return await self.lease.ipython(code, timeout_s=limit)
