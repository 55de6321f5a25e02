"""One validated, immutable description of a step: ``StepSpec``.

Each public op (``flowrl.ops.functional``) builds its spec once from its arguments, with the checks here
and in ``flowrl.core._validate`` (each names its argument), then hands it with the tensors to a backend of
the table in ``flowrl.backends._dispatch``. Backends read their scalars and switches from the spec only, so a
parameter is followed from ``flowrl.sde_step`` to the kernel launch through named fields:
``noise_level`` -> ``StepSpec.noise_level`` -> ``reference.mode_coefficients`` or the kernels'
``eta`` argument.

Sequence parallelism adds a ``ShardContext`` to the spec (``flowrl.distributed`` builds it from the
process group) instead of re-declaring the ops' arguments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from . import _validate as V
from ..contract import CHUNK_SIZE, LogProbKind, Mode, NoiseSource, Op, Prediction, Reduction, Schedule  # noqa: F401 (field types)

GeneratorArg = Union[None, torch.Generator, Sequence[torch.Generator]]


def draw_noise(shape, generator: GeneratorArg, device: torch.device) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` (docs/contract.md, Noise). A list of B generators
    draws row i from generator i with shape (1, *shape[1:]), so a sample's noise does not depend on
    its batch."""
    shape = tuple(shape)
    if isinstance(generator, (list, tuple)):
        rows = [torch.randn((1,) + shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return torch.cat([r.to(device) for r in rows], dim=0)
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)


def ddim_kl_reads_sample(prediction: Prediction, clipped: bool) -> bool:
    """Whether ddim's KL of ``prediction`` (clipped: ``clip_sample_range`` given) reads x: the unclipped
    one is ``c v - c v_ref``; the clipped one's x0_hat reads x, but for ``"sample"`` (x0_hat = v)
    (docs/contract.md, ddim)."""
    return clipped and prediction is not Prediction.SAMPLE


@dataclass(frozen=True)
class ShardContext:
    """Where this call's tensors sit in the full samples, under sequence parallelism.

    numel: elements per full sample (the mean's denominator).
    offset: index of this shard's first element in the flattened sample (Philox noise is keyed by it).
    gather: this shard's chunk partials [B, P_local] -> the full sample's [B, P], differentiable.
    draw_noise: (shape, generator, device) -> this shard's slice of the full-sample noise.
    """

    numel: int
    offset: int
    gather: Callable[[torch.Tensor], torch.Tensor]
    draw_noise: Callable[..., torch.Tensor] = draw_noise


@dataclass(frozen=True)
class StepSpec:
    """Everything a backend needs about one step besides the tensors.

    op: what the element pass computes (rollout, log-prob of a stored sample, KL).
    sigmas: the schedule table [T + 1], float32 (float64 only when given so; the torch backend then
        computes in float64), on the sample's device.
    step_index: int64 [B] on the sample's device.
    mode, noise_level: the step's mean and std (docs/contract.md, Modes); noise_level a float.
    kind: the per-element value (a log-prob kind, or KL for step_kl); reduction: mean or sum.
    numel: elements per full sample (the local count, or the shard context's).
    out_dtype, noise_source, noise_seed, return_mean: the rollout's (None / NONE / None / False
        for the other ops).
    shard: the sequence-parallel context, None on one device.
    token_sigmas, token_sigmas_next: each token's (sigma, sigma'), in the table's dtype, the compact
        shape the user gave (broadcastable to the sample), from ``token_schedule``; None for a
        per-sample step (docs/contract.md, Per-token schedules).
    frozen: bool mask broadcastable to the sample (True: conditioning element, x' = x, not scored);
        None when nothing is frozen.
    prediction, clip_sample_range: ddim's model output type and its x0 clip (None: no clipping);
        EPSILON / None for every other mode. For ddim, ``sigmas`` is the alpha-bar table [2T]
        (``_validate.check_alpha_bar_table``).
    """

    op: Op
    sigmas: torch.Tensor
    step_index: torch.Tensor
    mode: Mode
    noise_level: float
    kind: LogProbKind
    reduction: Reduction
    numel: int
    out_dtype: Optional[torch.dtype] = None
    noise_source: NoiseSource = NoiseSource.NONE
    noise_seed: Optional[V.NoiseSeed] = None
    return_mean: bool = False
    shard: Optional[ShardContext] = None
    prediction: Prediction = Prediction.EPSILON
    clip_sample_range: Optional[float] = None
    token_sigmas: Optional[torch.Tensor] = None
    token_sigmas_next: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None

    @property
    def per_token(self) -> bool:
        return self.token_sigmas is not None

    @property
    def linear_mean(self) -> bool:
        """True when the mean is ``a x + c v`` with per-step a, c (every mode but ddim with its x0 clip):
        two policies' means then differ by ``c v - c v_ref`` (docs/contract.md)."""
        return not (self.mode is Mode.DDIM and self.clip_sample_range is not None)

    @property
    def kl_reads_sample(self) -> bool:
        """Whether the KL depends on x (and has an x grad): only ddim's clipped KL, whose x0_hat reads x
        (``ddim_kl_reads_sample``)."""
        return self.mode is Mode.DDIM and ddim_kl_reads_sample(self.prediction, self.clip_sample_range is not None)

    @property
    def elementwise(self) -> bool:
        """True when some element's step differs from its sample's (per-token sigmas or a mask): the
        scored-element count and the per-token log term come from ``reference.scored_statistics``."""
        return self.token_sigmas is not None or self.frozen is not None

    def gather(self, partials: torch.Tensor) -> torch.Tensor:
        """The full sample's chunk partials from this call's (identity on one device)."""
        return partials if self.shard is None else self.shard.gather(partials)

    def gather_sum(self, local: torch.Tensor, n_local: int) -> torch.Tensor:
        """[B] per-sample values of this shard (integer-valued counts, or a log term) summed over the
        shards in rank order (identity on one device): carried through ``gather`` as the first
        column of a [B, P_local] zero block, so no second kind of collective is needed."""
        if self.shard is None:
            return local
        block = local.new_zeros((local.shape[0], -(-n_local // CHUNK_SIZE)))
        block[:, 0] = local
        return self.shard.gather(block).sum(dim=1)


def token_schedule(sigmas: torch.Tensor, token_sigmas: torch.Tensor):
    """Each token's (sigma, sigma') in the table's dtype, in ``token_sigmas``' compact shape: sigma'
    is the largest schedule value strictly below sigma - 1e-6, 0 when there is none (diffusers'
    FlowMatchEulerDiscreteScheduler.step with per_token_timesteps, the same comparison). A token at
    sigma 0 gets sigma' = 0: D = 0, held (x' = x). Computed once per op, here, for both backends."""
    sigma = token_sigmas.detach().to(sigmas.dtype)
    table = sigmas.reshape((-1,) + (1,) * sigma.dim())
    lower = table < (sigma - 1e-6).unsqueeze(0)
    sigma_next = (lower * table).amax(dim=0)
    return sigma, sigma_next


def flat_layout(t: torch.Tensor, sample_shape):
    """A compact tensor broadcastable to ``sample_shape`` as the kernels index it: ``(table [Bt, G]
    contiguous, inner, groups, batch_stride)`` with element e of sample b (flattened, in-sample) reading
    the flat table at ``b * batch_stride + (e // inner) % groups`` (batch_stride 0 when Bt is 1). Dims outside the span of t's non-1
    dims (after the batch) are pure repetition; only the span is materialised (expanded where t has a
    1 inside it), never the full sample unless the user passed one."""
    dims = [d for d in range(1, len(sample_shape)) if t.shape[d] != 1]
    bt = t.shape[0]
    if not dims:
        table, inner, groups = t.reshape(bt, 1), 1, 1
    else:
        lo, hi = dims[0], dims[-1]
        index = tuple(slice(None) if lo <= d <= hi or d == 0 else 0 for d in range(len(sample_shape)))
        span = t[index].expand((bt,) + tuple(sample_shape[lo: hi + 1]))
        groups = span[0].numel()
        table = span.reshape(bt, groups)
        inner = 1
        for d in range(hi + 1, len(sample_shape)):
            inner *= sample_shape[d]
    return table.contiguous(), inner, groups, 0 if bt == 1 else groups


def schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level, prediction=None):
    """The checks every op makes: the sample, model_output like it, the mode, the noise level, the
    schedule and the step indices. Returns (sigmas, int64 step indices [B], Mode, float eta).
    ``prediction`` (ddim's, from ``ddim_options``) decides whether alpha_bar_t may be 0."""
    V.check_sample(sample)
    V.check_batch_tensor("model_output", model_output, sample)
    mode = Mode.parse("mode", mode)
    eta = V.check_noise_level(noise_level, mode.label)
    if mode.rules.schedule is Schedule.ALPHA_BAR:
        allow_zero = prediction is not None and prediction is not Prediction.EPSILON
        sigmas = V.check_alpha_bar_table(sigmas, sample.device, allow_zero_alpha=allow_zero)
        num_steps = sigmas.numel() // 2
    else:
        sigmas = V.check_sigmas(sigmas, sample.device)
        num_steps = sigmas.numel() - 1
    idx = V.check_step_index(step_index, num_steps, sample.shape[0], sample.device)
    return sigmas, idx, mode, eta


def elementwise_inputs(sample, sigmas, token_sigmas, frozen, mode: Mode = Mode.SDE, second_order: bool = False):
    """The checked per-token schedule and frozen mask of an op: ``dict(token_sigmas=, token_sigmas_next=,
    frozen=)`` for ``StepSpec`` (Nones when not given). ddim (alpha-bar table) and dpm_sde's second
    order (which reads the previous step) take neither (``Mode.rules.per_token`` / ``frozen``): refused,
    never approximated."""
    fields = dict(token_sigmas=None, token_sigmas_next=None, frozen=None)
    refused = (token_sigmas is not None and not mode.rules.per_token) or (frozen is not None and not mode.rules.frozen)
    if (token_sigmas is not None or frozen is not None) and (refused or second_order):
        given = "token_sigmas" if token_sigmas is not None else "frozen"
        what = f"mode={mode.label!r}" if refused else "a second-order dpm_sde step (prev_x0_pred)"
        raise ValueError(f"{given} is not supported with {what}: per-token schedules and frozen masks are "
                         "defined for the flow modes' per-element steps (docs/contract.md)")
    if token_sigmas is not None:
        V.check_token_sigmas(token_sigmas, sample)
        fields["token_sigmas"], fields["token_sigmas_next"] = token_schedule(sigmas, token_sigmas)
    if frozen is not None:
        fields["frozen"] = V.check_frozen(frozen, sample)
    return fields


def ddim_options(mode, prediction_type, clip_sample_range) -> dict:
    """StepSpec's ddim fields from the public ``prediction_type`` / ``clip_sample_range``: for ddim,
    prediction_type is one of diffusers' ("epsilon" when None) and clip_sample_range None or > 0; other
    modes take neither (their model output is a velocity, and nothing is clipped)."""
    if "prediction_type" not in Mode.parse("mode", mode).rules.extra_inputs:
        if prediction_type is not None or clip_sample_range is not None:
            raise ValueError("prediction_type and clip_sample_range are mode='ddim' options; got "
                             f"prediction_type={prediction_type!r}, clip_sample_range={clip_sample_range!r} "
                             f"with mode={mode!r}")
        return {}
    prediction = Prediction.parse("prediction_type", "epsilon" if prediction_type is None else prediction_type)
    return dict(prediction=prediction, clip_sample_range=V.check_clip_sample_range(clip_sample_range))


def elements_per_sample(sample: torch.Tensor, shard: Optional[ShardContext]) -> int:
    """The mean's denominator: the sample's element count, or the full sample's under ``shard``."""
    if shard is None:
        return math.prod(sample.shape[1:])  # not numel // B: B may be 0 (an empty batch)
    if not isinstance(shard, ShardContext):
        raise TypeError(f"shard must be a flowrl.core.step_spec.ShardContext or None; got {type(shard).__name__}")
    return shard.numel


def parse_log_prob_kind(log_prob_kind) -> LogProbKind:
    """``log_prob_kind=``'s kind ("kl" is step_kl's value, not a log-prob kind)."""
    V.check_choice("log_prob_kind", log_prob_kind, V.LOG_PROB_KINDS)
    return LogProbKind.parse("log_prob_kind", log_prob_kind)


__all__ = ["StepSpec", "ShardContext", "schedule_and_steps", "token_schedule", "flat_layout", "elementwise_inputs",
           "ddim_options", "elements_per_sample", "parse_log_prob_kind", "draw_noise",
           "GeneratorArg"]
