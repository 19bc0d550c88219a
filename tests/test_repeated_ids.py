"""A repeated request id through the real node daemon: joined while it runs (every asker gets the
one answer), and once answered re-sent with its own arrays, never a reference to shared memory
that a later reply has reused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from daemon_fixtures import node_daemon, scripted_policy
from support.waits import async_poll
from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest
from rolloutd.native_io.trajectory import Trajectory
from rolloutd.daemon.tasks.datasets import oracle_plans

API_KEY = "repeat-test-key"
TASKS = ("wordwrap-001", "semver-010")
RUNNING_S = 30.0
"""How long a submitted rollout may take to be accepted and running on the node."""
RELEASE_S = 10.0
"""How long released answers may take to show as freed segments in the node's status."""


def plans_of_the_tasks() -> dict[str, list[str]]:
    return {t: oracle_plans()[t] for t in TASKS}


def owned(t: Trajectory) -> dict[str, list]:
    return {k: np.array(v).tolist() for k, v in t.arrays().items()}


def request(task: str, rid: str) -> RolloutRequest:
    return RolloutRequest(task_id=task, request_id=rid, sampling={"max_tokens": 1024, "seed": 1})


async def test_an_answered_id_asked_again_gets_its_own_arrays(short_tmp: Path) -> None:
    """A's reply lived in a shared-memory segment; A released it and B's reply refilled it. Asking
    for A again returned A's scalars over B's memory (issue 27); now it is A's arrays, copied."""
    env = {"ROLLOUTD_INFERENCE_API_KEY": API_KEY}
    with scripted_policy(plans_of_the_tasks(), short_tmp, API_KEY) as url, \
            node_daemon(short_tmp / "n", "--backend", "local", "--workers", "1", "--warm", "1", env=env) as address:
        async with AsyncRolloutClient(address) as client:
            await client.add_inference_server(url)
            first = (await client.results(await client.submit([request(TASKS[0], "rid-a")]), timeout_s=120))["rid-a"]
            assert first.error is None and first.reply is not None and first.reply.segments
            (a,) = first.trajectories
            expected = owned(a)
            await client.release(first)
            other = (await client.results(await client.submit([request(TASKS[1], "rid-b")]), timeout_s=120))["rid-b"]
            assert other.error is None and other.reply is not None
            (b,) = other.trajectories
            again = (await client.results(await client.submit([request(TASKS[0], "rid-a")]), timeout_s=30))["rid-a"]
            assert again.error is None, again.error
            (a2,) = again.trajectories
            assert (a2.task_id, a2.reward, a2.num_turns) == (a.task_id, a.reward, a.num_turns)
            assert owned(a2) == expected and owned(a2) != owned(b)
            await client.release(other)
            await client.release(again)
            st = await client.status()
            assert st["counters"]["duplicates"] == 1 and st["shm_segments"] == 0


async def test_concurrent_submits_of_one_id_all_get_the_one_answer(short_tmp: Path) -> None:
    """Two clients (and one client twice) submit the same id while it runs: it runs once and
    every asker gets it; the landed supervisor answered only the newest asker."""
    env = {"ROLLOUTD_INFERENCE_API_KEY": API_KEY}
    with scripted_policy(plans_of_the_tasks(), short_tmp, API_KEY, "--ms-per-token", "3") as url, \
            node_daemon(short_tmp / "n", "--backend", "local", "--workers", "1", "--warm", "1", env=env) as address:
        async with AsyncRolloutClient(address) as one, AsyncRolloutClient(address) as two:
            await one.add_inference_server(url)
            (rid,) = await one.submit([request(TASKS[0], "same-id")])
            await async_poll(one.status, lambda st: st["in_flight"] >= 1, RUNNING_S,
                             "the first ask accepted and running before the others ask")
            await two.submit([request(TASKS[0], "same-id")])
            await one.submit([request(TASKS[0], "same-id")])
            got = await asyncio.gather(one.results([rid], timeout_s=120), two.results([rid], timeout_s=120),
                                       one.results([rid], timeout_s=120))
            answers = [g[rid] for g in got]
            assert all(r.error is None for r in answers), [r.error for r in answers]
            arrays = [owned(r.trajectories[0]) for r in answers]
            assert arrays[0] == arrays[1] == arrays[2] and len(arrays[0]["response_ids"]) > 0
            for client, r in zip((one, two, one), answers):
                await client.release(r)
            st = await one.status()
            # run once: `two` joined on the daemon, `one` asking again joined in the client
            assert st["counters"]["duplicates"] == 1, st["counters"]
            await async_poll(one.status, lambda st: st["shm_segments"] == 0, RELEASE_S, "every segment released")

