"""flowrl.losses' kernels' specializations (kernels/loss.py): the GRPO family's element pass and its
backward, and the forward-process losses' (DiffusionNFT, AWM, Diffusion-DPO, DGPO)."""
from __future__ import annotations

from typing import Iterator, NamedTuple

from flowrl.backends import _triton_losses, _triton_ops
from flowrl.contract import CHUNK_SIZE, LOG2_CHUNK_SIZE, KLSpace, LogProbKind, Mode

from .launches import (Specialization, _elementwise, _elementwise_label, _ELEMENTWISE_SIG, _launch_configs,
                       _unaligned_philox_config)


# the loss kernels' (blocks_magic, blocks_shift): flowrl.backends._triton_ops.division_magic's (m, l), m
# in [2**31, 2**32) (an int64 argument)
_BLOCK_DIVISION_SIG = {"blocks_magic": "i64", "blocks_shift": "i32"}


class KLReference(NamedTuple):
    """The GRPO kernels' KL switches: the space the KL to the reference is taken in (KL_SPACE) and
    whether the reference comes as its two CFG branches (REF_GUIDED)."""

    space: KLSpace = KLSpace.TRANSITION
    guided: bool = False


def _grpo_loss(storage, mode, has_ref, trust, group, warps, backward=False, kind=LogProbKind.GAUSSIAN, mean=True,
               kl=KLReference(), elementwise=(), philox_aligned=True):
    """flowrl.losses' GRPO-family element pass (kernels/loss.py) or its backward; trust: 0 none, 1 a
    given float32 mu_old, 2 mu_old replayed from Philox noise (``philox_aligned``: from an offset that
    is a multiple of 4; otherwise "unaligned" in the label); kl: the KL's space and the guided
    reference (``KLReference``); elementwise: as the step kernels' (per-token sigmas, a frozen mask;
    the backward reads the scored count)."""
    kl_space, guided = kl
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
    Their mode math is kernels/common.py's, compiled in every mode by the step kernels (steps.py)."""
    configs = _launch_configs()
    largest, smallest = configs[-1], configs[0]
    replay = _triton_losses.REPLAY_BACKWARD_CONFIG  # the replaying backward's own
    ew, slim, wide = _triton_ops.ELEMENTWISE_CONFIG, _triton_ops.SLIM_CONFIG, _triton_ops.WIDE_CONFIG

    for backward in (False, True):
        if not backward:  # the replaying backward runs at REPLAY_BACKWARD_CONFIG only
            yield _grpo_loss(storage, Mode.SDE, True, 2, *largest)
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(replay if backward else smallest),
                         backward=backward)
        # mu_old replayed from an offset that is not a multiple of 4 (a shard cut mid-quad): the forward at
        # UNALIGNED_PHILOX_CONFIG (element_config), the backward at REPLAY_BACKWARD_CONFIG
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(replay if backward else _unaligned_philox_config()),
                         backward=backward, philox_aligned=False)
        yield _grpo_loss(storage, Mode.CPS, True, 1, *largest, backward=backward, kind=LogProbKind.SQ_ERR, mean=False)
        yield _grpo_loss(storage, Mode.DANCE, False, 0, *largest, backward=backward, kind=LogProbKind.KERNEL)
        # the KL choices (KL_SPACE, REF_GUIDED): the velocity KL to a guided reference with a given mu_old,
        # and the transition KL to a guided reference beside the heaviest switch, mu_old replayed
        yield _grpo_loss(storage, Mode.SDE, True, 1, *largest, backward=backward,
                         kl=KLReference(KLSpace.VELOCITY, guided=True))
        yield _grpo_loss(storage, Mode.SDE, True, 2, *(replay if backward else largest),
                         backward=backward, kl=KLReference(guided=True))
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
