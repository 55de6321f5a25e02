"""Property test: no output and no gradient of flowrl's public ops is NaN or inf anywhere in the
valid domain (docs/contract.md, Deterministic steps: "No input in the valid domain ever produces NaN
or inf").

Domain (hypothesis draws every axis independently; ``derandomize=True``, so CI sees the same examples):

- schedules: float32, built as diffusers builds them (float64 math, cast to float32, terminal 0
  appended), T = 1 .. 1000 steps (few and many):
    shifted      s * t / (1 + (s - 1) * t), t = linspace(1, 0, T + 1) without its last point, s in [1, 10]
    dynamic      exp(mu) / (exp(mu) + (1 / t - 1) ** e), same t (Flux), mu in [0, ln 10], e in [0.5, 1.25]
    beta         sigma_min + ppf(1 - linspace(0, 1, T); a, b) * (sigma_max - sigma_min) (diffusers'
                 use_beta_sigmas, scipy.stats.beta), a, b in [0.5, 1]
    karras       (max**(1/7) + linspace(0, 1, T) * (min**(1/7) - max**(1/7))) ** 7 (rho = 7)
    exponential  exp(linspace(log sigma_max, log sigma_min, T))
  with sigma_max in [0.05, 1] (often exactly 1, or just below it: 1 - 1.1e-5, 0.9999, 0.999) and
  sigma_min = sigma_max * 10**-u, u in [1e-3, 4].
  Only valid schedules are kept (``flowrl.core._validate.check_sigmas``: strictly decreasing in float32,
  sigmas[0] <= 1, sigmas[-1] == 0, sigmas[1] not within 1e-5 of 1).
- noise_level: exactly 0; subnormal and tiny (5e-324, 1e-45, 1e-38, 1e-23, 2**-40, 1e-12, 1e-6);
  log-uniform over [1e-45, 1e-12] and [1e-12, 0.3]; ordinary [0.3, 1]; large, log-uniform over
  [1, 10] for sde / dance; the largest allowed (10 for sde / dance, 1 for cps, which needs [0, 1]).
- mode ode / sde / dance / cps; log_prob gaussian / kernel / sq_err, and step_kl; reduction mean / sum.
- step_index: an int, or a per-sample int64 / int32 tensor [B] with values in [0, T - 1].
- dtype of x, v (and of the emitted sample): float32, bfloat16, float16, and float64 on the torch
  backend; the given noise in float32 or in that dtype.
- latents: x, v = N(0, 1) * scale, scale in [0, 10] each; v_ref = v + N(0, 1) * p, p in [0, 0.5];
  shapes [B, ...], B in 1..3, per-sample element counts including 1, odd sizes, 1023 / 1024 / 1025
  and > 2048 (several reduction chunks) on torch; <= 2100 on triton.
- backends: torch always (1500 examples); triton through Triton's interpreter on CPU, or on CUDA
  when present (50 examples, <= 3 x 2100 elements); plus explicit regression examples: noise_level
  1e-23 in every mode on both backends, and sde's largest amplification (``near_one``).

For each example: ``sde_step`` with the noise given and with it drawn from a generator (one, or a
list of B) gives finite prev_sample, log_prob, prev_sample_mean and std_dev; ``step_log_prob`` of
each emitted sample is finite and equal (``torch.equal``) to the rollout's log_prob; ``step_kl`` is
finite and >= 0; the gradients of a weighted sum of the log-prob (w.r.t. sample, model_output,
prev_sample) and of the KL (w.r.t. sample, model_output, ref_model_output) are finite; and with
model_output (and sample) requiring grad in ``sde_step``, d log_prob / d model_output is exactly 0.

Two float16 limits, both genuine (the exact value is not representable in float16), both explicit:

1. The emitted sample (sde only). mu = a * x + c * v with a = 1 - eta**2 * (sigma - sigma') /
   (2 (1 - sigma_t)): a step from a sigma close to 1 (but outside the 1e-5 tolerance, so sigma_t =
   sigma) that drops far amplifies x by up to ~eta**2 / (2 * 1.0e-5), i.e. |a| ~ 5e6 at eta = 10
   (sigmas [1, 0.999, 0], step 1: a ~ 1 - 500 eta**2), and the float32 sample exceeds float16's
   largest finite value 65504 (it rounds to inf from 65520). ``test_fp16_overflow_is_genuine`` shows
   one. The bound: a float16 sample overflows iff its float32 value |mu + std * eps| >= 65520. So for
   float16 the strategy scales x and v down (``FP16_SAMPLE_BOUND``) until max |a x + c v| +
   std * max |eps| <= 60000 over both rollouts' noise, computed in float64 from the step's
   coefficients; schedules and noise levels stay the full domain. It bites rarely (0 to a few of the
   ~350 float16 examples drawn; the ``near_one`` examples force it): with diffusers' shifted /
   dynamic schedules (shift <= 10), (sigma - sigma') / (1 - sigma) <= shift, so |a| <= 1 + 5 eta**2
   <= 501 and float16 holds |x| up to ~120; it takes karras / exponential / beta with sigma_max just
   below 1 and a large eta. dance, cps and ode have |a| <= 50.
   float32 / bfloat16 / float64 need no bound (|mu| < 3e8).
2. Gradients. d log_prob / d x' is -r / std**2 (gaussian, kernel; / N for the mean), and r holds the
   float16 rounding residual of x' (~ |x'| * 2**-11) however small the std: r / std**2 passes 65504
   once the std is below ~5e-4 (|x'| ~ 40, sum; lower for the mean), and is ~1e20 at the 2**-40
   floor (the KL's gradients likewise, ~ c**2 |v - v_ref| / std**2). float16 cannot hold that;
   float32 and bfloat16 can (< 1e30; their range is 3.4e38). For float16 the test computes the same
   gradients from the float16 values upcast to float32 (the ops compute in float32 either way) and
   requires: those float32 gradients are finite, and each float16 gradient element is finite
   wherever its float32 value is below 65520, and +-inf (never NaN) where it is not.

``test_negative_control`` shows the finiteness check can fail: with the std floor removed
(``flowrl.backends.reference.STD_FLOOR = 0``), noise_level 1e-23 gives a non-finite log-prob again.
``test_kl_sample_grad_float16_tiny_noise``: the exact d step_kl / d sample is 0 (mu - mu_ref does not
depend on x); in float16 with a tiny noise level it must not come out inf - inf = NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple, Union

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import event as _event
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st

import flowrl
from flowrl.backends import _dispatch
from flowrl.core._validate import check_sigmas
from flowrl.contract import SIGMA_ONE_TOL, Mode

from mode_coverage import every_mode_but

CPU = torch.device("cpu")
# every mode but these, whose finiteness is searched elsewhere (a new Mode joins MODES: give it its
# float64 coefficients in _coefficients below)
MODES_ELSEWHERE = {
    "ddim": "an alpha-bar table, not these flow schedules: its finiteness checks are tests/ops/test_ddim.py's",
    "dpm_sde": "its own search over these schedule families, both orders: tests/ops/test_dpm_sde.py",
    "flash_sde": "searched with dpm_sde over these schedule families: tests/ops/test_dpm_sde.py",
}
MODES = every_mode_but(MODES_ELSEWHERE)
KINDS = ("gaussian", "kernel", "sq_err")
REDUCTIONS = ("mean", "sum")
TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAMILIES = ("shifted", "dynamic", "beta", "karras", "exponential")

# noise levels from float64 / float32 subnormals to tiny (std around and below the 2**-40 floor)
TINY_ETAS = (5e-324, 1e-45, 1e-38, 1e-23, 2.0**-40, 1e-12, 1e-6)
NEAR_ONE = (float(torch.tensor(1 - 1.1e-5)), 0.9999, 0.999)
# the largest noise level drawn: 10, or the mode's MODE_RULES bound below it (cps: 1)
ETA_MAX = {m: min(10.0, Mode.parse("mode", m).rules.noise_level[1]) for m in MODES}

# float16: largest finite value 65504; float32 values from 65520 up round to inf
FP16_ROUNDS_TO_INF = 65520.0
# float16 examples keep max |a x + c v| + std * max |eps| below this (module docstring, limit 1)
FP16_SAMPLE_BOUND = 60000.0

# per-sample element counts: 1, odd, around the 1024-element reduction chunk, several chunks
TORCH_SHAPES = ((1,), (1, 1, 1), (7,), (3, 5), (2, 3, 7, 5), (1023,), (1024,), (1025,), (4, 16, 17),
                (2049,), (3, 1031))
TRITON_SHAPES = ((1,), (7,), (3, 5), (1023,), (1024,), (1025,), (4, 16, 17), (2100,))
TORCH_MAX_NUMEL = 3100
TRITON_MAX_NUMEL = 2100


# ------------------------------------------------------------------------------ schedules (diffusers)


def _append_zero(sig: np.ndarray) -> torch.Tensor:
    """float64 sigmas -> the float32 table with the terminal 0, as diffusers' set_timesteps does."""
    return torch.cat([torch.from_numpy(np.asarray(sig, dtype=np.float64)).to(torch.float32), torch.zeros(1)])


