"""A branching rollout driven by the functional ops: the batch holds one row per tree node alive at the
step (it grows at each fork by ``repeat_interleave``), so the shared prefix is computed once, and the
result is the same ``RolloutTrajectory`` (rows = leaves, ``traj.tree``) that
``rollout(..., branch=spec)`` records from a pipeline run with every leaf from the start
(docs/branching.md).

    traj = branch_rollout(lambda x, j, roots: model(x, t[j], embeds[roots]), x0, sigmas,
                          BranchSpec(steps=[2, 5], k=4, seed=7), mode="sde", noise_level=0.7)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from ..core import _validate as V
from ..data.trajectory import RolloutTrajectory
from ..data.tree import BranchSpec
from ..ops.functional import sde_step
from .recorder import _index_set

Velocity = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


def branch_rollout(
    velocity: Velocity,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    branch: BranchSpec,
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    sde_steps: Optional[Iterable[int]] = None,
    timesteps: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> RolloutTrajectory:
    """Run the T steps of ``sigmas`` (float32 [T + 1]) from ``sample`` ([B, ...], one row per root),
    forking at ``branch.steps``: before fork step s each row is repeated ``k`` times (its children,
    adjacent), and every stochastic step draws each row's noise from its node's Philox key
    (``flowrl.data.tree.node_key``); ``sde_steps`` (None: all) as in ``rollout``, the other steps ode.

    ``velocity(x, j, roots)``: the model output for the rows ``x`` at loop step j; ``roots`` (int64
    [rows]) is each row's root sample in ``sample`` (to index its conditioning). Called once per step
    on the nodes alive there. ``timesteps``: the schedule metadata to store ([T]; default
    ``sigmas[:-1] * 1000``). Returns the leaves' trajectory: ``latents`` [N, T + 1, ...] (each row's
    whole path), ``log_probs`` [N, T], ``tree``; every row recomputes with ``traj.step_inputs(j)``.
    """
    if not callable(velocity):
        raise TypeError(f"velocity must be callable (x, j, roots) -> model_output; got {type(velocity).__name__}")
    if not isinstance(branch, BranchSpec):
        raise TypeError(f"branch must be a flowrl.data.tree.BranchSpec; got {type(branch).__name__}")
    V.check_float_tensor("sample", sample)
    V.check_choice("mode", mode, V.MODES)
    noise_level = V.check_noise_level(noise_level, mode)
    sigmas = V.check_sigmas(sigmas, sample.device)
    num_steps = sigmas.numel() - 1
    stochastic_steps = _index_set("sde_steps", sde_steps, num_steps - 1)
    if branch.steps and branch.steps[-1] >= num_steps:
        raise ValueError(f"branch.steps entries must be loop steps in [0, {num_steps - 1}]; got {branch.steps[-1]}")

    def stochastic(j):
        return mode != "ode" and noise_level != 0 and (stochastic_steps is None or j in stochastic_steps)

    deterministic = [s for s in branch.steps if not stochastic(s)]
    if deterministic:
        raise ValueError(f"branch.steps {deterministic} are deterministic steps (mode {mode!r}, noise_level "
                         f"{noise_level}, sde_steps); a fork there gives equal children")
    if timesteps is None:
        timesteps = sigmas[:-1] * 1000
    tree = branch.tree(sample.shape[0])
    keys = tree.keys(num_steps).to(sample.device)  # [T, N] per leaf row
    nodes = tree.row_nodes(num_steps)  # [N, T]
    forks = dict(zip(branch.steps, branch.k))

    x = sample
    roots = torch.arange(sample.shape[0], device=sample.device)
    level = list(range(sample.shape[0]))  # the nodes the rows of x are, in order
    parent = tree.parent.tolist()
    inputs, log_probs, levels = [], [], []
    for j in range(num_steps):
        if j in forks:
            x = x.repeat_interleave(forks[j], 0)
            roots = roots.repeat_interleave(forks[j], 0)
            children = {}
            for m, p in enumerate(parent):
                children.setdefault(p, []).append(m)
            level = [c for m in level for c in children[m]]
        position = {m: r for r, m in enumerate(level)}
        # the key of each row of x: that of a leaf row under it
        leaf_row = {}
        for n, m in enumerate(nodes[:, j].tolist()):
            leaf_row.setdefault(m, n)
        rows = torch.tensor([leaf_row[m] for m in level], dtype=torch.int64, device=sample.device)
        v = velocity(x, j, roots)
        out = sde_step(x, v, sigmas, j, mode=mode if stochastic(j) else "ode", noise_level=noise_level,
                       log_prob_kind=log_prob_kind, reduction=reduction, backend=backend, return_prev_sample_mean=False,
                       noise_seed=keys[j][rows] if stochastic(j) else None)
        inputs.append(x)
        log_probs.append(out.log_prob)
        levels.append(position)
        x = out.prev_sample
    # the leaves' paths: row n at step j is the row of its node in that step's batch
    leaf_pos = torch.tensor([[levels[j][int(nodes[n, j])] for j in range(num_steps)] for n in range(tree.num_rows)],
                            dtype=torch.int64, device=sample.device)
    dtype = x.dtype
    for t in inputs:
        dtype = torch.promote_types(dtype, t.dtype)  # lossless, as the recorder stacks its latents
    latents = torch.stack([inputs[j].to(dtype)[leaf_pos[:, j]] for j in range(num_steps)] + [x], dim=1)
    lp = torch.stack([log_probs[j][leaf_pos[:, j]] for j in range(num_steps)], dim=1)
    return RolloutTrajectory(
        latents=latents, log_probs=lp, timesteps=timesteps, sigmas=sigmas, mode=mode, noise_level=noise_level,
        log_prob_kind=log_prob_kind, reduction=reduction,
        sde_steps=None if stochastic_steps is None else torch.tensor(stochastic_steps, dtype=torch.int64,
                                                                     device=sample.device),
        tree=tree,
    )


__all__ = ["branch_rollout"]
