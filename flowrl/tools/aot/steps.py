"""The step kernels' specializations (kernels/step.py, kernels/token.py): the rollout, log-prob and
KL partials, their backward and finalize, per mode (ddim's and the FEW_SPECIALIZATIONS modes' own
lists), and ``specializations``, the full list the compile checks (with loss_specs.py's)."""
from __future__ import annotations

from typing import Iterator, NamedTuple

from flowrl.backends import _triton_ops
from flowrl.contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, LogProbKind, Mode, NoiseSource, Op, Prediction, Variants
from flowrl.core.step_spec import ddim_kl_reads_sample

from .launches import (STORAGES, Specialization, _elementwise, _elementwise_label, _ELEMENTWISE_SIG, _launch_configs,
                       _step_config, _tiles_even, _unaligned_philox_config)
from .loss_specs import loss_specializations


class Rollout(NamedTuple):
    """A step_partials_kernel's noise switches (NOISE, WRITE_MEAN, PHILOX_ALIGNED): the noise source,
    whether the rollout also writes its mean, and whether Philox noise starts at an element offset
    that is a multiple of 4. The log-prob and the KL compile with the defaults (given noise, no mean)."""

    noise: NoiseSource = NoiseSource.TENSOR
    write_mean: bool = False
    philox_aligned: bool = False


# the rollouts the lists name: given noise with the mean, Philox noise (from an aligned offset) without
# and with it, none (ddim at eta = 0) with it, Philox from an unaligned offset with it
TENSOR_MEAN = Rollout(NoiseSource.TENSOR, True, False)
PHILOX = Rollout(NoiseSource.PHILOX, False, True)
PHILOX_MEAN = Rollout(NoiseSource.PHILOX, True, True)
NONE_MEAN = Rollout(NoiseSource.NONE, True, False)
PHILOX_UNALIGNED_MEAN = Rollout(NoiseSource.PHILOX, True, False)


def _partials(storage, mode, op, group, warps, rollout=Rollout(), aligned=True, elementwise=(), has_prev=False,
              ddim=(Prediction.EPSILON, False), even=False):
    """The step kernels' forward (kernels/step.py's step_partials_kernel) for ``op``: a rollout with
    ``rollout``'s noise switches, or the log-prob or KL partials."""
    noise, write_mean, philox_aligned = rollout
    sig = {
        "x_ptr": "*" + storage, "v_ptr": "*" + storage, "third_ptr": "*" + ("fp32" if op is Op.ROLLOUT else storage),
        "prev_out_ptr": "*" + storage, "mean_out_ptr": "*fp32", "partials_ptr": "*fp32", "sigmas_ptr": "*fp32",
        "step_ptr": "*i64", "seeds_ptr": "*i64", "stream_stride": "i32", "elem_offset": "i32", "n_per_sample": "i32",
        "n_chunks": "i32", "n_blocks": "i32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
        **_ELEMENTWISE_SIG,
        "prev_x0_ptr": "*" + storage, "last_index": "i32", "clip_range": "fp32",
    }
    cx = {"MODE": int(mode), "OP": int(op), "WRITE_MEAN": write_mean, "CHUNK": CHUNK_SIZE, "LOG2_CHUNK": LOG2_CHUNK_SIZE,
          "GROUP": group, "NOISE": int(noise), "PHILOX_ALIGNED": philox_aligned, **_elementwise(elementwise, storage),
          "HAS_PREV": has_prev, **_ddim_cx(mode, ddim), **_tiles_even(group, warps, even)}
    ptrs = tuple(k for k in sig if k.endswith("_ptr"))
    label = f"{op.label}" + (f" noise={noise.label}" + (" unaligned" if noise is NoiseSource.PHILOX and not philox_aligned
                                                        else "") + (" +mean" if write_mean else "")
                             if op is Op.ROLLOUT else "") + _elementwise_label(elementwise)
    return Specialization("step_partials_kernel", sig, cx, (ptrs + ("n_per_sample",)) if aligned else (), warps,
                          f"{mode_label(mode, ddim, has_prev)} {label} g{group}w{warps}" + (" even" if even else "")
                          + ("" if aligned else " unaligned-tensors"),
                          group * CHUNK_SIZE)


