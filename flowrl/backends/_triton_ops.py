"""The Triton backend: launchers and autograd Functions around the kernels of ``flowrl.kernels``.

Its three ops take a validated ``flowrl.core.step_spec.StepSpec`` and the tensors, like the torch
backend's (``flowrl.backends._dispatch`` holds the table). Inputs are made contiguous first (a no-op for the
usual contiguous latents; a non-contiguous view is copied once). Nothing here reads a device value
on the host (no ``.item()``, no sync), so the ops are CUDA-graph capturable.

Launch: the element kernels run a 1-D grid, one program per (sample, block of ``group`` consecutive
CHUNK_SIZE chunks) (any batch size), so every chunk's partial is summed inside one program (no
atomics, fixed order); ``step_config`` picks (group, num_warps) from the sample's element count,
the latents' dtypes and alignment and the step (``launch_config``'s one tile, or STEP_LAUNCH_TABLE's
static tiles with ``step_switches``; the tables and choosers are flowrl/backends/_launch.py's). Every
entry gives the same bits (each chunk's tree is the same; tested). The finalize kernel's block is the
sample's partial count rounded up to a power of two, num_warps = block / 256 in [1, 16].
Two launches per op call (partials, finalize); three for a rollout drawing torch noise (the randn).

``spec.gather`` (sequence parallelism) is called on the local partials in forward only: in backward
the incoming grad [B] is the same on every rank and the global ``numel`` is used, so each rank's
backward kernel writes its shard's grads with no communication.

A kernel that fails to compile or to launch on this machine raises ``KernelCompileError`` naming the
kernel, its specialization and the triton version, whether the backend was asked for or chosen by
``auto``: no silent fallback, since a fallback half-way (the forward compiled, the backward not) would
move a rollout and its recompute onto different backends and break their bitwise agreement.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime import errors as runtime_errors

from flowrl.kernels.step import finalize_kernel, step_backward_kernel, step_partials_kernel
from flowrl.kernels.token import RECORD, TABLE_HEADER, token_table_kernel

from . import reference
# the launch tables and choosers live in _launch.py; re-exported here (``_triton_ops.X``, flowrl/tools/aot)
from ._launch import ELEMENTWISE_CONFIG, LAUNCH_TABLE, MAX_TILE_REGISTERS, SLIM_CONFIG, STEP_LAUNCH_TABLE  # noqa: F401
from ._launch import TOKEN_TABLE_BLOCK, UNALIGNED_PHILOX_CONFIG, WIDE_CONFIG, division_magic  # noqa: F401
from ._launch import element_tiles, finalize_warps, launch_config, register_cap, step_switches  # noqa: F401
from ._launch import element_config, step_config, tiles_taken, token_run  # noqa: F401
from ..contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, SIGMA_ONE_TOL, LogProbKind, Mode, NoiseSource, Op, Reduction
from ..core.step_spec import flat_layout

# the pre-pass table's layout (kernels/token.py): header words, words per (sample, token) record
TOKEN_TABLE_HEADER = int(TABLE_HEADER.value)
TOKEN_RECORD = int(RECORD.value)

# Largest partial count combined by the finalize kernel in one program (16M elements per sample at
# CHUNK_SIZE 1024; 16 warps, 32 values per thread: at 65536 triton 3.6 spilled 40 bytes on sm_90a);
# above it the first levels of the same halving tree run as elementwise torch adds (exact IEEE adds,
# the same bits) until the width fits.
MAX_FINALIZE_WIDTH = 1 << 14

# Errors that mean "this kernel cannot be built or launched here" (compile errors, ptxas errors,
# shared memory or registers out of resources); the interpreter's runtime errors are not among them.
_BUILD_ERRORS = (CompilationError, runtime_errors.PTXASError, runtime_errors.OutOfResources)


class KernelCompileError(RuntimeError):
    """A flowrl Triton kernel failed to compile or launch on this machine."""


def _launch(kernel, grid, **kwargs):
    """``kernel[grid](**kwargs)``: every argument by its name in the kernel's signature (a misspelt or
    missing one raises at the launch); a build failure becomes a KernelCompileError that names the
    kernel, its constexpr specialization and the triton version, and says how to run the torch path."""
    try:
        kernel[grid](**kwargs)
    except _BUILD_ERRORS as exc:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        switches = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k.isupper())
        raise KernelCompileError(
            f"flowrl Triton kernel {name} ({switches}) failed to build with triton {triton.__version__}: "
            f"{type(exc).__name__}: {exc}. Run the torch backend instead (backend='torch', or "
            "FLOWRL_BACKEND=torch for backend='auto'), and report the triton version."
        ) from exc


# No FMA contraction: the kernels do the reference's roundings, and the rollout and recompute
# kernels cannot be contracted differently (their log-probs must agree bit for bit).
_LAUNCH = dict(enable_fp_fusion=False)


def optional_input(name: str, t: Optional[torch.Tensor], placeholder: torch.Tensor,
                   switch: Optional[str] = None) -> dict:
    """A kernel's optional tensor argument by name: ``t``, or ``placeholder`` when absent (never read:
    ``switch``, the kernel's presence switch, follows from ``t`` and compiles the read away)."""
    out = {name: placeholder if t is None else t}
    if switch is not None:
        out[switch] = t is not None
    return out


