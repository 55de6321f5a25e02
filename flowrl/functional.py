"""The public functional API: ``sde_step``, ``step_log_prob``, ``step_kl``.

Each function validates its arguments once, resolves the backend (``flowrl._dispatch``), and calls
that backend's function of the same name. The math lives in the backends (``flowrl.reference`` and
the Triton kernels), never here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from . import _dispatch
from . import _validate as V
from .reference import Gather

GeneratorArg = Union[None, torch.Generator, Sequence[torch.Generator]]


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


def draw_noise(shape, generator: GeneratorArg, device: torch.device) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` (SPEC, Noise). A list of B generators draws row i
    from generator i with shape (1, *shape[1:]), so a sample's noise does not depend on its batch."""
    shape = tuple(shape)
    if isinstance(generator, (list, tuple)):
        rows = [torch.randn((1,) + shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return torch.cat([r.to(device) for r in rows], dim=0)
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)


def _common(sample, model_output, sigmas, step_index, mode, noise_level):
    V.check_sample(sample)
    V.check_batch_tensor("model_output", model_output, sample)
    V.check_choice("mode", mode, V.MODES)
    eta = V.check_noise_level(noise_level, mode)
    sigmas = V.check_sigmas(sigmas, sample.device)
    idx = V.check_step_index(step_index, sigmas.numel() - 1, sample.shape[0], sample.device)
    return sigmas, idx, eta


def _storage_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else tensors[0].dtype


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
) -> SDEStepOutput:
    """Sample x' ~ N(mu, std^2) for one step of ``mode`` and return it with its log-prob.

    ``sigmas`` is the float32 schedule (length T + 1); ``step_index`` an int or an integer tensor
    [B]. ``noise`` (x's shape) is used as eps when given, else eps is drawn from ``generator``.
    ``noise_seed`` (instead of ``noise`` / ``generator``) draws eps from Philox4x32-10 inside the
    kernel, keyed by (seed, sample, element index): an int in [0, 2**63) (sample b on stream b) or an
    integer tensor [B] of per-sample seeds (a sample's noise then depends on its seed only); see
    docs/kernels.md. The log-prob is of ``prev_sample`` as emitted in ``out_dtype`` (default:
    model_output's dtype).
    """
    return _sde_step(
        sample, model_output, sigmas, step_index, mode=mode, noise_level=noise_level, noise=noise,
        generator=generator, log_prob=log_prob, reduction=reduction, out_dtype=out_dtype, backend=backend,
        return_prev_sample_mean=return_prev_sample_mean, noise_seed=noise_seed,
    )


def _sde_step(
    sample, model_output, sigmas, step_index, *, mode, noise_level, noise, generator, log_prob, reduction,
    out_dtype, backend, return_prev_sample_mean, noise_seed=None, numel: Optional[int] = None,
    gather: Gather = None, noise_fn=draw_noise, elem_offset: int = 0,
) -> SDEStepOutput:
    """``elem_offset`` (sequence parallelism): index of this shard's first element in the flattened
    sample, so ``noise_seed`` noise is the shard's slice of the single-device noise."""
    sigmas, idx, eta = _common(sample, model_output, sigmas, step_index, mode, noise_level)
    V.check_choice("log_prob", log_prob, V.LOG_PROB_KINDS)
    V.check_choice("reduction", reduction, V.REDUCTIONS)
    out_dtype = V.check_out_dtype(out_dtype, model_output.dtype)
    seed = None
    if noise_seed is not None:
        if noise is not None or generator is not None:
            raise ValueError("pass noise_seed alone: it replaces noise and generator (got noise_seed with "
                             f"{'noise' if noise is not None else 'generator'})")
        seed = V.check_noise_seed(noise_seed, sample)._replace(elem_offset=elem_offset)
    elif noise is not None:
        if generator is not None:
            raise ValueError("pass either noise or generator, not both")
        V.check_batch_tensor("noise", noise, sample)
    else:
        generator = V.check_generator(generator, sample.shape[0])
        if mode != "ode" and eta != 0:  # a step deterministic by its arguments draws no noise
            noise = noise_fn(sample.shape, generator, sample.device)
    stored = (sample, model_output) if noise is None else (sample, model_output, noise)
    name = _dispatch.resolve(backend, sample.device, _storage_dtype(*stored))
    if name == "triton" and out_dtype == torch.float64:
        raise TypeError("out_dtype=float64 runs on backend='torch' only")
    prev, lp, mean, std = _dispatch.module(name).sde_step(
        sample, model_output, sigmas, idx, noise, mode=mode, noise_level=eta, log_prob=log_prob,
        reduction=reduction, out_dtype=out_dtype, return_mean=return_prev_sample_mean, numel=numel, gather=gather,
        noise_seed=seed,
    )
    return SDEStepOutput(prev, lp, mean, std)


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
) -> torch.Tensor:
    """Log-prob [B] of the stored ``prev_sample`` under the current ``model_output``; differentiable
    with respect to ``model_output``, ``sample`` and ``prev_sample``. On the same backend and inputs it
    reproduces ``sde_step``'s log-prob bit for bit."""
    return _step_log_prob(
        sample, model_output, prev_sample, sigmas, step_index, mode=mode, noise_level=noise_level,
        log_prob=log_prob, reduction=reduction, backend=backend,
    )


def _step_log_prob(
    sample, model_output, prev_sample, sigmas, step_index, *, mode, noise_level, log_prob, reduction, backend,
    numel: Optional[int] = None, gather: Gather = None,
) -> torch.Tensor:
    sigmas, idx, eta = _common(sample, model_output, sigmas, step_index, mode, noise_level)
    V.check_batch_tensor("prev_sample", prev_sample, sample)
    V.check_choice("log_prob", log_prob, V.LOG_PROB_KINDS)
    V.check_choice("reduction", reduction, V.REDUCTIONS)
    name = _dispatch.resolve(backend, sample.device, _storage_dtype(sample, model_output, prev_sample))
    return _dispatch.module(name).step_log_prob(
        sample, model_output, prev_sample, sigmas, idx, mode=mode, noise_level=eta, log_prob=log_prob,
        reduction=reduction, numel=numel, gather=gather,
    )


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
) -> torch.Tensor:
    """Exact KL [B] between this step's transitions under ``model_output`` and ``ref_model_output``
    (same std): ``(mu - mu_ref)^2 / (2 std^2)`` reduced like the log-prob; 0 on deterministic steps."""
    return _step_kl(
        sample, model_output, ref_model_output, sigmas, step_index, mode=mode, noise_level=noise_level,
        reduction=reduction, backend=backend,
    )


def _step_kl(
    sample, model_output, ref_model_output, sigmas, step_index, *, mode, noise_level, reduction, backend,
    numel: Optional[int] = None, gather: Gather = None,
) -> torch.Tensor:
    sigmas, idx, eta = _common(sample, model_output, sigmas, step_index, mode, noise_level)
    V.check_batch_tensor("ref_model_output", ref_model_output, sample)
    V.check_choice("reduction", reduction, V.REDUCTIONS)
    name = _dispatch.resolve(backend, sample.device, _storage_dtype(sample, model_output, ref_model_output))
    return _dispatch.module(name).step_kl(
        sample, model_output, ref_model_output, sigmas, idx, mode=mode, noise_level=eta,
        reduction=reduction, numel=numel, gather=gather,
    )


__all__: List[str] = ["SDEStepOutput", "sde_step", "step_log_prob", "step_kl", "draw_noise"]
