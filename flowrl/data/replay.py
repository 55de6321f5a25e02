"""Batched replay for the log-prob recompute (docs/performance.md, "Batched replay").

A trainer recomputes S steps of B samples. Step by step that is S forwards of batch B; the recompute
of one (sample, step) pair needs only that sample's latents at that step and the model's output for
them, so the S x B pairs can be cut into forwards of any batch size N, each pair with its own step
index (``flowrl.step_log_prob`` takes ``step_index`` as an integer tensor [N], one step per row):

    plan = traj.replay_plan(64)                      # chunks of at most 64 (sample, step) pairs
    for chunk in plan:
        inputs = chunk.inputs(traj)                  # step_log_prob's kwargs for the chunk's N rows
        v = model(inputs["sample"], chunk.timesteps(traj), cond[chunk.samples])   # one forward of N
        new = flowrl.step_log_prob(model_output=v, **inputs)                      # [N]
        ratio = torch.exp(new - chunk.old_log_probs(traj))
    ratios = plan.assemble(per_chunk_ratios)         # [B, T], the replayed steps filled

flowrl's part is batch-invariant (docs/contract.md: each sample's reduction is in a fixed order that
does not depend on the batch), so the recomputed log-prob of a pair equals the step-by-step one bit for
bit whenever the model's output for that pair does. Whether it does is the model's and its kernels':
see docs/performance.md for when a transformer's bits depend on the batch (measured on the CPU with
``./run example``'s tiny transformer: ``bench/replay.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..ops.functional import step_log_prob

ORDERS = ("step", "sample")


@dataclass(frozen=True)
class ReplayChunk:
    """One forward's (sample, step) pairs: ``samples`` and ``steps``, int64 [N] on the trajectory's
    latents' device (row r is sample ``samples[r]`` at loop step ``steps[r]``)."""

    samples: torch.Tensor
    steps: torch.Tensor
    stochastic: bool

    def __len__(self) -> int:
        return int(self.samples.numel())

    def timesteps(self, traj) -> torch.Tensor:
        """[N] the scheduler timestep of each row (the model's ``timestep`` input)."""
        return traj.timesteps[self.steps.to(traj.timesteps.device)]

    def old_log_probs(self, traj) -> torch.Tensor:
        """[N] the recorded log-probs of the rows (``traj.log_probs[samples, steps]``)."""
        lp = traj.log_probs
        return lp[self.samples.to(lp.device), self.steps.to(lp.device)]

    def inputs(self, traj) -> Dict[str, Any]:
        """``flowrl.step_log_prob``'s keyword arguments (all but ``model_output``) for the rows: what
        ``traj.step_inputs(j)`` gives for one step, gathered per (sample, step) with ``step_index`` the
        [N] step of each row."""
        position = torch.full((traj.num_steps + 1,), -1, dtype=torch.int64, device=traj.latents.device)
        position[traj.latent_step_indices.to(position.device)] = torch.arange(traj.latents.shape[1],
                                                                                device=position.device)
        rows, steps = self.samples.to(traj.latents.device), self.steps.to(traj.latents.device)
        out = dict(sample=traj.latents[rows, position[steps]], prev_sample=traj.latents[rows, position[steps + 1]],
                   sigmas=traj.sigmas, step_index=self.steps.to(traj.sigmas.device), **traj.step_options())
        if self.stochastic:
            out["mode"] = traj.mode
        elif traj.mode == "ddim":  # ddim's steps outside sde_steps ran at eta = 0 (as step_inputs)
            out["noise_level"] = 0.0
        else:
            out["mode"] = "ode"
        if traj.token_sigmas is not None:
            d = traj.token_sigmas.device
            out["token_sigmas"] = traj.token_sigmas[rows.to(d), steps.to(d)]
        if traj.frozen is not None:
            out["frozen"] = traj.frozen[rows.to(traj.frozen.device)]
        if traj.mode == "dpm_sde" and self.stochastic and traj.prev_x0_preds is not None:
            d = traj.prev_x0_preds.device
            out["prev_x0_pred"] = traj.prev_x0_preds[rows.to(d), steps.to(d)]
        return out

    def log_prob(self, traj, model_output: torch.Tensor, **kwargs) -> torch.Tensor:
        """``flowrl.step_log_prob(model_output=model_output, **self.inputs(traj), **kwargs)``, the
        trajectory's tensors moved to ``model_output``'s device: [N]."""
        device = model_output.device
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.inputs(traj).items()}
        return step_log_prob(model_output=model_output, **{**inputs, **kwargs})


