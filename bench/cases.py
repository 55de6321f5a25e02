"""The step suite's cases (bench/run.py): the ops, modes, dtypes and implementations it times, the sweep's
shapes and constants, and the inputs of one (shape, dtype, mode) configuration (``Case``, ``make_case``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import baseline  # bench/baseline.py (bench/run.py puts bench/ on sys.path)

import flowrl
from flowrl.data.tree import BranchSpec

OPS = ("rollout", "recompute_fwd", "recompute_fwd_bwd", "kl_fwd_bwd")
COND_OPS = ("rollout_cond", "recompute_fwd_cond", "recompute_fwd_bwd_cond")  # 5-D shapes, first-order flow modes
# a branching rollout's step (docs/branching.md): the batch's rows are the K = B children of one fork,
# each drawing its noise in the kernel from its node's Philox key (flowrl.data.tree.node_key); the eager
# baseline is the ordinary rollout given that noise as a tensor (BranchGRPO draws torch.randn per child;
# its draw is not timed, as the rollout rows give the eager step its noise)
TREE_OPS = ("rollout_tree",)
COND_SUFFIX = "_cond"
MODES = baseline.MODES
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
IMPLS = ("flowrl-triton", "flowrl-torch", "eager", "compile")
FLOWRL_BACKEND = {"flowrl-triton": "triton", "flowrl-torch": "torch"}

# The sizes: Flux-style packed image tokens, SD3-style latent grids, Wan-style video latents.
FULL_SHAPES = (
    [(b, 4096, 64) for b in (1, 8, 32)]
    + [(b, 16, 128, 128) for b in (1, 8, 32)]
    + [(b, 16, 21, 60, 104) for b in (1, 4)]
)
QUICK_SHAPES = [(1, 4096, 64), (2, 16, 128, 128)]
# --quick: the two modes Flow-GRPO trains with, bf16, no torch.compile baseline (its compile time is most of
# a CPU sweep); any of --modes / --dtypes / --impls given explicitly wins
QUICK_MODES = ("sde", "cps")
QUICK_DTYPES = ("bf16",)
QUICK_IMPLS = tuple(i for i in IMPLS if i != "compile")

NUM_STEPS, SHIFT, STEP_INDEX, NOISE_LEVEL = 10, 3.0, 2, 0.7
CHECK_RTOL = 1e-2  # loose on purpose: catches a wrong formula, not rounding-order differences
PEAK_OP = ("recompute_fwd_bwd", "recompute_fwd_bwd_cond")
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}


def make_sigmas(num_steps: int = NUM_STEPS, shift: float = SHIFT) -> torch.Tensor:
    """A diffusers-style shifted schedule: float32, length T + 1, from 1 down to a terminal 0."""
    s = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float()


NOISE_SOURCES = ("tensor", "philox", "none")  # a rollout's eps: float32 tensor, in-kernel Philox, none (ode)
MODELLED_IMPLS = ("flowrl-triton",)  # the implementations whose traffic kernel_bytes models

# the losses suite's ops (bench/loss_suite.py, whose header says what each one times)
LOSS_OPS = ("grpo_loss", "grpo_guard", "nft_loss", "awm_loss", "dpo_loss", "dgpo_loss", "grpo_velocity_kl",
            "grpo_guided_ref", "grpo_joint")


def base_op(op: str) -> str:
    """The op a conditioned op times (its bytes are the base op's: every element is read and written,
    the per-frame table and mask are a few bytes per frame)."""
    if op in TREE_OPS:
        return "rollout"
    return op[: -len(COND_SUFFIX)] if op in COND_OPS else op


@dataclass
class Case:
    """Inputs of one (shape, dtype, mode) configuration, all on one device."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    mode: str
    sigmas: torch.Tensor
    step_index: torch.Tensor  # int64 [B], for the baseline (flowrl takes the int STEP_INDEX)
    sigma_max: float
    x: torch.Tensor
    v: torch.Tensor
    v_grad: torch.Tensor  # leaf copy of v that requires grad
    v_ref: torch.Tensor
    noise: torch.Tensor  # float32, as flowrl and the peers draw it
    prev: torch.Tensor  # a sample emitted by a rollout step, in the storage dtype
    grad_out: torch.Tensor  # ones [B]
    # conditioned video steps (5-D shapes): per-frame sigmas [B, 1, F, 1, 1], frame 0 frozen, and a
    # sample emitted by a conditioned rollout step
    token_sigmas: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None
    prev_cond: Optional[torch.Tensor] = None
    x0_prev: Optional[torch.Tensor] = None  # dpm_sde: the previous step's x0 prediction (second order)
    tree_keys: Optional[torch.Tensor] = None  # rollout_tree: each row's node key at the fork step (int64 [B])

    @property
    def log_prob_kind(self) -> str:
        return baseline.LOG_PROB_KIND[self.mode]


