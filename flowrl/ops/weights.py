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
"""
from __future__ import annotations

from typing import NamedTuple, Union

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
) -> StepWeights:
    """The ``scheme``'s per-step weights (module docstring) for steps ``step_index`` (an int or an
    integer tensor [B]) of the float32 schedule ``sigmas`` under ``mode`` / ``noise_level``."""
    V.check_choice("scheme", scheme, SCHEMES)
    mode = Mode.parse("mode", mode)
    if mode.rules.schedule is not Schedule.SIGMAS:
        raise ValueError(f"step_weights reads a flow schedule (sigmas); mode={mode.label!r} is not one")
    eta = V.check_noise_level(noise_level, mode.label)
    table = V.check_sigmas(sigmas, sigmas.device if isinstance(sigmas, torch.Tensor) else torch.device("cpu"))
    scalar = not isinstance(step_index, torch.Tensor)
    idx = V.check_step_index(step_index, table.numel() - 1, 1 if scalar else step_index.numel(), table.device)
    log_ratio, loss = scheme_weights(scheme, table, idx, mode, eta, torch.float64)
    out = [t.float().reshape(()) if scalar else t.float() for t in (log_ratio, loss)]
    return StepWeights(*out)


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
