"""The backend table and the one place that decides which backend runs.

``BACKEND_TABLE`` maps a backend's name to its ops: the three step ops, each taking a ``StepSpec``
and the tensors, and the two per-sample reductions of ``flowrl.losses``. The public ops and the
losses both pick their backend here, and each backend keeps its helpers to itself. ``backend="auto"`` runs the Triton kernels on CUDA tensors when triton imports, the torch
reference otherwise. ``FLOWRL_BACKEND=torch|triton`` in the environment replaces ``"auto"`` (an
explicit ``backend=`` argument always wins). Triton on CPU tensors runs only under
``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

BACKENDS = ("auto", "torch", "triton")  # the names ``backend=`` accepts
ENV_VAR = "FLOWRL_BACKEND"


@dataclass(frozen=True)
class Backend:
    """One backend's ops: ``sde_step(spec, sample, model_output, noise)`` -> (prev_sample, log_prob,
    mean or None, std, count); ``step_log_prob(spec, sample, model_output, prev_sample)`` and
    ``step_kl(spec, sample, model_output, ref_model_output)`` -> (value [B], count [B]).

    The losses' ops (flowrl.losses): ``grpo_values(loss, inputs)`` (a ``GRPOLossSpec`` and its
    ``GRPOInputs``, flowrl/core/loss_spec.py) -> (log_prob, kl, trust_divergence) [B] (zeros where absent);
    ``flow_sums(kind, count, xt, v, other, x0, ref, t, coefs, shard=None, noise_seed=None)``
    -> the forward-process loss ``kind``'s (``contract.FlowLoss``) per-sample sums [count, B] (``noise_seed``:
    DPO / DGPO's eps drawn from Philox in place of ``other``). Under sequence
    parallelism (``loss.step.shard``, or flow_sums' ``shard``, a ``ShardContext``) both gather the chunk
    partials across the ranks, as the step ops do: the [B] values are the full samples'."""

    name: str
    sde_step: Callable
    step_log_prob: Callable
    step_kl: Callable
    grpo_values: Optional[Callable] = None
    flow_sums: Optional[Callable] = None


def _torch_backend() -> Backend:
    from . import reference, reference_losses  # on first use, as the Triton one (no cycle: they do not import this)

    return Backend("torch", reference.sde_step, reference.step_log_prob, reference.step_kl,
                   reference_losses.grpo_values, reference_losses.flow_sums)


def _triton_backend() -> Backend:
    from . import _triton_losses, _triton_ops  # lazy: they import triton, an optional dependency

    return Backend("triton", _triton_ops.sde_step, _triton_ops.step_log_prob, _triton_ops.step_kl,
                   _triton_losses.grpo_values, _triton_losses.flow_sums)


# name -> loader (the Triton backend imports triton, so it loads on first use)
BACKEND_TABLE = {"torch": _torch_backend, "triton": _triton_backend}


@functools.lru_cache(maxsize=None)
def backend(name: str) -> Backend:
    """The ops of backend ``name`` ("torch" or "triton"), from ``BACKEND_TABLE``."""
    return BACKEND_TABLE[name]()


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str:
    try:
        import triton  # noqa: F401

        from . import _triton_ops  # noqa: F401  (lazy: triton is optional; this is the probe)
    except Exception as exc:  # ImportError, or a broken triton install
        return f"{type(exc).__name__}: {exc}"
    return ""


def triton_available() -> bool:
    return not _triton_import_error()


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to run for tensors on ``device`` with storage ``dtype``: "torch" or "triton"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend == "auto":
        forced = os.environ.get(ENV_VAR, "").strip().lower()
        if forced:
            if forced not in BACKENDS:
                raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKENDS)}; got {forced!r}")
            backend = forced
    if backend == "auto":
        if device.type == "cuda" and dtype != torch.float64 and triton_available():
            return "triton"
        return "torch"
    if backend == "triton":
        if dtype == torch.float64:
            raise TypeError("backend='triton' takes float32, bfloat16 or float16 tensors; float64 runs on backend='torch'")
        if not triton_available():
            raise RuntimeError(f"backend='triton' was requested but triton cannot be used: {_triton_import_error()}")
        if device.type != "cuda" and not interpreter_enabled():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got tensors on {device}); set TRITON_INTERPRET=1 "
                "before importing triton to run the kernels on the CPU through Triton's interpreter"
            )
    return backend


def select(backend_arg: str, *tensors: torch.Tensor) -> Backend:
    """The backend's ops for these tensors (their device; float64 when any is float64)."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else tensors[0].dtype
    return backend(resolve(backend_arg, tensors[0].device, dtype))
