"""End-to-end rollouts per second on the bundled tasks (scripted reference policy, CodeAct agent,
Apptainer sandboxes) at 1, 8 and 32 rollouts in flight, and the daemon's CPU per agent turn.

Daemon CPU is the user+system time of the supervisor and worker processes (sandbox processes,
the policy server and the client excluded) over the run, divided by the agent turns taken. The
agent's own bookkeeping per turn (token ledger, tool-call parsing) is reported from the
trajectories' metrics, and the part the sandbox watchdogs' checks took from the workers' stats: a
watchdog checks every sandbox a worker holds once a second, so a turn pays more for it the longer
rollouts wait.

The bundled tasks end in about 5 turns, so each turn carries a fifth of the per-rollout cost
(sandbox, set-up, eval). A last level, on a fresh daemon, puts ``PROBE_TURNS`` exploring tool calls
(shell, IPython, editor) before each task's solve, nearer the length of real SWE rollouts, to
show what a turn costs once those are spread over more turns. The target is judged on the
bundled tasks as they are. ``--also-in-flight 256`` adds a level of 256, to show whether a turn's
CPU grows with the rollouts a node holds.

Last, ``cpu_floor`` measures in this process what the cheapest possible turn of the 32 level costs
with the same components (sandbox life, inference call, shell command, observation encoding),
the lower bound the measured figure is compared with, and ``cpu_parts`` what the floor leaves out
(task set-up and evaluation, IPython kernels, the agent's bookkeeping, the watchdog), so that what
is left of the measured figure is seen, not guessed.
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import Panel, check_targets, daemon_cpu_s, plot_panels, print_table, standard_args, write_json  # noqa: E402
from agent_support import mask_runs  # noqa: E402
from cpu_floor import measure_floor  # noqa: E402
from cpu_parts import measure_left_out  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.async_client import RolloutRequest  # noqa: E402
from rolloutd.client.sync_client import RolloutClient  # noqa: E402
from rolloutd.cli.demo import policy_server  # noqa: E402
from rolloutd.daemon.tasks.datasets import oracle_plans  # noqa: E402


def cpu_s(client: RolloutClient) -> tuple[float, float]:
    """The daemon's CPU seconds (``daemon_cpu_s``), and of them what the workers' sandbox watchdogs
    spent on their checks, as the workers last reported it (once a second)."""
    status = client.status()
    return daemon_cpu_s(status), sum(w.get("pool", {}).get("watchdog_cpu_s", 0.0) for w in status["workers"])


PROBE_TURNS = 30
_PROBES = [
    ("Look at the repository.", "bash", {"command": "git status --short && ls"}),
    ("Find the functions.", "bash", {"command": "grep -rn 'def ' --include=*.py . | head -n 15"}),
    ("Count the files from Python.", "ipython", {"code": "import os\nsorted(os.listdir('.'))"}),
    ("Read the README.", "str_replace_editor", {"command": "view", "path": "README.md"}),
]


def with_probes(plans: dict[str, list[str]], n: int) -> dict[str, list[str]]:
    """Each plan with ``n`` exploring turns put before its own replies."""
    probes = [f"{text}\n<tool_call>\n{json.dumps({'name': tool, 'arguments': args})}\n</tool_call>"
              for text, tool, args in _PROBES]
    return {task: [probes[i % len(probes)] for i in range(n)] + replies for task, replies in plans.items()}


def run_level(client: RolloutClient, tasks: list[str], in_flight: int, total: int,
              agent_config: dict[str, int]) -> dict[str, float]:
    requests = [RolloutRequest(task_id=tasks[i % len(tasks)], sampling={"max_tokens": 1024, "seed": i},
                               agent_config=agent_config) for i in range(total)]
    (cpu0, watchdog0), t0 = cpu_s(client), time.monotonic()
    pending = set(client.submit(requests[:in_flight]))
    submitted, turns, agent_cpu, rewards, model_tokens = in_flight, 0, [], [], 0
    agent_cpu_s, cells = 0.0, []
    waits = {"tool_s": 0.0, "generate_s": 0.0}
    rollout_s: list[float] = []
    observations: list[np.ndarray] = []
    prompt_ids: list[int] = []
    while pending:
        for result in client.as_completed(sorted(pending), timeout_s=900):
            assert result.error is None, result.error
            for t in result.trajectories:
                assert t.finish_reason == "completed", (t.finish_reason, t.error_message)
                turns += t.num_turns
                rewards.append(t.reward)
                model_tokens += int(t.response_mask.sum())
                # Copies: the arrays live in shared memory that release() gives back.
                observations += [t.response_ids[a:b].copy() for a, b in mask_runs(t.response_mask == 0)]
                prompt_ids = prompt_ids or t.prompt_ids.tolist()
                agent_cpu.extend(t.metrics.get("agent_cpu_s_per_turn", []))
                agent_cpu_s += t.metrics["agent_cpu_s"]
                cells.append(t.tools["ipython"].count if "ipython" in t.tools else 0)
                for key in waits:
                    waits[key] += t.metrics[key]
                events = t.metrics["stage_events"]
                rollout_s.append(events[-1][2] - events[0][2])
            client.release(result)
            pending.discard(result.request_id)
            if submitted < total:
                pending |= set(client.submit([requests[submitted]]))
                submitted += 1
            break
    wall, (cpu1, watchdog1) = time.monotonic() - t0, cpu_s(client)
    cpu, watchdog = cpu1 - cpu0, watchdog1 - watchdog0
    return {"rollouts_per_s": total / wall, "wall_s": wall, "turns": turns, "daemon_cpu_ms_per_turn": 1e3 * cpu / turns,
            "watchdog_ms_per_turn": 1e3 * watchdog / turns,
            "agent_cpu_ms_per_turn": 1e3 * statistics.fmean(agent_cpu), "mean_reward": statistics.fmean(rewards),
            "agent_all_cpu_ms_per_turn": 1e3 * agent_cpu_s / turns,
            "kernel_share": statistics.fmean(c > 0 for c in cells), "cells_per_rollout": statistics.fmean(cells),
            "model_tokens_per_turn": model_tokens / turns, "observations": observations, "prompt_ids": prompt_ids,
            "tool_ms_per_turn": 1e3 * waits["tool_s"] / turns, "generate_ms_per_turn": 1e3 * waits["generate_s"] / turns,
            "rollout_s_p50": statistics.median(rollout_s)}


@dataclass
class TurnCpu:
    """A level's turn against its parts, each measured alone: the floor's (ms per turn), a
    sandbox's life (ms), and the parts the floor leaves out (ms per turn)."""
    floor: dict[str, float]
    sandbox_life_ms: float
    left_out: dict[str, float]


