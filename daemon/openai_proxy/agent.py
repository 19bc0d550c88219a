"""The ``blackbox`` agent: any harness that speaks the OpenAI chat API, run inside the sandbox.

Per trajectory it starts an OpenAI-compatible proxy (``rolloutd.daemon.openai_proxy``) on a
Unix socket in the sandbox's run folder, runs ``command`` in the sandbox (its own process group,
in the task's working folder, output to ``/run/rolloutd/openai/harness.log``), waits for it, and
returns the token history the proxy recorded. The harness gets in its environment:

- ``OPENAI_BASE_URL``: ``http://127.0.0.1:<port>/v1``, a forwarder inside the sandbox relaying
  to the socket (``loopback: false`` skips it: the URL is then ``http://localhost/v1`` and the
  harness must reach the socket itself, e.g. ``httpx.HTTPTransport(uds=...)``);
- ``OPENAI_API_KEY``: a random key for this trajectory only (the proxy refuses any other);
- ``ANTHROPIC_BASE_URL`` (the forwarder's URL without ``/v1``) and ``ANTHROPIC_API_KEY`` (the
  same key), for harnesses on Anthropic's SDK (the proxy serves ``/v1/messages`` too);
- ``ROLLOUTD_OPENAI_SOCKET``: the proxy's socket as the sandbox sees it;
- ``ROLLOUTD_MODEL``: the model name to request (any name is served);
- ``ROLLOUTD_TASK_ID``, ``ROLLOUTD_WORKDIR``, and ``ROLLOUTD_TASK_PROMPT_FILE``: a file holding
  the task message (its ``Task id: <id>`` line, the repository root and the issue), meant to be
  the harness's first user message (scripted reference policies key on that line);
- everything in ``env`` (the variables above win).

How the trajectory ends: ``completed`` when the harness exits on its own with status 0 (another
status is an AgentError carrying its output, unless ``allow_nonzero_exit``); ``max_turns``,
``max_tokens``, ``cancelled`` or ``timeout`` when the proxy refused a request for that reason
(the harness then has ``exit_grace_s`` to exit before it is stopped); ``timeout`` when the
harness outlives ``timeout_s`` or the rollout's deadline (it is stopped: SIGTERM to its process
group, then SIGKILL). The trajectory's arrays are described in ``openai_proxy.history``.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import shutil
import signal
import time
from dataclasses import dataclass, field

from rolloutd.daemon.agents.base import TEMPLATE_CHECKS, Agent, AgentContext, AgentOutcome, register_agent
from rolloutd.daemon.agents.codeact import user_prompt
from rolloutd.daemon.agents.content_text import check_mode
from rolloutd.daemon.agents.context import SandboxAgentContext
from rolloutd.native_io.errors import AgentError, ConfigError
from rolloutd.native_io.host_files import read_tail
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail
from rolloutd.native_io.spawn import Child, spawn, stop_group

from . import sandbox_forwarder
from .history import KEEP_MODES
from .protocol import UNAPPLIED_MODES
from .server import OpenAIProxyServer
from .session import ProxyLimits, ProxySession

STOP_GRACE_S = 2.0
"""After SIGTERM to the harness's process group, how long it has before SIGKILL."""


