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

The other losses get one op each, built the same way by ``_loss_op``: ``flowrl::nft_loss``,
``flowrl::awm_log_prob``, ``flowrl::awm_loss`` (running ``flowrl.losses._flow``'s blocks) and
``flowrl::teacher_kl_loss`` (running ``flowrl.losses._teacher.teacher_kl``: step_kl and the batch mean in
one op, so the mean is eager's too), ``flowrl::dpo_loss`` and ``flowrl::dgpo_loss`` (running
``flowrl.losses._preference``'s blocks; DGPO's group ids are read inside the op, so the trace has no sync).

An empty batch (B = 0), in eager mode as under ``torch.compile``: the losses call the wrappers here after
their checks, and the wrappers (``_call``) run no op: each op's fake implementation gives the outputs'
shapes and dtypes, filled with zeros, the loss on model_output's graph (docs/guide.md, An empty batch).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from ..backends import _dispatch
from ..contract import KLSpace, TrustSource
from ..core._validate import no_value_checks
from ..core.loss_spec import GRPOInputs, GRPOLossSpec, Variant
from ..ops import _custom_ops as op_support
from ._flow import NFTLossOutput, awm_from_args, awm_log_prob_from_args, nft_from_args
from ._policy import GRPOLossOutput, grpo_from_spec
from ._preference import (DGPOInputs, DGPOLossOutput, DGPOOptions, DPOLossOutput, dgpo_from_args, dgpo_references,
                          dpo_from_args)
from ._teacher import teacher_kl

_FIELDS = 14  # GRPOLossOutput's


def _present(variant: int, has_ref: bool, trust: int) -> List[bool]:
    """Which of GRPOLossOutput's fields the variant computes (the rest are None)."""
    dppo = variant == int(Variant.DPPO)
    return [True, True, True, True, has_ref, trust != int(TrustSource.NONE), not dppo, not dppo, not dppo, dppo,
            True, True, True, True]


# GRPOInputs' tensors but model_output (the op's first, differentiable argument), then the rollout's seeds
_TENSORS = tuple(name for name in GRPOInputs._fields if name != "model_output")
_STEP_INTS = 10  # pack_spec's


def _float(x: Optional[float]) -> float:
    return math.nan if x is None else float(x)  # None travels as NaN: no option it stands for can be NaN


def _optional(x: float) -> Optional[float]:
    return None if math.isnan(x) else x


def pack_loss(spec: GRPOLossSpec, inputs: GRPOInputs):
    """The loss as schema values: (model_output, tensors [GRPOInputs' others, seeds], the step's tensors,
    ints [the step's, seed stride and offset, variant, trust, kl_space], floats [noise_level, clip_low,
    clip_high, kl_coef, kl_threshold, ref_scale], the backend's name)."""
    step_tensors, step_ints, eta, _, _ = op_support.pack_spec(spec.step)
    seeds, seed_ints = op_support.pack_seed(spec.seed)
    clip = spec.clip if spec.clip is not None else (None, None)
    ints = [*step_ints, *seed_ints, int(spec.variant), int(spec.trust), int(spec.kl_space)]
    floats = [float(eta), *map(_float, (*clip, spec.kl_coef, spec.kl_threshold, spec.ref_scale))]
    tensors = [getattr(inputs, name) for name in _TENSORS] + [seeds]
    return inputs.model_output, tensors, step_tensors, ints, floats, spec.backend


def unpack_loss(model_output, tensors, step_tensors, ints, floats, backend):
    """``pack_loss``'s values back: (GRPOLossSpec, GRPOInputs)."""
    step = op_support.unpack_spec(step_tensors, ints[:_STEP_INTS], floats[0], None, None)
    seed = op_support.unpack_seed(tensors[-1], ints[_STEP_INTS:_STEP_INTS + 2])
    variant, trust, kl_space = ints[_STEP_INTS + 2:_STEP_INTS + 5]
    clip_low, clip_high, kl_coef, kl_threshold, ref_scale = map(_optional, floats[1:])
    spec = GRPOLossSpec(Variant(variant), step, trust=TrustSource(trust), seed=seed,
                        clip=None if clip_low is None else (clip_low, clip_high), kl_coef=kl_coef,
                        kl_space=KLSpace(kl_space), kl_threshold=kl_threshold, ref_scale=ref_scale, backend=backend)
    return spec, GRPOInputs(model_output=model_output, **dict(zip(_TENSORS, tensors[:-1])))


@torch.library.custom_op("flowrl::grpo_family_loss", mutates_args=())
def _grpo_op(model_output: torch.Tensor, tensors: List[Optional[torch.Tensor]],
             step_tensors: List[Optional[torch.Tensor]], ints: List[int], floats: List[float],
             backend: str) -> List[torch.Tensor]:
    with torch.no_grad():
        out = grpo_from_spec(*unpack_loss(model_output, tensors, step_tensors, ints, floats, backend))
    fields = [op_support.absent(out.log_prob) if t is None else t for t in out]
    return op_support.fresh(fields, [model_output, *tensors, *step_tensors])


@_grpo_op.register_fake
def _grpo_fake(model_output, tensors, step_tensors, ints, floats, backend):
    spec, inputs = unpack_loss(model_output, tensors, step_tensors, ints, floats, backend)
    wide = backend == "torch" and any(t.dtype == torch.float64
                                      for t in (inputs.sample, model_output, inputs.prev_sample))
    dtype = torch.float64 if wide else torch.float32
    return _fake(inputs.sample, dtype, _present(int(spec.variant), inputs.ref_model_output is not None,
                                                int(spec.trust)))


def _fake(sample, dtype, present):
    """GRPOLossOutput's fields as fake tensors (``dtype`` the log-prob's; ``present``: which are not None)."""
    b = sample.shape[0]
    shapes = [(), (), (b,), (b,), (b,), (b,), (), (), (), (), (), (), (), ()]
    dtypes = [dtype] * 6 + [torch.float32] * 4 + [dtype] * 4  # the fractions are bool means: float32
    # an absent field is ``absent(log_prob)``: empty, in the log-prob's dtype
    return [sample.new_empty(shape, dtype=d) if p else sample.new_empty((0,), dtype=dtype)
            for shape, d, p in zip(shapes, dtypes, present)]


@torch.library.custom_op("flowrl::grpo_family_loss_backward", mutates_args=())
def _grpo_backward_op(grad_loss: torch.Tensor, model_output: torch.Tensor, tensors: List[Optional[torch.Tensor]],
                      step_tensors: List[Optional[torch.Tensor]], ints: List[int], floats: List[float],
                      backend: str) -> torch.Tensor:
    def forward(v):
        return (grpo_from_spec(*unpack_loss(v, tensors, step_tensors, ints, floats, backend)).loss,)

    return op_support.grads_by_replay(forward, [model_output], [True], [grad_loss])[0]


@_grpo_backward_op.register_fake
def _(grad_loss, model_output, *rest):
    return torch.empty_like(model_output)


def _setup(ctx, inputs, output):
    model_output, tensors, step_tensors, ints, floats, backend = inputs
    ctx.save_for_backward(model_output, *tensors, *step_tensors)
    ctx.counts = (len(tensors), len(step_tensors))
    ctx.scalars = (ints, floats, backend)
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grads):
    model_output, *saved = ctx.saved_tensors
    n = ctx.counts[0]
    tensors, step_tensors = saved[:n], saved[n:]
    none = (None, op_support.list_grad(tensors), op_support.list_grad(step_tensors), None, None, None)
    if grads[0] is None or not ctx.needs_input_grad[0]:
        return none
    grad_v = _grpo_backward_op(grads[0], model_output, list(tensors), list(step_tensors), *ctx.scalars)
    return (grad_v,) + none[1:]


