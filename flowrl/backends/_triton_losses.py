"""The Triton backend's half of flowrl.losses: launchers and autograd Functions (kernels in
flowrl/kernels/loss.py), reached through the backend table (``flowrl.backends._dispatch``).

The element passes use the step kernels' launch design (``flowrl.backends._triton_ops.launch_config``: the
same chunks per program and warps, every choice the same bits), the log-prob and KL partials are
finalized by the step ops' own finalize kernel (``flowrl.backends._triton_ops._finalize``: the log-prob is
``step_log_prob``'s bit for bit), and the forward-process sums are combined by the contract's
halving tree (``flowrl.backends.reference.combine_partials``). Only ``model_output`` gets a gradient; each
backward is one element pass that writes it directly.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from flowrl.backends._triton_ops import (
    WIDE_CONFIG, _KernelScalars, _finalize, _launch, _LAUNCH, _rows_shape, check_philox_range,
    division_magic, element_config, launch_config, optional_input,
)
from flowrl.contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, KLSpace, LogProbKind, Reduction
from flowrl.core.loss_spec import GRPOInputs, GRPOLossSpec
from flowrl.kernels.loss import flow_backward_kernel, flow_partials_kernel, grpo_backward_kernel, grpo_partials_kernel

from . import reference


from ._launch import REPLAY_BACKWARD_CONFIG  # noqa: E402 (the launch choices are _launch.py's)


def _grpo_launch_args(spec, ks, trust, seed, x):
    seeds, stream_stride, elem_offset = seed if seed is not None else (ks.step_index, 0, 0)
    philox = trust == 2  # TrustSource.REPLAY
    if philox:
        check_philox_range(elem_offset, _rows_shape(x)[1])
    aligned = philox and elem_offset % 4 == 0
    return (seeds, stream_stride, elem_offset), philox, aligned


def _blocks_magic(n_blocks: int) -> dict:
    """The loss kernels' sample index from their program id: n // n_blocks by ``division_magic``."""
    magic, shift = division_magic(n_blocks)
    return dict(blocks_magic=magic, blocks_shift=shift)


def _kl_args(ref, ref_cond, ref_scale, kl_space, like):
    """The KL switches' launch arguments: the reference's conditional branch (``like`` when not guided),
    its guidance scale, KL_SPACE, REF_GUIDED (kernels/loss.py)."""
    guided = ref is not None and ref_cond is not None
    return dict(ref_cond_ptr=ref_cond if guided else like, ref_scale=float(ref_scale) if guided else 0.0,
                KL_SPACE=int(kl_space), REF_GUIDED=guided)


def _elementwise_args(ks, backward=False):
    """The element kernels' per-token table, frozen mask and switches (PER_TOKEN, HAS_FROZEN, WEIGHTED),
    step_log_prob's (``_KernelScalars``); the backward also reads the scored count."""
    out = dict(**ks.elementwise, **ks.switches)
    if backward:
        out["count_ptr"] = ks.count if ks.count is not None else ks.sigmas
    return out


def _velocity_kl(spec, kl_p):
    """The velocity KL [B] from its chunk partials: the contract's halving tree over them (as
    flowrl.backends.reference_losses.velocity_kl), over the element count for ``reduction="mean"``."""
    total = reference.combine_partials(kl_p)
    return total / spec.numel if spec.reduction is Reduction.MEAN else total


