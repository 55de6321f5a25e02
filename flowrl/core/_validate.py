"""Argument checks shared by every backend and every public entry point.

Each check raises ``ValueError`` / ``TypeError`` whose message names the argument. Checks that read
tensor *values* (the schedule, tensor step indices) need a host sync on CUDA. They are cached per
tensor identity and version (a schedule, or a step-index tensor reused across the log-prob, KL and
loss calls of a batch, is read once), skipped while a CUDA graph is being captured (values cannot be
read then), skipped while ``torch.compile`` traces the op (``torch.compiler.is_compiling()``: the
values are not known at trace time; docs/compile.md), and skipped inside ``flowrl.no_value_checks()``,
the explicit opt-out for loops that must not sync.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from numbers import Integral, Real
from typing import NamedTuple, Sequence, Union

import numpy as np
import torch

from ..contract import LOG_PROB_KINDS, SIGMA_ONE_TOL, Mode, Reduction

MODES = Mode.labels()
REDUCTIONS = Reduction.labels()
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _CheckedValues:
    """Tensors whose values passed a check, by identity and version (not by address: a freed block
    is reused by a new tensor); bounded."""

    def __init__(self, limit: int = 256):
        self._entries: dict = {}
        self._limit = limit

    def __contains__(self, t: torch.Tensor) -> bool:
        entry = self._entries.get(id(t))
        return entry is not None and entry[0]() is t and entry[1] == t._version and entry[2] == t.device

    def add(self, t: torch.Tensor) -> None:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(t)] = (weakref.ref(t), t._version, t.device)


_checked_schedules = _CheckedValues()
_checked_token_sigmas = _CheckedValues()
_checked_step_indices: dict = {}  # num_steps -> _CheckedValues (a range check depends on T)
_skip = threading.local()


@contextlib.contextmanager
def no_value_checks():
    """Inside, the checks that read device values (the schedule's values, the range of tensor step
    indices, the rollout recorder's check that a step's input is the previous step's output) are
    skipped: no host sync, for eager loops on CUDA that must not wait on the device. Every other
    check still runs. Out-of-range indices are then the caller's responsibility."""
    previous = getattr(_skip, "active", False)
    _skip.active = True
    try:
        yield
    finally:
        _skip.active = previous


class checks:
    """The checked mode: every float tensor a public op or loss validates (model outputs, samples, old
    log-probs, advantages, weights, ...) must be finite, asserted on its device without a host sync
    (``torch._assert_async``: a device-side assert on CUDA, which fails at the next sync; an immediate
    ``RuntimeError`` on the CPU) whose message names the argument. The first thing to try when a loss
    goes NaN. ``flowrl.checks(True)`` turns it on for the process (``flowrl.checks(False)`` off), ``with
    flowrl.checks():`` for a block; the environment variable ``FLOWRL_CHECKS=1`` turns it on at import.
    Skipped while torch.compile traces. Off, it costs nothing."""

    _enabled = os.environ.get("FLOWRL_CHECKS", "0") not in ("", "0", "false", "False")

    def __init__(self, enabled: bool = True):
        self._previous = checks._enabled
        checks._enabled = check_bool("enabled", enabled)

    def __enter__(self) -> "checks":
        return self

    def __exit__(self, *exc) -> None:
        checks._enabled = self._previous

    @staticmethod
    def enabled() -> bool:
        return checks._enabled


def assert_finite(name: str, t: torch.Tensor) -> None:
    """In the checked mode, assert on ``t``'s device that it holds no NaN or infinity."""
    if checks._enabled and t.device.type != "meta" and t.is_floating_point() and not torch.compiler.is_compiling():
        torch._assert_async(torch.isfinite(t).all(), f"flowrl.checks: {name} holds a NaN or an infinity")


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _skip_value_reads(t: torch.Tensor = None) -> bool:
    # compiling first: the other two are host state that torch.compile need not trace; a meta tensor
    # (shape inference) has no values to read
    return (torch.compiler.is_compiling() or getattr(_skip, "active", False) or capturing()
            or (t is not None and (t.device.type == "meta" or t.numel() == 0)))  # an empty tensor: no value


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """A bool (numpy's too: configs read from JSON or arrays), as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_float_tensor(name: str, t, *, allow_float64: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    allowed = FLOAT_DTYPES if allow_float64 else FLOAT_DTYPES[:3]
    if t.dtype not in allowed:
        raise TypeError(
            f"{name} must have a floating dtype in "
            f"({', '.join(str(d).replace('torch.', '') for d in allowed)}); got {t.dtype}"
        )
    assert_finite(name, t)
    return t


def check_batch_tensor(name: str, t, like: torch.Tensor, like_name: str = "sample") -> torch.Tensor:
    """``t`` must be a float tensor with ``like``'s shape and device."""
    check_float_tensor(name, t)
    if t.shape != like.shape:
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}; got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}; move them to one device")
    return t