_grpo_op.register_autograd(_backward, setup_context=_setup)


def _call(op, fake, v_index: int, *args) -> List[torch.Tensor]:
    """``op(*args)``, or on an empty batch (B = 0: ``args[v_index]``, model_output, holds no sample) no op and
    no kernel: ``fake``'s outputs as zeros, the loss on model_output's graph (``flowrl.ops._custom_ops.
    on_empty``). The losses send an empty batch here in eager mode too, after their checks."""
    if op_support.is_empty(args[v_index]):
        return op_support.on_empty(fake(*args), [args[v_index]])
    return op(*args)


def empty_joint(out, model_outputs):
    """A joint step's output on an empty batch: stream 0's (``out``, a loss output or awm_log_prob's [0])
    with its first field on the graph of every stream's model_output."""
    if isinstance(out, torch.Tensor):
        return op_support.on_empty([out], model_outputs)[0]
    return out._replace(**{out._fields[0]: op_support.on_empty([out[0]], model_outputs)[0]})


def grpo_family_loss(spec: GRPOLossSpec, inputs: GRPOInputs) -> GRPOLossOutput:
    """``grpo_from_spec(spec, inputs)``'s GRPOLossOutput through ``flowrl::grpo_family_loss``."""
    out = _call(_grpo_op, _grpo_fake, 0, *pack_loss(spec, inputs))
    present = _present(int(spec.variant), inputs.ref_model_output is not None, int(spec.trust))
    return GRPOLossOutput(*(t if p else None for t, p in zip(out, present)))


