#!/usr/bin/env python3
"""Benchmark flowrl's step operations against the Flow-GRPO-style eager baseline (bench/baseline.py).

    python bench/run.py            full sweep (the issue's sizes; meant for a GPU)
    python bench/run.py --quick    reduced sweep that ends in a few minutes on a small CPU

Operations: ``rollout`` (``sde_step`` with given float32 noise, no mean returned), ``recompute_fwd``
(``step_log_prob`` under no_grad), ``recompute_fwd_bwd`` and ``kl_fwd_bwd`` (``step_log_prob`` /
``step_kl`` plus ``torch.autograd.grad`` with respect to ``model_output``). Modes ``sde`` (Gaussian
log-prob) and ``cps`` (``sq_err`` log-prob), as Flow-GRPO computes them.

Conditioned video steps (``--ops rollout_cond,recompute_fwd_cond,recompute_fwd_bwd_cond``, 5-D
[B, C, F, H, W] shapes only, in the full sweep for its video shapes; not for ddim and dpm_sde, which
refuse per-token sigmas, so their rows skip these ops): the op with a per-frame schedule
(``token_sigmas`` [B, 1, F, 1, 1]; frame 0 at sigma 0, the others at the step's sigma) and frame 0
frozen (``frozen`` [1, 1, F, 1, 1]), as an image-to-video rollout steps (Wan 2.2 TI2V). The kernels
take the per-token path (per-element coefficients from the compact per-frame table, the mask) for
every element. The baseline computes the same values the way trainers do it today: the peers'
formula on the frames after the conditioning one, sliced off by hand (Flow-Factory); outputs are
compared on those frames (the gradient on every frame: frame 0's is 0).

Implementations: ``flowrl-triton`` (CUDA only; what ``backend="auto"`` runs on CUDA), ``flowrl-torch``
(the reference; what ``"auto"`` runs on CPU), ``eager`` (the baseline) and ``compile`` (``torch.compile``
of the baseline, given [B, N] views with ``dynamic=True`` so the sweep compiles one graph per op, mode,
dtype and B == 1 / B > 1 rather than one per shape; elementwise work and bytes are the same).

Every implementation's outputs are checked against the eager baseline (loose tolerance) before it is
timed. Time: median after warm-up (GPU: ``triton.testing.do_bench``; CPU: wall clock). GB/s counts
the minimal bytes (each input read once, each output written once, see ``min_bytes``), also shown as
a percentage of a large device-to-device copy measured in the same run; for ``flowrl-triton`` also
over the bytes its kernels move by their launch design (``kernel_bytes``, "model" columns), which
says how close they run to the bandwidth limit. Both byte counts are shown per element. Peak memory of
``recompute_fwd_bwd`` is what the op allocates beyond its inputs (GPU: ``max_memory_allocated``;
CPU: the allocator's running total as recorded by ``torch.profiler`` with ``profile_memory=True``).
Results: a markdown table on stdout and a CSV (plus the table as .md) under bench/local/ (ignored by git;
--out bench/results for the recorded ones);
``--table-from CSV`` prints an earlier CSV's table with the byte columns recomputed from its times.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline  # noqa: E402  (bench/baseline.py, next to this file)

import flowrl  # noqa: E402
from flowrl.backends import _dispatch  # noqa: E402
from flowrl.backends import reference  # noqa: E402
from flowrl.contract import CHUNK_SIZE  # noqa: E402
from flowrl.core import _validate as V  # noqa: E402
from flowrl.data.tree import BranchSpec  # noqa: E402

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

# The issue's sizes: Flux-style packed image tokens, SD3-style latent grids, Wan-style video latents.
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


def base_op(op: str) -> str:
    """The op a conditioned op times (its bytes are the base op's: every element is read and written,
    the per-frame table and mask are a few bytes per frame)."""
    if op in TREE_OPS:
        return "rollout"
    return op[: -len(COND_SUFFIX)] if op in COND_OPS else op


def _check_variant(op: str, noise: str, write_mean: bool) -> None:
    op = base_op(op)
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if noise not in NOISE_SOURCES:
        raise ValueError(f"noise must be one of {NOISE_SOURCES}; got {noise!r}")
    if op != "rollout" and (noise != "tensor" or write_mean):
        raise ValueError(f"noise= and write_mean= are rollout options; got them for {op!r}")


def min_bytes(op: str, numel: int, batch: int, itemsize: int, noise: str = "tensor", write_mean: bool = False,
              second_order: bool = False) -> int:
    """Bytes an ideal kernel moves: each input read once, each output written once (N = numel
    elements of ``itemsize`` = s bytes, B = batch samples).

    rollout: reads x, v (2Ns) and, with noise="tensor", the float32 noise (4N; Philox noise and a
    noiseless step read none), writes x' (Ns), the log-prob [B] and, with write_mean, the float32 mean
    (4N). recompute_fwd: reads x, v, x' (3Ns), writes [B]. recompute_fwd_bwd: reads x, v, x' and the
    grad_output [B], writes the value [B] and grad_v (4Ns + 8B). kl_fwd_bwd: reads v and v_ref, which
    is all the KL depends on (mu - mu_ref = c v - c v_ref: x cancels), and the grad_output [B], writes
    the value [B] and grad_v (3Ns + 8B). The table recorded on 2026-11-29 (bench/results/) counted x for the
    KL too (4Ns + 8B). ``second_order`` (dpm_sde with prev_x0_pred): the rollout and the log-prob also
    read the previous x0 prediction (+Ns; the KL does not: it cancels)."""
    _check_variant(op, noise, write_mean)
    op = base_op(op)
    extra = numel * itemsize if second_order and op != "kl_fwd_bwd" else 0
    if op == "rollout":
        return numel * (3 * itemsize + (4 if noise == "tensor" else 0) + (4 if write_mean else 0)) + 4 * batch + extra
    if op == "recompute_fwd":
        return numel * 3 * itemsize + 4 * batch + extra
    if op == "recompute_fwd_bwd":
        return numel * 4 * itemsize + 8 * batch + extra
    return numel * 3 * itemsize + 8 * batch  # kl_fwd_bwd


def kernel_bytes(op: str, numel: int, batch: int, itemsize: int, noise: str = "tensor",
                 write_mean: bool = False, second_order: bool = False) -> int:
    """Bytes flowrl's Triton kernels move for ``op`` by their launch design (flowrl/backends/_triton_ops.py,
    kernels/step.py), the traffic model set beside ``min_bytes``: GB/s over these bytes, against the
    copy bandwidth, says how close the kernels run to the bandwidth limit; GB/s over ``min_bytes``
    says how close their design plus that speed come to an ideal kernel. Update it here when the
    launch design changes.

    N = numel elements of s = itemsize bytes, B = batch samples, P = ceil(N / B / CHUNK_SIZE) chunk
    partials per sample (CHUNK_SIZE = 1024). The element kernels read and write each tensor once per
    CHUNK_SIZE-element chunk of one sample; whether a program covers one chunk or several, each chunk
    keeps its own float32 partial, so the bytes are the same.

    - forward, step_partials_kernel (every op): reads v (Ns) and
      rollout: x (Ns) and the float32 noise (4N) with noise="tensor"; nothing for the noise with
      "philox" (drawn in registers) or "none" (no eps); writes x' (Ns) and, with write_mean, the
      float32 mean (4N);
      recompute (log-prob): x and the stored x' (2Ns);
      kl: v_ref (Ns) only (mu - mu_ref = c v - c v_ref: x is not read);
      and writes one float32 partial per chunk (4BP).
    - finalize_kernel, one program per sample: reads its P partials (4BP; the lanes padding them to
      a power of two are masked, no traffic), writes the value and the std (8B).
    - backward, step_backward_kernel (the *_fwd_bwd ops, grad w.r.t. model_output only): reads the
      incoming grad [B] (4B), re-reads the forward's element inputs (x, v, x': 3Ns; kl: v, v_ref:
      2Ns), writes grad_v (Ns) and no grad that was not asked for.

    So every op moves its minimum plus 8BP (the partials, written and read back) plus 4B (the std
    that finalize also writes), and the fwd+bwd ops also the backward's second read of the inputs
    (3Ns, kl 2Ns): nothing is saved between forward and backward, which is what keeps their peak
    memory at the inputs plus one gradient.

    Not counted, as in ``min_bytes``: the sigma table, the step indices and Philox seeds (a few bytes
    per sample, read from cache after the first program), and, above MAX_FINALIZE_WIDTH (16384)
    partials per sample (16M elements), the torch adds that pre-combine them (under 1% of the
    element traffic). ``second_order`` (dpm_sde with prev_x0_pred): the element kernels of the rollout
    and the log-prob also read the previous x0 prediction (Ns forward, Ns again in the backward)."""
    _check_variant(op, noise, write_mean)
    op = base_op(op)
    s, n, b = itemsize, numel, batch
    extra = n * s if second_order and op != "kl_fwd_bwd" else 0
    chunks = b * -(-(n // b) // CHUNK_SIZE)  # B * P, P = ceil(N / B / CHUNK_SIZE)
    partials = 4 * chunks + 4 * chunks  # written by the element kernel, read by finalize
    finalize = 8 * b  # value and std, float32 [B]
    if op == "rollout":
        forward = n * (2 * s + (4 if noise == "tensor" else 0) + s + (4 if write_mean else 0)) + extra
        return forward + partials + finalize
    forward = n * (2 * s if op == "kl_fwd_bwd" else 3 * s) + extra
    if op == "recompute_fwd":
        return forward + partials + finalize
    backward = 4 * b + forward + n * s  # grad [B] in, the forward's inputs again, grad_v out
    return forward + partials + finalize + backward


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


# ---- the implementations: each builds a no-argument callable returning the op's outputs ----------

def _check_cond(case: Case, op: str) -> None:
    if op in COND_OPS and case.token_sigmas is None:
        raise ValueError(f"{op} needs a 5-D video shape [B, C, F, H, W]; got {case.shape}")


def _flowrl_cond_fn(case: Case, op: str, backend: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    common = dict(mode=case.mode, noise_level=noise_level(case.mode), backend=backend, token_sigmas=case.token_sigmas,
                  frozen=case.frozen, log_prob_kind=case.log_prob_kind)
    if op == "rollout_cond":
        def fn():
            out = flowrl.sde_step(case.x, case.v, case.sigmas, STEP_INDEX, noise=case.noise,
                                  return_prev_sample_mean=False, **common)
            return out.prev_sample[:, :, 1:], out.log_prob
    elif op == "recompute_fwd_cond":
        def fn():
            with torch.no_grad():
                return (flowrl.step_log_prob(case.x, case.v, case.prev_cond, case.sigmas, STEP_INDEX, **common),)
    else:
        def fn():
            lp = flowrl.step_log_prob(case.x, case.v_grad, case.prev_cond, case.sigmas, STEP_INDEX, **common)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    return fn


def _flowrl_fn(case: Case, op: str, backend: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if op in COND_OPS:
        _check_cond(case, op)
        return _flowrl_cond_fn(case, op, backend)
    common = dict(mode=case.mode, noise_level=noise_level(case.mode), backend=backend, prev_x0_pred=case.x0_prev)
    if op == "rollout_tree":
        def fn():
            out = flowrl.sde_step(case.x, case.v, case.sigmas, STEP_INDEX, noise_seed=case.tree_keys,
                                  log_prob_kind=case.log_prob_kind, return_prev_sample_mean=False, **common)
            return out.prev_sample, out.log_prob
    elif op == "rollout":
        def fn():
            out = flowrl.sde_step(
                case.x, case.v, case.sigmas, STEP_INDEX, noise=case.noise, log_prob_kind=case.log_prob_kind,
                return_prev_sample_mean=False, **common,
            )
            return out.prev_sample, out.log_prob
    elif op == "recompute_fwd":
        def fn():
            with torch.no_grad():
                return (flowrl.step_log_prob(
                    case.x, case.v, case.prev, case.sigmas, STEP_INDEX, log_prob_kind=case.log_prob_kind, **common),)
    elif op == "recompute_fwd_bwd":
        def fn():
            lp = flowrl.step_log_prob(
                case.x, case.v_grad, case.prev, case.sigmas, STEP_INDEX, log_prob_kind=case.log_prob_kind, **common)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    elif op == "kl_fwd_bwd":
        def fn():
            kl = flowrl.step_kl(case.x, case.v_grad, case.v_ref, case.sigmas, STEP_INDEX, **common)
            (grad,) = torch.autograd.grad(kl, case.v_grad, case.grad_out)
            return kl.detach(), grad
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn


# Module-level so torch.compile keys its cache on a few code objects; mode/out_dtype are constants.
def _baseline_rollout(x, v, noise, sigmas, step_index, sigma_max, mode, x0_prev, out_dtype):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_step(x, v, x0_prev, sigmas, step_index, noise=noise, out_dtype=out_dtype)
    if mode == "ddim":  # sigmas: the alpha-bar table (baseline.ddim_alpha_bar_table)
        return baseline.ddpo_step(x, v, sigmas, step_index, noise_level=NOISE_LEVEL, noise=noise, out_dtype=out_dtype)
    prev, lp, _, _ = baseline.flow_grpo_step(
        x, v, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL, noise=noise, out_dtype=out_dtype)
    return prev, lp


def _baseline_log_prob(x, v, prev, sigmas, step_index, sigma_max, mode, x0_prev):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_step(x, v, x0_prev, sigmas, step_index, prev_sample=prev)[1]
    if mode == "ddim":
        return baseline.ddpo_step(x, v, sigmas, step_index, noise_level=NOISE_LEVEL, prev_sample=prev)[1]
    return baseline.flow_grpo_step(
        x, v, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL, prev_sample=prev)[1]


def _baseline_kl(x, v, v_ref, sigmas, step_index, sigma_max, mode, x0_prev):
    if mode == "dpm_sde":
        return baseline.mixgrpo_dpm_kl(x, v, v_ref, x0_prev, sigmas, step_index)
    if mode == "ddim":
        return baseline.ddpo_kl(x, v, v_ref, sigmas, step_index, noise_level=NOISE_LEVEL)
    return baseline.flow_grpo_kl(x, v, v_ref, sigmas, step_index, sigma_max, mode=mode, noise_level=NOISE_LEVEL)


_COMPILED: Dict[str, Callable] = {}


def _compiled(name: str, fn: Callable) -> Callable:
    if name not in _COMPILED:
        _set_recompile_limit(64)  # one code object serves every mode, dtype and grad mode
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _baseline_fn(case: Case, op: str, compiled: bool) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if compiled:
        flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731  (a view: inputs are contiguous)
        rollout = _compiled("rollout", _baseline_rollout)
        log_prob = _compiled("log_prob", _baseline_log_prob)
        kl = _compiled("kl", _baseline_kl)
    else:
        flat = lambda t: t  # noqa: E731
        rollout, log_prob, kl = _baseline_rollout, _baseline_log_prob, _baseline_kl
    x0_prev = None if case.x0_prev is None else flat(case.x0_prev)
    scalars = (case.sigmas, case.step_index, case.sigma_max, case.mode, x0_prev)
    if op in COND_OPS:  # the conditioning frame sliced off by hand, as trainers do it today
        _check_cond(case, op)
        cut = lambda t: flat(t[:, :, 1:])  # noqa: E731
        x, v, prev = cut(case.x), cut(case.v), cut(case.prev_cond)
        op = base_op(op)
        if op == "rollout":
            noise = cut(case.noise)

            def fn():
                prev_out, lp = rollout(x, v, noise, *scalars, case.dtype)
                return prev_out.reshape(case.x[:, :, 1:].shape), lp
        elif op == "recompute_fwd":
            def fn():
                with torch.no_grad():
                    return (log_prob(x, v, prev, *scalars),)
        else:
            def fn():
                lp = log_prob(x, cut(case.v_grad), prev, *scalars)
                (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
                return lp.detach(), grad
        return fn
    noise = case.noise
    if op == "rollout_tree":  # the rows' node noise, materialized once (not timed)
        noise = reference.philox_normal(V.check_noise_seed(case.tree_keys, case.x), case.x[0].numel())
        noise, op = noise.reshape(case.shape), "rollout"
    x, v, v_grad, prev, v_ref, noise = map(flat, (case.x, case.v, case.v_grad, case.prev, case.v_ref, noise))
    if op == "rollout":
        def fn():
            prev_out, lp = rollout(x, v, noise, *scalars, case.dtype)
            return prev_out.reshape(case.shape), lp
    elif op == "recompute_fwd":
        def fn():
            with torch.no_grad():
                return (log_prob(x, v, prev, *scalars),)
    elif op == "recompute_fwd_bwd":
        def fn():
            lp = log_prob(x, v_grad, prev, *scalars)
            (grad,) = torch.autograd.grad(lp, case.v_grad, case.grad_out)
            return lp.detach(), grad
    elif op == "kl_fwd_bwd":
        def fn():
            value = kl(x, v_grad, v_ref, *scalars)
            (grad,) = torch.autograd.grad(value, case.v_grad, case.grad_out)
            return value.detach(), grad
    else:
        raise ValueError(f"unknown op {op!r}")
    return fn


def build(impl: str, case: Case, op: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    if impl in FLOWRL_BACKEND:
        return _flowrl_fn(case, op, FLOWRL_BACKEND[impl])
    if impl in ("eager", "compile"):
        return _baseline_fn(case, op, compiled=impl == "compile")
    raise ValueError(f"unknown impl {impl!r}")


def check(outputs: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], rtol: float = CHECK_RTOL) -> float:
    """Largest norm-relative error of ``outputs`` against the eager baseline's; raises if over ``rtol``."""
    worst = 0.0
    for got, want in zip(outputs, expected):
        got, want = got.detach().double(), want.detach().double()
        if got.shape != want.shape:
            raise AssertionError(f"shape {tuple(got.shape)} != baseline's {tuple(want.shape)}")
        if not torch.isfinite(got).all():
            raise AssertionError("non-finite output")
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        worst = max(worst, err)
    if worst > rtol:
        raise AssertionError(f"differs from the eager baseline: relative error {worst:.2e} > {rtol:.0e}")
    return worst