def _elementwise_layout(table, tok_layout, frozen, frozen_layout) -> dict:
    """The element kernels' per-token table and frozen mask arguments by name: each (inner, groups,
    stride) layout (``flat_layout``; (1, 1, 0) for none)."""
    return dict(tok_ptr=table, **dict(zip(("tok_inner", "tok_groups", "tok_stride"), tok_layout)),
                frozen_ptr=frozen, **dict(zip(("frozen_inner", "frozen_groups", "frozen_stride"), frozen_layout)))


class _KernelScalars:
    """The spec's per-call scalars in the form the kernels take them, and an elementwise step's
    compact tables with their index math (``flat_layout``): the pre-pass's table (kernels/token.py:
    the division multipliers and, with per-token sigmas, each (sample, token)'s coefficients), the
    frozen mask, and the scored count and the per-token log term (``reference.scored_statistics``).
    ``storage``: the latents' dtype (how many elements share a lookup, ``token_run``)."""

    def __init__(self, spec, sample_shape, prev_x0_pred=None, storage=None):
        # the contract's float32 table (a float64 schedule is read as float32, as the reference does)
        self.sigmas = spec.sigmas.to(torch.float32).contiguous()
        self.step_index = spec.step_index.contiguous()
        # cps' sin(eta * pi / 2): the reference's float32 value, computed once on the host
        self.scalars = dict(sigma_one_tol=SIGMA_ONE_TOL, eta=spec.noise_level,
                            sin_half_pi_eta=reference.sin_half_pi(spec.noise_level, torch.float32))
        # flash_sde reads sigmas[T] (sigma_min); dpm_sde's second order reads the previous data prediction
        self.last_index = spec.sigmas.numel() - 1
        # the element kernels' per-token table and frozen mask (placeholders, never read, unless the
        # switches below are on)
        self.elementwise = _elementwise_layout(self.sigmas, (1, 1, 0), self.sigmas, (1, 1, 0))
        self.switches = dict(PER_TOKEN=spec.per_token, HAS_FROZEN=spec.frozen is not None,
                             WEIGHTED=spec.per_token and spec.kind is not LogProbKind.SQ_ERR)
        if spec.elementwise:
            self.elementwise = self._pre_pass(spec, sample_shape)
            inners = (self.elementwise["tok_inner"],) if spec.per_token else ()
            inners += (self.elementwise["frozen_inner"],) if spec.frozen is not None else ()
            self.switches["RUN"] = token_run(inners, storage)
        self.count, self.log_term = (reference.scored_statistics(spec, sample_shape, torch.float32)
                                     if spec.elementwise else (None, None))
        # ddim's mean switches (every kernel takes them; other modes ignore them)
        clip = spec.clip_sample_range
        self.ddim = dict(clip_range=1.0 if clip is None else clip, PRED=int(spec.prediction), CLIP=clip is not None)
        self.prev_x0 = None if prev_x0_pred is None else prev_x0_pred.contiguous()

    def _pre_pass(self, spec, sample_shape):
        """The element kernels' per-token table and frozen mask arguments (``_elementwise_layout``),
        launching the pre-pass (one program without per-token sigmas:
        the header only)."""
        n = 1
        for d in sample_shape[1:]:
            n *= d
        if n >= 1 << 31:  # the element kernels' index math runs in 32 bits (common.compact_index)
            raise ValueError(f"per-token sigmas and frozen masks take samples below 2**31 elements; got {n}")
        b = self.step_index.numel()
        device = self.sigmas.device
        pairs, tok_layout = self.sigmas, (1, 1, 0)
        frozen, frozen_layout = self.sigmas, (1, 1, 0)
        if spec.per_token:  # one [Bt, G, 2] table of (sigma, sigma') pairs
            table, inner, groups, stride = flat_layout(spec.token_sigmas.to(torch.float32), sample_shape)
            if groups > MAX_TABLE_TOKENS:
                raise ValueError(f"token_sigmas: the Triton backend takes at most {MAX_TABLE_TOKENS} tokens per "
                                 f"sample; got {groups}")
            table_next = flat_layout(spec.token_sigmas_next.to(torch.float32), sample_shape)[0]
            pairs, tok_layout = torch.stack((table, table_next), dim=-1).contiguous(), (inner, groups, stride)
        if spec.frozen is not None:
            table, inner, groups, stride = flat_layout(spec.frozen, sample_shape)
            frozen, frozen_layout = table.view(torch.uint8), (inner, groups, stride)
        inner, groups, pairs_stride = tok_layout
        n_blocks = triton.cdiv(groups, TOKEN_TABLE_BLOCK)
        words = TOKEN_TABLE_HEADER + (TOKEN_RECORD * b * groups if spec.per_token else 0)
        table = torch.empty(words, dtype=torch.float32, device=device)
        magic = {f"{name}_{part}": w
                 for name, d in (("tok_inner", inner), ("tok_groups", groups), ("frozen_inner", frozen_layout[0]),
                                 ("frozen_groups", frozen_layout[1]))
                 for part, w in zip("ml", division_magic(d))}
        _launch(
            token_table_kernel, (b * n_blocks if spec.per_token else 1,),
            pairs_ptr=pairs, table_ptr=table, sigmas_ptr=self.sigmas, step_ptr=self.step_index, n_tokens=groups,
            pairs_stride=pairs_stride, n_blocks=n_blocks, **self.scalars, last_index=self.last_index, **magic,
            MODE=int(spec.mode), PER_TOKEN=spec.per_token, BLOCK=TOKEN_TABLE_BLOCK, **_LAUNCH,
        )
        # the records are per sample (the weight reads the sample's step): row stride G
        return _elementwise_layout(table, (inner, groups, groups), frozen, frozen_layout)


