"""What ``FlowMatchEulerDiscreteScheduler.step`` takes and returns, shared by flowrl's scheduler copy
(``scheduler``) and the rollout recorder (``recorder``), which records a step of diffusers' scheduler
or of flowrl's. Both import it from here, so the recorder does not import the scheduler module (which
imports the recorder for ``rollout()``). ``flowrl.rollout.scheduler`` re-exports these names."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Optional, Union

import torch

from ..ops.functional import GeneratorArg


@dataclass
class FlowMatchEulerDiscreteSchedulerOutput:
    """``step``'s result. ``prev_sample`` as in diffusers; inside a rollout also the step's ``log_prob``
    (float32 [B]), ``prev_sample_mean`` (float32, the sample's shape) and ``std_dev`` (float32 [B]).

    Indexes like diffusers' ``BaseOutput``: ``out[0]`` is ``prev_sample``, ``out["log_prob"]`` a field;
    ``to_tuple()`` holds the fields that are set."""

    prev_sample: torch.Tensor
    log_prob: Optional[torch.Tensor] = None
    prev_sample_mean: Optional[torch.Tensor] = None
    std_dev: Optional[torch.Tensor] = None

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]


def check_step_timestep(timestep) -> None:
    """``step``'s timestep must be a schedule value, not a loop index (diffusers raises the same)."""
    if isinstance(timestep, (bool, Integral)) or (
        isinstance(timestep, torch.Tensor) and not timestep.dtype.is_floating_point
    ):
        raise ValueError(
            "timestep must be one of scheduler.timesteps (a float), not an integer index such as one "
            "from enumerate(timesteps)"
        )


def _step_arguments(
    model_output: torch.Tensor,
    timestep: Union[float, torch.Tensor],
    sample: torch.Tensor,
    s_churn: float = 0.0,
    s_tmin: float = 0.0,
    s_tmax: float = float("inf"),
    s_noise: float = 1.0,
    generator: GeneratorArg = None,
    per_token_timesteps: Optional[torch.Tensor] = None,
    return_dict: bool = True,
):
    """The arguments of ``FlowMatchEulerDiscreteScheduler.step`` after ``self``: diffusers' and flowrl's
    copy (tests/rollout/test_recorder.py checks that this is flowrl's ``step`` signature)."""


# What a recording step binds its arguments to (the recorder runs in step's place).
STEP_SIGNATURE = inspect.signature(_step_arguments)

__all__ = ["FlowMatchEulerDiscreteSchedulerOutput", "check_step_timestep", "STEP_SIGNATURE"]
