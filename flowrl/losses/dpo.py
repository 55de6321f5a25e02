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
both backends, as nft_loss's (flowrl/losses/_preference.py: ``dpo_from_args``, ``dgpo_from_args``), run by
eager mode and, under ``torch.compile``, by the custom ops ``flowrl::dpo_loss`` / ``flowrl::dgpo_loss``
(flowrl/losses/_custom_ops.py, docs/compile.md). ``dpo_pairs`` is host-side bookkeeping (not an op).
"""
from __future__ import annotations

from numbers import Integral
from typing import Optional, Tuple, Union

import torch

from ..backends.reference_losses import flow_noise
from ..core import _validate as V
from ..core.step_spec import ShardContext, elements_per_sample
from ..ops._custom_ops import is_empty as _empty
from ..ops._custom_ops import traced as _traced
from . import _custom_ops as _ops
from ._common import _check_no_grad, _check_per_sample, _check_scalar, _flow_backend, check_clip_range
from ._preference import _preference_sums  # noqa: F401 (tests/losses/test_losses_dpo.py reads it here)
from ._preference import (DGPOInputs, DGPOLossOutput, DGPOOptions, DPOLossOutput, dgpo_from_args, dgpo_references,
                          dpo_from_args)
from ._preference import dgpo_noise_seed, dpo_noise_seed

PAIR_LAYOUTS = ("halves", "interleaved")
PAIR_TIES = ("verl_omni", "flow_factory", "flow_grpo")


def _check_same(name, t, like):
    V.check_batch_tensor(name, t, like, "model_output")


# ------------------------------------------------------------------------------------ Diffusion-DPO


def _noise_or_seed(noise, noise_seed, model_output):
    """Exactly one of ``noise`` / ``noise_seed``."""
    if (noise is None) == (noise_seed is None):
        raise ValueError("pass exactly one of noise (the eps tensor) and noise_seed (eps drawn from Philox in the "
                         "element pass); got " + ("both" if noise is not None else "neither"))
    if noise is not None:
        _check_same("noise", noise, model_output)


def dpo_loss(
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    noise: Optional[torch.Tensor],
    clean_sample: torch.Tensor,
    *,
    beta: float,
    pair_layout: str = "halves",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    noise_seed: Union[None, int, torch.Tensor] = None,
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

    ``noise_seed`` (with ``noise=None``; exactly one of the two): eps drawn from Philox4x32-10 inside the
    element passes (forward and backward), never stored. One Philox stream per pair, shared by its two
    samples: an int in [0, 2**63) keys every pair, pair p on stream p; an integer tensor [P] gives pair p
    its own seed (stream 0). The values are ``flowrl.backends.reference.philox_normal``'s (sde_step's noise_seed
    stream layout), float32; the torch backend draws the same ones (docs/losses.md).
    """
    V.check_sample(model_output, "model_output")
    batch = model_output.shape[0]
    elements_per_sample(model_output, shard)  # checks shard's type
    if batch % 2:  # 0 pairs (an empty batch) is valid
        raise ValueError(f"model_output must hold chosen/rejected pairs: an even batch (2P samples); got {batch}")
    _noise_or_seed(noise, noise_seed, model_output)
    for name, u in (("ref_model_output", ref_model_output), ("clean_sample", clean_sample)):
        _check_same(name, u, model_output)
    V.check_choice("pair_layout", pair_layout, PAIR_LAYOUTS)
    beta = _check_scalar("beta", beta, strict=True)
    _check_no_grad(ref_model_output=ref_model_output, noise=noise, clean_sample=clean_sample)
    seed = None
    if noise_seed is not None:
        seed = dpo_noise_seed(noise_seed, batch, model_output.device, pair_layout,
                              0 if shard is None else shard.offset)
    args = (model_output, ref_model_output, noise, clean_sample, beta, pair_layout)
    if (_traced() and shard is None) or _empty(model_output):  # compiling (one device): flowrl::dpo_loss; B = 0
        return _ops.dpo_loss(_flow_backend(backend, ref_model_output, model_output, noise, clean_sample).name, *args,
                             noise_seed=seed)
    return dpo_from_args(backend, *args, shard=shard, noise_seed=seed)