# Elements per sample the kernels take: their in-sample offsets and masks run in 32 bits (the row's
# start in 64), with room for a program's last tile past the end.
MAX_SAMPLE_ELEMENTS = 2**31 - 2**16
# Philox elements of a sample's stream the kernels draw: their quad counters are uint32, with room for a
# program's last block past the end (kernels/common.philox_quad)
PHILOX_ELEMENTS = 2**32 - 2**16
# tokens of a sample's per-token table: a record's offset in it, 4 words each, is 32-bit (step._element_terms)
MAX_TABLE_TOKENS = 2**29


def check_philox_range(elem_offset: int, n_per_sample: int) -> None:
    """ValueError unless a launch drawing Philox noise for elements elem_offset .. elem_offset +
    n_per_sample - 1 of a sample's stream stays below PHILOX_ELEMENTS."""
    if elem_offset < 0 or elem_offset + n_per_sample > PHILOX_ELEMENTS:
        raise ValueError(f"the Triton backend draws Philox noise for elements below {PHILOX_ELEMENTS} of a "
                         f"sample's stream; got elem_offset {elem_offset} and {n_per_sample} elements")


def _rows_shape(t: torch.Tensor):
    """(samples, elements per sample) of a latent tensor; ValueError past MAX_SAMPLE_ELEMENTS."""
    b = t.shape[0]
    n = t.numel() // b
    if n > MAX_SAMPLE_ELEMENTS:
        raise ValueError(f"the Triton backend takes samples of at most {MAX_SAMPLE_ELEMENTS} elements "
                         f"(in-sample offsets run in 32 bits); got {n} per sample")
    return b, n