@dataclass
class BlackBoxConfig:
    command: str = ""
    """The harness, as a bash command line run inside the sandbox in the task's working folder."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the harness (e.g. ``PYTHONPATH`` of a bound-in SDK)."""
    max_requests: int = 100
    """Model turns at most; the next request ends the trajectory with ``max_turns``."""
    max_context_tokens: int = 32768
    """Bound on one conversation's tokens (prompt + response); reaching it ends with ``max_tokens``."""
    max_tokens_per_turn: int = 4096
    """Tokens one turn may generate (a request's ``max_completion_tokens`` may lower it)."""
    timeout_s: float = 3600.0
    """Wall-time limit of the harness; the rollout's deadline applies too."""
    exit_grace_s: float = 10.0
    """Once the proxy refused a request for good, how long the harness has to exit on its own."""
    loopback: bool = True
    """Start the in-sandbox forwarder that gives the harness an ``http://127.0.0.1`` URL."""
    model_name: str = "rolloutd-policy"
    """What ``/v1/models`` lists."""
    keep_segments: str = "all"
    """After a history rewrite: ``all`` segments in the arrays (each range its own history) or
    only the ``last`` (see ``openai_proxy.history``)."""
    template_check: str = "final"
    """As the built-in agent's: check that the chat template is append-only (``every_turn``,
    ``final`` or ``off``)."""
    content_special_tokens: str | None = None
    """As the built-in agent's, for every message the harness sends (``text``, ``reject``: the
    request is refused and the trajectory ends with ``special_token``, ``special``); None: the node's."""
    unapplied_fields: str = "refuse"
    """Request fields the proxy cannot apply (sampling fields such as ``temperature``: the
    trainer's sampling rules every turn): ``refuse`` answers 400 naming the field, ``report``
    accepts them and lists them in ``metrics["ignored_request_fields"]``."""
    allow_nonzero_exit: bool = False
    """Treat a harness that exits with a non-zero status as completed instead of an error."""
    output_tail_bytes: int = 4000
    """How much of the end of the harness's output the trajectory's metrics keep."""

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise ConfigError("blackbox agent config: command (the harness's command line) is required")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.env.items()):
            raise ConfigError(f"blackbox agent config: env must map names to strings, got {self.env!r}")
        ProxyLimits(self.max_requests, self.max_context_tokens, self.max_tokens_per_turn)
        if isinstance(self.output_tail_bytes, bool) or not isinstance(self.output_tail_bytes, int) \
                or self.output_tail_bytes < 0:
            raise ConfigError(f"blackbox agent config: output_tail_bytes must be an integer >= 0, "
                              f"got {self.output_tail_bytes!r}")
        for name in ("timeout_s", "exit_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"blackbox agent config: {name} must be a number > 0, got {value!r}")
        if self.keep_segments not in KEEP_MODES:
            raise ConfigError(f"blackbox agent config: keep_segments must be one of {KEEP_MODES}, "
                              f"got {self.keep_segments!r}")
        if self.unapplied_fields not in UNAPPLIED_MODES:
            raise ConfigError(f"blackbox agent config: unapplied_fields must be one of {UNAPPLIED_MODES}, "
                              f"got {self.unapplied_fields!r}")
        if self.template_check not in TEMPLATE_CHECKS:
            raise ConfigError(f"blackbox agent config: template_check must be one of {TEMPLATE_CHECKS}, "
                              f"got {self.template_check!r}")
        if self.content_special_tokens is not None:
            check_mode(self.content_special_tokens, "blackbox agent config: content_special_tokens")
        if not isinstance(self.model_name, str) or not self.model_name or "/" in self.model_name:
            raise ConfigError(f"blackbox agent config: model_name must be a non-empty name without '/', "
                              f"got {self.model_name!r}")


class BlackBoxAgent(Agent):
    name = "blackbox"
    config_class = BlackBoxConfig

    async def run(self, ctx: AgentContext) -> AgentOutcome:
        if not isinstance(ctx, SandboxAgentContext):
            raise AgentError("the blackbox agent needs the pipeline's sandbox context (a leased sandbox)")
        cfg: BlackBoxConfig = self.config
        sb = ctx.lease.sandbox
        folder = sb.run_dir / "openai"
        folder.mkdir(mode=0o700, exist_ok=True)
        inside = f"{sb.run_dir_inside}/openai"
        key = secrets.token_urlsafe(24)
        session = ProxySession(lambda ids, n, k: ctx.generate(ids, max_tokens=n, top_logprobs=k), ctx.tokenizer,
                               model=cfg.model_name,
                               limits=ProxyLimits(cfg.max_requests, cfg.max_context_tokens, cfg.max_tokens_per_turn),
                               template_check=cfg.template_check, unapplied_fields=cfg.unapplied_fields,
                               content_special_tokens=cfg.content_special_tokens or ctx.content_special_tokens)
        server = OpenAIProxyServer(session, api_key=key, socket_path=folder / "api.sock")
        (folder / "task.md").write_text(user_prompt(ctx))
        env = {**cfg.env, "OPENAI_API_KEY": key, "OPENAI_BASE_URL": "http://localhost/v1", "ANTHROPIC_API_KEY": key,
               "ROLLOUTD_OPENAI_SOCKET": f"{inside}/api.sock", "ROLLOUTD_MODEL": cfg.model_name,
               "ROLLOUTD_TASK_ID": ctx.instance_id, "ROLLOUTD_TASK_PROMPT_FILE": f"{inside}/task.md",
               "ROLLOUTD_WORKDIR": ctx.workdir}
        launch = f"exec bash -c {shlex.quote(cfg.command)}"
        if cfg.loopback:
            shutil.copyfile(sandbox_forwarder.__file__, folder / "forwarder.py")
            forwarder = shlex.join([sb.python, f"{inside}/forwarder.py", "--socket", f"{inside}/api.sock", "--"])
            launch = launch.replace("exec", f"exec {forwarder}", 1)
        await server.start()
        t0 = time.monotonic()
        proc: Child | None = None
        timed_out = False
        try:
            with open(folder / "harness.log", "wb") as log_file:
                # Not asyncio's subprocesses: uvloop forks the worker for them (spawn.py says what that costs).
                proc = await spawn(sb.exec_argv(["bash", "-c", f"{sb.limits_prelude()}; {launch}"], cwd=ctx.workdir,
                                                env=env), stdout=log_file, stderr=log_file, start_new_session=True)
            sb.session_ids.add(proc.pid)
            timed_out = not await self._wait(proc, session, ctx)
        finally:
            if proc is not None:
                # SIGTERM alone: a SIGHUP would end the loopback forwarder before it reaps the harness it
                # passes the SIGTERM on to. The group is always killed at the end, so nothing the harness
                # left in the background outlives the trajectory.
                await asyncio.shield(stop_group(proc, proc.exited, STOP_GRACE_S, term_signals=(signal.SIGTERM,)))
                sb.session_ids.discard(proc.pid)
            await asyncio.shield(server.close())
        # The harness could have put a link at its log's name by now: read it without following one.
        harness_tail = (await asyncio.to_thread(read_tail, folder, "harness.log", cfg.output_tail_bytes)
                        ).decode(errors="replace")
        assert proc is not None
        rc = proc.returncode
        finish = session.stop_reason or ("timeout" if timed_out else "completed")
        if finish == "completed" and rc != 0 and not cfg.allow_nonzero_exit:
            raise AgentError(f"the harness exited with status {rc} (allow_nonzero_exit treats that as completed); "
                             f"its output ends with:\n{tail(harness_tail, LOG_TAIL_CHARS)}")
        return session.outcome(finish, keep=cfg.keep_segments, metrics={
            "harness_exit_code": rc, "harness_s": time.monotonic() - t0, "harness_output_tail": harness_tail})

    async def _wait(self, proc: Child, session: ProxySession,
                    ctx: SandboxAgentContext) -> bool:
        """Until the harness exits (True), or passes its time limit (False). Once the proxy has
        ended the trajectory, the harness gets ``exit_grace_s`` more."""
        left = ctx.time_left()
        limit = self.config.timeout_s if left is None else max(0.0, min(self.config.timeout_s, left))
        end = time.monotonic() + limit
        exited = asyncio.ensure_future(proc.wait())
        ended = asyncio.ensure_future(session.ended.wait())
        try:
            await asyncio.wait([exited, ended], timeout=limit, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done() and ended.done():
                grace = min(self.config.exit_grace_s, max(0.0, end - time.monotonic()))
                await asyncio.wait([exited], timeout=grace)
            return exited.done()
        finally:
            for task in (exited, ended):
                task.cancel()
            await asyncio.gather(exited, ended, return_exceptions=True)


register_agent(BlackBoxAgent.name, BlackBoxAgent)
