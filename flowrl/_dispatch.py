"""Backend selection: the one place that decides which implementation runs.

``backend="auto"`` runs the Triton kernels on CUDA tensors when triton imports, the torch reference
otherwise. ``FLOWRL_BACKEND=torch|triton`` in the environment replaces ``"auto"`` (an explicit
``backend=`` argument always wins). Triton on CPU tensors runs only under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "FLOWRL_BACKEND"


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str:
    try:
        import triton  # noqa: F401

        from . import _triton_ops  # noqa: F401
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


def module(name: str) -> ModuleType:
    if name == "triton":
        from . import _triton_ops

        return _triton_ops
    from . import reference

    return reference
