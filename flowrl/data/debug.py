"""Debug tensors of a rollout (opt-in, as SGLang's ``rollout_debug_mode``): per step the transition's
mean, its std, the noise drawn and the model output, to compare two implementations step by step.

``scheduler.rollout(..., debug=True)`` keeps them in memory (``traj.debug_tensors``);
``debug="run.safetensors"`` also writes them to that file when the rollout ends. Names follow SGLang's
``rollout_debug_tensors``: ``rollout_prev_sample_means`` float32 [B, T, ...], ``rollout_noise_std_devs``
float32 [B, T], ``rollout_variance_noises`` float32 [B, T, ...] (zeros on steps that drew none),
``rollout_model_outputs`` [B, T, ...] in the model output's dtype.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch

from ..core import _validate as V
from ..core.step_spec import draw_noise
from .serialization import load_safetensors, save_safetensors

NAMES = ("rollout_prev_sample_means", "rollout_noise_std_devs", "rollout_variance_noises", "rollout_model_outputs")
FORMAT = "flowrl.DebugTensors/1"


@dataclass
class DebugTensors:
    """Per-step debug tensors of a batch rollout (see the module doc for the fields)."""

    rollout_prev_sample_means: torch.Tensor
    rollout_noise_std_devs: torch.Tensor
    rollout_variance_noises: torch.Tensor
    rollout_model_outputs: torch.Tensor

    def as_dict(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in NAMES}

    def save(self, path) -> None:
        save_safetensors(path, self.as_dict(), {"format": FORMAT})

    @classmethod
    def load(cls, path) -> "DebugTensors":
        tensors, metadata = load_safetensors(path)
        if metadata.get("format") != FORMAT or set(tensors) != set(NAMES):
            raise ValueError(f"{os.fspath(path)}: not a flowrl debug-tensor file (format {metadata.get('format')!r}, "
                             f"tensors {sorted(tensors)}; expected {sorted(NAMES)})")
        return cls(**tensors)

    def compare(self, other: "DebugTensors") -> List[Dict[str, float]]:
        """Per step, the largest absolute difference of each field against ``other`` (same shapes),
        in float64: where two implementations first diverge."""
        if not isinstance(other, DebugTensors):
            raise TypeError(f"other must be DebugTensors; got {type(other).__name__}")
        rows = []
        steps = self.rollout_noise_std_devs.shape[1]
        for name in NAMES:
            a, b = getattr(self, name), getattr(other, name)
            if a.shape != b.shape:
                raise ValueError(f"{name}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
        for j in range(steps):
            rows.append({name: float((getattr(self, name)[:, j].double() - getattr(other, name)[:, j].double().to(
                getattr(self, name).device)).abs().max()) for name in NAMES})
        return rows


class DebugTensorRecorder:
    """Collects a rollout's debug tensors step by step (used by ``RolloutRecorder``)."""

    def __init__(self, target: Union[bool, str, "os.PathLike[str]"], host=None):
        if target is True:
            self.path = None
        elif isinstance(target, (str, os.PathLike)):
            self.path = target
        else:
            raise TypeError(f"debug must be None, False, True or a file path; got {target!r}")
        self.host = host  # the rollout's flowrl.data.trajectory_store.StepStore (store='cpu': host copies per step)
        self._rows: List[Dict[str, torch.Tensor]] = []

    @staticmethod
    def draw(sample: torch.Tensor, generator) -> torch.Tensor:
        """The noise ``sde_step`` would draw from ``generator`` (same call, same bits)."""
        generator = V.check_generator(generator, sample.shape[0])
        return draw_noise(sample.shape, generator, sample.device)

    def record(self, out, noise: Optional[torch.Tensor], model_output: torch.Tensor, sample: torch.Tensor) -> None:
        mean = out.prev_sample_mean
        self._rows.append({
            "rollout_prev_sample_means": mean.detach().float(),
            "rollout_noise_std_devs": out.std_dev.detach().float(),
            "rollout_variance_noises": (noise.detach().float() if noise is not None
                                        else torch.zeros(sample.shape, dtype=torch.float32, device=sample.device)),
            "rollout_model_outputs": model_output.detach().clone(),
        })
        if self.host is not None and self.host.on_host:
            self._rows[-1] = {name: self.host.keep(t) for name, t in self._rows[-1].items()}

    def finish(self) -> DebugTensors:
        debug = DebugTensors(**{name: torch.stack([row[name] for row in self._rows], dim=1) for name in NAMES})
        if self.path is not None:
            debug.save(self.path)
        return debug


__all__ = ["DebugTensors", "DebugTensorRecorder", "NAMES"]