class ReplayPlan:
    """The recompute of a trajectory's (sample, step) pairs as forwards of at most ``batch_size`` rows
    (``RolloutTrajectory.replay_plan``). Iterate it for the ``ReplayChunk``s; ``assemble`` puts per-chunk
    [N] results back into [B, T]."""

    def __init__(self, chunks: List[ReplayChunk], batch: int, num_steps: int, steps: Tuple[int, ...]):
        self.chunks = chunks
        self.batch_size, self.num_steps, self.steps = batch, num_steps, steps

    def __iter__(self) -> Iterator[ReplayChunk]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def assemble(self, values: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """[B, T] from one [N] tensor per chunk (in plan order); steps the plan does not replay hold
        ``fill``."""
        if len(values) != len(self.chunks):
            raise ValueError(f"values must hold one tensor per chunk: {len(self.chunks)} chunks, got {len(values)}")
        for i, (v, c) in enumerate(zip(values, self.chunks)):
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (len(c),):
                raise ValueError(f"values[{i}] must be a tensor [N] = [{len(c)}] (chunk {i}'s rows); got "
                                 f"{type(v).__name__ if not isinstance(v, torch.Tensor) else tuple(v.shape)}")
        first = values[0]
        out = torch.full((self.batch_size, self.num_steps), fill, dtype=first.dtype, device=first.device)
        for v, c in zip(values, self.chunks):
            out[c.samples.to(out.device), c.steps.to(out.device)] = v.to(out.dtype)
        return out


def replay_plan(traj, batch_size: int, *, steps: Optional[Sequence[int]] = None, order: str = "step") -> ReplayPlan:
    """Plan the recompute of ``traj`` as forwards of at most ``batch_size`` (sample, step) pairs.

    ``steps``: the loop steps to replay (default: the stochastic ones, ``traj.sde_steps``, or every step
    when all were stochastic); each needs latents j and j + 1 kept. ``order``: "step" enumerates the
    pairs step by step (all samples of step 0, then of step 1, ...), "sample" sample by sample; the
    enumeration is cut into consecutive chunks of ``batch_size``. Stochastic and ode steps (``sde_steps``)
    never share a chunk (their modes differ). Per-sample SDE windows (``traj.sde_mask``): the default
    replays the stochastic (sample, step) pairs only, every pair whose step the sample ran stochastic and
    no other; with ``steps=`` every pair of those steps, the stochastic and the ode pairs in separate
    chunks. ``batch_size = B`` with ``order="step"`` is the
    step-by-step recompute. A joint rollout (``streams``) is refused: replay it step by step."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    if traj.streams is not None:
        raise ValueError("replay_plan: a joint rollout (streams) is replayed step by step (traj.step_inputs(j))")
    num_steps, batch = traj.num_steps, traj.batch_size
    # bool [B, T]: which (sample, step) pairs ran stochastic (sde_mask per sample, sde_steps for the batch, or all)
    mask = traj.step_mask().cpu()
    default_steps = steps is None
    if steps is None:  # the steps with a stochastic pair
        steps = mask.any(dim=0).nonzero().flatten().tolist()
        if not steps and traj.sde_mask is not None:
            raise ValueError("sde_mask has no stochastic (sample, step) pair: nothing to replay")
    else:
        if isinstance(steps, torch.Tensor):
            steps = steps.tolist()
        if not isinstance(steps, (list, tuple)) or not all(
                isinstance(s, Integral) and not isinstance(s, bool) for s in steps):
            raise TypeError(f"steps must be a sequence of ints; got {steps!r}")
        steps = sorted(set(int(s) for s in steps))
    if not steps:
        raise ValueError("steps is empty: nothing to replay")
    for s in steps:  # the same checks as step_inputs (range, kept latents)
        traj._check_steps_kept(s)
    device = traj.latents.device
    g = torch.tensor(steps, dtype=torch.int64)
    if order == "step":
        all_steps, all_samples = g.repeat_interleave(batch), torch.arange(batch, dtype=torch.int64).repeat(len(steps))
    else:
        all_samples, all_steps = torch.arange(batch, dtype=torch.int64).repeat_interleave(len(steps)), g.repeat(batch)
    stochastic_pairs = mask[all_samples, all_steps]
    chunks: List[ReplayChunk] = []
    for stochastic in (True, False):  # the pairs of each kind, in the enumeration order; the default: stochastic only
        if not stochastic and default_steps:
            continue
        keep = stochastic_pairs == stochastic
        pair_steps, pair_samples = all_steps[keep], all_samples[keep]
        for start in range(0, pair_steps.numel(), int(batch_size)):
            chunks.append(ReplayChunk(pair_samples[start:start + batch_size].to(device),
                                      pair_steps[start:start + batch_size].to(device), stochastic))
    return ReplayPlan(chunks, batch, num_steps, tuple(steps))


__all__ = ["replay_plan", "ReplayPlan", "ReplayChunk", "ORDERS"]
