"""``RolloutTrajectory``: what a rollout records, for training to recompute log-probs from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RolloutTrajectory:
    """A batch of recorded rollouts.

    latents: [B, K, ...] latents; ``latents[:, j]`` is the input of loop step
        ``latent_step_indices[j]`` (index T is the final output). K = T + 1 unless filtered.
    log_probs: float32 [B, T], the log-prob of each step's emitted sample (0 on ode steps).
    timesteps: [T] the scheduler's timesteps (schedule metadata: shared, never sliced per sample).
    sigmas: float32 [T + 1] snapshot of the exact schedule, post-shift, with the terminal 0.
    latent_step_indices: int64 [K], which loop steps ``latents`` holds.
    mode, noise_level, log_prob, reduction: the rollout settings, to recompute with the same ones.
    sde_steps: int64 [S] loop steps that were stochastic (the others ran as ``ode``), or None for all.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    latent_step_indices: torch.Tensor
    mode: str = "sde"
    noise_level: float = 0.7
    log_prob: str = "gaussian"
    reduction: str = "mean"
    sde_steps: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.sigmas.numel() - 1)
