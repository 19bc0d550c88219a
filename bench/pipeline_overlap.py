"""Stage overlap: an eval-heavy synthetic workload through the staged pipeline, one request at a
time, and the ideal bound.

Each rollout is a ``command`` task whose set-up sleeps INIT s, a ``script`` agent that sleeps
RUN s, and an evaluation that sleeps EVAL s, all as real commands in real sandboxes. The ideal
bound for a batch of N is set by the busiest stage: ceil(N/slots) waves of its duration d, plus
the time the first rollout needs to reach that stage and the last to leave it (the other stages'
d), which no schedule can avoid. The durations d are the mean stage times measured in this run
(the sleeps plus what the commands around them cost), so the bound is one the same work could meet.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.async_client import RolloutRequest  # noqa: E402
from rolloutd.client.sync_client import RolloutClient  # noqa: E402

DURATIONS = {"init": 0.1, "run": 0.3, "eval": 1.0}
# As many init slots as eval slots: with fewer, the 64 set-ups take more waves than the bound's
# fill allows for, and the bound becomes one no schedule could meet.
SLOTS = {"init": 32, "run": 256, "eval": 32}


def request(i: int) -> RolloutRequest:
    task = {"type": "command", "instance_id": f"synthetic-{i}", "problem_statement": "sleep",
            "setup_script": f"sleep {DURATIONS['init']}", "eval_script": f"sleep {DURATIONS['eval']}; echo 1"}
    return RolloutRequest(task=task, agent="script", agent_config={"commands": [f"sleep {DURATIONS['run']}"]},
                          ipython=False)


def ideal_seconds(n: int, durations: dict[str, float]) -> float:
    busiest = max(durations, key=lambda s: -(-n // SLOTS[s]) * durations[s])
    fill = sum(d for s, d in durations.items() if s != busiest)
    return -(-n // SLOTS[busiest]) * durations[busiest] + fill


def run_batch(client: RolloutClient, requests: list[RolloutRequest], stage_s: dict[str, list[float]]) -> float:
    t0 = time.monotonic()
    ids = client.submit(requests)
    for result in client.as_completed(ids, timeout_s=600):
        assert result.error is None, result.error
        for t in result.trajectories:
            assert t.finish_reason == "completed" and t.reward == 1.0, (t.finish_reason, t.error_message)
            for stage, seconds in t.stage_s.items():
                stage_s[stage].append(seconds)
        client.release(result)
    return time.monotonic() - t0


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    n = 64
    n_seq = 4 if args.quick else 16
    run_dir = Path(tempfile.mkdtemp(prefix="rld-po-"))
    # Enough warm sandboxes for the whole batch: the bench measures stage scheduling, not start-up.
    node_args = ["--backend", "apptainer", "--workers", "2", "--warm", str(n // 2 + 2)]
    env = {"ROLLOUTD_WARM_IPYTHON": "0", "ROLLOUTD_INIT_CONCURRENCY": str(SLOTS["init"]),
           "ROLLOUTD_RUN_CONCURRENCY": str(SLOTS["run"]), "ROLLOUTD_EVAL_CONCURRENCY": str(SLOTS["eval"])}
    with node_daemon(run_dir, *node_args, env=env) as address:
        with RolloutClient(address) as client:
            stage_s: dict[str, list[float]] = {s: [] for s in DURATIONS}
            _wait_warm(client, n)
            staged = run_batch(client, [request(i) for i in range(n)], stage_s)
            _wait_warm(client, n)
            sequential = sum(run_batch(client, [request(1000 + i)], {s: [] for s in DURATIONS})
                             for i in range(n_seq)) / n_seq
    measured = {s: sum(v) / len(v) for s, v in stage_s.items()}
    ideal = ideal_seconds(n, measured)
    results = {"staged_rps": n / staged, "sequential_rps": 1 / sequential, "ideal_rps": n / ideal,
               "ideal_nominal_rps": n / ideal_seconds(n, DURATIONS)}
    print("measured mean stage seconds: " + ", ".join(f"{s} {d:.3f}" for s, d in measured.items()))
    print_table(f"{n} eval-heavy rollouts (init {DURATIONS['init']} s, run {DURATIONS['run']} s, "
                f"eval {DURATIONS['eval']} s of sleep; slots {SLOTS})", ["schedule", "rollouts/s", "batch s", "x sequential"],
                [["staged pipeline (ours)", results["staged_rps"], staged, results["staged_rps"] / results["sequential_rps"]],
                 ["one request at a time", results["sequential_rps"], n * sequential, 1.0],
                 ["ideal bound (busiest stage + fill)", results["ideal_rps"], ideal,
                  results["ideal_rps"] / results["sequential_rps"]]])
    write_json(args.json, results)
    ok = check_targets([(f"staged {results['staged_rps']:.1f} rps >= 0.9 x ideal {results['ideal_rps']:.1f} rps",
                         results["staged_rps"] >= 0.9 * results["ideal_rps"])])
    return 0 if ok else 1


def _wait_warm(client: RolloutClient, n: int) -> None:
    deadline = time.monotonic() + 300
    while client.status()["sandboxes"]["ready"] < n and time.monotonic() < deadline:
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