def make_case(shape, dtype, mode, device, seed: int = 0) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda: torch.randn(shape, generator=gen).to(device)  # noqa: E731
    x, v = rand().to(dtype), rand().to(dtype)
    v_ref = (v.float() + 0.05 * rand()).to(dtype)
    noise = rand()
    # the schedule table: ddim's alpha-bar pairs (Stable Diffusion's), the flow modes' sigmas
    sigmas = (baseline.ddim_alpha_bar_table(NUM_STEPS) if mode == "ddim" else make_sigmas()).to(device)
    x0_prev = rand().to(dtype) if mode == "dpm_sde" else None  # dpm_sde runs its second order
    prev = flowrl.sde_step(
        x, v, sigmas, STEP_INDEX, mode=mode, noise_level=noise_level(mode), noise=noise,
        log_prob_kind=baseline.LOG_PROB_KIND[mode], backend="torch", return_prev_sample_mean=False, prev_x0_pred=x0_prev,
    ).prev_sample
    cond = {}
    if len(shape) == 5 and mode not in ("ddim", "dpm_sde"):  # masks are the flow modes' (first order)
        frames = shape[2]
        token_sigmas = sigmas[STEP_INDEX].expand(shape[0], 1, frames, 1, 1).clone()
        token_sigmas[:, :, 0] = 0.0  # the conditioning frame: held
        frozen = torch.zeros(1, 1, frames, 1, 1, dtype=torch.bool, device=device)
        frozen[:, :, 0] = True
        prev_cond = flowrl.sde_step(
            x, v, sigmas, STEP_INDEX, mode=mode, noise_level=noise_level(mode), noise=noise, log_prob_kind=baseline.LOG_PROB_KIND[mode],
            backend="torch", return_prev_sample_mean=False, token_sigmas=token_sigmas, frozen=frozen,
        ).prev_sample
        cond = dict(token_sigmas=token_sigmas, frozen=frozen, prev_cond=prev_cond)
    tree = BranchSpec(steps=(STEP_INDEX,), k=shape[0], seed=seed).tree(1)  # one root, its B children
    cond["tree_keys"] = tree.keys(NUM_STEPS)[STEP_INDEX].to(device)
    return Case(
        shape=tuple(shape), dtype=dtype, mode=mode, sigmas=sigmas,
        step_index=torch.full((shape[0],), STEP_INDEX, dtype=torch.int64, device=device),
        sigma_max=float(sigmas[1]), x=x, v=v, v_grad=v.detach().clone().requires_grad_(True), v_ref=v_ref,
        noise=noise, prev=prev, grad_out=torch.ones(shape[0], device=device), x0_prev=x0_prev, **cond,
    )


def noise_level(mode: str) -> float:
    """The bench's noise level: NOISE_LEVEL, except dpm_sde's, which has none (1.0)."""
    return 1.0 if mode == "dpm_sde" else NOISE_LEVEL
