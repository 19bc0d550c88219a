"""The rollout pipeline of one worker: init -> run -> eval, each stage behind its own gate.

A request fans out into ``n`` samples; each sample leases a fresh sandbox (init: the task's
set-up, prepared once per task and copied), runs the agent (run), and is evaluated in the same
sandbox (eval), which is then released. Gates bound each stage separately, so a sample waiting
for an eval slot holds no agent slot and never delays another sample's turns. Only time inside
stages counts against the time-outs. Every sample ends as a trajectory: completed, or with the
finish reason that stopped it (``timeout``, ``eval_timeout``, ``cancelled``, ``error`` with code and
message); a trajectory stopped by its deadline keeps the tokens produced so far (for inspection:
``ended_by`` says no trainer may learn from them), a cancelled one has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutd.native_io.errors import BadRequest, Busy, OperationTimeout, RolloutdError, SandboxPathRefused
from rolloutd.native_io.trajectory import INFRA_KINDS, Trajectory
from rolloutd.native_io.wire import RolloutArgs

from ..agents.base import AgentOutcome, make_agent
from ..agents.context import SandboxAgentContext
from ..inference import SamplingParams, ServerPool
from ..openai_proxy import agent as _blackbox_agent  # noqa: F401  (registers the ``blackbox`` agent by name)
from ..sandbox.base import SandboxLimits, SandboxSpec
from ..sandbox.lease import Lease
from ..sandbox.pool import WarmPool
from ..tasks.base import EvalResult, Task, get_task_type
from ..tasks.datasets import resolve_task
from .clock import StageClock
from .ended_by import ended_by
from .gates import StageGate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineLimits:
    init: int = 16
    run: int = 256
    eval: int = 32
    queue: int = 4096
    """Samples admitted (waiting or in a stage) before new requests get BUSY."""


class RolloutPipeline:
    def __init__(self, *, sandboxes: WarmPool, inference: ServerPool, tokenizer: Any, limits: PipelineLimits,
                 cache_dir: Path, image: str = "default", binds: tuple[tuple[str, str, str], ...] = (),
                 content_special_tokens: str = "text", sandbox_limits: SandboxLimits | None = None) -> None:
        """``binds``: extra ``(host path, sandbox path, "ro"|"rw")`` binds of every rollout's sandbox
        (software a black-box harness needs, such as an SDK; the ``local`` backend ignores them).
        ``content_special_tokens``: the node's default for the agents (their config may override it).
        ``sandbox_limits``: the caps of every rollout's sandbox (the node config's)."""
        self.sandboxes = sandboxes
        self.inference = inference
        self.tokenizer = tokenizer
        self.limits = limits
        self.cache_dir = cache_dir
        self.image = image
        self.binds = binds
        self.content_special_tokens = content_special_tokens
        self.sandbox_limits = sandbox_limits or SandboxLimits()
        self.gates = {"init": StageGate("init", limits.init), "run": StageGate("run", limits.run),
                      "eval": StageGate("eval", limits.eval)}
        self.admitted = 0
        self.counters = {"samples": 0, "completed": 0, "timeouts": 0, "cancelled": 0, "errors": 0, "refilled": 0}

    def stats(self) -> dict[str, Any]:
        return {"stages": {name: g.stats() for name, g in self.gates.items()}, "admitted": self.admitted,
                "queue_limit": self.limits.queue, "inference": self.inference.status(), **self.counters}

    async def run_request(self, request_id: str, args: RolloutArgs,
                          on_start: Callable[[], None] | None = None) -> list[Trajectory]:
        """All ``n`` samples of one request; ``on_start`` runs once, when the first sample enters a stage."""
        task = resolve_task(args.task.dataset, args.task.instance_id, args.task.inline)
        if args.n < 1 or args.n > self.limits.queue:
            raise BadRequest(f"n must be between 1 and {self.limits.queue} (queue_limit), got {args.n}")
        if self.admitted + args.n > self.limits.queue:
            raise Busy(f"this worker already holds {self.admitted} samples of its queue limit {self.limits.queue} "
                       "(queue_limit); retry later, submit to another node, or raise queue_limit")
        if not 0 <= args.infra_retries <= MAX_INFRA_RETRIES:
            raise BadRequest(f"infra_retries must be between 0 and {MAX_INFRA_RETRIES}, got {args.infra_retries}")
        make_agent(args.agent, args.agent_config)  # refuse unknown agents/config before any sandbox starts
        self.admitted += args.n
        started = asyncio.Event()
        samples = [asyncio.ensure_future(self._refilled_sample(request_id, i, task, args, started))
                   for i in range(args.n)]
        if on_start is not None:
            waiter = asyncio.ensure_future(started.wait())
            waiter.add_done_callback(lambda f: on_start() if not f.cancelled() else None)
        try:
            return list(await asyncio.gather(*samples))
        except asyncio.CancelledError:
            # The client cancelled: every sample ends now, as a trajectory marked cancelled.
            for s in samples:
                s.cancel()
            results = await asyncio.gather(*samples, return_exceptions=True)
            task_ = asyncio.current_task()
            if task_ is not None:
                task_.uncancel()
            return [r for r in results if isinstance(r, Trajectory)]
        finally:
            self.admitted -= args.n
            if on_start is not None:
                waiter.cancel()

    async def _refilled_sample(self, request_id: str, index: int, task: Task, args: RolloutArgs,
                               started: asyncio.Event) -> Trajectory:
        """One sample, run again (fresh sandbox, same sampling) while infrastructure ended it, up to
        ``infra_retries`` times within its ``timeout_s`` of stage time; each failed attempt's cause
        is kept in ``metrics["infra_failures"]``."""
        budget_s = args.timeout_s
        failures: list[dict[str, Any]] = []
        while True:
            trajectory = await self._sample(request_id, index, task, args, started, budget_s)
            budget_s -= sum(trajectory.stage_s.values())
            if (trajectory.ended_by not in INFRA_KINDS or len(failures) >= args.infra_retries
                    or budget_s <= 0):
                break
            failures.append({"ended_by": trajectory.ended_by, "error_code": trajectory.error_code,
                             "error_message": trajectory.error_message})
            self.counters["refilled"] += 1
            log.warning("sample %s/%d ended by %s (%s); refilling it", request_id, index, trajectory.ended_by,
                        trajectory.error_code)
        trajectory.metrics["infra_failures"] = failures
        return trajectory

    async def _sample(self, request_id: str, index: int, task: Task, args: RolloutArgs,
                      started: asyncio.Event, budget_s: float) -> Trajectory:
        self.counters["samples"] += 1
        clock = StageClock(budget_s)
        task_type = get_task_type(task.type)
        spec = SandboxSpec(image=task.image if task.image != "default" else self.image,
                           network=args.network, ipython=args.ipython, binds=self.binds, limits=self.sandbox_limits)
        lease: Lease | None = None
        agent = make_agent(args.agent, args.agent_config)
        outcome: AgentOutcome | None = None
        evaluation: EvalResult | None = None
        finish, error = "completed", None
        try:
            async with self._stage(clock, "init", args.priority, args.init_timeout_s):
                started.set()
                lease = await self.sandboxes.lease(spec)
                workdir = await task_type.setup(task, lease, cache_dir=self.cache_dir)
            async with self._stage(clock, "run", args.priority, args.run_timeout_s, grace_s=RUN_GRACE_S):
                trajectory_id = f"{request_id}/{index}"
                # The agent ends its own trajectory at the deadline (finish "timeout", tokens kept);
                # the stage's time-out, a little later, only backs that up.
                ctx = SandboxAgentContext(
                    lease=lease, pool=self.inference, tokenizer=self.tokenizer, sampling=_sampling(args, index),
                    trajectory_id=trajectory_id, instance_id=task.instance_id,
                    problem_statement=task.problem_statement, workdir=workdir,
                    content_special_tokens=self.content_special_tokens,
                    deadline=time.monotonic() + clock.remaining_s(args.run_timeout_s))
                try:
                    outcome = await agent.run(ctx)
                finally:
                    self.inference.release_trajectory(trajectory_id)
                if outcome.finish_reason in ("timeout", "cancelled"):
                    raise _AgentStopped(outcome.finish_reason)
            async with self._stage(clock, "eval", args.priority, args.eval_timeout_s):
                try:
                    evaluation = await task_type.evaluate(task, lease, workdir,
                                                          timeout_s=clock.remaining_s(args.eval_timeout_s))
                except SandboxPathRefused as e:
                    # The agent put a link (or a FIFO) where the evaluation's files go: its own
                    # doing, so a score of 0, not a sandbox failure to refill (the sandbox is sound).
                    evaluation = EvalResult(0.0, {"error": f"the evaluation's files could not be placed or read: {e}"})
        except _AgentStopped as e:
            finish = e.reason
            self.counters["timeouts" if e.reason == "timeout" else "cancelled"] += 1
        except asyncio.CancelledError:
            finish = "cancelled"
            self.counters["cancelled"] += 1
        except (TimeoutError, OperationTimeout):
            finish = "timeout"
            self.counters["timeouts"] += 1
        except RolloutdError as e:
            finish, error = "error", e
            self.counters["errors"] += 1
        except Exception as e:  # a bug in an agent or task type must still yield an answer
            log.exception("sample %s/%d failed", request_id, index)
            finish, error = "error", RolloutdError(f"internal error: {e!r}")
            self.counters["errors"] += 1
        finally:
            if lease is not None:
                await asyncio.shield(self.sandboxes.release(lease))
        if finish == "completed":
            self.counters["completed"] += 1
            finish = outcome.finish_reason if outcome is not None else "error"
        stage = clock.events[-1][0] if clock.events else None
        if finish == "timeout" and stage == "eval":
            finish = "eval_timeout"  # the tests ran out of time: no score (was 0.0), an outcome of its own
        return _trajectory(request_id, index, task, args, outcome, evaluation, finish, error, clock,
                           lease.kernel_start_s if lease is not None else 0.0, ended_by(finish, error, stage))

    @contextlib.asynccontextmanager
    async def _stage(self, clock: StageClock, name: str, priority: int, limit_s: float, grace_s: float = 0.0) -> Any:
        gate = self.gates[name]
        with clock.waiting():
            await gate.acquire(priority)
        try:
            with clock.stage(name):
                async with asyncio.timeout(clock.remaining_s(limit_s) + grace_s):
                    yield
        finally:
            gate.release()


MAX_INFRA_RETRIES = 5
"""More refills than this only hide a node that is broken."""

RUN_GRACE_S = 5.0
"""How long past its deadline an agent may take to hand back its trajectory before it is cut off."""


class _AgentStopped(Exception):
    """The agent ended the trajectory itself (deadline passed, or the server aborted a turn)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _sampling(args: RolloutArgs, index: int) -> SamplingParams:
    params = dict(args.sampling)
    params.setdefault("max_tokens", 1024)
    if params.get("seed") is not None:
        params["seed"] = int(params["seed"]) + index  # n samples of one task must differ
    try:
        return SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"invalid sampling params {params}: {e}") from e


