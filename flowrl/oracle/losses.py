"""The losses of ``flowrl.losses`` in float64, from docs/losses.md's "Formulas" and docs/contract.md.

One function per loss, named as the public one and taking its sample-shaped inputs in the same
positions; its options are keyword-only, grouped where a loss has many (``StepArgs``: the step of the
log-prob; ``KLArgs``: the KL term; ``DGPOArgs``: DGPO's options). ``call(name, *args, **kwargs)`` takes
the public function's own keywords and groups them, so a test calls both with one argument list.
Each returns the public output type (``GRPOLossOutput``, ``NFTLossOutput``, ``DPOLossOutput``,
``DGPOLossOutput``; ``teacher_kl_loss``: (loss, kl); ``awm_log_prob``: [B]) with float64 values; the
loss is differentiable in ``model_output`` by autograd. Per-sample means are plain float64 means over a
sample's elements (the contract's chunked tree order is the kernels', not the math's).

Not covered (``NotImplementedError`` naming the option): per-token sigmas, frozen masks, joint steps
(tuples, ``stream_weights``), sequence parallelism (``shard``), Philox noise (``noise_seed``: pass the
noise or ``old_prev_sample_mean`` instead).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ..losses import DGPOLossOutput, DPOLossOutput, GRPOLossOutput, NFTLossOutput
from . import steps as S

F64 = torch.float64
AWM_EPS = 1e-10  # AWM's huber / ghuber offset (docs/losses.md)
NFT_WEIGHT_FLOOR = 1e-5  # DiffusionNFT's w+- = max(mean |e+-|, 1e-5)
ClipRange = Union[float, Tuple[float, float]]


def _f64(t) -> Optional[torch.Tensor]:
    return None if t is None else t.to(F64)


def _clip(clip_range: ClipRange) -> Tuple[float, float]:
    """eps or (eps_low, eps_high) as (eps_low, eps_high)."""
    if isinstance(clip_range, (tuple, list)):
        return float(clip_range[0]), float(clip_range[1])
    return float(clip_range), float(clip_range)


def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(1)


@dataclass(frozen=True)
class StepArgs:
    """The step a GRPO-family loss scores: ``step_log_prob``'s keywords."""

    mode: str = "sde"
    noise_level: float = 0.7
    log_prob_kind: str = "gaussian"
    reduction: str = "mean"


@dataclass(frozen=True)
class KLArgs:
    """The KL term: ``kl_coef`` x mean_b KL_b to ``ref_model_output`` (a tensor, or the pair (uncond, cond)
    with ``ref_guidance_scale``), in ``kl_space`` "transition" (the exact Gaussian KL) or "velocity"
    (mean (v - v_ref)^2). ``kl_coef`` a [B] tensor: the per-sample form mean_b(kl_coef_b KL_b) (GARDO)."""

    kl_coef: Union[float, torch.Tensor] = 0.0
    ref_model_output: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None
    kl_space: str = "transition"
    ref_guidance_scale: Optional[float] = None


@dataclass(frozen=True)
class DGPOArgs:
    """``dgpo_loss``'s options (docs/losses.md, dgpo_loss)."""

    group_size: Optional[int] = None
    clip_range: Optional[ClipRange] = None
    clip_dsm: bool = True
    clip_kl: bool = False
    ema_reference: bool = False
    kl_coef: float = 0.0


# ----------------------------------------------------------------------------- the GRPO family


def _reference(kl: KLArgs) -> Optional[torch.Tensor]:
    """v_ref: the tensor, or uncond + w (cond - uncond) with w rounded to float32 (the contract)."""
    ref = kl.ref_model_output
    if isinstance(ref, (tuple, list)):
        w = float(torch.tensor(kl.ref_guidance_scale, dtype=torch.float32))
        uncond, cond = _f64(ref[0]), _f64(ref[1])
        return uncond + w * (cond - uncond)
    if kl.ref_guidance_scale is not None:
        raise ValueError("ref_guidance_scale is given but ref_model_output is not a pair (uncond, cond)")
    return _f64(ref)


