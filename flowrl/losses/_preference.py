"""The preference losses' blocks after validation (``flowrl.losses.dpo`` validates): the backend's
per-sample sums (``Backend.flow_sums``, kinds DPO / DGPO) and the per-sample [B] arithmetic after them,
written once for both backends. Eager mode calls ``dpo_from_args`` / ``dgpo_from_args``; under
``torch.compile`` the custom ops ``flowrl::dpo_loss`` and ``flowrl::dgpo_loss``
(flowrl/losses/_custom_ops.py) run the same functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..backends import reference
from ..contract import FlowLoss
from ..core import _validate as V
from ..core.step_spec import elements_per_sample
from ._common import _flow_sums


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


def _preference_sums(backend_arg, kind, v, noise, x0, ref, two=None, shard=None, noise_seed=None):
    """[K, B] per-sample sums, K = 2 (DPO), 3 or 5 (DGPO without / with ``two``): rows (v - u)^2,
    (ref - u)^2 and, for DGPO, (v - ref)^2, then (two - u)^2, (v - two)^2 (u = noise - x0). The backends'
    flow_sums slots: v_ref in xt's, the second reference in ref's (kernels/loss.py's LOSS_DPO / LOSS_DGPO;
    flowrl.backends.reference_losses.flow_sums). ``noise_seed`` (``noise`` None): a resolved seed
    (``dpo_noise_seed`` / ``dgpo_noise_seed``), eps drawn from Philox in the element pass."""
    count = 2 if kind is FlowLoss.DPO else (5 if two is not None else 3)
    t = torch.zeros(v.shape[0], dtype=torch.float32, device=v.device)  # unused by these kinds
    return _flow_sums(backend_arg, kind, count, ref, v, noise, x0, two, t, (0.0, 0.0, 0.0), shard=shard,
                      noise_seed=noise_seed)


# A resolved noise seed: (seeds int64 [R], stream_stride, elem_offset, noise_div, noise_mod); sample b
# draws Philox row (b // noise_div) % noise_mod: seeds[row] on stream row * stream_stride, elements
# elem_offset + arange(numel) (flowrl.backends.reference_losses.flow_noise; kernels/loss.py's _flow_noise).


def dpo_noise_seed(noise_seed, batch: int, device, pair_layout: str, elem_offset: int = 0):
    """``dpo_loss``'s ``noise_seed`` resolved: one Philox row per pair, shared by its two samples. An int
    in [0, 2**63): every pair's key, pair p on stream p; an integer tensor [P]: pair p's own seed
    (stream 0: a pair's noise depends on its seed only). Pair p is samples p and P + p ("halves") or
    2p and 2p + 1 ("interleaved")."""
    pairs = batch // 2
    if isinstance(noise_seed, bool) or not isinstance(noise_seed, (Integral, torch.Tensor)):
        raise TypeError(f"noise_seed must be an int or an integer tensor of shape [P] = [{pairs}] (one seed per "
                        f"pair); got {type(noise_seed).__name__}")
    if isinstance(noise_seed, Integral):
        if not 0 <= int(noise_seed) < 2**63:
            raise ValueError(f"noise_seed must be in [0, 2**63); got {int(noise_seed)}")
        seeds, stride = torch.full((pairs,), int(noise_seed), dtype=torch.int64, device=device), 1
    else:
        if noise_seed.dtype.is_floating_point or noise_seed.dtype.is_complex or noise_seed.dtype == torch.bool:
            raise TypeError(f"noise_seed must be an integer tensor (int64 seeds); got {noise_seed.dtype}")
        if noise_seed.shape != (pairs,):
            raise ValueError(f"noise_seed must be an int or a tensor of shape [P] = [{pairs}] (one seed per pair); "
                             f"got shape {tuple(noise_seed.shape)}")
        if noise_seed.device != device:
            raise ValueError(f"noise_seed is on {noise_seed.device} but model_output is on {device}")
        seeds, stride = noise_seed.to(torch.int64).contiguous(), 0
    div, mod = (1, pairs) if pair_layout == "halves" else (2, pairs)
    return seeds, stride, elem_offset, div, mod


def dgpo_noise_seed(noise_seed, like: torch.Tensor, elem_offset: int = 0):
    """``dgpo_loss``'s ``noise_seed`` resolved as ``sde_step``'s (flowrl.core._validate.check_noise_seed):
    an int (sample b on stream b) or per-sample seeds [B] (stream 0: samples of equal seeds draw the same
    noise, e.g. ``group_seed[group_index]`` for DGPO's shared noise per group)."""
    seed = V.check_noise_seed(noise_seed, like)
    return seed.seeds, seed.stream_stride, elem_offset, 1, like.shape[0]


class DGPOInputs(NamedTuple):
    """The tensors ``dgpo_loss`` reads, validated (``ref_model_output``, ``noise``, ``old_model_output`` may
    be None)."""

    model_output: torch.Tensor
    ref_model_output: Optional[torch.Tensor]
    noise: Optional[torch.Tensor]
    clean_sample: torch.Tensor
    advantages: torch.Tensor
    group_index: torch.Tensor
    old_model_output: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class DGPOOptions:
    """``dgpo_loss``'s options, validated: ``clip`` is (eps_low, eps_high) or None; the rest as the
    function's arguments."""

    beta: float
    group_size: Optional[int] = None
    clip: Optional[Tuple[float, float]] = None
    clip_dsm: bool = True
    clip_kl: bool = False
    ema_reference: bool = False
    kl_coef: float = 0.0


def dgpo_references(ref_model_output, old_model_output, clip, ema_reference):
    """The kernel's references (first, second): the DGPO reference first, the other one (if needed) second."""
    first = old_model_output if ema_reference else ref_model_output
    second = ref_model_output if ema_reference else (old_model_output if clip is not None else None)
    return first, second


def dpo_from_args(backend, model_output, ref_model_output, noise, clean_sample, beta, pair_layout,
                  shard=None, noise_seed=None) -> DPOLossOutput:
    """``dpo_loss`` from its validated arguments (``backend``: the argument, or the resolved backend's name;
    ``shard``: the sequence-parallel context, the means over the full sample; ``noise_seed``: resolved,
    ``dpo_noise_seed``, with ``noise`` None)."""
    batch = model_output.shape[0]
    sums = _preference_sums(backend, FlowLoss.DPO, model_output, noise, clean_sample, ref_model_output, shard=shard,
                            noise_seed=noise_seed)
    numel = elements_per_sample(model_output, shard)
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


def dgpo_from_args(backend, inputs: DGPOInputs, options: DGPOOptions, shard=None, noise_seed=None) -> DGPOLossOutput:
    """``dgpo_loss`` from its validated inputs and options (``backend``: the argument, or the resolved
    backend's name; ``shard``, ``noise_seed`` (``dgpo_noise_seed``) as ``dpo_from_args``'). The groups are
    read here (``torch.unique``: a device sync)."""
    model_output, ref_model_output, noise, clean_sample, advantages, group_index, old_model_output = inputs
    clip, ema_reference = options.clip, options.ema_reference
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    first, second = dgpo_references(ref_model_output, old_model_output, clip, ema_reference)
    sums = _preference_sums(backend, FlowLoss.DGPO, model_output, noise, clean_sample, first, second, shard=shard,
                            noise_seed=noise_seed)
    numel = elements_per_sample(model_output, shard)
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
        if options.clip_dsm:
            dsm = torch.where(should_clip, dsm.detach(), dsm)
    counts = torch.bincount(inverse, minlength=n_groups)
    size = counts[inverse].to(dsm.dtype) if options.group_size is None else float(options.group_size)
    with torch.no_grad():
        term = adv * options.beta * (dsm.detach() - ref_dsm) / size
        weight = torch.sigmoid(_group_sums(term, inverse, counts))[inverse]
    policy_loss = (weight * adv * dsm).mean()
    loss = policy_loss
    if kl is not None:
        if options.clip_kl and should_clip is not None:
            kl = torch.where(should_clip, kl.detach(), kl)
        if options.kl_coef != 0:
            loss = policy_loss + options.kl_coef * kl.mean()
    return DGPOLossOutput(loss, policy_loss.detach(), dsm.detach(), ref_dsm, weight,
                          None if kl is None else kl.detach(), None if ratio is None else ratio,
                          clip_fraction)


__all__ = ["DPOLossOutput", "DGPOLossOutput", "DGPOInputs", "DGPOOptions", "dpo_from_args", "dgpo_from_args", "dgpo_references", "dpo_noise_seed",
           "dgpo_noise_seed"]