# ------------------------------------------------ nft_loss, awm_log_prob, awm_loss, teacher_kl_loss
#
# One op each, defined by ``_loss_op`` from its schema and ``run`` (the eager block: ``flowrl.losses._flow``,
# ``flowrl.losses._teacher``) returning a list of tensors whose first is the differentiable one;
# ``flowrl::<name>_backward`` replays ``run`` under autograd for d out[0] / d model_output.


def _loss_op(name: str, schema: str, run, fake, v_index: int):
    """``flowrl::<name>`` (``schema``: its arguments) running ``run(*args)`` with no grad, its backward op
    (``Tensor grad`` first, then the same arguments), the fake implementation ``fake`` and the autograd
    registration. Only ``args[v_index]`` (model_output) gets a gradient, of the first output."""

    def impl(*args):
        with torch.no_grad():
            out = run(*args)
        return op_support.fresh(out, [a for a in args if isinstance(a, torch.Tensor)])

    op = torch.library.custom_op(f"flowrl::{name}", impl, mutates_args=(), schema=f"({schema}) -> Tensor[]")
    op.register_fake(fake)

    def backward_impl(grad, *args):
        def forward(v):
            return run(*args[:v_index], v, *args[v_index + 1:])[:1]

        return op_support.grads_by_replay(forward, [args[v_index]], [True], [grad])[0]

    backward_op = torch.library.custom_op(f"flowrl::{name}_backward", backward_impl, mutates_args=(),
                                          schema=f"(Tensor grad, {schema}) -> Tensor")
    backward_op.register_fake(lambda grad, *args: torch.empty_like(args[v_index]))

    def setup(ctx, inputs, output):
        tensors = [k for k, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(inputs[k] for k in tensors))
        ctx.tensor_positions = tensors
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.mark_non_differentiable(*output[1:])

    def backward(ctx, grads):
        # a Tensor?[] argument's (None) gradient in the structure torch.library checks
        out = [op_support.list_grad(a) if isinstance(a, list) and any(isinstance(t, torch.Tensor) for t in a)
               else None for a in ctx.others]
        if grads[0] is None or not ctx.needs_input_grad[v_index]:
            return tuple(out)
        args = list(ctx.others)
        for k, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[k] = t
        out[v_index] = backward_op(grads[0], *args)
        return tuple(out)

    op.register_autograd(backward, setup_context=setup)
    return op


def _or_absent(fields, like):
    return [op_support.absent(like) if t is None else t for t in fields]


def _dtype(backend, *tensors):
    """The dtype of the backend's per-sample values: float64 on the torch backend given float64."""
    wide = backend == "torch" and any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