def check_sample(sample, name: str = "sample") -> torch.Tensor:
    """A float tensor [B, ...] with at least one element per sample (``name``: the caller's name for it,
    e.g. an adapter's ``latents``). B = 0, an empty batch, is valid: the ops and losses then return empty
    outputs and launch nothing (docs/guide.md, An empty batch)."""
    check_float_tensor(name, sample)
    if sample.dim() < 1:
        raise ValueError(f"{name} must have a batch dimension (shape [B, ...]); got a 0-d tensor")
    if math.prod(sample.shape[1:]) == 0:
        raise ValueError(f"{name} must have at least one element per sample; got shape {tuple(sample.shape)}")
    return sample


def check_noise_level(noise_level, mode: str, name: str = "noise_level") -> float:
    """A finite real in the mode's range (``Mode.rules.noise_level``: >= 0, <= 1 for cps and ddim,
    exactly 1 for dpm_sde), as a float."""
    if isinstance(noise_level, bool) or not isinstance(noise_level, Real):
        raise TypeError(f"{name} must be a real number; got {type(noise_level).__name__}")
    eta = float(noise_level)
    if not math.isfinite(eta):
        raise ValueError(f"{name} must be finite; got {eta}")
    if eta < 0:
        raise ValueError(f"{name} must be >= 0; got {eta}")
    rules = Mode.parse("mode", mode).rules
    lo, hi = rules.noise_level
    if lo == hi and eta != lo:
        raise ValueError(f"{name} must be {lo} for mode={mode!r} ({rules.fixed_why}); got {eta}")
    if not lo <= eta <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}] for mode={mode!r}; got {eta}")
    return eta


