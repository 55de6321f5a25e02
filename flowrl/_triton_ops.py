"""The Triton backend: launchers and autograd Functions around the kernels of ``flowrl.kernels``.

Same signatures and return values as ``flowrl.reference`` (arguments already validated by
``flowrl.functional``). Inputs are made contiguous first (a no-op for the usual contiguous latents;
a non-contiguous view is copied once). Nothing here reads a device value on the host (no ``.item()``,
no sync), so the ops are CUDA-graph capturable.

Launch heuristic: element kernels take one CHUNK_SIZE chunk per program, which keeps every chunk's
partial inside one program (no atomics, fixed order); num_warps scales with the block so each
thread holds 8 float32 values (4 warps at 1024), capped at 8 warps. The finalize kernel's block is
the sample's partial count rounded up to a power of two, with the same warp rule.

``gather`` (sequence parallelism) is called on the local partials in forward only: in backward the
incoming grad [B] is the same on every rank and the global ``numel`` is used, so each rank's
backward kernel writes its shard's grads with no communication.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from flowrl.kernels.common import KIND_CODES, MODE_CODES
from flowrl.kernels.step import (
    NOISE_NONE, NOISE_PHILOX, NOISE_TENSOR, OP_KL, OP_LOG_PROB, OP_ROLLOUT, finalize_kernel,
    step_backward_kernel, step_partials_kernel,
)

from . import reference
from ._validate import SIGMA_ONE_ATOL, SIGMA_ONE_RTOL, NoiseSeed
from .reference import CHUNK_SIZE, Gather

_LOG2_CHUNK = CHUNK_SIZE.bit_length() - 1
assert 1 << _LOG2_CHUNK == CHUNK_SIZE, "CHUNK_SIZE must be a power of two"
# Largest partial count combined by the finalize kernel in one program (64M elements per sample
# at CHUNK_SIZE 1024); above it the same halving tree runs as torch ops (reference.finalize).
MAX_FINALIZE_WIDTH = 1 << 16
# The CUDA grid's second axis (one sample per index) is limited to 65535.
MAX_BATCH = 65535
_SIGMA_ONE_TOL = SIGMA_ONE_ATOL + SIGMA_ONE_RTOL


def _num_warps(block: int) -> int:
    return max(1, min(8, block // 256))


# No FMA contraction: the kernels do the reference's roundings, and the rollout and recompute
# kernels cannot be contracted differently (their log-probs must agree bit for bit).
_LAUNCH = dict(enable_fp_fusion=False)


class _Step:
    """Per-call scalars shared by every kernel of one op call."""

    def __init__(self, sigmas: torch.Tensor, step_index: torch.Tensor, mode: str, noise_level: float):
        # the contract's float32 table (a float64 schedule is read as float32, as the reference does)
        self.sigmas = sigmas.to(torch.float32).contiguous()
        self.step_index = step_index.to(torch.int64).contiguous()
        self.mode_name = mode
        self.mode = MODE_CODES[mode]
        self.eta = float(noise_level)
        # cps' sin(eta * pi / 2): the reference's float32 value, computed once on the host
        self.sin_half_pi_eta = reference.sin_half_pi(self.eta, torch.float32)

    def coefficients(self):
        """(a, c, std) [B] by the torch reference, for the few steps done with torch ops."""
        return reference.mode_coefficients(self.sigmas, self.step_index, self.mode_name, self.eta, torch.float32)

    def scalars(self):
        return (_SIGMA_ONE_TOL, self.eta, self.sin_half_pi_eta)


def _rows_shape(t: torch.Tensor):
    b = t.shape[0]
    if b > MAX_BATCH:
        raise ValueError(f"backend='triton' takes at most {MAX_BATCH} samples per call; got a batch of {b}")
    return b, t.numel() // b


def _partials(op: int, st: _Step, x, v, third, prev_out=None, mean_out=None, noise_seed: Optional[NoiseSeed] = None) -> torch.Tensor:
    """Chunk partials [B, P]. A rollout with ``third`` None draws its noise in the kernel from
    ``noise_seed``, or, without a seed, is deterministic (x' = mu)."""
    b, n = _rows_shape(x)
    n_chunks = triton.cdiv(n, CHUNK_SIZE)
    partials = torch.empty((b, n_chunks), dtype=torch.float32, device=x.device)
    write_mean = mean_out is not None
    philox = noise_seed is not None
    noise_from = NOISE_TENSOR if third is not None else NOISE_PHILOX if philox else NOISE_NONE
    seeds, stream_stride, elem_offset = noise_seed if philox else (st.step_index, 0, 0)
    step_partials_kernel[(n_chunks, b)](
        x, v, x if third is None else third, prev_out if prev_out is not None else partials,
        mean_out if write_mean else partials, partials, st.sigmas, st.step_index,
        seeds, stream_stride, elem_offset, n, n_chunks, *st.scalars(),
        MODE=st.mode, OP=op, WRITE_MEAN=write_mean, CHUNK=CHUNK_SIZE, LOG2_CHUNK=_LOG2_CHUNK,
        # CHUNK_SIZE is a multiple of 4: every chunk starts on a Philox quad when the offset does
        NOISE=noise_from, PHILOX_ALIGNED=philox and elem_offset % 4 == 0,
        num_warps=_num_warps(CHUNK_SIZE), **_LAUNCH,
    )
    return partials


def _finalize(partials: torch.Tensor, st: _Step, numel: int, kind: str, reduction: str):
    """(value [B], std [B]) from the full sample's partials [B, P]."""
    b, p = partials.shape
    partials = partials.to(torch.float32).contiguous()
    width = max(2, 1 << max(p - 1, 0).bit_length())  # zero padding to >= 2 adds exact zeros only
    if width > MAX_FINALIZE_WIDTH:
        _, _, std = st.coefficients()
        return reference.finalize(partials, std, numel, kind, reduction), std
    value = torch.empty(b, dtype=torch.float32, device=partials.device)
    std = torch.empty(b, dtype=torch.float32, device=partials.device)
    finalize_kernel[(b,)](
        partials, st.sigmas, st.step_index, value, std, p, float(numel), reference.HALF_LOG_2PI, *st.scalars(),
        MODE=st.mode, KIND=KIND_CODES[kind], MEAN=reduction == "mean", WIDTH=width,
        LOG2_WIDTH=width.bit_length() - 1, num_warps=_num_warps(width), **_LAUNCH,
    )
    return value, std


def _backward(st: _Step, x, v, third, grad, numel: int, kind: str, reduction: str, need, third_dtype=None):
    """(grad_x, grad_v, grad_third) for the log-prob (third = x') or the KL (third = v_ref); None where
    ``need`` is False. Grads are written in their input's dtype."""
    need_x, need_v, need_third = need
    b, n = _rows_shape(x)
    is_kl = kind == "kl"
    grad_x = torch.empty_like(x) if need_x else None
    grad_v = torch.empty_like(v) if need_v else None
    grad_third = torch.empty_like(third, dtype=third_dtype or third.dtype) if need_third else None
    if is_kl and need_x:
        grad_x.zero_()  # mu - mu_ref does not depend on x: a * x cancels exactly
    kernel_needs = (need_x and not is_kl, need_v, need_third)
    if any(kernel_needs):
        dummy = grad.new_empty(1)
        step_backward_kernel[(triton.cdiv(n, CHUNK_SIZE), b)](
            x, v, third, grad.to(torch.float32).contiguous(),
            grad_x if kernel_needs[0] else dummy, grad_v if need_v else dummy,
            grad_third if need_third else dummy, st.sigmas, st.step_index, n, float(numel), *st.scalars(),
            MODE=st.mode, KIND=KIND_CODES[kind], MEAN=reduction == "mean", IS_KL=is_kl,
            NEED_X=kernel_needs[0], NEED_V=need_v, NEED_THIRD=need_third, CHUNK=CHUNK_SIZE,
            num_warps=_num_warps(CHUNK_SIZE), **_LAUNCH,
        )
    return grad_x, grad_v, grad_third


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------- sde_step


def _sde_step_forward(x, v, noise, st, log_prob, reduction, out_dtype, return_mean, numel, gather, noise_seed):
    prev = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mean = torch.empty(x.shape, dtype=torch.float32, device=x.device) if return_mean else None
    partials = _partials(OP_ROLLOUT, st, x, v, noise, prev_out=prev, mean_out=mean, noise_seed=noise_seed)
    if gather is not None:
        partials = gather(partials)
    lp, std = _finalize(partials, st, numel or x[0].numel(), log_prob, reduction)
    return prev, lp, mean, std


class _SDEStep(torch.autograd.Function):
    """Differentiable rollout step, with the reference's autograd semantics: x' = mu + std * eps is
    differentiable in x, v (through mu) and eps; the log-prob of the emitted sample depends on r =
    x' - mu, whose derivative in mu is exactly 0 (x' moves with mu), so it only reaches eps."""

    @staticmethod
    def forward(ctx, x, v, noise, st, log_prob, reduction, out_dtype, return_mean, numel, gather, noise_seed):
        prev, lp, mean, std = _sde_step_forward(
            x, v, noise, st, log_prob, reduction, out_dtype, return_mean, numel, gather, noise_seed
        )
        ctx.save_for_backward(x, v, noise, prev)
        ctx.st, ctx.log_prob, ctx.reduction = st, log_prob, reduction
        ctx.numel = numel or x[0].numel()
        ctx.mark_non_differentiable(std)
        return prev, lp, mean, std

    @staticmethod
    def backward(ctx, grad_prev, grad_lp, grad_mean, _grad_std):
        x, v, noise, prev = ctx.saved_tensors
        st = ctx.st
        need_x, need_v, need_noise = ctx.needs_input_grad[:3]
        b = x.shape[0]
        a, c, std = st.coefficients()
        grad_mu = grad_prev.to(torch.float32).reshape(b, -1)
        if grad_mean is not None:
            grad_mu = grad_mu + grad_mean.reshape(b, -1)
        grad_x = (a.reshape(-1, 1) * grad_mu).reshape(x.shape).to(x.dtype) if need_x else None
        grad_v = (c.reshape(-1, 1) * grad_mu).reshape(v.shape).to(v.dtype) if need_v else None
        grad_noise = None
        if need_noise:
            # d log-prob / d x' from the fused log-prob backward, evaluated at the emitted sample
            _, _, grad_prev_lp = _backward(
                st, x, v, prev, grad_lp, ctx.numel, ctx.log_prob, ctx.reduction, (False, False, True),
                third_dtype=torch.float32,
            )
            total = grad_prev.to(torch.float32) + grad_prev_lp
            grad_noise = (std.reshape((b,) + (1,) * (x.dim() - 1)) * total).to(noise.dtype)
        return grad_x, grad_v, grad_noise, None, None, None, None, None, None, None, None


def sde_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    noise: torch.Tensor,
    *,
    mode: str,
    noise_level: float,
    log_prob: str,
    reduction: str,
    out_dtype: torch.dtype,
    return_mean: bool = True,
    numel: Optional[int] = None,
    gather: Gather = None,
    noise_seed: Optional[NoiseSeed] = None,
):
    st = _Step(sigmas, step_index, mode, noise_level)
    x, v = sample.contiguous(), model_output.contiguous()
    eps = noise.contiguous() if noise is not None else None  # None: Philox noise, or a deterministic step
    args = (st, log_prob, reduction, out_dtype, return_mean, numel, gather, noise_seed)
    if _needs_grad(x, v, eps):
        return _SDEStep.apply(x, v, eps, *args)
    return _sde_step_forward(x, v, eps, *args)


