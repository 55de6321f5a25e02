"""The step ops as ``torch.library`` custom ops, so ``torch.compile`` traces a training step through them
with no graph break (docs/compile.md).

``flowrl.ops.functional`` validates its arguments and builds the ``StepSpec`` as in eager mode; while
``torch.compile`` traces (``torch.compiler.is_compiling()``), it hands the spec and the tensors to the
ops here instead of calling the backend directly. Each op is registered once:

- ``flowrl::sde_step``, ``flowrl::step_log_prob``, ``flowrl::step_kl``: the forward, taking the tensors,
  the spec flattened to what a custom-op schema holds (``pack_spec``: its tensors as ``Tensor?[]``, its
  switches as ``int[]``, the noise level, ddim's clip range, the rollout's out dtype) and the backend's
  name. Its implementation rebuilds the spec (``unpack_spec``) and runs that backend's op, the same code as
  eager mode, so the values are eager's bit for bit: the op is opaque to the compiler (Inductor does not
  re-derive the math).
- ``flowrl::<op>_backward``: the registered autograd formula. It replays the backend's op under
  autograd on the saved inputs and returns ``torch.autograd.grad`` of the outputs: the backend's own
  backward (the reference's autograd, or the Triton backward kernels), so the gradients are eager's bit
  for bit; the price is one more forward pass in the backward.
- Fake (meta) implementations give each output's shape and dtype, for tracing without data.

An empty batch (B = 0) runs no op, eagerly or traced: ``sde_step`` / ``step_value`` return ``on_empty`` of
the op's fake outputs (zeros of the right shapes and dtypes on the inputs' graph; docs/guide.md, An empty
batch).

Not routed (they run as in eager mode and ``torch.compile`` traces or breaks on them): sequence
parallelism (``shard``: its gather is a collective callable, not a schema value) and the noise draw from a
``torch.Generator`` (done by ``flowrl.ops.functional`` before the op; docs/compile.md).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..backends import _dispatch
from ..contract import LogProbKind, Mode, NoiseSource, Op, Prediction, Reduction
from ..core._validate import NoiseSeed
from ..core.step_spec import StepSpec

_SPEC_TENSORS = ("sigmas", "step_index", "token_sigmas", "token_sigmas_next", "frozen")


def traced(spec: Optional[StepSpec] = None) -> bool:
    """True when a call should go through the custom ops: ``torch.compile`` is tracing it (and it is not
    a sequence-parallel shard)."""
    return torch.compiler.is_compiling() and (spec is None or spec.shard is None)


def pack_seed(seed: Optional[NoiseSeed]):
    """A ``NoiseSeed`` as (seeds or None, [stream_stride, elem_offset])."""
    if seed is None:
        return None, [0, 0]
    return seed.seeds, [int(seed.stream_stride), int(seed.elem_offset)]


def unpack_seed(seeds: Optional[torch.Tensor], ints: Sequence[int]) -> Optional[NoiseSeed]:
    return None if seeds is None else NoiseSeed(seeds, int(ints[0]), int(ints[1]))


def pack_spec(spec: StepSpec):
    """The spec as schema values: (tensors [sigmas, step_index, token_sigmas, token_sigmas_next, frozen,
    seeds], ints [op, mode, kind, reduction, numel, noise_source, return_mean, prediction, stream_stride,
    elem_offset], noise_level, clip_sample_range, out_dtype)."""
    seeds, seed_ints = pack_seed(spec.noise_seed)
    tensors = [getattr(spec, name) for name in _SPEC_TENSORS] + [seeds]
    ints = [int(spec.op), int(spec.mode), int(spec.kind), int(spec.reduction), int(spec.numel),
            int(spec.noise_source), int(bool(spec.return_mean)), int(spec.prediction)] + seed_ints
    return tensors, ints, float(spec.noise_level), spec.clip_sample_range, spec.out_dtype


def unpack_spec(tensors: Sequence[Optional[torch.Tensor]], ints: Sequence[int], noise_level: float,
            clip_sample_range: Optional[float], out_dtype: Optional[torch.dtype]) -> StepSpec:
    sigmas, step_index, token_sigmas, token_sigmas_next, frozen, seeds = tensors
    op, mode, kind, reduction, numel, source, return_mean, prediction = ints[:8]
    return StepSpec(op=Op(op), sigmas=sigmas, step_index=step_index, mode=Mode(mode), noise_level=noise_level,
                    kind=LogProbKind(kind), reduction=Reduction(reduction), numel=numel, out_dtype=out_dtype,
                    noise_source=NoiseSource(source),
                    noise_seed=unpack_seed(seeds, ints[8:10]), return_mean=bool(return_mean),
                    prediction=Prediction(prediction), clip_sample_range=clip_sample_range, token_sigmas=token_sigmas,
                    token_sigmas_next=token_sigmas_next, frozen=frozen)


def _second(prev_x0_pred) -> dict:
    return {} if prev_x0_pred is None else {"prev_x0_pred": prev_x0_pred}


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder of an output (or a gradient) that is None in eager mode: an empty tensor (a
    custom op returns tensors only)."""
    return like.new_empty((0,))


