"""The public functional API: ``sde_step``, ``step_log_prob``, ``step_kl``.

Each op declares its arguments once, here, builds one validated, immutable ``StepSpec`` from them
(``flowrl.step_spec``), picks a backend from the table in ``flowrl._dispatch``, and calls that
backend's op with the spec and the tensors. ``flowrl.distributed`` wraps these ops (adding ``group``).
The math lives in the backends (``flowrl.reference`` and the Triton kernels), never here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from . import _dispatch
from . import _validate as V
from .contract import LogProbKind, Mode, NoiseSource, Op, Reduction
from .step_spec import (
    GeneratorArg, ShardContext, StepSpec, ddim_options, draw_noise, elements_per_sample, log_prob_kind,
    schedule_and_steps,
)


@dataclass
class SDEStepOutput:
    """Result of one stochastic step.

    prev_sample: the emitted sample x', in ``out_dtype``.
    log_prob: float32 [B], log-prob of the emitted (rounded) sample.
    prev_sample_mean: float32 mean mu of x' given x (None when not requested).
    std_dev: float32 [B], the transition's std per sample.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: Optional[torch.Tensor]
    std_dev: torch.Tensor

    def __iter__(self):
        return iter((self.prev_sample, self.log_prob, self.prev_sample_mean, self.std_dev))


def second_order(prev_x0_pred, mode: Mode, sample: torch.Tensor) -> dict:
    """The backend ops' keyword for a second-order dpm_sde step: ``{"prev_x0_pred": x0_prev}``, or
    ``{}`` (first order). ``prev_x0_pred`` is the previous step's data prediction ``x_{i-1} -
    sigma_{i-1} v_{i-1}`` (what diffusers' DPM solvers and MixGRPO keep as ``model_outputs``), x's
    shape; only mode='dpm_sde' reads one (docs/contract.md, dpm_sde)."""
    if prev_x0_pred is None:
        return {}
    if mode is not Mode.DPM_SDE:
        raise ValueError(f"prev_x0_pred is mode='dpm_sde''s (its second order); got mode={mode.label!r}")
    return {"prev_x0_pred": V.check_batch_tensor("prev_x0_pred", prev_x0_pred, sample)}


