"""The benchmark's baseline: the step math written out in plain eager torch, the way the peers do it.

This follows Flow-GRPO's ``sde_step_with_logprob`` (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``)
term for term: inputs upcast to float32, one torch op per term of the formula, the log-prob as the
mean over all non-batch dims. ``mode="sde"`` is Flow-GRPO's (and SGLang's ``rollout_sde_type="sde"``)
step with the Gaussian log-density; ``mode="cps"`` is its Coefficients-Preserving Sampling branch,
whose log-prob drops every constant (``-r^2``, flowrl's ``log_prob_kind="sq_err"``). The KL follows
Flow-GRPO's training loop: ``((mean - mean_ref) ** 2).mean(non-batch dims) / (2 * variance)`` with the
reference mean computed under ``torch.no_grad``.

Two deliberate departures, neither changing the op count:
- ``sigma_max`` (Flow-GRPO's ``self.sigmas[1].item()``) is passed in, so the baseline needs no host
  sync and ``torch.compile`` sees one graph;
- the KL divides by the transition's exact variance ``(std_dev_t * sqrt(-dt)) ** 2`` for ``sde`` where
  Flow-GRPO divides by ``std_dev_t ** 2``, so it can be checked against flowrl's exact KL (docs/contract.md, KL to a reference policy).

``mode="ddim"`` follows DDPO's ``ddim_step_with_logprob`` (kvablack/ddpo-pytorch,
``ddpo_pytorch/diffusers_patch/ddim_with_logprob.py``) the same way (epsilon-prediction, no clip, per-sample
timesteps gathered from the alpha-bar table ``ddim_alpha_bar_table`` builds), with the same upcast; its KL
is the exact one, ``(mean - mean_ref)^2 / (2 std^2)`` (DDPO trains without a KL).

It is not part of the flowrl package: it is what flowrl is measured against, and the bench checks that
both agree numerically before timing either.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

MODES = ("sde", "cps", "ddim", "flash_sde", "dpm_sde")
# flowrl's log_prob_kind= that matches each mode's Flow-GRPO (ddim: DDPO; flash_sde: Flash-GRPO; dpm_sde:
# MixGRPO) log-prob
LOG_PROB_KIND = {"sde": "gaussian", "cps": "sq_err", "ddim": "gaussian", "flash_sde": "gaussian", "dpm_sde": "gaussian"}


def _step_sigmas(sigmas: torch.Tensor, step_index: torch.Tensor, ndim: int):
    """sigma and sigma_prev per sample, shaped to broadcast against [B, ...], as Flow-GRPO gathers them."""
    shape = (-1,) + (1,) * (ndim - 1)
    return sigmas[step_index].view(shape), sigmas[step_index + 1].view(shape)


def flow_grpo_mean(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    sigma_max: float,
    *,
    mode: str,
    noise_level: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prev_sample_mean, std_dev_t, step_std)``: the float32 mean, Flow-GRPO's ``std_dev_t`` and the
    transition's std (``std_dev_t * sqrt(-dt)`` for sde, ``std_dev_t`` for cps), both [B, 1, ...]."""
    # bf16 can overflow in the mean: the peers upcast everything to float32 first
    model_output = model_output.float()
    sample = sample.float()
    sigma, sigma_prev = _step_sigmas(sigmas, step_index, sample.ndim)
    dt = sigma_prev - sigma
    if mode == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        prev_sample_mean = (
            sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        return prev_sample_mean, std_dev_t, std_dev_t * torch.sqrt(-1 * dt)
    if mode == "flash_sde":  # Flash-GRPO's sde_step_with_logprob (times noise_level; theirs is 1)
        sigma_min = sigmas[-1]
        std_dev_t = (sigma_min + (sigma_max - sigma_min) * sigma) * noise_level
        prev_sample_mean = (
            sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        return prev_sample_mean, std_dev_t, std_dev_t * torch.sqrt(-1 * dt)
    if mode == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        pred_original_sample = sample - sigma * model_output  # x0_hat
        noise_estimate = sample + model_output * (1 - sigma)  # x1_hat
        prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
            sigma_prev**2 - std_dev_t**2
        )
        return prev_sample_mean, std_dev_t, std_dev_t
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}")