def fresh(outputs: List[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """A custom op's outputs may not alias its inputs or each other: copy the ones that do (a copy keeps
    the bits)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    out = []
    for t in outputs:
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


def grads_by_replay(forward, inputs: Sequence[Optional[torch.Tensor]], needs: Sequence[bool],
                    grad_outputs: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """d outputs / d inputs (where ``needs``) of ``forward(*inputs)`` under autograd, as eager mode's
    autograd computes them; one not needed comes back as ``absent``. A custom op's implementation runs with
    autograd's dispatch keys excluded: the replay switches them back on. A needed gradient that eager
    mode leaves None (the input does not reach the outputs, e.g. step_kl's sample) comes back as zeros:
    the fake implementation cannot know it is unused."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False), torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(bool(need) and t.is_floating_point())
                  for t, need in zip(inputs, needs)]
        outputs = forward(*leaves)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if o is not None and g is not None and g.numel() and o.requires_grad]
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                     if pairs and wrt else [None] * len(wrt))
    out = []
    for t in leaves:
        if t is None or not t.requires_grad:
            out.append(absent(inputs[0]))
        else:
            g = next(grads)
            out.append(torch.zeros_like(t) if g is None else g)
    return out


def list_grad(tensors: Sequence[Optional[torch.Tensor]]):
    """The (None) gradient of a ``Tensor?[]`` input in the structure torch.library checks: one None for a
    list holding a None (flattened as one leaf), else a list of Nones of its length."""
    return None if any(t is None for t in tensors) else [None] * len(tensors)


