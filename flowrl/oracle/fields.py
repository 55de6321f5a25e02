"""Closed-form velocity fields of Gaussian data, for distributional tests of a sampler (float64).

With x_sigma = (1 - sigma) x0 + sigma eps (docs/contract.md, Notation), the exact velocity is
E[eps - x0 | x_sigma = x]; a sampler driven by it should reach the data distribution.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def gaussian_velocity(x: torch.Tensor, sigma: float, m: float, s: float) -> torch.Tensor:
    """E[eps - x0 | x_sigma = x] for x0 ~ N(m, s^2) per coordinate, x_sigma = (1 - sigma) x0 + sigma eps.

    (eps - x0, x_sigma) are jointly Gaussian: the conditional mean is linear in x."""
    var = (1 - sigma) ** 2 * s * s + sigma * sigma
    cov = sigma - (1 - sigma) * s * s
    return -m + cov / var * (x - (1 - sigma) * m)


def mixture_velocity(x: torch.Tensor, sigma: float, weights, means, stds) -> torch.Tensor:
    """The same for a 1-D Gaussian mixture per coordinate: the components' velocities weighted by
    their posterior responsibilities given x_sigma = x."""
    xd = x.to(F64)
    log_resp, vel = [], []
    for w, m, s in zip(weights, means, stds):
        var = (1 - sigma) ** 2 * s * s + sigma * sigma
        log_resp.append(math.log(w) - 0.5 * math.log(var) - (xd - (1 - sigma) * m) ** 2 / (2 * var))
        vel.append(gaussian_velocity(xd, sigma, m, s))
    resp = torch.softmax(torch.stack(log_resp), dim=0)
    return (resp * torch.stack(vel)).sum(0).to(x.dtype)
