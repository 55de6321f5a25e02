"""verl-omni's SDE scheduler and diffusion losses on flowrl's ops.

    # before: from verl_omni.pipelines.schedulers import FlowMatchSDEDiscreteScheduler
    from flowrl.compat.verl_omni import FlowMatchSDEDiscreteScheduler

    # or, once per process before the trainer is built (both the scheduler and the losses):
    import flowrl.compat.verl_omni as fv; fv.register()

Written against verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30:

- ``FlowMatchSDEDiscreteScheduler`` has verl-omni's ``sample_previous_step(sample, model_output,
  timestep=None, generator=None, per_token_timesteps=None, noise_level=0.7, prev_sample=None,
  sde_type="sde", return_logprobs=True, return_sqrt_dt=False, include_logprob_normalizer=True)`` and
  ``step(model_output, timestep, sample, ..., generator, per_token_timesteps, return_dict, noise_level,
  prev_sample, sde_type, return_logprobs, include_logprob_normalizer)``
  (``verl_omni/pipelines/schedulers/flow_match_sde.py``), with its returns ``(prev_sample, log_prob,
  prev_sample_mean, std_dev_t[, sqrt_dt])``: ``std_dev_t`` is verl-omni's (``"sde"``: the per-unit-time
  ``s``; ``"cps"``: the step's std; ``"dance_sde"``: ``noise_level * sqrt(sigma - sigma')``, the step's
  std), ``sqrt_dt`` is ``[B]``. The mode table: ``"sde"`` is flowrl's ``sde``, ``"cps"`` its ``cps``
  (``log_prob_kind="sq_err"``), ``"dance_sde"`` its ``dance``; ``include_logprob_normalizer=False`` is
  ``log_prob_kind="kernel"``. ``noise_level`` may be a float or a per-sample tensor (the rollout adapters'
  SDE windows: 0 outside the window). The log-prob is of the sample as returned (``out_dtype``,
  default float32: verl-omni stores the float32 trajectory), so the training adapter's recompute from
  the stored latents gives ratio exactly 1.
- The losses, as plain callables with the keyword signatures of verl-omni's ``compute_loss``
  (``verl_omni/trainer/diffusion/diffusion_algos.py``), returning ``(loss, metrics)``:
  ``flow_grpo_loss`` (``"flow_grpo"`` / ``"dance_grpo"``), ``grpo_guard_loss`` (``"grpo_guard"``),
  ``flow_dppo_loss`` (``"flow_dppo"``), ``diffusion_nft_loss`` (``"diffusion_nft"``: flowrl's fused
  ``flowrl.losses.nft_loss``). ``register()`` registers them under verl-omni's loss names (its
  ``register_diffusion_loss`` registry) when verl-omni is importable.

What differs from verl-omni:

- A deterministic step (``noise_level=0``, ``"cps"`` at the last step) has log-prob 0; verl-omni's
  ``"sde"`` / ``"dance_sde"`` give NaN there (0 / 0).
- The timestep is found with flowrl's bf16-safe lookup (a bf16 timestep works); sigma and sigma' are
  read from the float32 table; ``sigma == 1`` is tested within 1e-5 (docs/contract.md).
- Inputs of any float dtype are taken as they are (verl-omni asserts float32).
- ``per_token_timesteps`` is refused with ``ValueError`` (verl-omni: ``NotImplementedError``).
- ``diffusion_nft_loss``: flowrl's adaptive weights are clamped at 1e-5 (``adaptive_weight_min`` must
  be 1e-5, else ``ValueError``) and reduced in float32 where verl-omni reduces in float64; the reward
  probability enters as the advantage ``(2 p - 1) * adv_clip_max``.
"""
from __future__ import annotations

import math
import re
from numbers import Real
from typing import Any, Dict, Optional, Tuple

import torch

from ..core import _validate as V
from ..losses import nft_loss
from ..core.loss_spec import Variant
from ..losses._policy import policy_loss
from ..ops.functional import step_log_prob
from ..rollout.scheduler import FlowMatchEulerDiscreteScheduler
from . import _common as compat_common
from .flow_factory import _assemble, _groups

SDE_TYPES = {"sde": "sde", "cps": "cps", "dance_sde": "dance"}
LOSS_NAMES = ("flow_grpo", "dance_grpo", "grpo_guard", "flow_dppo", "diffusion_nft")


