"""Measurement (bench/run.py): every implementation's outputs checked against the eager baseline's (``check``),
its median time (``time_all``), the copy bandwidth the rates are measured against, the peak memory beyond the
inputs, and the machine a table was taken on."""
from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from cases import CHECK_RTOL, COPY_BYTES
from roofline import set_rates


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
