"""Joint steps in the GRPO family's losses (several streams stepped together: LTX-2's video and audio;
docs/losses.md, Joint steps), a thin layer over the per-stream computation.

Each stream is validated as one step by ``flowrl.losses._grpo.validate`` (its ``GRPOCall`` with
``reduction="sum"``), and its per-sample values come from the backend table (``Backend.grpo_values``:
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

from dataclasses import replace
from typing import List

import torch

from ..backends import _dispatch
from ..contract import Reduction, TrustSource
from ..core.loss_spec import GRPOInputs, GRPOLossSpec, Variant
from ..ops.functional import check_stream_weights, combine_streams
from ..backends.reference import mode_coefficients
from ..ops.weights import scheme_weights
from ..ops._custom_ops import is_empty
from ._custom_ops import empty_joint, grpo_family_loss
from ._grpo import GRPOCall, validate
from ._policy import GRPOLossOutput, kl_coef_of, policy_loss


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


def _stream_calls(call: GRPOCall) -> List[GRPOCall]:
    """A joint call's streams, each one step's call (``reduction="sum"``: the streams' sums are combined)."""
    if call.shard is not None:
        raise ValueError("shard: a joint step (tuples of streams) is not supported under sequence parallelism; "
                         "pass one stream's shards, or shard=None")
    if call.token_sigmas is not None or call.frozen is not None:
        given = "token_sigmas" if call.token_sigmas is not None else "frozen"
        raise ValueError(f"{given}: a joint step (tuples of streams) takes no per-token sigmas or frozen mask in "
                         "the losses; pass one stream, or compute step_log_prob(..., token_sigmas=, frozen=) per "
                         "stream and form the loss from it")
    n = len(call.sample)
    if n == 0:
        raise ValueError("sample must hold at least one stream when given as a tuple")
    per_stream = dict(
        sample=list(call.sample), model_output=_streams("model_output", call.model_output, n, False),
        prev_sample=_streams("prev_sample", call.prev_sample, n, False),
        ref_model_output=_streams("ref_model_output", call.ref_model_output, n, True),
        old_prev_sample_mean=_streams("old_prev_sample_mean", call.old_prev_sample_mean, n, True),
        sigmas=_shared("sigmas", call.sigmas, n), step_index=_shared("step_index", call.step_index, n),
        noise_seed=_shared("noise_seed", call.noise_seed, n))
    return [replace(call, reduction="sum", stream_weights=None, **{name: values[k] for name, values in per_stream.items()})
            for k in range(n)]


def _stream_values(spec: GRPOLossSpec, inputs: GRPOInputs):
    """One stream's (log_prob, kl, D_s, count, GRPO-Guard's (std, D, n, D_s) or None) [B]."""
    lp, kl, tr = _dispatch.backend(spec.backend).grpo_values(spec, inputs)
    step = spec.step
    # the count step_log_prob returns for a step with nothing frozen: every element, or none where the
    # step is deterministic (std 0)
    std = scheme_weights("grpo_guard", step.sigmas, step.step_index, step.mode, step.noise_level, lp.dtype)[0]
    count = torch.where(std > 0, float(step.numel), 0.0).to(torch.float32)
    guard = None
    if spec.variant is Variant.GUARD:  # the stream's std and D, its element count (not zeroed where std is 0)
        _, _, std_k = mode_coefficients(step.sigmas, step.step_index, step.mode, step.noise_level, lp.dtype)
        table = step.sigmas.to(lp.dtype)
        guard = (std_k, table[step.step_index] - table[step.step_index + 1], float(step.numel), tr)
    return lp, kl, tr, count, guard


def grpo_family(variant: Variant, call: GRPOCall) -> GRPOLossOutput:
    """The GRPO-family loss of a joint step (``call``'s sample-shaped arguments tuples of streams): each
    stream validated as one step, the streams' values combined, then the per-sample arithmetic once."""
    calls = _stream_calls(call)
    weights = check_stream_weights(call.stream_weights, len(calls))
    reduction = Reduction.parse("reduction", call.reduction)
    streams = [validate(variant, c) for c in calls]
    if is_empty(call.sample):  # B = 0 (every stream validated): stream 0's empty output, on every stream's graph
        return empty_joint(grpo_family_loss(*streams[0]), [c.model_output for c in calls])
    values = [_stream_values(spec, inputs) for spec, inputs in streams]
    lps, kls, trs, counts, guards = (list(column) for column in zip(*values))
    spec, inputs = streams[0]  # the loss's options and [B] tensors, the same in every stream
    lp = combine_streams(lps, counts, reduction, weights)
    kl = combine_streams(kls, counts, reduction, weights) if inputs.ref_model_output is not None else None
    guard_weights = None
    if variant is Variant.GUARD:
        tr, guard_weights = joint_guard(guards)
    elif spec.trust is not TrustSource.NONE:
        tr = combine_streams([t * c.to(t.dtype) for t, c in zip(trs, counts)], counts, "mean", weights)
    else:
        tr = None
    dtype = lp.dtype
    weights_is = inputs.rollout_is_weights
    return policy_loss(variant, lp, kl, tr, inputs.old_log_prob.to(dtype), inputs.advantages.to(dtype), spec.clip,
                       kl_coef_of(spec, inputs, dtype), guard_weights, spec.kl_threshold,
                       None if weights_is is None else weights_is.to(dtype))


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


def stream_arguments_of(stream_args, streams, stream_weights, shared_of):
    """A joint step's streams, validated: ``streams`` the (name, value, kind) of ``stream_args``' positional
    arguments in order, kind "tuple" (one tensor per stream), "optional" (a tuple, or None for every
    stream) or "shared" (a tuple, or one value for every stream); stream k is ``stream_args(...,
    stream="[k]", **shared_of(k))``. Returns (the columns, one list per argument; each stream's validated
    arguments, one backend and one batch size for all; ``check_stream_weights``' weights)."""
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
    arguments = []
    for k in range(n):
        args = stream_args(*(column[k] for column in per_stream), stream=f"[{k}]", **shared_of(k))
        if k and getattr(args[0], "name", args[0]) != getattr(arguments[0][0], "name", arguments[0][0]):  # by name:
            # a traced call may hand each stream its own backend object
            raise ValueError("the streams of a joint step must run on one backend; got tensors for two backends")
        arguments.append(args)
    batches = [t.shape[0] for t in per_stream[0]]  # each stream's first tensor, checked by stream_args
    if any(b != batches[0] for b in batches):
        raise ValueError(f"the streams of a joint step must have one batch size; got {batches}")
    return per_stream, arguments, weights


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
    per_stream, stream_arguments, weights = stream_arguments_of(stream_args, streams, stream_weights,
                                                                lambda k: shared)
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
