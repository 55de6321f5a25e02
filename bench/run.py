#!/usr/bin/env python3
"""Benchmark flowrl's step operations against the Flow-GRPO-style eager baseline (bench/baseline.py).

    python bench/run.py            full sweep (the issue's sizes; meant for a GPU)
    python bench/run.py --quick    reduced sweep that ends in a few minutes on a small CPU

Operations: ``rollout`` (``sde_step`` with given float32 noise, no mean returned), ``recompute_fwd``
(``step_log_prob`` under no_grad), ``recompute_fwd_bwd`` and ``kl_fwd_bwd`` (``step_log_prob`` /
``step_kl`` plus ``torch.autograd.grad`` with respect to ``model_output``). Modes ``sde`` (Gaussian
log-prob) and ``cps`` (``sq_err`` log-prob), as Flow-GRPO computes them.

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
Results: a markdown table on stdout and a CSV (plus the table as .md) under bench/results/;
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
from flowrl import _dispatch  # noqa: E402
from flowrl.contract import CHUNK_SIZE  # noqa: E402

OPS = ("rollout", "recompute_fwd", "recompute_fwd_bwd", "kl_fwd_bwd")
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

NUM_STEPS, SHIFT, STEP_INDEX, NOISE_LEVEL = 10, 3.0, 2, 0.7
CHECK_RTOL = 1e-2  # loose on purpose: catches a wrong formula, not rounding-order differences
PEAK_OP = "recompute_fwd_bwd"
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}


def make_sigmas(num_steps: int = NUM_STEPS, shift: float = SHIFT) -> torch.Tensor:
    """A diffusers-style shifted schedule: float32, length T + 1, from 1 down to a terminal 0."""
    s = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([s, torch.zeros(1, dtype=torch.float64)]).float()


NOISE_SOURCES = ("tensor", "philox", "none")  # a rollout's eps: float32 tensor, in-kernel Philox, none (ode)
MODELLED_IMPLS = ("flowrl-triton",)  # the implementations whose traffic kernel_bytes models


def _check_variant(op: str, noise: str, write_mean: bool) -> None:
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
    """Bytes flowrl's Triton kernels move for ``op`` by their launch design (flowrl/_triton_ops.py,
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
    x0_prev: Optional[torch.Tensor] = None  # dpm_sde: the previous step's x0 prediction (second order)

    @property
    def log_prob(self) -> str:
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
        log_prob=baseline.LOG_PROB_KIND[mode], backend="torch", return_prev_sample_mean=False, prev_x0_pred=x0_prev,
    ).prev_sample
    return Case(
        shape=tuple(shape), dtype=dtype, mode=mode, sigmas=sigmas,
        step_index=torch.full((shape[0],), STEP_INDEX, dtype=torch.int64, device=device),
        sigma_max=float(sigmas[1]), x=x, v=v, v_grad=v.detach().clone().requires_grad_(True), v_ref=v_ref,
        noise=noise, prev=prev, grad_out=torch.ones(shape[0], device=device), x0_prev=x0_prev,
    )


def noise_level(mode: str) -> float:
    """The bench's noise level: NOISE_LEVEL, except dpm_sde's, which has none (1.0)."""
    return 1.0 if mode == "dpm_sde" else NOISE_LEVEL


# ---- the implementations: each builds a no-argument callable returning the op's outputs ----------