def _none_if_absent(t: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t.numel() == 0 else t


def is_empty(sample) -> bool:
    """True for an empty batch (B = 0): ``sample`` a validated tensor [0, ...] (or a joint step's tuple of
    them, whose streams share one batch size). Under ``torch.compile`` a batch size of 0 is always a
    specialised (static) size, so this is a guard, not a graph break."""
    if isinstance(sample, (tuple, list)):
        return len(sample) > 0 and is_empty(sample[0])
    return isinstance(sample, torch.Tensor) and sample.dim() >= 1 and sample.shape[0] == 0


def on_empty(fields: Sequence[torch.Tensor], graph: Sequence[Optional[torch.Tensor]],
             differentiable: int = 1) -> List[torch.Tensor]:
    """The outputs of an op or a loss on an empty batch (B = 0), where nothing is launched: ``fields`` (the
    outputs of its fake implementation, which gives every shape and dtype) as zeros, the first
    ``differentiable`` of them (the loss, or the op's differentiable values) on the graph of each tensor of
    ``graph`` that requires grad: plus ``t.sum() * 0``, an exact zero that ``backward()`` reaches, so each
    such input gets a zero (for [0, ...] inputs: empty) gradient and every parameter behind it a zero one
    (DDP's reducer waits for every parameter's gradient). No NaN: nothing is averaged over zero samples."""
    out = [f.new_zeros(f.shape) for f in fields]
    link = None
    for t in graph:
        if t is not None and t.requires_grad:
            term = t.sum() * 0
            link = term if link is None else link + term
    if link is not None:
        for k in range(differentiable):
            out[k] = out[k] + link.to(out[k].dtype)
    return out


# -------------------------------------------------------------------------------------- sde_step


def _sde_step_eager(backend, spec, sample, model_output, noise, prev_x0_pred):
    prev, lp, mean, std, count = _dispatch.backend(backend).sde_step(spec, sample, model_output, noise,
                                                                     **_second(prev_x0_pred))
    return [prev, lp, absent(lp) if mean is None else mean, std, count]


@torch.library.custom_op("flowrl::sde_step", mutates_args=())
def _sde_step_op(sample: torch.Tensor, model_output: torch.Tensor, noise: Optional[torch.Tensor],
                 prev_x0_pred: Optional[torch.Tensor], spec_tensors: List[Optional[torch.Tensor]],
                 spec_ints: List[int], noise_level: float, clip_sample_range: Optional[float],
                 out_dtype: Optional[torch.dtype], backend: str) -> List[torch.Tensor]:
    spec = unpack_spec(spec_tensors, spec_ints, noise_level, clip_sample_range, out_dtype)
    with torch.no_grad():
        out = _sde_step_eager(backend, spec, sample, model_output, noise, prev_x0_pred)
    return fresh(out, [sample, model_output, noise, prev_x0_pred, *spec_tensors])


def _compute_dtype(backend: str, *tensors) -> torch.dtype:
    if backend == "torch" and any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


@_sde_step_op.register_fake
def _sde_step_fake(sample, model_output, noise, prev_x0_pred, spec_tensors, spec_ints, noise_level,
                   clip_sample_range, out_dtype, backend):
    b = sample.shape[0]
    dtype = _compute_dtype(backend, sample, model_output, noise)
    std_dtype = dtype if backend == "torch" else torch.float32
    mean = sample.new_empty(sample.shape, dtype=dtype) if spec_ints[6] else sample.new_empty((0,), dtype=dtype)
    return [sample.new_empty(sample.shape, dtype=out_dtype), sample.new_empty((b,), dtype=dtype), mean,
            sample.new_empty((b,), dtype=std_dtype), sample.new_empty((b,), dtype=torch.float32)]


@torch.library.custom_op("flowrl::sde_step_backward", mutates_args=())
def _sde_step_backward_op(grads: List[Optional[torch.Tensor]], sample: torch.Tensor, model_output: torch.Tensor,
                          noise: Optional[torch.Tensor], prev_x0_pred: Optional[torch.Tensor],
                          spec_tensors: List[Optional[torch.Tensor]], spec_ints: List[int], noise_level: float,
                          clip_sample_range: Optional[float], out_dtype: Optional[torch.dtype], backend: str,
                          needs: List[bool]) -> List[torch.Tensor]:
    spec = unpack_spec(spec_tensors, spec_ints, noise_level, clip_sample_range, out_dtype)

    def forward(x, v, eps, x0):
        prev, lp, mean, _, _ = _sde_step_eager(backend, spec, x, v, eps, x0)
        return prev, lp, _none_if_absent(mean)

    return grads_by_replay(forward, [sample, model_output, noise, prev_x0_pred], needs, grads[:3])


@_sde_step_backward_op.register_fake
def _(grads, sample, model_output, noise, prev_x0_pred, spec_tensors, spec_ints, noise_level, clip_sample_range,
      out_dtype, backend, needs):
    return [t.new_empty(t.shape) if t is not None and need else sample.new_empty((0,))
            for t, need in zip((sample, model_output, noise, prev_x0_pred), needs)]


def _sde_step_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], *inputs[4])
    ctx.n_spec = len(inputs[4])
    ctx.scalars = inputs[5:]
    ctx.mark_non_differentiable(output[3], output[4])


def _sde_step_backward(ctx, grads):
    saved = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    g = _sde_step_backward_op([None if t is None else t for t in grads[:3]], *saved[:4], list(saved[4:]),
                              *ctx.scalars, needs)
    g = [None if not need or t.numel() == 0 else t for t, need in zip(g, needs)]
    return (*g, list_grad(saved[4:]), None, None, None, None, None)


_sde_step_op.register_autograd(_sde_step_backward, setup_context=_sde_step_setup)


def sde_step(ops, spec: StepSpec, sample, model_output, noise, prev_x0_pred=None):
    """``ops.sde_step`` (eager), or ``flowrl::sde_step`` while ``torch.compile`` traces; on an empty batch
    neither: ``on_empty`` of the op's fake outputs (prev_sample, log_prob and the mean on the inputs' graph)."""
    empty = is_empty(sample)
    if not traced(spec) and not empty:
        return ops.sde_step(spec, sample, model_output, noise, **_second(prev_x0_pred))
    tensors, ints, eta, clip, out_dtype = pack_spec(spec)
    args = (sample, model_output, noise, prev_x0_pred, tensors, ints, eta, clip, out_dtype, ops.name)
    if empty:
        prev, lp, mean, std, count = on_empty(_sde_step_fake(*args), args[:4], 3)
    else:
        prev, lp, mean, std, count = _sde_step_op(*args)
    return prev, lp, (mean if spec.return_mean else None), std, count


# ------------------------------------------------------------------------- step_log_prob / step_kl


def _value_eager(backend, spec, sample, model_output, third, prev_x0_pred):
    ops = _dispatch.backend(backend)
    run = ops.step_kl if spec.op is Op.KL else ops.step_log_prob
    return list(run(spec, sample, model_output, third, **_second(prev_x0_pred)))