def _token_table(mode, per_token):
    """The elementwise steps' pre-pass (kernels/token.py): the header alone (a frozen mask without
    per-token sigmas) or with each (sample, token)'s records in ``mode``."""
    sig = {"pairs_ptr": "*fp32", "table_ptr": "*fp32", "sigmas_ptr": "*fp32", "step_ptr": "*i64", "n_tokens": "i32",
           "pairs_stride": "i32", "n_blocks": "i32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
           "last_index": "i32", **{f"{d}_{w}": ("i64" if w == "m" else "i32")
                                   for d in ("tok_inner", "tok_groups", "frozen_inner", "frozen_groups") for w in "ml"}}
    cx = {"MODE": int(mode), "PER_TOKEN": per_token, "BLOCK": _triton_ops.TOKEN_TABLE_BLOCK}
    return Specialization("token_table_kernel", sig, cx, ("pairs_ptr", "table_ptr", "sigmas_ptr", "step_ptr"), 4,
                          f"{mode.label}" + (" records" if per_token else " header"),
                          _triton_ops.TOKEN_TABLE_BLOCK)


def _finalize(mode, kind, mean, width, count_given=False, has_log=False):
    sig = {"partials_ptr": "*fp32", "sigmas_ptr": "*fp32", "step_ptr": "*i64", "value_ptr": "*fp32", "std_ptr": "*fp32",
           "count_ptr": "*fp32", "log_ptr": "*fp32",
           "n_partials": "i32", "numel_f": "fp32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
           "last_index": "i32", "clip_range": "fp32"}
    cx = {"MODE": int(mode), "KIND": int(kind), "MEAN": mean, "WIDTH": width, "LOG2_WIDTH": width.bit_length() - 1,
          "COUNT_GIVEN": count_given, "HAS_LOG": has_log, **_ddim_cx(mode, (Prediction.EPSILON, False))}
    warps = _triton_ops.finalize_warps(width)
    label = f"{mode.label} {kind.label} {'mean' if mean else 'sum'} width={width}" + (
        " +count" if count_given else "") + (" +log" if has_log else "")
    return Specialization("finalize_kernel", sig, cx, ("partials_ptr", "sigmas_ptr", "step_ptr", "value_ptr", "std_ptr"),
                          warps, label, width)


def _backward(storage, mode, kind, mean, needs, group, warps, elementwise=(), has_prev=False,
              ddim=(Prediction.EPSILON, False), even=False):
    sig = {
        "x_ptr": "*" + storage, "v_ptr": "*" + storage, "third_ptr": "*" + storage, "grad_ptr": "*fp32",
        "grad_x_ptr": "*" + storage, "grad_v_ptr": "*" + storage, "grad_third_ptr": "*" + storage,
        "sigmas_ptr": "*fp32", "step_ptr": "*i64", "count_ptr": "*fp32", "n_per_sample": "i32", "n_blocks": "i32",
        "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32", **_ELEMENTWISE_SIG,
        "prev_x0_ptr": "*" + storage, "grad_prev_ptr": "*" + storage, "last_index": "i32", "clip_range": "fp32",
    }
    need_x, need_v, need_third = needs
    cx = {"MODE": int(mode), "KIND": int(kind), "MEAN": mean, "IS_KL": kind is LogProbKind.KL, "NEED_X": need_x,
          "NEED_V": need_v, "NEED_THIRD": need_third, "BLOCK": group * CHUNK_SIZE, **_elementwise(elementwise, storage),
          "HAS_PREV": has_prev, "NEED_PREV": has_prev and kind is not LogProbKind.KL, **_ddim_cx(mode, ddim),
          **_tiles_even(group, warps, even)}
    ptrs = tuple(k for k in sig if k.endswith("_ptr"))
    grads = "+".join(n for n, on in zip(("x", "v", "third"), needs) if on)
    return Specialization("step_backward_kernel", sig, cx, ptrs + ("n_per_sample",), warps,
                          f"{mode_label(mode, ddim, has_prev)} {kind.label} {'mean' if mean else 'sum'} grads={grads} g{group}w{warps}"
                          + _elementwise_label(elementwise) + (" even" if even else ""), group * CHUNK_SIZE)