# flowrl::nft_loss -> [loss, policy_loss, per_sample_loss, positive_loss, negative_loss, kl (empty: None)]


def _nft_run(xt, v, old, x0, ref, t, adv, beta, adv_clip_max, kl_coef, backend):
    out = nft_from_args(_dispatch.backend(backend), xt, v, old, x0, ref, t, adv, beta, adv_clip_max, kl_coef)
    return _or_absent(out, out.per_sample_loss)


def _nft_fake(xt, v, old, x0, ref, t, adv, beta, adv_clip_max, kl_coef, backend):
    b, dtype = xt.shape[0], _dtype(backend, xt, v, old, x0, ref)
    shapes = [(), (), (b,), (b,), (b,), (b,) if ref is not None else (0,)]
    return [xt.new_empty(shape, dtype=dtype) for shape in shapes]


_nft_op = _loss_op("nft_loss", "Tensor noised_sample, Tensor model_output, Tensor old_model_output, "
                   "Tensor clean_sample, Tensor? ref_model_output, Tensor sigma, Tensor advantages, float beta, "
                   "float adv_clip_max, float kl_coef, str backend", _nft_run, _nft_fake, 1)


def nft_loss(ops, xt, v, old, x0, ref, t, adv, beta, adv_clip_max, kl_coef) -> NFTLossOutput:
    """``nft_from_args``' NFTLossOutput through ``flowrl::nft_loss`` (same arguments)."""
    out = _call(_nft_op, _nft_fake, 1, xt, v, old, x0, ref, t, adv, float(beta), float(adv_clip_max), float(kl_coef),
                ops.name)
    return NFTLossOutput(*out[:5], out[5] if ref is not None else None)


# flowrl::awm_log_prob -> [log_prob]


def _awm_lp_run(v, noise, x0, t, weighting, p, backend):
    return [awm_log_prob_from_args(_dispatch.backend(backend), v, noise, x0, t, weighting, p)]


def _awm_lp_fake(v, noise, x0, t, weighting, p, backend):
    return [v.new_empty((v.shape[0],), dtype=_dtype(backend, v, noise, x0))]


_AWM_SCHEMA = "Tensor model_output, Tensor noise, Tensor clean_sample, Tensor sigma, str weighting, float ghuber_power"
_awm_lp_op = _loss_op("awm_log_prob", f"{_AWM_SCHEMA}, str backend", _awm_lp_run, _awm_lp_fake, 0)


def awm_log_prob(ops, v, noise, x0, t, weighting, p) -> torch.Tensor:
    """``awm_log_prob_from_args`` through ``flowrl::awm_log_prob`` (same arguments)."""
    return _call(_awm_lp_op, _awm_lp_fake, 0, v, noise, x0, t, weighting, float(p), ops.name)[0]


# flowrl::awm_loss -> GRPOLossOutput's 14 fields (empty: None), as flowrl::grpo_family_loss's GRPO variant


def _awm_run(v, noise, x0, t, weighting, p, old_lp, adv, is_weights, clip_low, clip_high, backend):
    out = awm_from_args(_dispatch.backend(backend), v, noise, x0, t, weighting, p, old_lp, adv, (clip_low, clip_high),
                        is_weights)
    return _or_absent(out, out.log_prob)


def _awm_fake(v, noise, x0, t, weighting, p, old_lp, adv, is_weights, clip_low, clip_high, backend):
    return _fake(v, _dtype(backend, v, noise, x0), _present(int(Variant.GRPO), False, int(TrustSource.NONE)))


_awm_op = _loss_op("awm_loss", f"{_AWM_SCHEMA}, Tensor old_log_prob, Tensor advantages, "
                   "Tensor? rollout_is_weights, float clip_low, float clip_high, str backend", _awm_run, _awm_fake, 0)


