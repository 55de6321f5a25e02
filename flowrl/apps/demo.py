"""``python -m flowrl demo``: an RL rollout and its training-side recompute on an embedded model.

The model is the exact velocity field of a Gaussian-mixture target (no weights to download): with
``x_sigma = (1 - sigma) x0 + sigma eps`` and ``x0 ~ sum_k w_k N(m_k, s_k^2 I)``, the velocity
``E[eps - x0 | x_sigma]`` is closed-form. The demo samples a batch through flowrl's drop-in
scheduler inside ``rollout()``, recomputes every step's log-prob from the stored latents the way a
trainer would, and reports the importance ratios (exactly 1), how close the samples are to the
target, and the time per step of each available backend.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import List, Optional

import torch

import flowrl
from flowrl.backends._dispatch import BACKENDS
from flowrl.contract import Mode, Schedule

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class GaussianMixtureVelocity:
    """Exact velocity of an isotropic Gaussian mixture in ``dim`` dimensions, as a 'model' that
    takes ``(latents [B, dim], timestep [B] or scalar)`` like a diffusion transformer does."""

    def __init__(self, means: torch.Tensor, stds: torch.Tensor, weights: torch.Tensor, num_train_timesteps: int = 1000):
        self.means = means.double()  # [K, dim]
        self.stds = stds.double()  # [K]
        self.log_weights = torch.log(weights.double() / weights.sum())
        self.num_train_timesteps = num_train_timesteps

    @classmethod
    def default(cls, dim: int = 64, components: int = 4, seed: int = 0) -> "GaussianMixtureVelocity":
        g = torch.Generator().manual_seed(seed)
        means = torch.randn(components, dim, generator=g, dtype=torch.float64)
        means = 2.5 * means / means.norm(dim=1, keepdim=True) * math.sqrt(dim) / 4
        stds = torch.linspace(0.25, 0.45, components, dtype=torch.float64)
        weights = torch.linspace(1.0, 2.0, components, dtype=torch.float64)
        return cls(means, stds, weights)

    @property
    def dim(self) -> int:
        return int(self.means.shape[1])

    def _component_terms(self, x: torch.Tensor, sigma: torch.Tensor, signal: Optional[torch.Tensor] = None):
        # per component k: x_sigma | k ~ N((1 - sigma) m_k, tau_k^2 I), tau_k^2 = (1 - sigma)^2 s_k^2 + sigma^2
        # (``signal``: x0's scale where it is not 1 - sigma, sqrt(alpha_bar) of a DDPM schedule)
        one_minus = (1 - sigma if signal is None else signal)[:, None]  # [B, 1]
        tau2 = one_minus**2 * self.stds[None] ** 2 + sigma[:, None] ** 2  # [B, K]
        resid = x[:, None, :] - one_minus[:, :, None] * self.means[None]  # [B, K, dim]
        logp = self.log_weights[None] - 0.5 * (resid**2).sum(-1) / tau2 - 0.5 * self.dim * torch.log(2 * math.pi * tau2)
        return tau2, resid, logp

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """E[eps - x0 | x_sigma = x] in float64; ``sigma`` is [B]."""
        x = x.double().reshape(x.shape[0], -1)
        tau2, resid, logp = self._component_terms(x, sigma.double())
        post = torch.softmax(logp, dim=1)  # p(k | x_sigma)
        e_eps = sigma[:, None, None] / tau2[..., None] * resid
        e_x0 = self.means[None] + ((1 - sigma)[:, None, None] * self.stds[None, :, None] ** 2 / tau2[..., None]) * resid
        return (post[..., None] * (e_eps - e_x0)).sum(1)

    def epsilon(self, x: torch.Tensor, alpha_bar: torch.Tensor) -> torch.Tensor:
        """E[eps | x_t = sqrt(a) x0 + sqrt(1 - a) eps = x] in float64 (a DDPM model's epsilon-prediction)."""
        x, a = x.double().reshape(x.shape[0], -1), alpha_bar.double()
        tau2, resid, logp = self._component_terms(x, torch.sqrt(1 - a), torch.sqrt(a))
        post = torch.softmax(logp, dim=1)
        return (post[..., None] * (torch.sqrt(1 - a)[:, None, None] / tau2[..., None] * resid)).sum(1)

    def __call__(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(timestep, dtype=torch.float64).reshape(-1).expand(latents.shape[0])
        v = self.velocity(latents.cpu(), t / self.num_train_timesteps)  # a real model sees t, not sigma
        return v.reshape(latents.shape).to(device=latents.device, dtype=latents.dtype)

    def log_density(self, x0: torch.Tensor) -> torch.Tensor:
        """log p(x0) under the target, per sample."""
        _, _, logp = self._component_terms(x0.double().reshape(x0.shape[0], -1), torch.zeros(x0.shape[0], dtype=torch.float64))
        return torch.logsumexp(logp, dim=1)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        k = torch.multinomial(self.log_weights.exp(), n, replacement=True, generator=generator)
        eps = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return self.means[k] + self.stds[k, None] * eps

    def nearest_component(self, x0: torch.Tensor) -> torch.Tensor:
        _, _, logp = self._component_terms(x0.double().reshape(x0.shape[0], -1), torch.zeros(x0.shape[0], dtype=torch.float64))
        return logp.argmax(1)


class _EpsilonModel:
    """The mixture as a DDPM model (mode='ddim'): ``(latents, timestep)`` -> epsilon-prediction, with
    alpha_bar from the scheduler's table."""

    def __init__(self, model: GaussianMixtureVelocity, alphas_cumprod: torch.Tensor):
        self.model, self.alphas_cumprod = model, alphas_cumprod
        self.dim = model.dim

    def __call__(self, latents: torch.Tensor, timestep) -> torch.Tensor:
        t = torch.as_tensor(timestep).reshape(-1).long().cpu().expand(latents.shape[0])
        eps = self.model.epsilon(latents.cpu(), self.alphas_cumprod[t])
        return eps.reshape(latents.shape).to(device=latents.device, dtype=latents.dtype)


def _scheduler_and_model(model, mode: Mode, shift: float):
    """The drop-in scheduler that records ``mode`` (by its ``sigmas=`` kind, ``Mode.rules.schedule``) and
    the model it calls: flowrl's flow scheduler and the velocity, or flowrl.DDIMScheduler and epsilon."""
    if mode.rules.schedule is Schedule.ALPHA_BAR:
        scheduler = flowrl.DDIMScheduler(num_train_timesteps=model.num_train_timesteps)
        return scheduler, _EpsilonModel(model, scheduler.alphas_cumprod)
    return flowrl.FlowMatchEulerDiscreteScheduler(shift=shift), model


def _rollout(model, scheduler, args, dtype, device):
    gens = [torch.Generator().manual_seed(args.seed * 1000 + i) for i in range(args.batch)]
    latents = torch.cat([torch.randn(1, model.dim, generator=g) for g in gens]).to(device=device, dtype=dtype)
    scheduler.set_timesteps(args.steps, device=device)
    options = dict(noise_level=args.noise_level, log_prob_kind=args.log_prob_kind, generator=gens, backend=args.backend)
    if Mode.parse("mode", args.mode).rules.schedule is Schedule.SIGMAS:  # flowrl.DDIMScheduler's is ddim
        options["mode"] = args.mode
    rec = scheduler.rollout(**options)
    with rec:
        for t in scheduler.timesteps:
            v = model(latents, t)
            latents = scheduler.step(v, t, latents).prev_sample
    return rec.trajectory(), latents


def _recompute(model, traj, backend):
    """Training side: every step's log-prob from the stored latents and a fresh model call."""
    lps = []
    for i in range(traj.num_steps):
        x = traj.latents[:, i]
        v = model(x, traj.timesteps[i])
        lps.append(flowrl.step_log_prob(model_output=v, backend=backend, **traj.step_inputs(i)))
    return torch.stack(lps, dim=1)


def _time_step(backend: str, shape, dtype, device, sigmas, mode, noise_level, repeats: int) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    noise = torch.randn(shape, generator=g, device=device)
    step = min(1, sigmas.numel() - 2)  # a middle step where there is one; step 0 of a 1-step schedule
    run = lambda: flowrl.sde_step(x, v, sigmas, step, mode=mode, noise_level=noise_level, noise=noise, backend=backend)
    for _ in range(3):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _backends_here(device: torch.device) -> List[str]:
    names = ["torch"]
    if device.type == "cuda" and "triton" in flowrl.available_backends():
        names.append("triton")
    return names


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flowrl demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="sde", choices=list(Mode.labels()))  # flowrl.contract.MODE_RULES
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=64, help="dimension of the Gaussian-mixture target")
    p.add_argument("--noise-level", type=float, default=None,
                   help="default 0.7, or the mode's fixed level (dpm_sde: 1.0)")
    p.add_argument("--log-prob-kind", default="gaussian", choices=["gaussian", "kernel", "sq_err"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype of latents")
    p.add_argument("--shift", type=float, default=1.0, help="the scheduler's timestep shift")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.noise_level is None:  # the mode's range (flowrl.contract.MODE_RULES)
        lo, hi = Mode.parse("mode", args.mode).rules.noise_level
        args.noise_level = 0.7 if lo <= 0.7 <= hi else lo
    if args.steps < 1 or args.batch < 1 or args.dim < 1:
        p.error("--steps, --batch and --dim must be positive")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")

    try:
        return _report(args)
    except (ValueError, TypeError, RuntimeError) as exc:  # bad flags for this machine: say so, no traceback
        print(f"flowrl demo: error: {exc}", file=sys.stderr)
        return 2


def _report(args) -> int:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    model = GaussianMixtureVelocity.default(dim=args.dim, seed=args.seed)
    scheduler, step_model = _scheduler_and_model(model, Mode.parse("mode", args.mode), args.shift)

    t0 = time.perf_counter()
    traj, final = _rollout(step_model, scheduler, args, dtype, device)
    rollout_s = time.perf_counter() - t0
    recomputed = _recompute(step_model, traj, args.backend)
    ratios = torch.exp(recomputed - traj.log_probs)

    print(f"flowrl demo: {args.batch} samples x {args.steps} steps, mode={args.mode}, noise_level={args.noise_level}, "
          f"log_prob_kind={args.log_prob_kind}, storage {args.dtype}, device {device}")
    print(f"target: mixture of {model.means.shape[0]} isotropic Gaussians in {model.dim} dimensions "
          f"(exact velocity field, shift={args.shift})")
    print()
    print("Rollout record")
    print(f"  latents {tuple(traj.latents.shape)} {str(traj.latents.dtype).replace('torch.', '')}, "
          f"log_probs {tuple(traj.log_probs.shape)}, sigmas {tuple(traj.sigmas.shape)} "
          f"(from {traj.sigmas[0].item():.4f} to {traj.sigmas[-1].item():.1f})")
    lp = traj.log_probs
    print(f"  per-step log-prob (batch mean): first {lp[:, 0].mean().item():+.4f}, "
          f"middle {lp[:, lp.shape[1] // 2].mean().item():+.4f}, last {lp[:, -1].mean().item():+.4f}")
    print()
    print("Training-side recompute from the stored latents")
    identical = torch.equal(recomputed, traj.log_probs)
    worst = (ratios - 1).abs().max().item()
    print(f"  importance ratios exp(logp_new - logp_old): min {ratios.min().item():.9f}, max {ratios.max().item():.9f}")
    print(f"  recomputed log-probs bit-identical to the rollout's: {'yes' if identical else 'NO'} "
          f"({lp.numel()} values, max |ratio - 1| = {worst:.3g})")
    print()

    samples = final.double().reshape(args.batch, -1).cpu()
    ref = model.sample(4096, torch.Generator().manual_seed(12345))
    gen_ld = model.log_density(samples)
    ref_ld = model.log_density(ref)
    comp = model.nearest_component(samples)
    weights = model.log_weights.exp()
    print("Samples vs the target")
    # the standard error needs two samples: with one there is none to print
    stderr = f" (+- {gen_ld.std().item() / model.dim / math.sqrt(args.batch):.3f})" if args.batch > 1 else ""
    print(f"  mean target log-density per dimension: samples {gen_ld.mean().item() / model.dim:+.3f}"
          f"{stderr}, exact target draws {ref_ld.mean().item() / model.dim:+.3f}")
    resid = samples - model.means[comp]
    ratio_std = (resid.pow(2).mean(1).sqrt() / model.stds[comp]).mean().item()
    print(f"  spread around the nearest component / its std: {ratio_std:.3f} (1.0 = exact)")
    counts = torch.bincount(comp, minlength=len(weights)).tolist()
    print("  component  weight  share of samples")
    for k, (w, c) in enumerate(zip(weights.tolist(), counts)):
        print(f"  {k:>9}  {w:6.3f}  {c / args.batch:6.3f}")
    print()

    print("Time per sampling step (flowrl.sde_step on the demo's latents)")
    sigmas = traj.sigmas.to(device)
    shape = (args.batch, model.dim)
    for name in _backends_here(device):
        sec = _time_step(name, shape, dtype, device, sigmas, args.mode if args.mode != "ode" else "sde",
                         args.noise_level, repeats=50)
        print(f"  {name:>7}: {sec * 1e6:9.1f} us")
    if device.type != "cuda":
        print("  triton : needs a CUDA device (on the CPU it runs only through Triton's interpreter, for tests)")
    print(f"  whole rollout including the model: {rollout_s * 1e3:.1f} ms")
    return 0 if identical else 1
