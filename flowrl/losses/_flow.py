"""The forward-process losses' blocks after validation (``flowrl.losses`` validates and picks the
backend): the backend's per-sample sums (``Backend.flow_sums``) and the per-sample [B] arithmetic after
them, written once for both backends. Eager mode calls these functions; under ``torch.compile`` the
custom ops ``flowrl::nft_loss``, ``flowrl::awm_log_prob`` and ``flowrl::awm_loss``
(flowrl/losses/_custom_ops.py) run the same functions.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..contract import FlowLoss
from ._policy import GRPOLossOutput, Variant, policy_loss

AWM_EPS = 1e-10  # AWM's huber / ghuber offset


class NFTLossOutput(NamedTuple):
    """DiffusionNFT's loss and its per-sample terms (detached, [B]): ``per_sample_loss`` is
    [r mse+/w+ + (1 - r) mse-/w-] / beta (before the adv_clip_max scale and the batch mean),
    ``positive_loss`` = mse+/w+, ``negative_loss`` = mse-/w-, ``kl`` = mean (v - v_ref)^2 or None."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    per_sample_loss: torch.Tensor
    positive_loss: torch.Tensor
    negative_loss: torch.Tensor
    kl: Optional[torch.Tensor]


def _numel(like, shard) -> int:
    """Elements per full sample: ``like``'s, or the shard context's under sequence parallelism."""
    return like.numel() // like.shape[0] if shard is None else shard.numel


def nft_from_args(ops, noised_sample, model_output, old_model_output, clean_sample, ref_model_output, t, advantages,
                  beta, adv_clip_max, kl_coef, shard=None) -> NFTLossOutput:
    """``nft_loss`` from its validated arguments (``t`` the [B] sigma), on backend ``ops``; ``shard``: the
    sequence-parallel context (None on one device)."""
    has_ref = ref_model_output is not None
    sums = ops.flow_sums(FlowLoss.NFT, 5 if has_ref else 4, noised_sample, model_output, old_model_output,
                         clean_sample, ref_model_output, t, (beta, 1.0 - beta, 1.0 + beta), shard=shard)
    numel = _numel(noised_sample, shard)
    abs_pos, sq_pos, abs_neg, sq_neg = sums[0], sums[1], sums[2], sums[3]
    w_pos = (abs_pos.detach() / numel).clamp(min=1e-5)
    w_neg = (abs_neg.detach() / numel).clamp(min=1e-5)
    positive = (sq_pos / numel) / w_pos
    negative = (sq_neg / numel) / w_neg
    adv = advantages.to(sums.dtype).clamp(-adv_clip_max, adv_clip_max)
    r = torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0, 1)
    per_sample = r * positive / beta + (1.0 - r) * negative / beta
    policy_loss = (per_sample * adv_clip_max).mean()
    kl = sums[4] / numel if has_ref else None
    loss = policy_loss + kl_coef * kl.mean() if has_ref and kl_coef != 0 else policy_loss
    return NFTLossOutput(loss, policy_loss.detach(), per_sample.detach(), positive.detach(), negative.detach(),
                         None if kl is None else kl.detach())


def awm_log_prob_from_args(ops, model_output, noise, clean_sample, t, weighting, p, shard=None) -> torch.Tensor:
    """``awm_log_prob`` from its validated arguments (``t`` the [B] sigma, ``p`` the ghuber power)."""
    sums = ops.flow_sums(FlowLoss.AWM, 1, None, model_output, noise, clean_sample, None, t, (0.0, 0.0, 0.0),
                         shard=shard)
    lp = -(sums[0] / _numel(model_output, shard))
    t = t.to(lp.dtype)
    if weighting == "t":
        lp = lp * t
    elif weighting == "t**2":
        lp = lp * t ** 2
    elif weighting == "huber":
        lp = -(torch.sqrt(-lp + AWM_EPS) - 1e-5) * t
    elif weighting == "ghuber":
        lp = -(torch.pow(-lp + AWM_EPS, p) - AWM_EPS ** p) * t / p
    return lp


def awm_from_args(ops, model_output, noise, clean_sample, t, weighting, p, old_log_prob, advantages, clip,
                  rollout_is_weights, shard=None) -> GRPOLossOutput:
    """``awm_loss`` from its validated arguments: ``awm_log_prob`` and the GRPO surrogate's arithmetic."""
    lp = awm_log_prob_from_args(ops, model_output, noise, clean_sample, t, weighting, p, shard)
    return policy_loss(Variant.GRPO, lp, None, None, old_log_prob.to(lp.dtype), advantages.to(lp.dtype), clip,
                       0.0, None, None, None if rollout_is_weights is None else rollout_is_weights.to(lp.dtype))
