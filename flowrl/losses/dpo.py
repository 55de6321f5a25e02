"""Diffusion-DPO and DGPO: preference losses on the flow-matching forward process (docs/losses.md).

- ``dpo_loss``: Diffusion-DPO (Wallace et al., arXiv 2311.12908) for flow matching, on chosen/rejected
  pairs noised with the same noise and timestep: per sample err = mean (v - u)^2 with u = eps - x0,
  Delta = err_theta - err_ref, loss = mean over pairs of -log sigmoid(-beta/2 (Delta_w - Delta_l)).
  As yifan123/flow_grpo scripts/train_sd3_dpo.py (ac4c86e8, lines 924-950), Flow-Factory
  src/flow_factory/trainers/dpo.py (a0b2bc5a, lines 597-622) and verl-omni
  verl_omni/trainer/diffusion/diffusion_algos.py ``DPOLoss.compute_loss`` (a1139baf, lines 704-760)
  compute it: every peer takes the mean over a sample's elements (not the sum), the factor -0.5 beta
  and the logged implicit accuracy / rewards / margin below.
- ``dpo_pairs``: online pairs, the best and the worst sample of each rollout group, with each peer's
  tie rule.
- ``dgpo_loss``: DGPO (Luo et al., ICLR 2026), the group form of Luo-Yihong/DGPO
  scripts/train_sd3_dgpo.py (01ceb4b8: ``compute_group_dgpo_loss_allreduce``, lines 163-193, and its
  loss block, lines 1132-1160) and Flow-Factory src/flow_factory/trainers/dgpo.py (a0b2bc5a, lines
  448-504 and 633-708): per sample dsm = mean (v - u)^2, a detached group weight sigmoid(sum over the
  group of A beta (dsm - dsm_ref) / G), loss = mean(weight A dsm) (+ kl_coef mean (v - v_ref)^2), with
  the optional PPO-style clip of dsm against the old (EMA) policy.

One element pass per call computes every per-sample sum (kernels/loss.py's flow_partials_kernel,
kinds LOSS_DPO / LOSS_DGPO: AWM's matching error v - (eps - x0) beside each reference's), reduced in
the contract's fixed chunked halving-tree order (deterministic, batch-invariant per sample); one
backward pass writes d loss / d model_output. The [B] arithmetic after the sums is torch, shared by
both backends, as nft_loss's.
"""
from __future__ import annotations

from numbers import Integral
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..backends import reference
from ..contract import FlowLoss
from ..core import _validate as V
from ..core.step_spec import ShardContext, elements_per_sample
from ._common import _check_no_grad, _check_per_sample, _check_scalar, _flow_sums, check_clip_range

PAIR_LAYOUTS = ("halves", "interleaved")
PAIR_TIES = ("verl_omni", "flow_factory", "flow_grpo")


