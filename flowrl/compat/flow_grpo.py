"""Flow-GRPO's ``sde_step_with_logprob`` on flowrl's ops.

    # before: from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob
    from flowrl.compat.flow_grpo import sde_step_with_logprob

Same signature, defaults and returns as Flow-GRPO's function (yifan123/flow_grpo,
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, the version with ``sde_type`` and
``return_sqrt_dt``): ``(prev_sample, log_prob, prev_sample_mean, std_dev_t[, sqrt_dt])``, where
``std_dev_t`` is Flow-GRPO's: for ``sde_type="sde"`` the per-unit-time ``s = noise_level * sqrt(sigma /
(1 - sigma))`` (the step's std is ``s * sqrt_dt``), for ``"cps"`` the step's std ``sigma' * sin(noise_level
* pi / 2)``; both shaped ``[n, 1, ..., 1]`` with ``n`` the number of timesteps given (1 or B).
``log_prob`` is the mean over elements of the Gaussian log-density (``"sde"``) or of ``-(x' - mu)^2``
(``"cps"``, Flow-GRPO's constant-free convention).

What differs from Flow-GRPO (docs/integration.md has the measurements):

- ``prev_sample`` is returned in ``out_dtype`` (default: ``model_output``'s dtype, as diffusers'
  step) and ``log_prob`` is the log-prob of that returned, rounded sample. Flow-GRPO upcasts and
  returns a float32 sample with the log-prob of that float32 value; its pipeline then stores the
  float32 value but feeds the bf16-cast one to the next step, so training recomputes from latents
  the rollout never used (first-update ratio != 1). Pass ``out_dtype=latents.dtype`` in that
  pipeline's call and the stored latent is the one the next step consumes: ratio exactly 1.
- ``peer_compatible=True`` reproduces Flow-GRPO's values: the step is taken in float32 and the
  log-prob is of the float32 sample before any rounding (the sample is returned in float32, or
  rounded to ``out_dtype`` when given: exactly what Flow-GRPO's pipeline records).
- A deterministic step (``noise_level=0``; ``"cps"`` at the last step) has log-prob 0. Flow-GRPO
  gives NaN for ``"sde"`` at ``noise_level=0`` (0 / 0), and ``-mean((x' - mu)^2)`` of the stored
  sample's rounding at the last ``"cps"`` step.
- The timestep is found with flowrl's bf16-safe lookup (``flowrl.timestep_lookup``), so a bf16
  timestep works where diffusers' ``index_for_timestep`` raises; a value matching no entry raises
  ``ValueError`` naming ``timestep``. sigma and sigma' are read from the float32 table.
- ``sigma == 1`` is tested with the contract's tolerance (1e-5), not exact equality.
- The KL: Flow-GRPO's trainer computes ``((mu - mu_ref)^2).mean() / (2 std_dev_t^2)``, which for
  ``"sde"`` is the exact Gaussian KL times the step's ``D = sigma - sigma'``. ``flowrl.step_kl`` is the
  exact KL (docs/contract.md).

Works with ``self`` = diffusers' ``FlowMatchEulerDiscreteScheduler`` or flowrl's (any object with
float32 ``sigmas`` [T + 1] and ``timesteps`` [T]). ``timestep`` holds one value for the batch or one
per sample. Noise: ``generator`` as in diffusers' ``randn_tensor`` (one generator, a list of B, or
None for the global RNG), drawn in float32 whenever ``prev_sample`` is None, as Flow-GRPO does (so
the generators advance as in Flow-GRPO, also at ``noise_level=0``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..ops.functional import step_log_prob
from ..core import _validate as V
from . import _common as C

SDE_TYPES = {"sde": ("sde", "gaussian"), "cps": ("cps", "sq_err")}


def sde_step_with_logprob(
    self,
    model_output: torch.Tensor,
    timestep: Union[float, torch.Tensor],
    sample: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: Optional[torch.Tensor] = None,
    generator=None,
    sde_type: Optional[str] = "sde",
    return_sqrt_dt: Optional[bool] = False,
    *,
    out_dtype: Optional[torch.dtype] = None,
    peer_compatible: bool = False,
    backend: str = "auto",
):
    """One Flow-GRPO SDE/CPS step (``prev_sample=None``: sample it) or the log-prob of a stored
    ``prev_sample`` (training; differentiable in ``model_output``). See the module docstring.

    Extra keyword-only arguments: ``out_dtype`` (the returned sample's dtype on a rollout; default
    ``model_output.dtype``, float32 with ``peer_compatible``), ``peer_compatible`` (the log-prob of
    the float32 sample before rounding, as Flow-GRPO), ``backend`` (flowrl's ``"auto"``, ``"torch"``,
    ``"triton"``)."""
    sigmas, timesteps = C.scheduler_tables(self, "self")
    C.check_tensor("sample", sample)
    C.check_tensor("model_output", model_output, sample, "sample")
    if prev_sample is not None:
        C.check_tensor("prev_sample", prev_sample, sample, "sample")
    if not isinstance(sde_type, str) or sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {', '.join(map(repr, SDE_TYPES))}; got {sde_type!r}")
    mode, kind = SDE_TYPES[sde_type]
    eta = C.check_noise_level("noise_level", noise_level, at_most_one=mode == "cps")
    V.check_bool("return_sqrt_dt", return_sqrt_dt)
    V.check_bool("peer_compatible", peer_compatible)
    out_dtype = C.check_out_dtype(out_dtype)
    batch = sample.shape[0]
    idx, given = C.resolve_timesteps("timestep", timestep, timesteps, batch, sample.device)
    table = C.on_device(sigmas, sample.device)

    if prev_sample is None:
        noise = C.draw(sample, generator)
        if out_dtype is None:
            out_dtype = torch.float32 if peer_compatible else model_output.dtype
        prev, log_prob, mean, _ = C.emit(sample, model_output, table, idx, mode=mode, eta=eta, noise=noise,
                                         kind=kind, out_dtype=out_dtype, peer_compatible=peer_compatible,
                                         backend=backend)
    else:
        log_prob = step_log_prob(sample, model_output, prev_sample, table, idx, mode=mode, noise_level=eta,
                                 log_prob=kind, backend=backend)
        mean = C.step_mean(sample, model_output, table, idx, mode, eta, backend)
        prev = prev_sample.float()  # Flow-GRPO returns the upcast prev_sample

    rows = idx[:given]
    sigma, sigma_next = table.float()[rows], table.float()[rows + 1]
    if mode == "sde":
        std_dev_t = C.sde_per_unit_time_std(table, rows, eta)
    else:
        std_dev_t = C.cps_std(sigma_next, eta)
    std_dev_t = C.column(std_dev_t, sample.dim())
    if return_sqrt_dt:
        return prev, log_prob, mean, std_dev_t, C.column(torch.sqrt(sigma - sigma_next), sample.dim())
    return prev, log_prob, mean, std_dev_t


__all__ = ["sde_step_with_logprob", "SDE_TYPES"]