def _value_fake(sample, model_output, third, prev_x0_pred, spec_tensors, spec_ints, noise_level, clip_sample_range,
                backend):
    """flowrl::step_log_prob's and flowrl::step_kl's outputs: (value [B], count [B])."""
    b = sample.shape[0]
    dtype = _compute_dtype(backend, sample, model_output, third)
    return [sample.new_empty((b,), dtype=dtype), sample.new_empty((b,), dtype=torch.float32)]


def _define_value_op(name: str):
    """``flowrl::<name>`` (step_log_prob: third = prev_sample; step_kl: third = ref_model_output), its
    backward op, fake implementations and autograd registration."""

    def impl(sample: torch.Tensor, model_output: torch.Tensor, third: torch.Tensor,
             prev_x0_pred: Optional[torch.Tensor], spec_tensors: List[Optional[torch.Tensor]], spec_ints: List[int],
             noise_level: float, clip_sample_range: Optional[float], backend: str) -> List[torch.Tensor]:
        spec = unpack_spec(spec_tensors, spec_ints, noise_level, clip_sample_range, None)
        with torch.no_grad():
            out = _value_eager(backend, spec, sample, model_output, third, prev_x0_pred)
        return fresh(out, [sample, model_output, third, prev_x0_pred, *spec_tensors])

    op = torch.library.custom_op(f"flowrl::{name}", impl, mutates_args=())
    op.register_fake(_value_fake)

    def backward_impl(grad: torch.Tensor, sample: torch.Tensor, model_output: torch.Tensor, third: torch.Tensor,
                      prev_x0_pred: Optional[torch.Tensor], spec_tensors: List[Optional[torch.Tensor]],
                      spec_ints: List[int], noise_level: float, clip_sample_range: Optional[float], backend: str,
                      needs: List[bool]) -> List[torch.Tensor]:
        spec = unpack_spec(spec_tensors, spec_ints, noise_level, clip_sample_range, None)

        def forward(x, v, t, x0):
            return _value_eager(backend, spec, x, v, t, x0)[:1]

        return grads_by_replay(forward, [sample, model_output, third, prev_x0_pred], needs, [grad])

    backward_op = torch.library.custom_op(f"flowrl::{name}_backward", backward_impl, mutates_args=())

    @backward_op.register_fake
    def _(grad, sample, model_output, third, prev_x0_pred, spec_tensors, spec_ints, noise_level, clip_sample_range,
          backend, needs):
        return [t.new_empty(t.shape) if t is not None and need else sample.new_empty((0,))
                for t, need in zip((sample, model_output, third, prev_x0_pred), needs)]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:4], *inputs[4])
        ctx.scalars = inputs[5:]
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, grads):
        saved = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:4]]
        spec_grads = list_grad(saved[4:])
        if grads[0] is None or not any(needs):
            return None, None, None, None, spec_grads, None, None, None, None
        g = backward_op(grads[0], *saved[:4], list(saved[4:]), *ctx.scalars, needs)
        g = [None if not need or t.numel() == 0 else t for t, need in zip(g, needs)]
        return (*g, spec_grads, None, None, None, None)

    op.register_autograd(backward, setup_context=setup_context)
    return op


_step_log_prob_op = _define_value_op("step_log_prob")
_step_kl_op = _define_value_op("step_kl")


def step_value(ops, spec: StepSpec, sample, model_output, third, prev_x0_pred=None):
    """``ops.step_log_prob`` / ``ops.step_kl`` (by ``spec.op``) in eager mode, or ``flowrl::step_log_prob`` /
    ``flowrl::step_kl`` while ``torch.compile`` traces: (value [B], count [B]); on an empty batch neither:
    ``on_empty`` of the op's fake outputs (the value on the inputs' graph)."""
    empty = is_empty(sample)
    if not traced(spec) and not empty:
        run = ops.step_kl if spec.op is Op.KL else ops.step_log_prob
        return run(spec, sample, model_output, third, **_second(prev_x0_pred))
    tensors, ints, eta, clip, _ = pack_spec(spec)
    args = (sample, model_output, third, prev_x0_pred, tensors, ints, eta, clip, ops.name)
    if empty:
        value, count = on_empty(_value_fake(*args), args[:4])
        return value, count
    op = _step_kl_op if spec.op is Op.KL else _step_log_prob_op
    value, count = op(*args)
    return value, count


__all__ = ["traced", "sde_step", "step_value", "pack_spec", "unpack_spec", "pack_seed", "unpack_seed", "absent", "fresh",
           "grads_by_replay", "list_grad", "is_empty", "on_empty"]
