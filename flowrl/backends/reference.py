"""The torch reference backend: the math contract (docs/contract.md) written once, in plain torch.

It is the oracle the Triton kernels are tested against, the path taken on CPU, and the only backend
that accepts float64. Every function takes already-validated arguments (see ``flowrl.ops.functional``):
``step_index`` is an int64 tensor [B] on the sample's device, ``noise_level`` a float.

Log-probs are reduced in the contract's fixed order (see ``CHUNK_SIZE``): the flattened sample is cut
into chunks of ``CHUNK_SIZE`` elements, each chunk's sum of squared residuals is one partial
(each leaf of ``LEAF_SIZE`` consecutive elements by a fixed pairwise-halving tree, then the leaf sums
by the same tree), and the partials are combined by the same pairwise tree, zero-padded to a power
of two. Only elementwise adds are used, so the bits do not depend on
the batch size, the position in the batch, threading, or how a sample was sharded (when shard
boundaries fall on chunk boundaries). That tree is ``flowrl.backends.reference_reduce``, the Philox
noise ``flowrl.backends.reference_philox``; this module re-exports both modules' names.

The backend's three ops take a validated ``flowrl.core.step_spec.StepSpec`` and the tensors, like the
Triton backend's (``flowrl.backends._dispatch`` holds the table); under sequence parallelism the spec's
``numel`` is the full sample's and ``spec.gather`` maps the local partials to the full sample's.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from .. import contract
from ..core._validate import NoiseSeed  # noqa: F401 (re-exported)
from ..contract import CHUNK_SIZE, HALF_LOG_2PI, LEAF_SIZE, SIGMA_ONE_TOL, STD_FLOOR  # noqa: F401
from ..contract import LogProbKind, Mode, NoiseSource, Reduction
# Philox noise and the reduction tree live in their own modules; re-exported here (``reference.X``)
from .reference_philox import PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, _MASK32, _mulhilo32  # noqa: F401
from .reference_philox import box_muller, box_muller_radius, fma_f32, philox4x32_10, philox_normal  # noqa: F401
from .reference_philox import philox_quads, sqrt_rn  # noqa: F401
from .reference_reduce import _PairwiseSum, _chunk_partials, _halving_tree_, _pairwise_sum  # noqa: F401
from .reference_reduce import chunk_partials, combine_partials  # noqa: F401


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """float64 when the reference is given float64, float32 otherwise (docs/contract.md, Precision)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


@functools.lru_cache(maxsize=256)
def sin_half_pi(noise_level: float, dtype: torch.dtype) -> float:
    """cps' ``sin(eta * pi / 2)`` rounded as ``dtype`` computes it; it depends on the scalar eta only,
    so it is computed once per (eta, dtype) on the host (cached: no CPU tensor per call), and the
    Triton kernels take the same value."""
    return float(torch.sin(torch.tensor(noise_level, dtype=dtype) * (math.pi / 2)))


def cps_std(sigma_next: torch.Tensor, noise_level: float, dtype: torch.dtype) -> torch.Tensor:
    """cps' step std ``sigma' * sin(eta pi / 2)``, the sine computed once per eta on the host."""
    return sigma_next * sin_half_pi(noise_level, dtype)


def sde_noise_scale(table: torch.Tensor, sigma: torch.Tensor, noise_level: float,
                    sigma_sub: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sde's per-unit-time noise scale ``s = eta * sqrt(sigma / (1 - sigma_t))`` (the step's std is
    ``s * sqrt(D)``; Flow-GRPO returns ``s`` as ``std_dev_t``), in ``table``'s dtype."""
    # sigma == 1 would divide by zero: use the schedule's second value (Flow-GRPO, SGLang)
    at_one = (sigma - 1).abs() <= SIGMA_ONE_TOL
    sigma_t = torch.where(at_one, (table[1] if sigma_sub is None else sigma_sub).expand_as(sigma), sigma)
    return noise_level * torch.sqrt(sigma / (1 - sigma_t))


