"""Bytes and bounds (bench/run.py): what each op moves, the minimum (``min_bytes``, ``loss_min_bytes``) and
flowrl's kernels' traffic model (``kernel_bytes``, ``loss_kernel_bytes``); a row's bytes per element and rates
(``set_bytes``, ``set_rates``); and the static roofline bound of the op's kernels (docs/kernels.md's table)."""
from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Dict, List, Tuple

import baseline
from cases import LOSS_OPS, MODELLED_IMPLS, NOISE_SOURCES, OPS, TREE_OPS, base_op

from flowrl.contract import CHUNK_SIZE

if TYPE_CHECKING:
    from table import Row


def _check_variant(op: str, noise: str, write_mean: bool) -> None:
    op = base_op(op)
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if noise not in NOISE_SOURCES:
        raise ValueError(f"noise must be one of {NOISE_SOURCES}; got {noise!r}")
    if op != "rollout" and (noise != "tensor" or write_mean):
        raise ValueError(f"noise= and write_mean= are rollout options; got them for {op!r}")


def min_bytes(op: str, numel: int, batch: int, itemsize: int, noise: str = "tensor", write_mean: bool = False,
              second_order: bool = False) -> int:
    """Bytes an ideal kernel moves: each input read once, each output written once (N = numel
    elements of ``itemsize`` = s bytes, B = batch samples).

    rollout: reads x, v (2Ns) and, with noise="tensor", the float32 noise (4N; Philox noise and a
    noiseless step read none), writes x' (Ns), the log-prob [B] and, with write_mean, the float32 mean
    (4N). recompute_fwd: reads x, v, x' (3Ns), writes [B]. recompute_fwd_bwd: reads x, v, x' and the
    grad_output [B], writes the value [B] and grad_v (4Ns + 8B). kl_fwd_bwd: reads v and v_ref, which
    is all the KL depends on (mu - mu_ref = c v - c v_ref: x cancels), and the grad_output [B], writes
    the value [B] and grad_v (3Ns + 8B). The table recorded on 2026-11-29 (bench/results/) counted x for the
    KL too (4Ns + 8B). ``second_order`` (dpm_sde with prev_x0_pred): the rollout and the log-prob also
    read the previous x0 prediction (+Ns; the KL does not: it cancels)."""
    _check_variant(op, noise, write_mean)
    op = base_op(op)
    extra = numel * itemsize if second_order and op != "kl_fwd_bwd" else 0
    if op == "rollout":
        return numel * (3 * itemsize + (4 if noise == "tensor" else 0) + (4 if write_mean else 0)) + 4 * batch + extra
    if op == "recompute_fwd":
        return numel * 3 * itemsize + 4 * batch + extra
    if op == "recompute_fwd_bwd":
        return numel * 4 * itemsize + 8 * batch + extra
    return numel * 3 * itemsize + 8 * batch  # kl_fwd_bwd


