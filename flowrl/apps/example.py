"""An end-to-end GRPO training run on a CPU: ``python -m flowrl example`` (``./run example``).

A real diffusers ``SD3Transformer2DModel`` with tiny random weights (built from a small config in
code: no download) is trained with Flow-GRPO's recipe on a few fixed random "prompt" embeddings:

1. rollout: ``--k`` samples per prompt through flowrl's scheduler inside ``scheduler.rollout(...)``
   (``mode="sde"``, ``noise_level=0.7``, one generator per sample), recording the latents and the
   per-step log-probs (a ``flowrl.RolloutTrajectory``);
2. reward: a closed form on the final latents, the negative mean squared distance to a fixed target
   pattern, and group-normalized advantages ``(r - mean) / (std + 1e-4)`` per prompt;
3. a few PPO updates: every step's log-prob recomputed with ``flowrl.step_log_prob`` from the stored
   latents, with gradients through the transformer (only its output layers ``norm_out`` and
   ``proj_out`` train, with Adam), ratio ``exp(logp_new - logp_old)``, the clipped surrogate
   ``-min(rho A, clip(rho, 1 - eps, 1 + eps) A)``, and optionally ``--kl-coef`` times the exact KL to
   the initial policy (``flowrl.step_kl``).

Per iteration it prints the importance ratios of the first update (exactly 1: before any weight
change the recompute is the rollout's computation, bit for bit), the loss, the clip fraction and the
mean reward; at the end the first and last mean reward and the rise. Given ``--seed`` every printed
number except the wall time is the same on every run on the same machine.

Why the clip range is small (``--clip-range 1e-3``): the log-probs are means over a sample's elements
(``reduction="mean"``, as in Flow-GRPO), so one Adam step moves a step's ``logp`` by about 1e-3 and
the ratios of the later updates stay within about 0.99 to 1.005. A clip range of 0.2 (the LLM
default) would never clip and the updates would be plain policy-gradient steps; 1e-3 clips the 5 to
15% of (sample, step) terms that moved most, which is what bounds the policy change per iteration
(Flow-GRPO uses 1e-4 at its larger sizes). With Adam's lr 3e-3 the reward rises from the first
iteration on; 1e-2 first lowers it for two iterations (ratios down to 0.97) before it rises.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from typing import List, Optional

import torch

import flowrl
from flowrl.advantages import group_advantages as _group_advantages
from flowrl.backends._dispatch import BACKENDS, resolve

MODES = ("sde", "cps")
TRAINED = ("norm_out.", "proj_out.")  # the parameters that train: the transformer's output layers
TEXT_TOKENS, JOINT_DIM, POOLED_DIM = 6, 32, 16  # the shape of the random "prompt" embeddings


def tiny_transformer(size: int, seed: int):
    """A real diffusers SD3 transformer with tiny random weights (about 77k parameters)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=size, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=JOINT_DIM, caption_projection_dim=JOINT_DIM,
        pooled_projection_dim=POOLED_DIM,
    )


def target_pattern(size: int) -> torch.Tensor:
    """The reward's target for the final latents [4, size, size]: a +-1 checkerboard, with the sign
    flipped on every other channel."""
    c = torch.arange(4)[:, None, None]
    h = torch.arange(size)[None, :, None]
    w = torch.arange(size)[None, None, :]
    return 1.0 - 2.0 * ((c + h + w) % 2).float()