# ---- measurement --------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable, device: torch.device, budget_s: float = 0.5) -> float:
    """Median milliseconds per call after warm-up."""
    return time_all({"fn": fn}, device, budget_s)["fn"]


def time_all(fns: Dict[str, Callable], device: torch.device, budget_s: float = 0.5,
             min_rounds: int = 5, max_rounds: int = 200) -> Dict[str, float]:
    """Median milliseconds per call of each function, after warm-up.

    GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), one function at a time.
    CPU: wall clock, the functions interleaved round-robin so that load from other processes on a
    shared machine hits every implementation alike; at least ``min_rounds`` rounds and about
    ``budget_s`` seconds per function."""
    if device.type == "cuda":
        import triton.testing

        result = {}
        for name, fn in fns.items():
            try:
                result[name] = float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            except TypeError:  # older triton: no return_mode
                result[name] = float(triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0])
        return result
    for fn in fns.values():
        fn()
        fn()  # warm-up: first-call allocations, lazy inits
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s * len(fns)
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() < deadline):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: 1e3 * statistics.median(ts) for name, ts in samples.items()}


def copy_gbps(device: torch.device, budget_s: float) -> float:
    """Bandwidth of a large device-to-device copy (bytes read + bytes written per second), in GB/s."""
    nbytes = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, budget_s=budget_s)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _cpu_peak_bytes(fn: Callable) -> int:
    """Peak bytes allocated by ``fn`` beyond what existed before, from the allocator's running total
    that torch.profiler records with each allocation event (profile_memory=True)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    if not allocations:
        return 0
    allocations.sort(key=lambda a: a[0])
    _, first_size, first_total = allocations[0]
    start_total = first_total - first_size
    return max(0, max(total for _, _, total in allocations) - start_total)


def time_rows(op_rows, fns, device, timing_budget_s, numel, copy, itemsize, with_peak: bool) -> None:
    """Time each implementation of one op and configuration, fill its row's rates (and, ``with_peak``, its
    peak memory beyond the inputs), then each row's speed and peak memory relative to the eager one."""
    for impl, ms in time_all(fns, device, budget_s=timing_budget_s).items():
        row = op_rows[impl]
        set_rates(row, ms, numel, copy)
        if with_peak:
            peak = peak_extra_bytes(fns[impl], device)
            row.peak_extra_mib = math.nan if peak is None else peak / 2**20
            row.grad_mib = numel * itemsize / 2**20
    for row in op_rows.values():
        row.x_eager = op_rows["eager"].time_ms / row.time_ms
        if op_rows["eager"].peak_extra_mib > 0:
            row.peak_x_eager = row.peak_extra_mib / op_rows["eager"].peak_extra_mib


