"""Timestep -> schedule index lookup that survives bf16.

diffusers finds a timestep's index by exact float equality, so a timestep rounded to bf16 (a bf16
pipeline, a bf16 training batch) matches no entry. Here a timestep matches the schedule entries that
round to it in the timestep's own dtype: exact equality for float32 (as diffusers), within bf16/fp16
rounding otherwise. These functions take the schedule (``scheduler.timesteps``) as an argument, so they
work with any scheduler's table, diffusers' own included; ``flowrl.FlowMatchEulerDiscreteScheduler``'s
``index_for_timestep`` and ``indices_for_timesteps`` call them.
"""
from __future__ import annotations

from numbers import Real

import torch

# codes of ``resolve`` for a timestep it cannot map to one index
NO_MATCH = -1
AMBIGUOUS = -2


def _check_schedule(schedule) -> None:
    if not isinstance(schedule, torch.Tensor) or schedule.dim() != 1:
        shape = tuple(schedule.shape) if isinstance(schedule, torch.Tensor) else type(schedule).__name__
        raise TypeError(f"schedule_timesteps must be a 1-D torch.Tensor (scheduler.timesteps); got {shape}")


def resolve(timesteps: torch.Tensor, schedule: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the schedule index of each timestep; ``NO_MATCH`` (-1) where none matches,
    ``AMBIGUOUS`` (-2) where distinct entries match. Sync-free.

    Equal entries (a timestep repeated in a custom schedule) are not ambiguous: diffusers' rule picks
    the second occurrence."""
    schedule = schedule.to(timesteps.device)
    if timesteps.dtype.is_floating_point and timesteps.dtype != torch.float64:
        match = schedule.to(timesteps.dtype)[None, :] == timesteps[:, None]
    else:  # float64 and integer timesteps compare exactly, as diffusers' == does
        match = schedule.double()[None, :] == timesteps.double()[:, None]
    count = match.sum(dim=1)
    first = match.to(torch.uint8).argmax(dim=1)
    second = (match & (match.cumsum(dim=1) == 2)).to(torch.uint8).argmax(dim=1)
    first_value = schedule[first]
    ambiguous = (match & (schedule[None, :] != first_value[:, None])).any(dim=1)
    index = torch.where(count >= 2, second, first)
    index = torch.where(count == 0, torch.full_like(index, NO_MATCH), index)
    return torch.where(ambiguous, torch.full_like(index, AMBIGUOUS), index)


def explain(code: int, timestep: torch.Tensor, schedule: torch.Tensor) -> str:
    """The error message for a ``resolve`` code (``NO_MATCH`` or ``AMBIGUOUS``) of one timestep."""
    value, dtype = float(timestep), timestep.dtype
    if code == NO_MATCH:
        return (
            f"timestep {value} ({dtype}) is not in the scheduler's timesteps (no entry rounds to it in "
            f"{dtype}); pass one of scheduler.timesteps, not a loop index or a recomputed value"
        )
    schedule = schedule.to(timestep.device)
    near = schedule[schedule.to(dtype) == timestep]
    return (
        f"timestep {value} ({dtype}) is ambiguous: the schedule entries {near.tolist()} all round to it in "
        f"{dtype}. Pass the timestep in float32, or use fewer inference steps"
    )


def index_for_timestep(timestep, schedule_timesteps: torch.Tensor) -> int:
    """The index in ``schedule_timesteps`` of one timestep (a float or a one-element tensor of any float
    dtype). ``ValueError`` when no entry rounds to it, or when several distinct entries do (ambiguous)."""
    _check_schedule(schedule_timesteps)
    if isinstance(timestep, torch.Tensor):
        if timestep.numel() != 1:
            raise ValueError(
                f"timestep must hold one value; got shape {tuple(timestep.shape)} "
                "(use indices_for_timesteps for a batch)"
            )
        t = timestep.reshape(1)
    elif isinstance(timestep, Real) and not isinstance(timestep, bool):
        t = torch.tensor([float(timestep)], dtype=torch.float32)
    else:
        raise TypeError(f"timestep must be a float or a one-element tensor; got {type(timestep).__name__}")
    code = int(resolve(t, schedule_timesteps)[0])
    if code < 0:
        raise ValueError(explain(code, t[0], schedule_timesteps))
    return code


def indices_for_timesteps(timesteps: torch.Tensor, schedule_timesteps: torch.Tensor, *, strict: bool = False,
                          name: str = "timesteps") -> torch.Tensor:
    """Vectorized lookup for training batches: int64 [B] indices into ``schedule_timesteps``, on
    ``timesteps``' device, with no host sync. Entries that match no schedule entry, or several distinct
    ones, come back as -1; ``strict=True`` raises ``ValueError`` for them instead (one sync). ``name``:
    the caller's name for ``timesteps`` in the errors."""
    if not isinstance(timesteps, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D torch.Tensor; got {type(timesteps).__name__}")
    if timesteps.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B]; got shape {tuple(timesteps.shape)}")
    if timesteps.dtype == torch.bool or timesteps.dtype.is_complex:
        raise TypeError(f"{name} must be a real tensor; got {timesteps.dtype}")
    _check_schedule(schedule_timesteps)
    codes = resolve(timesteps, schedule_timesteps)
    if strict and timesteps.numel() and bool((codes < 0).any()):
        k = int((codes < 0).nonzero()[0, 0])
        raise ValueError(f"{name}[{k}]: " + explain(int(codes[k]), timesteps[k], schedule_timesteps))
    return codes.clamp(min=NO_MATCH)


__all__ = ["index_for_timestep", "indices_for_timesteps", "resolve", "explain", "NO_MATCH", "AMBIGUOUS"]
