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
from ..core.loss_spec import Variant
from ._policy import GRPOLossOutput, policy_loss

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


def nft_sums(ops, noised_sample, model_output, old_model_output, clean_sample, ref_model_output, t, advantages,
             beta, adv_clip_max, kl_coef, shard=None):
    """NFT's [K, B] per-sample sums (|e+|, e+^2, |e-|, e-^2 and, with a reference, (v - v_ref)^2) and the
    element count they are over, from ``nft_loss``'s validated arguments."""
    has_ref = ref_model_output is not None
    sums = ops.flow_sums(FlowLoss.NFT, 5 if has_ref else 4, noised_sample, model_output, old_model_output,
                         clean_sample, ref_model_output, t, (beta, 1.0 - beta, 1.0 + beta), shard=shard)
    return sums, _numel(noised_sample, shard)


def nft_from_args(ops, noised_sample, model_output, old_model_output, clean_sample, ref_model_output, t, advantages,
                  beta, adv_clip_max, kl_coef, shard=None) -> NFTLossOutput:
    """``nft_loss`` from its validated arguments (``t`` the [B] sigma), on backend ``ops``; ``shard``: the
    sequence-parallel context (None on one device)."""
    args = (ops, noised_sample, model_output, old_model_output, clean_sample, ref_model_output, t, advantages, beta,
            adv_clip_max, kl_coef)
    sums, numel = nft_sums(*args, shard=shard)
    return nft_from_means(args, [row / numel for row in sums])


def nft_from_means(args, means) -> NFTLossOutput:
    """``nft_loss`` from its per-sample means (``nft_sums``' rows over their counts: one stream's, or a joint
    step's combination) and its validated arguments ``args`` (their per-sample and scalar entries)."""
    advantages, beta, adv_clip_max, kl_coef = args[7:11]
    has_ref = len(means) == 5
    abs_pos, sq_pos, abs_neg, sq_neg = means[0], means[1], means[2], means[3]
    w_pos = abs_pos.detach().clamp(min=1e-5)
    w_neg = abs_neg.detach().clamp(min=1e-5)
    positive = sq_pos / w_pos
    negative = sq_neg / w_neg
    adv = advantages.to(sq_pos.dtype).clamp(-adv_clip_max, adv_clip_max)
    r = torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0, 1)
    per_sample = r * positive / beta + (1.0 - r) * negative / beta
    policy_loss = (per_sample * adv_clip_max).mean()
    kl = means[4] if has_ref else None
    loss = policy_loss + kl_coef * kl.mean() if has_ref and kl_coef != 0 else policy_loss
    return NFTLossOutput(loss, policy_loss.detach(), per_sample.detach(), positive.detach(), negative.detach(),
                         None if kl is None else kl.detach())


def awm_sums(ops, model_output, noise, clean_sample, t, weighting, p, shard=None):
    """AWM's [1, B] per-sample sum of (v - (eps - x0))^2 and its element count, from ``awm_log_prob``'s
    validated arguments."""
    sums = ops.flow_sums(FlowLoss.AWM, 1, None, model_output, noise, clean_sample, None, t, (0.0, 0.0, 0.0),
                         shard=shard)
    return sums, _numel(model_output, shard)


def awm_log_prob_from_args(ops, model_output, noise, clean_sample, t, weighting, p, shard=None) -> torch.Tensor:
    """``awm_log_prob`` from its validated arguments (``t`` the [B] sigma, ``p`` the ghuber power)."""
    args = (ops, model_output, noise, clean_sample, t, weighting, p)
    sums, numel = awm_sums(*args, shard=shard)
    return awm_from_means(args, [sums[0] / numel])


def awm_from_means(args, means) -> torch.Tensor:
    """``awm_log_prob`` from the per-sample mean of (v - (eps - x0))^2 (one stream's, or a joint step's
    combination) and its validated arguments ``args``: l = -mean, then the weighting."""
    t, weighting, p = args[4:7]
    lp = -means[0]
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