# ------------------------------------------------------------------------- step_log_prob / step_kl


def _value_forward(op, x, v, third, st, kind, reduction, numel, gather):
    partials = _partials(op, st, x, v, third)
    if gather is not None:
        partials = gather(partials)
    value, _ = _finalize(partials, st, numel or x[0].numel(), kind, reduction)
    return value


class _StepValue(torch.autograd.Function):
    """step_log_prob (third = x') or step_kl (third = v_ref): fused forward and fused backward; saves
    only the inputs."""

    @staticmethod
    def forward(ctx, x, v, third, st, op, kind, reduction, numel, gather):
        ctx.save_for_backward(x, v, third)
        ctx.st, ctx.kind, ctx.reduction = st, kind, reduction
        ctx.numel = numel or x[0].numel()
        return _value_forward(op, x, v, third, st, kind, reduction, numel, gather)

    @staticmethod
    def backward(ctx, grad):
        x, v, third = ctx.saved_tensors
        grads = _backward(ctx.st, x, v, third, grad, ctx.numel, ctx.kind, ctx.reduction, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def _value(op, kind, x, v, third, sigmas, step_index, mode, noise_level, reduction, numel, gather):
    st = _Step(sigmas, step_index, mode, noise_level)
    x, v, third = x.contiguous(), v.contiguous(), third.contiguous()
    if _needs_grad(x, v, third):
        return _StepValue.apply(x, v, third, st, op, kind, reduction, numel, gather)
    return _value_forward(op, x, v, third, st, kind, reduction, numel, gather)


def step_log_prob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    *,
    mode: str,
    noise_level: float,
    log_prob: str,
    reduction: str,
    numel: Optional[int] = None,
    gather: Gather = None,
) -> torch.Tensor:
    return _value(OP_LOG_PROB, log_prob, sample, model_output, prev_sample, sigmas, step_index, mode,
                  noise_level, reduction, numel, gather)


def step_kl(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: torch.Tensor,
    *,
    mode: str,
    noise_level: float,
    reduction: str,
    numel: Optional[int] = None,
    gather: Gather = None,
) -> torch.Tensor:
    return _value(OP_KL, "kl", sample, model_output, ref_model_output, sigmas, step_index, mode,
                  noise_level, reduction, numel, gather)


__all__ = ["sde_step", "step_log_prob", "step_kl", "CHUNK_SIZE", "MAX_FINALIZE_WIDTH"]