def run_levels(plans: dict[str, list[str]], levels: dict[int, int],
               floor_of: int | None = None) -> tuple[dict[int, dict[str, Any]], TurnCpu | None]:
    """Each level (in flight: rollouts) on one node daemon and scripted policy server following
    ``plans``; and the parts of a turn of level ``floor_of`` (``measure_floor``, ``measure_left_out``)."""
    work = Path(tempfile.mkdtemp(prefix="rld-rt-"))
    (work / "plans.json").write_text(json.dumps({"plans": plans}))
    api_key = secrets.token_hex(16)
    out = {}
    with policy_server(work / "plans.json", api_key) as url:
        env = {"ROLLOUTD_INFERENCE_API_KEY": api_key}
        with node_daemon(work / "node", "--backend", "apptainer", "--workers", "2", "--warm", "8",
                         "--inference-server", url, env=env) as address:
            with RolloutClient(address) as client:
                # Room for the longest plan (its last reply submits).
                agent_config = {"max_turns": max(map(len, plans.values()))}
                for in_flight, total in levels.items():
                    out[in_flight] = {**run_level(client, sorted(plans), in_flight, total, agent_config),
                                      "rollouts": total}
        if floor_of is None:
            return out, None
        r = out[floor_of]
        turns_per_rollout = r["turns"] / r["rollouts"]
        floor, life_ms = uvloop.run(measure_floor(
            url, api_key, prompt_ids=r["prompt_ids"], observations=r["observations"],
            model_tokens_per_turn=r["model_tokens_per_turn"], turns_per_rollout=turns_per_rollout))
    left_out = uvloop.run(measure_left_out(
        sorted(plans), turns_per_rollout=turns_per_rollout, kernel_share=r["kernel_share"],
        cells_per_rollout=r["cells_per_rollout"], agent_ms_per_turn=r["agent_all_cpu_ms_per_turn"],
        observation_encode_ms=floor["observation_encode"], watchdog_ms_per_turn=r["watchdog_ms_per_turn"]))
    return out, TurnCpu(floor, life_ms, left_out)