# Modes whose kernels differ from compiled ones in per-sample coefficients only (flash_sde is sde's path
# with another s; dpm_sde adds one read, p * x0_prev, under HAS_PREV): one specialization per op and
# switch, not the full matrix (CI time).
FEW_SPECIALIZATIONS = tuple(mode for mode in Mode if mode.rules.aot is Variants.FEW)  # flowrl.contract.MODE_RULES


def _few(storage, mode) -> Iterator[Specialization]:
    """The specializations of a FEW_SPECIALIZATIONS mode, on whole blocks (EVEN) at the launcher's
    configuration: the rollout (torch noise with the mean, Philox), the log-prob, the KL, their
    backward (gaussian mean) and finalize; dpm_sde's second order (HAS_PREV) for each op as well."""
    for has_prev in ((False, True) if mode is Mode.DPM_SDE else (False,)):
        fwd, philox, bwd = (_step_config(storage, philox=p, backward=b, second_order=has_prev)
                            for p, b in ((False, False), (True, False), (False, True)))
        kw = dict(has_prev=has_prev, even=True)
        yield _partials(storage, mode, Op.ROLLOUT, *fwd, rollout=TENSOR_MEAN, **kw)
        yield _partials(storage, mode, Op.ROLLOUT, *philox, rollout=PHILOX, **kw)
        yield _partials(storage, mode, Op.LOG_PROB, *fwd, **kw)
        yield _partials(storage, mode, Op.KL, *fwd, **kw)
        yield _backward(storage, mode, LogProbKind.GAUSSIAN, True, (True, True, True), *bwd, **kw)
        kl_bwd = _step_config(storage, backward=True)  # the KL's x0_prev terms cancel: not read
        yield _backward(storage, mode, LogProbKind.KL, True, (False, True, True), *kl_bwd, **kw)
    if storage == STORAGES[0]:
        yield _finalize(mode, LogProbKind.GAUSSIAN, True, 64)


def _ddim_cx(mode, ddim):
    """The ddim switches (PRED, CLIP); other modes compile with ddim's defaults, which they ignore."""
    prediction, clip = ddim if mode is Mode.DDIM else (Prediction.EPSILON, False)
    return {"PRED": int(prediction), "CLIP": clip}


def mode_label(mode, ddim=(Prediction.EPSILON, False), has_prev=False):
    """A specialization label's mode part: the mode, ddim's [prediction( clip)], " 2nd-order" with
    dpm_sde's previous x0 (``has_prev``)."""
    return mode.label + (f"[{ddim[0].label}{' clip' if ddim[1] else ''}]" if mode is Mode.DDIM else "") + (
        " 2nd-order" if has_prev else "")


# ddim's (prediction, clip) switch pairs: epsilon without the clip (Stable Diffusion's scheduler config,
# which DDPO's DDIMScheduler.from_config keeps: kvablack/ddpo-pytorch scripts/train.py @ 18294d8) and
# with it (DDIMScheduler's default) for every storage, v- and sample-prediction for bf16 only (the
# same code with other per-element formulas). The masked specializations take MASKED_DDIM_VARIANT.
DDIM_VARIANTS = {"bf16": ((Prediction.EPSILON, False), (Prediction.EPSILON, True), (Prediction.V_PREDICTION, False),
                          (Prediction.SAMPLE, True))}
DDIM_DEFAULT_VARIANTS = ((Prediction.EPSILON, False), (Prediction.EPSILON, True))
MASKED_DDIM_VARIANT = (Prediction.EPSILON, True)


