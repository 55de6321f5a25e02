"""The peers' sampler steps, transcribed for the tests (tests/compat/test_compat.py checks flowrl.compat
against them; tests/losses and tests/compat/test_verl_omni.py reuse them).

The peer functions here are transcriptions of the peers' math, operation for operation and dtype for
dtype (not imported: the peers are not dependencies):

- Flow-GRPO: yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
  (``sde_step_with_logprob`` with ``sde_type`` "sde" / "cps" and ``return_sqrt_dt``), its SD3 rollout
  loop (pipeline_with_logprob: float32 step, the float32 result stored, the bf16 cast fed on) and its
  trainer's recompute and KL (scripts/train_sd3.py).
- DanceGRPO: XueZeyue/DanceGRPO, fastvideo/train_grpo_flux.py (``flux_step``).
- Flow-Factory: X-GenGroup/Flow-Factory, src/flow_factory/scheduler/flow_match_euler_discrete.py
  (``FlowMatchEulerDiscreteSDEScheduler.step``).
- verl-omni: verl-project/verl-omni, verl_omni/pipelines/schedulers/flow_match_sde.py
  (``sample_previous_step``: ``sde_type`` "sde", "cps", "dance_sde", ``include_logprob_normalizer``).
"""
import math

import pytest
import torch

