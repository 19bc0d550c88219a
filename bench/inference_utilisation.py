"""Inference utilisation: how busy a GPU-like inference server stays under the staged pipeline and
under a synchronous batch loop (generate for all, then run all tools, then evaluate all, as
trainer-embedded loops do), on eval-heavy tasks, in the same run.

The reference policy stands in for the GPU server: a fixed number of sequence slots and a fixed
time per generated token (``--slots``/``--ms-per-token``); it integrates occupied slots over time.
Each task is a ``command`` task whose evaluation sleeps EVAL_S; the scripted policy answers every
turn with a bash call sleeping TOOL_S, then a submit. Both loops use real sandboxes and the same
scripted replies through the same HTTP protocol.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest  # noqa: E402
from rolloutd.cli.demo import policy_server  # noqa: E402
from rolloutd.daemon.inference import SamplingParams  # noqa: E402
from rolloutd.daemon.inference.vllm_http import GENERATE_PATH, generate_request  # noqa: E402
from rolloutd.daemon.policy.tokenizer import load_tokenizer  # noqa: E402

SLOTS, MS_PER_TOKEN = 4, 20.0
TURNS, TOOL_S, EVAL_S = 4, 0.1, 20.0
RAMP_S = EVAL_S
# An asynchronous trainer keeps enough rollouts in flight to fill the server: each rollout here
# holds a slot for about a tenth of its life (four short generations against a 20 s evaluation),
# so four slots need about 40 in flight, more where set-up, tools and evaluation take longer than
# their nominal times. At 48 a slower host left the slots just short of full (0.89-0.90); 56
# keeps a margin. The synchronous loop gets the same 56 as its batch.
IN_FLIGHT = 56


def tool_reply(turn: int) -> str:
    if turn == TURNS:
        return 'Done.\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
    return f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "sleep {TOOL_S}"}}}}\n</tool_call>'


def task(i: int) -> dict:
    return {"type": "command", "instance_id": f"util-{i}", "problem_statement": "Check the environment.",
            "eval_script": f"sleep {EVAL_S}; echo 1"}


async def utilisation(session: aiohttp.ClientSession, url: str, reset: bool = False) -> float:
    if reset:
        async with session.post(f"{url}/rolloutd/utilisation/reset") as r:
            r.raise_for_status()
        return 0.0
    async with session.get(f"{url}/rolloutd/utilisation") as r:
        return float((await r.json())["utilisation"])


async def staged(address: str, n: int, session: aiohttp.ClientSession, url: str) -> float:
    """Keep IN_FLIGHT rollouts in the daemon, submitting a new one whenever one finishes (as an
    asynchronous RL trainer does). The first IN_FLIGHT go in over RAMP_S, about one rollout's life,
    so the measured part looks like a trainer that has been running a while, with rollouts at every
    stage: started in one burst they move in lockstep (all generating, then all evaluating while
    the server idles), a convoy a running trainer does not have. Utilisation is read from the end
    of the ramp to the last submission (after that the daemon only drains)."""
    value = 0.0
    async with AsyncRolloutClient(address) as client:
        requests = [RolloutRequest(task=task(i), ipython=False, sampling={"max_tokens": 256, "seed": 0})
                    for i in range(n)]
        pending: set[str] = set()
        for request in requests[:IN_FLIGHT]:
            pending |= set(await client.submit([request]))
            await asyncio.sleep(RAMP_S / IN_FLIGHT)
        await utilisation(session, url, reset=True)
        submitted = IN_FLIGHT
        while pending:
            async for result in client.as_completed(sorted(pending)):
                assert result.error is None, result.error
                assert all(t.reward == 1.0 for t in result.trajectories), \
                    [(t.finish_reason, t.error_message) for t in result.trajectories]
                await client.release(result)
                pending.discard(result.request_id)
                if submitted < n:
                    pending |= set(await client.submit([requests[submitted]]))
                    submitted += 1
                    if submitted == n:
                        value = await utilisation(session, url)
                break
    return value


async def synchronous(address: str, url: str, api_key: str, n: int) -> None:
    """The trainer-embedded loop: per batch, every model turn for all, then every tool for all,
    and the evaluation of all at the end; the next batch waits for the whole batch."""
    tokenizer = load_tokenizer()
    headers = {"Authorization": f"Bearer {api_key}"}
    params = SamplingParams(max_tokens=256, seed=0)
    async with AsyncRolloutClient(address) as client, aiohttp.ClientSession(headers=headers) as http:
        for start in range(0, n, IN_FLIGHT):
            batch = list(range(start, min(n, start + IN_FLIGHT)))
            boxes = await asyncio.gather(*(client.open_sandbox(ipython=False) for _ in batch))
            prompts = [tokenizer.encode(tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Task id: util-{i}\nCheck the environment."}], tokenize=False,
                add_generation_prompt=True), add_special_tokens=False) for i in batch]

            async def generate(k: int) -> None:
                body = generate_request(prompts[k], params, f"sync-{batch[k]}-{len(prompts[k])}")
                async with http.post(f"{url}{GENERATE_PATH}", json=body) as r:
                    r.raise_for_status()
                    prompts[k] = prompts[k] + (await r.json())["choices"][0]["token_ids"]

            for turn in range(1, TURNS + 1):
                await asyncio.gather(*(generate(k) for k in range(len(batch))))
                if turn < TURNS:
                    await asyncio.gather(*(box.run(f"sleep {TOOL_S}") for box in boxes))
            results = await asyncio.gather(*(box.run(f"sleep {EVAL_S}; echo 1") for box in boxes))
            assert all(r.output.strip() == "1" for r in results)
            await asyncio.gather(*(box.close() for box in boxes))


async def measure(address: str, url: str, api_key: str, n: int) -> dict[str, float]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as session:
        t0 = time.monotonic()
        u_staged = await staged(address, n, session, url)
        staged_s = time.monotonic() - t0
        await asyncio.sleep(3)  # let the pool refill before the second loop
        await utilisation(session, url, reset=True)
        t0 = time.monotonic()
        await synchronous(address, url, api_key, n)
        sync_s = time.monotonic() - t0
        u_sync = await utilisation(session, url)
    return {"inference_utilisation_staged": u_staged, "inference_utilisation_sync": u_sync,
            "staged_s": staged_s, "sync_s": sync_s}


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    n = IN_FLIGHT * (2 if args.quick else 4)
    work = Path(tempfile.mkdtemp(prefix="rld-util-"))
    plans = work / "plans.json"
    plans.write_text(json.dumps({"plans": {f"util-{i}": [tool_reply(t) for t in range(1, TURNS + 1)]
                                           for i in range(n)}}))
    api_key = secrets.token_hex(16)
    with policy_server(plans, api_key, ["--slots", str(SLOTS), "--ms-per-token", str(MS_PER_TOKEN)]) as url:
        env = {"ROLLOUTD_INFERENCE_API_KEY": api_key, "ROLLOUTD_WARM_IPYTHON": "0"}
        node_args = ["--backend", "apptainer", "--workers", "2", "--warm", str(IN_FLIGHT // 2 + 4),
                     "--inference-server", url]
        with node_daemon(work / "node", *node_args, env=env) as address:
            results = asyncio.run(measure(address, url, api_key, n))
    print_table(f"Inference slot occupancy, {n} eval-heavy rollouts ({TURNS} turns, tools {TOOL_S} s, eval {EVAL_S} s; "
                f"server: {SLOTS} slots, {MS_PER_TOKEN} ms/token)", ["loop", "utilisation", "wall s"],
                [["staged pipeline (ours)", results["inference_utilisation_staged"], results["staged_s"]],
                 ["synchronous batch loop", results["inference_utilisation_sync"], results["sync_s"]]])
    write_json(args.json, results)
    ok = check_targets([
        (f"staged utilisation {results['inference_utilisation_staged']:.2f} >= 0.9",
         results["inference_utilisation_staged"] >= 0.9),
        (f"staged/sync {results['inference_utilisation_staged'] / max(1e-9, results['inference_utilisation_sync']):.2f}x"
         " >= 1.5x", results["inference_utilisation_staged"] >= 1.5 * results["inference_utilisation_sync"]),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