def _noise_levels(noise_level, batch: int, cps: bool):
    """Per-sample noise levels (a list of B floats) from a real or a tensor of 1 or B values, and
    whether it was a scalar."""
    if isinstance(noise_level, torch.Tensor):
        if noise_level.dtype == torch.bool or noise_level.dtype.is_complex:
            raise TypeError(f"noise_level must be a real number or a real tensor; got {noise_level.dtype}")
        values = [float(v) for v in noise_level.reshape(-1).tolist()]
        scalar = noise_level.numel() == 1
    else:
        values, scalar = [noise_level], True
    if len(values) not in (1, batch):
        raise ValueError(f"noise_level must hold 1 or B = {batch} values; got {len(values)}")
    etas = [compat_common.check_noise_level("noise_level", v, at_most_one=cps) for v in values]
    return (etas * batch if len(etas) == 1 else etas), scalar


class FlowMatchSDEDiscreteScheduler(FlowMatchEulerDiscreteScheduler):
    """verl-omni's ``FlowMatchSDEDiscreteScheduler`` on flowrl's scheduler and ops (module docstring).
    Built as verl-omni builds it (``from_pretrained(path, subfolder="scheduler")``, ``from_config``)."""

    def sample_previous_step(
        self,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        timestep: Optional[torch.Tensor] = None,
        generator=None,
        per_token_timesteps: Optional[torch.Tensor] = None,
        noise_level=0.7,
        prev_sample: Optional[torch.Tensor] = None,
        sde_type: str = "sde",
        return_logprobs: bool = True,
        return_sqrt_dt: bool = False,
        include_logprob_normalizer: bool = True,
        *,
        out_dtype: Optional[torch.dtype] = None,
        backend: str = "auto",
    ):
        """One SDE / CPS / Dance step (``prev_sample=None``: sample it) or the log-prob of a stored
        ``prev_sample`` (training; differentiable in ``model_output``). ``timestep=None`` uses the
        scheduler's ``step_index`` (the sequential loop). Extra keyword-only: ``out_dtype`` (the sampled
        ``prev_sample``'s dtype, default float32, which is what is scored), ``backend``."""
        sigmas, timesteps = compat_common.scheduler_tables(self, "self")
        compat_common.check_tensor("sample", sample)
        compat_common.check_tensor("model_output", model_output, sample, "sample")
        if prev_sample is not None:
            compat_common.check_tensor("prev_sample", prev_sample, sample, "sample")
        if per_token_timesteps is not None:
            raise ValueError("per_token_timesteps is not supported (verl-omni does not support it either)")
        if not isinstance(sde_type, str) or sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {', '.join(map(repr, SDE_TYPES))}; got {sde_type!r}")
        V.check_bool("return_logprobs", return_logprobs)
        V.check_bool("return_sqrt_dt", return_sqrt_dt)
        V.check_bool("include_logprob_normalizer", include_logprob_normalizer)
        out_dtype = compat_common.check_out_dtype(out_dtype) or torch.float32
        mode = SDE_TYPES[sde_type]
        kind = "sq_err" if mode == "cps" else ("gaussian" if include_logprob_normalizer else "kernel")
        batch, device = sample.shape[0], sample.device
        table = compat_common.on_device(sigmas, device)
        if timestep is None:
            if self.step_index is None:
                raise ValueError("timestep is None and the scheduler has no step_index: pass timestep, or call step()")
            idx = torch.full((batch,), int(self.step_index), dtype=torch.int64, device=device)
            given = 0
        else:
            idx, given = compat_common.resolve_timesteps("timestep", timestep, timesteps, batch, device)
        etas, scalar_eta = _noise_levels(noise_level, batch, mode == "cps")

        noise = compat_common.draw(sample, generator) if prev_sample is None else None
        prev_parts, lp_parts, mean_parts = [], [], []
        for eta, rows in _groups(etas):
            pick = (lambda t: t) if rows is None else (lambda t, r=torch.tensor(rows, device=device): t[r])
            x, v, i = pick(sample), pick(model_output), pick(idx)
            if prev_sample is None:
                o = compat_common.emit(x, v, table, i, mode=mode, eta=eta, noise=pick(noise), kind=kind, out_dtype=out_dtype,
                           peer_compatible=False, backend=backend)
                prev_parts.append((rows, o[0]))
                lp_parts.append((rows, o[1]))
                mean_parts.append((rows, o[2]))
            else:
                prev_parts.append((rows, pick(prev_sample).to(torch.float32)))
                if return_logprobs:
                    lp_parts.append((rows, step_log_prob(x, v, pick(prev_sample), table, i, mode=mode, noise_level=eta,
                                                         log_prob_kind=kind, backend=backend)))
                mean_parts.append((rows, compat_common.step_mean(x, v, table, i, mode, eta, backend)))
        prev, mean = _assemble(prev_parts), _assemble(mean_parts)
        log_prob = _assemble(lp_parts) if return_logprobs else None

        f32 = table.to(torch.float32)
        sigma, sigma_next = f32[idx], f32[idx + 1]
        eta_t = torch.tensor(etas, dtype=torch.float32, device=device)
        if mode == "sde":
            std = eta_t * compat_common.sde_per_unit_time_std(table, idx, 1.0)
        elif mode == "cps":
            std = torch.cat([compat_common.cps_std(sigma_next[k:k + 1], e) for k, e in enumerate(etas)])
        else:
            std = eta_t * torch.sqrt(sigma - sigma_next)
        if given == 0 and scalar_eta:  # verl-omni's sequential loop: 0-d sigma, 0-d std_dev_t
            std_dev_t = std[0].reshape(())
        else:
            std_dev_t = compat_common.column(std, sample.dim())
        if return_sqrt_dt:
            return prev, log_prob, mean, std_dev_t, torch.sqrt(sigma - sigma_next)
        return prev, log_prob, mean, std_dev_t

    def step(
        self,
        model_output: torch.Tensor,
        timestep,
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator=None,
        per_token_timesteps: Optional[torch.Tensor] = None,
        return_dict: bool = True,
        noise_level=0.7,
        prev_sample: Optional[torch.Tensor] = None,
        sde_type: str = "sde",
        return_logprobs: bool = True,
        include_logprob_normalizer: bool = True,
        *,
        out_dtype: Optional[torch.dtype] = None,
        backend: str = "auto",
    ):
        """verl-omni's ``step``: ``sample_previous_step`` at the scheduler's ``step_index`` (initialised
        from ``timestep``), then ``step_index += 1``. Returns ``FlowMatchSDEDiscreteSchedulerOutput`` or
        the tuple ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``. ``s_churn`` and the other
        Euler-churn arguments are accepted and unused, as in verl-omni."""
        if isinstance(timestep, int) or (isinstance(timestep, torch.Tensor) and not timestep.dtype.is_floating_point):
            raise ValueError("timestep must be one of scheduler.timesteps, not an integer index")
        V.check_bool("return_dict", return_dict)
        if self.step_index is None:
            self._init_step_index(timestep)
        out = self.sample_previous_step(sample, model_output, generator=generator,
                                        per_token_timesteps=per_token_timesteps, noise_level=noise_level,
                                        prev_sample=prev_sample, sde_type=sde_type, return_logprobs=return_logprobs,
                                        include_logprob_normalizer=include_logprob_normalizer, out_dtype=out_dtype,
                                        backend=backend)
        self._step_index += 1
        if not return_dict:
            return out
        return FlowMatchSDEDiscreteSchedulerOutput(*out)


