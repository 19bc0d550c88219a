"""The rollout pipeline in-process over real sandboxes: stage limits, overlap, time-outs, cancel,
BUSY, n samples, and end-to-end token fidelity with the reference policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from support.waits import async_wait_until
from rolloutd.daemon.inference import ServerPool
from rolloutd.daemon.pipeline.rollout import PipelineLimits, RolloutPipeline
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.policy.server import PolicyServerConfig, serve_policy
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.tasks.datasets import dataset_records, oracle_plans
from rolloutd.native_io.errors import BadRequest, Busy
from rolloutd.native_io.wire import RolloutArgs, TaskRef

API_KEY = "test-key"
STAGE_TIMEOUT_S = 20.0
"""A sample reaches a stage (its sandbox started, the set-up run) well within this."""
RELEASE_TIMEOUT_S = 10.0
"""A finished sample's sandbox goes back to the pool (reset included) well within this."""


@asynccontextmanager
async def pipeline(state: Path, limits: PipelineLimits, servers: list[str] | None = None) -> AsyncIterator[RolloutPipeline]:
    sandboxes = WarmPool(LocalBackend(state / "sb"), warm_specs={})
    await sandboxes.start()
    inference = await ServerPool.create(servers or [], api_key=API_KEY)
    pipe = RolloutPipeline(sandboxes=sandboxes, inference=inference, tokenizer=load_tokenizer(), limits=limits,
                           cache_dir=state / "cache")
    try:
        yield pipe
    finally:
        await inference.close()
        await sandboxes.close()


def command_args(iid: str, *, setup: str = "", run: list[str] | None = None, eval_script: str = "echo 1",
                 **kw: Any) -> RolloutArgs:
    task = {"type": "command", "instance_id": iid, "problem_statement": "x", "setup_script": setup,
            "eval_script": eval_script}
    return RolloutArgs(task=TaskRef(inline=task), agent="script", agent_config={"commands": run or []},
                       ipython=False, **kw)