def flow_grpo_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    sigma_max: float,
    *,
    mode: str,
    noise_level: float,
    prev_sample: Optional[torch.Tensor] = None,
    noise: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Flow-GRPO's ``sde_step_with_logprob``: ``(prev_sample, log_prob [B], prev_sample_mean, std_dev_t)``.

    Rollout: pass ``noise`` (float32, the sample's shape); ``prev_sample`` is returned in ``out_dtype``
    (the pipeline casts the latents back to the model dtype). Training recompute: pass ``prev_sample``."""
    if (prev_sample is None) == (noise is None):
        raise ValueError("pass exactly one of prev_sample (recompute) and noise (rollout)")
    mean, std_dev_t, step_std = flow_grpo_mean(
        sample, model_output, sigmas, step_index, sigma_max, mode=mode, noise_level=noise_level
    )
    if prev_sample is None:
        prev_sample = mean + step_std * noise
    else:
        prev_sample = prev_sample.float()
    if mode in ("sde", "flash_sde"):
        log_prob = (
            -((prev_sample.detach() - mean) ** 2) / (2 * (step_std**2))
            - torch.log(step_std)
            - math.log(math.sqrt(2 * math.pi))
        )
    else:  # cps: Flow-GRPO removes all constants
        log_prob = -((prev_sample.detach() - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if out_dtype is not None:
        prev_sample = prev_sample.to(out_dtype)
    return prev_sample, log_prob, mean, std_dev_t


def flow_grpo_kl(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    sigma_max: float,
    *,
    mode: str,
    noise_level: float,
) -> torch.Tensor:
    """Flow-GRPO's KL term per sample [B], with the exact variance (see the module docstring)."""
    mean, _, step_std = flow_grpo_mean(
        sample, model_output, sigmas, step_index, sigma_max, mode=mode, noise_level=noise_level
    )
    with torch.no_grad():  # the reference policy's step runs without autograd, as in Flow-GRPO
        mean_ref, _, _ = flow_grpo_mean(
            sample, ref_model_output, sigmas, step_index, sigma_max, mode=mode, noise_level=noise_level
        )
    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * step_std**2)
    return kl.reshape(-1)


def ddim_alpha_bar_table(num_steps: int = 10) -> torch.Tensor:
    """Stable Diffusion's DDIM schedule as flowrl's mode='ddim' takes it: float32 [2T] of
    (alphas_cumprod[t], alphas_cumprod[t - 1000 // T]) pairs at diffusers' 'leading' timesteps with
    steps_offset 1, final_alpha_cumprod = alphas_cumprod[0] (set_alpha_to_one=False)."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float32) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    ratio = 1000 // num_steps
    pairs = []
    for t in [(num_steps - 1 - k) * ratio + 1 for k in range(num_steps)]:
        pairs += [alphas_cumprod[t], alphas_cumprod[max(t - ratio, 0)]]
    return torch.stack(pairs)


def ddpo_mean(sample, model_output, table, step_index, noise_level):
    """DDPO's ``prev_sample_mean`` and ``std_dev_t`` ([B, 1, ...]) for epsilon-prediction without clip."""
    model_output, sample = model_output.float(), sample.float()
    shape = (-1,) + (1,) * (sample.ndim - 1)
    alpha_prod_t = table[2 * step_index].view(shape)
    alpha_prod_t_prev = table[2 * step_index + 1].view(shape)
    beta_prod_t = 1 - alpha_prod_t
    pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
    variance = ((1 - alpha_prod_t_prev) / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = noise_level * variance ** (0.5)
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * model_output
    return alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction, std_dev_t


def ddpo_step(sample, model_output, table, step_index, *, noise_level, prev_sample=None, noise=None, out_dtype=None):
    """DDPO's ``ddim_step_with_logprob``: ``(prev_sample, log_prob [B])``; rollout with ``noise``,
    recompute with ``prev_sample``."""
    if (prev_sample is None) == (noise is None):
        raise ValueError("pass exactly one of prev_sample (recompute) and noise (rollout)")
    mean, std_dev_t = ddpo_mean(sample, model_output, table, step_index, noise_level)
    prev_sample = mean + std_dev_t * noise if prev_sample is None else prev_sample.float()
    log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * (std_dev_t**2)) - torch.log(std_dev_t)
                - math.log(math.sqrt(2 * math.pi)))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return (prev_sample if out_dtype is None else prev_sample.to(out_dtype)), log_prob