def _second_order(ks: _KernelScalars, x) -> dict:
    """The element kernels' dpm_sde arguments: the previous data prediction (x as a placeholder when
    there is none: HAS_PREV then compiles its read away) and the table's last index."""
    return dict(**optional_input("prev_x0_ptr", ks.prev_x0, x, switch="HAS_PREV"), last_index=ks.last_index)


def _partials(spec, ks: _KernelScalars, x, v, third, prev_out=None, mean_out=None) -> torch.Tensor:
    """Chunk partials [B, P] of the spec's op. A rollout reads its eps from ``third`` (TENSOR), draws
    it in the kernel from ``spec.noise_seed`` (PHILOX), or has none (NONE: x' = mu)."""
    b, n = _rows_shape(x)
    n_chunks = triton.cdiv(n, CHUNK_SIZE)
    write_mean = mean_out is not None
    noise_from = spec.noise_source if spec.op is Op.ROLLOUT else NoiseSource.TENSOR
    philox = noise_from is NoiseSource.PHILOX
    seeds, stream_stride, elem_offset = spec.noise_seed if philox else (ks.step_index, 0, 0)
    if philox:
        check_philox_range(elem_offset, n)
    rollout = spec.op is Op.ROLLOUT  # its noise and mean are float32
    group, num_warps = step_config(spec, n, (x, v, None if rollout else third, prev_out, ks.prev_x0),
                                   (third if rollout else None, mean_out),
                                   unaligned_philox=philox and elem_offset % 4 != 0,
                                   second_order=ks.prev_x0 is not None, run=ks.switches.get("RUN"),
                                   write_mean=write_mean)
    n_blocks = triton.cdiv(n_chunks, group)
    partials = torch.empty((b, n_chunks), dtype=torch.float32, device=x.device)
    _launch(
        step_partials_kernel, (b * n_blocks,),
        x_ptr=x, v_ptr=v, third_ptr=x if third is None else third, **optional_input("prev_out_ptr", prev_out, partials),
        **optional_input("mean_out_ptr", mean_out, partials, switch="WRITE_MEAN"), partials_ptr=partials,
        sigmas_ptr=ks.sigmas, step_ptr=ks.step_index, seeds_ptr=seeds, stream_stride=stream_stride,
        elem_offset=elem_offset, n_per_sample=n, n_chunks=n_chunks, n_blocks=n_blocks, **ks.scalars, **ks.elementwise,
        MODE=int(spec.mode), OP=int(spec.op), CHUNK=CHUNK_SIZE, LOG2_CHUNK=LOG2_CHUNK_SIZE, GROUP=group,
        **ks.switches,
        **step_switches(group, num_warps, n, spec.elementwise, (x, v, third, ks.prev_x0, prev_out),
                        spec.mode if philox else None, x.element_size()),
        # CHUNK_SIZE is a multiple of 4: every block starts on a Philox quad when the offset does
        NOISE=int(noise_from), PHILOX_ALIGNED=philox and elem_offset % 4 == 0,
        num_warps=num_warps, **ks.ddim, **_second_order(ks, x), **_LAUNCH,
    )
    return partials


def _finalize(spec, ks: _KernelScalars, partials: torch.Tensor):
    """(value [B], std [B], count [B]) from the full sample's partials [B, P]."""
    partials = partials.to(torch.float32).contiguous()
    p = partials.shape[1]
    width = max(2, 1 << max(p - 1, 0).bit_length())  # zero padding to >= 2 adds exact zeros only
    if width > MAX_FINALIZE_WIDTH:
        # The halving tree's first levels, t[:h] + t[h:], as elementwise adds: the same IEEE adds the
        # kernel would do, so the same bits, until the width fits one program.
        partials = torch.nn.functional.pad(partials, (0, width - p))
        while width > MAX_FINALIZE_WIDTH:
            width //= 2
            partials = partials[:, :width] + partials[:, width:]
        partials, p = partials.contiguous(), width
    b = partials.shape[0]
    value = torch.empty(b, dtype=torch.float32, device=partials.device)
    std = torch.empty(b, dtype=torch.float32, device=partials.device)
    # the scored count: given (elementwise steps), else written by the kernel
    count = (ks.count.contiguous() if ks.count is not None
             else torch.empty(b, dtype=torch.float32, device=partials.device))
    log_term = ks.log_term.to(torch.float32).contiguous() if ks.log_term is not None else None
    _launch(
        finalize_kernel, (b,),
        partials_ptr=partials, sigmas_ptr=ks.sigmas, step_ptr=ks.step_index, value_ptr=value, std_ptr=std,
        count_ptr=count, COUNT_GIVEN=ks.count is not None,
        **optional_input("log_ptr", log_term, value, switch="HAS_LOG"),
        n_partials=p, numel_f=float(spec.numel), **ks.scalars, MODE=int(spec.mode), KIND=int(spec.kind),
        MEAN=spec.reduction is Reduction.MEAN, WIDTH=width, LOG2_WIDTH=width.bit_length() - 1,
        num_warps=finalize_warps(width), **ks.ddim, last_index=ks.last_index, **_LAUNCH,
    )
    return value, std, count


