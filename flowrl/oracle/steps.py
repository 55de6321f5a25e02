"""The step's transition in float64, every mode of ``flowrl.contract.Mode`` (docs/contract.md, Modes).

Each mode's mean and std is its row of the contract's table, written out as the formula reads:

- ``ode``: std 0, mu = x - D v.
- ``sde``: s = eta sqrt(sigma / (1 - sigma_t)) (sigma_t = sigmas[1] where sigma is 1 within rtol 1e-5),
  std = s sqrt(D), mu = x (1 - s^2 D / (2 sigma)) - v (1 + s^2 (1 - sigma) / (2 sigma)) D.
- ``dance``: ``sde`` with s = eta.
- ``flash_sde``: ``sde`` with s = eta (sigma_min + (sigma_max - sigma_min) sigma), sigma_max = sigmas[1],
  sigma_min = sigmas[-1].
- ``cps``: std = sigma' sin(eta pi / 2), mu = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat with
  sqrt(sigma'^2 - std^2) taken as sigma' cos(eta pi / 2) (the same number, no cancellation).
- ``dpm_sde`` (SDE-DPM-Solver++): q = (alpha sigma') / (sigma alpha'), B = alpha' (1 - q^2),
  std = sigma' sqrt(1 - q^2), mu = (sigma' / sigma) q x + (B + B2) x0_hat - B2 x0_prev, with
  B2 = B (h / h_prev) / 2 = B log(q) / (2 log(q_prev)) at order 2 (``prev_x0_pred=`` given, step > 0,
  sigma' > 0, and the previous step not from sigma = 1), else 0.
- ``ddim``: on the alpha-bar table (``sigmas[2i] = a``, ``sigmas[2i + 1] = a'``), x0_hat / eps_hat per
  ``prediction_type``, std = eta sqrt((1 - a') / (1 - a) (1 - a / a')), mu = sqrt(a') clip(x0_hat) +
  sqrt(max(1 - a' - std^2, 0)) eps_hat.

The sample is x' = mu + std eps (before any rounding: a caller compares it with the emitted x' at that
dtype's rounding). The log-prob is of the ``x_prev`` given (the contract: of the emitted sample), per
element ``gaussian`` -r^2 / (2 std_d^2) - log(std_d) - log(sqrt(2 pi)), ``kernel`` -r^2 / (2 std_d^2),
``sq_err`` -r^2 with std_d = max(std, 2^-40), reduced by a plain float64 sum (``mean``: / element count).
The KL is (mu - mu_ref)^2 / (2 std_d^2) per element, reduced alike. A step with std 0 is deterministic:
log-prob and KL 0 with zero gradient.

Step scalars (sigma, sigma', a, a', the coefficients) are Python floats computed in float64 from the
float32 table; the elementwise work is float64 torch ops, so autograd differentiates it. Rows are one at
a time: each sample has its own step. A mode or option this module has no row for raises
``NotImplementedError`` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

# contract (Modes): sigma counts as 1 under an fp32 isclose with rtol 1e-5
SIGMA_ONE_RTOL = 1e-5
# contract: the log-prob and KL divide by max(std, 2**-40) (std == 0 is the deterministic rule)
STD_FLOOR = 2.0**-40
F64 = torch.float64

FLOW_MODES = ("ode", "sde", "dance", "cps", "dpm_sde", "flash_sde")
MODES = FLOW_MODES + ("ddim",)
PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
LOG_PROB_KINDS = ("gaussian", "kernel", "sq_err")
REDUCTIONS = ("mean", "sum")


def mode_name(mode) -> str:
    """A mode's spelling: a ``flowrl.contract.Mode`` member or its string; NotImplementedError for a mode
    this oracle has no row for (so a new Mode fails the contract test instead of skipping)."""
    name = getattr(mode, "label", mode)
    if name not in MODES:
        raise NotImplementedError(f"flowrl.oracle has no float64 row for mode {name!r}: add it to "
                                  "flowrl/oracle/steps.py from docs/contract.md's formulas")
    return name


@dataclass(frozen=True)
class DDIM:
    """mode='ddim''s options: ``prediction_type`` and ``clip_sample_range`` (None: no clip)."""

    prediction_type: str = "epsilon"
    clip_sample_range: Optional[float] = None


@dataclass(frozen=True)
class Step:
    """One sample's step scalars (float64 Python numbers). ``s``: sde / dance / flash_sde's diffusion
    coefficient (0 otherwise). ``q``, ``b2``: dpm_sde's e^{-h} and second-order coefficient B2 (0: first
    order). ``a``, ``a_prev``: ddim's alpha-bar pair (sigma and sigma' are 0 for ddim)."""

    sigma: float
    sigma_next: float
    std: float
    s: float = 0.0
    q: float = 0.0
    b2: float = 0.0
    a: float = 0.0
    a_prev: float = 0.0

    @property
    def d(self) -> float:
        return self.sigma - self.sigma_next


def _table(sigmas) -> List[float]:
    return [float(v) for v in torch.as_tensor(sigmas).detach().cpu().to(F64)]