class FlowMatchSDEDiscreteSchedulerOutput(tuple):
    """verl-omni's output fields ``prev_sample, log_prob, prev_sample_mean, std_dev_t`` (a named tuple
    that also indexes by field name, as diffusers' ``BaseOutput``)."""

    _fields = ("prev_sample", "log_prob", "prev_sample_mean", "std_dev_t")

    def __new__(cls, prev_sample, log_prob, prev_sample_mean, std_dev_t):
        return super().__new__(cls, (prev_sample, log_prob, prev_sample_mean, std_dev_t))

    def __getattr__(self, name):
        if name in FlowMatchSDEDiscreteSchedulerOutput._fields:
            return self[FlowMatchSDEDiscreteSchedulerOutput._fields.index(name)]
        raise AttributeError(name)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return super().__getitem__(key)


# ------------------------------------------------------------------------------------------ losses
def _cfg(config, name: str, default=None):
    """``config.diffusion_loss.<name>`` (attribute or mapping access, as omegaconf allows both)."""
    loss_cfg = getattr(config, "diffusion_loss", None)
    if loss_cfg is None and hasattr(config, "get"):
        loss_cfg = config.get("diffusion_loss")
    if loss_cfg is None:
        raise ValueError("config must have a diffusion_loss section (verl-omni's DiffusionActorConfig)")
    value = getattr(loss_cfg, name, None)
    if value is None and hasattr(loss_cfg, "get"):
        value = loss_cfg.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"config.diffusion_loss.{name} must be set")
        return default
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        if isinstance(value, bool) and name == "add_kl_coefficient":
            return value
        raise ValueError(f"config.diffusion_loss.{name} must be a finite number; got {value!r}")
    return float(value)