def max_concurrency(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level = best = 0
    for _, d in points:
        level += d
        best = max(best, level)
    return best


async def test_stage_limits_and_order(short_tmp: Path) -> None:
    async with pipeline(short_tmp, PipelineLimits(init=1, run=2, eval=1)) as pipe:
        args = [command_args(f"t{i}", setup="sleep 0.1", run=["sleep 0.2"], eval_script="sleep 0.1; echo 1")
                for i in range(4)]
        results = await asyncio.gather(*(pipe.run_request(f"r{i}", a) for i, a in enumerate(args)))
        trajs = [r[0] for r in results]
        assert all(t.finish_reason == "completed" and t.reward == 1.0 for t in trajs)
        for t in trajs:
            s = t.stage_spans
            assert s["init"][1] <= s["run"][0] <= s["run"][1] <= s["eval"][0]
            assert t.stage_s["run"] >= 0.2
        for stage, limit in (("init", 1), ("run", 2), ("eval", 1)):
            assert max_concurrency([t.stage_spans[stage] for t in trajs]) <= limit
        assert sum(t.queued_s for t in trajs) > 0  # the limits made some wait
        assert pipe.sandboxes.stats()["leased"] == 0


async def test_slow_eval_does_not_delay_other_turns(short_tmp: Path) -> None:
    async with pipeline(short_tmp, PipelineLimits(init=4, run=4, eval=1)) as pipe:
        slow = asyncio.ensure_future(pipe.run_request("slow", command_args("slow", eval_script="sleep 2; echo 1")))
        await async_wait_until(lambda: pipe.gates["eval"].in_use == 1, STAGE_TIMEOUT_S,
                               "slow evaluating, holding the only eval slot")
        fast = await pipe.run_request("fast", command_args("fast", run=["echo turn1", "echo turn2"]))
        (slow_t,) = await slow
        (fast_t,) = fast
        slow_eval, fast_run = slow_t.stage_spans["eval"], fast_t.stage_spans["run"]
        # fast's agent turns ran entirely while slow held the eval slot...
        assert slow_eval[0] < fast_run[0] and fast_run[1] < slow_eval[1]
        # ...and fast's eval waited for the slot, which was not counted as stage time.
        assert fast_t.stage_spans["eval"][0] >= slow_eval[1] and fast_t.queued_s > 0.5
        assert fast_t.stage_s["eval"] < 1.0


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_timeout_at_each_stage_frees_the_sandbox(short_tmp: Path, stage: str) -> None:
    slow = "sleep 30"
    kwargs = {"init": {"setup": slow}, "run": {"run": [slow]}, "eval": {"eval_script": f"{slow}; echo 1"}}[stage]
    limits = {f"{stage}_timeout_s": 0.5}
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        (t,) = await asyncio.wait_for(pipe.run_request("r", command_args("t", **kwargs, **limits)), 20)
        # Past the deadline in init the sandbox failed (refilled); in run or eval the deadline ended
        # it: no score, nothing to train on (issue 27: an eval time-out was scored 0.0).
        expected = {"init": ("timeout", "sandbox"), "run": ("timeout", "deadline"),
                    "eval": ("eval_timeout", "deadline")}[stage]
        assert (t.finish_reason, t.ended_by) == expected, (t.finish_reason, t.error_message)
        assert t.reward == 0.0 and not t.reward_valid
        assert t.stage_s[stage] < 5
        await async_wait_until(lambda: pipe.sandboxes.stats()["leased"] == 0, RELEASE_TIMEOUT_S,
                               "the timed-out sample's sandbox released")


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_cancel_at_each_stage_frees_the_sandbox(short_tmp: Path, stage: str) -> None:
    slow = "sleep 30"
    kwargs = {"init": {"setup": slow}, "run": {"run": [slow]}, "eval": {"eval_script": f"{slow}; echo 1"}}[stage]
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        task = asyncio.ensure_future(pipe.run_request("r", command_args("t", **kwargs)))
        await async_wait_until(lambda: pipe.gates[stage].in_use, STAGE_TIMEOUT_S, f"the sample in its {stage} stage")
        task.cancel()
        (t,) = await asyncio.wait_for(task, 10)
        assert t.finish_reason == "cancelled" and stage in t.stage_s
        await async_wait_until(lambda: pipe.sandboxes.stats()["leased"] == 0 and pipe.admitted == 0,
                               RELEASE_TIMEOUT_S, "the cancelled sample's sandbox released")


async def test_busy_when_the_queue_is_full(short_tmp: Path) -> None:
    async with pipeline(short_tmp, PipelineLimits(queue=3)) as pipe:
        first = asyncio.ensure_future(pipe.run_request("a", command_args("a", run=["sleep 0.5"], n=2)))
        await async_wait_until(lambda: pipe.admitted == 2, STAGE_TIMEOUT_S, "the first request's samples admitted")
        with pytest.raises(Busy, match="queue_limit"):
            await pipe.run_request("b", command_args("b", n=2))
        assert len(await first) == 2
        assert len(await pipe.run_request("c", command_args("c", n=3))) == 3


async def test_n_samples_share_the_set_up(short_tmp: Path) -> None:
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        args = RolloutArgs(task=TaskRef("wordwrap-001"), agent="script", agent_config={"commands": ["ls"]}, n=3,
                           ipython=False)
        trajs = await pipe.run_request("r", args)
        assert sorted(t.sample_index for t in trajs) == [0, 1, 2]
        assert all(t.reward == 0.0 and t.finish_reason == "completed" for t in trajs)  # the bug is still there
        assert len(list((short_tmp / "cache" / "swe").iterdir())) == 1


async def test_a_link_the_agent_plants_for_the_evaluation_scores_0_and_is_not_refilled(short_tmp: Path) -> None:
    """The evaluation writes its tests into the agent's repository without following links (the
    host would write where the link points): a refused path is the agent's doing, so the sample
    is the model's with a reward of 0, not a sandbox failure to run again."""
    victim = short_tmp / "victim"
    victim.mkdir()
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        args = RolloutArgs(task=TaskRef("paginate-003"), agent="script", ipython=False,
                           agent_config={"commands": [f"rm -rf tests && ln -s {victim} tests"]})
        (traj,) = await pipe.run_request("r", args)
    assert list(victim.iterdir()) == []
    assert (traj.finish_reason, traj.ended_by, traj.reward, traj.error_code) == ("completed", "model", 0.0, None)
    assert "symbolic link" in traj.metrics["eval"]["error"], traj.metrics["eval"]
    assert pipe.counters["refilled"] == 0 and pipe.counters["samples"] == 1


async def test_oracle_plan_end_to_end_with_token_fidelity(short_tmp: Path) -> None:
    plans = oracle_plans()
    plans["paginate-003-unsolved"] = ['Giving up.\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>']
    plans_file = short_tmp / "plans.json"
    plans_file.write_text(json.dumps({"plans": {k: plans[k] for k in ("paginate-003", "paginate-003-unsolved")}}))
    unsolved_task = {**dataset_records("bundled")["paginate-003"], "instance_id": "paginate-003-unsolved"}
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, scripted=plans_file)) as policy:
        async with pipeline(short_tmp, PipelineLimits(), [policy.url]) as pipe:
            args = RolloutArgs(task=TaskRef("paginate-003"), n=2, ipython=True,
                               sampling={"max_tokens": 1024, "seed": 3})
            trajs = await pipe.run_request("e2e", args)
            (unsolved,) = await pipe.run_request("e2e-unsolved", RolloutArgs(task=TaskRef(inline=unsolved_task)))
    assert unsolved.finish_reason == "completed" and unsolved.num_turns == 1 and unsolved.reward == 0.0
    assert unsolved.metrics["eval"]["failed_fail_to_pass"]
    model, tok = default_model(), load_tokenizer()
    for t in trajs:
        assert t.finish_reason == "completed" and t.reward == 1.0, (t.finish_reason, t.error_message, t.metrics)
        assert t.num_turns == len(plans["paginate-003"]) and t.template_append_only
        assert len(t.response_ids) == len(t.response_mask) == len(t.response_logprobs)
        assert np.all(t.response_logprobs[t.response_mask == 0] == 0.0)
        full = np.concatenate([t.prompt_ids, t.response_ids])
        recomputed = model.sequence_logprobs(full)[len(t.prompt_ids):]
        model_tokens = t.response_mask == 1
        assert np.max(np.abs(recomputed[model_tokens] - t.response_logprobs[model_tokens])) <= 1e-5
        text = tok.decode(t.response_ids.tolist(), skip_special_tokens=False)
        for reply in plans["paginate-003"]:
            assert reply in text
        assert t.weight_versions and all(v == "0" for v in t.weight_versions)
        assert t.tools["str_replace_editor"].count >= 1 and t.tools["bash"].count >= 1
        assert "ipython" not in t.tools and t.metrics["kernel_start_s"] == 0.0  # offered, never started