def _backward(spec, ks: _KernelScalars, x, v, third, grad, count, need, kind: Optional[LogProbKind] = None,
              third_dtype=None):
    """(grad_x, grad_v, grad_third, grad_prev_x0) of the log-prob (third = x') or the KL (third = v_ref);
    None where ``need`` (three or four flags) is False. Grads are written in their input's dtype
    (``third_dtype`` overrides third's)."""
    need_x, need_v, need_third = need[:3]
    # dpm_sde's second order: dmu/dx0_prev = p (the KL's shared p * x0_prev cancels: no grad)
    need_prev = len(need) > 3 and need[3] and ks.prev_x0 is not None and kind is not LogProbKind.KL
    kind = spec.kind if kind is None else kind
    b, n = _rows_shape(x)
    is_kl = kind is LogProbKind.KL
    # mu - mu_ref = c v - c v_ref does not depend on x: no x grad (but ddim's clipped KL's x0_hat)
    need_x = need_x and (not is_kl or spec.kl_reads_sample)
    grad_x = torch.empty_like(x) if need_x else None
    grad_v = torch.empty_like(v) if need_v else None
    grad_third = torch.empty_like(third, dtype=third_dtype or third.dtype) if need_third else None
    grad_prev = torch.empty_like(ks.prev_x0) if need_prev else None
    kernel_needs = (need_x, need_v, need_third, need_prev)
    if any(kernel_needs):
        dummy = grad.new_empty(1)
        group, num_warps = step_config(spec, n, (x, v, third, grad_x, grad_v, grad_third, ks.prev_x0, grad_prev),
                                       backward=True, second_order=ks.prev_x0 is not None and not is_kl)
        block = group * CHUNK_SIZE
        n_blocks = triton.cdiv(n, block)
        _launch(
            step_backward_kernel, (b * n_blocks,),
            x_ptr=x, v_ptr=v, third_ptr=third, grad_ptr=grad.to(torch.float32).contiguous(),
            **optional_input("grad_x_ptr", grad_x, dummy, switch="NEED_X"),
            **optional_input("grad_v_ptr", grad_v, dummy, switch="NEED_V"),
            **optional_input("grad_third_ptr", grad_third, dummy, switch="NEED_THIRD"),
            **optional_input("grad_prev_ptr", grad_prev, dummy, switch="NEED_PREV"),
            sigmas_ptr=ks.sigmas, step_ptr=ks.step_index, count_ptr=count, n_per_sample=n, n_blocks=n_blocks,
            **ks.scalars, **ks.elementwise, MODE=int(spec.mode), KIND=int(kind), MEAN=spec.reduction is Reduction.MEAN,
            IS_KL=is_kl, BLOCK=block, **ks.switches, num_warps=num_warps, **ks.ddim, **_second_order(ks, x),
            **step_switches(
                group, num_warps, n, spec.elementwise, (x, v, third, ks.prev_x0, grad_x, grad_v, grad_third, grad_prev),
                latent_bytes=x.element_size()),
            **_LAUNCH,
        )
    return grad_x, grad_v, grad_third, grad_prev


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------- sde_step