def check_sigmas(sigmas, device: torch.device) -> torch.Tensor:
    """The schedule: 1-D float table of length T + 1 >= 2, strictly decreasing, sigmas[0] <= 1,
    sigmas[T] == 0, sigmas[1] not 1. Returns it on ``device`` (float32 unless given float64)."""
    if not isinstance(sigmas, torch.Tensor):
        raise TypeError(f"sigmas must be a 1-D torch.Tensor schedule; got {type(sigmas).__name__}")
    if sigmas.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"sigmas must be float32 (or float64), the exact schedule table; got {sigmas.dtype}. "
            "Rebuilding or demoting the schedule loses the values the contract reads."
        )
    if sigmas.dim() != 1:
        raise ValueError(f"sigmas must be 1-D (length T + 1); got shape {tuple(sigmas.shape)}")
    if sigmas.numel() < 2:
        raise ValueError(f"sigmas must hold at least 2 values (T >= 1); got {sigmas.numel()}")
    if sigmas.device != device:
        raise ValueError(f"sigmas is on {sigmas.device} but sample is on {device}; move them to one device")
    if sigmas.requires_grad:
        raise ValueError("sigmas requires grad, but the schedule is rollout data that flowrl does not "
                         "differentiate (gradients flow to model_output, sample and prev_sample); pass sigmas.detach()")
    if _skip_value_reads(sigmas) or sigmas in _checked_schedules:
        return sigmas
    s = sigmas.detach().double().cpu()
    if not bool(torch.isfinite(s).all()):
        raise ValueError("sigmas must be finite")
    if not bool((s[1:] < s[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing")
    if s[0] > 1 or s[-1] != 0:
        raise ValueError(
            f"sigmas must start at <= 1 and end at 0 (diffusers' set_timesteps appends the terminal 0); "
            f"got sigmas[0] = {float(s[0])}, sigmas[-1] = {float(s[-1])}"
        )
    if abs(float(s[1].float()) - 1.0) <= SIGMA_ONE_TOL:  # the host copy: no second sync
        raise ValueError(
            "sigmas[1] must not be 1: the sde mode replaces sigma = 1 by sigmas[1] at the first step, "
            "which would divide by zero"
        )
    _checked_schedules.add(sigmas)
    return sigmas


_checked_alpha_bar_tables = {True: _CheckedValues(), False: _CheckedValues()}  # by "a_t may be 0"


def check_alpha_bar_table(table, device: torch.device, *, allow_zero_alpha: bool) -> torch.Tensor:
    """ddim's schedule (passed as ``sigmas``): a 1-D float32 (or float64) table [2T] holding, for each
    loop step i, ``table[2i] = alpha_bar_t`` and ``table[2i + 1] = alpha_bar_prev`` (diffusers'
    ``alphas_cumprod[t]`` and ``alphas_cumprod[t - ratio]`` or ``final_alpha_cumprod``), with
    ``0 <= alpha_bar_t < 1``, ``alpha_bar_t <= alpha_bar_prev <= 1`` and ``alpha_bar_prev > 0``.
    ``alpha_bar_t == 0`` (a zero-terminal-SNR schedule's first step) only when ``allow_zero_alpha``
    (v- and sample-prediction; epsilon-prediction divides by sqrt(alpha_bar_t))."""
    name = "sigmas (mode='ddim': the alpha-bar table [2T] of (alpha_bar_t, alpha_bar_prev) pairs)"
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D torch.Tensor; got {type(table).__name__}")
    if table.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64); got {table.dtype}")
    if table.dim() != 1 or table.numel() < 2 or table.numel() % 2:
        raise ValueError(f"{name} must be 1-D of even length >= 2; got shape {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"sigmas is on {table.device} but sample is on {device}; move them to one device")
    checked = _checked_alpha_bar_tables[bool(allow_zero_alpha)]
    if _skip_value_reads(table) or table in checked:
        return table
    pairs = table.detach().double().cpu().reshape(-1, 2)
    a_t, a_prev = pairs[:, 0], pairs[:, 1]
    if not bool(torch.isfinite(pairs).all()):
        raise ValueError(f"{name} must be finite")
    if not bool(((a_prev > 0) & (a_prev <= 1)).all()):
        raise ValueError(f"{name}: every alpha_bar_prev (odd entries) must be in (0, 1]; got {a_prev.tolist()}")
    if not bool(((a_t >= 0) & (a_t < 1) & (a_t <= a_prev)).all()):
        raise ValueError(f"{name}: every alpha_bar_t (even entries) must be in [0, 1) and <= its alpha_bar_prev; "
                         f"got pairs {pairs.tolist()}")
    if not allow_zero_alpha and not bool((a_t > 0).all()):
        raise ValueError(f"{name}: alpha_bar_t = 0 (zero terminal SNR) needs prediction_type 'v_prediction' or "
                         "'sample': epsilon-prediction divides by sqrt(alpha_bar_t)")
    checked.add(table)
    return table


def check_clip_sample_range(clip_sample_range):
    """None (no clipping) or a finite real > 0, as a float."""
    if clip_sample_range is None:
        return None
    if isinstance(clip_sample_range, bool) or not isinstance(clip_sample_range, Real):
        raise TypeError(f"clip_sample_range must be None or a real number; got {type(clip_sample_range).__name__}")
    value = float(clip_sample_range)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"clip_sample_range must be finite and > 0 (or None: no clipping); got {value}")
    return value


def check_step_index(step_index, num_steps: int, batch: int, device: torch.device,
                     name: str = "step_index") -> torch.Tensor:
    """An int (whole batch) or an integer tensor, 0-d or [B]; returns an int64 tensor [B] on ``device``."""
    if isinstance(step_index, bool):
        raise TypeError(f"{name} must be an int or an integer tensor of shape [B]; got a bool")
    if isinstance(step_index, Integral):
        i = int(step_index)
        if not 0 <= i < num_steps:
            raise ValueError(f"{name} must be in [0, {num_steps - 1}] (the schedule has T = {num_steps} steps); got {i}")
        return torch.full((batch,), i, dtype=torch.int64, device=device)
    if not isinstance(step_index, torch.Tensor):
        raise TypeError(f"{name} must be an int or an integer tensor of shape [B]; got {type(step_index).__name__}")
    if step_index.dtype.is_floating_point or step_index.dtype.is_complex or step_index.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor; got {step_index.dtype}")
    values = step_index  # a 0-d index is read as given (its value is checked on an empty batch too)
    if step_index.dim() == 0:
        step_index = step_index.reshape(1).expand(batch)
    if step_index.dim() != 1 or step_index.shape[0] != batch:
        raise ValueError(f"{name} must be an int or a tensor of shape [B] = [{batch}]; got shape {tuple(step_index.shape)}")
    checked = _checked_step_indices.setdefault(num_steps, _CheckedValues())
    if not _skip_value_reads(values) and values not in checked:
        lo, hi = torch.stack(torch.aminmax(values)).tolist()  # one device-to-host copy for both bounds
        if lo < 0 or hi >= num_steps:
            raise ValueError(
                f"{name} must be in [0, {num_steps - 1}] (the schedule has T = {num_steps} steps); "
                f"got values in [{lo}, {hi}]"
            )
        checked.add(values)
    return step_index.to(device=device, dtype=torch.int64)


def check_out_dtype(out_dtype, default: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        return default
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, float64; got {out_dtype!r}")
    return out_dtype


def check_generator(generator, batch: int):
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"generator must be one torch.Generator or a list of B = {batch} generators; got a list of {len(generator)}")
        for k, g in enumerate(generator):
            if not isinstance(g, torch.Generator):
                raise TypeError(f"generator[{k}] must be a torch.Generator; got {type(g).__name__}")
        return list(generator)
    raise TypeError(f"generator must be None, a torch.Generator or a list of them; got {type(generator).__name__}")


def check_broadcastable(name: str, t, sample: torch.Tensor) -> torch.Tensor:
    """``t`` must be a tensor with the sample's ndim, on its device, each dim 1 or the sample's (a
    compact per-token / per-element value broadcast to the sample: [B, S, 1] for [B, S, C] tokens)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor broadcastable to sample; got {type(t).__name__}")
    if t.dim() != sample.dim():
        raise ValueError(
            f"{name} must have the sample's ndim {sample.dim()} (each dim 1 or the sample's, e.g. "
            f"{tuple(sample.shape[:2]) + (1,) * (sample.dim() - 2)}); got shape {tuple(t.shape)}"
        )
    if any(d != 1 and d != s for d, s in zip(t.shape, sample.shape)):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to sample {tuple(sample.shape)} "
            "(each dim must be 1 or the sample's)"
        )
    if t.device != sample.device:
        raise ValueError(f"{name} is on {t.device} but sample is on {sample.device}; move them to one device")
    return t


def check_token_sigmas(token_sigmas, sample: torch.Tensor, name: str = "token_sigmas") -> torch.Tensor:
    """Each token's current sigma: a float32 (or float64) tensor broadcastable to the sample, values
    in [0, 1] (read once per tensor version; skipped under no_value_checks / capture)."""
    check_broadcastable(name, token_sigmas, sample)
    if token_sigmas.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"{name} must be float32 (or float64), like the schedule; got {token_sigmas.dtype} "
            "(a half-precision sigma is not a schedule value)"
        )
    if not _skip_value_reads(token_sigmas) and token_sigmas not in _checked_token_sigmas:
        lo, hi = torch.stack(torch.aminmax(token_sigmas.detach().double())).tolist()
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or hi > 1:
            raise ValueError(f"{name} must be finite sigmas in [0, 1]; got values in [{lo}, {hi}]")
        _checked_token_sigmas.add(token_sigmas)
    return token_sigmas


def check_frozen(frozen, sample: torch.Tensor, name: str = "frozen") -> torch.Tensor:
    """A bool mask broadcastable to the sample: True marks a conditioning element (x' = x)."""
    check_broadcastable(name, frozen, sample)
    if frozen.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True: a frozen conditioning element); got {frozen.dtype}")
    return frozen


class NoiseSeed(NamedTuple):
    """A validated ``noise_seed`` (in-kernel Philox noise, see flowrl.backends.reference.philox_normal).

    seeds: int64 [B] on the sample's device, the Philox key of each sample (its 64 bits).
    stream_stride: sample b uses Philox stream b * stream_stride: 1 for an int seed (the samples of
        one call differ), 0 for a per-sample seed tensor (a sample's noise depends on its seed only).
    elem_offset: index in the flattened sample of the first local element (a sequence-parallel
        shard's start; 0 on one device)."""

    seeds: torch.Tensor
    stream_stride: int
    elem_offset: int = 0


def check_noise_seed(noise_seed, sample: torch.Tensor) -> NoiseSeed:
    """An int in [0, 2**63) (one seed, samples on streams 0..B-1) or an integer tensor [B] of
    per-sample seeds on the sample's device (any int64 value)."""
    batch = sample.shape[0]
    if isinstance(noise_seed, bool):
        raise TypeError("noise_seed must be an int or an integer tensor of shape [B]; got a bool")
    if isinstance(noise_seed, Integral):
        seed = int(noise_seed)
        if not 0 <= seed < 2**63:
            raise ValueError(f"noise_seed must be in [0, 2**63); got {seed}")
        return NoiseSeed(torch.full((batch,), seed, dtype=torch.int64, device=sample.device), 1)
    if not isinstance(noise_seed, torch.Tensor):
        raise TypeError(f"noise_seed must be an int or an integer tensor of shape [B]; got {type(noise_seed).__name__}")
    if noise_seed.dtype.is_floating_point or noise_seed.dtype.is_complex or noise_seed.dtype == torch.bool:
        raise TypeError(f"noise_seed must be an integer tensor (int64 seeds); got {noise_seed.dtype}")
    if noise_seed.shape != (batch,):
        raise ValueError(
            f"noise_seed must be an int or a tensor of shape [B] = [{batch}] (one seed per sample); "
            f"got shape {tuple(noise_seed.shape)}"
        )
    if noise_seed.device != sample.device:
        raise ValueError(f"noise_seed is on {noise_seed.device} but sample is on {sample.device}; move them to one device")
    return NoiseSeed(noise_seed.to(torch.int64).contiguous(), 0)


Scalar = Union[int, float]
StepIndex = Union[int, torch.Tensor]
__all__ = [
    "MODES", "LOG_PROB_KINDS", "REDUCTIONS", "check_bool", "check_choice", "check_float_tensor", "check_batch_tensor",
    "check_sample", "check_noise_level", "check_sigmas", "check_alpha_bar_table", "check_clip_sample_range",
    "check_step_index", "check_out_dtype", "check_generator", "check_noise_seed", "check_broadcastable",
    "check_token_sigmas", "check_frozen", "NoiseSeed", "capturing", "no_value_checks",
]