def build_schedule(family: str, T: int, p: dict) -> torch.Tensor:
    t = np.linspace(1.0, 0.0, T + 1)[:-1]  # = linspace(1, 1 / T, T)
    if family == "shifted":
        s = p["shift"]
        return _append_zero(s * t / (1 + (s - 1) * t))
    if family == "dynamic":  # Flux: time_shift(mu, sigma_exp, t)
        with np.errstate(divide="ignore"):
            return _append_zero(math.exp(p["mu"]) / (math.exp(p["mu"]) + (1 / t - 1) ** p["sigma_exp"]))
    lo, hi = p["sigma_min"], p["sigma_max"]
    if family == "beta":  # diffusers' _convert_to_beta
        ppf = scipy.stats.beta.ppf(1 - np.linspace(0, 1, T), p["alpha"], p["beta"])
        return _append_zero(lo + ppf * (hi - lo))
    if family == "karras":  # diffusers' _convert_to_karras, rho = 7
        rho = 7.0
        ramp = np.linspace(0, 1, T)
        return _append_zero((hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho)
    if family == "exponential":  # diffusers' _convert_to_exponential
        return _append_zero(np.exp(np.linspace(math.log(hi), math.log(lo), T)))
    raise ValueError(family)


def valid_schedule(sigmas: torch.Tensor) -> bool:
    try:
        check_sigmas(sigmas, CPU)
    except ValueError:
        return False
    return True


@st.composite
def schedule_params(draw):
    family = draw(st.sampled_from(FAMILIES))
    T = draw(st.one_of(st.integers(1, 12), st.integers(13, 1000)))
    if family == "shifted":
        p = {"shift": draw(st.one_of(st.just(1.0), st.just(10.0), st.floats(1.0, 10.0)))}
    elif family == "dynamic":
        p = {"mu": draw(st.floats(0.0, math.log(10.0))), "sigma_exp": draw(st.floats(0.5, 1.25))}
    else:
        # sigma_max: 1 (diffusers), or just below 1 where sde's 1 / (1 - sigma) is largest (|1 - sigma|
        # = 1.1e-5 is past the isclose tolerance 1e-5 + 1e-8, so sigma itself is used)
        hi = draw(st.one_of(st.just(1.0), st.sampled_from(NEAR_ONE), st.floats(0.05, 1.0)))
        p = {"sigma_max": hi, "sigma_min": hi * 10.0 ** -draw(st.floats(1e-3, 4.0))}
        if family == "beta":
            p.update(alpha=draw(st.floats(0.5, 1.0)), beta=draw(st.floats(0.5, 1.0)))
    return family, T, p


def _log_uniform(lo: float, hi: float):
    return st.floats(math.log10(lo), math.log10(hi)).map(lambda e: min(max(10.0**e, lo), hi))


def noise_levels(mode: str):
    top = ETA_MAX[mode]
    return st.one_of(  # (hypothesis favours the first branch: not 0, which needs no second look)
        st.floats(0.3, 1.0),
        st.just(0.0),
        st.sampled_from(TINY_ETAS),
        _log_uniform(1e-45, 1e-12),  # std below the 2**-40 floor
        _log_uniform(1e-12, 0.3),  # std between the floor and the rounding residual of x'
        _log_uniform(1.0, top) if top > 1 else st.just(top),
    )


# ---------------------------------------------------------------------------------------- examples


@dataclass
class Case:
    """One example: the drawn parameters (its repr, what hypothesis prints) and the tensors."""

    backend: str
    family: str
    T: int
    params: dict
    step: Union[int, List[int]]
    step_dtype: Optional[torch.dtype]  # None: ``step`` is passed as an int
    mode: str
    eta: float
    kind: str
    reduction: str
    dtype: torch.dtype
    noise_dtype: torch.dtype
    shape: Tuple[int, ...]
    seed: int
    x_scale: float
    v_scale: float
    pert: float
    gen_list: bool
    fp16_scaled: float = 1.0  # the factor FP16_SAMPLE_BOUND applied to x and v (1: none)
    sigmas: torch.Tensor = field(default=None, repr=False)
    x: torch.Tensor = field(default=None, repr=False)
    v: torch.Tensor = field(default=None, repr=False)
    v_ref: torch.Tensor = field(default=None, repr=False)
    noise: torch.Tensor = field(default=None, repr=False)
    weights: torch.Tensor = field(default=None, repr=False)

    def __repr__(self):
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"Case({shown})"

    def _repr_pretty_(self, printer, cycle):  # hypothesis prints the falsifying example with this
        printer.text(repr(self))

    @property
    def step_index(self):
        return self.step if self.step_dtype is None else torch.tensor(self.step, dtype=self.step_dtype)

    def generator(self):
        if self.gen_list:
            return [torch.Generator().manual_seed(self.seed + 1 + b) for b in range(self.shape[0])]
        return torch.Generator().manual_seed(self.seed + 1)


def _coefficients(sigmas: torch.Tensor, i: int, mode: str, eta: float) -> Tuple[float, float, float]:
    """(a, c, std) of step i in float64, from the float32 table (docs/contract.md, Modes)."""
    table = sigmas.double().tolist()
    sigma, sigma_next = table[i], table[i + 1]
    d = sigma - sigma_next
    if mode == "ode":
        return 1.0, -d, 0.0
    if mode == "cps":
        k = sigma_next * math.cos(eta * math.pi / 2)
        std = sigma_next * math.sin(eta * math.pi / 2)
        return (1 - sigma_next) + k, k * (1 - sigma) - (1 - sigma_next) * sigma, std
    if mode == "sde":
        sigma_t = table[1] if abs(sigma - 1) <= SIGMA_ONE_TOL else sigma
        s = eta * math.sqrt(sigma / (1 - sigma_t))
    elif mode == "dance":
        s = eta
    else:
        raise ValueError(f"_coefficients has no float64 formula for mode {mode!r}: add its row "
                         "(docs/contract.md, Modes) or name the mode in MODES_ELSEWHERE")
    s2 = s * s
    return 1 - s2 * d / (2 * sigma), -(1 + s2 * (1 - sigma) / (2 * sigma)) * d, s * math.sqrt(d)


def make_case(backend, family, T, params, step, step_dtype, mode, eta, kind, reduction, dtype, noise_dtype,
              shape, seed, x_scale, v_scale, pert, gen_list) -> Case:
    case = Case(backend, family, T, params, step, step_dtype, mode, eta, kind, reduction, dtype, noise_dtype,
                tuple(shape), seed, x_scale, v_scale, pert, gen_list)
    case.sigmas = build_schedule(family, T, params)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * x_scale
    v = torch.randn(shape, generator=g, dtype=torch.float64) * v_scale
    dv = torch.randn(shape, generator=g, dtype=torch.float64) * pert
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    case.weights = torch.randn(shape[0], generator=g, dtype=torch.float32)
    if dtype == torch.float16:
        # FP16_SAMPLE_BOUND (module docstring, limit 1): keep the float32 sample inside float16's range
        eps = torch.maximum(noise.abs(), flowrl.draw_noise(shape, case.generator(), CPU).abs())
        steps = [step] * shape[0] if isinstance(step, int) else step
        factor = 1.0
        for b, i in enumerate(steps):
            a, c, std = _coefficients(case.sigmas, i, mode, eta)
            mu_max = float((a * x[b] + c * v[b]).abs().max())
            room = FP16_SAMPLE_BOUND - std * float(eps[b].abs().max())
            assert room > FP16_SAMPLE_BOUND / 2, "the std alone nears float16's range"
            if mu_max > room:
                factor = min(factor, room / mu_max)
        x, v, dv = x * factor, v * factor, dv * factor
        case.fp16_scaled = factor
    case.x, case.v = x.to(dtype), v.to(dtype)
    case.v_ref = (v + dv).to(dtype)
    case.noise = noise.to(noise_dtype)
    return case


@st.composite
def cases(draw, backend: str):
    family, T, params = draw(schedule_params())
    assume(valid_schedule(build_schedule(family, T, params)))
    if backend == "torch":
        dtypes, shapes, max_numel = TORCH_DTYPES, TORCH_SHAPES, TORCH_MAX_NUMEL
    else:
        dtypes, shapes, max_numel = TRITON_DTYPES, TRITON_SHAPES, TRITON_MAX_NUMEL
    batch = draw(st.integers(1, 3))
    inner = draw(st.one_of(st.sampled_from(shapes), st.integers(1, max_numel).map(lambda n: (n,))))
    steps = draw(st.lists(st.integers(0, T - 1), min_size=batch, max_size=batch))
    step_dtype = draw(st.sampled_from((None, torch.int64, torch.int32)))
    mode = draw(st.sampled_from(MODES))
    dtype = draw(st.sampled_from(dtypes))
    return make_case(
        backend, family, T, params,
        step=steps[0] if step_dtype is None else steps,
        step_dtype=step_dtype,
        mode=mode,
        eta=draw(noise_levels(mode)),
        kind=draw(st.sampled_from(KINDS)),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        dtype=dtype,
        noise_dtype=draw(st.sampled_from((torch.float32, dtype))),
        shape=(batch,) + inner,
        seed=draw(st.integers(0, 2**31)),
        x_scale=draw(st.one_of(st.just(10.0), st.floats(0.0, 10.0))),
        v_scale=draw(st.one_of(st.just(10.0), st.floats(0.0, 10.0))),
        pert=draw(st.floats(0.0, 0.5)),
        gen_list=draw(st.booleans()),
    )


# -------------------------------------------------------------------------------------------- checks


def event(what: str) -> None:
    """hypothesis.event, for --hypothesis-show-statistics; a no-op outside a hypothesis test."""
    try:
        _event(what)
    except InvalidArgument:
        pass


def assert_finite(what: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    assert not bool(bad.any()), f"{what} is not finite at {bad.nonzero()[:4].tolist()}: {t[bad][:4].tolist()}"


def _value_grads(fn, case: Case, third: torch.Tensor, upcast: bool, **kw):
    """(value, grads w.r.t. (sample, model_output, third)) of the weighted sum of ``fn``'s value."""
    leaves = [t.float() if upcast else t for t in (case.x, case.v, third)]
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    value = fn(*leaves, case.sigmas, case.step_index, mode=case.mode, noise_level=case.eta,
               reduction=case.reduction, backend=case.backend, **kw)
    grads = torch.autograd.grad((case.weights * value).sum(), leaves, allow_unused=True, materialize_grads=True)
    return value.detach(), grads


def check_grads(what: str, fn, case: Case, third: torch.Tensor, names, **kw) -> torch.Tensor:
    value, grads = _value_grads(fn, case, third, upcast=False, **kw)
    if case.dtype != torch.float16:
        for name, g in zip(names, grads):
            assert_finite(f"d {what} / d {name}", g)
        return value
    # float16 (module docstring, limit 2): the exact gradient may exceed float16's range
    _, grads32 = _value_grads(fn, case, third, upcast=True, **kw)
    for name, g, g32 in zip(names, grads, grads32):
        assert_finite(f"d {what} / d {name} (float32, from the float16 values)", g32)
        nan = g.isnan()
        assert not bool(nan.any()), f"d {what} / d {name} (float16) has NaN; float32 gives {g32[nan][:4].tolist()}"
        over = g32.abs() >= FP16_ROUNDS_TO_INF
        assert_finite(f"d {what} / d {name} (float16, where its float32 value fits)", g[~over])
        assert bool((g[over].float() == g32[over].sign() * math.inf).all()), f"d {what} / d {name}: overflow sign"
        if bool(over.any()):
            event("float16 gradient beyond float16's range (inf)")
    return value


def run_case(case: Case) -> None:
    common = dict(mode=case.mode, noise_level=case.eta, backend=case.backend)
    lp_kw = dict(common, log_prob_kind=case.kind, reduction=case.reduction)
    event(f"{case.mode} {str(case.dtype).replace('torch.', '')}")
    event(f"schedule {case.family}, T {'1' if case.T == 1 else '2..12' if case.T <= 12 else '13..1000'}")
    eta = case.eta
    event("noise_level " + ("0" if eta == 0 else "<= 1e-12" if eta <= 1e-12 else "< 0.3" if eta < 0.3
                            else "0.3 .. 1" if eta <= 1 else "> 1"))
    numel = math.prod(case.shape[1:])
    event("per-sample numel " + ("1" if numel == 1 else "<= 1024" if numel <= 1024 else "> 1024"))
    if case.fp16_scaled < 1:
        event("float16 latents scaled down (FP16_SAMPLE_BOUND)")

    # rollouts: noise given, and drawn from the generator(s)
    rollouts = []
    for label, noise_kw in (("noise", dict(noise=case.noise)), ("generator", dict(generator=case.generator()))):
        out = flowrl.sde_step(case.x, case.v, case.sigmas, case.step_index, **lp_kw, **noise_kw)
        assert out.prev_sample.dtype == case.dtype
        for name in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev"):
            assert_finite(f"sde_step({label}).{name}", getattr(out, name))
        assert bool((out.std_dev >= 0).all())
        rollouts.append((label, out))

    # the training recompute: finite, and the rollout's bits
    for label, out in rollouts:
        lp = flowrl.step_log_prob(case.x, case.v, out.prev_sample, case.sigmas, case.step_index, **lp_kw)
        assert_finite(f"step_log_prob (sde_step({label}).prev_sample)", lp)
        assert torch.equal(lp, out.log_prob), f"recompute {lp.tolist()} != rollout {out.log_prob.tolist()} ({label})"

    # the KL to a nearby reference policy
    kl = flowrl.step_kl(case.x, case.v, case.v_ref, case.sigmas, case.step_index, reduction=case.reduction, **common)
    assert_finite("step_kl", kl)
    assert bool((kl >= 0).all()), f"step_kl < 0: {kl.tolist()}"

    # gradients of weighted sums of the log-prob and of the KL
    prev = rollouts[0][1].prev_sample
    lp = check_grads("log_prob", flowrl.step_log_prob, case, prev, ("sample", "model_output", "prev_sample"),
                     log_prob_kind=case.kind)
    assert torch.equal(lp, rollouts[0][1].log_prob)
    kl_g = check_grads("kl", flowrl.step_kl, case, case.v_ref, ("sample", "model_output", "ref_model_output"))
    assert torch.equal(kl_g, kl)

    # a rollout step with model_output (and sample) requiring grad: the log-prob of the emitted sample
    # has exactly zero gradient in them (the rounding to out_dtype is a constant of the step)
    x = case.x.detach().clone().requires_grad_()
    v = case.v.detach().clone().requires_grad_()
    out = flowrl.sde_step(x, v, case.sigmas, case.step_index, noise=case.noise, **lp_kw)
    assert torch.equal(out.prev_sample.detach(), prev)
    assert torch.equal(out.log_prob.detach(), rollouts[0][1].log_prob)
    if out.log_prob.requires_grad:
        gx, gv = torch.autograd.grad((case.weights * out.log_prob).sum(), (x, v), allow_unused=True,
                                     materialize_grads=True)
        assert bool((gv == 0).all()), f"d log_prob / d model_output of sde_step is not 0: {gv[gv != 0][:4].tolist()}"
        assert bool((gx == 0).all()), f"d log_prob / d sample of sde_step is not 0: {gx[gx != 0][:4].tolist()}"


# ------------------------------------------------------------------------------------------- tests


def regression(backend, mode, dtype, shape=(2, 37), eta=1e-23, kind="gaussian", reduction="mean"):
    """noise_level = 1e-23: std**2 underflows float32 (this gave NaN before the std floor). Steps:
    first, middle, last across the batch."""
    step = [(0, 5, 9)[b % 3] for b in range(shape[0])]
    return make_case(backend, "shifted", 10, {"shift": 3.0}, step, torch.int64, mode, eta, kind, reduction,
                     dtype, torch.float32, shape, seed=0, x_scale=10.0, v_scale=10.0, pert=0.1, gen_list=False)


def near_one(backend, dtype, eta=10.0, mode="sde"):
    """sde's largest amplification: sigma = 1 - 1.1e-5 (not rounded to 1), then a drop to 0.01: a ~
    1 - eta**2 * 0.99 / 2.2e-5, about -4.5e6 at eta = 10. In float16 the latents get scaled down
    (FP16_SAMPLE_BOUND)."""
    params = {"sigma_max": NEAR_ONE[0], "sigma_min": 0.01}
    return make_case(backend, "exponential", 2, params, [0, 1, 0], torch.int64, mode, eta, "gaussian", "sum",
                     dtype, torch.float32, (3, 33), seed=1, x_scale=10.0, v_scale=10.0, pert=0.5, gen_list=True)


_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@settings(max_examples=1500, **_SETTINGS)
@given(case=cases("torch"))
@example(case=regression("torch", "ode", torch.float32))
@example(case=regression("torch", "sde", torch.float32))
@example(case=regression("torch", "dance", torch.float32))
@example(case=regression("torch", "cps", torch.float32))
@example(case=regression("torch", "sde", torch.bfloat16, kind="kernel", reduction="sum"))
@example(case=regression("torch", "dance", torch.float64, kind="sq_err"))
@example(case=regression("torch", "cps", torch.float16, shape=(3, 1025)))
@example(case=near_one("torch", torch.float16))
@example(case=near_one("torch", torch.bfloat16))
@example(case=near_one("torch", torch.float32, eta=2**-40))
@example(case=make_case("torch", "shifted", 1, {"shift": 1.0}, 0, None, "sde", 1e-45, "gaussian", "mean",
                        torch.float16, torch.float32, (1, 1), 0, 10.0, 10.0, 0.5, False))  # KL grad NaN, torch
def test_torch_outputs_and_gradients_finite(case):
    run_case(case)


triton_only = pytest.mark.skipif(
    not (_dispatch.triton_available() and (torch.cuda.is_available() or _dispatch.interpreter_enabled())),
    reason="needs triton with CUDA or TRITON_INTERPRET=1",
)


# float16 gradients past float16's range (module docstring, limit 2): the interpreter's numpy cast warns
fp16_overflow_ok = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


@pytest.mark.slow
@triton_only
@fp16_overflow_ok
@settings(max_examples=50, **_SETTINGS)
@given(case=cases("triton"))
@example(case=regression("triton", "ode", torch.float32))
@example(case=regression("triton", "sde", torch.float32))
@example(case=regression("triton", "dance", torch.bfloat16))
@example(case=regression("triton", "cps", torch.float16))
@example(case=near_one("triton", torch.float16))
def test_triton_outputs_and_gradients_finite(case):
    if torch.cuda.is_available():
        case = _to_cuda(case)
    run_case(case)


def _to_cuda(case: Case) -> Case:
    for name in ("sigmas", "x", "v", "v_ref", "noise", "weights"):
        setattr(case, name, getattr(case, name).cuda())
    return case


def test_fp16_overflow_is_genuine():
    """Why float16 examples are bounded (module docstring, limit 1): sigmas [1, 0.999, 0], sde step 1,
    eta = 2 gives a = 1 - 4 * 0.999 / (2 * 0.001) ~ -1997, so x = 40 means x' ~ -8e4: finite in float32
    and bfloat16, past float16's 65504."""
    sigmas = torch.tensor([1.0, 0.999, 0.0])
    a, c, std = _coefficients(sigmas, 1, "sde", 2.0)
    assert a < -1900
    x = torch.full((1, 4), 40.0)
    v = torch.zeros(1, 4)
    noise = torch.zeros(1, 4)
    for dtype in (torch.float32, torch.bfloat16):
        out = flowrl.sde_step(x.to(dtype), v.to(dtype), sigmas, 1, noise_level=2.0, noise=noise, backend="torch")
        assert_finite("prev_sample", out.prev_sample)
        assert float(out.prev_sample.float().abs().max()) > FP16_ROUNDS_TO_INF
    out = flowrl.sde_step(x.half(), v.half(), sigmas, 1, noise_level=2.0, noise=noise, backend="torch")
    assert bool(out.prev_sample.isinf().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control(monkeypatch, dtype):
    """The finiteness check can fail: without the std floor, noise_level = 1e-23 makes std**2 underflow
    float32 to 0 and the log-prob is NaN or inf again (torch backend)."""
    case = regression("torch", "sde", dtype)
    run_case(case)  # passes with the floor
    monkeypatch.setattr(flowrl.backends.reference, "STD_FLOOR", 0.0)
    out = flowrl.sde_step(case.x, case.v, case.sigmas, case.step_index, noise=case.noise, mode="sde",
                          noise_level=1e-23, backend="torch")
    assert not bool(torch.isfinite(out.log_prob).all())
    with pytest.raises(AssertionError, match="not finite"):
        run_case(case)


@fp16_overflow_ok
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=triton_only)])
def test_kl_sample_grad_float16_tiny_noise(backend):
    """The exact d KL / d sample is 0 (mu - mu_ref = c * (v - v_ref) does not depend on x). With a tiny
    noise level, 1 / std**2 = 2**80, so the two a * x terms' gradients are each ~1e21: beyond float16.
    The triton backend writes the exact 0; it must not come out NaN (inf - inf) on any backend."""
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    x = torch.ones(1, 1, dtype=torch.float16, device=device, requires_grad=True)
    v = torch.ones(1, 1, dtype=torch.float16, device=device, requires_grad=True)
    v_ref = torch.full((1, 1), 1.125, dtype=torch.float16, device=device)
    kl = flowrl.step_kl(x, v, v_ref, sigmas.to(device), 0, mode="sde", noise_level=1e-23, backend=backend)
    assert_finite("step_kl", kl)
    grad_x, _ = torch.autograd.grad(kl.sum(), (x, v), allow_unused=True, materialize_grads=True)
    assert_finite("d kl / d sample", grad_x)
    assert bool((grad_x == 0).all())