def _sde_step_forward(spec, ks, x, v, noise):
    prev = torch.empty(x.shape, dtype=spec.out_dtype, device=x.device)
    mean = torch.empty(x.shape, dtype=torch.float32, device=x.device) if spec.return_mean else None
    partials = spec.gather(_partials(spec, ks, x, v, noise, prev_out=prev, mean_out=mean))
    lp, std, count = _finalize(spec, ks, partials)
    return prev, lp, mean, std, count


def _ddim_mean_vjp(spec, ks, x, v, grad_mu, need_x, need_v):
    """(std [B], grad_x, grad_v) of a ddim rollout's x' through its mean: autograd of
    reference.ddim_mean (the clip's gradient is 0 outside its range)."""
    b = x.shape[0]
    sqrt_a, sqrt_b, sqrt_a_prev, k, std = reference.ddim_coefficients(ks.sigmas, ks.step_index, spec.noise_level,
                                                                       torch.float32)
    with torch.enable_grad():
        xr = x.detach().reshape(b, -1).to(torch.float32).requires_grad_(need_x)
        vr = v.detach().reshape(b, -1).to(torch.float32).requires_grad_(need_v)
        cols = [t.reshape(-1, 1) for t in (sqrt_a, sqrt_b, sqrt_a_prev, k)]
        mu = reference.ddim_mean(xr, vr, *cols, spec.prediction, spec.clip_sample_range)
        wrt = [t for t, need in ((xr, need_x), (vr, need_v)) if need]
        grads = iter(torch.autograd.grad(mu, wrt, grad_mu)) if wrt else iter(())
    grad_x = next(grads).reshape(x.shape).to(x.dtype) if need_x else None
    grad_v = next(grads).reshape(v.shape).to(v.dtype) if need_v else None
    return std, grad_x, grad_v


class _SDEStep(torch.autograd.Function):
    """Differentiable rollout step, with the reference's autograd semantics: x' = mu + std * eps is
    differentiable in x, v (through mu) and eps; the log-prob of the emitted sample depends on r =
    x' - mu, whose derivative in mu is exactly 0 (the rounding is a constant), so it only reaches eps."""

    @staticmethod
    def forward(ctx, x, v, noise, prev_x0, spec, ks):  # prev_x0: ks.prev_x0 (dpm_sde's second order) or None
        prev, lp, mean, std, count = _sde_step_forward(spec, ks, x, v, noise)
        ctx.save_for_backward(x, v, noise, prev, count)
        ctx.spec, ctx.ks = spec, ks
        ctx.mark_non_differentiable(std, count)
        return prev, lp, mean, std, count

    @staticmethod
    def backward(ctx, grad_prev, grad_lp, grad_mean, _grad_std, _grad_count):
        x, v, noise, prev, count = ctx.saved_tensors
        spec = ctx.spec
        need_x, need_v, need_noise, need_prev_x0 = ctx.needs_input_grad[:4]
        b = x.shape[0]
        grad_prev_x0, keep = None, None
        grad_mu = grad_prev.to(torch.float32).reshape(x.shape)
        if grad_mean is not None:
            grad_mu = grad_mu + grad_mean.reshape(x.shape)

        def unless_kept(value, kept_value):
            return value if keep is None else torch.where(keep, kept_value, value)

        if spec.mode is Mode.DDIM:  # nonlinear mean: the reference's vector-Jacobian product
            std, grad_x, grad_v = _ddim_mean_vjp(spec, ctx.ks, x, v, grad_mu.reshape(b, -1), need_x, need_v)
            std = std.reshape((b,) + (1,) * (x.dim() - 1))
        else:
            if spec.elementwise:  # per-element coefficients; kept elements (x' = x) pass the grad to x
                terms = reference.ElementTerms(spec, x, torch.float32, with_stats=False)
                a, c, std, keep = terms.a, terms.c, terms.std, terms.keep
            elif ctx.ks.prev_x0 is not None:  # dpm_sde's second order: mu = a x + c v + p x0_prev
                a, c, p, std = (t.reshape((b,) + (1,) * (x.dim() - 1)) for t in reference.dpm_sde_coefficients(
                    ctx.ks.sigmas, ctx.ks.step_index, True, torch.float32))
                if need_prev_x0:
                    grad_prev_x0 = (p * grad_mu).to(ctx.ks.prev_x0.dtype)
            else:
                a, c, std = (t.reshape((b,) + (1,) * (x.dim() - 1)) for t in reference.mode_coefficients(
                    ctx.ks.sigmas, ctx.ks.step_index, spec.mode, spec.noise_level, torch.float32))
            grad_x = unless_kept(a * grad_mu, grad_mu).to(x.dtype) if need_x else None
            grad_v = unless_kept(c * grad_mu, torch.zeros_like(grad_mu)).to(v.dtype) if need_v else None
        grad_noise = None
        if need_noise:
            # d log-prob / d x' from the fused log-prob backward, evaluated at the emitted sample
            _, _, grad_prev_lp, _ = _backward(spec, ctx.ks, x, v, prev, grad_lp, count, (False, False, True),
                                              third_dtype=torch.float32)
            total = grad_prev.to(torch.float32) + grad_prev_lp
            grad_noise = unless_kept(std * total, torch.zeros_like(total)).to(noise.dtype)
        return grad_x, grad_v, grad_noise, grad_prev_x0, None, None


