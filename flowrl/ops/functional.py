"""The public functional API: ``sde_step``, ``step_log_prob``, ``step_kl``.

Each op declares its arguments once, here, builds one validated, immutable ``StepSpec`` from them
(``flowrl.core.step_spec``), picks a backend from the table in ``flowrl.backends._dispatch``, and calls that
backend's op with the spec and the tensors. ``flowrl.distributed`` wraps these ops (adding ``group``).
The math lives in the backends (``flowrl.backends.reference`` and the Triton kernels), never here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import List, NamedTuple, Optional, Sequence, Union

import torch

from ..backends import _dispatch
from . import _custom_ops
from ..core import _validate as V
from ..contract import LogProbKind, Mode, NoiseSource, Op, Reduction
from ..core.step_spec import (
    GeneratorArg, ShardContext, StepSpec, ddim_options, draw_noise, elements_per_sample, elementwise_inputs,
    parse_log_prob_kind,
    schedule_and_steps,
)


@dataclass
class SDEStepOutput:
    """Result of one stochastic step.

    prev_sample: the emitted sample x', in ``out_dtype``.
    log_prob: float32 [B], log-prob of the emitted (rounded) sample.
    prev_sample_mean: float32 mean mu of x' given x (None when not requested).
    std_dev: float32 [B], the transition's std per sample (its own step's, per-token sigmas aside).
    count: float32 [B], the elements the log-prob scores (not frozen, not held, std > 0): the
        denominator of ``reduction="mean"``, 0 for a deterministic step (docs/contract.md, Frozen
        elements and counts).

    Iterating yields the first four fields (``prev, lp, mean, std = sde_step(...)``, as before
    ``count`` was added).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: Optional[torch.Tensor]
    std_dev: torch.Tensor
    count: torch.Tensor

    def __iter__(self):
        return iter((self.prev_sample, self.log_prob, self.prev_sample_mean, self.std_dev))


class LogProbWithCount(NamedTuple):
    """``step_log_prob(..., return_count=True)``: the log-prob [B] and the count [B] of elements it
    scores (float32; SGLang returns the sum and the count). ``log_prob * count`` of a mean is not the
    sum bit for bit: ask for ``reduction="sum"`` to aggregate sums."""

    log_prob: torch.Tensor
    count: torch.Tensor


