"""Drop-in adapters for trainers written against a peer's step function, on flowrl's ops.

Swap one import and keep the call sites:

    from flowrl.compat.flow_grpo import sde_step_with_logprob        # Flow-GRPO
    from flowrl.compat.dance_grpo import flux_step                   # DanceGRPO
    from flowrl.compat.flow_factory import FlowMatchEulerDiscreteSDEScheduler   # Flow-Factory

Each adapter keeps its peer's signature and returns; where flowrl deliberately differs (the log-prob
of the emitted, rounded sample; log-prob 0 on deterministic steps; the table's sigmas; the bf16-safe
timestep lookup) its module docstring says so, and docs/integration.md shows the measured effect.
"""
from __future__ import annotations

from .dance_grpo import flux_step
from .flow_factory import FlowMatchEulerDiscreteSDEScheduler
from .flow_grpo import sde_step_with_logprob

__all__ = ["sde_step_with_logprob", "flux_step", "FlowMatchEulerDiscreteSDEScheduler"]
