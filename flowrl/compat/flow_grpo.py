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
  log-prob is of the float32 sample, returned in float32 (what Flow-GRPO's pipeline records).
  Together with an ``out_dtype`` other than float32 it raises ``ValueError``: the returned sample
  would be rounded while its log-prob is of the unrounded one, so the recompute from the stored
  sample disagrees (docs/integration.md has the measurement).
- Classifier-free guidance: Flow-GRPO's pipeline rounds the transformer's output to the prompt
  embeddings' dtype and forms the guidance in that dtype (bf16 / fp16 under mixed precision), while
  its trainer's ``compute_log_prob`` forms it in float32, so the two velocities differ and no step
  function gives ratio 1. ``guidance(noise_pred_uncond, noise_pred_text, guidance_scale,
  dtype=embeds.dtype)`` below, called in both places, gives both the same bits.
- A deterministic step (``noise_level=0``; ``"cps"`` at the last step) has log-prob 0. Flow-GRPO
  gives NaN for ``"sde"`` at ``noise_level=0`` (0 / 0), and ``-mean((x' - mu)^2)`` of the stored
  sample's rounding at the last ``"cps"`` step.
- The timestep is found with flowrl's bf16-safe lookup (``flowrl.rollout.timestep_lookup``), so a bf16
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
Flow-GRPO's newer step functions (yifan123/flow_grpo at 54809b5f) are here too, with the same
``out_dtype`` / ``peer_compatible`` rule: ``ode_step_with_logprob`` (sd3_sde_with_logprob.py; flowrl's
``ode`` step scored by ``-mean((x' - mu)^2)`` against the Euler step of ``mean_model_output``) and, from
``flow_grpo/diffusers_patch/solver.py`` (called by its ``run_sampling``), ``flow_grpo_step`` (``sde``),
``dance_grpo_step`` (``dance``, its log-prob the ``"kernel"`` kind) and ``ddim_step`` (sigma-space DDIM:
``cps`` at a per-step noise level, ``ddim_noise_level``). Their docstrings say what differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Optional, Union

import torch

from ..ops.functional import sde_step, step_log_prob
from ..core import _validate as V
from . import _common as compat_common

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
    sigmas, timesteps = compat_common.scheduler_tables(self, "self")
    compat_common.check_tensor("sample", sample)
    compat_common.check_tensor("model_output", model_output, sample, "sample")
    if prev_sample is not None:
        compat_common.check_tensor("prev_sample", prev_sample, sample, "sample")
    if not isinstance(sde_type, str) or sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {', '.join(map(repr, SDE_TYPES))}; got {sde_type!r}")
    mode, kind = SDE_TYPES[sde_type]
    eta = compat_common.check_noise_level("noise_level", noise_level, at_most_one=mode == "cps")
    V.check_bool("return_sqrt_dt", return_sqrt_dt)
    V.check_bool("peer_compatible", peer_compatible)
    out_dtype = compat_common.check_out_dtype(out_dtype)
    if peer_compatible and out_dtype not in (None, torch.float32):
        raise ValueError(
            f"peer_compatible=True with out_dtype={out_dtype} would return the sample rounded to {out_dtype} with the "
            "log-prob of the unrounded float32 sample, which the recompute from the stored sample does not reproduce; "
            "drop peer_compatible (the log-prob of the rounded sample: ratio exactly 1) or drop out_dtype (Flow-GRPO's "
            "float32 sample and its log-prob)"
        )
    batch = sample.shape[0]
    idx, given = compat_common.resolve_timesteps("timestep", timestep, timesteps, batch, sample.device)
    table = compat_common.on_device(sigmas, sample.device)

    if prev_sample is None:
        noise = compat_common.draw(sample, generator)
        if out_dtype is None:
            out_dtype = torch.float32 if peer_compatible else model_output.dtype
        prev, log_prob, mean, _ = compat_common.emit(sample, model_output, table, idx, mode=mode, eta=eta, noise=noise,
                                         kind=kind, out_dtype=out_dtype, peer_compatible=peer_compatible,
                                         backend=backend)
    else:
        log_prob = step_log_prob(sample, model_output, prev_sample, table, idx, mode=mode, noise_level=eta,
                                 log_prob_kind=kind, backend=backend)
        mean = compat_common.step_mean(sample, model_output, table, idx, mode, eta, backend)
        prev = prev_sample.float()  # Flow-GRPO returns the upcast prev_sample

    rows = idx[:given]
    sigma, sigma_next = table.float()[rows], table.float()[rows + 1]
    if mode == "sde":
        std_dev_t = compat_common.sde_per_unit_time_std(table, rows, eta)
    else:
        std_dev_t = compat_common.cps_std(sigma_next, eta)
    std_dev_t = compat_common.column(std_dev_t, sample.dim())
    if return_sqrt_dt:
        return prev, log_prob, mean, std_dev_t, compat_common.column(torch.sqrt(sigma - sigma_next), sample.dim())
    return prev, log_prob, mean, std_dev_t


def guidance(
    noise_pred_uncond: torch.Tensor,
    noise_pred_text: torch.Tensor,
    guidance_scale: float,
    *,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Classifier-free guidance ``uncond + guidance_scale * (text - uncond)``, float32, computed the same
    way wherever it is called, so Flow-GRPO's pipeline and its trainer's ``compute_log_prob`` get the
    same velocity bits (ratio exactly 1 with CFG under bf16 / fp16 mixed precision).

    ``dtype``: the dtype the pipeline rounds the transformer's output to (``prompt_embeds.dtype``;
    pass ``embeds.dtype`` in the trainer): both predictions are rounded to it first (a no-op where the
    transformer already returns values of that dtype), then combined in float32. Differentiable in
    both predictions (the trainer may pass ``noise_pred_uncond.detach()``). Replaces, in the pipeline,
    ``noise_pred_uncond + self.guidance_scale * (noise_pred_text - noise_pred_uncond)`` (formed in
    bf16 there) and, in ``compute_log_prob``, the same expression (formed in float32 there).
    """
    for name, t in (("noise_pred_uncond", noise_pred_uncond), ("noise_pred_text", noise_pred_text)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.Tensor; got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if noise_pred_text.shape != noise_pred_uncond.shape or noise_pred_text.device != noise_pred_uncond.device:
        raise ValueError(f"noise_pred_text must have noise_pred_uncond's shape and device; got "
                         f"{tuple(noise_pred_text.shape)} on {noise_pred_text.device} and "
                         f"{tuple(noise_pred_uncond.shape)} on {noise_pred_uncond.device}")
    if isinstance(guidance_scale, torch.Tensor) and guidance_scale.numel() == 1 and not guidance_scale.dtype.is_complex \
            and guidance_scale.dtype != torch.bool:
        guidance_scale = float(guidance_scale)
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, Real):
        raise TypeError(f"guidance_scale must be a real number; got {guidance_scale!r}")
    if not math.isfinite(float(guidance_scale)):
        raise ValueError(f"guidance_scale must be finite; got {guidance_scale!r}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be None or a float torch.dtype (prompt_embeds.dtype); got {dtype!r}")
        noise_pred_uncond, noise_pred_text = noise_pred_uncond.to(dtype), noise_pred_text.to(dtype)
    uncond, text = noise_pred_uncond.to(torch.float32), noise_pred_text.to(torch.float32)
    return uncond + float(guidance_scale) * (text - uncond)


# ----------------------------------------------------------------------------------------------
# Flow-GRPO's newer step functions (yifan123/flow_grpo at 54809b5f):
#   flow_grpo/diffusers_patch/sd3_sde_with_logprob.py  ode_step_with_logprob
#   flow_grpo/diffusers_patch/solver.py                flow_grpo_step, dance_grpo_step, ddim_step
#                                                      (called by run_sampling, which the SD3
#                                                      pipeline_with_logprob uses)
# docs/integration.md ("Flow-GRPO's solver functions") has the swap and what differs.


def ode_step_with_logprob(
    self,
    model_output: torch.Tensor,
    mean_model_output: torch.Tensor,
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
    """Flow-GRPO's ``ode_step_with_logprob``: an Euler (flowrl ``ode`` mode) step with ``model_output``
    (``prev_sample=None``) or the given ``prev_sample``, scored against the Euler step of
    ``mean_model_output``: ``log_prob = -mean((x' - mu)^2)`` with ``mu = x - D * mean_model_output``
    (Flow-GRPO's constant-free convention; flowrl's own ``ode`` log-prob is 0, a deterministic step,
    so this residual is formed here from flowrl's ``ode`` sample and mean). Returns ``(prev_sample,
    log_prob, prev_sample_mean, std_dev_t[, sqrt_dt])`` as Flow-GRPO: ``std_dev_t`` is the ``"sde"``
    per-unit-time ``noise_level * sqrt(sigma / (1 - sigma))`` whatever ``sde_type`` (which Flow-GRPO
    accepts and does not read; here it must still be ``"sde"`` or ``"cps"``); ``generator`` is accepted
    and unused (no noise), as in Flow-GRPO.

    ``out_dtype`` (default ``model_output.dtype``) and ``peer_compatible`` as in
    ``sde_step_with_logprob``: by default the sample is rounded to ``out_dtype`` and the residual is
    of that rounded sample (the recompute from the stored sample gives the same bits);
    ``peer_compatible=True`` scores the float32 sample and returns it in float32 (Flow-GRPO)."""
    sigmas, timesteps = compat_common.scheduler_tables(self, "self")
    compat_common.check_tensor("sample", sample)
    compat_common.check_tensor("model_output", model_output, sample, "sample")
    compat_common.check_tensor("mean_model_output", mean_model_output, sample, "sample")
    if prev_sample is not None:
        compat_common.check_tensor("prev_sample", prev_sample, sample, "sample")
    if not isinstance(sde_type, str) or sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {', '.join(map(repr, SDE_TYPES))}; got {sde_type!r}")
    eta = compat_common.check_noise_level("noise_level", noise_level)
    V.check_bool("return_sqrt_dt", return_sqrt_dt)
    V.check_bool("peer_compatible", peer_compatible)
    out_dtype = _check_peer_out_dtype(compat_common.check_out_dtype(out_dtype), peer_compatible)
    batch = sample.shape[0]
    idx, given = compat_common.resolve_timesteps("timestep", timestep, timesteps, batch, sample.device)
    table = compat_common.on_device(sigmas, sample.device)

    mean = compat_common.step_mean(sample, mean_model_output, table, idx, "ode", 0.0, backend)
    if prev_sample is None:
        if out_dtype is None:
            out_dtype = torch.float32 if peer_compatible else model_output.dtype
        prev = sde_step(sample, model_output, table, idx, mode="ode", noise_level=0.0, noise=None, log_prob_kind="kernel",
                        out_dtype=out_dtype, return_prev_sample_mean=False, backend=backend).prev_sample
        scored = prev.float()
    else:
        prev = scored = prev_sample.float()  # Flow-GRPO returns the upcast prev_sample
    r = scored.detach() - mean
    log_prob = -(r * r).mean(dim=tuple(range(1, r.dim())))

    rows = idx[:given]
    std_dev_t = compat_common.column(compat_common.sde_per_unit_time_std(table, rows, eta), sample.dim())
    if return_sqrt_dt:
        sigma, sigma_next = table.float()[rows], table.float()[rows + 1]
        return prev, log_prob, mean, std_dev_t, compat_common.column(torch.sqrt(sigma - sigma_next), sample.dim())
    return prev, log_prob, mean, std_dev_t


def flow_grpo_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: Union[int, torch.Tensor],
    prev_sample: Optional[torch.Tensor],
    generator=None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    peer_compatible: bool = False,
    backend: str = "auto",
):
    """Flow-GRPO's ``solver.flow_grpo_step``: flowrl's ``sde`` mode (Flow-SDE), Gaussian log-prob
    averaged over elements. Returns ``(prev_sample, pred_original_sample, log_prob)``;
    ``pred_original_sample = latents - sigma * model_output``. ``prev_sample=None`` samples the step
    (noise: float32 from ``generator`` as diffusers' ``randn_tensor``); a given ``prev_sample`` is
    returned as given with its log-prob (differentiable in ``model_output``).

    Extras: ``out_dtype`` (the sampled ``prev_sample``'s dtype; default ``model_output.dtype``: float32
    in ``run_sampling``, which then casts it to the latents' dtype; pass ``out_dtype=dtype`` there),
    ``peer_compatible`` (the log-prob of the float32 sample, as Flow-GRPO), ``backend``; ``index`` may
    also be an integer tensor [B]. ``eta=0``: log-prob 0 (Flow-GRPO: NaN)."""
    table, idx, eta, x0, _ = _solver_args(model_output, latents, eta, sigmas, index, prev_sample, peer_compatible)
    step = _SolverMode(mode="sde", noise_level=eta, kind="gaussian")
    return _solver_step(model_output, latents, table, idx, x0, prev_sample, step, generator, out_dtype,
                        peer_compatible, backend)


def dance_grpo_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: Union[int, torch.Tensor],
    prev_sample: Optional[torch.Tensor],
    *,
    generator=None,
    out_dtype: Optional[torch.dtype] = None,
    peer_compatible: bool = False,
    backend: str = "auto",
):
    """Flow-GRPO's ``solver.dance_grpo_step``: flowrl's ``dance`` mode (DanceGRPO's score-corrected
    mean, std ``eta * sqrt(sigma - sigma')``). Returns ``(prev_sample, pred_original_sample,
    log_prob)``. The log-prob is flowrl's ``"kernel"`` kind, ``-mean((x' - mu)^2 / (2 std^2))``:
    Flow-GRPO's line ends after that term and its ``- log(std) - log(sqrt(2 pi))`` stands alone as a
    separate, discarded expression, so its value is the kernel (same ratios as the Gaussian).

    Extras: ``generator`` (None: the global RNG, as Flow-GRPO's ``torch.randn_like``), ``out_dtype``,
    ``peer_compatible``, ``backend`` as in ``flow_grpo_step``. ``eta=0``: log-prob 0 (Flow-GRPO:
    NaN)."""
    table, idx, eta, x0, _ = _solver_args(model_output, latents, eta, sigmas, index, prev_sample, peer_compatible)
    step = _SolverMode(mode="dance", noise_level=eta, kind="kernel")
    return _solver_step(model_output, latents, table, idx, x0, prev_sample, step, generator, out_dtype,
                        peer_compatible, backend)


def ddim_step(
    model_output: torch.Tensor,
    latents: torch.Tensor,
    eta: float,
    sigmas: torch.Tensor,
    index: int,
    prev_sample: Optional[torch.Tensor],
    *,
    generator=None,
    out_dtype: Optional[torch.dtype] = None,
    peer_compatible: bool = False,
    backend: str = "auto",
):
    """Flow-GRPO's ``solver.ddim_step``: DDIM-eta in sigma space (``ddim_update``): with ``s = sigma``,
    ``t = sigma'``, std ``rho = eta * t * sqrt(1 - q^2)``, ``q = t (1 - s) / (s (1 - t))``, mean ``(1 - t)
    x0_hat + sqrt(t^2 - rho^2) x1_hat``. That is flowrl's ``cps`` mode (same mean form, std ``t *
    sin(eta_c pi / 2)``) at the step's noise level ``eta_c = (2 / pi) asin(eta sqrt(1 - q^2))``, computed
    here in float64 from the float32 table. (It is not flowrl's ``ddim`` mode, which is DDIM on an
    alpha-bar table.) Gaussian log-prob averaged over elements. Returns ``(prev_sample,
    pred_original_sample, log_prob)``.

    ``index`` is one step for the batch (an int, or an integer tensor of one element), as Flow-GRPO's:
    the noise level depends on the step. ``eta * sqrt(1 - q^2) > 1`` (where Flow-GRPO's mean is NaN)
    raises ``ValueError`` naming ``eta``. Flow-GRPO's ``ddim_step`` discards a given ``prev_sample``
    (``ddim_update`` draws a new sample and the result overwrites it), so its log-prob is of a fresh
    sample; here a given ``prev_sample`` is returned and scored (the recompute), and with
    ``peer_compatible=True`` it raises ``ValueError`` naming ``prev_sample``. Deterministic steps
    (``eta=0``, the last step ``t = 0``): log-prob 0 (Flow-GRPO: NaN). Extras as in
    ``dance_grpo_step``."""
    table, idx, eta, x0, _ = _solver_args(model_output, latents, eta, sigmas, index, prev_sample, peer_compatible,
                                          one_step=True)
    if peer_compatible and prev_sample is not None:
        raise ValueError(
            "peer_compatible=True with a prev_sample: Flow-GRPO's ddim_step discards the given prev_sample and "
            "returns the log-prob of a newly drawn sample, which cannot serve a recompute; drop peer_compatible to "
            "score the given prev_sample"
        )
    eta_c = ddim_noise_level(table, int(idx[0]), eta)
    step = _SolverMode(mode="cps", noise_level=eta_c, kind="gaussian")
    return _solver_step(model_output, latents, table, idx, x0, prev_sample, step, generator, out_dtype,
                        peer_compatible, backend)


@dataclass(frozen=True)
class _SolverMode:
    """The flowrl step a solver function is: ``mode`` at ``noise_level`` (the peer's ``eta``, or
    ``ddim_step``'s ``ddim_noise_level``), its log-prob of ``kind``."""

    mode: str
    noise_level: float
    kind: str


def _solver_step(model_output, latents, table, idx, x0, prev_sample, step: _SolverMode, generator, out_dtype,
                 peer_compatible, backend):
    """The solver functions' common body: sample the step (``prev_sample=None``) or score the given one,
    as flowrl's ``step`` (mode, noise level, log-prob kind); ``(prev_sample, x0, log_prob)``."""
    out_dtype = _check_peer_out_dtype(compat_common.check_out_dtype(out_dtype), peer_compatible)
    if prev_sample is None:
        noise = compat_common.draw(latents, generator)
        if out_dtype is None:
            out_dtype = torch.float32 if peer_compatible else model_output.dtype
        prev, log_prob, _, _ = compat_common.emit(latents, model_output, table, idx, mode=step.mode,
                                                  eta=step.noise_level, noise=noise, kind=step.kind,
                                                  out_dtype=out_dtype, peer_compatible=peer_compatible,
                                                  backend=backend)
        return prev, x0, log_prob
    log_prob = step_log_prob(latents, model_output, prev_sample, table, idx, mode=step.mode,
                             noise_level=step.noise_level, log_prob_kind=step.kind, backend=backend)
    return prev_sample, x0, log_prob


def ddim_noise_level(sigmas: torch.Tensor, index: int, eta: float) -> float:
    """The ``cps`` noise level of Flow-GRPO's sigma-space DDIM step ``index`` at ``eta``:
    ``(2 / pi) asin(eta sqrt(1 - q^2))``, ``q = t (1 - s) / (s (1 - t))``, in float64 from the table's
    values (``ValueError`` naming ``eta`` where the argument exceeds 1 before the last step)."""
    s, t = float(sigmas[index]), float(sigmas[index + 1])
    if t == 0.0:
        return 0.0  # the last step: std 0 at any eta (cps with sigma' = 0)
    q = t * (1.0 - s) / (s * (1.0 - t))
    y = eta * math.sqrt(max(1.0 - q * q, 0.0))
    if y > 1.0:
        raise ValueError(
            f"eta={eta} makes Flow-GRPO's ddim_step std exceed sigma' at step {index} (eta * sqrt(1 - q^2) = {y:.6g} "
            "> 1; its mean is NaN there); use eta <= 1"
        )
    return 2.0 / math.pi * math.asin(y)


def _check_peer_out_dtype(out_dtype, peer_compatible):
    if peer_compatible and out_dtype not in (None, torch.float32):
        raise ValueError(
            f"peer_compatible=True with out_dtype={out_dtype} would return the sample rounded to {out_dtype} with the "
            "log-prob of the unrounded float32 sample, which the recompute from the stored sample does not reproduce; "
            "drop peer_compatible (the log-prob of the rounded sample: ratio exactly 1) or drop out_dtype (Flow-GRPO's "
            "float32 sample and its log-prob)"
        )
    return out_dtype


def _solver_args(model_output, latents, eta, sigmas, index, prev_sample, peer_compatible, one_step=False):
    """The solver functions' checks under their argument names: ``(table on latents' device, int64
    [B] index, eta, pred_original_sample in the peer's dtype, the peer's dtype)``."""
    compat_common.check_tensor("latents", latents)
    compat_common.check_tensor("model_output", model_output, latents, "latents")
    if prev_sample is not None:
        compat_common.check_tensor("prev_sample", prev_sample, latents, "latents")
    eta = compat_common.check_noise_level("eta", eta)
    V.check_bool("peer_compatible", peer_compatible)
    if not isinstance(sigmas, torch.Tensor):
        raise TypeError(f"sigmas must be a 1-D torch.Tensor schedule; got {type(sigmas).__name__}")
    if sigmas.dtype not in (torch.float32, torch.float64) or sigmas.dim() != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D float32 schedule of length T + 1 >= 2; got {sigmas.dtype} "
                         f"{tuple(sigmas.shape)}")
    V.check_sigmas(sigmas, sigmas.device)
    table = compat_common.on_device(sigmas, latents.device)
    if one_step and isinstance(index, torch.Tensor) and index.numel() != 1:
        raise ValueError(f"index must be one step for the batch (an int) in ddim_step: its noise level depends on "
                         f"the step; got a tensor of shape {tuple(index.shape)}")
    idx = compat_common.check_index("index", index, table.numel() - 1, latents.shape[0], latents.device)
    peer_dtype = compat_common.promote(latents.dtype, model_output.dtype)
    sigma = compat_common.column(table.to(torch.float32)[idx], latents.dim())
    x0 = (latents.to(torch.float32) - sigma * model_output.to(torch.float32)).to(peer_dtype)
    return table, idx, eta, x0, peer_dtype


__all__ = ["sde_step_with_logprob", "guidance", "SDE_TYPES", "ode_step_with_logprob", "flow_grpo_step",
           "dance_grpo_step", "ddim_step", "ddim_noise_level"]