def _trajectory(request_id: str, index: int, task: Task, args: RolloutArgs, outcome: AgentOutcome | None,
                evaluation: EvalResult | None, finish: str, error: RolloutdError | None, clock: StageClock,
                kernel_start_s: float, ended: str) -> Trajectory:
    empty_i = np.zeros(0, dtype=np.int32)
    o = outcome
    metrics: dict[str, Any] = {**(o.metrics if o else {}), "created_at": time.time(), "kernel_start_s": kernel_start_s,
                               "stage_events": [(s, kind, t) for s, kind, t in clock.events]}
    if evaluation is not None:
        metrics["eval"] = evaluation.details
    return Trajectory(
        request_id=request_id, sample_index=index, task_id=task.instance_id,
        prompt_ids=o.prompt_ids if o else empty_i,
        response_ids=o.response_ids if o else empty_i,
        response_mask=o.response_mask if o else np.zeros(0, dtype=np.uint8),
        response_logprobs=o.response_logprobs if o else np.zeros(0, dtype=np.float32),
        # Only the model's outcomes are scored: the eval of a sample the task or a deadline ended
        # (special_token, ...) still ran, but its reward is no score of the model.
        reward=float(evaluation.reward) if evaluation is not None and ended == "model" else 0.0,
        finish_reason=finish,
        num_turns=o.num_turns if o else 0,
        turns=list(o.turns) if o else [],
        error_code=error.code if error else None,
        error_message=str(error) if error else None,
        stage_s=dict(clock.stage_s),
        queued_s=clock.queued_s,
        tools=dict(o.tools) if o else {},
        template_append_only=o.template_append_only if o else True,
        segments=list(o.segments) if o else [],
        agent=args.agent,
        metrics=metrics,
        ended_by=ended,
    )

