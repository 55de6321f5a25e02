"""The GRPO family's loss (``grpo_loss``, ``grpo_guard_loss``, ``flow_dppo_loss``) as one ``torch.library``
custom op, ``flowrl::grpo_family_loss``, so ``torch.compile`` traces a training step through it with no
graph break (docs/compile.md); the step ops' machinery is ``flowrl.ops._custom_ops``.

``flowrl.losses._grpo_family`` validates the arguments and builds the spec as in eager mode; while
``torch.compile`` traces, it calls ``grpo_family_loss`` here instead of ``grpo_from_spec``. The op runs
``grpo_from_spec`` (the backend's values and the per-sample arithmetic, the same code as eager mode) and
returns every field of ``GRPOLossOutput`` (an empty tensor for a field the variant leaves None): the loss
and its statistics are eager's bit for bit, the per-sample arithmetic included (the op is opaque to
Inductor). Its backward replays ``grpo_from_spec`` under autograd (``flowrl.ops._custom_ops.grads_by_replay``):
d loss / d model_output as eager mode computes it, one forward pass more. Only ``loss`` is differentiable,
as in eager mode.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..backends import _dispatch
from ..contract import TrustSource
from ..ops import _custom_ops as C
from ._policy import GRPOLossOutput, Variant, grpo_from_spec

_FIELDS = 14  # GRPOLossOutput's


def _present(variant: int, has_ref: bool, trust: int) -> List[bool]:
    """Which of GRPOLossOutput's fields the variant computes (the rest are None)."""
    dppo = variant == int(Variant.DPPO)
    return [True, True, True, True, has_ref, trust != int(TrustSource.NONE), not dppo, not dppo, not dppo, dppo,
            True, True, True, True]


def _run(sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output, old_prev_sample_mean,
         spec_tensors, spec_ints, noise_level, seeds, seed_ints, variant, trust, clip_low, clip_high, kl_coef,
         kl_threshold, backend, rollout_is_weights):
    spec = C.unpack_spec(spec_tensors, spec_ints, noise_level, None, None)
    return grpo_from_spec(Variant(variant), _dispatch.backend(backend), spec, sample, model_output, prev_sample,
                          old_log_prob, advantages, ref_model_output, old_prev_sample_mean, TrustSource(trust),
                          C.unpack_seed(seeds, seed_ints), None if clip_low is None else (clip_low, clip_high), kl_coef,
                          kl_threshold, rollout_is_weights)


@torch.library.custom_op("flowrl::grpo_family_loss", mutates_args=())
def _grpo_op(sample: torch.Tensor, model_output: torch.Tensor, prev_sample: torch.Tensor, old_log_prob: torch.Tensor,
             advantages: torch.Tensor, ref_model_output: Optional[torch.Tensor],
             old_prev_sample_mean: Optional[torch.Tensor], spec_tensors: List[Optional[torch.Tensor]],
             spec_ints: List[int], noise_level: float, seeds: Optional[torch.Tensor], seed_ints: List[int], variant: int,
             trust: int, clip_low: Optional[float], clip_high: Optional[float], kl_coef: float,
             kl_threshold: Optional[float], backend: str,
             rollout_is_weights: Optional[torch.Tensor]) -> List[torch.Tensor]:
    with torch.no_grad():
        out = _run(sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output, old_prev_sample_mean,
                   spec_tensors, spec_ints, noise_level, seeds, seed_ints, variant, trust, clip_low, clip_high, kl_coef,
                   kl_threshold, backend, rollout_is_weights)
    fields = [C.absent(out.log_prob) if t is None else t for t in out]
    return C.fresh(fields, [sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output,
                            old_prev_sample_mean, seeds, rollout_is_weights, *spec_tensors])


