"""Joint steps in the GRPO family's losses (several streams stepped together: LTX-2's video and audio;
docs/losses.md, Joint steps), a thin layer over the per-stream computation.

Each stream is validated as one step by ``flowrl.losses._grpo_family(..., _stream=True)`` with
``reduction="sum"``, and its per-sample values come from the backend table (``Backend.grpo_values``:
one fused pass per stream, forward and backward). The streams' log-probs and KLs are combined by
``flowrl.combine_streams`` with the streams' counts and ``stream_weights``, the formula
``step_log_prob`` / ``step_kl`` on tuples and the recorder use, so the joint log-prob equals
``step_log_prob(tuples)`` bit for bit and the first ratio on a joint rollout is exactly 1. Flow-DPPO's
D_s (a per-stream mean) is combined the same way (as a sum: the mean times the count). GRPO-Guard's
step quantities are verl-omni's MiniMax-H3 adapter's (``joint_guard``): element-count averages over the
streams. The per-sample arithmetic after that (``flowrl.losses._policy.policy_loss``) runs once, on the
joint values.
"""
from __future__ import annotations

import torch

from ..contract import Reduction, TrustSource
from ..ops.functional import check_stream_weights, combine_streams
from ..backends.reference import mode_coefficients
from ..ops.weights import scheme_weights
from ..ops._custom_ops import is_empty
from ._custom_ops import empty_joint, grpo_family_loss
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
                clip_range, mode, noise_level, log_prob_kind, reduction, kl_coef, ref_model_output, old_prev_sample_mean,
                noise_seed, kl_threshold, backend, rollout_is_weights, stream_weights, kl_space="transition",
                ref_guidance_scale=None) -> GRPOLossOutput:
    """The GRPO-family loss of a joint step; ``family`` is ``flowrl.losses._grpo_family`` (per stream)."""
    n = len(sample)
    if n == 0:
        raise ValueError("sample must hold at least one stream when given as a tuple")
    outputs = _streams("model_output", model_output, n, False)
    prevs = _streams("prev_sample", prev_sample, n, False)
    refs = _streams("ref_model_output", ref_model_output, n, True)
    olds = _streams("old_prev_sample_mean", old_prev_sample_mean, n, True)
    tables, steps, seeds = _shared("sigmas", sigmas, n), _shared("step_index", step_index, n), _shared(
        "noise_seed", noise_seed, n)
    weights = check_stream_weights(stream_weights, n)
    reduction = Reduction.parse("reduction", reduction)
    streams = [family(variant, sample[k], outputs[k], prevs[k], tables[k], steps[k], old_log_prob, advantages,
                      clip_range=clip_range, mode=mode, noise_level=noise_level, log_prob_kind=log_prob_kind, reduction="sum",
                      kl_coef=kl_coef, ref_model_output=refs[k], old_prev_sample_mean=olds[k], noise_seed=seeds[k],
                      kl_threshold=kl_threshold, backend=backend, rollout_is_weights=rollout_is_weights, _stream=True,
                      kl_space=kl_space, ref_guidance_scale=ref_guidance_scale) for k in range(n)]
    if is_empty(sample):  # B = 0 (every stream validated): stream 0's empty output, on every stream's graph
        return empty_joint(grpo_family_loss(*streams[0]), outputs)
    lps, kls, trs, counts, steps_k = [], [], [], [], []
    for args in streams:
        (_, ops, spec, x, v, prev, old_lp, adv, ref, old_mean, trust, seed, clip, kl_coef, kl_threshold,
         is_weights, kl_space_k, ref_cond, ref_scale) = args
        lp, kl, tr = ops.grpo_values(spec, x, v, prev, ref, old_mean, trust, seed, kl_space=kl_space_k,
                                     ref_cond=ref_cond, ref_scale=ref_scale)
        # the count step_log_prob returns for a step with nothing frozen: every element, or none where the
        # step is deterministic (std 0)
        std = scheme_weights("grpo_guard", spec.sigmas, spec.step_index, spec.mode, spec.noise_level, lp.dtype)[0]
        count = torch.where(std > 0, float(spec.numel), 0.0).to(torch.float32)
        lps.append(lp)
        kls.append(kl)
        trs.append(tr * count.to(tr.dtype))
        counts.append(count)
        if variant is Variant.GUARD:  # the stream's std and D, its element count (not zeroed where std is 0)
            _, _, std_k = mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, lp.dtype)
            table = spec.sigmas.to(lp.dtype)
            steps_k.append((std_k, table[spec.step_index] - table[spec.step_index + 1], float(spec.numel), tr))
    lp = combine_streams(lps, counts, reduction, weights)
    kl = combine_streams(kls, counts, reduction, weights) if refs[0] is not None else None
    guard_weights = None
    if variant is Variant.GUARD:
        tr, guard_weights = joint_guard(steps_k)
    elif trust is not TrustSource.NONE:
        tr = combine_streams(trs, counts, "mean", weights)
    else:
        tr = None
    dtype = lp.dtype
    return policy_loss(variant, lp, kl, tr, old_lp.to(dtype), adv.to(dtype), clip, kl_coef, guard_weights,
                       kl_threshold, None if is_weights is None else is_weights.to(dtype))


