"""Checks and helpers shared by the peer adapters of ``flowrl.compat``.

The adapters keep their peer's argument names (``latents``, ``noise_pred``, ``eta``, ``index``), so
they check their arguments here, under those names, before handing the tensors to flowrl's public ops
(whose own errors say ``sample``, ``model_output``, ``step_index``).
"""
from __future__ import annotations

import weakref
from numbers import Real
from typing import Optional, Sequence, Tuple

import torch

from ..core import _validate as V
from ..rollout import timestep_lookup
from ..ops.functional import draw_noise, sde_step
from ..backends import reference

_DEVICE_COPIES: dict = {}  # (id(src), version, device) -> (weakref to src, copy on device)


def check_tensor(name: str, t, like: Optional[torch.Tensor] = None, like_name: str = "") -> torch.Tensor:
    """A float tensor [B, ...]; with ``like``: of ``like``'s shape and device (flowrl's checks, under
    the peer's names)."""
    if like is None:
        return V.check_sample(t, name)
    return V.check_batch_tensor(name, t, like, like_name)


def check_noise_level(name: str, value, *, at_most_one: bool = False) -> float:
    """A finite real >= 0 (<= 1 when ``at_most_one``: cps), as a float."""
    return V.check_noise_level(value, "cps" if at_most_one else "sde", name=name)


def check_out_dtype(out_dtype) -> Optional[torch.dtype]:
    """None (the adapter's default) or a float dtype."""
    return V.check_out_dtype(out_dtype, None)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, the same copy for every call while ``t`` is unchanged: flowrl's schedule
    check is cached per tensor, so a table moved once is checked once (no host sync per step)."""
    if t.device == device:
        return t
    key = (id(t), t._version, str(device))
    hit = _DEVICE_COPIES.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    if len(_DEVICE_COPIES) > 64:
        _DEVICE_COPIES.clear()
    copy = t.to(device)
    _DEVICE_COPIES[key] = (weakref.ref(t), copy)
    return copy


def scheduler_tables(scheduler, name: str = "self") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas, timesteps)`` of a FlowMatchEulerDiscreteScheduler-like object (diffusers' or flowrl's)."""
    sigmas, timesteps = getattr(scheduler, "sigmas", None), getattr(scheduler, "timesteps", None)
    if not isinstance(sigmas, torch.Tensor) or not isinstance(timesteps, torch.Tensor):
        raise TypeError(
            f"{name} must be a FlowMatchEulerDiscreteScheduler (diffusers' or flowrl's) with tensors `sigmas` and "
            f"`timesteps` (call set_timesteps first); got {type(scheduler).__name__}"
        )
    if timesteps.dim() != 1 or sigmas.dim() != 1 or sigmas.numel() != timesteps.numel() + 1:
        raise ValueError(
            f"{name}.sigmas must be 1-D with one entry more than {name}.timesteps (the terminal sigma); got "
            f"shapes {tuple(sigmas.shape)} and {tuple(timesteps.shape)}"
        )
    return sigmas, timesteps


def timestep_tensor(name: str, timestep) -> torch.Tensor:
    """A float, a list of floats, or a tensor of any real dtype -> a 1-D tensor (its own dtype)."""
    if isinstance(timestep, torch.Tensor):
        if timestep.dtype == torch.bool or timestep.dtype.is_complex:
            raise TypeError(f"{name} must be a real tensor; got {timestep.dtype}")
        if timestep.dim() > 1:
            raise ValueError(f"{name} must be a scalar or a 1-D tensor [B]; got shape {tuple(timestep.shape)}")
        return timestep.reshape(-1)
    if isinstance(timestep, Real) and not isinstance(timestep, bool):
        return torch.tensor([float(timestep)], dtype=torch.float32)
    if isinstance(timestep, (list, tuple)) and timestep and all(
        isinstance(t, Real) and not isinstance(t, bool) for t in timestep
    ):
        return torch.tensor([float(t) for t in timestep], dtype=torch.float32)
    if isinstance(timestep, (list, tuple)) and timestep and all(
        isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype.is_floating_point for t in timestep
    ):  # a list of one-element tensors, e.g. list(scheduler.timesteps[idx])
        return torch.stack([t.reshape(()) for t in timestep])
    raise TypeError(f"{name} must be a float, a list of floats or a tensor; got {type(timestep).__name__}")


