"""flowrl: fused sampling steps and per-step log-probabilities for RL post-training of
flow-matching diffusion models (Flow-GRPO, DanceGRPO, CPS).

The math contract is docs/contract.md. Import never needs triton or CUDA.
"""
from __future__ import annotations

import importlib

from .core._validate import checks, no_value_checks
from .contract import CHUNK_SIZE
from .ops.functional import LogProbWithCount, SDEStepOutput, combine_streams, draw_noise, sde_step, step_kl, step_log_prob
from .core.step_spec import StepSpec
from .backends import _dispatch as _backend_dispatch

__version__ = "0.1.0"

# Heavier parts load on first use, so `import flowrl` stays light.
_LAZY = {
    "FlowMatchEulerDiscreteScheduler": ("flowrl.rollout.scheduler", "FlowMatchEulerDiscreteScheduler"),
    "DDIMScheduler": ("flowrl.rollout.ddim", "DDIMScheduler"),  # needs diffusers (its base class)
    "ddim": ("flowrl.rollout.ddim", None),
    "RolloutRecorder": ("flowrl.rollout.recorder", "RolloutRecorder"),
    "recorder": ("flowrl.rollout.recorder", None),
    "RolloutTrajectory": ("flowrl.data.trajectory", "RolloutTrajectory"),
    "shard_trajectory": ("flowrl.data.trajectory_shard", "shard_trajectory"),
    "serialization": ("flowrl.data.serialization", None),
    "distributed": ("flowrl.distributed", None),
    "reference": ("flowrl.backends.reference", None),
    "losses": ("flowrl.losses", None),
    "advantages": ("flowrl.advantages", None),
    "consistency": ("flowrl.consistency", None),
    "compat": ("flowrl.compat", None),
    "kernels": ("flowrl.kernels", None),  # the package imports no triton; its kernel modules do
    "step_weights": ("flowrl.ops.weights", "step_weights"),
    "StepWeights": ("flowrl.ops.weights", "StepWeights"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


def available_backends():
    """Backends that can run here: always "torch"; "triton" when triton imports."""
    return ["torch"] + (["triton"] if _backend_dispatch.triton_available() else [])


__all__ = [
    "SDEStepOutput", "LogProbWithCount", "combine_streams", "sde_step", "step_log_prob", "step_kl", "draw_noise", "CHUNK_SIZE", "StepSpec",
    "no_value_checks", "checks",
    "FlowMatchEulerDiscreteScheduler", "DDIMScheduler", "RolloutRecorder", "RolloutTrajectory", "available_backends",
    "step_weights", "StepWeights",
]