def _grpo_forward(loss: GRPOLossSpec, ks, inputs: GRPOInputs):
    """The forward element pass and the finalize: (log_prob, kl, trust_divergence) [B] (contiguous inputs)."""
    spec, trust, seed, kl_space = loss.step, int(loss.trust), loss.seed, loss.kl_space
    x, v, prev, ref = inputs.sample, inputs.model_output, inputs.prev_sample, inputs.ref_model_output
    old_mean = inputs.old_prev_sample_mean
    b, n = _rows_shape(x)
    n_chunks = triton.cdiv(n, CHUNK_SIZE)
    (seeds, stride, offset), philox, aligned = _grpo_launch_args(spec, ks, trust, seed, x)
    group, num_warps = element_config(spec, n, unaligned_philox=philox and not aligned, storage=x.dtype,
                                      run=ks.switches.get("RUN"))
    n_blocks = triton.cdiv(n_chunks, group)
    lp_p = torch.empty((b, n_chunks), dtype=torch.float32, device=x.device)
    kl_p = torch.empty_like(lp_p) if ref is not None else lp_p
    tr_p = torch.empty_like(lp_p) if trust else lp_p
    _launch(
        grpo_partials_kernel, (b * n_blocks,),
        x_ptr=x, v_ptr=v, prev_ptr=prev, **optional_input("ref_ptr", ref, v, switch="HAS_REF"),
        old_mean_ptr=old_mean if old_mean is not None else v, lp_partials_ptr=lp_p, kl_partials_ptr=kl_p,
        tr_partials_ptr=tr_p, sigmas_ptr=ks.sigmas, step_ptr=ks.step_index, seeds_ptr=seeds, stream_stride=stride,
        elem_offset=offset, n_per_sample=n, n_chunks=n_chunks, n_blocks=n_blocks, **_blocks_magic(n_blocks),
        **ks.scalars, last_index=ks.last_index, MODE=int(spec.mode), TRUST=int(trust), CHUNK=CHUNK_SIZE,
        LOG2_CHUNK=LOG2_CHUNK_SIZE, GROUP=group, PHILOX_ALIGNED=aligned, num_warps=num_warps, **_LAUNCH,
        **_kl_args(ref, inputs.ref_cond, loss.ref_scale, kl_space, v), **_elementwise_args(ks),
    )
    if spec.shard is not None:  # sequence parallelism: the full samples' partials, one gather for the three
        present = [lp_p] + ([kl_p] if ref is not None else []) + ([tr_p] if trust else [])
        full = iter(spec.gather(torch.cat(present)).split(b))
        lp_p = next(full)
        kl_p = next(full) if ref is not None else lp_p
        tr_p = next(full) if trust else lp_p
    lp = _finalize(spec, ks, lp_p)[0]
    zeros = torch.zeros(b, dtype=torch.float32, device=x.device)
    if ref is not None and kl_space is KLSpace.VELOCITY:
        kl = _velocity_kl(spec, kl_p)
    else:
        kl = _finalize(dataclasses.replace(spec, kind=LogProbKind.KL), ks, kl_p)[0] if ref is not None else zeros
    tr = (_finalize(dataclasses.replace(spec, kind=LogProbKind.KL, reduction=Reduction.MEAN), ks, tr_p)[0]
          if trust else zeros)
    return lp, kl, tr


class _GRPOValues(torch.autograd.Function):
    """(log-prob, KL to the reference, trust-region divergence) [B] each, from one element pass;
    backward: one element pass writing d / d model_output from the three incoming grads."""

    @staticmethod
    def forward(ctx, v, loss, inputs, ks):
        inputs = inputs._replace(model_output=v)
        ctx.save_for_backward(inputs.sample, v, inputs.prev_sample, inputs.ref_model_output,
                              inputs.old_prev_sample_mean, inputs.ref_cond)
        ctx.loss, ctx.ks = loss, ks
        return _grpo_forward(loss, ks, inputs)

    @staticmethod
    def backward(ctx, g_lp, g_kl, g_tr):
        x, v, prev, ref, old_mean, ref_cond = ctx.saved_tensors
        loss, ks = ctx.loss, ctx.ks
        spec, trust = loss.step, int(loss.trust)
        b, n = _rows_shape(x)
        zeros = torch.zeros(b, dtype=torch.float32, device=x.device)
        g_lp, g_kl, g_tr = (zeros if g is None else g.to(torch.float32).contiguous() for g in (g_lp, g_kl, g_tr))
        (seeds, stride, offset), philox, aligned = _grpo_launch_args(spec, ks, trust, loss.seed, x)
        if spec.elementwise:  # step_backward_kernel's configuration (no spills with per-element coefficients)
            group, num_warps = element_config(spec, n, storage=x.dtype, run=ks.switches.get("RUN"))
        else:
            group, num_warps = REPLAY_BACKWARD_CONFIG if philox else launch_config(n)
        block = group * CHUNK_SIZE
        n_blocks = triton.cdiv(n, block)
        grad_v = torch.empty_like(v)
        _launch(
            grpo_backward_kernel, (b * n_blocks,),
            x_ptr=x, v_ptr=v, prev_ptr=prev, **optional_input("ref_ptr", ref, v, switch="HAS_REF"),
            old_mean_ptr=old_mean if old_mean is not None else v, grad_lp_ptr=g_lp, grad_kl_ptr=g_kl,
            grad_tr_ptr=g_tr, grad_v_ptr=grad_v, sigmas_ptr=ks.sigmas, step_ptr=ks.step_index, seeds_ptr=seeds,
            stream_stride=stride, elem_offset=offset, n_per_sample=n, n_blocks=n_blocks, **_blocks_magic(n_blocks),
            numel_f=float(spec.numel), **ks.scalars, last_index=ks.last_index, MODE=int(spec.mode),
            KIND=int(spec.kind), MEAN=spec.reduction is Reduction.MEAN, TRUST=int(trust), BLOCK=block,
            PHILOX_ALIGNED=aligned, num_warps=num_warps, **_LAUNCH,
            **_kl_args(ref, ref_cond, loss.ref_scale, loss.kl_space, v), **_elementwise_args(ks, backward=True),
        )
        return grad_v, None, None, None


