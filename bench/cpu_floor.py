"""The least daemon CPU a turn of a rollout can cost with rolloutd's components, measured piece
by piece in this process on the rollouts just run: what ``rollout_throughput``'s per-turn figure
is set against.

Counted: the sandbox's life (instance start, shell and its first probe, stop) spread over the
rollout's turns, and per turn one inference call through the pool (the turn's mean generated
tokens), one shell command, and encoding the turn's observation (the real observations of the
rollouts, decoded and encoded again). Everything else a rollout costs is left out (the agent's
bookkeeping, task set-up and eval, IPython kernels, messages to the trainer, the watchdog), so
the measured figure can only lie above this one.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from rolloutd.daemon.agents.codec import TokenCodec
from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.growing_ids import GrowingIds
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.lease import open_lease


async def median_cpu_ms(reps: int, call: Callable[[], Awaitable[Any]]) -> float:
    """Median process CPU of ``call`` over ``reps`` runs after one warm-up (nothing else runs here)."""
    await call()
    samples = []
    for _ in range(reps):
        t0 = time.process_time()
        await call()
        samples.append(1e3 * (time.process_time() - t0))
    return statistics.median(samples)


async def measure_floor(url: str, api_key: str, *, prompt_ids: list[int], observations: list[np.ndarray],
                        model_tokens_per_turn: float, turns_per_rollout: float,
                        reps: int = 15) -> tuple[dict[str, float], float]:
    """(ms per turn of each part, ms of one sandbox's life)."""
    with tempfile.TemporaryDirectory(prefix="rld-floor-") as state:
        backend = ApptainerBackend(Path(state), uncontained_root_ok=True)

        async def sandbox_life() -> None:
            await (await open_lease(backend.create(SandboxSpec()))).destroy()

        life_ms = await median_cpu_ms(max(3, reps // 3), sandbox_life)
        lease = await open_lease(backend.create(SandboxSpec()))
        try:
            command_ms = await median_cpu_ms(reps, lambda: lease.run("echo ok"))
        finally:
            await lease.destroy()

    params = SamplingParams(max_tokens=max(1, round(model_tokens_per_turn)), ignore_eos=True, seed=0)
    context = GrowingIds(prompt_ids)  # as the agent sends it: its JSON text made once
    async with await ServerPool.create(["vllm-generate+" + url], api_key=api_key) as pool:
        generate_ms = await median_cpu_ms(
            reps, lambda: pool.generate(context, params, trajectory_id="floor", timeout_s=60))

    codec = TokenCodec(load_tokenizer())
    texts = [codec.decode(run.tolist()) for run in observations]
    t0 = time.process_time()
    for text in texts:
        codec.encode(text)
    encode_ms = 1e3 * (time.process_time() - t0) / max(1, len(texts))

    return {"sandbox_life_per_turn": life_ms / turns_per_rollout, "inference_call": generate_ms,
            "shell_command": command_ms, "observation_encode": encode_ms}, life_ms
