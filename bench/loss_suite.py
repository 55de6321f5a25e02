"""The losses suite (``python bench/run.py --suite losses``): flowrl.losses beside the peers' eager loss code,
each row checked against the peer's loss and gradient before it is timed (the header below says what each
op runs; its byte model is bench/roofline.py's)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

import baseline
from cases import DTYPES, FLOWRL_BACKEND, NOISE_LEVEL, STEP_INDEX, make_sigmas
from measure import check, copy_gbps, time_rows
from roofline import set_bytes
from table import Row

import flowrl
from flowrl.backends import _dispatch

# A separate suite (``--suite losses``): each op is forward + backward, d loss / d model_output, at
# one step (STEP_INDEX, mode sde, Gaussian log-prob). Implementations: flowrl-triton (CUDA only),
# flowrl-torch, and ``eager``, the peer's code as it runs in its trainer (the same formulas as
# tests/peer_losses.py's transcriptions, which are the tests' oracle):
#
# - grpo_loss: Flow-GRPO's recompute (baseline.flow_grpo_step) of the log-prob and mean, the reference
#   policy's mean without grad, its loss block (ratio, clip, KL with the exact variance, approx_kl,
#   clipfrac); flowrl: losses.grpo_loss with ref_model_output.
# - grpo_guard: verl-omni GRPOGuardLoss with the stored float32 old_prev_sample_mean; flowrl:
#   losses.grpo_guard_loss replaying mu_old from the rollout's noise_seed (no mean stored or read). The
#   rollout stores x' in float32 for this op (replaying from a bf16 x' is only within bf16 rounding,
#   docs/losses.md), so x' is read in float32 by both (the byte columns count the latents' dtype).
# - nft_loss: DiffusionNFT's train_nft_sd3.py policy loss and KL; flowrl: losses.nft_loss.
# - awm_loss: Flow-Factory's AWM weighted log-prob (float64) and clipped loss; flowrl: losses.awm_loss.
# - dpo_loss: flow_grpo's train_sd3_dpo.py DPO block on the [chosen; rejected] batch; flowrl:
#   losses.dpo_loss (an even batch; odd ones are skipped with a note).
# - dgpo_loss: Luo-Yihong/DGPO's loss block (the DSM clip against the old policy, the group sigmoid of
#   compute_group_dgpo_loss_allreduce on one process, the KL), two groups (the batch's halves), x standing
#   in for the old policy's output, in float32 (DGPO's own code computes the score-matching errors in float32,
#   its float32 target promoting the bf16 output, and only the KL, a difference of two bf16 outputs, in bf16;
#   upcast here as the DPO peers do); flowrl: losses.dgpo_loss.
# - grpo_velocity_kl: Flow-Factory's GRPO loss with kl_type="v-based" (trainers/grpo.py: the per-sample
#   mean of (v - v_ref)^2 times kl_beta) on Flow-GRPO's recompute, the difference upcast to float32 (in
#   bf16, as their code runs it, its rounding moves the gradient by a few percent); flowrl:
#   losses.grpo_loss(kl_space="velocity").
# - grpo_guided_ref: grpo_loss's block with the reference given as its two CFG branches and a scale,
#   combined by the peers' CFG line (uncond + w (cond - uncond), a [B, N] temporary) before the exact KL;
#   flowrl: losses.grpo_loss(ref_model_output=(uncond, cond), ref_guidance_scale=w), combined in the pass.
# - grpo_joint: verl-omni's MiniMax-H3 FlowGRPO on a joint step (the case's latent as the video, a quarter
#   as many elements per sample as the audio, on its own schedule, shift 1): the streams' recomputed mean
#   log densities combined 0.5 / 0.5 (combine_log_probs) in FlowGRPOLoss's clipped surrogate; flowrl:
#   losses.grpo_loss on the tuples with stream_weights=(0.5, 0.5). The gradient is the video's.

GUIDANCE_SCALE, JOINT_WEIGHTS, AUDIO_SHIFT = 4.5, (0.5, 0.5), 1.0
PAIR_OPS = ("dpo_loss",)  # need an even batch
DPO_BETA, DGPO_BETA = 2000.0, 100.0
LOSS_IMPLS = ("flowrl-triton", "flowrl-torch", "eager")
LOSS_SEED, LOSS_CLIP, LOSS_KL_COEF, NFT_BETA, NFT_ADV_MAX = 1234, 0.2, 0.04, 0.1, 5.0


@dataclass
class LossCase:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    sigmas: torch.Tensor
    step_index: torch.Tensor
    sigma_max: float
    x: torch.Tensor
    v: torch.Tensor  # the current policy's output (a leaf copy is made per call)
    v_ref: torch.Tensor
    prev: torch.Tensor
    old_mean: torch.Tensor  # float32: what verl-omni / Flow-Factory store per step
    old_lp: torch.Tensor
    prev32: torch.Tensor  # grpo_guard's rollout stores x' in float32, so that replaying mu_old from it is
    old_lp32: torch.Tensor  # exact up to float32 rounding (docs/losses.md); its mean and log-prob
    old_mean32: torch.Tensor
    awm_old_lp: torch.Tensor  # AWM's weighted log-prob under the old policy
    adv: torch.Tensor
    x0: torch.Tensor
    eps: torch.Tensor
    xt: torch.Tensor
    t: torch.Tensor
    v_uncond: torch.Tensor  # the reference's CFG branches (grpo_guided_ref)
    v_cond: torch.Tensor
    audio: Tuple[torch.Tensor, ...]  # grpo_joint's second stream: x, v, x' [B, N / 4 per sample], its sigmas
    joint_old_lp: torch.Tensor  # the joint rollout's log-prob (0.5 / 0.5 of the streams' mean densities)


def make_loss_case(shape, dtype, device, seed: int = 0) -> LossCase:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda: torch.randn(shape, generator=gen).to(device)  # noqa: E731
    x, v_old = rand().to(dtype), rand().to(dtype)
    v = (v_old.float() + 0.05 * rand()).to(dtype)
    v_ref = (v_old.float() + 0.05 * rand()).to(dtype)
    sigmas = make_sigmas().to(device)
    seeds = torch.arange(shape[0], device=device) + LOSS_SEED
    out = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch")
    out32 = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch",
                            out_dtype=torch.float32)
    x0, eps = rand().to(dtype), rand().to(dtype)
    t = torch.linspace(0.2, 0.9, shape[0], device=device)
    tb = t.reshape((-1,) + (1,) * (len(shape) - 1))
    xt = ((1 - tb) * x0.float() + tb * eps.float()).to(dtype)
    adv = torch.linspace(-1.5, 1.5, shape[0], device=device)
    dims = tuple(range(1, len(shape)))
    awm_old_lp = ((-(v_old.double() - (eps - x0).double()) ** 2).mean(dim=dims) * t).float()
    v_uncond = (v_old.float() + 0.1 * rand()).to(dtype)
    v_cond = (v_uncond.float() + (v_ref.float() - v_uncond.float()) / GUIDANCE_SCALE).to(dtype)
    audio_shape = (shape[0], max(x[0].numel() // 4, 1))
    xa, va = (torch.randn(audio_shape, generator=gen).to(device).to(dtype) for _ in range(2))
    sigmas_a = make_sigmas(shift=AUDIO_SHIFT).to(device)
    out_a = flowrl.sde_step(xa, va, sigmas_a, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds + 7,
                            backend="torch", reduction="sum")
    out_v = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch",
                            reduction="sum")
    joint_old_lp = flowrl.combine_streams([out_v.log_prob, out_a.log_prob], [out_v.count, out_a.count], "mean",
                                          JOINT_WEIGHTS)
    return LossCase(tuple(shape), dtype, sigmas, torch.full((shape[0],), STEP_INDEX, device=device),
                    float(sigmas[1]), x, v, v_ref, out.prev_sample, out.prev_sample_mean, out.log_prob,
                    out32.prev_sample, out32.log_prob, out32.prev_sample_mean, awm_old_lp,
                    adv, x0, eps, xt, t, v_uncond, v_cond, (xa, va, out_a.prev_sample, sigmas_a), joint_old_lp)


def _eager_loss(case: LossCase, op: str, v: torch.Tensor) -> torch.Tensor:
    """The peer's loss code, eager (see the block's header)."""
    dims = tuple(range(1, len(case.shape)))
    if op in ("grpo_velocity_kl", "grpo_guided_ref", "grpo_joint"):
        return _eager_issue24_loss(case, op, v, dims)
    if op in ("grpo_loss", "grpo_guard"):
        prev = case.prev if op == "grpo_loss" else case.prev32
        _, lp, mean, std_dev_t = baseline.flow_grpo_step(case.x, v, case.sigmas, case.step_index, case.sigma_max,
                                                         mode="sde", noise_level=NOISE_LEVEL, prev_sample=prev)
        adv = case.adv
        if op == "grpo_loss":
            with torch.no_grad():
                mean_ref, _, step_std = baseline.flow_grpo_mean(case.x, case.v_ref, case.sigmas, case.step_index,
                                                                case.sigma_max, mode="sde", noise_level=NOISE_LEVEL)
            ratio = torch.exp(lp - case.old_lp)
            policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))
            kl = ((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * step_std ** 2)
            _ = (0.5 * torch.mean((lp - case.old_lp) ** 2), torch.mean((torch.abs(ratio - 1) > LOSS_CLIP).float()))
            return policy + LOSS_KL_COEF * kl.mean()
        sigma, sigma_next = case.sigmas[case.step_index], case.sigmas[case.step_index + 1]
        sqrt_dt = torch.sqrt(sigma - sigma_next)
        scale = sqrt_dt.mean() * std_dev_t.mean()
        bias = (mean - case.old_mean32).pow(2).mean(dim=dims) / (2 * scale ** 2)
        ratio = torch.exp((lp - case.old_lp32 + bias) * scale)
        per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP))
        return torch.mean(per) / (sqrt_dt.mean() ** 2)
    tb = case.t.view(-1, *([1] * (len(case.shape) - 1)))
    if op == "nft_loss":
        r = torch.clamp((torch.clamp(case.adv, -NFT_ADV_MAX, NFT_ADV_MAX) / NFT_ADV_MAX) / 2.0 + 0.5, 0, 1)
        x0_pos = case.xt - tb * (NFT_BETA * v + (1 - NFT_BETA) * case.v_ref)
        x0_neg = case.xt - tb * ((1.0 + NFT_BETA) * case.v_ref - NFT_BETA * v)
        with torch.no_grad():
            w_pos = torch.abs(x0_pos.double() - case.x0.double()).mean(dim=dims, keepdim=True).clip(min=1e-5)
            w_neg = torch.abs(x0_neg.double() - case.x0.double()).mean(dim=dims, keepdim=True).clip(min=1e-5)
        pos = ((x0_pos - case.x0) ** 2 / w_pos).mean(dim=dims)
        neg = ((x0_neg - case.x0) ** 2 / w_neg).mean(dim=dims)
        policy = ((r * pos / NFT_BETA + (1.0 - r) * neg / NFT_BETA) * NFT_ADV_MAX).mean()
        return policy + LOSS_KL_COEF * ((v - case.v) ** 2).mean(dim=dims).mean()
    if op == "dpo_loss":  # flow_grpo train_sd3_dpo.py, the loss block
        bsz = case.shape[0] // 2
        target = case.eps - case.x0
        theta_mse = ((v.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        ref_mse = ((case.v_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        w_l_diff = (theta_mse[:bsz] - ref_mse[:bsz]) - (theta_mse[bsz:] - ref_mse[bsz:])
        inside_term = -0.5 * DPO_BETA * w_l_diff
        _ = (inside_term > 0).sum().float() / inside_term.size(0)
        return torch.mean(-torch.nn.functional.logsigmoid(inside_term))
    if op == "dgpo_loss":  # Luo-Yihong/DGPO train_sd3_dgpo.py, the loss block (one process)
        b = case.shape[0]
        target_v = case.eps.float() - case.x0.float()
        dsm = (target_v - v.float()).square().reshape(b, -1).mean(dim=1)
        old_dsm = (target_v - case.x.float()).square().reshape(b, -1).mean(dim=1)
        ratio = torch.exp(-dsm + old_dsm)
        should_clip = torch.where(case.adv > 0, ratio > 1.0 + LOSS_CLIP, ratio < 1.0 - LOSS_CLIP)
        dsm = torch.where(should_clip, dsm.detach(), dsm)
        with torch.no_grad():
            ref_dsm = (target_v - case.v_ref.float()).square().reshape(b, -1).mean(dim=1)
        term = case.adv * DGPO_BETA * (dsm.detach() - ref_dsm) / ((b + 1) // 2)
        groups = torch.arange(b, device=v.device) * 2 // b
        sums = torch.zeros(2, dtype=term.dtype, device=v.device).scatter_add_(0, groups, term)
        policy = (torch.sigmoid(sums)[groups].detach() * case.adv * dsm).mean()
        return policy + LOSS_KL_COEF * (v.float() - case.v_ref.float()).square().reshape(b, -1).mean(dim=1).mean()
    # awm_loss: Flow-Factory's float64 weighted log-prob ("t" weighting) and clipped loss
    target = case.eps - case.x0
    lp = (-(v.double() - target.double()) ** 2).mean(dim=dims) * case.t
    ratio = torch.exp(lp.float() - case.awm_old_lp)
    return torch.mean(torch.maximum(-case.adv * ratio, -case.adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))


def _grpo_surrogate(lp, old_lp, adv):
    ratio = torch.exp(lp - old_lp)
    return torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))


def _eager_issue24_loss(case: LossCase, op: str, v: torch.Tensor, dims) -> torch.Tensor:
    """The peers' code for the velocity KL, the guided reference and the weighted joint step (the block's
    header)."""
    recompute = dict(mode="sde", noise_level=NOISE_LEVEL)
    _, lp, mean, _ = baseline.flow_grpo_step(case.x, v, case.sigmas, case.step_index, case.sigma_max,
                                             prev_sample=case.prev, **recompute)
    if op == "grpo_velocity_kl":  # Flow-Factory kl_type="v-based", upcast (a bf16 difference is off by 1e-2)
        kl = torch.mean((v.float() - case.v_ref.float()) ** 2, dim=dims, keepdim=True)
        return _grpo_surrogate(lp, case.old_lp, case.adv) + LOSS_KL_COEF * kl.mean()
    if op == "grpo_guided_ref":  # the CFG line, then grpo_loss's exact KL
        with torch.no_grad():
            v_ref = case.v_uncond + GUIDANCE_SCALE * (case.v_cond - case.v_uncond)
            mean_ref, _, step_std = baseline.flow_grpo_mean(case.x, v_ref, case.sigmas, case.step_index,
                                                            case.sigma_max, **recompute)
        kl = ((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * step_std ** 2)
        return _grpo_surrogate(lp, case.old_lp, case.adv) + LOSS_KL_COEF * kl.mean()
    # grpo_joint: verl-omni MiniMax-H3 (combine_log_probs) in FlowGRPOLoss
    xa, va, prev_a, sigmas_a = case.audio
    _, lp_a, _, _ = baseline.flow_grpo_step(xa, va, sigmas_a, case.step_index, float(sigmas_a[1]), prev_sample=prev_a,
                                            **recompute)
    joint = JOINT_WEIGHTS[0] * lp + JOINT_WEIGHTS[1] * lp_a
    return _grpo_surrogate(joint, case.joint_old_lp, case.adv)


def _flowrl_loss(case: LossCase, op: str, v: torch.Tensor, backend: str) -> torch.Tensor:
    from flowrl import losses

    if op in ("grpo_velocity_kl", "grpo_guided_ref"):
        ref = dict(ref_model_output=case.v_ref, kl_space="velocity") if op == "grpo_velocity_kl" else dict(
            ref_model_output=(case.v_uncond, case.v_cond), ref_guidance_scale=GUIDANCE_SCALE)
        return losses.grpo_loss(case.x, v, case.prev, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp,
                                advantages=case.adv,
                                clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL, kl_coef=LOSS_KL_COEF, backend=backend,
                                **ref).loss
    if op == "grpo_joint":
        xa, va, prev_a, sigmas_a = case.audio
        return losses.grpo_loss((case.x, xa), (v, va), (case.prev, prev_a), (case.sigmas, sigmas_a), STEP_INDEX,
                                old_log_prob=case.joint_old_lp, advantages=case.adv, clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL,
                                stream_weights=JOINT_WEIGHTS, backend=backend).loss

    if op == "grpo_loss":
        return losses.grpo_loss(case.x, v, case.prev, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp,
                                advantages=case.adv,
                                clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL, kl_coef=LOSS_KL_COEF,
                                ref_model_output=case.v_ref, backend=backend).loss
    if op == "grpo_guard":
        seeds = torch.arange(case.shape[0], device=case.x.device) + LOSS_SEED
        return losses.grpo_guard_loss(case.x, v, case.prev32, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp32,
                                      advantages=case.adv,
                                      clip_range=LOSS_CLIP, noise_seed=seeds, noise_level=NOISE_LEVEL,
                                      backend=backend).loss
    if op == "nft_loss":
        # v_ref stands in for the old policy's output and case.v for the reference (same tensors as eager)
        return losses.nft_loss(case.xt, v, case.v_ref, case.x0, case.t, advantages=case.adv, beta=NFT_BETA,
                               adv_clip_max=NFT_ADV_MAX, kl_coef=LOSS_KL_COEF, ref_model_output=case.v,
                               backend=backend).loss
    if op == "dpo_loss":
        return losses.dpo_loss(v, case.v_ref, case.eps, case.x0, beta=DPO_BETA, backend=backend).loss
    if op == "dgpo_loss":
        b = case.shape[0]
        groups = torch.arange(b, device=v.device) * 2 // b
        return losses.dgpo_loss(v, case.v_ref, case.eps, case.x0, advantages=case.adv, group_index=groups,
                                beta=DGPO_BETA,
                                group_size=(b + 1) // 2, old_model_output=case.x, clip_range=LOSS_CLIP,
                                kl_coef=LOSS_KL_COEF, backend=backend).loss
    return losses.awm_loss(v, case.eps, case.x0, case.t, old_log_prob=case.awm_old_lp, advantages=case.adv,
                           clip_range=LOSS_CLIP, weighting="t",
                           backend=backend).loss


def build_loss(impl: str, case: LossCase, op: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    """A no-argument callable returning (loss, d loss / d model_output) of ``impl``."""
    leaf = case.v.detach().clone().requires_grad_(True)
    if impl == "eager":
        compute = lambda: _eager_loss(case, op, leaf)  # noqa: E731
    elif impl in FLOWRL_BACKEND:
        compute = lambda: _flowrl_loss(case, op, leaf, FLOWRL_BACKEND[impl])  # noqa: E731
    else:
        raise ValueError(f"unknown loss impl {impl!r}")

    def fn():
        loss = compute()
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss.detach().float().reshape(1), grad
    return fn


def run_loss_sweep(device: torch.device, shapes, dtypes, ops, impls, *, time_budget_s: float = math.inf,
                   timing_budget_s: float = 0.5, log=print,
                   progress: Optional[Callable[[List[Row], float], None]] = None) -> Tuple[List[Row], float, List[str]]:
    """Check every loss against the peer's eager code (loss and gradient), then time it and measure
    its peak memory beyond the inputs; rows as the step suite's (Row, markdown_table); the time
    budget and ``progress`` as in ``run_sweep``."""
    notes: List[str] = []
    impls = [i for i in impls if i != "compile"] + ([] if "eager" in impls else ["eager"])
    if "flowrl-triton" in impls and (device.type != "cuda" or not _dispatch.triton_available()):
        impls.remove("flowrl-triton")
        notes.append("flowrl-triton is timed on CUDA only (the Triton interpreter is not a measurement)")
    copy = copy_gbps(device, budget_s=max(timing_budget_s, 1.0))
    rows: List[Row] = []
    started = time.perf_counter()
    configs = [(s, d) for s in shapes for d in dtypes]
    for done, (shape, dname) in enumerate(configs):
        if time.perf_counter() - started > time_budget_s:
            notes.append(f"time budget of {time_budget_s:.0f} s reached: {done} of {len(configs)} "
                         "shape/dtype configurations measured")
            break
        case = make_loss_case(shape, DTYPES[dname], device)
        numel, batch, itemsize = case.x.numel(), shape[0], case.x.element_size()
        shape_s = "x".join(map(str, shape))
        for op in ops:
            if op in PAIR_OPS and batch % 2:
                note = f"{op} needs chosen/rejected pairs (an even batch): skipped at {shape_s}"
                notes += [] if note in notes else [note]
                continue
            expected = build_loss("eager", case, op)()
            op_rows = {impl: Row(op, "sde" if op.startswith("grpo") else "-", dname, shape_s, impl)
                       for impl in impls}
            fns: Dict[str, Callable] = {}
            for impl, row in op_rows.items():
                set_bytes(row, numel, batch, itemsize)
                try:
                    fn = build_loss(impl, case, op)
                    row.check_err = check(fn(), expected)
                    fns[impl] = fn
                except AssertionError as exc:
                    row.note = f"CHECK FAILED: {exc}"
                except Exception as exc:  # e.g. a kernel that fails to compile: report it, go on
                    row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            time_rows(op_rows, fns, device, timing_budget_s, numel, copy, itemsize, with_peak=True)
            for row in op_rows.values():
                log(f"# {op:12s} {dname} {shape_s:18s} {row.impl:14s} {row.time_ms:10.4f} ms  {row.note}")
            rows.extend(op_rows.values())
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(rows, copy)
    return rows, copy, notes