import flowrl

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler as DiffusersScheduler  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
# "within float32 rounding": the adapters and the peers run the same formulas in float32, in a
# different order of operations and of summation
TOL = dict(rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------- peers
def peer_flow_grpo(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None, generator=None,
                   sde_type="sde", return_sqrt_dt=False):
    """Flow-GRPO's sde_step_with_logprob, written out (diffusers' exact timestep lookup included)."""
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = self.sigmas[step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_prev = self.sigmas[prev_step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_max = self.sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        if prev_sample is None:
            noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
            prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
        log_prob = (
            -((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
            - torch.log(std_dev_t * torch.sqrt(-1 * dt))
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
    elif sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0 = sample - sigma * model_output
        x1 = sample + model_output * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        if prev_sample is None:
            noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
            prev_sample = mean + std_dev_t * noise
        log_prob = -((prev_sample.detach() - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if return_sqrt_dt:
        return prev_sample, log_prob, mean, std_dev_t, torch.sqrt(-1 * dt)
    return prev_sample, log_prob, mean, std_dev_t


def peer_flow_grpo_kl(mean, mean_ref, std_dev_t):
    """Flow-GRPO trainer's KL loss term (per sample, before its batch mean)."""
    return ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t**2)


def peer_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    """DanceGRPO's flux_step, written out."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        log_term = -0.5 * eta**2 * score_estimate
        prev_sample_mean = prev_sample_mean + log_term * dsigma
    if grpo and prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    if grpo:
        log_prob = (-((prev_sample.detach().to(F32) - prev_sample_mean.to(F32)) ** 2) / (2 * (std_dev_t**2))) - math.log(
            std_dev_t
        ) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        return prev_sample, pred_original_sample, log_prob
    return prev_sample_mean, pred_original_sample


def _bcast(value, ref):
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value if isinstance(value, list) else [value])
    value = value.to(device=ref.device, dtype=ref.dtype)
    if value.numel() == 1:
        value = value.expand(ref.shape[0])
    return value.view(-1, *([1] * (len(ref.shape) - 1)))


def peer_flow_factory(sched, noise_pred, timestep, latents, next_latents=None, timestep_next=None, generator=None,
                      noise_level=0.7, dynamics_type="Flow-SDE"):
    """Flow-Factory's step, written out: returns (next_latents, mean, noise_pred, log_prob, std_dev_t, dt)."""
    if timestep_next is None:
        step_index = [sched.index_for_timestep(t) for t in timestep.reshape(-1)]
        sigma = sched.sigmas[step_index]
        sigma_prev = sched.sigmas[[i + 1 for i in step_index]]
    else:
        sigma, sigma_prev = timestep / 1000, timestep_next / 1000
    input_dtype = latents.dtype
    noise_pred, latents = noise_pred.float(), latents.float()
    if next_latents is not None:
        next_latents = next_latents.float()
    noise_level = _bcast(0.0 if dynamics_type == "ODE" else noise_level, latents)
    sigma, sigma_prev = _bcast(sigma, latents), _bcast(sigma_prev, latents)
    dt = sigma_prev - sigma

    def noise():
        return randn_tensor(noise_pred.shape, generator=generator, device=noise_pred.device, dtype=noise_pred.dtype)

    def gaussian(std_variance):
        lp = (-((next_latents.detach() - mean) ** 2) / (2 * std_variance**2) - torch.log(std_variance)
              - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
        return lp.mean(dim=tuple(range(1, lp.ndim)))

    if dynamics_type == "ODE":
        mean = latents + noise_pred * dt
        std_dev_t = torch.zeros_like(sigma)
        next_latents = mean if next_latents is None else next_latents
        log_prob = torch.zeros(next_latents.shape[0], dtype=next_latents.dtype)
    elif dynamics_type == "Flow-SDE":
        sigma_max = _bcast(sched.sigmas[1].item(), latents)
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1.0, sigma_max, sigma))) * noise_level
        mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + noise_pred * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        if next_latents is None:
            next_latents = (mean + std_dev_t * torch.sqrt(-1 * dt) * noise()).to(input_dtype).float()
        log_prob = gaussian(std_dev_t * torch.sqrt(-1 * dt))
    elif dynamics_type == "Dance-SDE":
        x0 = latents - sigma * noise_pred
        std_dev_t = noise_level
        log_term = 0.5 * noise_level**2 * (latents - x0 * (1 - sigma)) / sigma**2
        mean = latents + (noise_pred + log_term) * dt
        if next_latents is None:
            next_latents = (mean + std_dev_t * torch.sqrt(-1 * dt) * noise()).to(input_dtype).float()
        log_prob = gaussian(std_dev_t * torch.sqrt(-1 * dt))
    else:  # CPS
        std_dev_t = sigma_prev * torch.sin(noise_level * torch.pi / 2)
        x0 = latents - sigma * noise_pred
        x1 = latents + noise_pred * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        if next_latents is None:
            next_latents = (mean + std_dev_t * noise()).to(input_dtype).float()
        log_prob = -((next_latents.detach() - mean) ** 2)
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return next_latents, mean, noise_pred, log_prob, std_dev_t, dt


def peer_verl_omni(sched, sample, model_output, timestep, noise_level, prev_sample, sde_type, include_logprob_normalizer):
    """verl-omni's FlowMatchSDEDiscreteScheduler.sample_previous_step, recompute (prev_sample given)."""
    idx = torch.tensor([sched.index_for_timestep(t) for t in timestep])
    sigma = sched.sigmas[idx].view(-1, *([1] * (sample.ndim - 1)))
    sigma_prev = sched.sigmas[idx + 1].view(-1, *([1] * (sample.ndim - 1)))
    sigma_max = sched.sigmas[1]
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        lp = -((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        if include_logprob_normalizer:
            lp = lp - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    elif sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0 = sample - sigma * model_output
        x1 = sample + model_output * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        lp = -((prev_sample.detach() - mean) ** 2)
    else:  # dance_sde
        dsigma, delta_t = sigma_prev - sigma, sigma - sigma_prev
        mean = sample + dsigma * model_output
        x0 = sample - sigma * model_output
        score = -(sample - x0 * (1 - sigma)) / (sigma**2)
        mean = mean + (-0.5 * noise_level**2 * score) * dsigma
        std = noise_level * torch.sqrt(delta_t)
        lp = -((prev_sample.detach() - mean) ** 2) / (2 * (std**2))
        if include_logprob_normalizer:
            lp = lp - torch.log(std) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    return lp.mean(dim=tuple(range(1, lp.ndim))), mean


# ------------------------------------------------------------------------------------- fixtures
def diffusers_scheduler(steps=10, shift=3.0):
    sched = DiffusersScheduler(shift=shift)
    sched.set_timesteps(steps)
    return sched


def flowrl_scheduler(steps=10, shift=3.0):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    return sched


def gen(seed):
    return torch.Generator().manual_seed(seed)
