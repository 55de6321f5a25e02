"""An independent float64 implementation of the math contract (docs/contract.md), for tests only.

Written from the contract's formulas, not from ``flowrl.backends.reference``: each mode's mean is the
contract's row as written (``cps`` through ``x0_hat`` / ``x1_hat``, with ``sqrt(sigma'^2 - std^2)`` taken as
``sigma' * cos(eta * pi / 2)``, the same number without a cancellation), each log-prob kind is its
per-element row, and reductions are plain float64 sums. Step scalars are Python floats read from the
float32 schedule table; the elementwise work is in float64 torch ops only so that autograd can
differentiate it for the gradient tests. Rows are handled one at a time: each sample has its own step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Union

import torch

# contract (Modes): sigma counts as 1 under an fp32 isclose with rtol 1e-5
SIGMA_ONE_RTOL = 1e-5
# contract: the log-prob and KL divide by max(std, 2**-40) (std == 0 is the deterministic rule)
STD_FLOOR = 2.0**-40
F64 = torch.float64


@dataclass(frozen=True)
class Step:
    sigma: float
    sigma_next: float
    std: float
    s: float  # the sde/dance diffusion coefficient (0 for ode/cps)

    @property
    def d(self) -> float:
        return self.sigma - self.sigma_next


def step_scalars(sigmas: torch.Tensor, i: int, mode: str, eta: float) -> Step:
    """sigma, sigma', std of step ``i`` as float64 Python numbers, from the float32 table."""
    table = [float(v) for v in sigmas.detach().cpu().to(F64)]
    sigma, sigma_next = table[i], table[i + 1]
    d = sigma - sigma_next
    if mode == "ode":
        return Step(sigma, sigma_next, 0.0, 0.0)
    if mode == "sde":
        sigma_t = table[1] if math.isclose(sigma, 1.0, rel_tol=SIGMA_ONE_RTOL) else sigma
        s = eta * math.sqrt(sigma / (1.0 - sigma_t))
        return Step(sigma, sigma_next, s * math.sqrt(d), s)
    if mode == "dance":
        return Step(sigma, sigma_next, eta * math.sqrt(d), eta)
    if mode == "cps":
        return Step(sigma, sigma_next, sigma_next * math.sin(eta * math.pi / 2), 0.0)
    raise ValueError(mode)


def _indices(step_index: Union[int, Sequence[int], torch.Tensor], batch: int) -> List[int]:
    if isinstance(step_index, int):
        return [step_index] * batch
    return [int(i) for i in step_index]


def _row_mean(x: torch.Tensor, v: torch.Tensor, st: Step, mode: str, eta: float) -> torch.Tensor:
    sigma, sigma_next, d = st.sigma, st.sigma_next, st.d
    if mode == "ode":
        return x - d * v
    if mode in ("sde", "dance"):
        s2 = st.s * st.s
        return x * (1 - s2 * d / (2 * sigma)) - v * (1 + s2 * (1 - sigma) / (2 * sigma)) * d
    if mode != "cps":
        raise ValueError(f"no float64 mean for mode {mode!r}: add its row (docs/contract.md, Modes)")
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    return (1 - sigma_next) * x0_hat + sigma_next * math.cos(eta * math.pi / 2) * x1_hat


def mean(x, v, sigmas, step_index, mode: str, eta: float) -> torch.Tensor:
    """mu of x' given x, float64, x's shape."""
    idx = _indices(step_index, x.shape[0])
    rows = [
        _row_mean(x[b].to(F64), v[b].to(F64), step_scalars(sigmas, idx[b], mode, eta), mode, eta)
        for b in range(x.shape[0])
    ]
    return torch.stack(rows)


def std(sigmas, step_index, mode: str, eta: float, batch: int) -> torch.Tensor:
    idx = _indices(step_index, batch)
    return torch.tensor([step_scalars(sigmas, i, mode, eta).std for i in idx], dtype=F64)


def sample(x, v, noise, sigmas, step_index, mode: str, eta: float) -> torch.Tensor:
    """x' = mu + std * eps in float64, before any rounding."""
    mu = mean(x, v, sigmas, step_index, mode, eta)
    sd = std(sigmas, step_index, mode, eta, x.shape[0]).reshape((-1,) + (1,) * (x.dim() - 1))
    return mu + sd * noise.to(F64)


def _reduce(per_element: torch.Tensor, reduction: str) -> torch.Tensor:
    total = per_element.reshape(-1).sum()
    return total / per_element.numel() if reduction == "mean" else total


def log_prob(x, v, x_prev, sigmas, step_index, mode: str, eta: float, kind: str = "gaussian",
             reduction: str = "mean") -> torch.Tensor:
    """Log-prob [B] (float64) of ``x_prev`` given ``x`` under velocity ``v``; 0 on deterministic steps."""
    idx = _indices(step_index, x.shape[0])
    out = []
    for b in range(x.shape[0]):
        st = step_scalars(sigmas, idx[b], mode, eta)
        mu = _row_mean(x[b].to(F64), v[b].to(F64), st, mode, eta)
        r = x_prev[b].to(F64) - mu
        if st.std == 0:
            out.append((r * 0).sum())  # deterministic: exactly 0, zero gradient
            continue
        sd = max(st.std, STD_FLOOR)
        if kind == "gaussian":
            per = -r * r / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
        elif kind == "kernel":
            per = -r * r / (2 * sd ** 2)
        elif kind == "sq_err":
            per = -r * r
        else:
            raise ValueError(kind)
        out.append(_reduce(per, reduction))
    return torch.stack(out)


def kl(x, v, v_ref, sigmas, step_index, mode: str, eta: float, reduction: str = "mean") -> torch.Tensor:
    """Exact Gaussian KL [B] (float64): (mu - mu_ref)^2 / (2 std^2) per element, reduced."""
    idx = _indices(step_index, x.shape[0])
    out = []
    for b in range(x.shape[0]):
        st = step_scalars(sigmas, idx[b], mode, eta)
        xb = x[b].to(F64)
        diff = _row_mean(xb, v[b].to(F64), st, mode, eta) - _row_mean(xb, v_ref[b].to(F64), st, mode, eta)
        if st.std == 0:
            out.append((diff * 0).sum())
            continue
        out.append(_reduce(diff * diff / (2 * max(st.std, STD_FLOOR) ** 2), reduction))
    return torch.stack(out)


# ---- closed-form velocity fields, for the distributional tests ---------------------------------

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