def _dpm_q(sigma: float, sigma_next: float) -> float:
    """e^{-h} = (alpha sigma') / (sigma alpha'), alpha = 1 - sigma: 0 at sigma = 1 and at sigma' = 0."""
    return (1 - sigma) * sigma_next / (sigma * (1 - sigma_next))


def step_scalars(sigmas, i: int, mode, eta: float, *, second_order: bool = False) -> Step:
    """Step ``i``'s scalars from the float32 table (``second_order``: dpm_sde with ``prev_x0_pred``)."""
    mode = mode_name(mode)
    table = _table(sigmas)
    if mode == "ddim":
        a, a_prev = table[2 * i], table[2 * i + 1]
        std = eta * math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        return Step(0.0, 0.0, std, a=a, a_prev=a_prev)
    sigma, sigma_next = table[i], table[i + 1]
    d = sigma - sigma_next
    if mode == "ode":
        return Step(sigma, sigma_next, 0.0, 0.0)
    if mode in ("sde", "dance", "flash_sde"):
        if mode == "sde":
            sigma_t = table[1] if math.isclose(sigma, 1.0, rel_tol=SIGMA_ONE_RTOL) else sigma
            s = eta * math.sqrt(sigma / (1.0 - sigma_t))
        elif mode == "dance":
            s = eta
        else:
            sigma_max, sigma_min = table[1], table[-1]
            s = eta * (sigma_min + (sigma_max - sigma_min) * sigma)
        return Step(sigma, sigma_next, s * math.sqrt(d), s)
    if mode == "cps":
        return Step(sigma, sigma_next, sigma_next * math.sin(eta * math.pi / 2), 0.0)
    # dpm_sde
    q = _dpm_q(sigma, sigma_next)
    std = sigma_next * math.sqrt(1 - q * q)
    b2 = 0.0
    if second_order and i > 0 and q > 0:
        q_prev = _dpm_q(table[i - 1], sigma)  # 0 after a step from sigma = 1 (h_prev = inf): first order
        if 0 < q_prev < 1:
            b2 = (1 - sigma_next) * (1 - q * q) * math.log(q) / (2 * math.log(q_prev))
    return Step(sigma, sigma_next, std, q=q, b2=b2)


def indices(step_index: Union[int, Sequence[int], torch.Tensor], batch: int) -> List[int]:
    if isinstance(step_index, int):
        return [step_index] * batch
    return [int(i) for i in step_index]


def _ddim_mean(x: torch.Tensor, v: torch.Tensor, st: Step, ddim: DDIM) -> torch.Tensor:
    a, ap = st.a, st.a_prev
    if ddim.prediction_type == "epsilon":
        x0_hat, eps_hat = (x - math.sqrt(1 - a) * v) / math.sqrt(a), v
    elif ddim.prediction_type == "sample":
        x0_hat, eps_hat = v, (x - math.sqrt(a) * v) / math.sqrt(1 - a)
    elif ddim.prediction_type == "v_prediction":
        x0_hat, eps_hat = math.sqrt(a) * x - math.sqrt(1 - a) * v, math.sqrt(a) * v + math.sqrt(1 - a) * x
    else:
        raise NotImplementedError(f"flowrl.oracle: no ddim row for prediction_type={ddim.prediction_type!r}")
    if ddim.clip_sample_range is not None:
        x0_hat = x0_hat.clamp(-ddim.clip_sample_range, ddim.clip_sample_range)
    return math.sqrt(ap) * x0_hat + math.sqrt(max(1 - ap - st.std * st.std, 0.0)) * eps_hat


def row_mean(x: torch.Tensor, v: torch.Tensor, st: Step, mode, eta: float,
             x0_prev: Optional[torch.Tensor] = None, ddim: Optional[DDIM] = None) -> torch.Tensor:
    """mu of one sample (float64 tensors ``x``, ``v``; ``x0_prev``: dpm_sde's previous data prediction,
    read when ``st.b2`` is nonzero; ``ddim``: ddim's options)."""
    mode = mode_name(mode)
    sigma, sigma_next, d = st.sigma, st.sigma_next, st.d
    if mode == "ode":
        return x - d * v
    if mode in ("sde", "dance", "flash_sde"):
        s2 = st.s * st.s
        return x * (1 - s2 * d / (2 * sigma)) - v * (1 + s2 * (1 - sigma) / (2 * sigma)) * d
    if mode == "cps":
        x0_hat = x - sigma * v
        x1_hat = x + (1 - sigma) * v
        return (1 - sigma_next) * x0_hat + sigma_next * math.cos(eta * math.pi / 2) * x1_hat
    if mode == "dpm_sde":
        x0_hat = x - sigma * v
        b = (1 - sigma_next) * (1 - st.q * st.q)
        mu = (sigma_next / sigma) * st.q * x + (b + st.b2) * x0_hat
        return mu - st.b2 * x0_prev if st.b2 != 0 else mu
    return _ddim_mean(x, v, st, ddim or DDIM())