def _per_sample(name, t, like=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor; got {type(t).__name__}")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"{name} must have log_prob's shape {tuple(like.shape)}; got {tuple(t.shape)}")
    return t


def _pg_metrics(log_ratio, ratio, clip) -> Dict[str, float]:
    with torch.no_grad():
        return {
            "actor/ppo_kl": float(torch.mean(-log_ratio)),
            "actor/pg_clipfrac": float(torch.mean((torch.abs(ratio - 1.0) > clip).float())),
            "actor/pg_clipfrac_higher": float(torch.mean((ratio - 1.0 > clip).float())),
            "actor/pg_clipfrac_lower": float(torch.mean((1.0 - ratio > clip).float())),
            "actor/ratio_mean": float(ratio.mean()),
            "actor/ratio_std": float(ratio.std()) if ratio.numel() > 1 else 0.0,
        }


def _is_weights(rollout_is_weights, log_prob):
    """verl-omni's ``rollout_is_weights`` (detached; log_prob's shape), or None."""
    if rollout_is_weights is None:
        return None
    return _per_sample("rollout_is_weights", rollout_is_weights, log_prob).detach()


# The surrogates below are flowrl.losses._policy.policy_loss's (the GRPO family's per-sample arithmetic,
# written once): verl-omni's clamp(A), rho, D_s / KL and scale are formed here and passed in; the metrics
# keep verl-omni's formulas (e.g. |rho - 1| > eps for the clip fraction) on policy_loss's ratio.


def flow_grpo_loss(*, old_log_prob, log_prob, advantages, config, rollout_is_weights=None
                   ) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl-omni's ``FlowGRPOLoss.compute_loss`` (``"flow_grpo"``, ``"dance_grpo"``): advantages clamped
    to ``adv_clip_max``, ``mean(max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) * w)``."""
    log_prob = _per_sample("log_prob", log_prob)
    old_log_prob, advantages = _per_sample("old_log_prob", old_log_prob, log_prob), _per_sample("advantages", advantages,
                                                                                               log_prob)
    clip, adv_max = _cfg(config, "clip_ratio"), _cfg(config, "adv_clip_max")
    adv = torch.clamp(advantages, -adv_max, adv_max)
    out = policy_loss(Variant.GRPO, log_prob, None, None, old_log_prob, adv, (clip, clip), 0.0, None, None,
                      _is_weights(rollout_is_weights, log_prob))
    return out.loss, _pg_metrics(log_prob.detach() - old_log_prob, out.ratio, clip)


def _mean_diff_sq(prev_sample_mean, old_prev_sample_mean):
    if not isinstance(prev_sample_mean, torch.Tensor) or not isinstance(old_prev_sample_mean, torch.Tensor):
        raise TypeError("prev_sample_mean and old_prev_sample_mean must be tensors")
    if prev_sample_mean.shape != old_prev_sample_mean.shape:
        raise ValueError(f"old_prev_sample_mean must have prev_sample_mean's shape {tuple(prev_sample_mean.shape)}; "
                         f"got {tuple(old_prev_sample_mean.shape)}")
    return (prev_sample_mean - old_prev_sample_mean.detach()).pow(2)


def grpo_guard_loss(*, old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                    sqrt_dt, rollout_is_weights=None) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl-omni's ``GRPOGuardLoss.compute_loss``: with the step's shared ``scale = mean(std_dev_t) *
    mean(sqrt_dt)`` (the step's std), ``D_s = mean (mu - mu_old)^2 / (2 scale^2)``, ``rho = exp((log_prob
    - old_log_prob + D_s) * scale)``, the clipped surrogate's mean divided by ``mean(sqrt_dt)^2``."""
    log_prob = _per_sample("log_prob", log_prob)
    old_log_prob, advantages = _per_sample("old_log_prob", old_log_prob, log_prob), _per_sample("advantages", advantages,
                                                                                               log_prob)
    clip, adv_max = _cfg(config, "clip_ratio"), _cfg(config, "adv_clip_max")
    adv = torch.clamp(advantages, -adv_max, adv_max)
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * std_dev_t.mean()
    d = _mean_diff_sq(prev_sample_mean, old_prev_sample_mean)
    d = d.mean(dim=tuple(range(1, d.ndim))) if d.ndim > 1 else d
    bias = d / (2 * scale ** 2)
    # guard weights (scale, 1.0): verl-omni divides the batch mean by mean(sqrt_dt)^2 (below), where
    # flowrl's grpo_guard_loss multiplies each sample by its own 1/D before the mean; * 1.0 is exact
    out = policy_loss(Variant.GUARD, log_prob, None, bias, old_log_prob, adv, (clip, clip), 0.0, (scale, 1.0), None,
                      _is_weights(rollout_is_weights, log_prob))
    return out.loss / sqrt_dt_mean ** 2, _pg_metrics(log_prob.detach() - old_log_prob, out.ratio, clip)