def _kl_values(x, v, sigmas, step_index, step: StepArgs, kl: KLArgs) -> Optional[torch.Tensor]:
    v_ref = _reference(kl)
    if v_ref is None:
        return None
    if kl.kl_space == "velocity":
        d = v.to(F64) - v_ref
        return torch.stack([S.reduce(d[b] * d[b], step.reduction) for b in range(x.shape[0])])
    if kl.kl_space != "transition":
        raise NotImplementedError(f"flowrl.oracle: no kl_space {kl.kl_space!r}")
    return S.kl(x, v, v_ref, sigmas, step_index, step.mode, step.noise_level, step.reduction)


def _trust_divergence(x, v, sigmas, step_index, step: StepArgs, old_mean) -> torch.Tensor:
    """D_s = mean ||mu_theta - mu_old||^2 / (2 std^2) per sample (the KL's rule: 0 where std is 0)."""
    mu = S.mean(x, v, sigmas, step_index, step.mode, step.noise_level)
    std = S.std(sigmas, step_index, step.mode, step.noise_level, x.shape[0])
    diff = mu - _f64(old_mean)
    out = []
    for b, sd in enumerate(std.tolist()):
        if sd == 0:
            out.append((diff[b] * 0).sum())
            continue
        out.append((diff[b] * diff[b]).mean() / (2 * max(sd, S.STD_FLOOR) ** 2))
    return torch.stack(out)


def _surrogate(ratio, adv, clip):
    """-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) and the clip statistics."""
    lo, hi = clip
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - lo, 1 + hi))
    low, high = ratio.detach() < 1 - lo, ratio.detach() > 1 + hi
    return per, (low | high).to(F64).mean(), low.to(F64).mean(), high.to(F64).mean()


def _output(per, lp, old_lp, ratio, *, kl=None, kl_coef=0.0, tr=None, clip_stats=(None, None, None), masked=None,
            weights=None) -> GRPOLossOutput:
    """The batch mean (per-sample policy loss x ``rollout_is_weights``) + kl_coef mean(kl), and the stats."""
    if weights is not None:
        per = per * _f64(weights)
    policy = per.mean()
    if isinstance(kl_coef, torch.Tensor) and kl is not None:  # per sample (GARDO)
        loss = policy + (_f64(kl_coef) * kl).mean()
    else:
        loss = policy + kl_coef * kl.mean() if kl is not None and kl_coef != 0 else policy
    r = ratio.detach()
    return GRPOLossOutput(loss, policy.detach(), lp.detach(), r, None if kl is None else kl.detach(),
                          None if tr is None else tr.detach(), *clip_stats, masked,
                          0.5 * ((lp.detach() - old_lp) ** 2).mean(), r.mean(), r.min(), r.max())


def grpo_loss(x, v, prev, sigmas, step_index, *, old_log_prob, advantages, clip_range: ClipRange,
              step: StepArgs = StepArgs(), kl: KLArgs = KLArgs(), rollout_is_weights=None) -> GRPOLossOutput:
    """lp = log_prob(x, v, x'), rho = exp(lp - lp_old), per sample -min(rho A, clip(rho) A) (x the rollout
    weights), batch mean, + kl_coef mean(KL)."""
    lp = S.log_prob(x, v, prev, sigmas, step_index, step.mode, step.noise_level, step.log_prob_kind, step.reduction)
    old_lp, adv = _f64(old_log_prob), _f64(advantages)
    ratio = torch.exp(lp - old_lp)
    per, *stats = _surrogate(ratio, adv, _clip(clip_range))
    kl_b = _kl_values(x, v, sigmas, step_index, step, kl)
    return _output(per, lp, old_lp, ratio, kl=kl_b, kl_coef=kl.kl_coef, clip_stats=tuple(stats),
                   weights=rollout_is_weights)