def kernel_bytes(op: str, numel: int, batch: int, itemsize: int, noise: str = "tensor",
                 write_mean: bool = False, second_order: bool = False) -> int:
    """Bytes flowrl's Triton kernels move for ``op`` by their launch design (flowrl/backends/_triton_ops.py,
    kernels/step.py), the traffic model set beside ``min_bytes``: GB/s over these bytes, against the
    copy bandwidth, says how close the kernels run to the bandwidth limit; GB/s over ``min_bytes``
    says how close their design plus that speed come to an ideal kernel. Update it here when the
    launch design changes.

    N = numel elements of s = itemsize bytes, B = batch samples, P = ceil(N / B / CHUNK_SIZE) chunk
    partials per sample (CHUNK_SIZE = 1024). The element kernels read and write each tensor once per
    CHUNK_SIZE-element chunk of one sample; whether a program covers one chunk or several, each chunk
    keeps its own float32 partial, so the bytes are the same.

    - forward, step_partials_kernel (every op): reads v (Ns) and
      rollout: x (Ns) and the float32 noise (4N) with noise="tensor"; nothing for the noise with
      "philox" (drawn in registers) or "none" (no eps); writes x' (Ns) and, with write_mean, the
      float32 mean (4N);
      recompute (log-prob): x and the stored x' (2Ns);
      kl: v_ref (Ns) only (mu - mu_ref = c v - c v_ref: x is not read);
      and writes one float32 partial per chunk (4BP).
    - finalize_kernel, one program per sample: reads its P partials (4BP; the lanes padding them to
      a power of two are masked, no traffic), writes the value and the std (8B).
    - backward, step_backward_kernel (the *_fwd_bwd ops, grad w.r.t. model_output only): reads the
      incoming grad [B] (4B), re-reads the forward's element inputs (x, v, x': 3Ns; kl: v, v_ref:
      2Ns), writes grad_v (Ns) and no grad that was not asked for.

    So every op moves its minimum plus 8BP (the partials, written and read back) plus 4B (the std
    that finalize also writes), and the fwd+bwd ops also the backward's second read of the inputs
    (3Ns, kl 2Ns): nothing is saved between forward and backward, which is what keeps their peak
    memory at the inputs plus one gradient.

    Not counted, as in ``min_bytes``: the sigma table, the step indices and Philox seeds (a few bytes
    per sample, read from cache after the first program), and, above MAX_FINALIZE_WIDTH (16384)
    partials per sample (16M elements), the torch adds that pre-combine them (under 1% of the
    element traffic). ``second_order`` (dpm_sde with prev_x0_pred): the element kernels of the rollout
    and the log-prob also read the previous x0 prediction (Ns forward, Ns again in the backward)."""
    _check_variant(op, noise, write_mean)
    op = base_op(op)
    s, n, b = itemsize, numel, batch
    extra = n * s if second_order and op != "kl_fwd_bwd" else 0
    chunks = b * -(-(n // b) // CHUNK_SIZE)  # B * P, P = ceil(N / B / CHUNK_SIZE)
    partials = 4 * chunks + 4 * chunks  # written by the element kernel, read by finalize
    finalize = 8 * b  # value and std, float32 [B]
    if op == "rollout":
        forward = n * (2 * s + (4 if noise == "tensor" else 0) + s + (4 if write_mean else 0)) + extra
        return forward + partials + finalize
    forward = n * (2 * s if op == "kl_fwd_bwd" else 3 * s) + extra
    if op == "recompute_fwd":
        return forward + partials + finalize
    backward = 4 * b + forward + n * s  # grad [B] in, the forward's inputs again, grad_v out
    return forward + partials + finalize + backward


# ---- the losses suite's byte model (bench/loss_suite.py) -----------------------------------------

# element tensors each op reads (the inputs the loss depends on), besides writing grad_v: x, v, x', v_ref |
# x, v, x' | x_t, v, v_old, x0, v_ref | v, eps, x0 | v, v_ref, eps, x0 | v, v_ref, v_old, eps, x0 |
# x, v, x', v_ref | x, v, x', uncond, cond | the video's x, v, x' (the audio's, a quarter of the elements,
# are not counted in the per-element bytes)
LOSS_INPUTS = {"grpo_loss": 4, "grpo_guard": 3, "nft_loss": 5, "awm_loss": 3, "dpo_loss": 4, "dgpo_loss": 5,
               "grpo_velocity_kl": 4, "grpo_guided_ref": 5, "grpo_joint": 3}
LOSS_SUMS = {"grpo_loss": 2, "grpo_guard": 2, "nft_loss": 5, "awm_loss": 1, "dpo_loss": 2,
             "dgpo_loss": 5, "grpo_velocity_kl": 2, "grpo_guided_ref": 2, "grpo_joint": 1}  # per-sample sums
LOSS_BACKWARD_INPUTS = {"dpo_loss": 3}  # the backward's reads where fewer than the forward's (DPO: v, eps, x0)


def loss_min_bytes(op: str, numel: int, batch: int, itemsize: int) -> int:
    """An ideal fused loss with its backward: each element input read once (LOSS_INPUTS), grad_v
    written once, plus the per-sample inputs (old log-prob, advantages: 8B). The eager grpo_guard also
    reads the stored float32 mean (4N), which the replaying flowrl op does not need."""
    if op not in LOSS_OPS:
        raise ValueError(f"unknown loss op {op!r}")
    return numel * (LOSS_INPUTS[op] + 1) * itemsize + 8 * batch


def loss_kernel_bytes(op: str, numel: int, batch: int, itemsize: int) -> int:
    """Bytes flowrl's loss kernels move (kernels/loss.py, flowrl/backends/_triton_losses.py): the forward
    element pass reads the LOSS_INPUTS tensors (Ns each) and writes LOSS_SUMS float32 partial sets
    (4BP each), read back by the finalize (8BP each with the write); the backward re-reads the inputs
    and writes grad_v (Ns), reading the per-sample grads (4B per sum). Per-sample [B] scalars besides
    are not counted (tens of bytes per sample)."""
    s, n, b = itemsize, numel, batch
    chunks = b * -(-(n // b) // CHUNK_SIZE)
    sums = LOSS_SUMS[op]
    forward = n * LOSS_INPUTS[op] * s + 8 * chunks * sums
    backward = n * LOSS_BACKWARD_INPUTS.get(op, LOSS_INPUTS[op]) * s + n * s + 4 * b * sums
    return forward + backward + 8 * batch


def set_bytes(row: Row, numel: int, batch: int, itemsize: int) -> None:
    """The row's bytes per element: the minimum, and the traffic model for the implementations it
    models (the others' traffic is not designed, so they get none)."""
    second_order = row.mode == "dpm_sde"  # the bench runs dpm_sde at order 2 (Case.x0_prev)
    if row.op in LOSS_OPS:  # the losses suite (below)
        minimum, model, extra = loss_min_bytes, loss_kernel_bytes, {}
    else:
        minimum, model, extra = min_bytes, kernel_bytes, {"second_order": second_order}
        if row.op in TREE_OPS:  # the noise is drawn in the kernel (Philox), no tensor read
            extra["noise"] = "philox"
    row.min_b_elem = minimum(row.op, numel, batch, itemsize, **extra) / numel
    modelled = row.impl in MODELLED_IMPLS
    row.model_b_elem = model(row.op, numel, batch, itemsize, **extra) / numel if modelled else math.nan
    if modelled:
        import triton

        row.bound_pct = static_bound(row.op, row.mode, row.dtype, triton.__version__)


# ---- the static roofline bound (flowrl/tools/aot; docs/kernels.md's roofline table) ---------------

DOCS_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "kernels.md")


def roofline_table(path: str = DOCS_KERNELS) -> Dict[Tuple[str, str, str], float]:
    """{(kernel, label without its launch configuration, triton version): bound} from the roofline
    table ``python -m flowrl.tools.aot --update-docs docs/kernels.md`` writes (bf16, sm_90a; the
    bound as a fraction of copy bandwidth). Empty when the file or the table is missing."""
    from flowrl.tools import aot

    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for row in aot.markdown_rows(text, aot.ROOFLINE_START, aot.ROOFLINE_END):
        kernel, label = row["kernel"].strip("`"), re.sub(r" g\d+w\d+", "", row["specialization"])
        for column, cell in row.items():
            version = re.fullmatch(r"bound \((.+)\)", column)
            if version and cell.split()[0] not in ("None", "-"):
                out[(kernel, label, version.group(1))] = float(cell.split()[0])
    return out


def _op_kernels(op: str, mode: str) -> List[Tuple[str, str]]:
    """(kernel, label prefix) of the element kernels an op launches, as aot labels them."""
    from flowrl.contract import Mode
    from flowrl.tools import aot

    kind = baseline.LOG_PROB_KIND.get(mode, "gaussian")
    # dpm_sde at order 2 (Case.x0_prev); ddim with flowrl's defaults, epsilon-prediction without the clip
    mode = aot.mode_label(Mode[mode.upper()], has_prev=mode == "dpm_sde")
    if op == "rollout":
        return [("step_partials_kernel", f"{mode} rollout noise=tensor")]
    if op in TREE_OPS:
        return [("step_partials_kernel", f"{mode} rollout noise=philox")]
    if op == "recompute_fwd":
        return [("step_partials_kernel", f"{mode} log_prob")]
    if op == "recompute_fwd_bwd":
        return [("step_partials_kernel", f"{mode} log_prob"), ("step_backward_kernel", f"{mode} {kind} mean grads=")]
    if op == "kl_fwd_bwd":
        return [("step_partials_kernel", f"{mode} kl"), ("step_backward_kernel", f"{mode} kl mean grads=")]
    return []


def static_bound(op: str, mode: str, dtype: str, version: str, table=None) -> float:
    """The static roofline bound (% of copy bandwidth) of the op's flowrl-triton kernels: the lowest
    over its element kernels (for each, the best-matching label: the lowest bound among those that
    start with the prefix). NaN where the table has no row (fp32, the conditioned and loss ops)."""
    table = roofline_table() if table is None else table
    if dtype != "bf16":
        return math.nan
    bounds = []
    for kernel, prefix in _op_kernels(op, mode):
        found = [b for (k, label, v), b in table.items() if k == kernel and v == version
                 and (label == prefix or label.startswith(prefix + " ") or (prefix.endswith("=") and label.startswith(prefix)))
                 and not re.search(r"\+token|\+frozen|unaligned", label)]  # the ordinary step's kernels
        if not found:
            return math.nan
        bounds.append(min(found))
    return 100 * min(bounds) if bounds else math.nan


def set_rates(row: Row, ms: float, numel: int, copy: float) -> None:
    """GB/s over the minimal and the modelled bytes, and each as a percentage of the copy bandwidth."""
    row.time_ms = ms
    row.gbps = row.min_b_elem * numel / (ms * 1e-3) / 1e9
    row.pct_copy = 100 * row.gbps / copy
    row.gbps_model = row.model_b_elem * numel / (ms * 1e-3) / 1e9
    row.pct_copy_model = 100 * row.gbps_model / copy