def peak_extra_bytes(fn: Callable, device: torch.device) -> Optional[int]:
    """Bytes ``fn`` allocates at its peak beyond the memory held before it runs (its inputs)."""
    fn()  # warm: compile, lazy inits
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        return peak
    try:
        return _cpu_peak_bytes(fn)
    except Exception as exc:  # private profiler API: report n/a rather than fail the sweep
        print(f"# CPU peak memory unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


# ---- the sweep ----------------------------------------------------------------------------------

@dataclass
class Row:
    op: str
    mode: str
    dtype: str
    shape: str
    impl: str
    time_ms: float = math.nan
    gbps: float = math.nan  # over min_bytes
    pct_copy: float = math.nan
    min_b_elem: float = math.nan  # min_bytes / N
    model_b_elem: float = math.nan  # kernel_bytes / N (MODELLED_IMPLS only)
    gbps_model: float = math.nan  # over kernel_bytes
    pct_copy_model: float = math.nan
    x_eager: float = math.nan
    x_compile: float = math.nan
    peak_extra_mib: float = math.nan
    peak_x_eager: float = math.nan
    grad_mib: float = math.nan
    check_err: float = math.nan
    bound_pct: float = math.nan  # the static roofline bound of the op's kernels, % of copy (flowrl-triton)
    note: str = ""


def set_bytes(row: Row, numel: int, batch: int, itemsize: int) -> None:
    """The row's bytes per element: the minimum, and the traffic model for the implementations it
    models (the others' traffic is not designed, so they get none)."""
    second_order = row.mode == "dpm_sde"  # the bench runs dpm_sde at order 2 (Case.x0_prev)
    if row.op in LOSS_OPS:  # the losses suite (below)
        minimum, model, extra = loss_min_bytes, loss_kernel_bytes, {}
    else:
        minimum, model, extra = min_bytes, kernel_bytes, {"second_order": second_order}
        if row.op in TREE_OPS:  # the noise is drawn in the kernel (Philox), no tensor read
            extra["noise"] = "philox"
    row.min_b_elem = minimum(row.op, numel, batch, itemsize, **extra) / numel
    modelled = row.impl in MODELLED_IMPLS
    row.model_b_elem = model(row.op, numel, batch, itemsize, **extra) / numel if modelled else math.nan
    if modelled:
        import triton

        row.bound_pct = static_bound(row.op, row.mode, row.dtype, triton.__version__)


# ---- the static roofline bound (flowrl/tools/aot; docs/kernels.md's roofline table) ---------------

DOCS_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "kernels.md")


