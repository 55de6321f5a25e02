"""The GRPO family's loss block after validation (``flowrl.losses._grpo_family`` validates and builds the
spec): the backend's per-sample values (``Backend.grpo_values``) and the per-sample [B] arithmetic after
the reductions (ratio, clip, masks, weights), written once for both backends. Eager mode calls
``grpo_from_spec``; under ``torch.compile`` the custom op ``flowrl::grpo_family_loss``
(flowrl/losses/_custom_ops.py) runs the same function.
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional

import torch

from ..contract import KLSpace, TrustSource
from ..ops.weights import scheme_weights


class Variant(enum.IntEnum):
    GRPO = 0
    GUARD = 1
    DPPO = 2


class GRPOLossOutput(NamedTuple):
    """What a GRPO-family loss returns. ``loss`` is differentiable (to model_output); the rest are
    detached: per-sample [B] values and 0-d batch statistics (no host sync: ``.item()`` them when
    logging). Fields a variant does not compute are None.

    loss: policy_loss + kl_coef * mean(kl).
    policy_loss: the batch mean of the per-sample surrogate (GRPO-Guard: each divided by its step's D;
        times ``rollout_is_weights`` when given).
    log_prob: [B] the recomputed log-prob, bit for bit ``flowrl.step_log_prob``'s on the same backend.
    ratio: [B] the importance ratio (GRPO-Guard: its corrected ratio).
    kl: [B] the KL to the reference policy (when ``ref_model_output`` is given): the exact transition KL,
        or with ``kl_space="velocity"`` the velocity's mean (v - v_ref)^2.
    trust_divergence: [B] D_s = mean ||mu_theta - mu_old||^2 / (2 std^2) (trust-region variants).
    clip_fraction, clip_fraction_low, clip_fraction_high: fraction of samples whose ratio is outside
        [1 - eps_low, 1 + eps_high] (both sides, below, above).
    masked_fraction: Flow-DPPO's fraction of masked samples.
    approx_kl: 0.5 * mean((log_prob - old_log_prob)^2) (Flow-GRPO's ``approx_kl``).
    ratio_mean, ratio_min, ratio_max: of ``ratio``.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    log_prob: torch.Tensor
    ratio: torch.Tensor
    kl: Optional[torch.Tensor]
    trust_divergence: Optional[torch.Tensor]
    clip_fraction: Optional[torch.Tensor]
    clip_fraction_low: Optional[torch.Tensor]
    clip_fraction_high: Optional[torch.Tensor]
    masked_fraction: Optional[torch.Tensor]
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor


def policy_loss(variant, lp, kl, tr, old_lp, adv, clip, kl_coef, guard_weights, kl_threshold,
                is_weights=None) -> GRPOLossOutput:
    """The per-sample [B] arithmetic after the reductions, shared by both backends. ``guard_weights``:
    GRPO-Guard's (log_ratio, loss) weights, (std, 1/D) from flowrl.weights.scheme_weights.
    ``is_weights``: rollout-correction weights [B] multiplying the per-sample policy loss before the
    batch mean (verl-omni's ``rollout_is_weights``; flowrl.consistency), not the KL term."""
    log_ratio = lp - old_lp
    if variant is Variant.GUARD:  # GRPO-Guard: rho = exp((dlogp + D_s) * std)
        ratio = torch.exp((log_ratio + tr) * guard_weights[0])
    else:
        ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clip_fraction = clip_low = clip_high = masked_fraction = None
    if variant is Variant.DPPO:  # mask a sample past the divergence bound moving further in A's direction
        beyond = tr.detach() >= kl_threshold
        masked = beyond & (((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0)))
        per_sample = torch.where(masked.detach(), torch.zeros_like(unclipped), unclipped)
        masked_fraction = masked.float().mean().detach()
    else:
        lo, hi = clip
        clipped = -adv * torch.clamp(ratio, 1.0 - lo, 1.0 + hi)
        per_sample = torch.maximum(unclipped, clipped)
        if variant is Variant.GUARD:  # the loss scaled by 1/D (verl-omni: / sqrt_dt ** 2)
            per_sample = per_sample * guard_weights[1]
        with torch.no_grad():
            low, high = ratio < 1.0 - lo, ratio > 1.0 + hi
            clip_low, clip_high = low.float().mean(), high.float().mean()
            clip_fraction = (low | high).float().mean()
    if is_weights is not None:  # rollout correction: per sample, before the batch mean (verl-omni)
        per_sample = per_sample * is_weights
    policy_loss = per_sample.mean()
    loss = policy_loss + kl_coef * kl.mean() if kl is not None and kl_coef != 0 else policy_loss
    with torch.no_grad():
        r = ratio.detach()
        return GRPOLossOutput(
            loss, policy_loss.detach(), lp.detach(), r, None if kl is None else kl.detach(),
            None if tr is None else tr.detach(), clip_fraction, clip_low, clip_high, masked_fraction,
            0.5 * (log_ratio.detach() ** 2).mean(), r.mean(), r.min(), r.max())


def grpo_from_spec(variant, ops, spec, sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output,
                   old_prev_sample_mean, trust, seed, clip, kl_coef, kl_threshold, rollout_is_weights,
                   kl_space=KLSpace.TRANSITION, ref_cond=None, ref_scale=None) -> GRPOLossOutput:
    """The GRPO family's loss from its validated arguments (``flowrl.losses._grpo_family``), on backend ``ops``.
    ``ref_cond`` given: ``ref_model_output`` is the reference's unconditional branch, guided by ``ref_cond``
    at scale ``ref_scale`` inside the backend's pass; ``kl_space``: where the KL is measured."""
    lp, kl, tr = ops.grpo_values(spec, sample, model_output, prev_sample, ref_model_output, old_prev_sample_mean,
                                 trust, seed, kl_space=kl_space, ref_cond=ref_cond, ref_scale=ref_scale)
    dtype = lp.dtype
    # GRPO-Guard's weights: std on the corrected log-ratio, 1/D on the loss (flowrl.weights)
    guard_weights = (scheme_weights("grpo_guard", spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
                     if variant is Variant.GUARD else None)
    return policy_loss(variant, lp, kl if ref_model_output is not None else None,
                       tr if trust is not TrustSource.NONE else None, old_log_prob.to(dtype), advantages.to(dtype),
                       clip, kl_coef, guard_weights, kl_threshold,
                       None if rollout_is_weights is None else rollout_is_weights.to(dtype))
