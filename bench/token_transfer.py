"""Token arrays from a worker to a co-located trainer: shared memory against raw ZeroMQ frames,
arrays embedded in msgpack, and pickle; each compared with an in-process memcpy of the same bytes.

Every path ends with the client holding numpy arrays whose pages are all mapped (shared memory
is mapped with MAP_POPULATE), so nothing is deferred past the measured call.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, percentile, print_table, standard_args, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.sync_client import RolloutClient  # noqa: E402

BYTES_PER_TOKEN = 4 + 4 + 1  # int32 id, float32 logprob, uint8 mask
SIZES = {"1k": 1_000, "100k": 100_000, "1m": 1_000_000, "16m": 16_000_000}


def fetch(client: RolloutClient, n_tokens: int, encoding: str) -> float:
    n_traj = max(1, min(64, n_tokens // 1000))
    t0 = time.perf_counter()
    reply = client.request("debug.make_arrays", {"n_tokens": n_tokens, "n_trajectories": n_traj, "encoding": encoding})
    if encoding == "msgpack":
        dtypes = {"response_ids": np.int32, "response_logprobs": np.float32, "response_mask": np.uint8,
                  "offsets": np.int64}
        arrays = {k: np.array(v, dtype=dtypes[k]) for k, v in reply.result["embedded"].items()}
    elif encoding == "pickle":
        arrays = pickle.loads(reply.arrays["pickle"])
    else:
        arrays = reply.arrays
    assert len(arrays["offsets"]) == n_traj + 1
    elapsed = time.perf_counter() - t0
    client.release(reply)
    return elapsed


def memcpy_times(n_tokens: int, reps: int) -> list[float]:
    """Copies between two buffers allocated once (steady state, no page faults)."""
    src = np.ones(n_tokens * BYTES_PER_TOKEN, dtype=np.uint8)
    dst = np.zeros_like(src)
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out[1:]


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    reps = {"1k": 200, "100k": 50, "1m": 15, "16m": 3} if not args.quick else {"1k": 60, "100k": 15, "1m": 6, "16m": 2}
    results: dict[str, float] = {}
    rows = []
    run_dir = Path(tempfile.mkdtemp(prefix="rld-tt-"))
    with node_daemon(run_dir, "--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops") as address:
        with RolloutClient(address) as shm_client, RolloutClient(address, arrays="frames") as frame_client:
            for label, n in SIZES.items():
                nbytes = n * BYTES_PER_TOKEN
                memcpy = percentile(memcpy_times(n, max(3, reps[label])), 50)
                paths = {"shm": (shm_client, "native"), "frames": (frame_client, "native"),
                         "msgpack": (frame_client, "msgpack"), "pickle": (frame_client, "pickle")}
                row_times = {}
                for name, (client, encoding) in paths.items():
                    if label == "16m" and name in ("msgpack", "pickle") and args.quick:
                        continue
                    fetch(client, n, encoding)  # warm-up
                    row_times[name] = percentile([fetch(client, n, encoding) for _ in range(reps[label])], 50)
                for name, t in {**row_times, "memcpy": memcpy}.items():
                    gbps = nbytes / t / 1e9
                    results[f"{name}_gbps_{label}"] = gbps
                    rows.append([label, name, nbytes / 1e6, t * 1e3, gbps, memcpy / t])
    print_table("Token arrays worker -> client (time until the client holds mapped numpy arrays)",
                ["tokens", "path", "MB", "p50 ms", "GB/s", "x memcpy"], rows)
    write_json(args.json, results)
    ok = check_targets([
        (f"shm/msgpack at 1M tokens {results['shm_gbps_1m'] / results['msgpack_gbps_1m']:.1f}x >= 5x",
         results["shm_gbps_1m"] >= 5 * results["msgpack_gbps_1m"]),
        (f"shm/pickle at 1M tokens {results['shm_gbps_1m'] / results['pickle_gbps_1m']:.1f}x >= 5x",
         results["shm_gbps_1m"] >= 5 * results["pickle_gbps_1m"]),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