def roofline_table(path: str = DOCS_KERNELS) -> Dict[Tuple[str, str, str], float]:
    """{(kernel, label without its launch configuration, triton version): bound} from the roofline
    table ``python -m flowrl.tools.aot --update-docs docs/kernels.md`` writes (bf16, sm_90a; the
    bound as a fraction of copy bandwidth). Empty when the file or the table is missing."""
    from flowrl.tools import aot

    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for row in aot.markdown_rows(text, aot.ROOFLINE_START, aot.ROOFLINE_END):
        kernel, label = row["kernel"].strip("`"), re.sub(r" g\d+w\d+", "", row["specialization"])
        for column, cell in row.items():
            version = re.fullmatch(r"bound \((.+)\)", column)
            if version and cell.split()[0] not in ("None", "-"):
                out[(kernel, label, version.group(1))] = float(cell.split()[0])
    return out


def _op_kernels(op: str, mode: str) -> List[Tuple[str, str]]:
    """(kernel, label prefix) of the element kernels an op launches, as aot labels them."""
    from flowrl.contract import Mode
    from flowrl.tools import aot

    kind = baseline.LOG_PROB_KIND.get(mode, "gaussian")
    # dpm_sde at order 2 (Case.x0_prev); ddim with flowrl's defaults, epsilon-prediction without the clip
    mode = aot.mode_label(Mode[mode.upper()], has_prev=mode == "dpm_sde")
    if op == "rollout":
        return [("step_partials_kernel", f"{mode} rollout noise=tensor")]
    if op in TREE_OPS:
        return [("step_partials_kernel", f"{mode} rollout noise=philox")]
    if op == "recompute_fwd":
        return [("step_partials_kernel", f"{mode} log_prob")]
    if op == "recompute_fwd_bwd":
        return [("step_partials_kernel", f"{mode} log_prob"), ("step_backward_kernel", f"{mode} {kind} mean grads=")]
    if op == "kl_fwd_bwd":
        return [("step_partials_kernel", f"{mode} kl"), ("step_backward_kernel", f"{mode} kl mean grads=")]
    return []


def static_bound(op: str, mode: str, dtype: str, version: str, table=None) -> float:
    """The static roofline bound (% of copy bandwidth) of the op's flowrl-triton kernels: the lowest
    over its element kernels (for each, the best-matching label: the lowest bound among those that
    start with the prefix). NaN where the table has no row (fp32, the conditioned and loss ops)."""
    table = roofline_table() if table is None else table
    if dtype != "bf16":
        return math.nan
    bounds = []
    for kernel, prefix in _op_kernels(op, mode):
        found = [b for (k, label, v), b in table.items() if k == kernel and v == version
                 and (label == prefix or label.startswith(prefix + " ") or (prefix.endswith("=") and label.startswith(prefix)))
                 and not re.search(r"\+token|\+frozen|unaligned", label)]  # the ordinary step's kernels
        if not found:
            return math.nan
        bounds.append(min(found))
    return 100 * min(bounds) if bounds else math.nan


