"""What a rollout accepts before it records: the scheduler classes it drives and the check of a scheduler
instance (``check_scheduler``), dpm_sde's solver order and the step-index sets (``sde_steps``, ``keep``).
``flowrl.rollout.recorder`` re-exports every name.
"""
from __future__ import annotations

from numbers import Integral
from typing import Iterable, List, Optional

import torch

from ..contract import Mode, Schedule

try:  # optional: flowrl's copy runs without diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler as _DiffusersFlowMatchEulerDiscreteScheduler
except ImportError:
    _DiffusersFlowMatchEulerDiscreteScheduler = None

# The scheduler classes a rollout drives (with their subclasses): diffusers' FlowMatchEulerDiscreteScheduler
# when diffusers is installed, and flowrl's copy, which flowrl.rollout.scheduler registers when it is
# imported (so before any instance of it exists). This module does not import flowrl.rollout.scheduler:
# that module imports this one for its rollout().
_SCHEDULER_CLASSES: List[type] = [c for c in (_DiffusersFlowMatchEulerDiscreteScheduler,) if c is not None]


def register_scheduler_class(cls: type) -> type:
    """Let a rollout drive instances of ``cls`` (and its subclasses): a class with the Euler step and
    the attributes of diffusers' ``FlowMatchEulerDiscreteScheduler`` (flowrl's copy registers itself)."""
    if not isinstance(cls, type):
        raise TypeError(f"register_scheduler_class takes a class; got {type(cls).__name__}")
    if cls not in _SCHEDULER_CLASSES:
        _SCHEDULER_CLASSES.append(cls)
    return cls


def check_scheduler(scheduler, mode: Optional[str] = None, noise_level: Optional[float] = None,
                    sde_steps=None) -> None:
    """Raise ``TypeError`` / ``ValueError`` (naming ``scheduler``) unless a rollout can drive this
    scheduler: a ``FlowMatchEulerDiscreteScheduler`` instance (diffusers', flowrl's or a subclass) whose
    plain step is the Euler step on a decreasing sigma table, or, with ``stochastic_sampling=True``,
    the step x' = (1 - sigma') x0_hat + sigma' eps, which is cps at noise_level 1: then the rollout's
    ``mode``, ``noise_level`` and ``sde_steps`` must be that process (docs/contract.md, Variants)."""
    if isinstance(scheduler, type):
        raise TypeError(f"scheduler must be a scheduler instance, not the class {scheduler.__name__}")
    if not isinstance(scheduler, tuple(_SCHEDULER_CLASSES)):
        raise TypeError(
            f"scheduler must be a FlowMatchEulerDiscreteScheduler (diffusers', flowrl's or a subclass); got "
            f"{type(scheduler).__name__}. A rollout replaces the Euler step x + (sigma' - sigma) v of that "
            "scheduler; other schedulers (Heun, LCM, multistep, DDIM) step differently"
        )
    if mode is not None and Mode.parse("mode", mode).rules.schedule is not Schedule.SIGMAS:
        raise ValueError("mode='ddim' steps an alpha-bar (DDPM) schedule, not this scheduler's sigma table: record it "
                         "with flowrl.DDIMScheduler(...).rollout() (or flowrl.rollout.ddim.DDIMRolloutRecorder)")
    config = scheduler.config
    if config.get("stochastic_sampling", False) and (mode != "cps" or noise_level != 1 or sde_steps is not None):
        raise ValueError(
            "scheduler has config.stochastic_sampling=True: its step x' = (1 - sigma') x0_hat + sigma' eps is "
            "cps at noise_level 1 on every step, so record it with mode='cps', noise_level=1.0 and sde_steps=None "
            f"(got mode={mode!r}, noise_level={noise_level!r}, sde_steps={sde_steps!r}), or use "
            "type(scheduler).from_config(scheduler.config, stochastic_sampling=False)"
        )
    if config.get("invert_sigmas", False):
        raise ValueError(
            "scheduler has config.invert_sigmas=True (Mochi): rollout needs a decreasing schedule ending at 0"
        )
    if getattr(scheduler, "order", 1) != 1:
        raise ValueError(f"scheduler has order {scheduler.order}; a rollout records one step per model call (order 1)")
    missing = [a for a in ("sigmas", "timesteps", "_step_index", "_begin_index") if not hasattr(scheduler, a)]
    if missing or not hasattr(scheduler, "__dict__"):
        raise TypeError(
            f"scheduler ({type(scheduler).__name__}) lacks {missing or '__dict__'}, which a rollout reads and "
            "sets as diffusers' FlowMatchEulerDiscreteScheduler has them"
        )


def _solver_order(mode: str, solver_order) -> Optional[int]:
    """dpm_sde's solver order (1 or 2; default 2, diffusers' DPM solvers' default); None for other modes."""
    if Mode.parse("mode", mode).rules.order == 1:
        if solver_order is not None:
            raise ValueError(f"solver_order is mode='dpm_sde''s; got it with mode={mode!r}")
        return None
    if solver_order is None:
        return 2
    if isinstance(solver_order, bool) or solver_order not in (1, 2):
        raise ValueError(f"solver_order must be 1 or 2 for mode='dpm_sde'; got {solver_order!r}")
    return int(solver_order)


def _index_set(name: str, values, upper: Optional[int] = None) -> Optional[List[int]]:
    """None, or sorted unique ints from an iterable of ints / an integer tensor."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.dim() > 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or an iterable of ints; got {values.dtype} "
                            f"{tuple(values.shape)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of ints or None; got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must hold ints; got {v!r}")
        if v < 0 or (upper is not None and v > upper):
            raise ValueError(f"{name} entries must be in [0, {upper}]; got {int(v)}")
        out.append(int(v))
    return sorted(set(out))