@_grpo_op.register_fake
def _(sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output, old_prev_sample_mean, spec_tensors,
      spec_ints, noise_level, seeds, seed_ints, variant, trust, clip_low, clip_high, kl_coef, kl_threshold, backend,
      rollout_is_weights):
    b = sample.shape[0]
    wide = backend == "torch" and any(t.dtype == torch.float64 for t in (sample, model_output, prev_sample))
    dtype = torch.float64 if wide else torch.float32
    shapes = [(), (), (b,), (b,), (b,), (b,), (), (), (), (), (), (), (), ()]
    dtypes = [dtype] * 6 + [torch.float32] * 4 + [dtype] * 4  # the fractions are bool means: float32
    present = _present(variant, ref_model_output is not None, trust)
    # an absent field is ``absent(log_prob)``: empty, in the log-prob's dtype
    return [sample.new_empty(shape, dtype=d) if p else sample.new_empty((0,), dtype=dtype)
            for shape, d, p in zip(shapes, dtypes, present)]


@torch.library.custom_op("flowrl::grpo_family_loss_backward", mutates_args=())
def _grpo_backward_op(grad_loss: torch.Tensor, sample: torch.Tensor, model_output: torch.Tensor,
                      prev_sample: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      ref_model_output: Optional[torch.Tensor], old_prev_sample_mean: Optional[torch.Tensor],
                      spec_tensors: List[Optional[torch.Tensor]], spec_ints: List[int], noise_level: float,
                      seeds: Optional[torch.Tensor], seed_ints: List[int], variant: int, trust: int,
                      clip_low: Optional[float], clip_high: Optional[float],
                      kl_coef: float, kl_threshold: Optional[float], backend: str,
                      rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    def forward(v):
        return (_run(sample, v, prev_sample, old_log_prob, advantages, ref_model_output, old_prev_sample_mean,
                     spec_tensors, spec_ints, noise_level, seeds, seed_ints, variant, trust, clip_low, clip_high,
                     kl_coef, kl_threshold, backend, rollout_is_weights).loss,)

    return C.grads_by_replay(forward, [model_output], [True], [grad_loss])[0]


@_grpo_backward_op.register_fake
def _(grad_loss, sample, model_output, *rest):
    return torch.empty_like(model_output)


def _setup(ctx, inputs, output):
    # saved: the 7 tensors, seeds, rollout_is_weights, then the spec's tensors
    ctx.save_for_backward(*inputs[:7], inputs[10], inputs[19], *inputs[7])
    ctx.scalars = (inputs[8], inputs[9], inputs[11], *inputs[12:19])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    none = (None,) * 7 + (C.list_grad(saved[9:]),) + (None,) * 12
    if grads[0] is None or not ctx.needs_input_grad[1]:
        return none
    spec_ints, noise_level, seed_ints, *rest = ctx.scalars
    grad_v = _grpo_backward_op(grads[0], *saved[:7], list(saved[9:]), spec_ints, noise_level, saved[7], seed_ints,
                               *rest, saved[8])
    return (none[0], grad_v) + none[2:]


_grpo_op.register_autograd(_backward, setup_context=_setup)


def grpo_family_loss(variant, ops, spec, sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output,
                     old_prev_sample_mean, trust, seed, clip, kl_coef, kl_threshold, rollout_is_weights):
    """``grpo_from_spec``'s GRPOLossOutput through ``flowrl::grpo_family_loss`` (same arguments)."""
    tensors, ints, eta, _, _ = C.pack_spec(spec)
    seeds, seed_ints = C.pack_seed(seed)
    out = _grpo_op(sample, model_output, prev_sample, old_log_prob, advantages, ref_model_output, old_prev_sample_mean,
                   tensors, ints, eta, seeds, seed_ints, int(variant), int(trust), *(clip if clip else (None, None)),
                   float(kl_coef), kl_threshold, ops.name, rollout_is_weights)
    present = _present(int(variant), ref_model_output is not None, int(trust))
    return GRPOLossOutput(*(t if p else None for t, p in zip(out, present)))


__all__ = ["grpo_family_loss"]
