"""Ahead-of-time compile of flowrl's kernels for NVIDIA targets, on a machine without a GPU.

Triton's interpreter runs the kernels as Python and accepts code that real Triton rejects (a module
global that is not a ``tl.constexpr``, for one), so every kernel specialization the launchers can
request is also compiled to PTX and cubin for real targets through ``triton.compile(ASTSource(...),
target=GPUTarget(...))``; the wheel ships ``ptxas``, ``cuobjdump`` and ``nvdisasm``. Run it in a
process without ``TRITON_INTERPRET`` (under it ``@triton.jit`` makes interpreted functions); it
compiles into a fresh ``TRITON_CACHE_DIR`` (Triton's cache keys miss some settings, and a cached
build once hid a compile error)::

    python -m flowrl.kernels.aot [--arch 90 80] [--quick] [--sass] [--json | --markdown] [--jobs N]
    python -m flowrl.kernels.aot --update-docs docs/kernels.md     # the table, both triton versions

It fails (exit 1) on any compile error and on any local-memory use (register spills), and reports
per specialization: registers per thread, spill bytes, shared memory, how many of its global loads
and stores are 128-bit (the latents' vectorized accesses), barriers per program, and (``--sass``: disassembling costs ~0.4 s each) SASS
instructions per element. ``--update-docs`` runs the installed triton and triton 3.6.0 (from
``.venv/triton-3.6``, or ``FLOWRL_TRITON36``) and rewrites the table between the markers of the file.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Iterator, List, NamedTuple, Sequence

from flowrl.contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, KLSpace, LogProbKind, Mode, NoiseSource, Op, Prediction, Variants

STORAGES = ("bf16", "fp16", "fp32")
ARCHS = (90, 80)


class Specialization(NamedTuple):
    """One compile of one kernel: argument types (Triton's signature strings), constexpr values, the
    arguments the JIT marks divisible by 16 (pointers 16-byte aligned, integers multiples of 16), the
    launch's warps, a label, and the elements one program covers (for per-element counts)."""

    kernel: str
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    aligned: tuple
    num_warps: int
    label: str = ""
    elements: int = CHUNK_SIZE


def _launch_configs():
    """The distinct (chunks per program, num_warps) of the launcher's table."""
    from flowrl.backends._triton_ops import LAUNCH_TABLE

    return sorted({(group, warps) for _, group, warps in LAUNCH_TABLE})


def _step_config(storage, backward=False, masked_rollout=False, second_order=False, philox=False,
                 philox_mean=False):
    """The step kernels' launch configuration for large latents of ``storage`` (the launcher's
    step_config with 16-byte aligned latents): STEP_LAUNCH_TABLE's largest where tiles are taken
    (tiles_taken, bf16 / fp16), LAUNCH_TABLE's largest, one tile, elsewhere."""
    from flowrl.backends._triton_ops import STEP_LAUNCH_TABLE, tiles_taken

    if storage in ("bf16", "fp16") and tiles_taken(backward, masked_rollout, second_order, philox,
                                                      philox_mean):
        return STEP_LAUNCH_TABLE[-1][1:]
    return _launch_configs()[-1]


def _step_configs():
    """Every (chunks per program, num_warps) the step kernels' tables give."""
    from flowrl.backends._triton_ops import STEP_LAUNCH_TABLE

    return sorted({(group, warps) for _, group, warps in STEP_LAUNCH_TABLE} | set(_launch_configs()))


def _tiles_even(group, warps, even):
    """The step kernels' TILES (flowrl.backends._triton_ops.element_tiles) and EVEN switches."""
    from flowrl.backends._triton_ops import element_tiles

    return {"TILES": element_tiles(group, warps), "EVEN": even}


def _unaligned_philox_config():
    from flowrl.backends._triton_ops import UNALIGNED_PHILOX_CONFIG

    return UNALIGNED_PHILOX_CONFIG


# the compact per-token (sigma, sigma') table and frozen mask of an elementwise step, with their index math
_ELEMENTWISE_SIG = {"tok_ptr": "*fp32", "tok_inner": "i32", "tok_groups": "i32", "tok_stride": "i32",
                    "frozen_ptr": "*u8", "frozen_inner": "i32", "frozen_groups": "i32", "frozen_stride": "i32"}


def _elementwise(elementwise, storage):
    """The switches of an elementwise step: () for none, or a subset of ("token", "frozen"), and "run1"
    for one lookup per element (RUN 1: a table's inner is odd); otherwise RUN is a thread's 16-byte
    vector of ``storage`` (the launcher's ``token_run`` when every inner is a multiple of it)."""
    if not elementwise:  # RUN unused
        return {"PER_TOKEN": False, "HAS_FROZEN": False, "WEIGHTED": False, "RUN": 1}
    per_token = "token" in elementwise
    run = 1 if "run1" in elementwise else 16 // _WIDTH["*" + storage]
    return {"PER_TOKEN": per_token, "HAS_FROZEN": "frozen" in elementwise, "WEIGHTED": per_token, "RUN": run}


def _elementwise_label(elementwise):
    return "".join(" +" + name for name in elementwise)


def _partials(storage, mode, op, noise, write_mean, philox_aligned, group, warps, aligned=True, elementwise=(),
              has_prev=False, ddim=(Prediction.EPSILON, False), even=False):
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
    from flowrl.backends._triton_ops import TOKEN_TABLE_BLOCK

    sig = {"pairs_ptr": "*fp32", "table_ptr": "*fp32", "sigmas_ptr": "*fp32", "step_ptr": "*i64", "n_tokens": "i32",
           "pairs_stride": "i32", "n_blocks": "i32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
           "last_index": "i32", **{f"{d}_{w}": ("i64" if w == "m" else "i32")
                                   for d in ("tok_inner", "tok_groups", "frozen_inner", "frozen_groups") for w in "ml"}}
    cx = {"MODE": int(mode), "PER_TOKEN": per_token, "BLOCK": TOKEN_TABLE_BLOCK}
    return Specialization("token_table_kernel", sig, cx, ("pairs_ptr", "table_ptr", "sigmas_ptr", "step_ptr"), 4,
                          f"{mode.label}" + (" records" if per_token else " header"), TOKEN_TABLE_BLOCK)


def _finalize(mode, kind, mean, width, count_given=False, has_log=False):
    sig = {"partials_ptr": "*fp32", "sigmas_ptr": "*fp32", "step_ptr": "*i64", "value_ptr": "*fp32", "std_ptr": "*fp32",
           "count_ptr": "*fp32", "log_ptr": "*fp32",
           "n_partials": "i32", "numel_f": "fp32", "sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32",
           "last_index": "i32", "clip_range": "fp32"}
    cx = {"MODE": int(mode), "KIND": int(kind), "MEAN": mean, "WIDTH": width, "LOG2_WIDTH": width.bit_length() - 1,
          "COUNT_GIVEN": count_given, "HAS_LOG": has_log, **_ddim_cx(mode, (Prediction.EPSILON, False))}
    from flowrl.backends._triton_ops import finalize_warps

    warps = finalize_warps(width)
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


# the loss kernels' (blocks_magic, blocks_shift): flowrl.backends._triton_ops.division_magic's (m, l), m
# in [2**31, 2**32) (an int64 argument)
_BLOCK_DIVISION_SIG = {"blocks_magic": "i64", "blocks_shift": "i32"}


def _grpo_loss(storage, mode, has_ref, trust, group, warps, backward=False, kind=LogProbKind.GAUSSIAN, mean=True,
               kl_space=KLSpace.TRANSITION, guided=False, elementwise=(), philox_aligned=True):
    """flowrl.losses' GRPO-family element pass (kernels/loss.py) or its backward; trust: 0 none, 1 a
    given float32 mu_old, 2 mu_old replayed from Philox noise (``philox_aligned``: from an offset that
    is a multiple of 4; otherwise "unaligned" in the label); kl_space: the KL's KLSpace; guided: the
    reference as its two CFG branches (REF_GUIDED); elementwise: as the step kernels' (per-token sigmas,
    a frozen mask; the backward reads the scored count)."""
    sig = {"x_ptr": "*" + storage, "v_ptr": "*" + storage, "prev_ptr": "*" + storage, "ref_ptr": "*" + storage,
           "old_mean_ptr": "*" + ("fp32" if trust == 1 else storage)}
    if backward:
        sig.update({"grad_lp_ptr": "*fp32", "grad_kl_ptr": "*fp32", "grad_tr_ptr": "*fp32", "grad_v_ptr": "*" + storage})
    else:
        sig.update({"lp_partials_ptr": "*fp32", "kl_partials_ptr": "*fp32", "tr_partials_ptr": "*fp32"})
    sig.update({"sigmas_ptr": "*fp32", "step_ptr": "*i64", "seeds_ptr": "*i64", "stream_stride": "i32",
                "elem_offset": "i32", "n_per_sample": "i32"})
    sig.update({"n_blocks": "i32", "numel_f": "fp32"} if backward else {"n_chunks": "i32", "n_blocks": "i32"})
    sig.update(_BLOCK_DIVISION_SIG)
    sig.update({"sigma_one_tol": "fp32", "eta": "fp32", "sin_half_pi_eta": "fp32", "last_index": "i32"})
    sig.update({"ref_cond_ptr": "*" + storage, "ref_scale": "fp32", **_ELEMENTWISE_SIG})
    if backward:
        sig["count_ptr"] = "*fp32"
    cx = {"MODE": int(mode), "HAS_REF": has_ref, "TRUST": trust, "PHILOX_ALIGNED": trust == 2 and philox_aligned,
          "KL_SPACE": int(kl_space), "REF_GUIDED": guided, **_elementwise(elementwise, storage)}
    if backward:
        cx.update({"KIND": int(kind), "MEAN": mean, "BLOCK": group * CHUNK_SIZE})
    else:
        cx.update({"CHUNK": CHUNK_SIZE, "LOG2_CHUNK": LOG2_CHUNK_SIZE, "GROUP": group})
    ptrs = tuple(k for k in sig if k.endswith("_ptr"))
    name = "grpo_backward_kernel" if backward else "grpo_partials_kernel"
    label = f"{mode.label} ref={has_ref} trust={trust}" + (" unaligned" if trust == 2 and not philox_aligned else "") + (
        f" {kind.label} {'mean' if mean else 'sum'}" if backward else "") + f" g{group}w{warps}"
    if kl_space is not KLSpace.TRANSITION or guided:
        label += f" kl={kl_space.label}" + (" guided" if guided else "")
    label += _elementwise_label(elementwise)
    return Specialization(name, sig, cx, ptrs + ("n_per_sample",), warps, label, group * CHUNK_SIZE)


def _flow_loss(storage, loss, has_ref, group, warps, backward=False, even=False, philox=False, aligned=True,
               paired=True, noise_div=1):
    """flowrl.losses' forward-process element pass (loss 0 DiffusionNFT, 1 AWM, 2 Diffusion-DPO, 3 DGPO)
    or its backward; even: whole blocks (EVEN, no masks); philox: DPO / DGPO's eps drawn in the kernel
    (aligned: from an element offset that is a multiple of 4); paired: bfloat16 read as uint32 pairs
    (PAIRED: an even element count, 4-byte aligned rows); unpaired: an odd count or misaligned rows,
    compiled without the JIT's alignment attributes (as the launch sees them); noise_div: the Philox
    row's NOISE_DIV (1: DPO's "halves" pairs and DGPO; 2: "interleaved" pairs; 0: any (div, mod))."""
    sig = {k: "*" + storage for k in ("xt_ptr", "v_ptr", "other_ptr", "x0_ptr", "ref_ptr")}
    sig["t_ptr"] = "*fp32"
    sig.update({"grad_ptr": "*fp32", "grad_v_ptr": "*" + storage} if backward else {"partials_ptr": "*fp32"})
    sig["n_per_sample"] = "i32"
    sig.update({"n_blocks": "i32"} if backward else {"n_chunks": "i32", "n_blocks": "i32"})
    sig.update(_BLOCK_DIVISION_SIG)
    sig.update({"n_rows": "i32", "beta": "fp32", "one_minus_beta": "fp32", "one_plus_beta": "fp32"})
    sig.update({"seeds_ptr": "*i64", "stream_stride": "i32", "elem_offset": "i32", "noise_div": "i32",
                "noise_mod": "i32"})
    cx = {"LOSS": loss, "HAS_REF": has_ref, "EVEN": even, "PHILOX": philox, "PHILOX_ALIGNED": philox and aligned,
          "PAIRED": paired, "NOISE_DIV": noise_div if philox else 0}
    cx.update({"BLOCK": group * CHUNK_SIZE} if backward else {"CHUNK": CHUNK_SIZE, "LOG2_CHUNK": LOG2_CHUNK_SIZE,
                                                              "GROUP": group})
    ptrs = tuple(k for k in sig if k.endswith("_ptr"))
    name = "flow_backward_kernel" if backward else "flow_partials_kernel"
    label = f"{('nft', 'awm', 'dpo', 'dgpo')[loss]} ref={has_ref}" + (" noise=philox" if philox else "") + (
        " unaligned" if philox and not aligned else "") + (f" div{noise_div}" if philox and noise_div != 1 else "") + (
        " even" if even else "") + f" g{group}w{warps}" + (
        "" if paired else " unaligned-tensors")
    return Specialization(name, sig, cx, ptrs + ("n_per_sample",) if paired else (), warps, label, group * CHUNK_SIZE)


def loss_specializations(storage: str = "bf16") -> Iterator[Specialization]:
    """flowrl.losses' kernels (kernels/loss.py), sparingly: the heaviest switches (reference KL and
    mu_old replayed from Philox) at the largest and the smallest launch configuration (the replaying
    backward at its own, REPLAY_BACKWARD_CONFIG), a given mu_old,
    each log-prob kind's backward once, and the forward-process losses at the largest configuration.
    Their mode math is kernels/common.py's, compiled in every mode by the step kernels above."""
    configs = _launch_configs()
    largest, smallest = configs[-1], configs[0]
    from flowrl.backends._triton_losses import REPLAY_BACKWARD_CONFIG
    from flowrl.backends._triton_ops import ELEMENTWISE_CONFIG as ew
    from flowrl.backends._triton_ops import SLIM_CONFIG as slim
    from flowrl.backends._triton_ops import WIDE_CONFIG as wide

    for backward in (False, True):
        if not backward:  # the replaying backward runs at REPLAY_BACKWARD_CONFIG only
            yield _grpo_loss(storage, Mode.SDE, True, 2, *largest)
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(REPLAY_BACKWARD_CONFIG if backward else smallest),
                         backward=backward)
        # mu_old replayed from an offset that is not a multiple of 4 (a shard cut mid-quad): the forward at
        # UNALIGNED_PHILOX_CONFIG (element_config), the backward at REPLAY_BACKWARD_CONFIG
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(REPLAY_BACKWARD_CONFIG if backward else _unaligned_philox_config()),
                         backward=backward, philox_aligned=False)
        yield _grpo_loss(storage, Mode.CPS, True, 1, *largest, backward=backward, kind=LogProbKind.SQ_ERR, mean=False)
        yield _grpo_loss(storage, Mode.DANCE, False, 0, *largest, backward=backward, kind=LogProbKind.KERNEL)
        # the KL choices (KL_SPACE, REF_GUIDED): the velocity KL to a guided reference with a given mu_old,
        # and the transition KL to a guided reference beside the heaviest switch, mu_old replayed
        yield _grpo_loss(storage, Mode.SDE, True, 1, *largest, backward=backward, kl_space=KLSpace.VELOCITY,
                         guided=True)
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(REPLAY_BACKWARD_CONFIG if backward else largest),
                         backward=backward, guided=True)
        # per-token sigmas and a frozen mask (flowrl.backends._triton_ops.element_config: ELEMENTWISE_CONFIG, or
        # WIDE_CONFIG for float32 latents and one lookup per element): the heaviest switches (the KL,
        # mu_old replayed) with both, and a given mu_old with a frozen mask alone (GRPO-Guard's)
        config = wide if storage == "fp32" else ew
        yield _grpo_loss(storage, Mode.SDE, True, 2, *config, backward=backward, elementwise=("token", "frozen"))
        yield _grpo_loss(storage, Mode.SDE, False, 1, *config, backward=backward, elementwise=("frozen",))
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(slim if storage == "fp32" else wide), backward=backward,
                         elementwise=("token", "frozen", "run1"))
        # the forward-process losses with a tail block (masked) and on whole blocks (EVEN: latents of a
        # multiple of CHUNK_SIZE elements, the usual case), and unpaired (an odd element count or
        # misaligned rows: no uint32 pairs, no alignment); DPO / DGPO's eps also drawn in the kernel
        for even, paired in ((False, True), (True, True), (False, False)):
            kw = dict(backward=backward, even=even, paired=paired)
            config = largest if paired else wide  # unpaired: WIDE_CONFIG (no spill; _flow_noise_args)
            yield _flow_loss(storage, 0, True, *config, **kw)
            yield _flow_loss(storage, 1, False, *config, **kw)
            yield _flow_loss(storage, 2, False, *config, **kw)  # Diffusion-DPO
            yield _flow_loss(storage, 3, False, *config, **kw)  # DGPO, one reference
            yield _flow_loss(storage, 3, True, *config, **kw)  # DGPO, both references
            yield _flow_loss(storage, 2, False, *config, philox=True, **kw)
            yield _flow_loss(storage, 3, True, *config, philox=True, **kw)
        # DPO's "interleaved" pairs (NOISE_DIV 2) and any other (div, mod) (NOISE_DIV 0), on whole blocks
        for noise_div in (2, 0):
            yield _flow_loss(storage, 2, False, *largest, backward=backward, even=True, philox=True, noise_div=noise_div)
        # Philox from an unaligned offset (a sequence-parallel shard cut mid-quad): WIDE_CONFIG, unpaired
        # and never EVEN (flowrl/backends/_triton_losses.py)
        for loss, has_ref in ((2, False), (3, True)):
            yield _flow_loss(storage, loss, has_ref, *wide, backward=backward, philox=True, aligned=False,
                             paired=False)


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
        yield _partials(storage, mode, Op.ROLLOUT, NoiseSource.TENSOR, True, False, *fwd, **kw)
        yield _partials(storage, mode, Op.ROLLOUT, NoiseSource.PHILOX, False, True, *philox, **kw)
        yield _partials(storage, mode, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *fwd, **kw)
        yield _partials(storage, mode, Op.KL, NoiseSource.TENSOR, False, False, *fwd, **kw)
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
    from flowrl.backends._triton_ops import WIDE_CONFIG
    from flowrl.core.step_spec import ddim_kl_reads_sample

    fwd, philox, bwd = (_step_config(storage, philox=p, backward=b)
                        for p, b in ((False, False), (True, False), (False, True)))
    wide = storage == "fp32"  # the launcher's element_config: ddim's float32 rollouts at WIDE_CONFIG
    rollout, philox = (WIDE_CONFIG, WIDE_CONFIG) if wide else (fwd, philox)
    for ddim in DDIM_VARIANTS.get(storage, DDIM_DEFAULT_VARIANTS):
        kw, rkw = dict(ddim=ddim, even=True), dict(ddim=ddim, even=not wide)  # multi-warp programs stay masked
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, NoiseSource.TENSOR, True, False, *rollout, **rkw)
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, NoiseSource.PHILOX, False, True, *philox, **rkw)
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, NoiseSource.NONE, True, False, *rollout, **rkw)  # eta = 0
        yield _partials(storage, Mode.DDIM, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *fwd, **kw)
        yield _partials(storage, Mode.DDIM, Op.KL, NoiseSource.TENSOR, False, False,
                        *_step_config(storage), **kw)
        yield _backward(storage, Mode.DDIM, LogProbKind.GAUSSIAN, True, (True, True, True), *bwd, **kw)
        if bwd != _launch_configs()[-1]:  # below 4,096 elements: one tile
            yield _backward(storage, Mode.DDIM, LogProbKind.GAUSSIAN, True, (True, True, True),
                            *_launch_configs()[-1], **kw)
        yield _backward(storage, Mode.DDIM, LogProbKind.KL, True, (ddim_kl_reads_sample(*ddim), True, True),
                        *_step_config(storage, backward=True), **kw)
    # masked (a sample size not a multiple of the block), one variant per op
    ddim = MASKED_DDIM_VARIANT
    if not wide:
        yield _partials(storage, Mode.DDIM, Op.ROLLOUT, NoiseSource.TENSOR, True, False,
                        *_step_config(storage, masked_rollout=True), ddim=ddim)
    yield _partials(storage, Mode.DDIM, Op.KL, NoiseSource.TENSOR, False, False,
                    *_step_config(storage), ddim=ddim)
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
    rollouts = [(NoiseSource.TENSOR, False, False), (NoiseSource.TENSOR, True, False),
                (NoiseSource.PHILOX, False, True), (NoiseSource.PHILOX, True, True), (NoiseSource.PHILOX, True, False),
                (NoiseSource.NONE, False, False), (NoiseSource.NONE, True, False)]
    sde = _step_config(storage)
    if quick:  # masked: heavier than whole blocks
        yield _partials(storage, Mode.SDE, Op.ROLLOUT, NoiseSource.PHILOX, True, True,
                        *_step_config(storage, philox=True, philox_mean=True))
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
            for noise, write_mean, philox_aligned in rollouts:
                if not (every or (noise, write_mean, philox_aligned) == (NoiseSource.PHILOX, True, True)):
                    continue
                if noise is NoiseSource.PHILOX and not philox_aligned:  # one variant, masked, at its own
                    if even:
                        yield _partials(storage, mode, Op.ROLLOUT, noise, write_mean, False, *_unaligned_philox_config())
                    continue
                philox = noise is NoiseSource.PHILOX
                config = _step_config(storage, masked_rollout=not even, philox=philox,
                                      philox_mean=philox and write_mean)
                yield _partials(storage, mode, Op.ROLLOUT, noise, write_mean, philox_aligned, *config, even=even)
            yield _partials(storage, mode, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *fwd, even=even)
            yield _partials(storage, mode, Op.KL, NoiseSource.TENSOR, False, False, *fwd, even=even)
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
            yield _partials(storage, Mode.SDE, Op.ROLLOUT, NoiseSource.PHILOX, True, True, *one_tile, even=even)
            yield _partials(storage, Mode.SDE, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *one_tile, even=even)
            yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (True, True, True), *one_tile, even=even)
    # without the JIT's alignment attributes (an unaligned address or size): one tile
    for even in (True, False):
        yield _partials(storage, Mode.SDE, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *one_tile, aligned=False,
                        even=even)
    # elementwise steps (per-token schedules, frozen masks): the heaviest rollout (Philox, the mean,
    # per-token coefficients and a mask), the recompute with both and with a mask alone, its backward,
    # at the launchers' configurations (flowrl.backends._triton_ops.element_config: float32 latents' forward
    # and one lookup per element, RUN 1, at WIDE_CONFIG), and Philox from an unaligned offset
    both, slow = ("token", "frozen"), ("token", "frozen", "run1")
    from flowrl.backends._triton_ops import ELEMENTWISE_CONFIG as ew
    from flowrl.backends._triton_ops import SLIM_CONFIG
    from flowrl.backends._triton_ops import WIDE_CONFIG as wide

    forward = wide if storage == "fp32" else ew
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, NoiseSource.PHILOX, True, True, *forward, elementwise=both)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *forward, elementwise=both)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *forward, elementwise=("frozen",))
    yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False), *ew, elementwise=both)
    run1 = SLIM_CONFIG if storage == "fp32" else wide  # element_config: float32 latents with RUN 1
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, NoiseSource.PHILOX, True, True, *run1, elementwise=slow)
    yield _partials(storage, Mode.SDE, Op.LOG_PROB, NoiseSource.TENSOR, False, False, *run1, elementwise=slow)
    yield _backward(storage, Mode.SDE, LogProbKind.GAUSSIAN, True, (False, True, False), *ew, elementwise=slow)
    yield _partials(storage, Mode.SDE, Op.ROLLOUT, NoiseSource.PHILOX, True, False, *_unaligned_philox_config(),
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
        from flowrl.backends._triton_ops import MAX_FINALIZE_WIDTH

        for width in (2, 1024, MAX_FINALIZE_WIDTH):
            yield _finalize(Mode.SDE, LogProbKind.GAUSSIAN, True, width)
    yield from loss_specializations(storage)


def compile_specialization(spec: Specialization, arch: int = 90, kernel=None):
    """Compile ``spec`` for sm_{arch} with the launch options the backend uses (no FMA contraction);
    returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). ``kernel``:
    a @triton.jit function (default: flowrl.kernels.step's kernel named ``spec.kernel``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the AOT compile needs real @triton.jit functions: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flowrl.kernels import loss, step, token

    if kernel is None:  # the step kernels, then flowrl.losses' (kernels/loss.py)
        kernel = getattr(step, spec.kernel, None) or getattr(loss, spec.kernel, None) or getattr(token, spec.kernel)
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in kernel.arg_names}  # in argument order
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    from flowrl.backends._triton_ops import register_cap

    cx = spec.constexprs
    philox = cx.get("NOISE") == NoiseSource.PHILOX.value  # a step kernel's rollout drawing Philox noise
    cap = register_cap(cx.get("TILES", 1), Mode(cx["MODE"]) if philox else None,
                       4 if spec.signature.get("x_ptr") == "*fp32" else 2)
    options = backend.parse_options({"num_warps": spec.num_warps, "enable_fp_fusion": False, **cap})
    return triton.compile(source, target=target, options=options.__dict__)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")


# ------------------------------------------------------------------------------------ the roofline
# An H200 issues at most one warp instruction per clock per scheduler: 132 SMs x 4 schedulers x 32 lanes
# x 1.98 GHz thread-instructions per second; a device copy moves about 4.3e12 bytes per second. A
# specialization's bound, as a fraction of copy bandwidth, is (ISSUE_RATE / SASS per element) /
# (COPY_BANDWIDTH / bytes per element), not capped at 1: above 1 the kernel has instruction headroom.
ISSUE_RATE = 132 * 4 * 32 * 1.98e9
COPY_BANDWIDTH = 4.3e12


def _rollout(c):
    return c.get("OP") == int(Op.ROLLOUT)


def _clipped_kl_reads_x(c):
    from flowrl.core.step_spec import ddim_kl_reads_sample

    return c["MODE"] == int(Mode.DDIM) and ddim_kl_reads_sample(Prediction(c["PRED"]), c["CLIP"])


# The element traffic of each kernel: the per-element tensors it reads or writes, each with the
# condition (on the specialization's constexprs) under which it does; a tensor's width is its
# pointer's type in the signature (the storage dtype, or float32 for given noise, the mean and a given
# mu_old). The minimum traffic: the per-sample scalars, the compact per-token tables and masks (a few
# bytes per token, cache resident) and the chunk partials (4 bytes per 1,024 elements) are not counted.
ELEMENT_TRAFFIC = {
    "step_partials_kernel": (
        # the KL's c v - c v_ref (ddim's clipped KL reads x for x0_hat, but for prediction "sample")
        ("x_ptr", lambda c: c["OP"] != int(Op.KL) or _clipped_kl_reads_x(c)),
        ("v_ptr", lambda c: True),
        ("third_ptr", lambda c: c["NOISE"] == int(NoiseSource.TENSOR)),  # eps, x' or v_ref
        ("prev_out_ptr", _rollout),
        ("mean_out_ptr", lambda c: _rollout(c) and c["WRITE_MEAN"]),
        ("prev_x0_ptr", lambda c: c["HAS_PREV"]),
    ),
    "step_backward_kernel": (
        ("x_ptr", lambda c: not c["IS_KL"] or _clipped_kl_reads_x(c)),
        ("v_ptr", lambda c: True),
        ("third_ptr", lambda c: True),
        ("prev_x0_ptr", lambda c: c["HAS_PREV"] and not c["IS_KL"] and c["MODE"] != int(Mode.DDIM)),
        ("grad_x_ptr", lambda c: c["NEED_X"]),
        ("grad_v_ptr", lambda c: c["NEED_V"]),
        ("grad_third_ptr", lambda c: c["NEED_THIRD"]),
        ("grad_prev_ptr", lambda c: c["NEED_PREV"]),
    ),
    "grpo_partials_kernel": (
        ("x_ptr", lambda c: True), ("v_ptr", lambda c: True), ("prev_ptr", lambda c: True),
        ("ref_ptr", lambda c: c["HAS_REF"]), ("old_mean_ptr", lambda c: c["TRUST"] == 1),
        ("ref_cond_ptr", lambda c: c["HAS_REF"] and c["REF_GUIDED"]),
    ),
    "grpo_backward_kernel": (
        ("x_ptr", lambda c: True), ("v_ptr", lambda c: True), ("prev_ptr", lambda c: True),
        ("ref_ptr", lambda c: c["HAS_REF"]), ("old_mean_ptr", lambda c: c["TRUST"] == 1),
        ("ref_cond_ptr", lambda c: c["HAS_REF"] and c["REF_GUIDED"]),
        ("grad_v_ptr", lambda c: True),
    ),
    # the xt slot: NFT's x_t, DPO / DGPO's v_ref (the DPO backward does not read it); the ref slot: NFT's
    # v_ref, DGPO's second reference; other: v_old or eps (not read when PHILOX draws eps)
    "flow_partials_kernel": (
        ("xt_ptr", lambda c: c["LOSS"] != 1), ("v_ptr", lambda c: True), ("other_ptr", lambda c: not c["PHILOX"]),
        ("x0_ptr", lambda c: True), ("ref_ptr", lambda c: c["LOSS"] in (0, 3) and c["HAS_REF"]),
    ),
    "flow_backward_kernel": (
        ("xt_ptr", lambda c: c["LOSS"] in (0, 3)), ("v_ptr", lambda c: True),
        ("other_ptr", lambda c: not c["PHILOX"]), ("x0_ptr", lambda c: True),
        ("ref_ptr", lambda c: c["LOSS"] in (0, 3) and c["HAS_REF"]), ("grad_v_ptr", lambda c: True),
    ),
    "finalize_kernel": (("partials_ptr", lambda c: True),),  # its elements are the partials
    # its elements are tokens: a (sigma, sigma') pair read, a record written
    "token_table_kernel": (("pairs_ptr", lambda c: c["PER_TOKEN"]), ("pairs_ptr", lambda c: c["PER_TOKEN"]),
                           ("table_ptr", lambda c: c["PER_TOKEN"]), ("table_ptr", lambda c: c["PER_TOKEN"]),
                           ("table_ptr", lambda c: c["PER_TOKEN"]), ("table_ptr", lambda c: c["PER_TOKEN"])),
}
_WIDTH = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*u8": 1, "*i64": 8}


def bytes_per_element(spec: Specialization) -> int:
    """The minimum bytes ``spec`` moves per element (ELEMENT_TRAFFIC)."""
    return sum(_WIDTH[spec.signature[ptr]] for ptr, used in ELEMENT_TRAFFIC[spec.kernel] if used(spec.constexprs))


def roofline_bound(sass_per_element: float, bytes_per_element: float) -> float:
    """The fraction of copy bandwidth instruction issue allows (ISSUE_RATE, COPY_BANDWIDTH)."""
    return (ISSUE_RATE / sass_per_element) / (COPY_BANDWIDTH / bytes_per_element)


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_BRANCH = re.compile(r"\bBRA\b.*\b0x([0-9a-f]+)\s*$")


def cubin_text(cubin: bytes) -> bytes:
    """The machine code of a one-kernel cubin: its ``.text.<kernel>`` section (ELF64 section headers)."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strings = headers[names][4]
    texts = [cubin[offset:offset + size] for name, _, _, _, offset, size in headers
             if cubin[strings + name:cubin.index(b"\0", strings + name)].startswith(b".text.")]
    if len(texts) != 1:
        raise ValueError(f"expected one .text section in the cubin, found {len(texts)}")
    return texts[0]


def disassemble(texts: Sequence[bytes], arch: int = 90) -> List[str]:
    """The nvdisasm listing of each machine-code section (``cubin_text``), all from one nvdisasm call:
    its start-up (~0.7 s, tables it builds) is most of one kernel's disassembly. The sections go in
    concatenated as a raw SM{arch} instruction stream (128-bit instructions, branches PC-relative, so
    each decodes as in its cubin); the listing is split back at their offsets, and its branch targets
    are addresses in the concatenation (``sass_count`` compares them to the branch's own)."""
    if not texts:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "text.bin")
        with open(path, "wb") as f:
            f.write(b"".join(texts))
        listing = subprocess.run([_tool("nvdisasm"), "-b", "SM90a" if arch == 90 else f"SM{arch}", path],
                                 capture_output=True, text=True, check=True).stdout
    ends, start = [], 0
    for text in texts:
        start += len(text)
        ends.append(start)
    parts, k = [[] for _ in texts], 0
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        while int(m.group(1), 16) >= ends[k]:
            k += 1
        parts[k].append(line)
    return ["\n".join(part) for part in parts]