def _ddim(storage) -> Iterator[Specialization]:
    """ddim's specializations, on whole blocks (EVEN) at the launcher's configuration: per (prediction,
    clip) pair, the rollout (torch noise with the mean, Philox, none at eta = 0), the log-prob, the KL
    and their backward (gaussian mean, KL), and the gaussian backward at one tile (below 4,096
    elements: its parts, step_backward_kernel's PARTS, at one tile too); masked, one variant per op;
    one finalize (ddim's finalize reads only the std)."""
    fwd, philox, bwd = (_step_config(storage, philox=p, backward=b)
                        for p, b in ((False, False), (True, False), (False, True)))
    wide = storage == "fp32"  # the launcher's element_config: ddim's float32 rollouts at WIDE_CONFIG
    sampled, philox = (_triton_ops.WIDE_CONFIG,) * 2 if wide else (fwd, philox)
    for ddim in DDIM_VARIANTS.get(storage, DDIM_DEFAULT_VARIANTS):
        kw, rkw = dict(ddim=ddim, even=True), dict(ddim=ddim, even=not wide)  # multi-warp programs stay masked
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, *sampled, rollout=TENSOR_MEAN, **rkw)
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, *philox, rollout=PHILOX, **rkw)
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, *sampled, rollout=NONE_MEAN, **rkw)  # eta = 0
        yield _partials(storage, Mode.DDIM, Op.LOG_PROB, *fwd, **kw)
        yield _partials(storage, Mode.DDIM, Op.KL, *_step_config(storage), **kw)
        yield _backward(storage, Mode.DDIM, LogProbKind.GAUSSIAN, True, (True, True, True), *bwd, **kw)
        if bwd != _launch_configs()[-1]:  # below 4,096 elements: one tile
            yield _backward(storage, Mode.DDIM, LogProbKind.GAUSSIAN, True, (True, True, True),
                            *_launch_configs()[-1], **kw)
        yield _backward(storage, Mode.DDIM, LogProbKind.KL, True, (ddim_kl_reads_sample(*ddim), True, True),
                        *_step_config(storage, backward=True), **kw)
    # masked (a sample size not a multiple of the block), one variant per op
    ddim = MASKED_DDIM_VARIANT
    if not wide:
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, *_step_config(storage, masked_rollout=True),
                        rollout=TENSOR_MEAN, ddim=ddim)
    yield _partials(storage, Mode.DDIM, Op.KL, *_step_config(storage), ddim=ddim)
    yield _backward(storage, Mode.DDIM, LogProbKind.GAUSSIAN, True, (True, True, True), *bwd, ddim=ddim)
    yield _backward(storage, Mode.DDIM, LogProbKind.KL, True, (ddim_kl_reads_sample(*ddim), True, True),
                    *_step_config(storage, backward=True), ddim=ddim)
    if storage == STORAGES[0]:
        yield _finalize(Mode.DDIM, LogProbKind.GAUSSIAN, True, 64)


def specializations(storage: str = "bf16", quick: bool = False) -> Iterator[Specialization]:
    """Every specialization the launchers request for latents stored as ``storage``, each once: each
    mode with every op, noise source (Philox from an aligned and an unaligned offset), mean-writing
    and log-prob kind x reduction at the launcher's configuration for large latents (step_config), on
    whole blocks (EVEN) and masked; one tile (below 4,096 elements) for the heaviest variants (the sde
    rollout with Philox noise and the mean, the sde log-prob and its backward); finalize widths from 2
    to MAX_FINALIZE_WIDTH; one variant without the JIT's alignment attributes; flowrl.losses' kernels.
    ``quick``: one specialization per kernel (the heaviest switches), for a fast check."""
    seen = set()
    for spec in _specializations(storage, quick):
        if (spec.kernel, spec.label) not in seen:
            seen.add((spec.kernel, spec.label))
            yield spec