def check_stream_weights(weights, num_streams: int, name: str = "stream_weights") -> Optional[tuple]:
    """None, or ``weights`` as a tuple of ``num_streams`` floats, each finite and >= 0, not all 0;
    ``TypeError`` / ``ValueError`` naming ``name`` otherwise (a list or tuple of real numbers)."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes, torch.Tensor)) or not isinstance(weights, (list, tuple)):
        raise TypeError(f"{name} must be None or a tuple of {num_streams} floats (one per stream); got "
                        f"{type(weights).__name__}")
    if len(weights) != num_streams:
        raise ValueError(f"{name} must have one weight per stream ({num_streams}); got {len(weights)}")
    out = []
    for k, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, Real):
            raise TypeError(f"{name}[{k}] must be a real number; got {w!r}")
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{name}[{k}] must be finite and >= 0; got {w}")
        out.append(w)
    if not any(out):
        raise ValueError(f"{name} must have a weight > 0; got {tuple(out)}")
    return tuple(out)


def combine_streams(sums: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], reduction: str = "mean",
                    weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    """The joint log-prob (or KL) [B] of several streams stepped together (LTX-2's video and audio):
    ``sums`` are each stream's value with ``reduction="sum"``, ``counts`` their counts. ``"sum"``:
    the streams' sums added left to right; ``"mean"``: that total divided by the total count (0 where
    no element is scored). The one place the combination is written: ``step_log_prob`` with tuples
    and the recorder's rollout both call it, so they agree bit for bit.

    ``weights`` (one float per stream, finite, >= 0, not all 0; None: the element-count weighting
    above): ``"mean"`` is ``sum_k w_k * (sums[k] / counts[k])`` (a stream's mean is 0 where its count
    is 0), the fixed weighting of per-modality means (verl-omni's MiniMax-H3 recipe: 0.5 / 0.5);
    ``"sum"`` is ``sum_k w_k * sums[k]``; terms added left to right."""
    reduction = Reduction.parse("reduction", reduction)
    sums, counts = list(sums), list(counts)
    if not sums or len(sums) != len(counts):
        raise ValueError(f"combine_streams needs one count per sum and at least one stream; got {len(sums)} sums "
                         f"and {len(counts)} counts")
    weights = check_stream_weights(weights, len(sums), "weights")
    if weights is not None:
        total = None
        for value, c, w in zip(sums, counts, weights):
            if reduction is Reduction.MEAN:
                value = _safe_mean(value, c.to(torch.float32))
            term = value * w
            total = term if total is None else total + term
        return total
    total = sums[0]
    for value in sums[1:]:
        total = total + value
    if reduction is Reduction.SUM:
        return total
    count = counts[0].to(torch.float32)
    for c in counts[1:]:
        count = count + c.to(torch.float32)
    return _safe_mean(total, count)


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, 0 where ``count`` is 0."""
    none_scored = count == 0
    value = total / torch.where(none_scored, torch.ones_like(count), count)
    return torch.where(none_scored, torch.zeros_like(value), value)


def second_order(prev_x0_pred, mode: Mode, sample: torch.Tensor) -> dict:
    """The backend ops' keyword for a second-order dpm_sde step: ``{"prev_x0_pred": x0_prev}``, or
    ``{}`` (first order). ``prev_x0_pred`` is the previous step's data prediction ``x_{i-1} -
    sigma_{i-1} v_{i-1}`` (what diffusers' DPM solvers and MixGRPO keep as ``model_outputs``), x's
    shape; only mode='dpm_sde' reads one (docs/contract.md, dpm_sde)."""
    if prev_x0_pred is None:
        return {}
    if "prev_x0_pred" not in mode.rules.extra_inputs:
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
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    return_prev_sample_mean: bool = True,
    noise_seed: Union[None, int, torch.Tensor] = None,
    shard: Optional[ShardContext] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
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
    it; None on one device).

    ``prediction_type`` ("epsilon", "sample", "v_prediction") and
    ``clip_sample_range`` (None: no clipping) are mode='ddim''s, whose ``sigmas`` is the alpha-bar
    table [2T] of (alpha_bar_t, alpha_bar_prev) pairs (docs/contract.md, ddim). ``prev_x0_pred``
    (mode='dpm_sde' only): the previous step's data prediction ``x_{i-1} - sigma_{i-1} v_{i-1}``, x's
    shape, which makes the step second order (docs/contract.md, dpm_sde); differentiable.

    ``token_sigmas`` (float, the sample's ndim, broadcastable to it, e.g. [B, S, 1]): each token's
    current sigma; its next is the largest schedule value strictly below it (diffusers' per-token
    rule), a token at sigma 0 is held (x' = x). ``frozen`` (bool, broadcastable): conditioning
    elements, emitted unchanged (x' = x), not scored, zero gradient; the noise keeps its element
    positions. See docs/contract.md, Per-token schedules and Frozen elements and counts.
    """
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    elementwise = elementwise_inputs(sample, sigmas, token_sigmas, frozen, mode, prev_x0_pred is not None)
    kind, reduction = parse_log_prob_kind(log_prob_kind), Reduction.parse("reduction", reduction)
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
    spec = StepSpec(op=Op.ROLLOUT, sigmas=sigmas, step_index=idx, mode=mode, noise_level=eta, kind=kind,
                    reduction=reduction, numel=elements_per_sample(sample, shard), out_dtype=out_dtype,
                    noise_source=source, noise_seed=seed,
                    return_mean=bool(return_prev_sample_mean), shard=shard, **extra, **elementwise)
    # the backend is chosen (and a bad one refused) before any noise is drawn: a drawn noise is float32,
    # so only a given noise tensor enters the choice
    given = (sample, model_output) if noise is None else (sample, model_output, noise)
    ops = _dispatch.select(backend, *given, *prev.values())
    if ops.name == "triton" and spec.out_dtype == torch.float64:
        raise TypeError("out_dtype=float64 runs on backend='torch' only")
    # an empty batch (B = 0) draws nothing: _custom_ops.sde_step returns its empty outputs, no kernel
    if noise is None and source is NoiseSource.TENSOR and not _custom_ops.is_empty(sample):
        noise = (draw_noise if shard is None else shard.draw_noise)(sample.shape, generator, sample.device)
    # while torch.compile traces, the custom op flowrl::sde_step (flowrl/ops/_custom_ops.py); else the backend's op
    return SDEStepOutput(*_custom_ops.sde_step(ops, spec, sample, model_output, noise, **prev))


def _per_stream(name: str, value, n: int) -> list:
    """One entry per stream: a tuple of n entries, or one value shared by every stream."""
    if isinstance(value, tuple):
        if len(value) != n:
            raise ValueError(f"{name} must have one entry per stream ({n}) or be one shared value; got {len(value)} entries")
        return list(value)
    return [value] * n


def _joint(op, sample, tensors: dict, shared: dict, reduction, return_count: bool, stream_weights=None):
    """``op`` over streams: each stream's sum and count, combined by ``combine_streams`` (with
    ``stream_weights``, when given)."""
    n = len(sample)
    if n == 0:
        raise ValueError("sample must hold at least one stream when given as a tuple")
    stream_weights = check_stream_weights(stream_weights, n)
    for name, value in tensors.items():
        if not isinstance(value, tuple):
            raise TypeError(f"{name} must be a tuple of {n} tensors, one per stream like sample; got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"{name} must be a tuple of {n} tensors, one per stream like sample; got {len(value)} entries")
    streams = {name: list(value) for name, value in tensors.items()}
    streams.update({name: _per_stream(name, value, n) for name, value in shared.items()})
    sums, counts = [], []
    for k in range(n):
        value, count = op(sample[k], **{name: streams[name][k] for name in streams}, reduction="sum", return_count=True)
        sums.append(value)
        counts.append(count)
    joint = combine_streams(sums, counts, reduction, stream_weights)
    if not return_count:
        return joint
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return LogProbWithCount(joint, total)


def _single_stream(stream_weights) -> None:
    if stream_weights is not None:
        raise ValueError("stream_weights weights the streams of a joint step: pass sample, model_output and the "
                         "third tensor as tuples (one tensor per stream), or stream_weights=None")


def step_log_prob(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
    return_count: bool = False,
    prediction_type: Optional[str] = None,
    clip_sample_range: Optional[float] = None,
    prev_x0_pred=None,
    stream_weights=None,
):
    """Log-prob [B] of the stored ``prev_sample`` under the current ``model_output``; differentiable
    with respect to ``model_output``, ``sample`` and ``prev_sample``. On the same backend and inputs it
    reproduces ``sde_step``'s log-prob bit for bit. ``token_sigmas`` and ``frozen`` as in ``sde_step``;
    ``return_count=True`` returns ``LogProbWithCount(log_prob, count)``.

    Joint streams: ``sample``, ``model_output`` and ``prev_sample`` as tuples (one tensor per stream,
    same batch); ``sigmas``, ``step_index``, ``token_sigmas`` and ``frozen`` a tuple with one entry
    per stream or one shared value. The value is ``combine_streams`` of the streams' sums and counts;
    ``stream_weights`` (one float per stream, e.g. ``(0.5, 0.5)``: weighted per-stream means) passes
    its weights (None: weighted by element count). ``return_count``'s count is the streams' total.

    ``prediction_type`` and ``clip_sample_range``: mode='ddim''s, as in ``sde_step``. A second-order
    dpm_sde step needs the rollout's ``prev_x0_pred`` (``RolloutTrajectory.prev_x0_preds[:, i]``),
    also differentiable (for streams: a tuple, one per stream, or None)."""
    if isinstance(sample, tuple):
        return _joint(step_log_prob, sample, dict(model_output=model_output, prev_sample=prev_sample),
                      dict(sigmas=sigmas, step_index=step_index, token_sigmas=token_sigmas, frozen=frozen,
                           mode=mode, noise_level=noise_level, log_prob_kind=log_prob_kind, backend=backend, shard=shard,
                           prediction_type=prediction_type, clip_sample_range=clip_sample_range,
                           prev_x0_pred=prev_x0_pred),
                      reduction, V.check_bool("return_count", return_count), stream_weights)
    _single_stream(stream_weights)
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    V.check_batch_tensor("prev_sample", prev_sample, sample)
    return_count = V.check_bool("return_count", return_count)
    spec = StepSpec(op=Op.LOG_PROB, sigmas=sigmas, step_index=idx, mode=mode, noise_level=eta,
                    kind=parse_log_prob_kind(log_prob_kind), reduction=Reduction.parse("reduction", reduction),
                    numel=elements_per_sample(sample, shard), shard=shard, **extra,
                    **elementwise_inputs(sample, sigmas, token_sigmas, frozen, mode, prev_x0_pred is not None))
    prev = second_order(prev_x0_pred, mode, sample)
    ops = _dispatch.select(backend, sample, model_output, prev_sample, *prev.values())
    value, count = _custom_ops.step_value(ops, spec, sample, model_output, prev_sample, **prev)
    return LogProbWithCount(value, count) if return_count else value


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
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
    return_count: bool = False,
    prediction_type: Optional[str] = None,
    clip_sample_range: Optional[float] = None,
    prev_x0_pred=None,
    stream_weights=None,
):
    """Exact KL [B] between this step's transitions under ``model_output`` and ``ref_model_output``
    (same std): ``(mu - mu_ref)^2 / (2 std^2)`` reduced like the log-prob; 0 on deterministic steps.
    ``token_sigmas``, ``frozen``, ``return_count``, tuples of streams (and ``stream_weights``) and the
    ddim / dpm_sde options as in ``step_log_prob``."""
    if isinstance(sample, tuple):
        return _joint(step_kl, sample, dict(model_output=model_output, ref_model_output=ref_model_output),
                      dict(sigmas=sigmas, step_index=step_index, token_sigmas=token_sigmas, frozen=frozen,
                           mode=mode, noise_level=noise_level, backend=backend, shard=shard,
                           prediction_type=prediction_type, clip_sample_range=clip_sample_range,
                           prev_x0_pred=prev_x0_pred),
                      reduction, V.check_bool("return_count", return_count), stream_weights)
    _single_stream(stream_weights)
    extra = ddim_options(mode, prediction_type, clip_sample_range)
    sigmas, idx, mode, eta = schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level,
                                                extra.get("prediction"))
    V.check_batch_tensor("ref_model_output", ref_model_output, sample)
    return_count = V.check_bool("return_count", return_count)
    spec = StepSpec(op=Op.KL, sigmas=sigmas, step_index=idx, mode=mode, noise_level=eta, kind=LogProbKind.KL,
                    reduction=Reduction.parse("reduction", reduction), numel=elements_per_sample(sample, shard),
                    shard=shard, **extra,
                    **elementwise_inputs(sample, sigmas, token_sigmas, frozen, mode, prev_x0_pred is not None))
    prev = second_order(prev_x0_pred, mode, sample)
    ops = _dispatch.select(backend, sample, model_output, ref_model_output, *prev.values())
    value, count = _custom_ops.step_value(ops, spec, sample, model_output, ref_model_output, **prev)
    return LogProbWithCount(value, count) if return_count else value


__all__: List[str] = ["SDEStepOutput", "LogProbWithCount", "combine_streams", "check_stream_weights", "sde_step",
                       "step_log_prob", "step_kl",
                       "draw_noise", "ShardContext"]