def sass_count(listing: str):
    """(instructions, runtime loops) of a kernel's listing (``disassemble``). Instructions: every
    instruction but the NOP padding and the self-branch after the final EXIT. A runtime loop is a
    branch to an earlier instruction (the self-branch excepted); with none, every instruction runs at
    most once per thread, so the count times the threads is an upper bound of the dynamic count (it
    includes the rarely taken slow paths of IEEE division and square root)."""
    count, loops = 0, 0
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or m.group(2).startswith("NOP"):
            continue
        count += 1
        target = _BRANCH.search(m.group(2))
        if target:
            at, to = int(m.group(1), 16), int(target.group(1), 16)
            if to == at:  # BRA to itself: the trap after EXIT
                count -= 1
            elif to < at:
                loops += 1
    return count, loops


def sass_of(compiled):
    """(instructions, runtime loops) of a compiled kernel (``sass_count``), for its target's arch."""
    return sass_count(disassemble([cubin_text(compiled.asm["cubin"])], compiled.metadata.target.arch)[0])


def _group_warps(spec: Specialization):
    cx = spec.constexprs
    return (cx["GROUP"] if "GROUP" in cx else cx["BLOCK"] // CHUNK_SIZE), spec.num_warps


def is_hot(spec: Specialization) -> bool:
    """The specializations the roofline targets apply to: every element kernel's specialization at
    the launch configuration large latents use, with the JIT's alignment attributes (every contiguous
    latent has them): the step kernels on whole blocks (EVEN) at the launcher's step_config
    (``_step_config``), the elementwise steps, Philox from an unaligned offset and flowrl.losses'
    kernels (the replaying backward at REPLAY_BACKWARD_CONFIG) at theirs, masked; elementwise steps with
    a token run of a 16-byte vector (RUN 1, an odd per-token ``inner``, is reported only); DPO / DGPO's
    Philox rows of any (div, mod) (NOISE_DIV 0, a layout flowrl.losses never makes) are reported only."""
    from flowrl.backends._triton_losses import REPLAY_BACKWARD_CONFIG

    if spec.kernel in ("finalize_kernel", "token_table_kernel") or not spec.aligned:
        return False
    cx = spec.constexprs
    if (cx.get("PER_TOKEN") or cx.get("HAS_FROZEN")) and cx["RUN"] == 1:  # one lookup per element: a per-token layout with an odd inner, reported only
        return False
    config = _group_warps(spec)
    if cx.get("PER_TOKEN") or cx.get("HAS_FROZEN"):
        from flowrl.backends._triton_ops import ELEMENTWISE_CONFIG

        return config == tuple(ELEMENTWISE_CONFIG)
    if cx.get("NOISE") == int(NoiseSource.PHILOX) and not cx["PHILOX_ALIGNED"]:
        return config == tuple(_unaligned_philox_config())
    if spec.kernel == "grpo_backward_kernel" and cx["TRUST"] == 2:  # replaying from an unaligned offset: rare
        return config == tuple(REPLAY_BACKWARD_CONFIG) and cx["PHILOX_ALIGNED"]
    if spec.kernel.startswith("flow") and cx["PHILOX"] and cx["NOISE_DIV"] == 0:  # no layout flowrl.losses makes
        return False
    if spec.kernel.startswith(("grpo", "flow")):
        return config == _launch_configs()[-1]
    storage = spec.signature["v_ptr"][1:]
    # large latents fill whole blocks (EVEN)
    partials = spec.kernel == "step_partials_kernel"
    philox = partials and cx["NOISE"] == int(NoiseSource.PHILOX)
    return cx["EVEN"] and config == tuple(_step_config(storage, not partials,
                                                       second_order=cx["HAS_PREV"] and not cx.get("IS_KL"),
                                                       philox=philox,
                                                       philox_mean=philox and cx["WRITE_MEAN"]))


def roofline_target(spec: Specialization):
    """The bound (fraction of copy bandwidth) a hot bf16 / fp16 specialization must reach (issue 21);
    None for the rest (fp32 moves twice the bytes and is reported only)."""
    if not is_hot(spec) or spec.signature["v_ptr"] == "*fp32":
        return None
    cx = spec.constexprs
    if spec.kernel.startswith("grpo"):
        return 1.0 if cx["TRUST"] == 2 else 2.0
    if spec.kernel.startswith("flow"):
        # eps drawn in the kernel (DPO / DGPO): the replayed mu_old's class. Philox and an exact
        # Box-Muller take about 33 SASS per element before any loss math; 2.0 at 6 bytes allows 23.3
        return 1.0 if cx["PHILOX"] else 2.0
    if cx.get("NOISE") == int(NoiseSource.PHILOX) and cx.get("OP") == int(Op.ROLLOUT):
        return 1.0 if cx["PHILOX_ALIGNED"] else 0.7
    if cx["PER_TOKEN"] or cx["HAS_FROZEN"]:
        return 1.5
    if cx["MODE"] == int(Mode.DDIM):
        return 2.0
    return 3.0


def hot_specializations(storage: str = "bf16") -> List[Specialization]:
    """The hot specializations of ``storage`` (``is_hot``), each once."""
    seen = {}
    for spec in specializations(storage):
        if is_hot(spec):
            seen.setdefault((spec.kernel, spec.label), spec)
    return list(seen.values())


def analyze(compiled, spec: Specialization, sass: bool = False) -> Dict[str, object]:
    """Registers, spills, shared memory (cuobjdump's resource usage of the cubin), the global loads and
    stores in the PTX and how many are 128-bit (the latents' vectorized accesses; the per-sample
    scalars are narrower), barriers in the PTX, the minimum bytes moved per element
    (``bytes_per_element``), and with ``sass`` the SASS instructions per element of the program
    (``sass_of``) and the roofline bound (``sass_fields``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    widths = {"ld": [], "st": []}
    for kind, vec, bits in _GLOBAL_ACCESS.findall(compiled.asm["ptx"]):
        widths[kind].append(int(vec or 1) * int(bits))
    wide = {kind: sum(w == 128 for w in ws) for kind, ws in widths.items()}
    row = {
        "registers": int(fields.get("REG", 0)), "spill_bytes": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
        "shared_bytes": int(compiled.metadata.shared), "loads": len(widths["ld"]), "loads_128": wide["ld"],
        "stores": len(widths["st"]), "stores_128": wide["st"],
        "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", compiled.asm["ptx"])),
        "bytes_per_element": bytes_per_element(spec), "target": roofline_target(spec),
    }
    row.update(sass_fields(spec, *(sass_of(compiled) if sass else (None, None))))
    return row


def sass_fields(spec: Specialization, instructions, loops) -> Dict[str, object]:
    """A row's runtime loops, SASS per element (the count times the program's threads over its
    elements) and roofline bound (``roofline_bound``), from ``sass_count``'s (instructions, loops);
    None where not counted."""
    per_element = None if instructions is None else round(instructions * 32 * spec.num_warps / spec.elements, 2)
    nbytes = bytes_per_element(spec)
    return {"loops": loops, "sass_per_element": per_element,
            "bound": (None if per_element is None or loops or not nbytes  # the pre-pass's header alone moves none
                      else round(roofline_bound(per_element, nbytes), 3))}


def _run_one(job):
    """One specialization compiled and analyzed; where its SASS is to be counted, its machine code
    rides along (``_text``) for ``check``'s batched disassembly."""
    spec, storage, arch, sass = job
    import triton

    row = {"kernel": spec.kernel, "storage": storage, "arch": f"sm_{arch}", "triton": triton.__version__,
           "label": spec.label, "num_warps": spec.num_warps}
    try:
        compiled = compile_specialization(spec, arch)
        row.update(analyze(compiled, spec))
        if sass:
            row["_text"] = cubin_text(compiled.asm["cubin"])
    except Exception as exc:  # report every failure, then fail the run
        lines = str(exc).strip().splitlines()
        row.update(ok=False, error=f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500])
    return row