def set_rates(row: Row, ms: float, numel: int, copy: float) -> None:
    """GB/s over the minimal and the modelled bytes, and each as a percentage of the copy bandwidth."""
    row.time_ms = ms
    row.gbps = row.min_b_elem * numel / (ms * 1e-3) / 1e9
    row.pct_copy = 100 * row.gbps / copy
    row.gbps_model = row.model_b_elem * numel / (ms * 1e-3) / 1e9
    row.pct_copy_model = 100 * row.gbps_model / copy


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _loadavg() -> str:
    """1-minute load average: CPU timings on a shared machine are only as good as its load."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "none"


def _set_recompile_limit(limit: int) -> None:
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


def run_sweep(
    device: torch.device, shapes, dtypes, modes, ops, impls, *, time_budget_s: float = math.inf,
    timing_budget_s: float = 0.5, log=print, progress: Optional[Callable[[List[Row], float], None]] = None,
) -> Tuple[List[Row], float, List[str]]:
    """Check and time every configuration; returns (rows, copy GB/s, notes). ``progress(rows, copy)``
    is called after each configuration (the results so far survive a run killed at a time limit)."""
    notes: List[str] = []
    impls = list(impls) + ([] if "eager" in impls else ["eager"])  # every row is checked against it
    if "flowrl-triton" in impls and device.type != "cuda":
        impls.remove("flowrl-triton")
        notes.append("flowrl-triton is timed on CUDA only (the Triton interpreter is not a measurement)")
    if "flowrl-triton" in impls and not _dispatch.triton_available():
        impls.remove("flowrl-triton")
        notes.append(f"flowrl-triton unavailable: {_dispatch._triton_import_error()}")
    copy = copy_gbps(device, budget_s=max(timing_budget_s, 1.0))
    log(f"# copy bandwidth: {copy:.1f} GB/s")
    rows: List[Row] = []
    started = time.perf_counter()
    configs = [(s, d, m) for s in shapes for d in dtypes for m in modes]
    for done, (shape, dname, mode) in enumerate(configs):
        if time.perf_counter() - started > time_budget_s:
            notes.append(f"time budget of {time_budget_s:.0f} s reached: {done} of {len(configs)} "
                         "shape/dtype/mode configurations measured")
            break
        dtype = DTYPES[dname]
        case = make_case(shape, dtype, mode, device)
        numel, batch, itemsize = case.x.numel(), shape[0], case.x.element_size()
        shape_s = "x".join(map(str, shape))
        for op in ops:
            if op in COND_OPS and case.token_sigmas is None:
                continue  # conditioned steps are video steps of the first-order flow modes (make_case)
            eager = build("eager", case, op)
            expected = eager()
            op_rows = {impl: Row(op, mode, dname, shape_s, impl) for impl in impls}
            for row in op_rows.values():
                set_bytes(row, numel, batch, itemsize)
            rows.extend(op_rows.values())
            fns: Dict[str, Callable] = {}
            for impl, row in op_rows.items():
                try:
                    fn = eager if impl == "eager" else build(impl, case, op)
                    row.check_err = check(fn(), expected)
                    fns[impl] = fn
                except AssertionError as exc:
                    row.note = f"CHECK FAILED: {exc}"
                except Exception as exc:  # e.g. torch.compile without a working compiler: report it
                    row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            time_rows(op_rows, fns, device, timing_budget_s, numel, copy, itemsize, with_peak=op in PEAK_OP)
            for row in op_rows.values():
                if "compile" in op_rows:
                    row.x_compile = op_rows["compile"].time_ms / row.time_ms
                log(f"# {op:18s} {mode} {dname} {shape_s:18s} {row.impl:14s} {row.time_ms:10.4f} ms  {row.note}")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(rows, copy)
    return rows, copy, notes


# =================================================================================================
# ---- Training losses (flowrl.losses, docs/losses.md) beside the peers' eager loss code ----------
# =================================================================================================
# A separate suite (``--suite losses``): each op is forward + backward, d loss / d model_output, at
# one step (STEP_INDEX, mode sde, Gaussian log-prob). Implementations: flowrl-triton (CUDA only),
# flowrl-torch, and ``eager``, the peer's code as it runs in its trainer (the same formulas as
# tests/losses/test_losses_peers.py's transcriptions, which are the tests' oracle):
#
# - grpo_loss: Flow-GRPO's recompute (baseline.flow_grpo_step) of the log-prob and mean, the reference
#   policy's mean without grad, its loss block (ratio, clip, KL with the exact variance, approx_kl,
#   clipfrac); flowrl: losses.grpo_loss with ref_model_output.
# - grpo_guard: verl-omni GRPOGuardLoss with the stored float32 old_prev_sample_mean; flowrl:
#   losses.grpo_guard_loss replaying mu_old from the rollout's noise_seed (no mean stored or read). The
#   rollout stores x' in float32 for this op (replaying from a bf16 x' is only within bf16 rounding,
#   docs/losses.md), so x' is read in float32 by both (the byte columns count the latents' dtype).
# - nft_loss: DiffusionNFT's train_nft_sd3.py policy loss and KL; flowrl: losses.nft_loss.
# - awm_loss: Flow-Factory's AWM weighted log-prob (float64) and clipped loss; flowrl: losses.awm_loss.
# - dpo_loss: flow_grpo's train_sd3_dpo.py DPO block on the [chosen; rejected] batch; flowrl:
#   losses.dpo_loss (an even batch; odd ones are skipped with a note).
# - dgpo_loss: Luo-Yihong/DGPO's loss block (the DSM clip against the old policy, the group sigmoid of
#   compute_group_dgpo_loss_allreduce on one process, the KL), two groups (the batch's halves), x standing
#   in for the old policy's output, in float32 (DGPO's own code computes the score-matching errors in float32,
#   its float32 target promoting the bf16 output, and only the KL, a difference of two bf16 outputs, in bf16;
#   upcast here as the DPO peers do); flowrl: losses.dgpo_loss.
# - grpo_velocity_kl: Flow-Factory's GRPO loss with kl_type="v-based" (trainers/grpo.py: the per-sample
#   mean of (v - v_ref)^2 times kl_beta) on Flow-GRPO's recompute, the difference upcast to float32 (in
#   bf16, as their code runs it, its rounding moves the gradient by a few percent); flowrl:
#   losses.grpo_loss(kl_space="velocity").
# - grpo_guided_ref: grpo_loss's block with the reference given as its two CFG branches and a scale,
#   combined by the peers' CFG line (uncond + w (cond - uncond), a [B, N] temporary) before the exact KL;
#   flowrl: losses.grpo_loss(ref_model_output=(uncond, cond), ref_guidance_scale=w), combined in the pass.
# - grpo_joint: verl-omni's MiniMax-H3 FlowGRPO on a joint step (the case's latent as the video, a quarter
#   as many elements per sample as the audio, on its own schedule, shift 1): the streams' recomputed mean
#   log densities combined 0.5 / 0.5 (combine_log_probs) in FlowGRPOLoss's clipped surrogate; flowrl:
#   losses.grpo_loss on the tuples with stream_weights=(0.5, 0.5). The gradient is the video's.

LOSS_OPS = ("grpo_loss", "grpo_guard", "nft_loss", "awm_loss", "dpo_loss", "dgpo_loss", "grpo_velocity_kl",
            "grpo_guided_ref", "grpo_joint")
GUIDANCE_SCALE, JOINT_WEIGHTS, AUDIO_SHIFT = 4.5, (0.5, 0.5), 1.0
PAIR_OPS = ("dpo_loss",)  # need an even batch
DPO_BETA, DGPO_BETA = 2000.0, 100.0
LOSS_IMPLS = ("flowrl-triton", "flowrl-torch", "eager")
LOSS_SEED, LOSS_CLIP, LOSS_KL_COEF, NFT_BETA, NFT_ADV_MAX = 1234, 0.2, 0.04, 0.1, 5.0
# element tensors each op reads (the inputs the loss depends on), besides writing grad_v: x, v, x', v_ref |
# x, v, x' | x_t, v, v_old, x0, v_ref | v, eps, x0 | v, v_ref, eps, x0 | v, v_ref, v_old, eps, x0 |
# x, v, x', v_ref | x, v, x', uncond, cond | the video's x, v, x' (the audio's, a quarter of the elements,
# are not counted in the per-element bytes)
LOSS_INPUTS = {"grpo_loss": 4, "grpo_guard": 3, "nft_loss": 5, "awm_loss": 3, "dpo_loss": 4, "dgpo_loss": 5,
               "grpo_velocity_kl": 4, "grpo_guided_ref": 5, "grpo_joint": 3}
LOSS_SUMS = {"grpo_loss": 2, "grpo_guard": 2, "nft_loss": 5, "awm_loss": 1, "dpo_loss": 2,
             "dgpo_loss": 5, "grpo_velocity_kl": 2, "grpo_guided_ref": 2, "grpo_joint": 1}  # per-sample sums
LOSS_BACKWARD_INPUTS = {"dpo_loss": 3}  # the backward's reads where fewer than the forward's (DPO: v, eps, x0)


def loss_min_bytes(op: str, numel: int, batch: int, itemsize: int) -> int:
    """An ideal fused loss with its backward: each element input read once (LOSS_INPUTS), grad_v
    written once, plus the per-sample inputs (old log-prob, advantages: 8B). The eager grpo_guard also
    reads the stored float32 mean (4N), which the replaying flowrl op does not need."""
    if op not in LOSS_OPS:
        raise ValueError(f"unknown loss op {op!r}")
    return numel * (LOSS_INPUTS[op] + 1) * itemsize + 8 * batch


def loss_kernel_bytes(op: str, numel: int, batch: int, itemsize: int) -> int:
    """Bytes flowrl's loss kernels move (kernels/loss.py, flowrl/backends/_triton_losses.py): the forward
    element pass reads the LOSS_INPUTS tensors (Ns each) and writes LOSS_SUMS float32 partial sets
    (4BP each), read back by the finalize (8BP each with the write); the backward re-reads the inputs
    and writes grad_v (Ns), reading the per-sample grads (4B per sum). Per-sample [B] scalars besides
    are not counted (tens of bytes per sample)."""
    s, n, b = itemsize, numel, batch
    chunks = b * -(-(n // b) // CHUNK_SIZE)
    sums = LOSS_SUMS[op]
    forward = n * LOSS_INPUTS[op] * s + 8 * chunks * sums
    backward = n * LOSS_BACKWARD_INPUTS.get(op, LOSS_INPUTS[op]) * s + n * s + 4 * b * sums
    return forward + backward + 8 * batch


@dataclass
class LossCase:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    sigmas: torch.Tensor
    step_index: torch.Tensor
    sigma_max: float
    x: torch.Tensor
    v: torch.Tensor  # the current policy's output (a leaf copy is made per call)
    v_ref: torch.Tensor
    prev: torch.Tensor
    old_mean: torch.Tensor  # float32: what verl-omni / Flow-Factory store per step
    old_lp: torch.Tensor
    prev32: torch.Tensor  # grpo_guard's rollout stores x' in float32, so that replaying mu_old from it is
    old_lp32: torch.Tensor  # exact up to float32 rounding (docs/losses.md); its mean and log-prob
    old_mean32: torch.Tensor
    awm_old_lp: torch.Tensor  # AWM's weighted log-prob under the old policy
    adv: torch.Tensor
    x0: torch.Tensor
    eps: torch.Tensor
    xt: torch.Tensor
    t: torch.Tensor
    v_uncond: torch.Tensor  # the reference's CFG branches (grpo_guided_ref)
    v_cond: torch.Tensor
    audio: Tuple[torch.Tensor, ...]  # grpo_joint's second stream: x, v, x' [B, N / 4 per sample], its sigmas
    joint_old_lp: torch.Tensor  # the joint rollout's log-prob (0.5 / 0.5 of the streams' mean densities)


def make_loss_case(shape, dtype, device, seed: int = 0) -> LossCase:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda: torch.randn(shape, generator=gen).to(device)  # noqa: E731
    x, v_old = rand().to(dtype), rand().to(dtype)
    v = (v_old.float() + 0.05 * rand()).to(dtype)
    v_ref = (v_old.float() + 0.05 * rand()).to(dtype)
    sigmas = make_sigmas().to(device)
    seeds = torch.arange(shape[0], device=device) + LOSS_SEED
    out = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch")
    out32 = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch",
                            out_dtype=torch.float32)
    x0, eps = rand().to(dtype), rand().to(dtype)
    t = torch.linspace(0.2, 0.9, shape[0], device=device)
    tb = t.reshape((-1,) + (1,) * (len(shape) - 1))
    xt = ((1 - tb) * x0.float() + tb * eps.float()).to(dtype)
    adv = torch.linspace(-1.5, 1.5, shape[0], device=device)
    dims = tuple(range(1, len(shape)))
    awm_old_lp = ((-(v_old.double() - (eps - x0).double()) ** 2).mean(dim=dims) * t).float()
    v_uncond = (v_old.float() + 0.1 * rand()).to(dtype)
    v_cond = (v_uncond.float() + (v_ref.float() - v_uncond.float()) / GUIDANCE_SCALE).to(dtype)
    audio_shape = (shape[0], max(x[0].numel() // 4, 1))
    xa, va = (torch.randn(audio_shape, generator=gen).to(device).to(dtype) for _ in range(2))
    sigmas_a = make_sigmas(shift=AUDIO_SHIFT).to(device)
    out_a = flowrl.sde_step(xa, va, sigmas_a, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds + 7,
                            backend="torch", reduction="sum")
    out_v = flowrl.sde_step(x, v_old, sigmas, STEP_INDEX, noise_level=NOISE_LEVEL, noise_seed=seeds, backend="torch",
                            reduction="sum")
    joint_old_lp = flowrl.combine_streams([out_v.log_prob, out_a.log_prob], [out_v.count, out_a.count], "mean",
                                          JOINT_WEIGHTS)
    return LossCase(tuple(shape), dtype, sigmas, torch.full((shape[0],), STEP_INDEX, device=device),
                    float(sigmas[1]), x, v, v_ref, out.prev_sample, out.prev_sample_mean, out.log_prob,
                    out32.prev_sample, out32.log_prob, out32.prev_sample_mean, awm_old_lp,
                    adv, x0, eps, xt, t, v_uncond, v_cond, (xa, va, out_a.prev_sample, sigmas_a), joint_old_lp)


def _eager_loss(case: LossCase, op: str, v: torch.Tensor) -> torch.Tensor:
    """The peer's loss code, eager (see the block's header)."""
    dims = tuple(range(1, len(case.shape)))
    if op in ("grpo_velocity_kl", "grpo_guided_ref", "grpo_joint"):
        return _eager_issue24_loss(case, op, v, dims)
    if op in ("grpo_loss", "grpo_guard"):
        prev = case.prev if op == "grpo_loss" else case.prev32
        _, lp, mean, std_dev_t = baseline.flow_grpo_step(case.x, v, case.sigmas, case.step_index, case.sigma_max,
                                                         mode="sde", noise_level=NOISE_LEVEL, prev_sample=prev)
        adv = case.adv
        if op == "grpo_loss":
            with torch.no_grad():
                mean_ref, _, step_std = baseline.flow_grpo_mean(case.x, case.v_ref, case.sigmas, case.step_index,
                                                                case.sigma_max, mode="sde", noise_level=NOISE_LEVEL)
            ratio = torch.exp(lp - case.old_lp)
            policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))
            kl = ((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * step_std ** 2)
            _ = (0.5 * torch.mean((lp - case.old_lp) ** 2), torch.mean((torch.abs(ratio - 1) > LOSS_CLIP).float()))
            return policy + LOSS_KL_COEF * kl.mean()
        sigma, sigma_next = case.sigmas[case.step_index], case.sigmas[case.step_index + 1]
        sqrt_dt = torch.sqrt(sigma - sigma_next)
        scale = sqrt_dt.mean() * std_dev_t.mean()
        bias = (mean - case.old_mean32).pow(2).mean(dim=dims) / (2 * scale ** 2)
        ratio = torch.exp((lp - case.old_lp32 + bias) * scale)
        per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP))
        return torch.mean(per) / (sqrt_dt.mean() ** 2)
    tb = case.t.view(-1, *([1] * (len(case.shape) - 1)))
    if op == "nft_loss":
        r = torch.clamp((torch.clamp(case.adv, -NFT_ADV_MAX, NFT_ADV_MAX) / NFT_ADV_MAX) / 2.0 + 0.5, 0, 1)
        x0_pos = case.xt - tb * (NFT_BETA * v + (1 - NFT_BETA) * case.v_ref)
        x0_neg = case.xt - tb * ((1.0 + NFT_BETA) * case.v_ref - NFT_BETA * v)
        with torch.no_grad():
            w_pos = torch.abs(x0_pos.double() - case.x0.double()).mean(dim=dims, keepdim=True).clip(min=1e-5)
            w_neg = torch.abs(x0_neg.double() - case.x0.double()).mean(dim=dims, keepdim=True).clip(min=1e-5)
        pos = ((x0_pos - case.x0) ** 2 / w_pos).mean(dim=dims)
        neg = ((x0_neg - case.x0) ** 2 / w_neg).mean(dim=dims)
        policy = ((r * pos / NFT_BETA + (1.0 - r) * neg / NFT_BETA) * NFT_ADV_MAX).mean()
        return policy + LOSS_KL_COEF * ((v - case.v) ** 2).mean(dim=dims).mean()
    if op == "dpo_loss":  # flow_grpo train_sd3_dpo.py, the loss block
        bsz = case.shape[0] // 2
        target = case.eps - case.x0
        theta_mse = ((v.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        ref_mse = ((case.v_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        w_l_diff = (theta_mse[:bsz] - ref_mse[:bsz]) - (theta_mse[bsz:] - ref_mse[bsz:])
        inside_term = -0.5 * DPO_BETA * w_l_diff
        _ = (inside_term > 0).sum().float() / inside_term.size(0)
        return torch.mean(-torch.nn.functional.logsigmoid(inside_term))
    if op == "dgpo_loss":  # Luo-Yihong/DGPO train_sd3_dgpo.py, the loss block (one process)
        b = case.shape[0]
        target_v = case.eps.float() - case.x0.float()
        dsm = (target_v - v.float()).square().reshape(b, -1).mean(dim=1)
        old_dsm = (target_v - case.x.float()).square().reshape(b, -1).mean(dim=1)
        ratio = torch.exp(-dsm + old_dsm)
        should_clip = torch.where(case.adv > 0, ratio > 1.0 + LOSS_CLIP, ratio < 1.0 - LOSS_CLIP)
        dsm = torch.where(should_clip, dsm.detach(), dsm)
        with torch.no_grad():
            ref_dsm = (target_v - case.v_ref.float()).square().reshape(b, -1).mean(dim=1)
        term = case.adv * DGPO_BETA * (dsm.detach() - ref_dsm) / ((b + 1) // 2)
        groups = torch.arange(b, device=v.device) * 2 // b
        sums = torch.zeros(2, dtype=term.dtype, device=v.device).scatter_add_(0, groups, term)
        policy = (torch.sigmoid(sums)[groups].detach() * case.adv * dsm).mean()
        return policy + LOSS_KL_COEF * (v.float() - case.v_ref.float()).square().reshape(b, -1).mean(dim=1).mean()
    # awm_loss: Flow-Factory's float64 weighted log-prob ("t" weighting) and clipped loss
    target = case.eps - case.x0
    lp = (-(v.double() - target.double()) ** 2).mean(dim=dims) * case.t
    ratio = torch.exp(lp.float() - case.awm_old_lp)
    return torch.mean(torch.maximum(-case.adv * ratio, -case.adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))


def _grpo_surrogate(lp, old_lp, adv):
    ratio = torch.exp(lp - old_lp)
    return torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - LOSS_CLIP, 1 + LOSS_CLIP)))


def _eager_issue24_loss(case: LossCase, op: str, v: torch.Tensor, dims) -> torch.Tensor:
    """The peers' code for the velocity KL, the guided reference and the weighted joint step (the block's
    header)."""
    recompute = dict(mode="sde", noise_level=NOISE_LEVEL)
    _, lp, mean, _ = baseline.flow_grpo_step(case.x, v, case.sigmas, case.step_index, case.sigma_max,
                                             prev_sample=case.prev, **recompute)
    if op == "grpo_velocity_kl":  # Flow-Factory kl_type="v-based", upcast (a bf16 difference is off by 1e-2)
        kl = torch.mean((v.float() - case.v_ref.float()) ** 2, dim=dims, keepdim=True)
        return _grpo_surrogate(lp, case.old_lp, case.adv) + LOSS_KL_COEF * kl.mean()
    if op == "grpo_guided_ref":  # the CFG line, then grpo_loss's exact KL
        with torch.no_grad():
            v_ref = case.v_uncond + GUIDANCE_SCALE * (case.v_cond - case.v_uncond)
            mean_ref, _, step_std = baseline.flow_grpo_mean(case.x, v_ref, case.sigmas, case.step_index,
                                                            case.sigma_max, **recompute)
        kl = ((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * step_std ** 2)
        return _grpo_surrogate(lp, case.old_lp, case.adv) + LOSS_KL_COEF * kl.mean()
    # grpo_joint: verl-omni MiniMax-H3 (combine_log_probs) in FlowGRPOLoss
    xa, va, prev_a, sigmas_a = case.audio
    _, lp_a, _, _ = baseline.flow_grpo_step(xa, va, sigmas_a, case.step_index, float(sigmas_a[1]), prev_sample=prev_a,
                                            **recompute)
    joint = JOINT_WEIGHTS[0] * lp + JOINT_WEIGHTS[1] * lp_a
    return _grpo_surrogate(joint, case.joint_old_lp, case.adv)


def _flowrl_loss(case: LossCase, op: str, v: torch.Tensor, backend: str) -> torch.Tensor:
    from flowrl import losses

    if op in ("grpo_velocity_kl", "grpo_guided_ref"):
        ref = dict(ref_model_output=case.v_ref, kl_space="velocity") if op == "grpo_velocity_kl" else dict(
            ref_model_output=(case.v_uncond, case.v_cond), ref_guidance_scale=GUIDANCE_SCALE)
        return losses.grpo_loss(case.x, v, case.prev, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp,
                                advantages=case.adv,
                                clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL, kl_coef=LOSS_KL_COEF, backend=backend,
                                **ref).loss
    if op == "grpo_joint":
        xa, va, prev_a, sigmas_a = case.audio
        return losses.grpo_loss((case.x, xa), (v, va), (case.prev, prev_a), (case.sigmas, sigmas_a), STEP_INDEX,
                                old_log_prob=case.joint_old_lp, advantages=case.adv, clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL,
                                stream_weights=JOINT_WEIGHTS, backend=backend).loss

    if op == "grpo_loss":
        return losses.grpo_loss(case.x, v, case.prev, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp,
                                advantages=case.adv,
                                clip_range=LOSS_CLIP, noise_level=NOISE_LEVEL, kl_coef=LOSS_KL_COEF,
                                ref_model_output=case.v_ref, backend=backend).loss
    if op == "grpo_guard":
        seeds = torch.arange(case.shape[0], device=case.x.device) + LOSS_SEED
        return losses.grpo_guard_loss(case.x, v, case.prev32, case.sigmas, STEP_INDEX, old_log_prob=case.old_lp32,
                                      advantages=case.adv,
                                      clip_range=LOSS_CLIP, noise_seed=seeds, noise_level=NOISE_LEVEL,
                                      backend=backend).loss
    if op == "nft_loss":
        # v_ref stands in for the old policy's output and case.v for the reference (same tensors as eager)
        return losses.nft_loss(case.xt, v, case.v_ref, case.x0, case.t, advantages=case.adv, beta=NFT_BETA,
                               adv_clip_max=NFT_ADV_MAX, kl_coef=LOSS_KL_COEF, ref_model_output=case.v,
                               backend=backend).loss
    if op == "dpo_loss":
        return losses.dpo_loss(v, case.v_ref, case.eps, case.x0, beta=DPO_BETA, backend=backend).loss
    if op == "dgpo_loss":
        b = case.shape[0]
        groups = torch.arange(b, device=v.device) * 2 // b
        return losses.dgpo_loss(v, case.v_ref, case.eps, case.x0, advantages=case.adv, group_index=groups,
                                beta=DGPO_BETA,
                                group_size=(b + 1) // 2, old_model_output=case.x, clip_range=LOSS_CLIP,
                                kl_coef=LOSS_KL_COEF, backend=backend).loss
    return losses.awm_loss(v, case.eps, case.x0, case.t, old_log_prob=case.awm_old_lp, advantages=case.adv,
                           clip_range=LOSS_CLIP, weighting="t",
                           backend=backend).loss


def build_loss(impl: str, case: LossCase, op: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    """A no-argument callable returning (loss, d loss / d model_output) of ``impl``."""
    leaf = case.v.detach().clone().requires_grad_(True)
    if impl == "eager":
        compute = lambda: _eager_loss(case, op, leaf)  # noqa: E731
    elif impl in FLOWRL_BACKEND:
        compute = lambda: _flowrl_loss(case, op, leaf, FLOWRL_BACKEND[impl])  # noqa: E731
    else:
        raise ValueError(f"unknown loss impl {impl!r}")

    def fn():
        loss = compute()
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss.detach().float().reshape(1), grad
    return fn


def run_loss_sweep(device: torch.device, shapes, dtypes, ops, impls, *, time_budget_s: float = math.inf,
                   timing_budget_s: float = 0.5, log=print,
                   progress: Optional[Callable[[List[Row], float], None]] = None) -> Tuple[List[Row], float, List[str]]:
    """Check every loss against the peer's eager code (loss and gradient), then time it and measure
    its peak memory beyond the inputs; rows as the step suite's (Row, markdown_table); the time
    budget and ``progress`` as in ``run_sweep``."""
    notes: List[str] = []
    impls = [i for i in impls if i != "compile"] + ([] if "eager" in impls else ["eager"])
    if "flowrl-triton" in impls and (device.type != "cuda" or not _dispatch.triton_available()):
        impls.remove("flowrl-triton")
        notes.append("flowrl-triton is timed on CUDA only (the Triton interpreter is not a measurement)")
    copy = copy_gbps(device, budget_s=max(timing_budget_s, 1.0))
    rows: List[Row] = []
    started = time.perf_counter()
    configs = [(s, d) for s in shapes for d in dtypes]
    for done, (shape, dname) in enumerate(configs):
        if time.perf_counter() - started > time_budget_s:
            notes.append(f"time budget of {time_budget_s:.0f} s reached: {done} of {len(configs)} "
                         "shape/dtype configurations measured")
            break
        case = make_loss_case(shape, DTYPES[dname], device)
        numel, batch, itemsize = case.x.numel(), shape[0], case.x.element_size()
        shape_s = "x".join(map(str, shape))
        for op in ops:
            if op in PAIR_OPS and batch % 2:
                note = f"{op} needs chosen/rejected pairs (an even batch): skipped at {shape_s}"
                notes += [] if note in notes else [note]
                continue
            expected = build_loss("eager", case, op)()
            op_rows = {impl: Row(op, "sde" if op.startswith("grpo") else "-", dname, shape_s, impl)
                       for impl in impls}
            fns: Dict[str, Callable] = {}
            for impl, row in op_rows.items():
                set_bytes(row, numel, batch, itemsize)
                try:
                    fn = build_loss(impl, case, op)
                    row.check_err = check(fn(), expected)
                    fns[impl] = fn
                except AssertionError as exc:
                    row.note = f"CHECK FAILED: {exc}"
                except Exception as exc:  # e.g. a kernel that fails to compile: report it, go on
                    row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            time_rows(op_rows, fns, device, timing_budget_s, numel, copy, itemsize, with_peak=True)
            for row in op_rows.values():
                log(f"# {op:12s} {dname} {shape_s:18s} {row.impl:14s} {row.time_ms:10.4f} ms  {row.note}")
            rows.extend(op_rows.values())
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(rows, copy)
    return rows, copy, notes


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| op | mode | dtype | shape | impl | time ms | min B/elem | GB/s | % copy | model B/elem "
            "| GB/s (model) | % copy (model) | static bound % copy | x eager | x compile | peak MiB (x eager) | note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peak = "-" if math.isnan(r.peak_extra_mib) else (
            f"{_fmt(r.peak_extra_mib)} ({_fmt(r.peak_x_eager, 2)})" if not math.isnan(r.peak_x_eager)
            else _fmt(r.peak_extra_mib))
        lines.append(
            f"| {r.op} | {r.mode} | {r.dtype} | {r.shape} | {r.impl} | {_fmt(r.time_ms)} | {_fmt(r.min_b_elem, 4)} "
            f"| {_fmt(r.gbps)} | {_fmt(r.pct_copy, 2)} | {_fmt(r.model_b_elem, 4)} | {_fmt(r.gbps_model)} "
            f"| {_fmt(r.pct_copy_model, 2)} | {_fmt(r.bound_pct, 3)} | {_fmt(r.x_eager, 2)} | {_fmt(r.x_compile, 2)} | {peak} | {r.note} |"
        )
    return "\n".join(lines)


def retabulate(csv_path: str) -> Tuple[List[Row], Dict[str, str]]:
    """The rows of a results CSV, their byte columns recomputed from the recorded times with the
    current ``min_bytes`` and ``kernel_bytes`` (the copy bandwidth is the one recorded with them), so
    a table taken under an older byte count reads the same as a new one. Returns (rows, header)."""
    row_fields = {f.name for f in fields(Row)}
    rows: List[Row] = []
    header: Dict[str, str] = {}
    with open(csv_path, newline="") as f:
        for rec in csv.DictReader(f):
            header = {k: v for k, v in rec.items() if k not in row_fields}
            row = Row(**{k: (v if k in ("op", "mode", "dtype", "shape", "impl", "note") else float(v or "nan"))
                         for k, v in rec.items() if k in row_fields})
            shape = [int(d) for d in row.shape.split("x")]
            numel = math.prod(shape)
            set_bytes(row, numel, shape[0], torch.empty((), dtype=DTYPES[row.dtype]).element_size())
            if not math.isnan(row.time_ms):
                # the unrounded copy bandwidth of that run, from its own GB/s and % copy
                copy = 100 * float(rec["gbps"]) / float(rec["pct_copy"])
                set_rates(row, row.time_ms, numel, copy)
            rows.append(row)
    return rows, header


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def write_results(rows: Sequence[Row], header: Dict[str, str], table: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    suite = "".join(f"_{name}" for name in dict.fromkeys(header.get(k) for k in ("suite", "tag")) if name)
    stem = _slug(f"{header['machine']}_torch-{header['torch']}_triton-{header['triton']}_{header['date']}{suite}")
    path = os.path.join(out_dir, stem + ".csv")
    names = list(header) + [f.name for f in fields(Row)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in rows:
            writer.writerow({**header, **asdict(r)})
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + table + "\n")
    return path


def parse_shapes(text: str) -> List[Tuple[int, ...]]:
    try:
        shapes = [tuple(int(d) for d in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are like 1x4096x64,8x16x128x128; got {text!r}") from None
    if not shapes or any(len(s) < 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"each shape needs a batch and at least one more positive dim; got {text!r}")
    return shapes


def _choices(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}; got {text!r}")
        return items
    return parse


def default_ops(quick: bool) -> List[str]:
    """The step suite's ops without --ops: all, and with --quick all but the tree step (its torch
    reference's CPU Philox doubled the quick run, 26 s -> 50 s on the 2-core machine)."""
    return list(OPS + COND_OPS + (() if quick else TREE_OPS))