def grpo_guard_loss(x, v, prev, sigmas, step_index, *, old_log_prob, advantages, clip_range: ClipRange,
                    old_prev_sample_mean, step: StepArgs = StepArgs(), kl: KLArgs = KLArgs(),
                    rollout_is_weights=None) -> GRPOLossOutput:
    """GRPO-Guard: rho = exp((lp - lp_old + D_s) std), the clipped surrogate of each sample divided by its
    D = sigma - sigma', batch mean, + kl_coef mean(KL)."""
    lp = S.log_prob(x, v, prev, sigmas, step_index, step.mode, step.noise_level, step.log_prob_kind, step.reduction)
    old_lp, adv = _f64(old_log_prob), _f64(advantages)
    tr = _trust_divergence(x, v, sigmas, step_index, step, old_prev_sample_mean)
    std = S.std(sigmas, step_index, step.mode, step.noise_level, x.shape[0])
    ratio = torch.exp((lp - old_lp + tr) * std)
    per, *stats = _surrogate(ratio, adv, _clip(clip_range))
    d = torch.tensor([S.step_scalars(sigmas, i, step.mode, step.noise_level).d
                      for i in S.indices(step_index, x.shape[0])], dtype=F64)
    kl_b = _kl_values(x, v, sigmas, step_index, step, kl)
    return _output(per / d, lp, old_lp, ratio, kl=kl_b, kl_coef=kl.kl_coef, tr=tr, clip_stats=tuple(stats),
                   weights=rollout_is_weights)


