"""DanceGRPO's ``flux_step`` on flowrl's ops.

    # before: flux_step defined in fastvideo/train_grpo_flux.py (XueZeyue/DanceGRPO)
    from flowrl.compat.dance_grpo import flux_step

Same signature and returns as DanceGRPO's ``flux_step(model_output, latents, eta, sigmas, index,
prev_sample, grpo, sde_solver)``:

- ``grpo=True``: ``(prev_sample, pred_original_sample, log_prob)``. ``prev_sample=None`` samples the
  step (noise from the global RNG, as DanceGRPO's ``torch.randn_like``; or ``generator=``); a given
  ``prev_sample`` is returned as given and ``log_prob`` is its log-prob (training; differentiable in
  ``model_output``). The step is flowrl's ``dance`` mode: std ``eta * sqrt(sigma - sigma')``, mean
  ``x - D v - D eta^2 (x + (1 - sigma) v) / (2 sigma)`` (DanceGRPO's score-corrected mean with
  ``sde_solver=True``), Gaussian log-density averaged over elements.
- ``grpo=False``: ``(prev_sample_mean, pred_original_sample)``, the deterministic mean: the
  score-corrected one with ``sde_solver=True``, the Euler step ``x - D v`` with ``sde_solver=False``.

``pred_original_sample`` is ``latents - sigma * model_output``. Returned tensors have DanceGRPO's dtype
(``latents``' and ``model_output``'s promoted), except the sample, below.

What differs from DanceGRPO (docs/integration.md):

- ``prev_sample`` is emitted in ``out_dtype`` (default ``model_output.dtype``: bf16 under DanceGRPO's
  autocast) and ``log_prob`` is of that rounded sample, so the stored latent is the one the
  recompute reads (ratio exactly 1). DanceGRPO adds float32 noise to a float32 mean and returns the
  float32 sample. ``peer_compatible=True`` reproduces that: the sample in DanceGRPO's dtype and the
  log-prob of the float32 value (with an ``out_dtype`` other than float32: ``ValueError``, the
  returned sample would not be the one scored).
- flowrl computes the mean in float32. With a bf16 ``model_output`` DanceGRPO rounds ``dsigma *
  model_output`` and ``sigma * model_output`` to bf16 before adding them to the float32 latents (a
  0-d tensor times a bf16 tensor stays bf16), so its mean, sample and ``pred_original_sample`` differ
  from flowrl's by that rounding; ``peer_compatible`` does not reproduce it. The rollout's log-prob
  still agrees within float32 rounding (``x' - mu`` is the noise term on both sides).
- ``eta=0`` is a deterministic step with log-prob 0; DanceGRPO raises ``ValueError: math domain
  error`` (``math.log(0)``).
- ``grpo=True`` with ``sde_solver=False`` (Euler mean, ``eta * sqrt(D)`` noise) is not one of flowrl's
  modes: ``ValueError`` naming ``sde_solver`` (every DanceGRPO trainer passes ``sde_solver=True``).
- ``index`` may also be an integer tensor [B] (one step per sample).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..core import _validate as V
from ..ops.functional import step_log_prob
from . import _common as compat_common


def flux_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: Union[int, torch.Tensor],
    prev_sample: Optional[torch.Tensor],
    grpo: bool,
    sde_solver: bool,
    *,
    generator=None,
    out_dtype: Optional[torch.dtype] = None,
    peer_compatible: bool = False,
    backend: str = "auto",
):
    """DanceGRPO's step (see the module docstring). Extra keyword-only arguments: ``generator`` (None:
    the global RNG, as DanceGRPO), ``out_dtype`` (the sampled ``prev_sample``'s dtype; default
    ``model_output.dtype``), ``peer_compatible`` (the log-prob of the float32 sample, as DanceGRPO),
    ``backend``."""
    compat_common.check_tensor("latents", latents)
    compat_common.check_tensor("model_output", model_output, latents, "latents")
    if prev_sample is not None:
        compat_common.check_tensor("prev_sample", prev_sample, latents, "latents")
    eta = compat_common.check_noise_level("eta", eta)
    V.check_bool("grpo", grpo)
    V.check_bool("sde_solver", sde_solver)
    V.check_bool("peer_compatible", peer_compatible)
    out_dtype = compat_common.check_out_dtype(out_dtype)
    if peer_compatible and out_dtype not in (None, torch.float32):
        raise ValueError(
            f"peer_compatible=True with out_dtype={out_dtype} would return the sample rounded to {out_dtype} with the "
            "log-prob of the unrounded float32 sample, which the recompute from the stored sample does not reproduce; "
            "drop peer_compatible (the log-prob of the rounded sample) or out_dtype (DanceGRPO's sample)"
        )
    if grpo and not sde_solver:
        raise ValueError(
            "sde_solver=False with grpo=True (Euler mean with eta * sqrt(dt) noise) is not supported: flowrl's "
            "'dance' mode is DanceGRPO's sde_solver=True step, which every DanceGRPO trainer uses"
        )
    if not isinstance(sigmas, torch.Tensor):
        raise TypeError(f"sigmas must be a 1-D torch.Tensor schedule; got {type(sigmas).__name__}")
    if sigmas.dtype not in (torch.float32, torch.float64) or sigmas.dim() != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D float32 schedule of length T + 1 >= 2; got {sigmas.dtype} "
                         f"{tuple(sigmas.shape)}")
    V.check_sigmas(sigmas, sigmas.device)  # validated where it lives (cached per tensor)
    table = compat_common.on_device(sigmas, latents.device)
    idx = compat_common.check_index("index", index, table.numel() - 1, latents.shape[0], latents.device)
    mode = "dance" if sde_solver else "ode"
    peer_dtype = compat_common.promote(latents.dtype, model_output.dtype)
    sigma = compat_common.column(table.to(torch.float32)[idx], latents.dim())
    x0 = (latents.to(torch.float32) - sigma * model_output.to(torch.float32)).to(peer_dtype)

    if not grpo:
        mean = compat_common.step_mean(latents, model_output, table, idx, mode, eta, backend)
        return mean.to(peer_dtype), x0
    if prev_sample is None:
        noise = compat_common.draw(latents, generator)
        if out_dtype is None:
            out_dtype = peer_dtype if peer_compatible else model_output.dtype
        prev, log_prob, _, _ = compat_common.emit(latents, model_output, table, idx, mode="dance", eta=eta, noise=noise,
                                      kind="gaussian", out_dtype=out_dtype, peer_compatible=peer_compatible,
                                      backend=backend)
        return prev, x0, log_prob
    log_prob = step_log_prob(latents, model_output, prev_sample, table, idx, mode="dance", noise_level=eta,
                             log_prob_kind="gaussian", backend=backend)
    return prev_sample, x0, log_prob


__all__ = ["flux_step"]
