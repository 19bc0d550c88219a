"""What a turn of the bundled tasks costs beyond the floor (``cpu_floor``): the parts the floor
leaves out, so that ``rollout_throughput``'s measured figure can be set against all of its parts
and what is left is named for what it is.

Measured alone in this process, on a quiet node after the levels, like the floor: a task's set-up
and evaluation in a sandbox (as the workers run them: templates copied by the sandbox's shell),
and an IPython kernel's life (start, first cell, stop) and each further cell. Taken from the
level itself, as the workers timed them under its load: the agent's bookkeeping (its CPU over the
rollout, less the observations' encoding, which the floor has) and the sandbox watchdog's checks.
Each is spread over the turns as the level's rollouts used it (the share of rollouts that started
a kernel, their cells).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from cpu_floor import median_cpu_ms

from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.daemon.sessions.ipython import KernelSession
from rolloutd.daemon.tasks.base import get_task_type
from rolloutd.daemon.tasks.datasets import resolve_task

TASKS_TIMED = 8
"""Bundled tasks whose set-up and evaluation are timed (spread over the sorted list)."""
EVAL_TIMEOUT_S = 120.0
CELL_REPS = 15
KERNEL_LIVES = 3


async def _task_ms(backend: ApptainerBackend, task_id: str) -> float:
    """Process CPU of one set-up and evaluation of a bundled task in a fresh sandbox."""
    task = resolve_task("bundled", task_id, None)
    kind = get_task_type(task.type)
    lease = await open_lease(backend.create(SandboxSpec()))
    try:
        t0 = time.process_time()
        workdir = await kind.setup(task, lease, cache_dir=backend.shared_dir / "task-cache")
        await kind.evaluate(task, lease, workdir, timeout_s=EVAL_TIMEOUT_S)
        return 1e3 * (time.process_time() - t0)
    finally:
        await lease.destroy()


async def _kernel_ms(backend: ApptainerBackend) -> tuple[float, float]:
    """(a kernel's start, first cell and stop; a further cell), process CPU in ms."""
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))

    async def life() -> None:
        kernel = KernelSession(lease.sandbox, name="parts")
        await kernel.start()
        try:
            await kernel.execute("x = 1")
        finally:
            await kernel.close()

    try:
        life_ms = await median_cpu_ms(KERNEL_LIVES, life)
        kernel = await lease.start_kernel()
        return life_ms, await median_cpu_ms(CELL_REPS, lambda: kernel.execute("x = 1"))
    finally:
        await lease.destroy()


async def measure_left_out(tasks: list[str], *, turns_per_rollout: float, kernel_share: float,
                           cells_per_rollout: float, agent_ms_per_turn: float, observation_encode_ms: float,
                           watchdog_ms_per_turn: float) -> dict[str, float]:
    """ms per turn of each part the floor leaves out. ``kernel_share``: the level's rollouts that
    started a kernel; ``cells_per_rollout``: their cells after the first, over all rollouts."""
    step = max(1, len(tasks) // TASKS_TIMED)
    with tempfile.TemporaryDirectory(prefix="rld-parts-") as state:
        backend = ApptainerBackend(Path(state), uncontained_root_ok=True)
        timed = sorted(tasks)[::step][:TASKS_TIMED]
        for task_id in timed:  # builds the templates, once per task on a node
            await _task_ms(backend, task_id)
        task_ms = statistics.fmean([await _task_ms(backend, task_id) for task_id in timed])
        kernel_life_ms, cell_ms = await _kernel_ms(backend)
    return {"task_setup_and_eval": task_ms / turns_per_rollout,
            "ipython_kernel": (kernel_share * kernel_life_ms + cells_per_rollout * cell_ms) / turns_per_rollout,
            "agent_bookkeeping": agent_ms_per_turn - observation_encode_ms,
            "sandbox_watchdog": watchdog_ms_per_turn}