@dataclass(frozen=True)
class _Rows:
    """A call's per-sample steps and per-mode inputs, resolved once."""

    mode: str
    eta: float
    steps: List[Step]
    x0_prev: Optional[torch.Tensor]
    ddim: Optional[DDIM]

    def mean(self, b: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        prev = None if self.x0_prev is None else self.x0_prev[b].to(F64)
        return row_mean(x[b].to(F64), v[b].to(F64), self.steps[b], self.mode, self.eta, prev, self.ddim)


def _rows(sigmas, step_index, mode, eta, batch, prev_x0_pred=None, prediction_type=None,
          clip_sample_range=None) -> _Rows:
    mode = mode_name(mode)
    if prev_x0_pred is not None and mode != "dpm_sde":
        raise ValueError(f"prev_x0_pred is mode='dpm_sde''s; got mode={mode!r}")
    ddim = None
    if mode == "ddim":
        ddim = DDIM(prediction_type or "epsilon", clip_sample_range)
    elif prediction_type is not None or clip_sample_range is not None:
        raise ValueError(f"prediction_type and clip_sample_range are mode='ddim''s; got mode={mode!r}")
    second = prev_x0_pred is not None
    steps = [step_scalars(sigmas, i, mode, eta, second_order=second) for i in indices(step_index, batch)]
    return _Rows(mode, eta, steps, prev_x0_pred, ddim)


def mean(x, v, sigmas, step_index, mode, eta: float, *, prev_x0_pred=None, prediction_type=None,
         clip_sample_range=None) -> torch.Tensor:
    """mu of x' given x, float64, x's shape."""
    rows = _rows(sigmas, step_index, mode, eta, x.shape[0], prev_x0_pred, prediction_type, clip_sample_range)
    return torch.stack([rows.mean(b, x, v) for b in range(x.shape[0])])


def std(sigmas, step_index, mode, eta: float, batch: int) -> torch.Tensor:
    """The step's std [B] (float64); the same at orders 1 and 2 and for every ddim prediction type."""
    return torch.tensor([step_scalars(sigmas, i, mode, eta).std for i in indices(step_index, batch)], dtype=F64)


def sample(x, v, noise, sigmas, step_index, mode, eta: float, *, prev_x0_pred=None, prediction_type=None,
           clip_sample_range=None) -> torch.Tensor:
    """x' = mu + std * eps in float64, before any rounding."""
    mu = mean(x, v, sigmas, step_index, mode, eta, prev_x0_pred=prev_x0_pred, prediction_type=prediction_type,
              clip_sample_range=clip_sample_range)
    sd = std(sigmas, step_index, mode, eta, x.shape[0]).reshape((-1,) + (1,) * (x.dim() - 1))
    return mu + sd * noise.to(F64)


def reduce(per_element: torch.Tensor, reduction: str) -> torch.Tensor:
    """One sample's elements summed in float64 (``mean``: divided by their count)."""
    if reduction not in REDUCTIONS:
        raise NotImplementedError(f"flowrl.oracle: no reduction {reduction!r}")
    total = per_element.reshape(-1).sum()
    return total / per_element.numel() if reduction == "mean" else total


def per_element_log_prob(r: torch.Tensor, std_value: float, kind: str) -> torch.Tensor:
    """The contract's per-element log-prob of residual ``r`` (std > 0)."""
    sd = max(std_value, STD_FLOOR)
    if kind == "gaussian":
        return -r * r / (2 * sd**2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
    if kind == "kernel":
        return -r * r / (2 * sd**2)
    if kind == "sq_err":
        return -r * r
    raise NotImplementedError(f"flowrl.oracle: no log-prob kind {kind!r}")


def log_prob(x, v, x_prev, sigmas, step_index, mode, eta: float, kind: str = "gaussian", reduction: str = "mean", *,
             prev_x0_pred=None, prediction_type=None, clip_sample_range=None) -> torch.Tensor:
    """Log-prob [B] (float64) of ``x_prev`` given ``x`` under velocity ``v``; 0 on deterministic steps."""
    rows = _rows(sigmas, step_index, mode, eta, x.shape[0], prev_x0_pred, prediction_type, clip_sample_range)
    out = []
    for b, st in enumerate(rows.steps):
        r = x_prev[b].to(F64) - rows.mean(b, x, v)
        if st.std == 0:
            out.append((r * 0).sum())  # deterministic: exactly 0, zero gradient
            continue
        out.append(reduce(per_element_log_prob(r, st.std, kind), reduction))
    return torch.stack(out)


def kl(x, v, v_ref, sigmas, step_index, mode, eta: float, reduction: str = "mean", *, prev_x0_pred=None,
       prediction_type=None, clip_sample_range=None) -> torch.Tensor:
    """Exact Gaussian KL [B] (float64): (mu - mu_ref)^2 / (2 std^2) per element, reduced; both means at
    the same x (and the same x0_prev)."""
    rows = _rows(sigmas, step_index, mode, eta, x.shape[0], prev_x0_pred, prediction_type, clip_sample_range)
    out = []
    for b, st in enumerate(rows.steps):
        diff = rows.mean(b, x, v) - rows.mean(b, x, v_ref)
        if st.std == 0:
            out.append((diff * 0).sum())
            continue
        out.append(reduce(diff * diff / (2 * max(st.std, STD_FLOOR) ** 2), reduction))
    return torch.stack(out)