def grpo_values(loss: GRPOLossSpec, inputs: GRPOInputs):
    """(log_prob, kl, trust_divergence) [B] float32 of a GRPO-family loss; kl / trust_divergence are zeros
    when absent. ``inputs.ref_cond``: the reference's conditional branch (``ref_model_output`` its
    unconditional one), guided in the kernel at ``loss.ref_scale``."""
    sample_shaped = ("sample", "model_output", "prev_sample", "ref_model_output", "old_prev_sample_mean", "ref_cond")
    inputs = inputs._replace(**{name: getattr(inputs, name).contiguous() for name in sample_shaped
                                if getattr(inputs, name) is not None})
    ks = _KernelScalars(loss.step, inputs.sample.shape, storage=inputs.sample.dtype)
    if torch.is_grad_enabled() and inputs.model_output.requires_grad:
        return _GRPOValues.apply(inputs.model_output, loss, inputs, ks)
    return _grpo_forward(loss, ks, inputs)


# ------------------------------------------------------------------------- forward-process losses


def _flow_noise_args(noise_seed, n, tensors, batch):
    """The flow kernels' launch configuration and switches: ((group, num_warps), keyword arguments).
    ``noise_seed``: None (eps read from ``other``) or (seeds, stream_stride, elem_offset, noise_div,
    noise_mod) (flow_sums) for ``batch`` samples; NOISE_DIV (kernels/loss.py's _flow_noise) is noise_div
    where it is 1 or 2 and the last sample's row // noise_div is below 2 noise_mod (one wrap: every
    layout flowrl.losses makes), else 0 (the general modulo). PAIRED (kernels/loss.py: bfloat16 read
    as uint32 pairs): an even element count and 4-byte aligned rows; EVEN: PAIRED and whole blocks.
    Philox from an unaligned offset is neither (flowrl/tools/aot lists each launch)."""
    philox = noise_seed is not None
    if philox:
        check_philox_range(int(noise_seed[2]), n)
    aligned = philox and noise_seed[2] % 4 == 0
    paired = n % 2 == 0 and not (philox and not aligned) and all(
        u.dtype != torch.bfloat16 or u.data_ptr() % 4 == 0 for u in tensors if u is not None)
    # unpaired (an odd count, misaligned rows: element loads) at one warp per chunk DGPO's two references
    # spill (136 bytes, sm_90a); at WIDE_CONFIG's 8 values per thread none does
    group, num_warps = launch_config(n) if paired else WIDE_CONFIG
    even = paired and n % (group * CHUNK_SIZE) == 0
    if philox:
        seeds, stride, offset, div, mod = noise_seed
        one_wrap = int(div) in (1, 2) and (batch - 1) // int(div) < 2 * int(mod)
        kw = dict(seeds_ptr=seeds, stream_stride=int(stride), elem_offset=int(offset), noise_div=int(div),
                  noise_mod=int(mod), NOISE_DIV=int(div) if one_wrap else 0)
    else:
        kw = {}
    return (group, num_warps), dict(kw, EVEN=even, PHILOX=philox, PHILOX_ALIGNED=aligned, PAIRED=paired)


def _flow_inputs(xt, v, other, x0, ref, t) -> dict:
    """The flow kernels' input tensors by name (kernels/loss.py): ``xt`` and ``other`` may be None (``v``
    in their place, never read: LOSS and PHILOX say which the kernel reads), ``ref`` too (HAS_REF follows
    from it)."""
    return dict(**optional_input("xt_ptr", xt, v), v_ptr=v, **optional_input("other_ptr", other, v), x0_ptr=x0,
                **optional_input("ref_ptr", ref, v, switch="HAS_REF"), t_ptr=t)


def _flow_coefs(coefs) -> dict:
    """The flow kernels' (beta, 1 - beta, 1 + beta) by name (NFT's; zeros for the other losses)."""
    return dict(zip(("beta", "one_minus_beta", "one_plus_beta"), coefs, strict=True))