def _count_sass(work, rows, jobs):
    """The SASS fields of the rows whose machine code rode along, disassembled in ``jobs`` batches per
    arch (``disassemble``: one nvdisasm start-up per batch, not per kernel), run side by side."""
    from concurrent.futures import ThreadPoolExecutor

    batches = []
    for arch in sorted({job[2] for job in work}):
        todo = [k for k, (job, row) in enumerate(zip(work, rows)) if job[2] == arch and "_text" in row]
        size = max(1, -(-len(todo) // max(1, jobs)))
        batches += [(arch, todo[i:i + size]) for i in range(0, len(todo), size)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        listings = pool.map(lambda b: disassemble([rows[k].pop("_text") for k in b[1]], b[0]), batches)
        for (_, ks), parts in zip(batches, listings):
            for k, listing in zip(ks, parts):
                rows[k].update(sass_fields(work[k][0], *sass_count(listing)))


def _verdict(row):
    """ok, or the error: a compile failure (already set), register spills, runtime loops."""
    if "ok" in row:
        return row
    row["ok"] = row["spill_bytes"] == 0 and not row["loops"]
    if row["spill_bytes"]:
        row["error"] = f"{row['spill_bytes']} bytes of local memory (register spills)"
    elif row["loops"]:
        row["error"] = f"{row['loops']} runtime loops (backward branches): SASS per element is not a dynamic count"
    return row


def check(archs: Sequence[int] = ARCHS, storages: Sequence[str] = STORAGES, quick: bool = False,
          jobs: int = 1, sass: bool = False, hot: bool = False, match: Sequence[str] = (),
          sass_hot: bool = False, spot_archs: Sequence[int] = ()) -> List[Dict[str, object]]:
    """Compile and analyze every specialization (``hot``: the hot ones only, ``hot_specializations``;
    ``match``: only those whose "kernel: label" contains one of the substrings); one result dict per
    (specialization, storage, arch). ``sass``: count the SASS of each; ``sass_hot``: of the hot ones
    on sm_90 only (the roofline's rows, from the same compile as the rest: tests/kernels/test_compile.py);
    ``spot_archs``: the archs of ``archs`` compiled for a spot check only, the hot bf16 specializations."""
    work = [(spec, storage, arch, sass or (sass_hot and arch == 90 and is_hot(spec)))
            for arch in archs for storage in storages if arch not in spot_archs or storage == "bf16"
            for spec in (hot_specializations(storage) if hot or arch in spot_archs
                         else specializations(storage, quick))
            if not match or any(m in f"{spec.kernel}: {spec.label}" for m in match)]
    if jobs <= 1:
        rows = [_run_one(job) for job in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_run_one, work, chunksize=4))
    _count_sass(work, rows, jobs)
    return [_verdict(row) for row in rows]


def summarize(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (kernel, arch): specializations, failures, and the range of each measured quantity."""
    groups: Dict[tuple, List[Dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((row["kernel"], row["arch"], row["triton"]), []).append(row)
    out = []
    for (kernel, arch, version), members in sorted(groups.items()):
        good = [r for r in members if "registers" in r]

        def span(key):
            values = [r[key] for r in good if r[key] is not None]
            return (min(values), max(values)) if values else (None, None)
        out.append({"kernel": kernel, "arch": arch, "triton": version, "compiled": len(good),
                    "failed": sum(not r["ok"] for r in members), "registers": span("registers"),
                    "spill_bytes": span("spill_bytes"), "shared_bytes": span("shared_bytes"),
                    "loads_128": span("loads_128"), "loads": span("loads"), "stores_128": span("stores_128"),
                    "stores": span("stores"),
                    "barriers": span("barriers"), "sass_per_element": span("sass_per_element"),
                    "bytes_per_element": span("bytes_per_element"), "bound": span("bound")})
    return out


def markdown(rows: List[Dict[str, object]]) -> str:
    """The per-kernel table of docs/kernels.md."""
    def fmt(pair):
        lo, hi = pair
        return "-" if lo is None else (f"{lo}" if lo == hi else f"{lo}-{hi}")
    lines = ["| kernel | target | triton | compiled | failed | registers | spill B | shared B | 128-bit loads (of) "
             "| 128-bit stores (of) | barriers | SASS / element | bytes / element | bound |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summarize(rows):
        lines.append(f"| `{s['kernel']}` | {s['arch']} | {s['triton']} | {s['compiled']} | {s['failed']} | "
                     f"{fmt(s['registers'])} | {fmt(s['spill_bytes'])} | {fmt(s['shared_bytes'])} | "
                     f"{fmt(s['loads_128'])} ({fmt(s['loads'])}) | {fmt(s['stores_128'])} ({fmt(s['stores'])}) | "
                     f"{fmt(s['barriers'])} | "
                     f"{fmt(s['sass_per_element'])} | {fmt(s['bytes_per_element'])} | {fmt(s['bound'])} |")
    return "\n".join(lines)


def roofline_markdown(rows: List[Dict[str, object]], storage: str = "bf16", arch: str = "sm_90") -> str:
    """The hot specializations of ``storage`` on ``arch``, one line each, a column pair per triton
    version: SASS per element and the bound (fraction of copy bandwidth), against the target."""
    rows = [r for r in rows if r["storage"] == storage and r["arch"] == arch and r.get("target") is not None]
    versions = sorted({r["triton"] for r in rows})
    by = {(r["kernel"], r["label"], r["triton"]): r for r in rows}
    keys = sorted({(r["kernel"], r["label"]) for r in rows})
    head = "| kernel | specialization | bytes / element | " + " | ".join(
        f"SASS / element ({v}) | bound ({v})" for v in versions) + " | target |"
    lines = [head, "|" + " --- |" * (4 + 2 * len(versions))]
    for kernel, label in keys:
        cells = []
        first = by[(kernel, label, versions[0])]
        for v in versions:
            r = by.get((kernel, label, v), {})
            bound = r.get("bound")
            mark = "" if bound is None or bound >= first["target"] else " (below)"
            cells += [f"{r.get('sass_per_element')}", f"{bound}{mark}"]
        lines.append(f"| `{kernel}` | {label} | {first['bytes_per_element']} | " + " | ".join(cells)
                     + f" | {first['target']} |")
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- aot-table:start -->", "<!-- aot-table:end -->"
ROOFLINE_START, ROOFLINE_END = "<!-- roofline-table:start -->", "<!-- roofline-table:end -->"


def markdown_rows(text: str, start: str, end: str) -> List[Dict[str, str]]:
    """The rows of the markdown table between the markers ``start`` and ``end`` of ``text`` (the tables
    ``update_docs`` writes), each {column heading: cell}; empty without the markers."""
    if start not in text or end not in text:
        return []
    lines = [ln for ln in text.split(start, 1)[1].split(end, 1)[0].strip().splitlines() if ln.startswith("|")]

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]
    head = cells(lines[0]) if lines else []
    return [dict(zip(head, cells(line))) for line in lines[2:]]


def triton36_path() -> str:
    """Where ./run installs triton 3.6.0: <checkout>/.venv/triton-3.6 (this file is <checkout>/kernels/aot.py
    in the editable install), or FLOWRL_TRITON36."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("FLOWRL_TRITON36", os.path.join(root, ".venv", "triton-3.6"))


def _replace_between(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def update_docs(path: str, archs: Sequence[int], jobs: int) -> int:
    """Rows for the installed triton (here) and triton 3.6.0 (a subprocess with its wheel first on
    PYTHONPATH), with the hot specializations' SASS counts on sm_90 (tests/kernels/test_compile.py's run); the
    summary and the roofline table replace the text between their markers in ``path``."""
    rows = check(archs, jobs=jobs, sass_hot=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (triton36_path(), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-m", "flowrl.kernels.aot", "--json", "--sass-hot", "--jobs", str(jobs),
                          "--arch", *map(str, archs)], env=env, capture_output=True, text=True)
    if not res.stdout.strip():
        print(res.stderr[-3000:], file=sys.stderr)
        return 1
    old_rows = json.loads(res.stdout.strip().splitlines()[-1])
    if {row["triton"] for row in old_rows} != {"3.6.0"}:
        raise RuntimeError(f"expected triton 3.6.0 from {triton36_path()}; got {sorted({r['triton'] for r in old_rows})}")
    rows += old_rows
    with open(path) as f:
        text = f.read()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{path} has no {TABLE_START} ... {TABLE_END} markers")
    text = _replace_between(text, TABLE_START, TABLE_END, markdown(rows))
    if ROOFLINE_START in text:
        text = _replace_between(text, ROOFLINE_START, ROOFLINE_END, roofline_markdown(rows))
    with open(path, "w") as f:
        f.write(text)
    failed = [row for row in rows if not row["ok"]]
    print(f"{len(rows)} specializations, {len(failed)} failed; table written to {path}")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="SM versions (default: 90 80)")
    parser.add_argument("--quick", action="store_true", help="one specialization per kernel and storage dtype")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: all cores)")
    parser.add_argument("--sass", action="store_true", help="also count SASS instructions per element")
    parser.add_argument("--hot", action="store_true", help="only the hot specializations (roofline targets)")
    parser.add_argument("--sass-hot", action="store_true",
                        help="count SASS instructions per element of the hot specializations on sm_90 only")
    parser.add_argument("--spot-arch", type=int, nargs="+", default=[], metavar="ARCH",
                        help="of --arch, the SM versions compiled for the hot bf16 specializations only")
    parser.add_argument("--storage", nargs="+", default=list(STORAGES), choices=STORAGES, help="latent dtypes")
    parser.add_argument("--roofline", action="store_true",
                        help="print the hot specializations' roofline table (implies --sass)")
    parser.add_argument("--match", nargs="+", default=[], metavar="SUBSTRING",
                        help="only the specializations whose 'kernel: label' contains one of these")
    parser.add_argument("--json", action="store_true", help="print every result as one JSON line")
    parser.add_argument("--markdown", action="store_true", help="print the per-kernel summary table")
    parser.add_argument("--update-docs", metavar="PATH", help="rewrite the table in PATH (both triton versions)")
    args = parser.parse_args(argv)
    # fresh: no cached build hides an error; removed at exit (a full run leaves hundreds of MB)
    os.environ["TRITON_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="flowrl-aot-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    if args.update_docs:
        return update_docs(args.update_docs, args.arch, args.jobs)
    rows = check(args.arch, args.storage, quick=args.quick, jobs=args.jobs, sass=args.sass or args.roofline,
                 hot=args.hot, match=args.match, sass_hot=args.sass_hot, spot_archs=args.spot_arch)
    if args.json:
        print(json.dumps(rows))
    elif args.roofline:
        for storage in args.storage:
            for arch in args.arch:
                print(f"\n{storage}, sm_{arch}:\n" + roofline_markdown(rows, storage, f"sm_{arch}"))
    elif args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            status = "ok" if row["ok"] else f"FAILED {row['error']}"
            details = "" if "registers" not in row else (
                f" regs {row['registers']} spill {row['spill_bytes']} smem {row['shared_bytes']} "
                f"ld128 {row['loads_128']}/{row['loads']} st128 {row['stores_128']}/{row['stores']} bar {row['barriers']} "
                f"sass/elem {row['sass_per_element']} bytes/elem {row['bytes_per_element']} bound {row['bound']}")
            print(f"{row['kernel']:21s} {row['storage']:4s} {row['arch']} {row['label']:45s} {status}{details}")
        print(markdown(rows), file=sys.stderr)
    failed = [row for row in rows if not row["ok"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} specializations failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
