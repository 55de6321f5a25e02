"""flowrl: fused sampling steps and per-step log-probabilities for RL post-training of
flow-matching diffusion models (Flow-GRPO, DanceGRPO, CPS).

The math contract is docs/contract.md. Import never needs triton or CUDA.
"""
from __future__ import annotations

import importlib

from ._validate import no_value_checks
from .contract import CHUNK_SIZE
from .functional import LogProbWithCount, SDEStepOutput, combine_streams, draw_noise, sde_step, step_kl, step_log_prob
from .step_spec import StepSpec

__version__ = "0.1.0"

# Heavier parts load on first use, so `import flowrl` stays light.
_LAZY = {
    "FlowMatchEulerDiscreteScheduler": ("flowrl.scheduler", "FlowMatchEulerDiscreteScheduler"),
    "DDIMScheduler": ("flowrl.ddim", "DDIMScheduler"),  # needs diffusers (its base class)
    "ddim": ("flowrl.ddim", None),
    "RolloutRecorder": ("flowrl.recorder", "RolloutRecorder"),
    "recorder": ("flowrl.recorder", None),
    "RolloutTrajectory": ("flowrl.trajectory", "RolloutTrajectory"),
    "serialization": ("flowrl.serialization", None),
    "distributed": ("flowrl.distributed", None),
    "reference": ("flowrl.reference", None),
    "losses": ("flowrl.losses", None),
    "step_weights": ("flowrl.weights", "step_weights"),
    "StepWeights": ("flowrl.weights", "StepWeights"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


def available_backends():
    """Backends that can run here: always "torch"; "triton" when triton imports."""
    from ._dispatch import triton_available

    return ["torch"] + (["triton"] if triton_available() else [])


__all__ = [
    "SDEStepOutput", "LogProbWithCount", "combine_streams", "sde_step", "step_log_prob", "step_kl", "draw_noise", "CHUNK_SIZE", "StepSpec",
    "no_value_checks",
    "FlowMatchEulerDiscreteScheduler", "DDIMScheduler", "RolloutRecorder", "RolloutTrajectory", "available_backends",
    "step_weights", "StepWeights",
]
