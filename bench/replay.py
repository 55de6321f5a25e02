"""Batched replay of the log-prob recompute, measured on ``./run example``'s tiny transformer (CPU).

    .venv/bin/python bench/replay.py                 # the example's defaults: 4 prompts x 8, 10 steps, 16x16
    .venv/bin/python bench/replay.py --per-sample    # a batch-invariant model: the same transformer, one
                                                     # sample per forward, in the rollout and the replay

One rollout of ``flowrl.apps.example``'s ``Trainer`` (a real diffusers SD3Transformer2DModel with tiny random
weights), then the recompute of every (sample, step) log-prob with gradients (forward, the GRPO
surrogate at the first update, backward into the trained output layers), timed per iteration:

- ``step``: step by step, T forwards of batch B (what ``flowrl/apps/example.py``'s ``update`` does);
- ``N=...``: ``traj.replay_plan(N)``: ceil(T B / N) forwards of at most N (sample, step) pairs, each row
  with its own timestep, conditioning and step index.

Columns: forwards per recompute, the median wall time and process CPU time over ``--repeats`` (after
one warm-up round; the plans timed round-robin), their speed-ups against ``step``, and max |ratio - 1|
of the first update over all pairs (exactly 0 when the replayed velocities equal the rollout's bit for
bit). docs/performance.md, "Batched replay", has the
numbers and the command.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flowrl  # noqa: E402
from flowrl.apps import example  # noqa: E402


def build(args):
    """(trainer, velocity(latents, timesteps [N], samples [N])) for the example's tiny transformer."""
    ns = example.parse_args(["--prompts", str(args.prompts), "--k", str(args.k), "--steps", str(args.steps),
                             "--size", str(args.size), "--seed", str(args.seed), "--device", "cpu",
                             "--backend", args.backend])
    trainer = example.Trainer(ns)

    def forward(latents, timesteps, samples):
        return trainer.transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=trainer.embeds[samples],
                                   pooled_projections=trainer.pooled[samples], return_dict=False)[0]

    def velocity(latents, timesteps, samples):
        if not args.per_sample:
            return forward(latents, timesteps, samples)
        return torch.cat([forward(latents[i:i + 1], timesteps[i:i + 1], samples[i:i + 1])
                          for i in range(latents.shape[0])])

    return trainer, velocity


@torch.no_grad()
def rollout(trainer, velocity, args) -> flowrl.RolloutTrajectory:
    """The example's rollout, its velocity from ``velocity`` (so --per-sample rolls out one sample per forward)."""
    batch = trainer.batch
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(batch)]
    latents = torch.cat([torch.randn((1, 4, args.size, args.size), generator=g) for g in gens])
    sched = trainer.scheduler
    sched.set_timesteps(args.steps)
    everyone = torch.arange(batch)
    with sched.rollout(mode="sde", noise_level=0.7, generator=gens, backend=args.backend) as rec:
        for t in sched.timesteps:
            latents = sched.step(velocity(latents, t.expand(batch), everyone), t, latents).prev_sample
    return rec.trajectory()


def recompute(traj, velocity, advantages, batch_size: Optional[int], backend: str, eps: float = 1e-3):
    """One first update's recompute with gradients; returns max |ratio - 1| over all pairs.
    ``batch_size`` None: step by step (T forwards of B); else ``traj.replay_plan(batch_size)``."""
    ratios = []
    everyone = torch.arange(traj.batch_size)
    n_pairs = traj.batch_size * traj.num_steps
    if batch_size is None:
        for j in range(traj.num_steps):
            inputs = traj.step_inputs(j)
            v = velocity(inputs["sample"], traj.timesteps[j].expand(traj.batch_size), everyone)
            ratio = torch.exp(flowrl.step_log_prob(model_output=v, backend=backend, **inputs) - traj.log_probs[:, j])
            surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
            (surrogate.sum() / n_pairs).backward()
            ratios.append(ratio.detach())
        return float((torch.stack(ratios).double() - 1).abs().max())
    for chunk in traj.replay_plan(batch_size):
        inputs = chunk.inputs(traj)
        v = velocity(inputs["sample"], chunk.timesteps(traj), chunk.samples)
        ratio = torch.exp(flowrl.step_log_prob(model_output=v, backend=backend, **inputs) - chunk.old_log_probs(traj))
        adv = advantages[chunk.samples]
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
        (surrogate.sum() / n_pairs).backward()
        ratios.append(ratio.detach())
    return float((torch.cat(ratios).double() - 1).abs().max())


def measure(args) -> List[dict]:
    """Per plan: forwards, median wall and CPU (process) seconds per recompute, max |ratio - 1|. The plans
    are timed round-robin (each repeat runs every plan once) so that a load change on a shared machine
    falls on all of them alike; the process CPU time is less sensitive to other processes than wall time."""
    torch.manual_seed(args.seed)
    trainer, velocity = build(args)
    traj = rollout(trainer, velocity, args)
    advantages = torch.randn(traj.batch_size, generator=torch.Generator().manual_seed(args.seed))
    pairs = traj.batch_size * traj.num_steps
    plans = [None] + args.chunks
    wall = {n: [] for n in plans}
    cpu = {n: [] for n in plans}
    worst = {}
    for r in range(args.repeats + 1):
        for n in plans:
            trainer.optimizer.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            worst[n] = recompute(traj, velocity, advantages, n, args.backend)
            if r:  # the first round warms up
                wall[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
    rows = []
    for n in plans:
        forwards = traj.num_steps if n is None else len(traj.replay_plan(n))
        rows.append(dict(plan="step" if n is None else f"N={n}", forwards=forwards, seconds=statistics.median(wall[n]),
                         cpu_seconds=statistics.median(cpu[n]), max_ratio_dev=worst[n], pairs=pairs))
    for row in rows:
        row["speedup"] = rows[0]["seconds"] / row["seconds"]
        row["cpu_speedup"] = rows[0]["cpu_seconds"] / row["cpu_seconds"]
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench/replay.py", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per plan, after one warm-up (median)")
    p.add_argument("--chunks", default="64,160,320", help="replay batch sizes N, comma-separated")
    p.add_argument("--per-sample", action="store_true", help="a batch-invariant model: one sample per forward")
    p.add_argument("--backend", default="torch", choices=["torch", "auto"])
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    args = p.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    if any(c < 1 for c in args.chunks):
        p.error("--chunks: positive ints")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    print(f"batched replay, tiny SD3 transformer (flowrl.apps.example), {args.prompts}x{args.k} samples, {args.steps} steps, "
          f"latents 4x{args.size}x{args.size}, {'one sample per forward (batch-invariant)' if args.per_sample else 'batched forwards'}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'plan':>8} {'forwards':>9} {'wall s':>8} {'speedup':>8} {'cpu s':>8} {'cpu speedup':>12} {'max|ratio-1|':>13}")
    for r in rows:
        print(f"{r['plan']:>8} {r['forwards']:>9} {r['seconds']:>8.3f} {r['speedup']:>7.2f}x {r['cpu_seconds']:>8.3f} "
              f"{r['cpu_speedup']:>11.2f}x {r['max_ratio_dev']:>13.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
