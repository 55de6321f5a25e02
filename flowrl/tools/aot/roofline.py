"""The static roofline: the minimum bytes each specialization moves per element (ELEMENT_TRAFFIC), the
bound instruction issue allows as a fraction of copy bandwidth (``roofline_bound``), the hot
specializations the targets apply to (``is_hot``) and their targets (``roofline_target``)."""
from __future__ import annotations

from typing import Dict, List

from flowrl.backends import _triton_losses, _triton_ops
from flowrl.contract import CHUNK_SIZE, Mode, NoiseSource, Op, Prediction
from flowrl.core.step_spec import ddim_kl_reads_sample

from .launches import _WIDTH, Specialization, _launch_configs, _step_config, _unaligned_philox_config
from .steps import specializations


# An H200 issues at most one warp instruction per clock per scheduler: 132 SMs x 4 schedulers x 32 lanes
# x 1.98 GHz thread-instructions per second; a device copy moves about 4.3e12 bytes per second. A
# specialization's bound, as a fraction of copy bandwidth, is (ISSUE_RATE / SASS per element) /
# (COPY_BANDWIDTH / bytes per element), not capped at 1: above 1 the kernel has instruction headroom.
ISSUE_RATE = 132 * 4 * 32 * 1.98e9
COPY_BANDWIDTH = 4.3e12


def _rollout(c):
    return c.get("OP") == int(Op.ROLLOUT)


def _clipped_kl_reads_x(c):
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


def bytes_per_element(spec: Specialization) -> int:
    """The minimum bytes ``spec`` moves per element (ELEMENT_TRAFFIC)."""
    return sum(_WIDTH[spec.signature[ptr]] for ptr, used in ELEMENT_TRAFFIC[spec.kernel] if used(spec.constexprs))


def roofline_bound(sass_per_element: float, bytes_per_element: float) -> float:
    """The fraction of copy bandwidth instruction issue allows (ISSUE_RATE, COPY_BANDWIDTH)."""
    return (ISSUE_RATE / sass_per_element) / (COPY_BANDWIDTH / bytes_per_element)


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
    if spec.kernel in ("finalize_kernel", "token_table_kernel") or not spec.aligned:
        return False
    cx = spec.constexprs
    # one lookup per element: a per-token layout with an odd inner, reported only
    if (cx.get("PER_TOKEN") or cx.get("HAS_FROZEN")) and cx["RUN"] == 1:
        return False
    config = _group_warps(spec)
    if cx.get("PER_TOKEN") or cx.get("HAS_FROZEN"):
        return config == tuple(_triton_ops.ELEMENTWISE_CONFIG)
    if cx.get("NOISE") == int(NoiseSource.PHILOX) and not cx["PHILOX_ALIGNED"]:
        return config == tuple(_unaligned_philox_config())
    if spec.kernel == "grpo_backward_kernel" and cx["TRUST"] == 2:  # replaying from an unaligned offset: rare
        return config == tuple(_triton_losses.REPLAY_BACKWARD_CONFIG) and cx["PHILOX_ALIGNED"]
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


def sass_fields(spec: Specialization, instructions, loops) -> Dict[str, object]:
    """A row's runtime loops, SASS per element (the count times the program's threads over its
    elements) and roofline bound (``roofline_bound``), from ``sass_count``'s (instructions, loops);
    None where not counted."""
    per_element = None if instructions is None else round(instructions * 32 * spec.num_warps / spec.elements, 2)
    nbytes = bytes_per_element(spec)
    return {"loops": loops, "sass_per_element": per_element,
            "bound": (None if per_element is None or loops or not nbytes  # the pre-pass's header alone moves none
                      else round(roofline_bound(per_element, nbytes), 3))}