def awm_loss(ops, v, noise, x0, t, weighting, p, old_lp, adv, clip, is_weights) -> GRPOLossOutput:
    """``awm_from_args``' GRPOLossOutput through ``flowrl::awm_loss`` (same arguments)."""
    out = _call(_awm_op, _awm_fake, 0, v, noise, x0, t, weighting, float(p), old_lp, adv, is_weights, float(clip[0]),
                float(clip[1]), ops.name)
    present = _present(int(Variant.GRPO), False, int(TrustSource.NONE))
    return GRPOLossOutput(*(f if k else None for f, k in zip(out, present)))


# flowrl::teacher_kl_loss -> [loss, kl]; step_index an int (step_index_tensor None) or a tensor


def _teacher_run(x, v, teacher, sigmas, idx_tensor, idx_int, mode, noise_level, reduction, backend):
    idx = idx_int if idx_tensor is None else idx_tensor
    with no_value_checks():  # skipped under compile (docs/compile.md): the op must not read sigmas' values
        return list(teacher_kl(x, v, teacher, sigmas, idx, mode, noise_level, reduction, backend))


def _teacher_fake(x, v, teacher, sigmas, idx_tensor, idx_int, mode, noise_level, reduction, backend):
    dtype = _dtype(backend, x, v, teacher)
    return [x.new_empty((), dtype=dtype), x.new_empty((x.shape[0],), dtype=dtype)]


_teacher_op = _loss_op("teacher_kl_loss", "Tensor sample, Tensor model_output, Tensor teacher_model_output, "
                       "Tensor sigmas, Tensor? step_index_tensor, int step_index, str mode, float noise_level, "
                       "str reduction, str backend", _teacher_run, _teacher_fake, 1)


def teacher_kl_loss(sample, model_output, teacher, sigmas, step_index, mode, noise_level, reduction, backend):
    """``teacher_kl``'s (loss, kl) through ``flowrl::teacher_kl_loss`` (same arguments; the backend resolved
    here, as eager mode resolves it)."""
    name = _dispatch.select(backend, sample, model_output, teacher).name
    tensor = step_index if isinstance(step_index, torch.Tensor) else None
    loss, kl = _call(_teacher_op, _teacher_fake, 1, sample, model_output, teacher, sigmas, tensor,
                     0 if tensor is not None else step_index, mode, float(noise_level), reduction, name)
    return loss, kl


# flowrl::dpo_loss -> DPOLossOutput's 8 fields


def _seed(seeds, *layout):
    """A resolved noise seed (flowrl.losses._preference) from the ops' seeds and ints (stride, offset,
    div, mod)."""
    return None if seeds is None else (seeds, *layout)


_SEED_SCHEMA = "Tensor? noise_seeds, int noise_stride, int noise_offset, int noise_div, int noise_mod"


def _dpo_run(v, ref, noise, x0, beta, pair_layout, backend, seeds, *layout):
    return list(dpo_from_args(backend, v, ref, noise, x0, beta, pair_layout, noise_seed=_seed(seeds, *layout)))


def _dpo_fake(v, ref, noise, x0, beta, pair_layout, backend, seeds, *layout):
    b, dtype = v.shape[0], _dtype(backend, v, ref, noise, x0)
    p = b // 2
    shapes = [(), (p,), (), (p,), (p,), (), (b,), (b,)]
    return [v.new_empty(shape, dtype=torch.float32 if k == 2 else dtype) for k, shape in enumerate(shapes)]


_dpo_op = _loss_op("dpo_loss", "Tensor model_output, Tensor ref_model_output, Tensor? noise, Tensor clean_sample, "
                   "float beta, str pair_layout, str backend, " + _SEED_SCHEMA, _dpo_run, _dpo_fake, 0)


def _seed_args(noise_seed):
    return (None, 0, 0, 1, 1) if noise_seed is None else (noise_seed[0], *(int(k) for k in noise_seed[1:]))


def dpo_loss(backend, v, ref, noise, x0, beta, pair_layout, noise_seed=None) -> DPOLossOutput:
    """``dpo_from_args``' DPOLossOutput through ``flowrl::dpo_loss`` (same arguments; ``backend`` the resolved
    backend's name; ``noise_seed`` resolved, as ``dpo_from_args``')."""
    return DPOLossOutput(*_call(_dpo_op, _dpo_fake, 0, v, ref, noise, x0, float(beta), pair_layout, backend,
                                *_seed_args(noise_seed)))


