"""Drop-in adapters for trainers written against a peer's step function, on flowrl's ops.

Swap one import and keep the call sites:

    from flowrl.compat.flow_grpo import sde_step_with_logprob        # Flow-GRPO
    from flowrl.compat.dance_grpo import flux_step                   # DanceGRPO
    python -m flowrl.compat.flow_factory config.yaml                 # Flow-Factory (registers the scheduler)
    from flowrl.compat.verl_omni import FlowMatchSDEDiscreteScheduler  # verl-omni (and register() for its losses)
    import flowrl.compat.sglang; flowrl.compat.sglang.register()     # SGLang's rollout engine (in the server)

Each adapter keeps its peer's signature and returns; where flowrl deliberately differs (the log-prob
of the emitted, rounded sample; log-prob 0 on deterministic steps; the table's sigmas; the bf16-safe
timestep lookup) its module docstring says so, and docs/integration.md shows the measured effect.
"""
from __future__ import annotations

import importlib

# Imported on first use (PEP 562), so ``python -m flowrl.compat.flow_factory`` runs that module once
_LAZY = {"sde_step_with_logprob": "flow_grpo", "flux_step": "dance_grpo",
         "FlowMatchEulerDiscreteSDEScheduler": "flow_factory"}

__all__ = ["sde_step_with_logprob", "flux_step", "FlowMatchEulerDiscreteSDEScheduler"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