def flow_dppo_loss(*, old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                   sqrt_dt, rollout_is_weights=None) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl-omni's ``FlowDPPOLoss.compute_loss``: per sample ``-A rho``, set to 0 where the Gaussian KL
    ``mean (mu - mu_old)^2 / (2 (std_dev_t sqrt_dt)^2)`` (``/ 2`` with ``add_kl_coefficient=False``)
    is at least ``kl_mask_threshold`` and rho moves in A's direction; no clipping; batch mean."""
    log_prob = _per_sample("log_prob", log_prob)
    old_log_prob = _per_sample("old_log_prob", old_log_prob, log_prob)
    adv = _per_sample("advantages", advantages, log_prob).detach()
    threshold = _cfg(config, "kl_mask_threshold")
    add_coef = _cfg(config, "add_kl_coefficient", True)
    d = _mean_diff_sq(prev_sample_mean, old_prev_sample_mean)
    if add_coef:
        s = sqrt_dt.reshape(-1, *([1] * (std_dev_t.dim() - 1))) if sqrt_dt.dim() else sqrt_dt
        d = d / (2 * (std_dev_t * s) ** 2)
    else:
        d = d / 2
    kl = d.mean(dim=tuple(range(1, d.ndim))) if d.ndim > 1 else d
    out = policy_loss(Variant.DPPO, log_prob, None, kl, old_log_prob, adv, None, 0.0, None, threshold,
                      _is_weights(rollout_is_weights, log_prob))
    with torch.no_grad():
        kl = kl.detach()
        metrics = {"actor/ppo_kl": float(torch.mean(-(log_prob - old_log_prob))),
                   "actor/ratio_mean": float(out.ratio_mean),
                   "actor/kl_new_old_mean": float(kl.mean()), "actor/kl_new_old_max": float(kl.max()),
                   "actor/kl_mask_fraction": float((kl >= threshold).float().mean()),
                   "actor/masked_fraction": float(out.masked_fraction)}
    return out.loss, metrics


