"""The GRPO family's arguments as given (``GRPOCall``, one object from the public function to the
validator) and their one validator, ``validate``: a ``GRPOLossSpec`` and the ``GRPOInputs`` it reads
(flowrl/core/loss_spec.py). A joint step validates each stream here too (flowrl/losses/_joint.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from ..backends import _dispatch
from ..contract import KLSpace, Op, Reduction, TrustSource
from ..core import _validate as V
from ..core.loss_spec import GRPOInputs, GRPOLossSpec, Variant
from ..core.step_spec import (
    ShardContext, StepSpec, elements_per_sample, elementwise_inputs, parse_log_prob_kind, schedule_and_steps,
)
from ._common import _check_no_grad, _check_per_sample, _check_scalar, check_clip_range


@dataclass(frozen=True)
class GRPOCall:
    """A ``grpo_loss`` / ``grpo_guard_loss`` / ``flow_dppo_loss`` call's arguments, as the user gave them
    (the public functions' docstrings say what each means); ``validate`` checks them."""

    sample: Any
    model_output: Any
    prev_sample: Any
    sigmas: Any
    step_index: Any
    old_log_prob: Any
    advantages: Any
    clip_range: Any = None
    mode: str = "sde"
    noise_level: float = 0.7
    log_prob_kind: str = "gaussian"
    reduction: str = "mean"
    kl_coef: Union[float, torch.Tensor] = 0.0
    kl_space: str = "transition"
    kl_threshold: Optional[float] = None
    ref_model_output: Any = None
    ref_guidance_scale: Optional[float] = None
    old_prev_sample_mean: Any = None
    noise_seed: Any = None
    rollout_is_weights: Optional[torch.Tensor] = None
    token_sigmas: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None
    backend: str = "auto"
    shard: Optional[ShardContext] = None
    stream_weights: Optional[Sequence[float]] = None


def _step_sample_tensor(name, t, sample):
    if t is not None:
        V.check_batch_tensor(name, t, sample)
    return t


def _reference(ref_model_output, ref_guidance_scale, sample) -> Tuple[Any, Any, Optional[float]]:
    """The reference's output: (ref, None, None) for one tensor (or None), (uncond, cond, w) for the two
    branches ``ref_model_output=(uncond, cond)`` with ``ref_guidance_scale=w``; each checked."""
    if isinstance(ref_model_output, (tuple, list)):
        if len(ref_model_output) != 2:
            raise ValueError("ref_model_output must be a tensor or a pair (uncond, cond) of the reference's two "
                             f"branches; got a {type(ref_model_output).__name__} of {len(ref_model_output)}")
        uncond, cond = ref_model_output
        _step_sample_tensor("ref_model_output[0] (uncond)", uncond, sample)
        _step_sample_tensor("ref_model_output[1] (cond)", cond, sample)
        _check_no_grad(**{"ref_model_output[0] (uncond)": uncond, "ref_model_output[1] (cond)": cond})
        if ref_guidance_scale is None:
            raise ValueError("ref_model_output is a pair (uncond, cond) but ref_guidance_scale is None: pass the "
                             "guidance scale w of the reference's uncond + w (cond - uncond)")
        return uncond, cond, _check_scalar("ref_guidance_scale", ref_guidance_scale, minimum=-math.inf)
    if ref_guidance_scale is not None:
        raise ValueError("ref_guidance_scale is given but ref_model_output is not a pair (uncond, cond): pass the "
                         "reference's two branches, or its guided output alone without ref_guidance_scale")
    return _step_sample_tensor("ref_model_output", ref_model_output, sample), None, None


def _trust(variant: Variant, call: GRPOCall, sample) -> Tuple[TrustSource, Optional[V.NoiseSeed]]:
    """Where a trust-region variant's mu_old comes from: given, or replayed from the rollout's noise seed."""
    if variant is Variant.GRPO:
        return TrustSource.NONE, None
    if (call.old_prev_sample_mean is None) == (call.noise_seed is None):
        raise ValueError("pass exactly one of old_prev_sample_mean (the rollout's mean mu_old) and noise_seed "
                         "(the rollout's noise_seed, to replay mu_old = prev_sample - std * eps)")
    if call.old_prev_sample_mean is not None:
        V.check_batch_tensor("old_prev_sample_mean", call.old_prev_sample_mean, sample)
        return TrustSource.GIVEN, None
    # a shard's Philox elements are keyed by their index in the full sample (as sde_step's)
    seed = V.check_noise_seed(call.noise_seed, sample)
    return TrustSource.REPLAY, seed._replace(elem_offset=0 if call.shard is None else call.shard.offset)


def _kl_coef(value, batch: int, device) -> Tuple[float, Optional[torch.Tensor]]:
    """``kl_coef``: a real number >= 0 (the scalar weight, as it has always been), or a float tensor [B]
    (per-sample weights, GARDO's gated KL: ``flowrl.advantages.gardo_kl_coef``) with no grad, whose values
    (finite, >= 0) are asserted on the device in the checked mode only (flowrl.checks: no host sync).
    Returns (the scalar, 0.0 for a tensor; the tensor or None)."""
    if isinstance(value, torch.Tensor):
        t = _check_per_sample("kl_coef", value, batch, device)
        _check_no_grad(kl_coef=t)
        if V.checks._enabled and t.device.type != "meta" and not torch.compiler.is_compiling():
            torch._assert_async((t >= 0).all(), "flowrl.checks: kl_coef holds a negative value")
        return 0.0, t
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError("kl_coef must be a finite real number >= 0 or a float tensor of shape [B] = "
                        f"[{batch}] (per-sample weights); got {type(value).__name__}")
    return _check_scalar("kl_coef", value), None


def _refuse_elementwise(variant: Variant, call: GRPOCall, kl_space: KLSpace) -> None:
    if call.token_sigmas is not None and variant is Variant.GUARD:
        raise ValueError("token_sigmas is not supported by grpo_guard_loss: its ratio exp((dlogp + D_s) * std) and "
                         "loss weight 1/D are one step's std and D (flowrl.ops.weights.scheme_weights), and per-token "
                         "sigmas give each token its own; use flow_dppo_loss or grpo_loss (frozen= alone is "
                         "supported: the sample's own step)")
    if (call.token_sigmas is not None or call.frozen is not None) and kl_space is KLSpace.VELOCITY:
        given = "token_sigmas" if call.token_sigmas is not None else "frozen"
        raise ValueError(f"{given} is not supported with kl_space='velocity' (its (v - v_ref)^2 is a mean over "
                         "every element, with no scored count); use kl_space='transition', whose KL is "
                         "step_kl(..., token_sigmas=, frozen=)")


def validate(variant: Variant, call: GRPOCall) -> Tuple[GRPOLossSpec, GRPOInputs]:
    """One stream's call checked (each error names its argument): the loss's spec and its inputs."""
    sample, model_output, prev_sample = call.sample, call.model_output, call.prev_sample
    if call.stream_weights is not None:
        raise ValueError("stream_weights weights the streams of a joint step: pass sample, model_output and "
                         "prev_sample as tuples (one tensor per stream), or stream_weights=None")
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, call.sigmas, call.step_index, call.mode,
                                                call.noise_level)
    if not mode.rules.losses:  # ddim: its mean is not a * x + c * v (x0's clip; an alpha-bar table), which the loss kernels fuse
        raise ValueError(f"mode={mode.label!r} is not supported by flowrl.losses; compute "
                         f"step_log_prob(mode={mode.label!r}, ...) and form the loss from it")
    V.check_batch_tensor("prev_sample", prev_sample, sample)
    kl_space = KLSpace.parse("kl_space", call.kl_space)
    # per-token sigmas and the frozen mask: step_log_prob's checks and spec fields (one formula, one place)
    elementwise = elementwise_inputs(sample, sigmas, call.token_sigmas, call.frozen, mode)
    _refuse_elementwise(variant, call, kl_space)
    ref_model_output, ref_cond, ref_scale = _reference(call.ref_model_output, call.ref_guidance_scale, sample)
    batch = sample.shape[0]
    numel = elements_per_sample(sample, call.shard)  # the full sample's under sequence parallelism (checks shard)
    old_log_prob = _check_per_sample("old_log_prob", call.old_log_prob, batch, sample.device)
    advantages = _check_per_sample("advantages", call.advantages, batch, sample.device)
    weights = call.rollout_is_weights
    if weights is not None:
        weights = _check_per_sample("rollout_is_weights", weights, batch, sample.device)
    clip = check_clip_range(call.clip_range) if variant is not Variant.DPPO else None
    kl_coef, kl_per_sample = _kl_coef(call.kl_coef, batch, sample.device)
    if kl_per_sample is not None and ref_model_output is None:
        raise ValueError("kl_coef is a per-sample tensor but ref_model_output is None: pass the reference "
                         "policy's model_output")
    if kl_coef != 0 and ref_model_output is None:
        raise ValueError("kl_coef is nonzero but ref_model_output is None: pass the reference policy's model_output")
    _check_no_grad(sample=sample, prev_sample=prev_sample, ref_model_output=ref_model_output,
                   old_prev_sample_mean=call.old_prev_sample_mean, old_log_prob=old_log_prob, advantages=advantages,
                   rollout_is_weights=weights)
    trust, seed = _trust(variant, call, sample)
    step = StepSpec(op=Op.LOG_PROB, sigmas=sigmas, step_index=idx, mode=mode, noise_level=eta,
                    kind=parse_log_prob_kind(call.log_prob_kind),
                    reduction=Reduction.parse("reduction", call.reduction),
                    numel=numel, shard=call.shard, **elementwise)
    inputs = GRPOInputs(sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output=ref_model_output,
                        ref_cond=ref_cond, old_prev_sample_mean=call.old_prev_sample_mean, rollout_is_weights=weights,
                        kl_coef=kl_per_sample)
    ops = _dispatch.select(call.backend, *(t for t in (sample, model_output, prev_sample, ref_model_output,
                                                       call.old_prev_sample_mean, ref_cond) if t is not None))
    spec = GRPOLossSpec(variant, step, trust=trust, seed=seed, clip=clip, kl_coef=kl_coef, kl_space=kl_space,
                        kl_threshold=call.kl_threshold, ref_scale=ref_scale, backend=ops.name)
    return spec, inputs


__all__ = ["GRPOCall", "validate"]
