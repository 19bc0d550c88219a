"""GRPO on the bundled tasks with the reference CPU policy: rollouts through rolloutd, a torch
update on CPU, the new weights pushed to the policy server, the next rollouts on them.

    python examples/grpo_cpu.py [--steps 3] [--tasks 2] [--n 4] [--protocol sglang|vllm]
                                [--backend auto|apptainer|local] [--lr 0.02] [--json PATH]

Each step:

1. rollouts: every task ``n`` times through the client (a node daemon with the policy server);
   every turn of every trajectory must carry the current weight version;
2. the token-in/token-out check: the trainer recomputes each generated token's log-probability
   with its own (torch) copy of the weights; it must equal the server's within 1e-5;
3. GRPO: advantage = (reward - group mean) / group std, the group being one task's samples;
   loss = the clipped policy-gradient loss over generated tokens (mask 1), ratio = p_new / p_rollout,
   averaged over all generated tokens of the batch; one Adam step;
4. the push: pause the inference servers through the daemon, ``/update_weights_from_disk`` with
   the new ``.npz`` and weight version, tell the daemon the version when the protocol does not
   report it (vLLM), resume.

Why the rewards differ within a group: a tiny random model cannot fix a bug, so the policy server
runs in scripted mode. Half of each task's samples follow the task's oracle plan (reward 1); the
other half are the same task under another id whose plan gives up at once (reward 0). Scripted
replies fix the tokens, not their probabilities: every token still carries the model's true
log-probability, so the loss, the gradient and the check above are real, and learning shows as
the solved samples' tokens gaining log-probability and the unsolved ones' losing it (printed as
``logp+`` / ``logp-``, per token, as the server reported them at rollout). Rewards stay constant.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rolloutd.cli.demo import node_daemon, policy_server
from rolloutd.client import RolloutClient, RolloutdError, RolloutRequest, Trajectory
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.sandbox.apptainer import apptainer_available
from rolloutd.daemon.tasks.datasets import dataset_records, oracle_plans

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_policy import TorchReferencePolicy  # noqa: E402

GIVE_UP = "-giveup"
GIVE_UP_REPLY = ("I could not find the cause of this issue, so I will stop here.\n"
                 '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>')
LOGPROB_TOLERANCE = 1e-5


@dataclass
class Sample:
    group: str
    """The task the sample belongs to (its GRPO group)."""
    trajectory: Trajectory
    advantage: float = 0.0


@dataclass
class StepReport:
    step: int
    weight_version: str
    """The version every rollout of this step was generated with."""
    next_version: str
    """The version pushed at the end of the step."""
    loss: float
    mean_reward: float
    rewards: list[float]
    max_logprob_diff: float
    """max |trainer log-prob - server log-prob| over generated tokens, before the update."""
    logp_solved: float
    logp_unsolved: float
    """Mean server log-probability per generated token of the reward-1 / reward-0 samples."""
    model_tokens: int
    rollout_s: float
    train_s: float
    push_s: float


def rollout_requests(task_ids: list[str], n: int, seed: int) -> list[tuple[str, RolloutRequest]]:
    """Per task: n/2 samples on the oracle plan's id, n/2 on the give-up plan's id."""
    records = dataset_records("bundled")
    sampling = {"max_tokens": 1024, "seed": seed}
    out = []
    for task_id in task_ids:
        giveup = {**records[task_id], "instance_id": task_id + GIVE_UP}
        out.append((task_id, RolloutRequest(task_id=task_id, n=n // 2, sampling=sampling)))
        out.append((task_id, RolloutRequest(task=giveup, n=n - n // 2, sampling=sampling)))
    return out


def collect(client: RolloutClient, requests: list[tuple[str, RolloutRequest]], timeout_s: float) -> list[Sample]:
    ids = client.submit([r for _, r in requests])
    group_of = dict(zip(ids, (g for g, _ in requests)))
    samples = []
    for result in client.as_completed(ids, timeout_s=timeout_s):
        if result.error is not None:
            raise result.error
        samples.extend(Sample(group_of[result.request_id], t.copy()) for t in result.trajectories)
        client.release(result)
    return samples


def check_versions(samples: list[Sample], version: str) -> None:
    for s in samples:
        t = s.trajectory
        if t.finish_reason == "error" or not t.turns:
            raise RolloutdError(f"{t.task_id}/{t.sample_index} ended with {t.finish_reason}: {t.error_message}")
        if set(t.weight_versions) != {version}:
            raise RolloutdError(f"{t.task_id}/{t.sample_index} was generated with weight versions "
                                f"{sorted(set(t.weight_versions))}, expected only {version!r}")


def set_advantages(samples: list[Sample]) -> None:
    """GRPO: (reward - mean) / std within each group (0 where a group's rewards are all equal)."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    for members in groups.values():
        rewards = [m.trajectory.reward for m in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for m in members:
            m.advantage = (m.trajectory.reward - mean) / std if std > 0 else 0.0


def train_step(policy: TorchReferencePolicy, optimizer: torch.optim.Optimizer, samples: list[Sample],
               clip: float) -> tuple[float, float]:
    """One optimizer step on the clipped policy-gradient loss; (loss, max log-prob difference)."""
    total_tokens = sum(s.trajectory.num_model_tokens for s in samples)
    optimizer.zero_grad()
    loss_sum, max_diff = 0.0, 0.0
    for s in samples:
        t = s.trajectory
        positions = np.flatnonzero(t.response_mask == 1)
        new = policy.token_logprobs(t.prompt_ids, t.response_ids, positions)
        old = torch.from_numpy(t.response_logprobs[positions].astype(np.float64))
        max_diff = max(max_diff, float((new.detach() - old).abs().max()))
        ratio = torch.exp(new - old)
        surrogate = torch.minimum(ratio * s.advantage, ratio.clamp(1 - clip, 1 + clip) * s.advantage)
        # Gradients are accumulated per trajectory: one graph at a time, whatever the batch size.
        loss = -surrogate.sum() / total_tokens
        loss.backward()
        loss = loss.detach()
        loss_sum += loss.item()
    if max_diff > LOGPROB_TOLERANCE:
        raise RolloutdError(f"token-in/token-out check failed: the trainer's log-probabilities differ from the "
                            f"server's by up to {max_diff:.3g} (> {LOGPROB_TOLERANCE}); the weights or tokens differ")
    optimizer.step()
    policy.round_to_float32()
    return loss_sum, max_diff


def push_weights(client: RolloutClient, url: str, api_key: str, weights: Path, version: str, protocol: str) -> None:
    """Pause, load the new weights on the server under ``version``, resume."""
    client.pause_inference("keep")
    try:
        body = json.dumps({"model_path": str(weights), "weight_version": version}).encode()
        request = urllib.request.Request(f"{url}/update_weights_from_disk", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.load(resp)
        if not answer.get("success"):
            raise RolloutdError(f"the policy server refused the weights {weights}: {answer}")
        if protocol == "vllm":
            # vLLM's answers carry no weight version: the daemon records the one it is told.
            client.set_weight_version(version)
    finally:
        client.resume_inference()


def mean_logprob(samples: list[Sample], reward: float) -> float:
    chosen = [s.trajectory for s in samples if s.trajectory.reward == reward]
    values = np.concatenate([t.response_logprobs[t.response_mask == 1] for t in chosen]) if chosen else []
    return float(np.mean(values)) if len(values) else float("nan")


def run(args: argparse.Namespace, work: Path) -> list[StepReport]:
    task_ids = sorted(oracle_plans())[: args.tasks]
    plans = {**{t: oracle_plans()[t] for t in task_ids}, **{t + GIVE_UP: [GIVE_UP_REPLY] for t in task_ids}}
    (work / "plans.json").write_text(json.dumps({"plans": plans}))
    backend = args.backend if args.backend != "auto" else ("apptainer" if apptainer_available() else "local")
    api_key = secrets.token_hex(16)
    policy = TorchReferencePolicy.from_model(default_model())  # the weights the server starts with
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    reports = []
    print(f"GRPO on {task_ids} x {args.n} samples, {args.protocol} protocol, sandbox backend {backend}, "
          f"lr {args.lr}", flush=True)
    t_start = time.monotonic()
    with policy_server(work / "plans.json", api_key) as url:
        node_args = ["--backend", backend, "--inference-server", f"{args.protocol}+{url}",
                     "--warm", str(min(4, args.n * len(task_ids))), "--workers", "1"]
        with node_daemon(work / "node", node_args, {"ROLLOUTD_INFERENCE_API_KEY": api_key}) as address:
            print(f"policy server {url} and node daemon {address} ready in {time.monotonic() - t_start:.1f} s",
                  flush=True)
            with RolloutClient(address) as client:
                version = "0"
                for step in range(1, args.steps + 1):
                    t0 = time.monotonic()
                    samples = collect(client, rollout_requests(task_ids, args.n, seed=step), args.timeout_s)
                    check_versions(samples, version)
                    set_advantages(samples)
                    t1 = time.monotonic()
                    loss, diff = train_step(policy, optimizer, samples, args.clip)
                    t2 = time.monotonic()
                    weights = work / f"weights-step{step}.npz"
                    policy.save(weights)
                    next_version = str(step)
                    push_weights(client, url, api_key, weights, next_version, args.protocol)
                    rewards = [s.trajectory.reward for s in samples]
                    report = StepReport(
                        step=step, weight_version=version, next_version=next_version, loss=loss,
                        mean_reward=statistics.fmean(rewards), rewards=rewards, max_logprob_diff=diff,
                        logp_solved=mean_logprob(samples, 1.0), logp_unsolved=mean_logprob(samples, 0.0),
                        model_tokens=sum(s.trajectory.num_model_tokens for s in samples),
                        rollout_s=t1 - t0, train_s=t2 - t1, push_s=time.monotonic() - t2)
                    reports.append(report)
                    print(f"step {step}  loss {loss:+.5f}  mean reward {report.mean_reward:.2f}  weight version "
                          f"{version} -> {next_version}  max|dlogp| {diff:.1e}  logp+ {report.logp_solved:.4f}  "
                          f"logp- {report.logp_unsolved:.4f}  ({len(samples)} rollouts {report.rollout_s:.1f} s, "
                          f"train {report.train_s:.2f} s, push {report.push_s:.2f} s)", flush=True)
                    version = next_version
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tasks", type=int, default=2, help="the first N bundled tasks")
    p.add_argument("--n", type=int, default=4, help="samples per task (half solved, half giving up)")
    p.add_argument("--protocol", choices=["sglang", "vllm"], default="sglang",
                   help="how the daemon talks to the policy server; SGLang answers carry the weight version")
    p.add_argument("--backend", choices=["auto", "apptainer", "local"], default="auto")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--timeout-s", type=float, default=900.0, help="for each step's rollouts")
    p.add_argument("--json", type=Path, help="write the per-step numbers here")
    args = p.parse_args(argv)
    if args.n < 2 or args.steps < 1 or args.tasks < 1:
        p.error("--n must be >= 2 (a group needs both kinds), --steps and --tasks >= 1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory(prefix="rld-grpo-") as tmp:
        reports = run(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps({"protocol": args.protocol, "steps": [asdict(r) for r in reports]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