def _flow_forward(kind, count, xt, v, other, x0, ref, t, coefs, shard=None, noise_seed=None):
    b, n = _rows_shape(v)
    n_chunks = triton.cdiv(n, CHUNK_SIZE)
    (group, num_warps), noise_kw = _flow_noise_args(noise_seed, n, (xt, v, other, x0, ref), b)
    n_blocks = triton.cdiv(n_chunks, group)
    partials = torch.empty((count, b, n_chunks), dtype=torch.float32, device=v.device)
    _launch(
        flow_partials_kernel, (b * n_blocks,),
        **_flow_inputs(xt, v, other, x0, ref, t), partials_ptr=partials, n_per_sample=n, n_chunks=n_chunks,
        n_blocks=n_blocks, **_blocks_magic(n_blocks), n_rows=b, **_flow_coefs(coefs), LOSS=int(kind),
        CHUNK=CHUNK_SIZE, LOG2_CHUNK=LOG2_CHUNK_SIZE, GROUP=group, num_warps=num_warps, **noise_kw, **_LAUNCH,
    )
    partials = partials.reshape(count * b, n_chunks)
    if shard is not None:  # sequence parallelism: the full samples' partials (forward only, as the step ops)
        partials = shard.gather(partials)
    # [count, B]: the contract's halving tree over each sample's partials
    return reference.combine_partials(partials).reshape(count, b)


class _FlowSums(torch.autograd.Function):
    """The forward-process losses' per-sample sums [K, B] from one element pass; backward: one element
    pass writing d / d model_output from the grads of the squared sums."""

    @staticmethod
    def forward(ctx, v, kind, count, xt, other, x0, ref, t, coefs, shard, noise_seed):
        seeds = noise_seed[0] if noise_seed is not None else None
        ctx.save_for_backward(xt, v, other, x0, ref, t, seeds)
        ctx.kind, ctx.coefs, ctx.noise_seed = kind, coefs, None if noise_seed is None else noise_seed[1:]
        return _flow_forward(kind, count, xt, v, other, x0, ref, t, coefs, shard, noise_seed)

    @staticmethod
    def backward(ctx, grad):
        xt, v, other, x0, ref, t, seeds = ctx.saved_tensors
        b, n = _rows_shape(v)
        grad_v = torch.empty_like(v)
        noise_seed = None if ctx.noise_seed is None else (seeds, *ctx.noise_seed)
        (group, num_warps), noise_kw = _flow_noise_args(noise_seed, n, (xt, v, other, x0, ref, grad_v), b)
        block = group * CHUNK_SIZE
        n_blocks = triton.cdiv(n, block)
        _launch(
            flow_backward_kernel, (b * n_blocks,),
            **_flow_inputs(xt, v, other, x0, ref, t), grad_ptr=grad.to(torch.float32).contiguous(),
            grad_v_ptr=grad_v, n_per_sample=n, n_blocks=n_blocks, **_blocks_magic(n_blocks), n_rows=b,
            **_flow_coefs(ctx.coefs), LOSS=int(ctx.kind), BLOCK=block, num_warps=num_warps, **noise_kw, **_LAUNCH,
        )
        return grad_v, None, None, None, None, None, None, None, None, None, None


def flow_sums(kind, count, xt, v, other, x0, ref, t, coefs, shard=None, noise_seed=None):
    """[count, B] float32 per-sample sums of the forward-process loss ``kind`` (see the kernel);
    ``shard``: the sequence-parallel context (partials gathered in forward; the backward needs none:
    d sum / d element does not depend on the other ranks' elements). ``noise_seed`` (DPO / DGPO, with
    ``other`` None): (seeds int64 [R], stream_stride, elem_offset, noise_div, noise_mod), eps of sample b
    drawn in the kernels from Philox row (b // noise_div) % noise_mod (flowrl.backends.reference.philox_normal's
    stream of that row's seed, its stream the row times stream_stride)."""
    xt = xt.contiguous() if xt is not None else None
    v, x0 = v.contiguous(), x0.contiguous()
    other = other.contiguous() if other is not None else None
    ref = ref.contiguous() if ref is not None else None
    t = t.to(torch.float32).contiguous()
    if noise_seed is not None:
        noise_seed = (noise_seed[0].to(torch.int64).contiguous(), *noise_seed[1:])
    if torch.is_grad_enabled() and v.requires_grad:
        return _FlowSums.apply(v, int(kind), count, xt, other, x0, ref, t, coefs, shard, noise_seed)
    return _flow_forward(int(kind), count, xt, v, other, x0, ref, t, coefs, shard, noise_seed)


__all__ = ["grpo_values", "flow_sums", "REPLAY_BACKWARD_CONFIG"]
