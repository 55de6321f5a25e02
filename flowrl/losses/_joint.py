"""Joint steps in the GRPO family's losses (several streams stepped together: LTX-2's video and audio;
docs/losses.md, Joint steps), a thin layer over the per-stream computation.

Each stream is validated as one step by ``flowrl.losses._grpo_family(..., _stream=True)`` with
``reduction="sum"``, and its per-sample values come from the backend table (``Backend.grpo_values``:
one fused pass per stream, forward and backward). The streams' log-probs and KLs are combined by
``flowrl.combine_streams`` with the streams' counts and ``stream_weights``, the formula
``step_log_prob`` / ``step_kl`` on tuples and the recorder use, so the joint log-prob equals
``step_log_prob(tuples)`` bit for bit and the first ratio on a joint rollout is exactly 1. Flow-DPPO's
D_s (a per-stream mean) is combined the same way (as a sum: the mean times the count). The per-sample
arithmetic after that (``flowrl.losses._policy.policy_loss``) runs once, on the joint values.
"""
from __future__ import annotations

import torch

from ..contract import Reduction, TrustSource
from ..ops.functional import check_stream_weights, combine_streams
from ..ops.weights import scheme_weights
from ._policy import GRPOLossOutput, Variant, policy_loss


def _streams(name: str, value, n: int, optional: bool) -> list:
    """One tensor per stream: a tuple of n (None for each stream when ``optional`` and None)."""
    if value is None and optional:
        return [None] * n
    if not isinstance(value, tuple):
        raise TypeError(f"{name} must be a tuple of {n} tensors, one per stream like sample; got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{name} must be a tuple of {n} tensors, one per stream like sample; got {len(value)} entries")
    return list(value)


def _shared(name: str, value, n: int) -> list:
    """One entry per stream: a tuple of n entries, or one value shared by every stream."""
    if isinstance(value, tuple):
        if len(value) != n:
            raise ValueError(f"{name} must have one entry per stream ({n}) or be one shared value; got {len(value)} entries")
        return list(value)
    return [value] * n


def grpo_family(family, variant, sample, model_output, prev_sample, sigmas, step_index, old_log_prob, advantages, *,
                clip_range, mode, noise_level, log_prob, reduction, kl_coef, ref_model_output, old_prev_sample_mean,
                noise_seed, kl_threshold, backend, rollout_is_weights, stream_weights, kl_space="transition",
                ref_guidance_scale=None) -> GRPOLossOutput:
    """The GRPO-family loss of a joint step; ``family`` is ``flowrl.losses._grpo_family`` (per stream)."""
    n = len(sample)
    if n == 0:
        raise ValueError("sample must hold at least one stream when given as a tuple")
    if variant is Variant.GUARD:
        raise ValueError("grpo_guard_loss takes one stream: its ratio and loss weights (std, 1/D) are a step's, and "
                         "the streams of a joint step have their own; use grpo_loss or flow_dppo_loss for tuples")
    if ref_guidance_scale is not None:
        raise ValueError("ref_guidance_scale: a joint step takes each stream's reference output as one tensor (the "
                         "streams' tuple is ref_model_output); combine the guided reference per stream first")
    outputs = _streams("model_output", model_output, n, False)
    prevs = _streams("prev_sample", prev_sample, n, False)
    refs = _streams("ref_model_output", ref_model_output, n, True)
    olds = _streams("old_prev_sample_mean", old_prev_sample_mean, n, True)
    tables, steps, seeds = _shared("sigmas", sigmas, n), _shared("step_index", step_index, n), _shared(
        "noise_seed", noise_seed, n)
    weights = check_stream_weights(stream_weights, n)
    reduction = Reduction.parse("reduction", reduction)
    lps, kls, trs, counts = [], [], [], []
    for k in range(n):
        args = family(variant, sample[k], outputs[k], prevs[k], tables[k], steps[k], old_log_prob, advantages,
                      clip_range=clip_range, mode=mode, noise_level=noise_level, log_prob=log_prob, reduction="sum",
                      kl_coef=kl_coef, ref_model_output=refs[k], old_prev_sample_mean=olds[k], noise_seed=seeds[k],
                      kl_threshold=kl_threshold, backend=backend, rollout_is_weights=rollout_is_weights, _stream=True,
                      kl_space=kl_space)
        (_, ops, spec, x, v, prev, old_lp, adv, ref, old_mean, trust, seed, clip, kl_coef, kl_threshold,
         is_weights, kl_space_k, ref_cond, ref_scale) = args
        lp, kl, tr = ops.grpo_values(spec, x, v, prev, ref, old_mean, trust, seed, kl_space=kl_space_k)
        # the count step_log_prob returns for a step with nothing frozen: every element, or none where the
        # step is deterministic (std 0)
        std = scheme_weights("grpo_guard", spec.sigmas, spec.step_index, spec.mode, spec.noise_level, lp.dtype)[0]
        count = torch.where(std > 0, float(spec.numel), 0.0).to(torch.float32)
        lps.append(lp)
        kls.append(kl)
        trs.append(tr * count.to(tr.dtype))
        counts.append(count)
    lp = combine_streams(lps, counts, reduction, weights)
    kl = combine_streams(kls, counts, reduction, weights) if refs[0] is not None else None
    tr = combine_streams(trs, counts, "mean", weights) if trust is not TrustSource.NONE else None
    dtype = lp.dtype
    return policy_loss(variant, lp, kl, tr, old_lp.to(dtype), adv.to(dtype), clip, kl_coef, None, kl_threshold,
                       None if is_weights is None else is_weights.to(dtype))