def ddpo_kl(sample, model_output, ref_model_output, table, step_index, *, noise_level):
    """The exact KL per sample [B] between DDPO's step under the policy and under the reference."""
    mean, std_dev_t = ddpo_mean(sample, model_output, table, step_index, noise_level)
    with torch.no_grad():
        mean_ref, _ = ddpo_mean(sample, ref_model_output, table, step_index, noise_level)
    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t**2)
    return kl.reshape(-1)


def mixgrpo_dpm_mean(sample, model_output, x0_prev, sigmas, step_index):
    """MixGRPO's SDE-DPM-Solver++ mean and std ([B, 1, ...]), fastvideo/utils/sampling_utils.py
    (Tencent-Hunyuan/MixGRPO): ``multistep_dpm_solver_second_order_update`` (dpmsolver++, midpoint,
    sde_solver) with ``x0_prev`` the previous step's x0 prediction, for steps past the first (the bench's
    step); the same upcast as the flow modes."""
    model_output, sample = model_output.float(), sample.float()
    shape = (-1,) + (1,) * (sample.ndim - 1)
    sigma_t, sigma_s0 = sigmas[step_index + 1].view(shape), sigmas[step_index].view(shape)
    sigma_s1 = sigmas[step_index - 1].view(shape)
    alpha_t, alpha_s0, alpha_s1 = 1 - sigma_t, 1 - sigma_s0, 1 - sigma_s1
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0 = sample - sigma_s0 * model_output  # convert_model_output
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    d1 = (1.0 / r0) * (m0 - x0_prev.float())
    mean = ((sigma_t / sigma_s0 * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * m0
            + 0.5 * (alpha_t * (1 - torch.exp(-2.0 * h))) * d1)
    return mean, sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h))


def mixgrpo_dpm_step(sample, model_output, x0_prev, sigmas, step_index, *, prev_sample=None, noise=None,
                     out_dtype=None):
    """MixGRPO's ``dpm_step`` with its gaussian log-prob: ``(prev_sample, log_prob [B])``."""
    if (prev_sample is None) == (noise is None):
        raise ValueError("pass exactly one of prev_sample (recompute) and noise (rollout)")
    mean, std = mixgrpo_dpm_mean(sample, model_output, x0_prev, sigmas, step_index)
    prev_sample = mean + std * noise if prev_sample is None else prev_sample.float()
    log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std)
                - math.log(math.sqrt(2 * math.pi)))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return (prev_sample if out_dtype is None else prev_sample.to(out_dtype)), log_prob


def mixgrpo_dpm_kl(sample, model_output, ref_model_output, x0_prev, sigmas, step_index):
    """The exact KL per sample [B] between two policies' MixGRPO steps sharing x0_prev."""
    mean, std = mixgrpo_dpm_mean(sample, model_output, x0_prev, sigmas, step_index)
    with torch.no_grad():
        mean_ref, _ = mixgrpo_dpm_mean(sample, ref_model_output, x0_prev, sigmas, step_index)
    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std**2)
    return kl.reshape(-1)
