"""Replay under sequence parallelism: a recorded trajectory cut to one rank's shard.

``flowrl.shard_trajectory(traj, start, stop, dim=1)`` keeps, of every sample, the elements
``start:stop`` of the sample's dim ``dim`` (dim 0 is the batch): ``[B, S, C]`` tokens split on S are
``dim=1``. That is ``flowrl.distributed``'s layout (a contiguous range of each sample's flattened
elements, ranks in order) when the sample's dims between the batch and ``dim`` have size 1, which is
checked; the shard's ``offset`` and ``numel`` are the ``ShardContext`` values of that range.

The shard holds the rank's slices of the latents, per-token sigmas, the frozen mask and dpm_sde's
previous x0; the schedule, the settings, the log-probs (full-sample values, the same on every
rank) and the per-sample SDE mask (``sde_mask``: per sample, not per element) are the trajectory's.
On a step where the mask makes some samples stochastic and others ode, ``shard.step_log_prob`` runs
the two groups as two collectives, stochastic first, on every rank alike. ``shard.step_inputs(j)`` gives this rank's inputs of
``flowrl.distributed.step_log_prob``, and ``shard.step_log_prob(j, v_shard, group=...)`` calls it:
with every rank's shard boundary on a chunk boundary (``CHUNK_SIZE`` elements; docs/wire_and_sp.md)
the result is the single-device log-prob bit for bit (the per-token gaussian log term: to float32
rounding, as for the step ops). The replay environment's model inputs are the recorded whole-sample
calls (a sequence-parallel model splits them itself); ``shard.step_model_output(j, raw)`` turns the
whole-sample output(s) into the velocity and keeps this rank's slice.

A shard is a view for recompute: ``to_wire`` / ``save`` refuse it (save the whole trajectory), and a
joint rollout (``streams``, LTX-2's audio) is refused: its streams have shapes of their own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Optional

import torch

from ..ops import distributed
from .denoising_env import DenoisingEnv
from .trajectory import RolloutTrajectory


class ShardedDenoisingEnv(DenoisingEnv):
    """A replay environment whose ``step_model_output`` keeps one rank's slice of the velocity."""

    def __init__(self, env: DenoisingEnv, dim: int, start: int, stop: int):
        super().__init__(env.steps, env.module_name)
        self.dim, self.start, self.stop = dim, start, stop

    def step_model_output(self, j: int, raw_output: Any) -> torch.Tensor:
        """The velocity of step ``j`` from the whole-sample call output(s), cut to this rank's shard."""
        v = super().step_model_output(j, raw_output)
        return v.narrow(self.dim, self.start, self.stop - self.start)


@dataclass
class ShardedRolloutTrajectory(RolloutTrajectory):
    """One rank's shard of a ``RolloutTrajectory`` (``shard_trajectory(traj, start, stop, dim)``): ``shard_dim``,
    ``shard_start``, ``shard_stop`` on the sample's dims; ``full_shape``: one whole sample's shape."""

    shard_dim: int = 1
    shard_start: int = 0
    shard_stop: int = 0
    full_shape: tuple = ()

    @property
    def numel(self) -> int:
        """Elements per whole sample (``ShardContext.numel``)."""
        return math.prod(self.full_shape)

    @property
    def offset(self) -> int:
        """Where this shard starts in the flattened sample (``ShardContext.offset``)."""
        return self.shard_start * math.prod(self.full_shape[self.shard_dim:])

    @property
    def shard_numel(self) -> int:
        return (self.shard_stop - self.shard_start) * math.prod(self.full_shape[self.shard_dim:])

    def step_log_prob(self, j, model_output, *, group=None, shard_numels=None, **kwargs) -> torch.Tensor:
        """``flowrl.distributed.step_log_prob(model_output=model_output, **self.step_inputs(j, device=
        model_output.device), group=group, shard_numels=shard_numels, **kwargs)``: this rank's part of
        the recompute, a collective over ``group`` (every rank calls it); the full-sample [B] log-prob."""
        if not isinstance(model_output, torch.Tensor):
            raise TypeError(f"model_output must be this rank's velocity shard (a tensor); got {type(model_output).__name__}")
        split = self._mode_split(j)
        if split is not None:  # per-sample windows (sde_mask, the same on every rank): two collectives, in this order
            return self._split_step_log_prob(split, j, model_output, lambda rows, jj, part: rows.step_log_prob(
                jj, part, group=group, shard_numels=shard_numels, **kwargs))
        inputs = self.step_inputs(j, device=model_output.device)
        return distributed.step_log_prob(model_output=model_output, **{**inputs, **kwargs}, group=group,
                                         shard_numels=shard_numels)

    def to_wire(self):
        raise ValueError("a trajectory shard is a view for recompute; serialize the whole trajectory")

    def save(self, path) -> None:
        raise ValueError("a trajectory shard is a view for recompute; save the whole trajectory")

