"""The server pool over real servers: stickiness, least-loaded choice, servers added, removed and
crashing mid-run, retries that restart the whole turn, cancel, pause/resume and weight versions."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import numpy as np
import pytest
from inference_support import (
    API_KEY,
    PROMPT,
    BadServer,
    max_logprob_error,
    policy_server,
    policy_server_process,
    wait_until,
)
from support.loop import run

from rolloutd.daemon.inference.base import GenerateResult, SamplingParams
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.inference.vllm_http import VLLMHTTPBackend
from rolloutd.native_io.errors import (
    ConfigError,
    InferenceError,
    InferenceProtocolError,
    InferenceTimeout,
    NoInferenceServer,
    NotFound,
)

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


async def _turns(pool: ServerPool, trajectory: str, n: int, params: SamplingParams) -> list[GenerateResult]:
    """``n`` turns of one trajectory, each prompt extending the last with the generated ids."""
    prompt, out = list(PROMPT), []
    for _ in range(n):
        result = await pool.generate(prompt, params, trajectory_id=trajectory, timeout_s=30)
        out.append(result)
        prompt = prompt + result.token_ids.tolist() + [1, 580, 207]
    return out


def test_trajectories_stick_to_one_server_and_spread_by_load() -> None:
    async def scenario() -> None:
        async with policy_server() as a, policy_server() as b:
            async with await ServerPool.create(["vllm+" + a.url, "sglang+" + b.url], api_key=API_KEY) as pool:
                runs = await asyncio.gather(*(_turns(pool, f"traj-{i}", 3, SamplingParams(max_tokens=6, seed=i))
                                              for i in range(8)))
                status = pool.status()
        servers = [{r.server for r in results} for results in runs]
        assert all(len(s) == 1 for s in servers)  # every turn of a trajectory on one server
        counts = [sum(s == {url} for s in servers) for url in (a.url, b.url)]
        assert counts == [4, 4]  # eight trajectories started together split evenly
        assert [s["completed"] for s in status["servers"]] == [12, 12]
        assert status["sticky_trajectories"] == 8
    run(scenario())


def test_new_trajectories_avoid_the_busy_server_and_release_drops_stickiness() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=25) as slow, policy_server() as fast:
            async with await ServerPool.create([slow.url, fast.url], api_key=API_KEY) as pool:
                # Six long turns: three land on the slow server and are still running there when
                # new trajectories start.
                pinned = [asyncio.create_task(pool.generate(PROMPT, LONG, trajectory_id=f"p{i}", timeout_s=30))
                          for i in range(6)]
                # The server sees a turn once its connection is up, after the pool counted it.
                await wait_until(lambda: [s["in_flight"] for s in pool.status()["servers"]] == [3, 0]
                                 and slow.engine.running == 3, what="three turns running on the slow server")
                fresh = await asyncio.gather(*(pool.generate(PROMPT, SamplingParams(max_tokens=4),
                                                             trajectory_id=f"n{i}", timeout_s=30) for i in range(3)))
                assert {r.server for r in fresh} == {fast.url}
                done = await asyncio.gather(*pinned)
                sticky_server = done[0].server
                pool.release_trajectory("p0")
                # p0 went to the first server; released, its next turn goes wherever load says (both idle:
                # the server with fewer calls so far, the slow one).
                again = await pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="p0", timeout_s=30)
        assert sticky_server == slow.url and again.server == slow.url
    run(scenario())


def test_removed_server_turns_restart_elsewhere_without_duplicated_tokens() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as a, policy_server(ms_per_token=5) as b:
            async with await ServerPool.create([a.url, b.url], api_key=API_KEY) as pool:
                calls = [asyncio.create_task(pool.generate(PROMPT, LONG, trajectory_id=f"t{i}", timeout_s=30))
                         for i in range(6)]
                await wait_until(lambda: a.engine.running == 3 and a.engine.steps >= 3)
                await pool.remove_server(a.url)
                assert a.engine.running == 0  # the moved turns were aborted there
                results = await asyncio.gather(*calls)
                status = pool.status()
                later = await pool.generate(PROMPT, SamplingParams(max_tokens=3), trajectory_id="t0", timeout_s=30)
        assert [s["address"] for s in status["servers"]] == [b.url]
        assert later.server == b.url
        for r in results:
            assert r.server == b.url
            assert (len(r.token_ids), r.finish_reason) == (40, "length")
            assert max_logprob_error(PROMPT, r) <= 1e-5
    run(scenario())


def test_crashed_server_turns_are_retried_whole_on_another() -> None:
    async def scenario() -> None:
        async with policy_server_process("--ms-per-token", "10") as (proc, doomed), \
                policy_server_process("--ms-per-token", "2") as (_, healthy):
            async with await ServerPool.create([doomed, healthy], api_key=API_KEY, health_interval_s=0) as pool:
                params = SamplingParams(max_tokens=30, ignore_eos=True, seed=5)
                calls = [asyncio.create_task(pool.generate(PROMPT, params, trajectory_id=f"c{i}", timeout_s=30))
                         for i in range(4)]
                # Turns under way on the doomed server (sent and waiting for their tokens) when it dies.
                await wait_until(lambda: {s["address"]: s["in_flight"] for s in pool.status()["servers"]}[doomed] == 2,
                                 what="two turns on the doomed server")
                proc.send_signal(signal.SIGKILL)
                results = await asyncio.gather(*calls)
                status = {s["address"]: s for s in pool.status()["servers"]}
                # The same seeded turn run directly on the healthy server: the pool's answer must be
                # exactly that, not a splice of the crashed server's partial output and a new one.
                direct = VLLMHTTPBackend(healthy, api_key=API_KEY)
                expected = await direct.generate(PROMPT, params, request_id="direct", timeout_s=30)
                await direct.close()
        assert not status[doomed]["healthy"] and status[doomed]["failures"] >= 1
        assert "may be down" in status[doomed]["last_error"] or "HTTP" in status[doomed]["last_error"]
        assert status[healthy]["completed"] == 4
        for r in results:
            assert r.server == healthy
            np.testing.assert_array_equal(r.token_ids, expected.token_ids)
            np.testing.assert_array_equal(r.logprobs, expected.logprobs)
    run(scenario(), timeout_s=90)


@pytest.mark.parametrize("mode", ["http500", "truncated", "no_logprobs", "disconnect"])
def test_bad_server_is_taken_out_and_the_turn_retried(mode: str) -> None:
    async def scenario() -> None:
        async with BadServer(mode) as bad, policy_server() as good:
            specs = ["vllm+" + bad.url, good.url]
            async with await ServerPool.create(specs, api_key=API_KEY, health_interval_s=0) as pool:
                params = SamplingParams(max_tokens=12, seed=4)
                result = await pool.generate(PROMPT, params, trajectory_id="x", timeout_s=30)
                status = {s["address"]: s for s in pool.status()["servers"]}
                direct = VLLMHTTPBackend(good.url, api_key=API_KEY)
                expected = await direct.generate(PROMPT, params, request_id="d", timeout_s=30)
                await direct.close()
        assert bad.generate_calls == 1
        assert result.server == good.url
        np.testing.assert_array_equal(result.token_ids, expected.token_ids)
        assert max_logprob_error(PROMPT, result) <= 1e-5
        assert not status[bad.url]["healthy"] and status[bad.url]["last_error"]
    run(scenario())


def test_only_bad_servers_give_the_servers_error_then_none_left() -> None:
    async def scenario() -> None:
        async with BadServer("no_logprobs") as bad:
            async with await ServerPool.create(["sglang+" + bad.url], health_interval_s=0) as pool:
                with pytest.raises(InferenceProtocolError, match="without log-probabilities") as info:
                    await pool.generate(PROMPT, SamplingParams(max_tokens=8), trajectory_id="x", timeout_s=10)
                assert any("no other healthy server" in note for note in info.value.__notes__)
                with pytest.raises(NoInferenceServer, match="out"):
                    await pool.generate(PROMPT, SamplingParams(max_tokens=8), trajectory_id="y", timeout_s=10)
                # The health check puts a server whose /health answers back in the pool.
                assert await pool.check_health() == {bad.url: True}
                bad.mode = "ok"
                result = await pool.generate(PROMPT, SamplingParams(max_tokens=8), trajectory_id="y", timeout_s=10)
                assert result.token_ids.tolist() == [5, 6, 2] and result.weight_version == "7"
    run(scenario())


def test_health_loop_takes_a_dead_server_out() -> None:
    async def scenario() -> None:
        async with policy_server() as good:
            async with await ServerPool.create([good.url], api_key=API_KEY, health_interval_s=0.05) as pool:
                async with BadServer("ok") as flaky:
                    await pool.add_server("sglang+" + flaky.url)
                    await wait_until(lambda: pool.status()["servers"][1]["healthy"])
                    url = flaky.url
                await wait_until(lambda: not pool.status()["servers"][1]["healthy"], what="dead server out")
                results = await asyncio.gather(*(pool.generate(PROMPT, SamplingParams(max_tokens=3),
                                                               trajectory_id=f"h{i}", timeout_s=10) for i in range(4)))
        assert {r.server for r in results} == {good.url} and url != good.url
    run(scenario())


def test_hang_through_the_pool_is_a_timeout_not_a_failure() -> None:
    async def scenario() -> None:
        async with BadServer("hang") as bad:
            async with await ServerPool.create([bad.url], health_interval_s=0) as pool:
                with pytest.raises(InferenceTimeout):
                    await pool.generate(PROMPT, SamplingParams(max_tokens=8), trajectory_id="x", timeout_s=0.3,
                                        request_id="hung")
                await wait_until(lambda: bad.aborted == ["hung"])
                assert pool.status()["servers"][0]["healthy"]
    run(scenario())


def test_cancel_through_the_pool_aborts_on_the_server() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as srv:
            async with await ServerPool.create(["sglang+" + srv.url], api_key=API_KEY) as pool:
                call = asyncio.create_task(pool.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True),
                                                         trajectory_id="c", timeout_s=30))
                await wait_until(lambda: srv.engine.running == 1)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                await wait_until(lambda: srv.engine.running == 0)
                assert pool.status()["servers"][0]["in_flight"] == 0
                assert pool.status()["servers"][0]["healthy"]
    run(scenario())


def test_pause_resume_and_weight_versions() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as v, policy_server(ms_per_token=5) as s, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            async with await ServerPool.create(["vllm+" + v.url, "sglang+" + s.url], api_key=API_KEY) as pool:
                before = await asyncio.gather(*(pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id=t,
                                                              timeout_s=30) for t in ("tv", "ts")))
                running = [asyncio.create_task(pool.generate(PROMPT, LONG, trajectory_id=t, timeout_s=30))
                           for t in ("tv", "ts")]
                await wait_until(lambda: v.engine.running == 1 and s.engine.running == 1 and v.engine.steps > 3)
                await pool.pause_all()
                assert v.engine.is_paused and s.engine.is_paused and pool.paused
                steps = (v.engine.steps, s.engine.steps)
                dispatched = [x["dispatched"] for x in pool.status()["servers"]]
                held = asyncio.create_task(pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="new",
                                                         timeout_s=30))
                with pytest.raises(InferenceTimeout, match="paused"):
                    await pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="short", timeout_s=0.1)
                await asyncio.sleep(0.1)
                assert (v.engine.steps, s.engine.steps) == steps and not any(t.done() for t in running)
                assert [x["dispatched"] for x in pool.status()["servers"]] == dispatched and not held.done()
                # The trainer updates the weights: SGLang learns the version from its update call,
                # vLLM 0.32 from the label the pool sets on it (and reports it per call).
                async with http.post(s.url + "/update_weight_version", json={"new_version": "step-7"}) as resp:
                    assert resp.status == 200
                await pool.set_weight_version("step-7")
                await pool.resume_all()
                after = await asyncio.gather(*running, held)
                status = pool.status()
        assert [r.weight_version for r in before] == ["0", "0"]
        assert [r.server for r in after[:2]] == [v.url, s.url]
        assert [r.weight_version for r in after] == ["step-7"] * 3
        assert all(len(r.token_ids) == 40 and max_logprob_error(PROMPT, r) <= 1e-5 for r in after[:2])
        assert not status["paused"] and status["weight_version"] == "step-7"
        assert {x["address"]: x["weight_version"] for x in status["servers"]}[s.url] == "step-7"
    run(scenario())


def test_servers_added_at_run_time_and_membership_errors() -> None:
    async def scenario() -> None:
        async with policy_server() as a, policy_server(protocol="sglang") as b:
            async with ServerPool(api_key=API_KEY) as pool:
                with pytest.raises(NoInferenceServer, match="empty"):
                    await pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="x", timeout_s=5)
                await pool.add_server(a.url)
                first = await pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="x", timeout_s=5)
                assert await pool.add_server(b.url) == b.url  # detected as SGLang
                second = await pool.generate(PROMPT, SamplingParams(max_tokens=2), trajectory_id="y", timeout_s=5)
                kinds = [s["kind"] for s in pool.status()["servers"]]
                with pytest.raises(ConfigError, match="already"):
                    await pool.add_server(a.url)
                with pytest.raises(NotFound):
                    await pool.remove_server("http://127.0.0.1:1")
                with pytest.raises(InferenceError, match="cannot reach"):
                    await pool.add_server("http://127.0.0.1:1")
        assert (first.server, second.server) == (a.url, b.url)
        assert kinds == ["vllm-generate", "sglang"]
    run(scenario())


def test_drain_lets_running_turns_finish_on_a_removed_server() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=2) as a, policy_server() as b:
            async with await ServerPool.create([a.url, b.url], api_key=API_KEY) as pool:
                call = asyncio.create_task(pool.generate(PROMPT, LONG, trajectory_id="d", timeout_s=30))
                await wait_until(lambda: a.engine.running == 1)
                await pool.remove_server(a.url, drain_timeout_s=20)
                result = await call
        assert result.server == a.url and len(result.token_ids) == 40
    run(scenario())


def test_a_removed_server_that_ignores_its_abort_is_closed_and_the_turn_moves() -> None:
    """The removed server gets the abort for the turn's request id (again and again: it keeps the
    request) and after abort_timeout_s the pool closes its connections; the turn, never cancelled,
    runs on the other server."""
    async def scenario() -> None:
        async with BadServer("hang") as bad, policy_server() as good:
            specs = ["sglang+" + bad.url, "sglang+" + good.url]
            # One attempt: a turn moved off a removed server is not a failed attempt.
            async with await ServerPool.create(specs, api_key=API_KEY, health_interval_s=0, max_attempts=1) as pool:
                turn = asyncio.create_task(pool.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), trajectory_id="s",
                                                         timeout_s=30, request_id="stuck"))
                await wait_until(lambda: bad.hanging == 1, what="the turn hanging on the bad server")
                await pool.remove_server(bad.url, abort_timeout_s=2.0)
                result = await turn
                status = pool.status()
        assert set(bad.aborted) == {"stuck"} and len(bad.aborted) >= 2, bad.aborted
        assert result.server == good.url and len(result.token_ids) == 4
        assert [(s["address"], s["failures"]) for s in status["servers"]] == [(good.url, 0)]
    run(scenario())


def test_a_server_failing_a_pause_is_taken_out_and_named() -> None:
    async def scenario() -> None:
        async with BadServer("ok") as bad, policy_server() as good:
            specs = ["sglang+" + good.url, "sglang+" + bad.url]
            async with await ServerPool.create(specs, api_key=API_KEY, health_interval_s=0) as pool:
                with pytest.raises(InferenceError, match=f"pause failed on 1 of 2 server.*{bad.url}"):
                    await pool.pause_all()
                healthy = {s["address"]: s["healthy"] for s in pool.status()["servers"]}
        assert healthy == {good.url: True, bad.url: False}
    run(scenario())


def test_max_attempts_bounds_the_retries() -> None:
    async def scenario() -> None:
        async with BadServer("http500") as b1, BadServer("http500") as b2, BadServer("http500") as b3:
            specs = ["sglang+" + b.url for b in (b1, b2, b3)]
            async with await ServerPool.create(specs, max_attempts=2, health_interval_s=0) as pool:
                with pytest.raises(InferenceError, match="HTTP 500") as info:
                    await pool.generate(PROMPT, SamplingParams(max_tokens=4), trajectory_id="m", timeout_s=10)
                healthy = [s["healthy"] for s in pool.status()["servers"]]
        assert [b.generate_calls for b in (b1, b2, b3)] == [1, 1, 0]
        assert healthy == [False, False, True]
        assert any("max_attempts=2" in note for note in info.value.__notes__)
    run(scenario())


def test_turns_carry_the_versions_they_were_generated_under() -> None:
    """A turn sent under one version and finished after a weight update: the vLLM route reports
    per-token spans (some tokens of each version: straddled); the completions route reports none,
    so the turn is labelled with the version it was sent under (not the one current when it came
    back) and marked straddled. A turn sent after the update holds one version."""
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as g, policy_server(ms_per_token=5) as c:
            async with await ServerPool.create(["vllm-generate+" + g.url, "vllm-completions+" + c.url],
                                               api_key=API_KEY) as pool:
                await pool.set_weight_version("v1")
                running = [asyncio.create_task(pool.generate(PROMPT, LONG, trajectory_id=t, timeout_s=30))
                           for t in ("tg", "tc")]
                await wait_until(lambda: g.engine.steps > 3 and c.engine.steps > 3, what="both calls generating")
                await pool.pause_all()
                await pool.set_weight_version("v2")
                await pool.resume_all()
                across = await asyncio.gather(*running)
                after = await pool.generate(PROMPT, SamplingParams(max_tokens=3), trajectory_id="tc", timeout_s=30)
        spans, flat = across
        assert spans.server == g.url and flat.server == c.url
        versions = [s.version for s in spans.weight_spans]
        assert versions == ["v1", "v2"] and spans.weight_spans[0].end > 0 and spans.weight_spans[-1].end == 40
        assert (spans.weight_version, spans.sent_version, spans.straddled) == ("v2", "v1", True)
        assert (flat.weight_spans, flat.weight_version, flat.sent_version, flat.straddled) == ((), "v1", "v1", True)
        assert (after.weight_version, after.sent_version, after.straddled) == ("v2", "v2", False)
    run(scenario())