def flash_noise_scale(table: torch.Tensor, sigma: torch.Tensor, noise_level: float) -> torch.Tensor:
    """flash_sde's per-unit-time noise scale ``s = eta * (sigma_min + (sigma_max - sigma_min) * sigma)``
    with ``sigma_max = sigmas[1]``, ``sigma_min = sigmas[-1]`` (Flash-GRPO's ``std_dev_t``; the
    schedule's last value, 0 for a diffusers schedule, exactly as their code reads it)."""
    sigma_max, sigma_min = table[1], table[-1]
    return noise_level * (sigma_min + (sigma_max - sigma_min) * sigma)


def dpm_sde_first_order(sigma: torch.Tensor, sigma_next: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """SDE-DPM-Solver++'s first-order ``(A, B, q, std)``: ``mu = A x + B x0_hat`` with q = e^{-h} =
    (alpha sigma') / (sigma alpha') computed without logs, A = (sigma' / sigma) q, B = alpha' (1 - q^2),
    std = sigma' sqrt(1 - q^2) (``dpm_sde_coefficients`` adds the second order)."""
    alpha_next = 1 - sigma_next
    q = ((1 - sigma) * sigma_next) / (sigma * alpha_next)
    one_minus_q2 = 1 - q * q
    return sigma_next / sigma * q, alpha_next * one_minus_q2, q, sigma_next * torch.sqrt(one_minus_q2)


def dpm_sde_coefficients(
    sigmas: torch.Tensor, step_index: torch.Tensor, second_order: bool, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDE-DPM-Solver++ (alpha = 1 - sigma; docs/contract.md, dpm_sde): per-sample ``(a, c, p, std)``
    with ``mu = a * x + c * v + p * x0_prev``, ``x0_prev`` the previous step's data prediction.

    ``q = e^{-h} = (alpha * sigma') / (sigma * alpha')`` is computed without logs, so sigma = 1
    (lambda = -inf) and sigma' = 0 (lambda' = +inf) give q = 0 exactly, the limits. Then
    ``mu = (sigma'/sigma) q x + (B + B2) x0_hat - B2 x0_prev``, ``B = alpha' (1 - q^2)``,
    ``std = sigma' sqrt(1 - q^2)``; ``B2 = B h / (2 h_prev)`` (midpoint D1 = (x0_hat - x0_prev) / r,
    r = h_prev / h) when ``second_order``, else 0. The second-order term is 0 (the step is first
    order, as MixGRPO and diffusers' lower_order_final) at step 0, at sigma' = 0, after a step
    from sigma = 1 (h_prev = inf) and where h_prev rounds to 0 (q_prev == 1)."""
    table = sigmas.to(dtype)
    sigma = table[step_index]
    big_a, b, q, std = dpm_sde_first_order(sigma, table[step_index + 1])
    if not second_order:
        return big_a + b, -(b * sigma), torch.zeros_like(sigma), std
    sigma_prev = table[(step_index - 1).clamp(min=0)]
    alpha = 1 - sigma  # 0 only at sigma = 1, i.e. step 0 (first order): 1 there keeps q_prev finite
    q_prev = ((1 - sigma_prev) * sigma) / (sigma_prev * torch.where(alpha > 0, alpha, torch.ones_like(alpha)))
    # first order also where h_prev rounds to 0 (q_prev == 1: adjacent sigmas an ulp apart), whose
    # finite difference D1 = (x0_hat - x0_prev) h / h_prev would be inf
    first_order = (step_index == 0) | (q == 0) | (q_prev == 0) | (q_prev == 1)
    half = torch.full_like(q, 0.5)  # any q in (0, 1) keeps the unused branch finite
    h_ratio = torch.log(torch.where(first_order, half, q)) / torch.log(torch.where(first_order, half, q_prev))
    b2 = torch.where(first_order, torch.zeros_like(b), 0.5 * b * h_ratio)
    bb = b + b2
    return big_a + bb, -(bb * sigma), -b2, std


def coefficients_of(
    table: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, mode: Mode, noise_level: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, c, std)`` with ``mu = a * x + c * v`` for steps sigma -> sigma_next (tensors of any one
    shape, in ``table``'s dtype; ``table`` is the schedule, for sde's sigma == 1 rule).

    This is the only place the torch backend writes the modes' math (docs/contract.md, Modes)."""
    d = sigma - sigma_next  # D > 0; diffusers' dt is -D
    # eta stays a Python scalar (the ops cast it to ``dtype``): no host-to-device copy, capturable
    if mode is Mode.ODE:
        return torch.ones_like(sigma), -d, torch.zeros_like(sigma)
    if mode in (Mode.SDE, Mode.DANCE, Mode.FLASH_SDE):
        if mode is Mode.SDE:
            s = sde_noise_scale(table, sigma, noise_level)
        elif mode is Mode.FLASH_SDE:
            s = flash_noise_scale(table, sigma, noise_level)
        else:
            s = torch.full_like(sigma, noise_level)
        s2 = s * s
        a = 1 - s2 * d / (2 * sigma)
        c = -(1 + s2 * (1 - sigma) / (2 * sigma)) * d
        return a, c, s * torch.sqrt(d)
    if mode is Mode.CPS:
        std = cps_std(sigma_next, noise_level, table.dtype)
        # clamp: at eta = 1, sigma'^2 - std^2 is 0 up to rounding and may come out a hair negative
        k = torch.sqrt(torch.clamp(sigma_next * sigma_next - std * std, min=0))
        a = (1 - sigma_next) + k
        c = k * (1 - sigma) - (1 - sigma_next) * sigma
        return a, c, std
    if mode is Mode.DPM_SDE:  # first order; the second order takes the previous data prediction
        big_a, b, _, std = dpm_sde_first_order(sigma, sigma_next)
        return big_a + b, -(b * sigma), std
    raise ValueError(f"mode must be a flowrl.contract.Mode; got {mode!r}")


def mode_coefficients(
    sigmas: torch.Tensor, step_index: torch.Tensor, mode: Mode, noise_level: float, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(a, c, std)`` with ``mu = a * x + c * v``, each [B] in ``dtype``."""
    table = sigmas.to(dtype)
    return coefficients_of(table, table[step_index], table[step_index + 1], mode, noise_level)


def token_coefficients(spec, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(a, c, std)`` in the compact shape of ``spec.token_sigmas``: the modes' math of
    ``coefficients_of`` on each token's (sigma, sigma'), and a held token (D = 0: sigma 0, or no
    lower schedule value) gets (1, 0, 0), x' = x (the sde formula would divide 0 by 0 there)."""
    table = spec.sigmas.to(dtype)
    sigma, sigma_next = spec.token_sigmas.to(dtype), spec.token_sigmas_next.to(dtype)
    a, c, std = coefficients_of(table, sigma, sigma_next, spec.mode, spec.noise_level)
    held = sigma == sigma_next
    return (torch.where(held, torch.ones_like(a), a), torch.where(held, torch.zeros_like(c), c),
            torch.where(held, torch.zeros_like(std), std))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _col(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(-1, 1)


def density_std(std: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The deterministic-step rule and the std floor (docs/contract.md), for every op of this
    backend: returns (deterministic, the std the value divides by). std == 0 is deterministic (value
    0, gradient 0; 1 keeps the masked branch finite, so its gradient is 0, not NaN); otherwise
    max(std, STD_FLOOR), so std**2 never underflows and r**2 / std**2 stays finite."""
    deterministic = std == 0
    return deterministic, torch.where(deterministic, torch.ones_like(std), std.clamp(min=STD_FLOOR))


def ordinary_count(std: torch.Tensor, numel: int) -> torch.Tensor:
    """float32 [B] scored elements of a per-sample step with nothing frozen: every element, or none
    when the step is deterministic (std 0)."""
    return torch.where(std > 0, float(numel), 0.0).to(torch.float32)


def value_from_total(
    total: torch.Tensor, std: torch.Tensor, count: torch.Tensor, kind: LogProbKind, reduction: Reduction,
    log_term: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A sample's log-prob (``kind`` gaussian/kernel/sq_err) or KL (``kind`` KL) from its total of
    (weighted) squared residuals over its ``count`` scored elements: the same operations as the
    kernels' ``value_from_total``. ``std`` is the sample's step std (per-token weights are relative to
    it); ``log_term`` the per-token schedules' sum of log(std_token / std) over the scored elements
    (None: 0). A sample with no scored element has value 0 (deterministic, or all frozen)."""
    none_scored = count == 0
    if reduction is Reduction.MEAN:
        total = total / torch.where(none_scored, torch.ones_like(count), count)
    _, std_d = density_std(std)
    var = std_d * std_d
    if kind is LogProbKind.SQ_ERR:
        value = -total
    elif kind is LogProbKind.KL:
        value = total / (2 * var)
    else:
        value = -total / (2 * var)
        if kind is LogProbKind.GAUSSIAN:
            const = -torch.log(std_d) - HALF_LOG_2PI
            if reduction is Reduction.MEAN:
                if log_term is not None:
                    const = const - log_term / torch.where(none_scored, torch.ones_like(count), count)
                value = value + const
            else:
                const = const * count
                value = value + (const if log_term is None else const - log_term)
    return torch.where(none_scored, torch.zeros_like(value), value)


def finalize(
    partials: torch.Tensor, std: torch.Tensor, count: torch.Tensor, kind: LogProbKind, reduction: Reduction,
    log_term: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Combine a sample's chunk partials of squared residuals (``combine_partials``) and turn the
    total into its log-prob or KL (``value_from_total``)."""
    return value_from_total(combine_partials(partials), std, count, kind, reduction, log_term)


def scored_statistics(spec, sample_shape, dtype: torch.dtype):
    """(count float32 [B], log_term [B] or None) of an elementwise step (per-token sigmas and/or a
    frozen mask), computed once on the compact tensors for both backends: ``count`` = elements
    scored (not frozen, std > 0), ``log_term`` (gaussian per-token only) = the sum over them of
    log(std_token_d / std_d), std_d the sample's own step std (density rule). Under sequence
    parallelism both are the full sample's (summed over shards)."""
    _, _, std_ref = mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
    ndim = len(sample_shape)
    column = (-1,) + (1,) * (ndim - 1)
    std = token_coefficients(spec, dtype)[2] if spec.per_token else std_ref.reshape(column)
    scored = std > 0
    if spec.frozen is not None:
        scored = scored & ~spec.frozen
    # repetition of the compact tensor over the sample: dims where it is 1 (the batch dim aside)
    repeat = 1
    for d in range(1, ndim):
        if scored.shape[d] == 1:
            repeat *= sample_shape[d]
    batch = sample_shape[0]
    n_local = 1
    for d in sample_shape[1:]:
        n_local *= d
    count = (scored.reshape(scored.shape[0], -1).sum(dim=1) * repeat).to(torch.float32).expand(batch)
    log_term = None
    if spec.per_token and spec.kind is LogProbKind.GAUSSIAN:
        _, ref_d = density_std(std_ref)
        _, tok_d = density_std(std)
        ratio = torch.log(tok_d / ref_d.reshape(column))
        ratio = torch.where(scored, ratio, torch.zeros_like(ratio))
        rows = ratio.expand(torch.broadcast_shapes(ratio.shape, scored.shape))
        rows = rows.reshape(rows.shape[0], -1)
        log_term = (combine_partials(chunk_partials(rows)) * repeat).expand(batch)
        log_term = spec.gather_sum(log_term.contiguous(), n_local)
    return spec.gather_sum(count.contiguous(), n_local), log_term


def _mean(x: torch.Tensor, v: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """mu = a * x + c * v on [B, N] rows, in a, c's compute dtype: a [B, 1] column times the stored
    rows promotes them to it (a column is never 0-d, so promotion never demotes to the storage dtype),
    without an upcast copy of x or v."""
    mu = _col(a) * _rows(x)
    return mu.add_(_col(c) * _rows(v))


def ddim_coefficients(
    table: torch.Tensor, step_index: torch.Tensor, noise_level: float, dtype: torch.dtype
) -> Tuple[torch.Tensor, ...]:
    """ddim's per-sample scalars ``(sqrt(a_t), sqrt(1 - a_t), sqrt(a_prev), k, std)``, each [B] in
    ``dtype``, from the alpha-bar table [2T] (a_t = table[2i], a_prev = table[2i + 1]), with diffusers'
    ``DDIMScheduler.step`` operations in its order: variance = ((1 - a_prev) / (1 - a_t)) * (1 - a_t /
    a_prev), std = eta * sqrt(variance), k = sqrt((1 - a_prev) - std^2). The only place the torch
    backend writes ddim's schedule math (docs/contract.md, ddim)."""
    t = table.to(dtype)
    a_t, a_prev = t[2 * step_index], t[2 * step_index + 1]
    beta_t, beta_prev = 1 - a_t, 1 - a_prev
    std = noise_level * torch.sqrt((beta_prev / beta_t) * (1 - a_t / a_prev))
    # clamp: at eta = 1, (1 - a_prev) - std^2 is >= 0 exactly but may round a hair negative (diffusers: NaN)
    k = torch.sqrt(torch.clamp(beta_prev - std * std, min=0))
    return torch.sqrt(a_t), torch.sqrt(beta_t), torch.sqrt(a_prev), k, std


def ddim_mean(x: torch.Tensor, v: torch.Tensor, sqrt_a, sqrt_b, sqrt_a_prev, k, prediction, clip_sample_range):
    """ddim's mu = sqrt(a_prev) * clip(x0_hat) + k * eps_hat on [B, N] rows (coefficients [B, 1], in the
    compute dtype), x0_hat and eps_hat from the model output as diffusers' DDIMScheduler.step computes
    them (same operations, same order); eps_hat is never re-derived from the clipped x0 (diffusers'
    default use_clipped_model_output=False). The clip makes mu nonlinear in v: autograd's clamp gradient
    is 0 outside [-range, range] (inclusive bounds pass it)."""
    v = v.to(sqrt_a.dtype)  # upcast once: the clip compares compute-dtype values, as the kernel does
    if prediction is contract.Prediction.EPSILON:
        x0, eps = (x - sqrt_b * v) / sqrt_a, v
    elif prediction is contract.Prediction.SAMPLE:
        x0 = v
        eps = (x - sqrt_a * x0) / sqrt_b
    else:  # V_PREDICTION
        x0, eps = sqrt_a * x - sqrt_b * v, sqrt_a * v + sqrt_b * x
    if clip_sample_range is not None:
        x0 = x0.clamp(-clip_sample_range, clip_sample_range)
    return sqrt_a_prev * x0 + k * eps


def ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, prediction):
    """d mu / d v of ddim's unclipped mean [B] (the kernels' common.ddim_velocity_coefficient, the same
    operations): without the clip mu = A x + C v, so two policies' means differ by C v - C v_ref."""
    if prediction is contract.Prediction.EPSILON:
        return k - (sqrt_a_prev / sqrt_a) * sqrt_b
    if prediction is contract.Prediction.SAMPLE:
        return sqrt_a_prev - (k / sqrt_b) * sqrt_a
    return k * sqrt_a - sqrt_a_prev * sqrt_b  # V_PREDICTION


def ddim_clipped_kl_coefficients(sqrt_a, sqrt_b, k, prediction):
    """(e, inv_sqrt_a) of ddim's clipped KL, per sample (the kernels' common.ddim_clipped_kl_coefficients,
    the same operations): e = d (k eps_hat) / d v, and epsilon's 1 / sqrt(a) (None for the others)."""
    if prediction is contract.Prediction.EPSILON:
        return k, 1 / sqrt_a
    if prediction is contract.Prediction.SAMPLE:
        return -((k / sqrt_b) * sqrt_a), None
    return k * sqrt_a, None  # V_PREDICTION


def _fma(a, b, c) -> torch.Tensor:
    """a * b + c rounded once (``fma_f32``'s value in float32, a * b + c in float64), differentiable as
    a * b + c: the unfused expression carries autograd, its value is replaced exactly (y - y.detach() is
    0 for finite y)."""
    y = a * b + c
    if y.dtype != torch.float32:
        return y
    with torch.no_grad():
        fused = fma_f32(*(t.detach() if isinstance(t, torch.Tensor) else t for t in (a, b, c)))
    return fused + (y - y.detach()) if y.requires_grad else fused


def ddim_clipped_difference(x, v, v_ref, sqrt_a, sqrt_b, sqrt_a_prev, k, prediction, clip_sample_range):
    """mu(v) - mu(v_ref) of ddim's clipped mean on [B, N] rows (coefficients [B, 1]), the kernels'
    common.ddim_clipped_difference: fma(sqrt(a'), clip(x0_hat) - clip(x0_hat_ref), e (v - v_ref)), with
    x0_hat = fma(-sqrt(1 - a), v, x) * (1 / sqrt(a)) (epsilon), v (sample), fma(-sqrt(1 - a), v,
    sqrt(a) x) (v_prediction) (docs/contract.md, ddim). x is not read for "sample"."""
    dtype = sqrt_a.dtype
    v, v_ref = v.to(dtype), v_ref.to(dtype)  # upcast once: the clip compares compute-dtype values
    e, inv_sqrt_a = ddim_clipped_kl_coefficients(sqrt_a, sqrt_b, k, prediction)

    def clipped_x0(out):
        if prediction is contract.Prediction.EPSILON:
            x0 = _fma(-sqrt_b, out, x) * inv_sqrt_a
        elif prediction is contract.Prediction.SAMPLE:
            x0 = out
        else:  # V_PREDICTION
            x0 = _fma(-sqrt_b, out, sqrt_a * x)
        return x0.clamp(-clip_sample_range, clip_sample_range)

    return _fma(sqrt_a_prev, clipped_x0(v) - clipped_x0(v_ref), e * (v - v_ref))


def _mean_and_std(spec, sample: torch.Tensor, model_output: torch.Tensor, dtype: torch.dtype,
                  prev_x0_pred: Optional[torch.Tensor] = None):
    """The step's mean [B, N] (in ``dtype``) and std [B] for the spec's mode. A second-order dpm_sde
    step (``prev_x0_pred`` given) adds ``p * x0_prev`` last, the kernels' order."""
    if spec.mode is Mode.DPM_SDE and prev_x0_pred is not None:
        a, c, p, std = dpm_sde_coefficients(spec.sigmas, spec.step_index, True, dtype)
        return _mean(sample, model_output, a, c).add_(_col(p) * _rows(prev_x0_pred)), std
    if spec.mode is Mode.DDIM:
        sqrt_a, sqrt_b, sqrt_a_prev, k, std = ddim_coefficients(spec.sigmas, spec.step_index, spec.noise_level, dtype)
        mu = ddim_mean(_rows(sample), _rows(model_output), _col(sqrt_a), _col(sqrt_b), _col(sqrt_a_prev), _col(k),
                       spec.prediction, spec.clip_sample_range)
        return mu, std
    a, c, std = mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
    return _mean(sample, model_output, a, c), std


def _reduce(spec, r: torch.Tensor, std: torch.Tensor):
    """[B, N] residuals -> (the per-sample value, count): chunk partials of r^2, gathered across
    shards (``spec.gather``), then ``finalize`` with the full sample's element count."""
    partials = spec.gather(_chunk_partials(r * r, consume=True))
    count = ordinary_count(std, spec.numel)
    return finalize(partials, std, count, spec.kind, spec.reduction), count


class ElementTerms:
    """An elementwise step's per-element pieces (docs/contract.md, Per-token schedules; Frozen
    elements): ``a, c, std`` broadcastable to the sample (per token, or per sample as a column),
    ``std_ref`` [B] (the sample's own step), ``scored`` (std > 0 and not frozen), ``keep`` (x' = x:
    frozen, or a held token; None when there is none), ``weight`` (var_ref / var_token for the
    kinds that divide by the variance: exactly 1 where a token's step is its sample's; None when
    per sample)."""

    def __init__(self, spec, sample: torch.Tensor, dtype: torch.dtype, with_stats: bool = True):
        a, c, std_ref = mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
        column = (-1,) + (1,) * (sample.dim() - 1)
        self.std_ref, self.weight, self.keep = std_ref, None, spec.frozen
        if spec.per_token:
            self.a, self.c, self.std = token_coefficients(spec, dtype)
            held = spec.token_sigmas == spec.token_sigmas_next
            self.keep = held if spec.frozen is None else held | spec.frozen
            if spec.kind is not LogProbKind.SQ_ERR:
                _, ref_d = density_std(std_ref)
                _, tok_d = density_std(self.std)
                self.weight = (ref_d * ref_d).reshape(column) / (tok_d * tok_d)
        else:
            self.a, self.c, self.std = a.reshape(column), c.reshape(column), std_ref.reshape(column)
        self.scored = self.std > 0 if spec.frozen is None else (self.std > 0) & ~spec.frozen
        # the count and log term (a collective under sequence parallelism): forward only
        self.stats = scored_statistics(spec, sample.shape, dtype) if with_stats else None

    def reduce(self, spec, r: torch.Tensor):
        """(value [B], count [B]) from the full-shape residuals ``r``: weighted squares of the scored
        elements only, reduced in the contract's order."""
        sq = r * r if self.weight is None else r * r * self.weight
        sq = torch.where(self.scored, sq, torch.zeros_like(sq))
        partials = spec.gather(_chunk_partials(_rows(sq), consume=True))
        count, log_term = self.stats
        return finalize(partials, self.std_ref, count, spec.kind, spec.reduction, log_term), count


class _EmittedResidual(torch.autograd.Function):
    """r = x' - mu of the emitted sample x' = round(mu + std * eps), in ``dtype``. The rounding to
    out_dtype is a constant of the step, so r moves with the noise term std * eps only, never with
    mu: d log_prob / d model_output of a rollout step is exactly 0 (as in the Triton kernel), where
    autograd through the cast would round a zero-sum gradient through out_dtype instead."""

    @staticmethod
    def forward(ctx, prev, mu, noise_term, dtype):
        return (prev - mu).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad, None


def _noise_rows(spec, sample, noise):
    if spec.noise_source is NoiseSource.PHILOX:
        return philox_normal(spec.noise_seed, _rows(sample).shape[1])
    return noise


def sde_step(spec, sample: torch.Tensor, model_output: torch.Tensor, noise: Optional[torch.Tensor],
             prev_x0_pred: Optional[torch.Tensor] = None):
    """One stochastic step. Returns ``(prev_sample, log_prob [B], mean or None, std [B], count [B])``;
    the log-prob is of the emitted ``prev_sample`` rounded to ``spec.out_dtype`` (docs/contract.md,
    Rounding). ``noise`` is eps for a TENSOR noise source; for PHILOX eps is ``philox_normal`` of the
    spec's seed; for NONE the step is deterministic by its arguments (ode, noise level 0) and x' = mu."""
    noise = _noise_rows(spec, sample, noise)
    if spec.elementwise:
        return _sde_step_elementwise(spec, sample, model_output, noise)
    dtype = compute_dtype(sample, model_output, noise)
    mu, std = _mean_and_std(spec, sample, model_output, dtype, prev_x0_pred)
    if noise is None:
        noise_term = None
        prev = mu.to(spec.out_dtype, copy=True)  # std is 0: mu + 0 * eps is mu
    else:
        noise_term = _col(std) * _rows(noise)
        prev = (noise_term + mu).to(spec.out_dtype)  # = mu + std * eps, rounded to out_dtype
    r = _EmittedResidual.apply(prev, mu, noise_term, dtype)  # docs/contract.md, Rounding
    lp, count = _reduce(spec, r, std)
    mean = mu.reshape(sample.shape) if spec.return_mean else None
    return prev.reshape(sample.shape), lp, mean, std, count


def _sde_step_elementwise(spec, sample, model_output, noise):
    """The rollout with per-token sigmas and/or a frozen mask: the same operations per element as
    ``sde_step``, in the sample's shape; kept elements (frozen, held tokens) emit x' = x and are not
    scored, but keep their noise positions."""
    dtype = compute_dtype(sample, model_output, noise)
    t = ElementTerms(spec, sample, dtype)
    mu = t.a * sample + t.c * model_output
    if noise is None:
        noise_term = None
        prev = mu.to(spec.out_dtype, copy=True)
    else:
        noise_term = t.std * noise.reshape(sample.shape)
        prev = (noise_term + mu).to(spec.out_dtype)
    if t.keep is not None:
        prev = torch.where(t.keep, sample.to(spec.out_dtype), prev)
    # kept elements are not scored (frozen, or held: std 0), so r needs no mask before ``reduce``
    r = _EmittedResidual.apply(prev, mu, noise_term, dtype)
    lp, count = t.reduce(spec, r)
    if spec.return_mean and t.keep is not None:
        mu = torch.where(t.keep, sample.to(dtype), mu)
    return prev, lp, (mu if spec.return_mean else None), t.std_ref, count


def step_log_prob(spec, sample: torch.Tensor, model_output: torch.Tensor, prev_sample: torch.Tensor,
                  prev_x0_pred: Optional[torch.Tensor] = None):
    """(log-prob [B], count [B]) of ``prev_sample`` given ``sample`` under the policy's ``model_output``."""
    dtype = compute_dtype(sample, model_output, prev_sample)
    if spec.elementwise:
        t = ElementTerms(spec, sample, dtype)
        return t.reduce(spec, (prev_sample - (t.a * sample + t.c * model_output)).to(dtype))
    mu, std = _mean_and_std(spec, sample, model_output, dtype, prev_x0_pred)
    r = (_rows(prev_sample) - mu).to(dtype)
    return _reduce(spec, r, std)


def step_kl(spec, sample: torch.Tensor, model_output: torch.Tensor, ref_model_output: torch.Tensor,
            prev_x0_pred: Optional[torch.Tensor] = None):
    """(KL [B], count [B]): the exact Gaussian KL between the step's transitions under two policies
    sharing ``std``: ``(mu_theta - mu_ref)^2 / (2 std^2)`` per element (docs/contract.md, KL)."""
    dtype = compute_dtype(sample, model_output, ref_model_output)
    # mu - mu_ref = c v - c v_ref: the a * x terms cancel exactly, so the KL does not depend on x (its
    # gradient is none, not two opposite terms that can overflow a float16 gradient and give NaN)
    if spec.mode is Mode.DDIM:
        sqrt_a, sqrt_b, sqrt_a_prev, k, std = ddim_coefficients(spec.sigmas, spec.step_index, spec.noise_level, dtype)
        if not spec.linear_mean:  # the clip: x0_hat's terms differ by the clip (x read, but for "sample")
            x = _rows(sample).to(dtype) if spec.kl_reads_sample else None
            r = ddim_clipped_difference(x, _rows(model_output), _rows(ref_model_output), _col(sqrt_a), _col(sqrt_b),
                                        _col(sqrt_a_prev), _col(k), spec.prediction, spec.clip_sample_range)
            return _reduce(spec, r, std)
        c = ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, spec.prediction)
    elif spec.elementwise:
        t = ElementTerms(spec, sample, dtype)
        return t.reduce(spec, (t.c * model_output) - (t.c * ref_model_output))
    elif spec.mode is Mode.DPM_SDE and prev_x0_pred is not None:  # p * x0_prev is shared and cancels like a * x
        _, c, _, std = dpm_sde_coefficients(spec.sigmas, spec.step_index, True, dtype)
    else:
        _, c, std = mode_coefficients(spec.sigmas, spec.step_index, spec.mode, spec.noise_level, dtype)
    r = (_col(c) * _rows(model_output)).sub_(_col(c) * _rows(ref_model_output))
    return _reduce(spec, r, std)