def _specializations(storage, quick) -> Iterator[Specialization]:
    one_tile = _launch_configs()[-1]
    rollouts = [Rollout(NoiseSource.TENSOR, False, False), Rollout(NoiseSource.TENSOR, True, False),
                Rollout(NoiseSource.PHILOX, False, True), Rollout(NoiseSource.PHILOX, True, True),
                Rollout(NoiseSource.PHILOX, True, False), Rollout(NoiseSource.NONE, False, False),
                Rollout(NoiseSource.NONE, True, False)]
    sde = _step_config(storage)
    if quick:  # masked: heavier than whole blocks
        yield _partials(storage, Mode.SDE, Op.ROLLOUT, *_step_config(storage, philox=True, philox_mean=True),
                        rollout=PHILOX_MEAN)
        yield _finalize(Mode.CPS, LogProbKind.GAUSSIAN, True, 64)
        yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (True, True, True),
                        *_step_config(storage, backward=True))
        return
    for mode in Mode:
        if mode.rules.aot is Variants.DDIM:
            yield from _ddim(storage)
            continue
        if mode in FEW_SPECIALIZATIONS:  # coefficient-only variants of compiled paths: one of each op
            yield from _few(storage, mode)
            continue
        fwd, bwd = _step_config(storage), _step_config(storage, backward=True)
        # large latents: whole blocks (EVEN) at the launcher's configuration, then the masked variants
        # (a sample size not a multiple of the block); sde's every switch, one of each op elsewhere
        for even in (True, False):
            every = even or mode is Mode.SDE
            for rollout in rollouts:
                if not (every or rollout == PHILOX_MEAN):
                    continue
                if rollout.noise is NoiseSource.PHILOX and not rollout.philox_aligned:  # one variant, masked, at its own
                    if even:
                        yield _partials(storage, mode, Op.ROLLOUT, *_unaligned_philox_config(), rollout=rollout)
                    continue
                philox = rollout.noise is NoiseSource.PHILOX
                config = _step_config(storage, masked_rollout=not even, philox=philox,
                                      philox_mean=philox and rollout.write_mean)
                yield _partials(storage, mode, Op.ROLLOUT, *config, rollout=rollout, even=even)
            yield _partials(storage, mode, Op.LOG_PROB, *fwd, even=even)
            yield _partials(storage, mode, Op.KL, *fwd, even=even)
            for kind in LogProbKind:
                for mean in (True, False):
                    if every or (kind, mean) == (LogProbKind.GAUSSIAN, True):
                        needs = (False, True, True) if kind is LogProbKind.KL else (True, True, True)
                        yield _backward(storage, mode, kind, mean, needs, *bwd, even=even)
    for even in (True, False):
        yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False),
                        *_step_config(storage, backward=True), even=even)  # training's usual
    # below 4,096 elements (and where no tiles are taken): one tile, masked or not
    if sde != one_tile:
        for even in (True, False):
            yield _partials(storage, Mode.SDE, Op.ROLLOUT, *one_tile, rollout=PHILOX_MEAN, even=even)
            yield _partials(storage, Mode.SDE, Op.LOG_PROB, *one_tile, even=even)
            yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (True, True, True), *one_tile, even=even)
    # without the JIT's alignment attributes (an unaligned address or size): one tile
    for even in (True, False):
        yield _partials(storage, Mode.SDE, Op.LOG_PROB, *one_tile, aligned=False, even=even)
    # elementwise steps (per-token schedules, frozen masks): the heaviest rollout (Philox, the mean,
    # per-token coefficients and a mask), the recompute with both and with a mask alone, its backward,
    # at the launchers' configurations (flowrl.backends._triton_ops.element_config: float32 latents' forward
    # and one lookup per element, RUN 1, at WIDE_CONFIG), and Philox from an unaligned offset
    both, slow = ("token", "frozen"), ("token", "frozen", "run1")
    ew, wide = _triton_ops.ELEMENTWISE_CONFIG, _triton_ops.WIDE_CONFIG
    forward = wide if storage == "fp32" else ew
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, *forward, rollout=PHILOX_MEAN, elementwise=both)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, *forward, elementwise=both)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, *forward, elementwise=("frozen",))
    yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False), *ew, elementwise=both)
    run1 = _triton_ops.SLIM_CONFIG if storage == "fp32" else wide  # element_config: float32 latents with RUN 1
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, *run1, rollout=PHILOX_MEAN, elementwise=slow)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, *run1, elementwise=slow)
    yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False), *ew, elementwise=slow)
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, *_unaligned_philox_config(), rollout=PHILOX_UNALIGNED_MEAN,
                    elementwise=both)
    if storage == STORAGES[0]:  # the pre-pass reads float32 tables whatever the latents' dtype
        yield _token_table(Mode.SDE, False)
        for mode in (m for m in Mode if m.rules.per_token):
            yield _token_table(mode, True)
    if storage == STORAGES[0]:  # the finalize reads float32 partials whatever the latents' dtype
        yield _finalize(Mode.SDE, LogProbKind.GAUSSIAN, True, 64, count_given=True, has_log=True)
        yield _finalize(Mode.SDE, LogProbKind.GAUSSIAN, False, 64, count_given=True)
        for mode in (m for m in Mode if m.rules.aot is Variants.FULL):
            for kind in LogProbKind:
                for mean in (True, False):
                    yield _finalize(mode, kind, mean, 64)
        for width in (2, 1024, _triton_ops.MAX_FINALIZE_WIDTH):
            yield _finalize(Mode.SDE, LogProbKind.GAUSSIAN, True, width)
    yield from loss_specializations(storage)