# where a run writes unless told (--out, $OUT): a folder git ignores, so a run leaves the checkout clean
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"reduced sweep (under a minute on a 2-core CPU): shapes {QUICK_SHAPES}, modes {QUICK_MODES}, "
                        f"dtypes {QUICK_DTYPES}, no torch.compile baseline")
    p.add_argument("--suite", choices=("steps", "losses"), default="steps",
                   help="steps: the step ops (default); losses: flowrl.losses beside the peers' eager loss code")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated, e.g. 1x4096x64,4x16x21x60x104")
    p.add_argument("--dtypes", type=_choices(list(DTYPES)), default=None, help=f"default {list(DTYPES)}")
    p.add_argument("--modes", type=_choices(MODES), default=None, help=f"default {list(MODES)}")
    p.add_argument("--ops", type=_choices(OPS + COND_OPS + TREE_OPS), default=None,
                   help="the conditioned ops (*_cond) run on 5-D video shapes, in the modes that take per-token "
                        "sigmas (not ddim, dpm_sde); default all, and with --quick all but rollout_tree (the torch "
                        "reference's Philox takes most of a CPU sweep's time)")
    p.add_argument("--impls", type=_choices(IMPLS), default=None, help=f"default {list(IMPLS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch.set_num_threads (1 gives stable timings on a loaded, shared machine)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--time-budget", type=float, default=math.inf,
                   help="stop starting new configurations after this many seconds (the table says so)")
    p.add_argument("--timing-budget", type=float, default=None,
                   help="CPU: seconds of repeated runs per timing (default 0.5, 0.2 with --quick)")
    p.add_argument("--table-from", metavar="CSV",
                   help="print the table of an earlier results CSV, its byte columns recomputed (no run)")
    p.add_argument("--tag", default="",
                   help="appended to the results' file names (several runs on one machine and day)")
    p.add_argument("--out", default=os.environ.get("OUT") or DEFAULT_OUT,
                   help="directory for the CSV and .md (default: $OUT, else bench/local/, which git ignores; "
                        "the recorded tables go to bench/results/ by --out bench/results)")
    args = p.parse_args(argv)
    if args.table_from:
        rows, header = retabulate(args.table_from)
        print("# " + ", ".join(f"{k}={v}" for k, v in header.items()))
        print(markdown_table(rows))
        return 0

    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    shapes = args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    if args.modes is None:
        args.modes = list(QUICK_MODES if args.quick else MODES)
    if args.dtypes is None:
        args.dtypes = list(QUICK_DTYPES if args.quick else DTYPES)
    if args.impls is None:
        args.impls = list(QUICK_IMPLS if args.quick else IMPLS)
    if args.ops is None:
        args.ops = default_ops(args.quick)
    impls = [i for i in args.impls if not (args.no_compile and i == "compile")]
    timing_budget = args.timing_budget if args.timing_budget is not None else (0.2 if args.quick else 0.5)

    header = {
        "machine": machine_name(device),
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton_version(),
        "date": datetime.date.today().isoformat(),
        "threads": str(torch.get_num_threads()),
        "load_before": _loadavg(),
    }
    if args.suite == "losses":
        header["suite"] = "losses"
    if args.tag:
        header["tag"] = args.tag
    print("# " + ", ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    started = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    def progress(rows: List[Row], copy: float) -> None:
        """The results so far, rewritten after each configuration and marked partial: a run stopped
        at a time limit (a GPU lease) still leaves every row it measured."""
        write_results(rows, {**header, "copy_gbps": f"{copy:.1f}", "partial": "yes"}, markdown_table(rows), args.out)

    if args.suite == "losses":
        rows, copy, notes = run_loss_sweep(device, shapes, args.dtypes, LOSS_OPS, impls, time_budget_s=args.time_budget,
                                           timing_budget_s=timing_budget, log=log, progress=progress)
    else:
        rows, copy, notes = run_sweep(
            device, shapes, args.dtypes, args.modes, args.ops, impls, time_budget_s=args.time_budget,
            timing_budget_s=timing_budget, log=log, progress=progress,
        )
    header["load_after"] = _loadavg()
    header["copy_gbps"] = f"{copy:.1f}"
    header["sweep_s"] = f"{time.perf_counter() - started:.0f}"
    table = markdown_table(rows)
    path = write_results(rows, header, table, args.out)
    print(f"\n{'GPU' if device.type == 'cuda' else 'CPU'} results on {header['machine']} (torch {header['torch']}, "
          f"triton {header['triton']}, {header['date']}); copy bandwidth {copy:.1f} GB/s; CSV: {path}")
    for note in notes:
        print(f"note: {note}")
    print("\n" + table, flush=True)
    # a wrong result fails the run, and so does a flowrl implementation that raised (a kernel that does
    # not compile on this machine); the compile baseline's failures are only reported
    failed = [r for r in rows if r.note.startswith("CHECK FAILED") or (r.note and r.impl in FLOWRL_BACKEND)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
