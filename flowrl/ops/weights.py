"""Per-step weights that GRPO variants put on the log-prob ratio or on the loss, from the step's math
(docs/contract.md, Per-step weights), so trainers stop re-deriving them.

``step_weights(scheme, sigmas, step_index, mode=..., noise_level=...)`` returns ``StepWeights(log_ratio,
loss)``, float32 tensors shaped like ``step_index`` (0-d for an int): multiply ``log_prob -
old_log_prob`` by ``log_ratio`` before the exponential, and the per-sample clipped loss by ``loss``.
``std`` is the step's std and ``c`` the coefficient of the model output in its mean (``mu = a x + c v``),
both from ``flowrl.backends.reference.mode_coefficients`` (the contract's formulas, computed in float64 from the
float32 table), ``D = sigma - sigma'``:

- ``"grpo_guard"`` (GRPO-Guard, arXiv 2510.22319; verl-omni ``GRPOGuardLoss`` in
  verl_omni/trainer/diffusion/diffusion_algos.py, Flow-Factory ``GRPOGuardTrainer``): log_ratio = std
  (their ``sqrt_dt * sigma_t``: ratio = exp((log_prob - old_log_prob + mean_bias) * std)), loss = 1 / D
  (verl-omni's ``1 / sqrt_dt**2``). The mean-bias term ``|mu - mu_old|^2 / (2 std^2)`` is a function of
  the two means, not a weight: flowrl's ``step_kl`` computes it (the same value).
- ``"tempflow_grpo"`` (TempFlow-GRPO, scripts/train_flux_pr.py): loss = std (their
  ``std_dev_t * sqrt(-dt)``; their code multiplies by a further constant 1.73), log_ratio = 1.
- ``"flash_grpo"`` (Flash-GRPO, scripts/train_wanx2_1_flash.py): loss = std / |c| (their ``coe``,
  ``1 / (sqrt(-dt) / std_dev_t + std_dev_t sqrt(-dt) (1 - sigma) / (2 sigma))`` for the Flow-SDE mean;
  they then divide by its mean over the batch's steps), log_ratio = 1; 0 where the step is
  deterministic (std = 0) or the mean does not read the model output (c = 0).

``normalize_over`` (step indices, any scheme) divides ``loss`` by the mean of the scheme's ``loss`` over
those steps (``log_ratio`` is unchanged): Flash-GRPO's temporal gradient rectification is the
``flash_grpo`` loss weight over its mean, the mean over the steps the batch trains on, all ranks
(scripts/train_wanx2_1_flash.py: ``w = 1 / accelerator.reduce(coe.mean())``), or over a fixed candidate
pool (UniRL's ``FlashGRPO``, unirl/algorithms/flashgrpo.py, ``rectification_indices``: the first 10 of 20
steps). Pass the pool, or the batch's step indices gathered from every rank (with equal per-rank
batches the mean of the ranks' means is the pooled mean).
"""
from __future__ import annotations

from numbers import Integral
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ..core import _validate as V
from ..contract import Mode, Schedule
from ..backends.reference import mode_coefficients

SCHEMES = ("grpo_guard", "tempflow_grpo", "flash_grpo")


class StepWeights(NamedTuple):
    """log_ratio: multiplies ``log_prob - old_log_prob``; loss: multiplies the per-sample loss."""

    log_ratio: torch.Tensor
    loss: torch.Tensor


def step_weights(
    scheme: str,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    normalize_over: Optional[Union[torch.Tensor, Sequence[int]]] = None,
) -> StepWeights:
    """The ``scheme``'s per-step weights (module docstring) for steps ``step_index`` (an int or an
    integer tensor [B]) of the float32 schedule ``sigmas`` under ``mode`` / ``noise_level``; with
    ``normalize_over`` (a non-empty integer tensor [P] or sequence of step indices) ``loss`` is divided by
    its mean over those steps (in float64, before the float32 rounding)."""
    V.check_choice("scheme", scheme, SCHEMES)
    mode = Mode.parse("mode", mode)
    if mode.rules.schedule is not Schedule.SIGMAS:
        raise ValueError(f"step_weights reads a flow schedule (sigmas); mode={mode.label!r} is not one")
    eta = V.check_noise_level(noise_level, mode.label)
    table = V.check_sigmas(sigmas, sigmas.device if isinstance(sigmas, torch.Tensor) else torch.device("cpu"))
    scalar = not isinstance(step_index, torch.Tensor)
    idx = V.check_step_index(step_index, table.numel() - 1, 1 if scalar else step_index.numel(), table.device)
    log_ratio, loss = scheme_weights(scheme, table, idx, mode, eta, torch.float64)
    if normalize_over is not None:
        pool = _check_pool(normalize_over, table.numel() - 1, table.device)
        pool_mean = scheme_weights(scheme, table, pool, mode, eta, torch.float64)[1].mean()
        if not bool(pool_mean > 0):
            raise ValueError(f"normalize_over: the mean of {scheme!r}'s loss weight over those steps is "
                             f"{float(pool_mean)} (every one deterministic under mode={mode.label!r}, "
                             f"noise_level={eta}); it must be > 0")
        loss = loss / pool_mean
    out = [t.float().reshape(()) if scalar else t.float() for t in (log_ratio, loss)]
    return StepWeights(*out)


def _check_pool(normalize_over, num_steps: int, device: torch.device) -> torch.Tensor:
    """``normalize_over`` as int64 step indices [P], P >= 1, each in [0, T - 1]."""
    if not isinstance(normalize_over, torch.Tensor):
        if isinstance(normalize_over, (str, bytes)) or not isinstance(normalize_over, Sequence):
            raise TypeError("normalize_over must be an integer tensor [P] or a sequence of ints; "
                            f"got {type(normalize_over).__name__}")
        if not all(isinstance(i, Integral) and not isinstance(i, bool) for i in normalize_over):
            raise TypeError(f"normalize_over must hold ints; got {list(normalize_over)!r}")
        normalize_over = torch.tensor([int(i) for i in normalize_over], dtype=torch.int64)
    if normalize_over.dim() != 1 or normalize_over.numel() == 0:
        raise ValueError("normalize_over must be a non-empty [P] of step indices; "
                         f"got shape {tuple(normalize_over.shape)}")
    return V.check_step_index(normalize_over, num_steps, normalize_over.numel(), device, name="normalize_over")


def scheme_weights(scheme: str, table: torch.Tensor, idx: torch.Tensor, mode: Mode, eta: float, dtype: torch.dtype):
    """``(log_ratio, loss)`` of ``scheme`` for checked inputs (the float32 table, int64 steps, a Mode),
    computed in ``dtype``: the one place the schemes' weights are written (``step_weights`` in float64;
    ``flowrl.losses.grpo_guard_loss`` in its compute dtype)."""
    _, c, std = mode_coefficients(table, idx, mode, eta, dtype)
    t = table.to(dtype)
    d = t[idx] - t[idx + 1]
    ones = torch.ones_like(std)
    if scheme == "grpo_guard":
        return std, 1 / d
    if scheme == "tempflow_grpo":
        return ones, std
    usable = (std > 0) & (c != 0)  # flash_grpo
    return ones, torch.where(usable, std / torch.where(usable, c.abs(), ones), torch.zeros_like(std))


__all__ = ["step_weights", "StepWeights", "SCHEMES", "scheme_weights"]
