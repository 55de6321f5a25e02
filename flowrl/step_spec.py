"""One validated, immutable description of a step: ``StepSpec``.

The public ops (``flowrl.functional``) build a spec once from their arguments (every check that names
an argument runs here, through ``flowrl._validate``), then hand it with the tensors to a backend of
the table in ``flowrl._dispatch``. Backends read their scalars and switches from the spec only, so a
parameter is followed from ``flowrl.sde_step`` to the kernel launch through named fields:
``noise_level`` -> ``StepSpec.noise_level`` -> ``reference.mode_coefficients`` or the kernels'
``eta`` argument.

Sequence parallelism adds a ``ShardContext`` to the spec (``flowrl.distributed`` builds it from the
process group) instead of re-declaring the ops' arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from . import _validate as V
from .contract import LogProbKind, Mode, NoiseSource, Op, Reduction

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

    def gather(self, partials: torch.Tensor) -> torch.Tensor:
        """The full sample's chunk partials from this call's (identity on one device)."""
        return partials if self.shard is None else self.shard.gather(partials)


def _schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level):
    V.check_sample(sample)
    V.check_batch_tensor("model_output", model_output, sample)
    mode = Mode.parse("mode", mode)
    eta = V.check_noise_level(noise_level, mode.label)
    sigmas = V.check_sigmas(sigmas, sample.device)
    idx = V.check_step_index(step_index, sigmas.numel() - 1, sample.shape[0], sample.device)
    return sigmas, idx, mode, eta


def _numel(sample: torch.Tensor, shard: Optional[ShardContext]) -> int:
    if shard is None:
        return sample.numel() // sample.shape[0]
    if not isinstance(shard, ShardContext):
        raise TypeError(f"shard must be a flowrl.step_spec.ShardContext or None; got {type(shard).__name__}")
    return shard.numel


def rollout_spec(
    sample, model_output, sigmas, step_index, *, mode, noise_level, log_prob, reduction, out_dtype,
    noise, generator, noise_seed, return_mean: bool, shard: Optional[ShardContext],
) -> StepSpec:
    """The spec of ``sde_step``; checks the noise arguments too (``noise``, ``generator``, ``noise_seed``
    are exclusive). The noise source is PHILOX for a seed, TENSOR for a given tensor or one to draw,
    and NONE for a step deterministic by its arguments (ode, noise level 0) with nothing given: such
    a step draws no noise and advances no generator."""
    sigmas, idx, mode, eta = _schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level)
    kind = _log_prob_kind(log_prob)
    reduction = Reduction.parse("reduction", reduction)
    out_dtype = V.check_out_dtype(out_dtype, model_output.dtype)
    seed = None
    if noise_seed is not None:
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
        V.check_generator(generator, sample.shape[0])
        deterministic = mode is Mode.ODE or eta == 0
        source = NoiseSource.NONE if deterministic else NoiseSource.TENSOR
    return StepSpec(
        Op.ROLLOUT, sigmas, idx, mode, eta, kind, reduction, _numel(sample, shard), out_dtype=out_dtype,
        noise_source=source, noise_seed=seed, return_mean=bool(return_mean), shard=shard,
    )


def log_prob_spec(
    sample, model_output, prev_sample, sigmas, step_index, *, mode, noise_level, log_prob, reduction,
    shard: Optional[ShardContext],
) -> StepSpec:
    """The spec of ``step_log_prob``."""
    sigmas, idx, mode, eta = _schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level)
    V.check_batch_tensor("prev_sample", prev_sample, sample)
    return StepSpec(Op.LOG_PROB, sigmas, idx, mode, eta, _log_prob_kind(log_prob),
                    Reduction.parse("reduction", reduction), _numel(sample, shard), shard=shard)


def kl_spec(
    sample, model_output, ref_model_output, sigmas, step_index, *, mode, noise_level, reduction,
    shard: Optional[ShardContext],
) -> StepSpec:
    """The spec of ``step_kl``."""
    sigmas, idx, mode, eta = _schedule_and_steps(sample, model_output, sigmas, step_index, mode, noise_level)
    V.check_batch_tensor("ref_model_output", ref_model_output, sample)
    return StepSpec(Op.KL, sigmas, idx, mode, eta, LogProbKind.KL, Reduction.parse("reduction", reduction),
                    _numel(sample, shard), shard=shard)


def _log_prob_kind(log_prob) -> LogProbKind:
    V.check_choice("log_prob", log_prob, V.LOG_PROB_KINDS)  # "kl" is step_kl's, not a log_prob= value
    return LogProbKind.parse("log_prob", log_prob)


__all__ = ["StepSpec", "ShardContext", "rollout_spec", "log_prob_spec", "kl_spec", "draw_noise", "GeneratorArg"]