def dpo_noise(noise_seed: Union[int, torch.Tensor], like: torch.Tensor, *, pair_layout: str = "halves",
              shard: Optional[ShardContext] = None) -> torch.Tensor:
    """The eps ``dpo_loss(..., noise_seed=noise_seed, pair_layout=pair_layout)`` draws, float32 in
    ``like``'s shape (a pair's two samples equal), to form the model's input x_t = (1 - sigma) x0 +
    sigma eps. The torch backend's draw (flowrl.backends.reference.philox_normal); the Triton kernels' normals
    equal it to an ulp or so (docs/losses.md)."""
    V.check_sample(like, "like")
    batch = like.shape[0]
    if batch % 2:
        raise ValueError(f"like must hold chosen/rejected pairs: an even batch (2P samples); got {batch}")
    V.check_choice("pair_layout", pair_layout, PAIR_LAYOUTS)
    seed = dpo_noise_seed(noise_seed, batch, like.device, pair_layout, 0 if shard is None else shard.offset)
    return flow_noise(seed, batch, elements_per_sample(like, None)).reshape(like.shape)


def dgpo_noise(noise_seed: Union[int, torch.Tensor], like: torch.Tensor, *,
               shard: Optional[ShardContext] = None) -> torch.Tensor:
    """The eps ``dgpo_loss(..., noise_seed=noise_seed)`` draws, float32 in ``like``'s shape, to form the
    model's input x_t (``dpo_noise``'s note)."""
    V.check_sample(like, "like")
    seed = dgpo_noise_seed(noise_seed, like, 0 if shard is None else shard.offset)
    return flow_noise(seed, like.shape[0], elements_per_sample(like, None)).reshape(like.shape)


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


def _check_group_index(group_index, batch, device) -> torch.Tensor:
    if not isinstance(group_index, torch.Tensor) or group_index.dtype.is_floating_point \
            or group_index.dtype == torch.bool:
        raise TypeError("group_index must be an integer tensor [B] (the sample's group, e.g. its prompt id)")
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must have shape [B] = [{batch}]; got {tuple(group_index.shape)}")
    if group_index.device != device:
        raise ValueError(f"group_index is on {group_index.device} but model_output is on {device}")
    return group_index


def dgpo_loss(
    model_output: torch.Tensor,
    ref_model_output: Optional[torch.Tensor],
    noise: Optional[torch.Tensor],
    clean_sample: torch.Tensor,
    *,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
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
    noise_seed: Union[None, int, torch.Tensor] = None,
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

    ``noise_seed`` (with ``noise=None``; exactly one of the two): eps drawn from Philox4x32-10 inside the
    element passes, as ``sde_step``'s ``noise_seed``: an int in [0, 2**63) (sample b on stream b: every
    sample its own noise) or an integer tensor [B] of per-sample seeds (stream 0: samples with equal seeds
    draw the same noise; DGPO's shared noise per group: ``group_seeds[group_index]``). The torch backend
    draws the same float32 values (``flowrl.backends.reference.philox_normal``; docs/losses.md).
    """
    V.check_sample(model_output, "model_output")
    batch = model_output.shape[0]
    elements_per_sample(model_output, shard)  # checks shard's type
    device = model_output.device
    _noise_or_seed(noise, noise_seed, model_output)
    for name, u in (("clean_sample", clean_sample),):
        _check_same(name, u, model_output)
    for name, u in (("ref_model_output", ref_model_output), ("old_model_output", old_model_output)):
        if u is not None:
            _check_same(name, u, model_output)
    advantages = _check_per_sample("advantages", advantages, batch, device)
    group_index = _check_group_index(group_index, batch, device)
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
    seed = None
    if noise_seed is not None:
        seed = dgpo_noise_seed(noise_seed, model_output, 0 if shard is None else shard.offset)
    inputs = DGPOInputs(model_output, ref_model_output, noise, clean_sample, advantages, group_index,
                        old_model_output=old_model_output)
    options = DGPOOptions(beta, group_size=group_size, clip=clip, clip_dsm=clip_dsm, clip_kl=clip_kl,
                          ema_reference=ema_reference, kl_coef=kl_coef)
    if (_traced() and shard is None) or _empty(model_output):  # compiling (one device): flowrl::dgpo_loss; B = 0
        first, second = dgpo_references(ref_model_output, old_model_output, clip, ema_reference)
        name = _flow_backend(backend, first, model_output, noise, clean_sample, second).name
        return _ops.dgpo_loss(name, inputs, options, noise_seed=seed)
    return dgpo_from_args(backend, inputs, options, shard=shard, noise_seed=seed)


__all__ = ["dpo_loss", "dpo_pairs", "dgpo_loss", "dpo_noise", "dgpo_noise", "DPOLossOutput", "DGPOLossOutput",
           "PAIR_LAYOUTS", "PAIR_TIES"]