def resolve_timesteps(name: str, timestep, schedule: torch.Tensor, batch: int, device) -> Tuple[torch.Tensor, int]:
    """int64 [B] schedule indices of ``timestep`` (1 or B values) by flowrl's bf16-safe lookup, on
    ``device``, and how many values were given. ``ValueError`` naming ``name`` for a value that is
    in no entry's rounding, or in several distinct entries' (one host sync)."""
    t = timestep_tensor(name, timestep)
    if t.numel() not in (1, batch):
        raise ValueError(f"{name} must hold 1 or B = {batch} timesteps; got {t.numel()}")
    codes = timestep_lookup.indices_for_timesteps(t, schedule, strict=True, name=name)
    n = t.numel()
    idx = codes.to(device)
    return (idx.expand(batch).contiguous() if n == 1 and batch > 1 else idx), n


def check_index(name: str, index, num_steps: int, batch: int, device) -> torch.Tensor:
    """An int, or an integer tensor (0-d, [1] or [B]), in [0, num_steps - 1] -> int64 [B] on ``device``
    (flowrl's step-index check, under the peer's name)."""
    if isinstance(index, torch.Tensor) and index.dim() == 1 and index.shape[0] == 1:
        index = index.reshape(())
    return V.check_step_index(index, num_steps, batch, device, name=name)


def generator_arg(generator, batch: int):
    """diffusers' ``randn_tensor`` rule: a list of one generator is that generator."""
    if isinstance(generator, (list, tuple)) and len(generator) == 1:
        generator = generator[0]
    return V.check_generator(generator, batch)


def draw(like: torch.Tensor, generator) -> torch.Tensor:
    """float32 standard normal noise of ``like``'s shape, from the same stream as diffusers'
    ``randn_tensor(shape, generator, device, dtype=float32)`` (and ``torch.randn_like`` of a float32
    tensor when ``generator`` is None)."""
    return draw_noise(like.shape, generator_arg(generator, like.shape[0]), like.device)


def column(values: torch.Tensor, ndim: int) -> torch.Tensor:
    """[n] -> [n, 1, ..., 1] with ``ndim`` dims (broadcasts against a [B, ...] sample)."""
    return values.reshape(-1, *([1] * (ndim - 1)))


def sde_per_unit_time_std(sigmas: torch.Tensor, idx: torch.Tensor, eta: float) -> torch.Tensor:
    """Flow-GRPO's ``std_dev_t`` of the ``sde`` mode, float32 [n]: ``s = eta * sqrt(sigma / (1 - sigma_t))``
    (per unit time; the step's std is ``s * sqrt(D)``), with the contract's ``sigma_t`` rule."""
    table = sigmas.to(torch.float32)
    return reference.sde_noise_scale(table, table[idx], eta)


def cps_std(sigma_next: torch.Tensor, eta: float) -> torch.Tensor:
    """cps' step std (float32), as flowrl's backends compute it."""
    return reference.cps_std(sigma_next.to(torch.float32), eta, torch.float32)


def step_mean(sample, model_output, sigmas, idx, mode: str, eta: float, backend: str) -> torch.Tensor:
    """The transition mean ``mu`` (float32, ``sample``'s shape), differentiable in ``model_output`` and
    ``sample``, from ``flowrl.sde_step`` with zero noise on the same backend as the log-prob."""
    noise = None if mode == "ode" else torch.zeros(sample.shape, dtype=torch.float32, device=sample.device)
    out = sde_step(sample, model_output, sigmas, idx, mode=mode, noise_level=eta, noise=noise,
                   log_prob_kind="kernel", out_dtype=torch.float32, backend=backend)
    return out.prev_sample_mean


def emit(sample, model_output, sigmas, idx, *, mode, eta, noise, kind, out_dtype, peer_compatible, backend):
    """One rollout step through ``flowrl.sde_step``: ``(prev_sample in out_dtype, log_prob, mean, std)``.

    Default: the log-prob is of the returned sample, rounded to ``out_dtype`` (flowrl's rule).
    ``peer_compatible``: the step is taken in float32 and the log-prob is of that float32 sample (what
    the peers record); the returned sample is then rounded to ``out_dtype``."""
    if peer_compatible:
        out = sde_step(sample, model_output, sigmas, idx, mode=mode, noise_level=eta, noise=noise, log_prob_kind=kind,
                       out_dtype=torch.float32, backend=backend)
        return out.prev_sample.to(out_dtype), out.log_prob, out.prev_sample_mean, out.std_dev
    out = sde_step(sample, model_output, sigmas, idx, mode=mode, noise_level=eta, noise=noise, log_prob_kind=kind,
                   out_dtype=out_dtype, backend=backend)
    return out.prev_sample, out.log_prob, out.prev_sample_mean, out.std_dev


def promote(*dtypes: Sequence[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out