def sde_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    noise: Optional[torch.Tensor] = None,
    generator: GeneratorArg = None,
    log_prob: str = "gaussian",
    reduction: str = "mean",
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    return_prev_sample_mean: bool = True,
    noise_seed: Union[None, int, torch.Tensor] = None,
    shard: Optional[ShardContext] = None,
    prediction_type: Optional[str] = None,
    clip_sample_range: Optional[float] = None,
    prev_x0_pred: Optional[torch.Tensor] = None,
) -> SDEStepOutput:
    """Sample x' ~ N(mu, std^2) for one step of ``mode`` and return it with its log-prob.

    ``sigmas`` is the float32 schedule (length T + 1); ``step_index`` an int or an integer tensor
    [B]. ``noise`` (x's shape) is used as eps when given, else eps is drawn from ``generator``.
    ``noise_seed`` (instead of ``noise`` / ``generator``) draws eps from Philox4x32-10 inside the
    kernel, keyed by (seed, sample, element index): an int in [0, 2**63) (sample b on stream b) or an
    integer tensor [B] of per-sample seeds (a sample's noise then depends on its seed only); see
    docs/kernels.md. The log-prob is of ``prev_sample`` as emitted in ``out_dtype`` (default:
    model_output's dtype). ``shard``: the sequence-parallel context (``flowrl.distributed`` passes
    it; None on one device). ``prediction_type`` ("epsilon", "sample", "v_prediction") and
    ``clip_sample_range`` (None: no clipping) are mode='ddim''s, whose ``sigmas`` is the alpha-bar
    table [2T] of (alpha_bar_t, alpha_bar_prev) pairs (docs/contract.md, ddim). ``prev_x0_pred``
    (mode='dpm_sde' only): the previous step's data prediction ``x_{i-1} - sigma_{i-1} v_{i-1}``, x's
    shape, which makes the step second order (docs/contract.md, dpm_sde); differentiable.
    """
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    kind, reduction = log_prob_kind(log_prob), Reduction.parse("reduction", reduction)
    prev = second_order(prev_x0_pred, mode, sample)
    out_dtype = V.check_out_dtype(out_dtype, model_output.dtype)
    seed = None
    if noise_seed is not None:  # noise, generator and noise_seed are exclusive
        if noise is not None or generator is not None:
            raise ValueError("pass noise_seed alone: it replaces noise and generator (got noise_seed with "
                             f"{'noise' if noise is not None else 'generator'})")
        seed = V.check_noise_seed(noise_seed, sample)._replace(elem_offset=0 if shard is None else shard.offset)
        source = NoiseSource.PHILOX
    elif noise is not None:
        if generator is not None:
            raise ValueError("pass either noise or generator, not both")
        V.check_batch_tensor("noise", noise, sample)
        source = NoiseSource.TENSOR
    else:
        generator = V.check_generator(generator, sample.shape[0])
        # a step deterministic by its arguments draws no noise and advances no generator
        source = NoiseSource.NONE if mode is Mode.ODE or eta == 0 else NoiseSource.TENSOR
    spec = StepSpec(Op.ROLLOUT, sigmas, idx, mode, eta, kind, reduction, elements_per_sample(sample, shard),
                    out_dtype=out_dtype, noise_source=source, noise_seed=seed,
                    return_mean=bool(return_prev_sample_mean), shard=shard, **extra)
    # the backend is chosen (and a bad one refused) before any noise is drawn: a drawn noise is float32,
    # so only a given noise tensor enters the choice
    given = (sample, model_output) if noise is None else (sample, model_output, noise)
    ops = _dispatch.select(backend, *given, *prev.values())
    if ops.name == "triton" and spec.out_dtype == torch.float64:
        raise TypeError("out_dtype=float64 runs on backend='torch' only")
    if noise is None and source is NoiseSource.TENSOR:
        noise = (draw_noise if shard is None else shard.draw_noise)(sample.shape, generator, sample.device)
    return SDEStepOutput(*ops.sde_step(spec, sample, model_output, noise, **prev))


def step_log_prob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob: str = "gaussian",
    reduction: str = "mean",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    prediction_type: Optional[str] = None,
    clip_sample_range: Optional[float] = None,
    prev_x0_pred: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Log-prob [B] of the stored ``prev_sample`` under the current ``model_output``; differentiable
    with respect to ``model_output``, ``sample`` and ``prev_sample``. On the same backend and inputs it
    reproduces ``sde_step``'s log-prob bit for bit; a second-order dpm_sde step needs the rollout's
    ``prev_x0_pred`` (``RolloutTrajectory.prev_x0_preds[:, i]``), also differentiable."""
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    V.check_batch_tensor("prev_sample", prev_sample, sample)
    spec = StepSpec(Op.LOG_PROB, sigmas, idx, mode, eta, log_prob_kind(log_prob), Reduction.parse("reduction", reduction),
                    elements_per_sample(sample, shard), shard=shard, **extra)
    prev = second_order(prev_x0_pred, mode, sample)
    return _dispatch.select(backend, sample, model_output, prev_sample, *prev.values()).step_log_prob(
        spec, sample, model_output, prev_sample, **prev)


def step_kl(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    reduction: str = "mean",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    prediction_type: Optional[str] = None,
    clip_sample_range: Optional[float] = None,
    prev_x0_pred: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact KL [B] between this step's transitions under ``model_output`` and ``ref_model_output``
    (same std): ``(mu - mu_ref)^2 / (2 std^2)`` reduced like the log-prob; 0 on deterministic steps."""
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    V.check_batch_tensor("ref_model_output", ref_model_output, sample)
    spec = StepSpec(Op.KL, sigmas, idx, mode, eta, LogProbKind.KL, Reduction.parse("reduction", reduction),
                    elements_per_sample(sample, shard), shard=shard, **extra)
    prev = second_order(prev_x0_pred, mode, sample)
    return _dispatch.select(backend, sample, model_output, ref_model_output, *prev.values()).step_kl(
        spec, sample, model_output, ref_model_output, **prev)


__all__: List[str] = ["SDEStepOutput", "sde_step", "step_log_prob", "step_kl", "draw_noise", "ShardContext"]