def diffusion_nft_loss(*, forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t_expanded, reward_prob,
                       config, backend: str = "auto") -> Tuple[torch.Tensor, Dict[str, Any]]:
    """verl-omni's ``DiffusionNFTLoss.compute_loss`` on flowrl's fused ``nft_loss`` (one element pass):
    ``mix_beta`` is beta, ``adv_clip_max`` the scale, ``ref_kl_coef`` the KL weight; ``t_expanded``
    [B, 1, ...] (one t per sample); ``reward_prob`` [B] (or [B, ...], averaged per sample)."""
    beta, adv_max = _cfg(config, "mix_beta"), _cfg(config, "adv_clip_max")
    kl_coef = _cfg(config, "ref_kl_coef", 0.0)
    weight_min = _cfg(config, "adaptive_weight_min", 1e-5)
    if weight_min != 1e-5:
        raise ValueError(f"config.diffusion_loss.adaptive_weight_min must be 1e-5 (flowrl's fused NFT clamp); got "
                         f"{weight_min}")
    if not isinstance(t_expanded, torch.Tensor) or t_expanded.shape[0] != xt.shape[0]:
        raise ValueError("t_expanded must be a tensor [B, 1, ...] with one t per sample")
    t = t_expanded.reshape(t_expanded.shape[0], -1)
    if not bool((t == t[:, :1]).all()):
        raise ValueError("t_expanded must hold one t per sample")
    p = _per_sample("reward_prob", reward_prob)
    p = p.flatten(1).mean(dim=1) if p.dim() > 1 else p
    advantages = ((2.0 * p.to(torch.float32) - 1.0) * adv_max).detach()
    out = nft_loss(xt.detach(), forward_prediction, old_prediction.detach(), x0.detach(), t[:, 0].detach().float(),
                   advantages=advantages, beta=beta, adv_clip_max=adv_max, kl_coef=kl_coef,
                   ref_model_output=ref_forward_prediction.detach(), backend=backend)
    with torch.no_grad():
        metrics = {"actor/policy_loss": float(out.policy_loss), "actor/positive_loss": float(out.positive_loss.mean()),
                   "actor/negative_loss": float(out.negative_loss.mean()), "actor/ref_kl_loss": float(out.kl.mean()),
                   "actor/reward_prob_mean": float(p.mean()), "actor/total_loss": float(out.loss)}
    return out.loss, metrics


LOSSES = {
    "flow_grpo": (flow_grpo_loss, ("log_probs",), ("old_log_probs", "advantages")),
    "dance_grpo": (flow_grpo_loss, ("log_probs",), ("old_log_probs", "advantages")),
    "grpo_guard": (grpo_guard_loss, ("log_probs", "prev_sample_mean", "std_dev_t", "sqrt_dt"),
                   ("old_log_probs", "advantages", "old_prev_sample_mean")),
    "flow_dppo": (flow_dppo_loss, ("log_probs", "prev_sample_mean", "std_dev_t", "sqrt_dt"),
                  ("old_log_probs", "advantages", "old_prev_sample_mean")),
    "diffusion_nft": (diffusion_nft_loss, ("forward_prediction", "old_prediction", "ref_forward_prediction", "x0", "xt",
                                           "t_expanded"), ("reward_prob",)),
}


def loss_from_batch(name: str, config, model_output, data):
    """What a registered loss's ``__call__`` does: read verl-omni's ``model_output`` / ``data`` keys for
    ``name`` and call the callable; returns ``(loss, metrics)``."""
    if name not in LOSSES:
        raise ValueError(f"name must be one of {', '.join(LOSSES)}; got {name!r}")
    fn = LOSSES[name][0]
    if fn is diffusion_nft_loss:
        return fn(config=config, reward_prob=data["reward_prob"],
                  **{k: model_output[k] for k in LOSSES[name][1]})
    kwargs = dict(old_log_prob=data["old_log_probs"], log_prob=model_output["log_probs"],
                  advantages=data["advantages"], config=config,
                  rollout_is_weights=data.get("rollout_is_weights", None) if hasattr(data, "get") else None)
    if fn is not flow_grpo_loss:
        kwargs.update(old_prev_sample_mean=data["old_prev_sample_mean"], prev_sample_mean=model_output["prev_sample_mean"],
                      std_dev_t=model_output["std_dev_t"], sqrt_dt=model_output["sqrt_dt"])
    return fn(**kwargs)


def _class_name(prefix: str, name: str) -> str:
    return "FlowRL_" + re.sub(r"\W", "_", prefix + name)


