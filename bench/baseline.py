"""The benchmark's baseline: the step math written out in plain eager torch, the way the peers do it.

This follows Flow-GRPO's ``sde_step_with_logprob`` (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``)
term for term: inputs upcast to float32, one torch op per term of the formula, the log-prob as the
mean over all non-batch dims. ``mode="sde"`` is Flow-GRPO's (and SGLang's ``rollout_sde_type="sde"``)
step with the Gaussian log-density; ``mode="cps"`` is its Coefficients-Preserving Sampling branch,
whose log-prob drops every constant (``-r^2``, flowrl's ``log_prob="sq_err"``). The KL follows
Flow-GRPO's training loop: ``((mean - mean_ref) ** 2).mean(non-batch dims) / (2 * variance)`` with the
reference mean computed under ``torch.no_grad``.

Two deliberate departures, neither changing the op count:
- ``sigma_max`` (Flow-GRPO's ``self.sigmas[1].item()``) is passed in, so the baseline needs no host
  sync and ``torch.compile`` sees one graph;
- the KL divides by the transition's exact variance ``(std_dev_t * sqrt(-dt)) ** 2`` for ``sde`` where
  Flow-GRPO divides by ``std_dev_t ** 2``, so it can be checked against flowrl's exact KL (SPEC, KL).

It is not part of the flowrl package: it is what flowrl is measured against, and the bench checks that
both agree numerically before timing either.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

MODES = ("sde", "cps")
# flowrl's log_prob= kind that matches each mode's Flow-GRPO log-prob
LOG_PROB_KIND = {"sde": "gaussian", "cps": "sq_err"}


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
    if mode == "sde":
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