def reward(final: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Negative mean squared distance of each sample's final latents to the target: float32 [B]."""
    return -(final.float() - target).square().flatten(1).mean(1)


def group_advantages(rewards: torch.Tensor, prompts: int, k: int) -> torch.Tensor:
    """GRPO's per-prompt normalization (r - mean) / (std + 1e-4), population std (Flow-GRPO's
    ``PerPromptStatTracker``): ``flowrl.advantages.group_advantages``; samples are ordered prompt-major."""
    prompt_of_sample = torch.arange(prompts, device=rewards.device).repeat_interleave(k)
    return _group_advantages(rewards, prompt_of_sample, std="group", eps=1e-4)


def _positive_int(minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {value}")
        return value

    return parse


def _even_size(text: str) -> int:
    value = _positive_int(2)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (the transformer's patch size is 2); got {value}")
    return value


def _float_in(low: float, high: float, low_open: bool = True):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low}, {high}]; got {text}")
        return value

    return parse


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m flowrl example",
        description="GRPO training of a tiny random diffusers SD3 transformer with flowrl's rollout recorder and "
                    "log-prob recompute; runs on a CPU in under 2 minutes at the default size.",
    )
    p.add_argument("--iterations", type=_positive_int(1), default=20, help="rollout + update rounds (default 20)")
    p.add_argument("--prompts", type=_positive_int(1), default=4, help="prompts per iteration (default 4)")
    p.add_argument("--k", type=_positive_int(2), default=8, help="rollouts per prompt, the GRPO group (default 8)")
    p.add_argument("--steps", type=_positive_int(1), default=10, help="sampling steps T (default 10)")
    p.add_argument("--size", type=_even_size, default=16, help="latent height and width, even (default 16)")
    p.add_argument("--updates", type=_positive_int(1), default=3, help="PPO updates per iteration (default 3)")
    p.add_argument("--lr", type=_float_in(0.0, 1.0), default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--clip-range", type=_float_in(0.0, 1.0), default=1e-3, help="PPO epsilon (default 1e-3)")
    p.add_argument("--kl-coef", type=_float_in(0.0, 1e6, low_open=False), default=0.0,
                   help="weight of the exact KL to the initial policy (flowrl.step_kl); default 0")
    p.add_argument("--mode", default="sde", choices=MODES,
                   help="rollout SDE (default sde). With cps the step onto the last nonzero sigma has a tiny std "
                        "(sigma' sin(eta pi / 2)), so its ratios leave 1 by far after an update")
    p.add_argument("--noise-level", type=_float_in(0.0, 10.0), default=0.7, help="eta (default 0.7)")
    p.add_argument("--shift", type=_float_in(0.0, 100.0), default=3.0, help="the scheduler's shift (default 3)")
    p.add_argument("--seed", type=_positive_int(0), default=0)
    p.add_argument("--backend", default="auto", choices=list(BACKENDS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"argument --device: cpu or cuda (cuda:N); got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: this torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        p.error(f"argument --device: cpu or cuda; got {args.device!r}")
    args.device = device
    try:
        resolve(args.backend, device, torch.float32)
    except (ValueError, TypeError, RuntimeError) as exc:
        p.error(f"argument --backend: {exc}")
    if args.mode == "cps" and args.noise_level > 1:
        p.error(f"argument --noise-level: must be <= 1 for --mode cps; got {args.noise_level}")
    return args


class Trainer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        device = args.device
        self.batch = args.prompts * args.k
        self.transformer = tiny_transformer(args.size, args.seed).to(device)
        self.params = []
        for name, param in self.transformer.named_parameters():
            param.requires_grad_(name.startswith(TRAINED))
            if param.requires_grad:
                self.params.append(param)
        self.reference = None
        if args.kl_coef > 0:  # the initial values of the trained parameters, for the KL's reference policy
            self.reference = {n: p.detach().clone() for n, p in self.transformer.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.Adam(self.params, lr=args.lr)

        g = torch.Generator().manual_seed(args.seed)
        embeds = torch.randn(args.prompts, TEXT_TOKENS, JOINT_DIM, generator=g)
        pooled = torch.randn(args.prompts, POOLED_DIM, generator=g)
        # prompt-major: samples p * k ... p * k + k - 1 share prompt p
        self.embeds = embeds.repeat_interleave(args.k, 0).to(device)
        self.pooled = pooled.repeat_interleave(args.k, 0).to(device)
        self.seeds = torch.Generator().manual_seed(args.seed + 1)  # draws each rollout's per-sample seeds
        self.target = target_pattern(args.size).to(device)
        self.scheduler = flowrl.FlowMatchEulerDiscreteScheduler(shift=args.shift)

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, params=None) -> torch.Tensor:
        t = timestep.expand(latents.shape[0])
        kwargs = dict(hidden_states=latents, timestep=t, encoder_hidden_states=self.embeds,
                      pooled_projections=self.pooled, return_dict=False)
        if params is None:
            return self.transformer(**kwargs)[0]
        return torch.func.functional_call(self.transformer, params, (), kwargs, strict=False)[0]

    @torch.no_grad()
    def rollout(self) -> flowrl.RolloutTrajectory:
        a = self.args
        seeds = torch.randint(0, 2**62, (self.batch,), generator=self.seeds).tolist()
        gens = [torch.Generator().manual_seed(s) for s in seeds]  # one per sample
        shape = (1, 4, a.size, a.size)
        latents = torch.cat([torch.randn(shape, generator=gen) for gen in gens]).to(a.device)
        self.scheduler.set_timesteps(a.steps, device=a.device)
        with self.scheduler.rollout(mode=a.mode, noise_level=a.noise_level, generator=gens, backend=a.backend) as rec:
            for t in self.scheduler.timesteps:
                v = self.velocity(latents, t)
                latents = self.scheduler.step(v, t, latents).prev_sample
        return rec.trajectory()

    def update(self, traj: flowrl.RolloutTrajectory, advantages: torch.Tensor):
        """One PPO update: every step's log-prob recomputed with gradients, one Adam step.
        Returns (ratios [B, T], loss, clip fraction, mean KL)."""
        a = self.args
        eps = a.clip_range
        self.optimizer.zero_grad(set_to_none=True)
        ratios, clipped, total, kls = [], 0, 0.0, []
        opts = dict(mode=traj.mode, noise_level=traj.noise_level, reduction=traj.reduction, backend=a.backend)
        for i in range(traj.num_steps):
            x, x_next = traj.latents[:, i], traj.latents[:, i + 1]
            v = self.velocity(x, traj.timesteps[i])
            lp = flowrl.step_log_prob(x, v, x_next, traj.sigmas, i, log_prob_kind=traj.log_prob_kind, **opts)
            ratio = torch.exp(lp - traj.log_probs[:, i])
            surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))
            loss = surrogate.mean()
            if self.reference is not None:
                with torch.no_grad():
                    v_ref = self.velocity(x, traj.timesteps[i], self.reference)
                kl = flowrl.step_kl(x, v, v_ref, traj.sigmas, i, **opts).mean()
                loss = loss + a.kl_coef * kl
                kls.append(kl.detach())
            (loss / traj.num_steps).backward()
            total += loss.item() / traj.num_steps
            ratios.append(ratio.detach())
            clipped += int(((ratio - 1).abs() > eps).sum())
        self.optimizer.step()
        ratios = torch.stack(ratios, 1)
        kl = torch.stack(kls).mean().item() if kls else 0.0
        return ratios, total, clipped / ratios.numel(), kl


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    trainer = Trainer(args)
    n_params = sum(p.numel() for p in trainer.transformer.parameters())
    n_trained = sum(p.numel() for p in trainer.params)
    print(f"flowrl example: GRPO on a tiny random SD3Transformer2DModel ({n_params} parameters, {n_trained} trained: "
          f"norm_out + proj_out), device {args.device}, backend {resolve(args.backend, args.device, torch.float32)}")
    print(f"{args.prompts} prompts x {args.k} rollouts, {args.steps} steps, mode={args.mode}, "
          f"noise_level={args.noise_level}, latents 4x{args.size}x{args.size}, {args.updates} updates/iteration, "
          f"Adam lr={args.lr}, clip range={args.clip_range}, kl coef={args.kl_coef}, seed={args.seed}")
    print("reward: -mean((final latents - checkerboard target)^2)")
    print()
    print("iter  reward_mean  reward_std   ratio1_min   ratio1_max   ratio_last_min  ratio_last_max        loss"
          "  clip_frac          kl")
    first = last = None
    worst = 0.0  # max |ratio - 1| over the first updates of all iterations
    for it in range(1, args.iterations + 1):
        traj = trainer.rollout()
        rewards = reward(traj.latents[:, -1], trainer.target)
        advantages = group_advantages(rewards, args.prompts, args.k)
        losses, clips, kls = [], [], []
        for u in range(args.updates):
            ratios, loss, clip, kl = trainer.update(traj, advantages)
            if u == 0:
                first_ratios = ratios
            losses.append(loss)
            clips.append(clip)
            kls.append(kl)
        worst = max(worst, (first_ratios.double() - 1).abs().max().item())
        mean = rewards.mean().item()
        first = mean if first is None else first
        last = mean
        print(f"{it:>4}  {mean:11.6f}  {rewards.std(unbiased=False).item():10.6f}  {first_ratios.min().item():11.9f}  "
              f"{first_ratios.max().item():11.9f}  {ratios.min().item():14.9f}  {ratios.max().item():14.9f}  "
              f"{sum(losses) / len(losses):10.3e}  {sum(clips) / len(clips):9.4f}  {sum(kls) / len(kls):10.3e}")
        sys.stdout.flush()
    print()
    print("columns: ratio1 = exp(logp_new - logp_old) over all samples and steps on the first update of the "
          "iteration (before any weight change); ratio_last = on the last update; loss, clip_frac and kl (computed "
          "when --kl-coef > 0) = means over the updates")
    # float32 ratios next to 1 are 6e-8 apart, so 9 decimals show any deviation; this line says it exactly
    print(f"first-update ratios, max |ratio - 1| over all iterations: {worst:.3g} "
          f"({'exactly 1: the recompute equals the rollout bit for bit' if worst == 0 else 'NOT exactly 1'})")
    print(f"mean reward: first {first:.6f}, last {last:.6f}, rise {last - first:+.6f}")
    print(f"wall time: {time.perf_counter() - t_start:.1f} s")
    return 0 if worst == 0 else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("diffusers") is None:
        print("flowrl example: error: needs diffusers (pip install -e '.[diffusers]')", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
