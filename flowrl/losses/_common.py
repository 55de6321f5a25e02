"""What every loss of ``flowrl.losses`` shares: the argument checks (each error names the argument) and
the forward-process losses' per-sample sums through the backend table (``Backend.flow_sums``: nft, awm,
dpo, dgpo)."""
from __future__ import annotations

import math
from numbers import Real
from typing import Tuple

import torch

from ..backends import _dispatch
from ..core import _validate as V


def _check_no_grad(**tensors):
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad, but flowrl.losses differentiates model_output only; pass "
                             f"{name}.detach() (it is rollout data or a frozen policy's output)")


def _check_per_sample(name: str, t, batch: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float tensor of shape [B] = [{batch}]; got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor; got {t.dtype}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}]; got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but sample is on {device}")
    V.assert_finite(name, t)  # the checked mode (flowrl.checks)
    return t


def _check_scalar(name: str, value, *, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number; got {value!r}")
    value = float(value)
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}; got {value}")
    return value


def check_clip_range(clip_range) -> Tuple[float, float]:
    """``clip_range``: eps (ratio clipped to [1 - eps, 1 + eps]) or a pair (eps_low, eps_high) (ratio
    clipped to [1 - eps_low, 1 + eps_high]); each finite and >= 0, and eps_low < 1: a ratio is positive,
    so a lower bound at or below 0 would never clip (eps = 1.5 is a typo for 0.15, not a setting)."""
    if isinstance(clip_range, (tuple, list)):
        if len(clip_range) != 2:
            raise ValueError(f"clip_range must be a float or a pair (eps_low, eps_high); got {clip_range!r}")
        low, high = (_check_scalar("clip_range[0] (eps_low)", clip_range[0]),
                     _check_scalar("clip_range[1] (eps_high)", clip_range[1]))
        name = "clip_range[0] (eps_low)"
    else:
        low = high = _check_scalar("clip_range", clip_range)
        name = "clip_range"
    if low >= 1:
        raise ValueError(f"{name} must be < 1 (the ratio's lower clip bound is 1 - eps_low, and a ratio is "
                         f"positive); got {low}")
    return low, high


def _flow_backend(backend_arg, *tensors):
    """The backend a forward-process loss runs on (its tensors that are not None)."""
    return _dispatch.select(backend_arg, *(u for u in tensors if u is not None))


def _flow_sums(backend_arg, kind, count, xt, v, other, x0, ref, t, coefs, shard=None, noise_seed=None):
    """[count, B] per-sample sums of the forward-process loss ``kind`` on the backend of its tensors
    (``shard``: the full samples' sums under sequence parallelism, the same on every rank; ``noise_seed``:
    eps drawn from Philox instead of ``other``, the backends' flow_sums)."""
    ops = _flow_backend(backend_arg, xt, v, other, x0, ref)
    if noise_seed is None:
        return ops.flow_sums(kind, count, xt, v, other, x0, ref, t, coefs, shard=shard)
    return ops.flow_sums(kind, count, xt, v, other, x0, ref, t, coefs, shard=shard, noise_seed=noise_seed)