def _loss_class(algos, prefix: str, name: str):
    """The verl-omni loss class ``register()`` installs for ``name`` (under ``prefix + name``): made once
    per (prefix, name) and kept as this module's attribute ``FlowRL_<prefix><name>``, with this module as
    its ``__module__``, so its instances pickle (Ray and multiprocessing send them) and unpickle in a
    process that imports this module (``__getattr__`` rebuilds it there)."""
    qualname = _class_name(prefix, name)
    cls = globals().get(qualname)
    # the same verl-omni module: a re-imported one (another process's, a test's stand-in) gets a new class
    if cls is not None and getattr(cls, "_flowrl_key", None) == (prefix, name) and cls._flowrl_algos is algos:
        return cls
    fn, model_keys, data_keys = LOSSES[name]

    def __call__(self, *, config, model_output, data, _name=name):
        loss, metrics = loss_from_batch(_name, config, model_output, data)
        return algos.DiffusionLossResult(loss=loss, metrics=metrics)

    base = type(algos.DIFFUSION_LOSS_REGISTRY.get(name)) if name in algos.DIFFUSION_LOSS_REGISTRY \
        else algos.DiffusionLossFn  # keeps verl-omni's prepare_actor_batch (e.g. DiffusionNFT's)
    if getattr(base, "_flowrl_key", None) is not None:  # registered before: verl-omni's own class is its base
        base = base.__mro__[1]
    # verl-omni's base is an ABC: without __module__ here, ABCMeta would name the class abc.FlowRL_...
    cls = type(qualname, (base,), {
        "__module__": __name__, "__qualname__": qualname, "_flowrl_key": (prefix, name), "_flowrl_algos": algos,
        "required_model_output_keys": model_keys, "required_data_keys": data_keys,
        "compute_loss": classmethod(lambda cls, _fn=fn, **kw: _fn(**kw)), "__call__": __call__,
    })
    globals()[qualname] = cls
    return cls


def __getattr__(attr: str):
    """``FlowRL_<prefix><loss>`` in a process that unpickles a registered loss before registering."""
    if attr.startswith("FlowRL_"):
        for name in sorted(LOSS_NAMES, key=len, reverse=True):
            if attr.endswith(name):
                prefix = attr[len("FlowRL_"):-len(name)]
                if _class_name(prefix, name) == attr:
                    from verl_omni.trainer.diffusion import diffusion_algos as algos

                    return _loss_class(algos, prefix, name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def register(*, losses: bool = True, scheduler: bool = True, prefix: str = "") -> Dict[str, Any]:
    """Register flowrl's versions with verl-omni, in this process (call it before the trainer is built).

    ``losses``: each of ``LOSS_NAMES`` under ``prefix + name`` in verl-omni's diffusion-loss registry
    (``register_diffusion_loss``); with the default ``prefix=""`` they replace verl-omni's own, so the
    configuration is unchanged; with e.g. ``prefix="flowrl_"`` select them by
    ``diffusion_loss.loss_mode: flowrl_flow_grpo``. ``scheduler``: ``verl_omni.pipelines.schedulers.
    FlowMatchSDEDiscreteScheduler`` (and the name in already-imported verl-omni modules that bound it)
    becomes this module's class. Returns what was registered; ``ImportError`` without verl-omni."""
    import sys

    V.check_bool("losses", losses)
    V.check_bool("scheduler", scheduler)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    try:
        from verl_omni.trainer.diffusion import diffusion_algos as algos
        import verl_omni.pipelines.schedulers as schedulers
    except ImportError as e:
        raise ImportError("flowrl.compat.verl_omni.register() needs verl-omni (verl-project/verl-omni) installed") from e
    done: Dict[str, Any] = {}
    if losses:
        for name in LOSS_NAMES:
            cls = _loss_class(algos, prefix, name)
            algos.register_diffusion_loss(prefix + name)(cls)
            done[prefix + name] = cls
    if scheduler:
        original = getattr(schedulers, "FlowMatchSDEDiscreteScheduler", None)
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("verl_omni") and mod is not None and original is not None \
                    and getattr(mod, "FlowMatchSDEDiscreteScheduler", None) is original:
                setattr(mod, "FlowMatchSDEDiscreteScheduler", FlowMatchSDEDiscreteScheduler)
        schedulers.FlowMatchSDEDiscreteScheduler = FlowMatchSDEDiscreteScheduler
        done["FlowMatchSDEDiscreteScheduler"] = FlowMatchSDEDiscreteScheduler
    return done


__all__ = [
    "FlowMatchSDEDiscreteScheduler", "FlowMatchSDEDiscreteSchedulerOutput", "flow_grpo_loss", "grpo_guard_loss",
    "flow_dppo_loss", "diffusion_nft_loss", "loss_from_batch", "register", "LOSSES", "LOSS_NAMES", "SDE_TYPES",
]