def main() -> int:
    parser = standard_args(__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, help="write a PNG of CPU per turn, latency per turn and rollouts/s vs in flight")
    parser.add_argument("--also-in-flight", type=int, action="append", default=[], metavar="N",
                        help="one more level after the others: N rollouts, all in flight at once (e.g. 256; that many "
                             "Apptainer instances take about two minutes on 2 cores)")
    args = parser.parse_args()
    levels = {1: 3, 8: 8, 32: 32} if args.quick else {1: 6, 8: 24, 32: 64}
    levels.update({n: n for n in args.also_in_flight})
    plans = oracle_plans()
    results: dict[str, float] = {}
    rows = []
    turn_cpu: TurnCpu | None = None
    curves: list[dict[str, Any]] = []
    for suffix, level_plans, level_set in (("", plans, levels),
                                           ("_probes", with_probes(plans, PROBE_TURNS), {32: levels[32]})):
        level_results, measured = run_levels(level_plans, level_set, floor_of=32 if not suffix else None)
        turn_cpu = turn_cpu or measured
        for in_flight, r in level_results.items():
            rows.append([f"{in_flight} {suffix.strip('_')}".strip(), r["rollouts"], r["rollouts_per_s"], r["wall_s"],
                         r["turns"], r["daemon_cpu_ms_per_turn"], r["watchdog_ms_per_turn"], r["agent_cpu_ms_per_turn"],
                         r["tool_ms_per_turn"], r["generate_ms_per_turn"], r["rollout_s_p50"], r["mean_reward"]])
            for key in ("tool_ms_per_turn", "generate_ms_per_turn", "rollout_s_p50", "watchdog_ms_per_turn"):
                results[f"{key}_{in_flight}{suffix}"] = r[key]
            if not suffix:
                curves.append(r | {"in_flight": in_flight})
            results[f"rollouts_per_s_{in_flight}{suffix}"] = r["rollouts_per_s"]
            results[f"daemon_cpu_ms_per_turn_{in_flight}{suffix}"] = r["daemon_cpu_ms_per_turn"]
            results[f"agent_cpu_ms_per_turn_{in_flight}{suffix}"] = r["agent_cpu_ms_per_turn"]
            results[f"turns_per_rollout_{in_flight}{suffix}"] = r["turns"] / r["rollouts"]
    results["daemon_cpu_ms_per_turn"] = results["daemon_cpu_ms_per_turn_32"]
    print_table("Bundled tasks end to end (scripted reference policy, Apptainer sandboxes)",
                ["in flight", "rollouts", "rollouts/s", "wall s", "agent turns", "daemon CPU ms/turn",
                 "of it watchdog", "agent loop CPU ms/turn", "tool ms/turn", "model ms/turn", "rollout s p50", "mean reward"], rows)
    assert turn_cpu is not None
    parts, life_ms, left_out = turn_cpu.floor, turn_cpu.sandbox_life_ms, turn_cpu.left_out
    floor_ms, measured = sum(parts.values()), results["daemon_cpu_ms_per_turn_32"]
    all_parts_ms = floor_ms + sum(left_out.values())
    results.update({f"floor_{k}_ms": v for k, v in parts.items()}, floor_sandbox_life_ms=life_ms,
                   floor_ms_per_turn=floor_ms, **{f"left_out_{k}_ms": v for k, v in left_out.items()},
                   parts_ms_per_turn=all_parts_ms)
    print_table(f"Least daemon CPU a turn at 32 in flight could cost (see cpu_floor.py; a sandbox's life is "
                f"{life_ms:.2f} ms, over {results['turns_per_rollout_32']:.1f} turns)",
                ["part", "ms per turn"], [*parts.items(), ("floor", floor_ms), ("measured", measured)])
    print_table("What the floor leaves out (see cpu_parts.py; the agent and the watchdog timed in the workers "
                "during the level, the rest alone here)",
                ["part", "ms per turn"], [*left_out.items(), ("floor and these", all_parts_ms), ("measured", measured),
                                          ("measured - all parts", measured - all_parts_ms)])
    write_json(args.json, results)
    if args.plot:
        plot(curves, floor_ms, args.plot)
    ok = check_targets([
        (f"daemon CPU per turn at 32 in flight {measured:.2f} ms <= 1.5 x floor {floor_ms:.2f} ms",
         measured <= 1.5 * floor_ms),
        (f"daemon CPU per turn at 32 in flight {measured:.2f} ms <= 2.5 ms", measured <= 2.5),
    ])
    return 0 if ok else 1


def plot(curves: list[dict[str, Any]], floor_ms: float, path: Path) -> None:
    n = [c["in_flight"] for c in curves]
    plot_panels(path, "Bundled tasks end to end, one node, Apptainer sandboxes, 2 cores", [
        Panel("rollouts in flight", "daemon CPU per turn (ms)",
              {"measured": (n, [c["daemon_cpu_ms_per_turn"] for c in curves]),
               "of it the sandbox watchdog": (n, [c["watchdog_ms_per_turn"] for c in curves]),
               "floor (at 32, cpu_floor.py)": ([32], [floor_ms])}, log_x=True),
        Panel("rollouts in flight", "wall time per turn (ms)",
              {"tool call": (n, [c["tool_ms_per_turn"] for c in curves]),
               "model call": (n, [c["generate_ms_per_turn"] for c in curves])}, log_x=True),
        Panel("rollouts in flight", "rollouts per second", {"": (n, [c["rollouts_per_s"] for c in curves])},
              log_x=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