async def test_a_sample_infrastructure_ended_is_refilled_and_the_cause_kept(short_tmp: Path) -> None:
    # The first time only (a marker on the host: the local backend), the set-up runs more processes
    # than a sandbox may: the watchdog destroys the sandbox under it, which the task cannot help.
    marker = short_tmp / "died-once"
    setup = f"if mkdir {marker} 2>/dev/null; then for i in $(seq 600); do sleep 30 & done; wait; fi"
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        (refilled,) = await pipe.run_request("r1", command_args("flaky-shell", setup=setup))
        assert (refilled.ended_by, refilled.finish_reason, refilled.reward) == ("model", "completed", 1.0)
        (failure,) = refilled.metrics["infra_failures"]
        assert failure["ended_by"] == "sandbox" and failure["error_code"], failure
        assert pipe.counters["refilled"] == 1
        marker.rmdir()
        (lost,) = await pipe.run_request("r2", command_args("flaky-shell", setup=setup, infra_retries=0))
        assert (lost.ended_by, lost.finish_reason, lost.reward_valid) == ("sandbox", "error", False)
        assert lost.metrics["infra_failures"] == [] and pipe.counters["refilled"] == 1


async def test_who_ended_each_sample_is_said_and_only_infrastructure_is_refilled(short_tmp: Path) -> None:
    async with pipeline(short_tmp, PipelineLimits()) as pipe:
        (broken_task,) = await pipe.run_request("t", command_args("bad-setup", setup="exit 3"))
        (zero,) = await pipe.run_request("m", command_args("scored-zero", eval_script="echo 0"))
        slow = asyncio.ensure_future(pipe.run_request("c", command_args("cancelled", run=["sleep 31"])))
        await async_wait_until(  # until the agent's command runs: the sample is under way
            lambda: any(p.info["cmdline"] == ["sleep", "31"] for p in psutil.process_iter(["cmdline"])),
            STAGE_TIMEOUT_S, "the agent's command running", poll_s=0.05)
        slow.cancel()
        (cancelled,) = await slow
    assert (broken_task.ended_by, broken_task.error_code, broken_task.reward_valid) == ("task", "TASK", False)
    assert (zero.ended_by, zero.reward, zero.reward_valid) == ("model", 0.0, True)  # a real 0, to train on
    assert (cancelled.ended_by, cancelled.finish_reason) == ("client", "cancelled")
    assert pipe.counters["refilled"] == 0
    with pytest.raises(BadRequest, match="infra_retries"):
        async with pipeline(short_tmp / "b", PipelineLimits()) as pipe:
            await pipe.run_request("x", command_args("x", infra_retries=99))