def _flowrl_fn(case: Case, op: str, backend: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    common = dict(mode=case.mode, noise_level=noise_level(case.mode), backend=backend, prev_x0_pred=case.x0_prev)
    if op == "rollout":
        def fn():
            out = flowrl.sde_step(
                case.x, case.v, case.sigmas, STEP_INDEX, noise=case.noise, log_prob=case.log_prob,
                return_prev_sample_mean=False, **common,
            )
            return out.prev_sample, out.log_prob
    elif op == "recompute_fwd":
        def fn():
            with torch.no_grad():
                return (flowrl.step_log_prob(
                    case.x, case.v, case.prev, case.sigmas, STEP_INDEX, log_prob=case.log_prob, **common),)
    elif op == "recompute_fwd_bwd":
        def fn():
            lp = flowrl.step_log_prob(
                case.x, case.v_grad, case.prev, case.sigmas, STEP_INDEX, log_prob=case.log_prob, **common)
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
    x, v, v_grad, prev, v_ref, noise = map(flat, (case.x, case.v, case.v_grad, case.prev, case.v_ref, case.noise))
    x0_prev = None if case.x0_prev is None else flat(case.x0_prev)
    scalars = (case.sigmas, case.step_index, case.sigma_max, case.mode, x0_prev)
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
    note: str = ""


def set_bytes(row: Row, numel: int, batch: int, itemsize: int) -> None:
    """The row's bytes per element: the minimum, and the traffic model for the implementations it
    models (the others' traffic is not designed, so they get none)."""
    second_order = row.mode == "dpm_sde"  # the bench runs dpm_sde at order 2 (Case.x0_prev)
    row.min_b_elem = min_bytes(row.op, numel, batch, itemsize, second_order=second_order) / numel
    modelled = row.impl in MODELLED_IMPLS
    row.model_b_elem = (kernel_bytes(row.op, numel, batch, itemsize, second_order=second_order) / numel
                        if modelled else math.nan)


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
    timing_budget_s: float = 0.5, log=print,
) -> Tuple[List[Row], float, List[str]]:
    """Check and time every configuration; returns (rows, copy GB/s, notes)."""
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
            for impl, ms in time_all(fns, device, budget_s=timing_budget_s).items():
                row = op_rows[impl]
                set_rates(row, ms, numel, copy)
                if op == PEAK_OP:
                    peak = peak_extra_bytes(fns[impl], device)
                    row.peak_extra_mib = math.nan if peak is None else peak / 2**20
                    row.grad_mib = numel * itemsize / 2**20
            for row in op_rows.values():
                row.x_eager = op_rows["eager"].time_ms / row.time_ms
                if op_rows["eager"].peak_extra_mib > 0:
                    row.peak_x_eager = row.peak_extra_mib / op_rows["eager"].peak_extra_mib
                if "compile" in op_rows:
                    row.x_compile = op_rows["compile"].time_ms / row.time_ms
                log(f"# {op:18s} {mode} {dname} {shape_s:18s} {row.impl:14s} {row.time_ms:10.4f} ms  {row.note}")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, copy, notes


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| op | mode | dtype | shape | impl | time ms | min B/elem | GB/s | % copy | model B/elem "
            "| GB/s (model) | % copy (model) | x eager | x compile | peak MiB (x eager) | note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peak = "-" if math.isnan(r.peak_extra_mib) else (
            f"{_fmt(r.peak_extra_mib)} ({_fmt(r.peak_x_eager, 2)})" if not math.isnan(r.peak_x_eager)
            else _fmt(r.peak_extra_mib))
        lines.append(
            f"| {r.op} | {r.mode} | {r.dtype} | {r.shape} | {r.impl} | {_fmt(r.time_ms)} | {_fmt(r.min_b_elem, 4)} "
            f"| {_fmt(r.gbps)} | {_fmt(r.pct_copy, 2)} | {_fmt(r.model_b_elem, 4)} | {_fmt(r.gbps_model)} "
            f"| {_fmt(r.pct_copy_model, 2)} | {_fmt(r.x_eager, 2)} | {_fmt(r.x_compile, 2)} | {peak} | {r.note} |"
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
    stem = _slug(f"{header['machine']}_torch-{header['torch']}_triton-{header['triton']}_{header['date']}")
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"reduced sweep: shapes {QUICK_SHAPES}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated, e.g. 1x4096x64,4x16x21x60x104")
    p.add_argument("--dtypes", type=_choices(list(DTYPES)), default=list(DTYPES))
    p.add_argument("--modes", type=_choices(MODES), default=list(MODES))
    p.add_argument("--ops", type=_choices(OPS), default=list(OPS))
    p.add_argument("--impls", type=_choices(IMPLS), default=list(IMPLS))
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch.set_num_threads (1 gives stable timings on a loaded, shared machine)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--time-budget", type=float, default=math.inf,
                   help="stop starting new configurations after this many seconds (the table says so)")
    p.add_argument("--timing-budget", type=float, default=None,
                   help="CPU: seconds of repeated runs per timing (default 0.5, 0.2 with --quick)")
    p.add_argument("--table-from", metavar="CSV",
                   help="print the table of an earlier results CSV, its byte columns recomputed (no run)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"),
                   help="directory for the CSV and .md (default: $OUT, else bench/results)")
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
    print("# " + ", ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    started = time.perf_counter()
    rows, copy, notes = run_sweep(
        device, shapes, args.dtypes, args.modes, args.ops, impls, time_budget_s=args.time_budget,
        timing_budget_s=timing_budget, log=lambda s: print(s, file=sys.stderr, flush=True),
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
    failed = [r for r in rows if r.note.startswith("CHECK FAILED")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