def _cut(t: Optional[torch.Tensor], axis: int, start: int, stop: int) -> Optional[torch.Tensor]:
    """``t`` sliced on ``axis`` unless it is broadcast there (size 1)."""
    if t is None or t.shape[axis] == 1:
        return t
    return t.narrow(axis, start, stop - start)


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    return int(value)


def shard_trajectory(traj: RolloutTrajectory, start: int, stop: int, *, dim: int = 1) -> ShardedRolloutTrajectory:
    """This rank's shard of ``traj``: elements ``start:stop`` of every sample's dim ``dim`` (see the
    module doc). ``ValueError`` / ``TypeError`` name the argument that cannot make one."""
    if not isinstance(traj, RolloutTrajectory):
        raise TypeError(f"traj must be a RolloutTrajectory; got {type(traj).__name__}")
    if isinstance(traj, ShardedRolloutTrajectory):
        raise ValueError("traj is already a shard; cut the whole trajectory")
    start, stop, dim = _check_int("start", start), _check_int("stop", stop), _check_int("dim", dim)
    if traj.streams is not None:
        raise ValueError("traj is a joint rollout (streams): its streams' latents have shapes of their own; "
                         "shard each stream's trajectory (traj.streams[k]) with its own range")
    full = tuple(traj.latents.shape[2:])  # one sample: latents are [B, K, ...]
    sample_ndim = 1 + len(full)
    if not 1 <= dim < sample_ndim:
        raise ValueError(f"dim must be a sample dim in [1, {sample_ndim - 1}] (0 is the batch); got {dim}")
    if any(d != 1 for d in full[:dim - 1]):
        raise ValueError(
            f"dim={dim}: a shard is a contiguous range of each sample's flattened elements "
            f"(flowrl.distributed's layout), so the sample's dims before dim {dim} must have size 1; the sample "
            f"is {[traj.batch_size, *full]}"
        )
    size = full[dim - 1]
    if not 0 <= start < stop <= size:
        raise ValueError(f"start, stop must satisfy 0 <= start < stop <= {size} (the sample's dim {dim}); "
                         f"got start={start}, stop={stop}")
    env = traj.denoising_env
    if isinstance(env, DenoisingEnv):
        env = ShardedDenoisingEnv(env, dim, start, stop)
    fields = {name: getattr(traj, name) for name in traj.__dataclass_fields__}
    fields.update(
        latents=_cut(traj.latents, dim + 1, start, stop),
        token_sigmas=_cut(traj.token_sigmas, dim + 1, start, stop),
        prev_x0_preds=_cut(traj.prev_x0_preds, dim + 1, start, stop),
        frozen=_cut(traj.frozen, dim, start, stop),
        denoising_env=env,
        debug_tensors=None,  # whole-sample debug rows: read them on the whole trajectory
    )
    return ShardedRolloutTrajectory(**fields, shard_dim=dim, shard_start=start, shard_stop=stop, full_shape=full)


__all__ = ["ShardedRolloutTrajectory", "ShardedDenoisingEnv", "shard_trajectory"]