def flow_dppo_loss(x, v, prev, sigmas, step_index, *, old_log_prob, advantages, kl_threshold: float,
                   old_prev_sample_mean, step: StepArgs = StepArgs(), kl: KLArgs = KLArgs(),
                   rollout_is_weights=None) -> GRPOLossOutput:
    """Flow-DPPO: per sample -rho A, 0 where D_s >= kl_threshold and rho moves in A's direction (rho > 1
    with A > 0, rho < 1 with A < 0); no clip; batch mean, + kl_coef mean(KL)."""
    lp = S.log_prob(x, v, prev, sigmas, step_index, step.mode, step.noise_level, step.log_prob_kind, step.reduction)
    old_lp, adv = _f64(old_log_prob), _f64(advantages)
    tr = _trust_divergence(x, v, sigmas, step_index, step, old_prev_sample_mean)
    ratio = torch.exp(lp - old_lp)
    masked = (tr.detach() >= kl_threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    per = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    kl_b = _kl_values(x, v, sigmas, step_index, step, kl)
    return _output(per, lp, old_lp, ratio, kl=kl_b, kl_coef=kl.kl_coef, tr=tr, masked=masked.to(F64).mean(),
                   weights=rollout_is_weights)


def teacher_kl_loss(x, v, teacher_model_output, sigmas, step_index, *, mode: str = "sde", noise_level: float = 0.7,
                    reduction: str = "mean") -> Tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-OPD: (mean_b KL_b, KL [B]), KL the exact Gaussian KL to the teacher's transition."""
    kl = S.kl(x, v, teacher_model_output, sigmas, step_index, mode, noise_level, reduction)
    return kl.mean(), kl.detach()


# ----------------------------------------------------------------------------- forward-process losses


def _per_sample_t(t, batch: int, ndim: int) -> torch.Tensor:
    """``sigma`` (a float or [B]) as float64 [B, 1, ...]."""
    t = torch.full((batch,), float(t), dtype=F64) if not isinstance(t, torch.Tensor) else t.to(F64).reshape(batch)
    return t.reshape((batch,) + (1,) * (ndim - 1))


def nft_loss(noised_sample, model_output, old_model_output, clean_sample, sigma, *, advantages, beta: float,
             adv_clip_max: float, kl_coef: float = 0.0, ref_model_output=None) -> NFTLossOutput:
    """DiffusionNFT: r = clip((clip(A, -A_max, A_max) / A_max) / 2 + 1/2, 0, 1); v+ = beta v + (1 - beta)
    v_old, v- = (1 + beta) v_old - beta v; e+- = (x_t - t v+-) - x0; w+- = stop-grad max(mean |e+-|,
    1e-5); L = r mean(e+^2) / w+ / beta + (1 - r) mean(e-^2) / w- / beta; loss = mean(L A_max) +
    kl_coef mean_b mean (v - v_ref)^2."""
    xt, v, v_old, x0 = (_f64(u) for u in (noised_sample, model_output, old_model_output, clean_sample))
    t = _per_sample_t(sigma, xt.shape[0], xt.dim())
    adv = _f64(advantages)
    r = ((adv.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max) / 2 + 0.5).clamp(0, 1)
    e_pos = (xt - t * (beta * v + (1 - beta) * v_old)) - x0
    e_neg = (xt - t * ((1 + beta) * v_old - beta * v)) - x0
    w_pos = _per_sample_mean(e_pos.detach().abs()).clamp(min=NFT_WEIGHT_FLOOR)
    w_neg = _per_sample_mean(e_neg.detach().abs()).clamp(min=NFT_WEIGHT_FLOOR)
    pos, neg = _per_sample_mean(e_pos * e_pos) / w_pos, _per_sample_mean(e_neg * e_neg) / w_neg
    per = (r * pos + (1 - r) * neg) / beta
    policy = (per * adv_clip_max).mean()
    kl = None if ref_model_output is None else _per_sample_mean((v - _f64(ref_model_output)) ** 2)
    loss = policy + kl_coef * kl.mean() if kl is not None and kl_coef != 0 else policy
    return NFTLossOutput(loss, policy.detach(), per.detach(), pos.detach(), neg.detach(),
                         None if kl is None else kl.detach())


def awm_log_prob(model_output, noise, clean_sample, sigma, *, weighting: str = "uniform",
                 ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's [B]: l = -mean (v - (eps - x0))^2, weighted: uniform l, t l t, t**2 l t^2, huber
    -(sqrt(-l + 1e-10) - 1e-5) t, ghuber -((-l + 1e-10)^p - 1e-10^p) t / p (t = sigma, p = ghuber_power)."""
    v, eps, x0 = _f64(model_output), _f64(noise), _f64(clean_sample)
    lp = -_per_sample_mean((v - (eps - x0)) ** 2)
    t = _per_sample_t(sigma, v.shape[0], 1)
    if weighting == "uniform":
        return lp
    if weighting == "t":
        return lp * t
    if weighting == "t**2":
        return lp * t * t
    if weighting == "huber":
        return -(torch.sqrt(-lp + AWM_EPS) - 1e-5) * t
    if weighting == "ghuber":
        p = ghuber_power
        return -(torch.pow(-lp + AWM_EPS, p) - AWM_EPS**p) * t / p
    raise NotImplementedError(f"flowrl.oracle: no AWM weighting {weighting!r}")


def awm_loss(model_output, noise, clean_sample, sigma, *, old_log_prob, advantages, clip_range: ClipRange,
             weighting: str = "uniform", ghuber_power: float = 0.25, rollout_is_weights=None) -> GRPOLossOutput:
    """``awm_log_prob`` in ``grpo_loss``'s clipped surrogate (no KL)."""
    lp = awm_log_prob(model_output, noise, clean_sample, sigma, weighting=weighting, ghuber_power=ghuber_power)
    old_lp, adv = _f64(old_log_prob), _f64(advantages)
    ratio = torch.exp(lp - old_lp)
    per, *stats = _surrogate(ratio, adv, _clip(clip_range))
    return _output(per, lp, old_lp, ratio, clip_stats=tuple(stats), weights=rollout_is_weights)


def _matching_error(out, noise, clean_sample) -> torch.Tensor:
    """Per sample mean (R - u)^2, u = eps - x0."""
    return _per_sample_mean((_f64(out) - (_f64(noise) - _f64(clean_sample))) ** 2)


def dpo_loss(model_output, ref_model_output, noise, clean_sample, *, beta: float,
             pair_layout: str = "halves") -> DPOLossOutput:
    """Diffusion-DPO: Delta = err_theta - err_ref per sample; logits = -beta/2 (Delta_w - Delta_l) over the
    pairs (chosen then rejected: "halves", or adjacent: "interleaved"); loss = mean(-log sigmoid(logits))."""
    if noise is None:
        raise NotImplementedError("flowrl.oracle.dpo_loss: noise_seed (noise=None); pass the noise tensor")
    err, ref_err = _matching_error(model_output, noise, clean_sample), _matching_error(ref_model_output, noise,
                                                                                         clean_sample)
    delta = err - ref_err
    if pair_layout == "halves":
        pairs = delta.shape[0] // 2
        dw, dl = delta[:pairs], delta[pairs:]
    elif pair_layout == "interleaved":
        dw, dl = delta[0::2], delta[1::2]
    else:
        raise NotImplementedError(f"flowrl.oracle: no pair_layout {pair_layout!r}")
    logits = -beta / 2 * (dw - dl)
    loss = -torch.nn.functional.logsigmoid(logits).mean()
    rc, rr = (-beta / 2 * dw).detach(), (-beta / 2 * dl).detach()
    return DPOLossOutput(loss, logits.detach(), (logits.detach() > 0).to(F64).mean(), rc, rr, (rc - rr).mean(),
                         err.detach(), ref_err.detach())


def dgpo_loss(model_output, ref_model_output, noise, clean_sample, *, advantages, group_index, beta: float,
              old_model_output=None, dgpo: DGPOArgs = DGPOArgs()) -> DGPOLossOutput:
    """DGPO: dsm = mean (v - u)^2, dsm_ref = mean (v_R - u)^2 (v_R = ref_model_output, or old_model_output
    with ema_reference); w = sigmoid(sum over the group of A beta (dsm - dsm_ref) / G), detached;
    policy_loss = mean(w A dsm); loss = policy_loss + kl_coef mean(mean (v - v_ref)^2). With clip_range:
    ratio = exp(old_dsm - dsm), a sample clipped when A > 0 and ratio > 1 + eps_high or A <= 0 and ratio <
    1 - eps_low has its dsm (clip_dsm) and kl (clip_kl) detached."""
    if noise is None:
        raise NotImplementedError("flowrl.oracle.dgpo_loss: noise_seed (noise=None); pass the noise tensor")
    v_r = old_model_output if dgpo.ema_reference else ref_model_output
    dsm, dsm_ref = _matching_error(model_output, noise, clean_sample), _matching_error(v_r, noise, clean_sample)
    adv = _f64(advantages)
    groups = [int(g) for g in group_index]
    weight = torch.empty_like(adv)
    for g in sorted(set(groups)):
        members = [b for b, gb in enumerate(groups) if gb == g]
        size = dgpo.group_size if dgpo.group_size is not None else len(members)
        total = sum(float(adv[b]) * beta * float(dsm[b].detach() - dsm_ref[b].detach()) for b in members) / size
        for b in members:
            weight[b] = 1 / (1 + math.exp(-total))
    kl = None if ref_model_output is None else _per_sample_mean((_f64(model_output) - _f64(ref_model_output)) ** 2)
    ratio = clip_fraction = None
    dsm_used, kl_used = dsm, kl
    if dgpo.clip_range is not None:
        lo, hi = _clip(dgpo.clip_range)
        ratio = torch.exp(_matching_error(old_model_output, noise, clean_sample) - dsm.detach())
        clipped = ((adv > 0) & (ratio > 1 + hi)) | ((adv <= 0) & (ratio < 1 - lo))
        clip_fraction = clipped.to(F64).mean()
        if dgpo.clip_dsm:
            dsm_used = torch.where(clipped, dsm.detach(), dsm)
        if dgpo.clip_kl and kl is not None:
            kl_used = torch.where(clipped, kl.detach(), kl)
    policy = (weight * adv * dsm_used).mean()
    loss = policy + dgpo.kl_coef * kl_used.mean() if kl is not None and dgpo.kl_coef != 0 else policy
    return DGPOLossOutput(loss, policy.detach(), dsm.detach(), dsm_ref.detach(), weight,
                          None if kl is None else kl.detach(), ratio, clip_fraction)


# ----------------------------------------------------------------------------- by the public names

LOSSES = {f.__name__: f for f in (grpo_loss, grpo_guard_loss, flow_dppo_loss, teacher_kl_loss, nft_loss,
                                  awm_log_prob, awm_loss, dpo_loss, dgpo_loss)}
_GROUPS = {"step": StepArgs, "kl": KLArgs, "dgpo": DGPOArgs}
_IGNORED = ("backend",)  # the oracle has one backend


def call(name: str, *args, **kwargs):
    """The oracle of ``flowrl.losses.<name>`` called with the public function's arguments: keywords that
    belong to a group (``StepArgs``, ``KLArgs``, ``DGPOArgs``) are gathered into it; ``backend`` is
    dropped; anything else the oracle does not take raises NotImplementedError naming it."""
    fn = LOSSES.get(name)
    if fn is None:
        raise NotImplementedError(f"flowrl.oracle has no float64 row for loss {name!r}: add it to "
                                  "flowrl/oracle/losses.py from docs/losses.md's formulas")
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    for group, cls in _GROUPS.items():
        if group in params:
            names = {f.name for f in dataclasses.fields(cls)}
            kwargs[group] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise NotImplementedError(f"flowrl.oracle.{name}: option(s) {', '.join(unknown)} not covered")
    return fn(*args, **kwargs)
