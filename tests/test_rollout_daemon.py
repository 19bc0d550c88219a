"""Rollouts through the real node daemon and client: submit, as_completed, cancel, BUSY, inference
servers added at run time, weight versions, arrays through shared memory."""

from __future__ import annotations

import time
import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daemon_fixtures import node_daemon, scripted_policy
from support.waits import async_poll
from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.tasks.datasets import oracle_plans
from rolloutd.native_io.errors import Busy, Cancelled

API_KEY = "daemon-test-key"
STATS_TIMEOUT_S = 10.0
"""Workers report their pools and stages once a second; a report this late means something is stuck."""


def policy(plans: dict[str, list[str]], tmp: Path) -> contextlib.AbstractContextManager[str]:
    return scripted_policy(plans, tmp, API_KEY)


def test_bundled_rollouts_through_the_daemon(short_tmp: Path) -> None:
    tasks = ["wordwrap-001", "semver-010", "durations-027"]
    with policy({t: oracle_plans()[t] for t in tasks}, short_tmp) as url:
        env = {"ROLLOUTD_INFERENCE_API_KEY": API_KEY}
        with node_daemon(short_tmp / "n", "--backend", "local", "--workers", "2", "--warm", "2", env=env) as address:
            with RolloutClient(address) as client:
                assert client.add_inference_server(url)["workers"]
                client.set_weight_version("step-7")
                ids = client.submit([RolloutRequest(task_id=t, n=2, sampling={"max_tokens": 1024, "seed": 1})
                                     for t in tasks])
                seen = []
                for result in client.as_completed(ids, timeout_s=300):
                    assert result.error is None, result.error
                    for t in result.trajectories:
                        assert (t.finish_reason, t.reward) == ("completed", 1.0), (t.finish_reason, t.error_message)
                        assert not t.response_ids.flags.owndata  # a view into the node's shared memory
                        assert set(t.weight_versions) == {"step-7"}
                        full = np.concatenate([t.prompt_ids, t.response_ids])
                        lp = default_model().sequence_logprobs(full)[len(t.prompt_ids):]
                        m = t.response_mask == 1
                        assert np.max(np.abs(lp[m] - t.response_logprobs[m])) <= 1e-5
                        seen.append((t.task_id, t.sample_index))
                    client.release(result)
                assert sorted(seen) == sorted((t, i) for t in tasks for i in range(2))
                st = client.status()
                assert st["shm_segments"] == 0
            # The workers share one task cache: each task's template was built once for the node.
            workers = workers_dir(NodeConfig(run_dir=str(short_tmp / "n")))
            built = sorted(p.name.rsplit("-", 1)[0] for p in (workers / "shared" / "task-cache" / "swe").iterdir())
            assert built == sorted(tasks), built
            assert not list(workers.glob("w*/shared")), "a worker kept a task cache of its own"


async def test_cancel_and_busy_through_the_daemon(short_tmp: Path) -> None:
    env = {"ROLLOUTD_QUEUE_LIMIT": "4"}
    with node_daemon(short_tmp / "n", "--backend", "local", "--workers", "1", "--warm", "1", env=env) as address:
        async with AsyncRolloutClient(address) as client:
            slow = {"type": "command", "instance_id": "slow", "eval_script": "echo 1"}
            (long_id,) = await client.submit([RolloutRequest(task=slow, agent="script", ipython=False,
                                                             agent_config={"commands": ["sleep 60"]}, n=3)])
            await async_poll(client.status, lambda st: _admitted(st) == 3, STATS_TIMEOUT_S,
                             "the three samples admitted by the worker's pipeline")
            (busy_id,) = await client.submit([RolloutRequest(task=slow, agent="script", ipython=False, n=2)])
            busy = await client.results([busy_id], timeout_s=30)
            assert isinstance(busy[busy_id].error, Busy)
            t0 = time.monotonic()
            await client.cancel(long_id)
            result = (await client.results([long_id], timeout_s=30))[long_id]
            assert time.monotonic() - t0 < 10
            assert [t.finish_reason for t in result.trajectories] == ["cancelled"] * 3
            await async_poll(client.status, lambda st: st["sandboxes"]["leased"] == 0, STATS_TIMEOUT_S,
                             "the cancelled samples' sandboxes back from lease")


def _admitted(status: dict[str, Any]) -> int:
    """Samples the workers' pipelines hold (what BUSY counts against queue_limit), as last reported."""
    return sum(int(w.get("pipeline", {}).get("admitted", 0)) for w in status["workers"])


async def test_cancel_right_after_submit_is_answered(short_tmp: Path) -> None:
    """A CANCEL that reaches the worker in the same read as its request (before the request's task
    first runs) still gets the request its one final answer."""
    with node_daemon(short_tmp / "n", "--backend", "local", "--workers", "1", "--warm", "1") as address:
        async with AsyncRolloutClient(address) as client:
            slow = {"type": "command", "instance_id": "slow", "eval_script": "echo 1"}
            for _ in range(20):
                (rid,) = await client.submit([RolloutRequest(task=slow, agent="script", ipython=False,
                                                             agent_config={"commands": ["sleep 60"]})])
                await client.cancel(rid)
                result = (await client.results([rid], timeout_s=10))[rid]
                # Cancelled before the supervisor handed it on (an error), or in the worker: before
                # its sample began (no trajectory) or after (one, cancelled). Nothing else.
                assert isinstance(result.error, Cancelled) or (result.error is None and [
                    t.finish_reason for t in result.trajectories] in ([], ["cancelled"])), result
                await client.release(result)


def test_unknown_task_is_a_clear_error(short_tmp: Path) -> None:
    with node_daemon(short_tmp / "n", "--backend", "local", "--workers", "1", "--warm", "0") as address:
        with RolloutClient(address) as client:
            (rid,) = client.submit([RolloutRequest(task_id="no-such-task")])
            result = client.results([rid], timeout_s=30)[rid]
            assert result.error is not None and result.error.code == "TASK" and "no-such-task" in str(result.error)
            (rid,) = client.submit([RolloutRequest(task_id="wordwrap-001", agent="nope")])
            assert client.results([rid], timeout_s=30)[rid].error.code == "CONFIG"


@pytest.mark.apptainer
def test_rollout_in_apptainer_sandboxes(short_tmp: Path) -> None:
    with policy({"csvline-005": oracle_plans()["csvline-005"]}, short_tmp) as url:
        env = {"ROLLOUTD_INFERENCE_API_KEY": API_KEY}
        with node_daemon(short_tmp / "n", "--backend", "apptainer", "--workers", "1", "--warm", "1",
                         "--inference-server", url, env=env) as address:
            with RolloutClient(address) as client:
                (rid,) = client.submit([RolloutRequest(task_id="csvline-005", sampling={"max_tokens": 1024})])
                (t,) = client.results([rid], timeout_s=300)[rid].trajectories
                assert (t.finish_reason, t.reward) == ("completed", 1.0), (t.finish_reason, t.error_message)
                assert set(t.stage_s) == {"init", "run", "eval"}