class DPOLossOutput(NamedTuple):
    """What ``dpo_loss`` returns. ``loss`` is differentiable (to model_output); the rest are detached.

    loss: mean over the P pairs of -log sigmoid(logits).
    logits: [P] -beta/2 (Delta_w - Delta_l) (the peers' ``inside_term``).
    implicit_accuracy: 0-d, the fraction of pairs with logits > 0 (the peers' ``implicit_acc``).
    reward_chosen, reward_rejected: [P] the implicit rewards -beta/2 Delta_w and -beta/2 Delta_l.
    reward_margin: 0-d, mean(reward_chosen - reward_rejected) (verl-omni's ``rewards/margins``).
    model_error, ref_error: [2P] mean (v - u)^2 of the policy and the reference, in the input's order.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    implicit_accuracy: torch.Tensor
    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor
    reward_margin: torch.Tensor
    model_error: torch.Tensor
    ref_error: torch.Tensor


class DGPOLossOutput(NamedTuple):
    """What ``dgpo_loss`` returns. ``loss`` is differentiable (to model_output); the rest are detached.

    loss: policy_loss + kl_coef * mean(kl).
    policy_loss: mean(group_weight * A * dsm) (the peers' ``dgpo_loss`` / ``policy_loss``).
    dsm, ref_dsm: [B] mean (v - u)^2 of the policy and of the DGPO reference.
    group_weight: [B] sigmoid of the sample's group sum (detached in the loss).
    kl: [B] mean (v - v_ref)^2 to ``ref_model_output`` (None without it).
    ratio: [B] exp(old_dsm - dsm) against ``old_model_output`` (None without clipping).
    clip_fraction: 0-d, the fraction of clipped samples (DGPO's ``clip_ratio_total``; None without
        clipping).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    dsm: torch.Tensor
    ref_dsm: torch.Tensor
    group_weight: torch.Tensor
    kl: Optional[torch.Tensor]
    ratio: Optional[torch.Tensor]
    clip_fraction: Optional[torch.Tensor]


# ------------------------------------------------------------------- per-sample sums (backends)


def _preference_sums(backend_arg, kind, v, noise, x0, ref, two=None, shard=None):
    """[K, B] per-sample sums, K = 2 (DPO), 3 or 5 (DGPO without / with ``two``): rows (v - u)^2,
    (ref - u)^2 and, for DGPO, (v - ref)^2, then (two - u)^2, (v - two)^2 (u = noise - x0). The backends'
    flow_sums slots: v_ref in xt's, the second reference in ref's (kernels/loss.py's LOSS_DPO / LOSS_DGPO;
    flowrl.backends.reference_losses.flow_sums)."""
    count = 2 if kind is FlowLoss.DPO else (5 if two is not None else 3)
    t = torch.zeros(v.shape[0], dtype=torch.float32, device=v.device)  # unused by these kinds
    return _flow_sums(backend_arg, kind, count, ref, v, noise, x0, two, t, (0.0, 0.0, 0.0), shard=shard)


def _check_same(name, t, like):
    V.check_batch_tensor(name, t, like, "model_output")


# ------------------------------------------------------------------------------------ Diffusion-DPO


def dpo_loss(
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    noise: torch.Tensor,
    clean_sample: torch.Tensor,
    *,
    beta: float,
    pair_layout: str = "halves",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
) -> DPOLossOutput:
    """Flow-matching Diffusion-DPO on P chosen/rejected pairs (2P samples), one element pass.

    ``model_output`` / ``ref_model_output``: the policy's and the frozen reference's velocity at
    x_t = (1 - sigma) x0 + sigma eps; ``noise`` = eps (the same for a pair's two samples, as the peers
    draw it), ``clean_sample`` = x0. Per sample err = mean (v - u)^2, u = eps - x0 (every peer's mean
    over elements); Delta = err_theta - err_ref; logits = -beta/2 (Delta_w - Delta_l); loss =
    mean(-log sigmoid(logits)). ``pair_layout``: "halves" (chosen samples first, then the rejected in
    the same order: flow_grpo's and Flow-Factory's batches) or "interleaved" (chosen, rejected adjacent:
    verl-omni's). Offline pairs are passed as they are; online pairs come from ``dpo_pairs``.
    The timestep enters only through the model's inputs (x_t, t): the loss does not read sigma.
    ``shard``: the sequence-parallel context (the means are over the full sample; flowrl.losses' note).
    """
    V.check_sample(model_output, "model_output")
    batch = model_output.shape[0]
    numel = elements_per_sample(model_output, shard)
    if batch < 2 or batch % 2:
        raise ValueError(f"model_output must hold chosen/rejected pairs: an even batch >= 2; got {batch}")
    for name, u in (("ref_model_output", ref_model_output), ("noise", noise), ("clean_sample", clean_sample)):
        _check_same(name, u, model_output)
    V.check_choice("pair_layout", pair_layout, PAIR_LAYOUTS)
    beta = _check_scalar("beta", beta, strict=True)
    _check_no_grad(ref_model_output=ref_model_output, noise=noise, clean_sample=clean_sample)
    sums = _preference_sums(backend, FlowLoss.DPO, model_output, noise, clean_sample, ref_model_output, shard=shard)
    err, ref_err = sums[0] / numel, sums[1] / numel
    p = batch // 2
    if pair_layout == "halves":
        w, l = slice(0, p), slice(p, batch)
    else:
        w, l = slice(0, batch, 2), slice(1, batch, 2)
    w_diff = err[w] - ref_err[w]
    l_diff = err[l] - ref_err[l]
    scale = -0.5 * beta
    logits = scale * (w_diff - l_diff)
    loss = -F.logsigmoid(logits).mean()
    with torch.no_grad():
        chosen, rejected = scale * w_diff, scale * l_diff
        return DPOLossOutput(loss, logits.detach(), (logits > 0).float().mean(), chosen, rejected,
                             (chosen - rejected).mean(), err.detach(), ref_err.detach())


def dpo_pairs(rewards: torch.Tensor, group_ids: torch.Tensor, *, ties: str = "verl_omni"
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Online Diffusion-DPO pairs: per rollout group (samples with equal ``group_ids``, e.g. one prompt),
    the index of its best sample (chosen) and of its worst (rejected). Returns (chosen, rejected), int64
    [P] on ``rewards``' device, one entry per group of >= 2 samples, groups in increasing id order
    (verl-omni orders them by first appearance). Gather the pair batch with ``torch.cat([x[chosen],
    x[rejected]])`` (pair_layout "halves").

    ``ties`` picks among equal rewards as each peer does: "verl_omni" (``DPOLoss.
    build_online_dpo_pair_indices``: the first best and the last worst, so a group of equal rewards
    still gives two samples), "flow_factory" (``DPOTrainer._form_pairs_from_advantages``: the first best
    and the first worst; a group of equal rewards pairs a sample with itself, a zero-gradient pair),
    "flow_grpo" (stat_tracking ``type='dpo'``: the first best and the first worst, a group of equal
    rewards its second and first sample). Host-side (one sync), as the peers' pairing is.
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.dtype.is_floating_point or rewards.ndim != 1:
        raise TypeError("rewards must be a 1-D float tensor [N]")
    if not isinstance(group_ids, torch.Tensor) or group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError("group_ids must be an integer tensor [N] (a group id per sample)")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have rewards' shape {tuple(rewards.shape)}; got {tuple(group_ids.shape)}")
    V.check_choice("ties", ties, PAIR_TIES)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    ids = group_ids.detach().cpu().tolist()
    values = rewards.detach().cpu().double().tolist()
    members = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, []).append(i)
    chosen, rejected = [], []
    for gid in sorted(members):
        idx = members[gid]
        if len(idx) < 2:
            continue
        r = [values[i] for i in idx]
        hi, lo = max(r), min(r)
        best = idx[r.index(hi)]
        if ties == "verl_omni":
            worst = idx[len(r) - 1 - r[::-1].index(lo)]
        else:
            worst = idx[r.index(lo)]
            if ties == "flow_grpo" and hi == lo:
                best, worst = idx[1], idx[0]
        chosen.append(best)
        rejected.append(worst)
    device = rewards.device
    return (torch.tensor(chosen, dtype=torch.int64, device=device),
            torch.tensor(rejected, dtype=torch.int64, device=device))


# --------------------------------------------------------------------------------------------- DGPO


def _group_ids(group_index, batch, device) -> Tuple[torch.Tensor, int]:
    if not isinstance(group_index, torch.Tensor) or group_index.dtype.is_floating_point \
            or group_index.dtype == torch.bool:
        raise TypeError("group_index must be an integer tensor [B] (the sample's group, e.g. its prompt id)")
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must have shape [B] = [{batch}]; got {tuple(group_index.shape)}")
    if group_index.device != device:
        raise ValueError(f"group_index is on {group_index.device} but model_output is on {device}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, int(inverse.max()) + 1


def _group_sums(term, inverse, counts) -> torch.Tensor:
    """[G] each group's sum of ``term`` over its members in batch order, by the contract's halving tree
    over the members zero-padded at the end: deterministic (no atomics, as scatter_add has on a GPU) and
    independent of the other groups in the call (extra zero padding adds exact zeros)."""
    order = torch.sort(inverse, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(inverse.shape[0], device=inverse.device) - starts[inverse[order]]
    rows = torch.zeros((counts.shape[0], int(counts.max())), dtype=term.dtype, device=term.device)
    rows[inverse[order], position] = term[order]
    return reference.combine_partials(rows)


def dgpo_loss(
    model_output: torch.Tensor,
    ref_model_output: Optional[torch.Tensor],
    noise: torch.Tensor,
    clean_sample: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    beta: float,
    group_size: Optional[int] = None,
    old_model_output: Optional[torch.Tensor] = None,
    clip_range=None,
    clip_dsm: bool = True,
    clip_kl: bool = False,
    ema_reference: bool = False,
    kl_coef: float = 0.0,
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
) -> DGPOLossOutput:
    """DGPO's group-level preference loss (Luo-Yihong/DGPO ``compute_group_dgpo_loss_allreduce``;
    Flow-Factory ``DGPOTrainer``), one element pass over x0, eps, v and the references.

    Per sample u = eps - x0 (``noise`` = eps, shared by a group's samples when the trainer shares it:
    DGPO's ``use_shared_noise``), dsm = mean (v - u)^2, dsm_ref = mean (v_R - u)^2 with v_R the DGPO
    reference: ``ref_model_output`` (the frozen reference, its CFG output when the trainer guides it),
    or ``old_model_output`` (the EMA old policy) when ``ema_reference`` (DGPO's ``use_ema_ref``).
    Group weight w = stop-grad sigmoid(sum over the sample's group of A beta (dsm - dsm_ref) / G), G =
    ``group_size`` (the trainer's configured group size; None: each group's count in this call);
    policy_loss = mean(w A dsm); loss = policy_loss + kl_coef mean(kl), kl = mean (v - v_ref)^2 to
    ``ref_model_output``. ``advantages`` are used as given (clamp them as the trainer does).
    ``clip_range`` (eps or (eps_low, eps_high), with ``old_model_output``): ratio = exp(old_dsm - dsm),
    a sample is clipped when A > 0 and ratio > 1 + eps_high, or A <= 0 and ratio < 1 - eps_low; a clipped
    sample's dsm (``clip_dsm``) and kl (``clip_kl``) are detached. Each group is summed by a fixed tree
    over its members in batch order (``_group_sums``): deterministic, and a group's weight does not
    depend on the other groups in the call (the peers' scatter_add uses atomics on a GPU).
    ``shard``: the sequence-parallel context (the means are over the full sample; flowrl.losses' note).
    """
    V.check_sample(model_output, "model_output")
    batch = model_output.shape[0]
    numel = elements_per_sample(model_output, shard)
    device = model_output.device
    for name, u in (("noise", noise), ("clean_sample", clean_sample)):
        _check_same(name, u, model_output)
    for name, u in (("ref_model_output", ref_model_output), ("old_model_output", old_model_output)):
        if u is not None:
            _check_same(name, u, model_output)
    advantages = _check_per_sample("advantages", advantages, batch, device)
    inverse, n_groups = _group_ids(group_index, batch, device)
    beta = _check_scalar("beta", beta, strict=True)
    kl_coef = _check_scalar("kl_coef", kl_coef)
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, Integral)
                                   or group_size < 1):
        raise ValueError(f"group_size must be None or a positive int; got {group_size!r}")
    clip_dsm, clip_kl = V.check_bool("clip_dsm", clip_dsm), V.check_bool("clip_kl", clip_kl)
    ema_reference = V.check_bool("ema_reference", ema_reference)
    clip = check_clip_range(clip_range) if clip_range is not None else None
    if (clip is not None or ema_reference) and old_model_output is None:
        raise ValueError("old_model_output is None but clip_range or ema_reference needs it: pass the old (EMA) "
                         "policy's model_output")
    if ref_model_output is None and (not ema_reference or kl_coef != 0):
        raise ValueError("ref_model_output is None: pass the frozen reference's model_output (the DGPO reference, "
                         "and the KL's when kl_coef > 0)")
    _check_no_grad(ref_model_output=ref_model_output, old_model_output=old_model_output, noise=noise,
                   clean_sample=clean_sample, advantages=advantages)
    # the kernel's references: the DGPO reference first, the other one (if needed) second
    first = old_model_output if ema_reference else ref_model_output
    second = ref_model_output if ema_reference else (old_model_output if clip is not None else None)
    sums = _preference_sums(backend, FlowLoss.DGPO, model_output, noise, clean_sample, first, second, shard=shard)
    dsm, ref_dsm = sums[0] / numel, (sums[1] / numel).detach()
    if ema_reference:
        old_dsm = ref_dsm
        kl = sums[4] / numel if second is not None else None
    else:
        old_dsm = (sums[3] / numel).detach() if second is not None else None
        kl = sums[2] / numel
    adv = advantages.to(dsm.dtype)
    ratio = clip_fraction = should_clip = None
    if clip is not None:
        lo, hi = clip
        ratio = torch.exp(-dsm.detach() + old_dsm)
        should_clip = torch.where(adv > 0, ratio > 1.0 + hi, ratio < 1.0 - lo)
        clip_fraction = should_clip.float().mean()
        if clip_dsm:
            dsm = torch.where(should_clip, dsm.detach(), dsm)
    counts = torch.bincount(inverse, minlength=n_groups)
    size = counts[inverse].to(dsm.dtype) if group_size is None else float(group_size)
    with torch.no_grad():
        term = adv * beta * (dsm.detach() - ref_dsm) / size
        weight = torch.sigmoid(_group_sums(term, inverse, counts))[inverse]
    policy_loss = (weight * adv * dsm).mean()
    loss = policy_loss
    if kl is not None:
        if clip_kl and should_clip is not None:
            kl = torch.where(should_clip, kl.detach(), kl)
        if kl_coef != 0:
            loss = policy_loss + kl_coef * kl.mean()
    return DGPOLossOutput(loss, policy_loss.detach(), dsm.detach(), ref_dsm, weight,
                          None if kl is None else kl.detach(), None if ratio is None else ratio,
                          clip_fraction)


__all__ = ["dpo_loss", "dpo_pairs", "dgpo_loss", "DPOLossOutput", "DGPOLossOutput", "PAIR_LAYOUTS", "PAIR_TIES"]
