"""The GRPO family's loss block after validation (``flowrl.losses._grpo.validate`` builds the spec and
the inputs): the backend's per-sample values (``Backend.grpo_values``) and the per-sample [B] arithmetic after
the reductions (ratio, clip, masks, weights), written once for both backends. Eager mode calls
``grpo_from_spec``; under ``torch.compile`` the custom op ``flowrl::grpo_family_loss``
(flowrl/losses/_custom_ops.py) runs the same function.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..backends import _dispatch
from ..contract import TrustSource
from ..core.loss_spec import GRPOInputs, GRPOLossSpec, Variant
from ..ops.weights import scheme_weights


class GRPOLossOutput(NamedTuple):
    """What a GRPO-family loss returns. ``loss`` is differentiable (to model_output); the rest are
    detached: per-sample [B] values and 0-d batch statistics (no host sync: ``.item()`` them when
    logging). Fields a variant does not compute are None.

    loss: policy_loss + kl_coef * mean(kl); with ``kl_coef`` a per-sample [B] tensor, policy_loss +
        mean(kl_coef * kl) (GARDO's gated KL, docs/losses.md).
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
    GRPO-Guard's (log_ratio, loss) weights, (std, 1/D) from flowrl.ops.weights.scheme_weights.
    ``is_weights``: rollout-correction weights [B] multiplying the per-sample policy loss before the
    batch mean (verl-omni's ``rollout_is_weights``; flowrl.consistency), not the KL term.
    ``kl_coef``: a float (the KL term kl_coef * mean(kl), none when 0) or a [B] tensor in the KL's dtype
    (the KL term mean(kl_coef * kl), always formed)."""
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
    if kl is None:
        loss = policy_loss
    elif isinstance(kl_coef, torch.Tensor):  # per sample (GARDO), before the batch mean
        loss = policy_loss + (kl_coef * kl).mean()
    else:
        loss = policy_loss + kl_coef * kl.mean() if kl_coef != 0 else policy_loss
    with torch.no_grad():
        r = ratio.detach()
        return GRPOLossOutput(
            loss, policy_loss.detach(), lp.detach(), r, None if kl is None else kl.detach(),
            None if tr is None else tr.detach(), clip_fraction, clip_low, clip_high, masked_fraction,
            0.5 * (log_ratio.detach() ** 2).mean(), r.mean(), r.min(), r.max())


def kl_coef_of(spec: GRPOLossSpec, inputs: GRPOInputs, dtype):
    """The KL weight ``policy_loss`` takes: the per-sample [B] ``inputs.kl_coef`` in ``dtype`` when given,
    else the spec's float."""
    return spec.kl_coef if inputs.kl_coef is None else inputs.kl_coef.to(dtype)


def grpo_from_spec(spec: GRPOLossSpec, inputs: GRPOInputs) -> GRPOLossOutput:
    """The GRPO family's loss from its validated spec and inputs (``flowrl.losses._grpo.validate``), on the
    spec's backend: the backend's per-sample values, then ``policy_loss``."""
    lp, kl, tr = _dispatch.backend(spec.backend).grpo_values(spec, inputs)
    dtype = lp.dtype
    # GRPO-Guard's weights: std on the corrected log-ratio, 1/D on the loss (flowrl.ops.weights)
    step = spec.step
    guard_weights = (scheme_weights("grpo_guard", step.sigmas, step.step_index, step.mode, step.noise_level, dtype)
                     if spec.variant is Variant.GUARD else None)
    weights = inputs.rollout_is_weights
    return policy_loss(spec.variant, lp, kl if inputs.ref_model_output is not None else None,
                       tr if spec.trust is not TrustSource.NONE else None, inputs.old_log_prob.to(dtype),
                       inputs.advantages.to(dtype), spec.clip, kl_coef_of(spec, inputs, dtype), guard_weights,
                       spec.kl_threshold,
                       None if weights is None else weights.to(dtype))