# flowrl::dgpo_loss -> DGPOLossOutput's 8 fields (empty: None); clip (eps_low, eps_high) or None


# flowrl::dgpo_loss carries DGPOInputs but model_output as ``tensors`` and DGPOOptions as ``floats`` [beta,
# clip_low, clip_high, kl_coef] (a None clip as NaN) and ``ints`` [group_size (0: None), clip_dsm, clip_kl,
# ema_reference]
_DGPO_TENSORS = DGPOInputs._fields[1:]


def _dgpo_unpack(v, tensors, floats, ints):
    beta, clip_low, clip_high, kl_coef = floats
    group_size, clip_dsm, clip_kl, ema_reference = ints
    options = DGPOOptions(beta, group_size=group_size or None,
                          clip=None if math.isnan(clip_low) else (clip_low, clip_high), clip_dsm=bool(clip_dsm),
                          clip_kl=bool(clip_kl), ema_reference=bool(ema_reference), kl_coef=kl_coef)
    return DGPOInputs(v, **dict(zip(_DGPO_TENSORS, tensors))), options


def _dgpo_run(v, tensors, floats, ints, backend, seeds, *layout):
    inputs, options = _dgpo_unpack(v, tensors, floats, ints)
    out = dgpo_from_args(backend, inputs, options, noise_seed=_seed(seeds, *layout))
    return _or_absent(out, out.dsm)


def _dgpo_fake(v, tensors, floats, ints, backend, seeds, *layout):
    inputs, options = _dgpo_unpack(v, tensors, floats, ints)
    clipped = options.clip is not None
    first, second = dgpo_references(inputs.ref_model_output, inputs.old_model_output, options.clip,
                                    options.ema_reference)
    b, dtype = v.shape[0], _dtype(backend, first, v, inputs.noise, inputs.clean_sample, second)  # what the sums read
    shapes = [(), (), (b,), (b,), (b,), (b,) if inputs.ref_model_output is not None else (0,),
              (b,) if clipped else (0,), () if clipped else (0,)]
    dtypes = [dtype] * 7 + [torch.float32 if clipped else dtype]  # clip_fraction is a bool mean
    return [v.new_empty(shape, dtype=d) for shape, d in zip(shapes, dtypes)]


_dgpo_op = _loss_op("dgpo_loss", "Tensor model_output, Tensor?[] tensors, float[] floats, int[] ints, str backend, "
                    + _SEED_SCHEMA, _dgpo_run, _dgpo_fake, 0)


def dgpo_loss(backend, inputs: DGPOInputs, options: DGPOOptions, noise_seed=None) -> DGPOLossOutput:
    """``dgpo_from_args``' DGPOLossOutput through ``flowrl::dgpo_loss`` (``backend`` the resolved backend's
    name; ``noise_seed`` resolved, as ``dgpo_from_args``')."""
    clip = options.clip if options.clip is not None else (math.nan, math.nan)
    floats = [float(options.beta), float(clip[0]), float(clip[1]), float(options.kl_coef)]
    ints = [options.group_size or 0, int(options.clip_dsm), int(options.clip_kl), int(options.ema_reference)]
    tensors = [getattr(inputs, name) for name in _DGPO_TENSORS]
    out = _call(_dgpo_op, _dgpo_fake, 0, inputs.model_output, tensors, floats, ints, backend,
                *_seed_args(noise_seed))
    clipped = options.clip is not None
    return DGPOLossOutput(*out[:5], out[5] if inputs.ref_model_output is not None else None,
                          out[6] if clipped else None, out[7] if clipped else None)


__all__ = ["grpo_family_loss", "nft_loss", "awm_log_prob", "awm_loss", "teacher_kl_loss", "dpo_loss", "dgpo_loss",
           "empty_joint"]