def joint_guard(streams):
    """GRPO-Guard's (D_s, (log_ratio weight, loss weight)) [B] of a joint step from each stream's (std_k,
    D_k, n_k, D_s_k): verl-omni's MiniMax-H3 FlowGRPO adapter (verl-project/verl-omni commit 066a6cca,
    verl_omni/pipelines/minimax_h3_flow_grpo/diffusers_training_adapter.py) with its ``GRPOGuardLoss``:
    with n_k the streams' element counts, N their sum,

        D = sum_k n_k D_k / N;  s^2 = sum_k n_k (std_k^2 / D_k) / N  (their ``std_dev_t``^2 = std^2 / D);
        scale = sqrt(D) sqrt(s^2);  D_s = sum_k n_k mean_k (mu - mu_old)^2 / N / (2 scale^2),

    the ratio exp((lp - lp_old + D_s) scale) and the loss / D. So the step quantities are element-count
    averages whatever ``stream_weights`` weights the log-prob (theirs: 0.5 / 0.5 log-probs, count-averaged
    std, dt and mean drift). A stream's mean (mu - mu_old)^2 is its D_s_k x 2 std_k^2 (0 where std_k is
    0, as its D_s_k is); every sum runs over the streams left to right."""
    n_total = sum(n for _, _, n, _ in streams)
    d_bar = s2_bar = drift = None
    for std, d, n, tr in streams:
        w = n / n_total
        var_rate = torch.where(d > 0, std * std / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
        terms = (w * d, w * var_rate, w * (tr * (2 * std * std)))
        d_bar, s2_bar, drift = terms if d_bar is None else (d_bar + terms[0], s2_bar + terms[1], drift + terms[2])
    scale = torch.sqrt(d_bar) * torch.sqrt(s2_bar)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    tr = torch.where(scale > 0, drift / (2 * safe * safe), torch.zeros_like(drift))
    return tr, (scale, 1 / d_bar)


def single_stream(stream_weights, tuples: str) -> None:
    """``stream_weights`` given to a loss called on one stream: refused, naming the tuple arguments."""
    if stream_weights is not None:
        raise ValueError(f"stream_weights weights the streams of a joint step: pass {tuples} as tuples (one tensor "
                         "per stream), or stream_weights=None")


def flow_loss(stream_args, sums_of, tail, stream_weights, streams, shared, empty=None):
    """A forward-process loss (nft, awm) of a joint step. ``streams``: the (name, value, kind) of
    ``stream_args``' positional arguments in order, kind "tuple" (one tensor per stream), "optional" (a
    tuple, or None for every stream) or "shared" (a tuple, or one value for every stream); ``shared``:
    its keyword arguments. Each stream is validated by ``stream_args(..., stream="[k]")``, its [K, B]
    sums and element count come from ``sums_of`` (the backend's fused pass); each row's mean is
    ``combine_streams`` of the streams' sums and counts with ``stream_weights``; ``tail(args of stream 0,
    means)`` runs the per-sample arithmetic once on the joint means. On an empty batch (B = 0) no sum is
    computed: ``empty(*args of stream 0)`` (the loss's op wrapper, which answers B = 0 with zeros) with its
    loss on the graph of every stream's ``model_output``."""
    n = len(streams[0][1])
    if n == 0:
        raise ValueError(f"{streams[0][0]} must hold at least one stream when given as a tuple")
    per_stream = []
    for name, value, kind in streams:
        if kind == "shared":
            per_stream.append(_shared(name, value, n))
        else:
            per_stream.append(_streams(name, value, n, kind == "optional"))
    if any(kind == "optional" and isinstance(value, tuple) and any(u is None for u in value)
           for name, value, kind in streams):
        raise ValueError("ref_model_output: give every stream's reference output, or ref_model_output=None")
    weights = check_stream_weights(stream_weights, n)
    stream_arguments = []
    for k in range(n):
        args = stream_args(*(column[k] for column in per_stream), stream=f"[{k}]", **shared)
        if k and args[0] is not stream_arguments[0][0]:
            raise ValueError("the streams of a joint step must run on one backend; got tensors for two backends")
        stream_arguments.append(args)
    batches = [t.shape[0] for t in per_stream[0]]  # each stream's first tensor, checked by stream_args
    if any(b != batches[0] for b in batches):
        raise ValueError(f"the streams of a joint step must have one batch size; got {batches}")
    first = stream_arguments[0]
    if empty is not None and is_empty(per_stream[0]):
        outputs = next(column for (name, _, _), column in zip(streams, per_stream) if name == "model_output")
        return empty_joint(empty(*first), outputs)
    sums, counts = [], []
    for args in stream_arguments:
        s, numel = sums_of(*args)
        sums.append(s)
        counts.append(torch.full((s.shape[1],), float(numel), dtype=torch.float32, device=s.device))
    means = [combine_streams([s[j] for s in sums], counts, "mean", weights) for j in range(sums[0].shape[0])]
    return tail(first, means)