def sde_step(spec, sample: torch.Tensor, model_output: torch.Tensor, noise: Optional[torch.Tensor],
             prev_x0_pred: Optional[torch.Tensor] = None):
    """The rollout step of ``spec``: ``(prev_sample, log_prob [B], mean or None, std [B], count [B])``."""
    ks = _KernelScalars(spec, sample.shape, prev_x0_pred, storage=sample.dtype)
    x, v = sample.contiguous(), model_output.contiguous()
    eps = noise.contiguous() if noise is not None else None  # None: Philox noise, or a deterministic step
    if _needs_grad(x, v, eps, ks.prev_x0):
        return _SDEStep.apply(x, v, eps, ks.prev_x0, spec, ks)
    return _sde_step_forward(spec, ks, x, v, eps)


# ------------------------------------------------------------------------- step_log_prob / step_kl


def _value_forward(spec, ks, x, v, third):
    value, _, count = _finalize(spec, ks, spec.gather(_partials(spec, ks, x, v, third)))
    return value, count


class _StepValue(torch.autograd.Function):
    """step_log_prob (third = x') or step_kl (third = v_ref): fused forward and fused backward; saves
    only the inputs (and the count [B])."""

    @staticmethod
    def forward(ctx, x, v, third, prev_x0, spec, ks):  # prev_x0: ks.prev_x0 (dpm_sde's second order) or None
        value, count = _value_forward(spec, ks, x, v, third)
        ctx.save_for_backward(x, v, third, count)
        ctx.spec, ctx.ks = spec, ks
        ctx.mark_non_differentiable(count)
        return value, count

    @staticmethod
    def backward(ctx, grad, _grad_count):
        x, v, third, count = ctx.saved_tensors
        grads = _backward(ctx.spec, ctx.ks, x, v, third, grad, count, ctx.needs_input_grad[:4])
        return (*grads, None, None)


def _value(spec, x, v, third, prev_x0_pred=None):
    ks = _KernelScalars(spec, x.shape, prev_x0_pred, storage=x.dtype)
    x, v, third = x.contiguous(), v.contiguous(), third.contiguous()
    if _needs_grad(x, v, third, ks.prev_x0):
        return _StepValue.apply(x, v, third, ks.prev_x0, spec, ks)
    return _value_forward(spec, ks, x, v, third)


def step_log_prob(spec, sample: torch.Tensor, model_output: torch.Tensor, prev_sample: torch.Tensor,
                  prev_x0_pred: Optional[torch.Tensor] = None):
    """(log-prob [B], count [B]) of the stored ``prev_sample`` (spec.op LOG_PROB)."""
    return _value(spec, sample, model_output, prev_sample, prev_x0_pred)


def step_kl(spec, sample: torch.Tensor, model_output: torch.Tensor, ref_model_output: torch.Tensor,
            prev_x0_pred: Optional[torch.Tensor] = None):
    """(KL [B], count [B]) between the policies' transitions (spec.op KL)."""
    return _value(spec, sample, model_output, ref_model_output, prev_x0_pred)


__all__ = ["sde_step", "step_log_prob", "step_kl", "KernelCompileError", "MAX_FINALIZE_WIDTH"]
