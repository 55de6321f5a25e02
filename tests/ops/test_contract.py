"""The contract test: every Mode and every loss against the float64 oracle (flowrl.oracle), on both backends.

The modes are ``list(flowrl.contract.Mode)`` and the losses every function of ``flowrl.losses.__all__``
whose name ends in ``_loss`` (and ``awm_log_prob``): nothing here lists them, so a new mode or loss is
tested here as soon as it exists, and fails until flowrl/oracle/steps.py (a mode) or
flowrl/oracle/losses.py (a loss) has its float64 row (the oracle raises NotImplementedError naming it).
A mode's extra inputs (``ModeRules.extra_inputs``: ddim's prediction types and clip, dpm_sde's second
order) are run for each value of ``EXTRA_VALUES``; its schedule is the one ``ModeRules.schedule`` names.

Per mode, backend and storage dtype: ``sde_step`` (given noise: the sample, its mean and its log-prob),
``step_log_prob`` (every log-prob kind, both reductions), ``step_kl`` (both reductions) and the gradient of
log-prob + KL in ``model_output``. Per loss and backend (float32; the GRPO-family and teacher losses for
every mode the losses take, ``ModeRules.losses``): every field of the output and the gradient of the loss
in ``model_output``.

Tolerances. The torch backend against float64: ``TOL`` (rtol, atol) per storage dtype and quantity, with
the measured maxima beside each row. The Triton backend: flash-attention's rule as docs/contract.md states
it (Backends), its error against float64 at most twice the torch backend's error on the same inputs plus
``2e-6 (1 + |value|)`` per element (plus one ulp of the storage dtype for an emitted low-precision
value: the two backends may round one element differently).
"""
from __future__ import annotations

import inspect
import itertools

import pytest
import torch

import flowrl
from flowrl import losses as L
from flowrl import oracle
from flowrl.backends import _dispatch
from flowrl.contract import Mode, Schedule

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not (_dispatch.triton_available() and (torch.cuda.is_available() or _dispatch.interpreter_enabled())),
    reason="needs CUDA or TRITON_INTERPRET=1"))]
DTYPES = [torch.float32, torch.bfloat16]
# (backend, dtype): every pair; the interpreter's bfloat16 runs are the full suite's (slow)
_TRITON_MARKS = BACKENDS[1].marks
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{d}",
                               marks=[*(_TRITON_MARKS if b == "triton" else ()),
                                      *((pytest.mark.slow,) if b == "triton" and d != torch.float32 else ())])
                  for b in ("torch", "triton") for d in DTYPES]
MODES = list(Mode)
LOSS_MODES = [m for m in Mode if m.rules.losses]
LOSSES = sorted(n for n in L.__all__ if callable(getattr(L, n)) and (n.endswith("_loss") or n == "awm_log_prob"))

T = 6
STEPS = [0, 3, 5]  # the first step (sigma = 1: sde's sigma_t rule), a middle one, the last (sigma' = 0)
SHAPE = (3, 4, 5)
# the values each mode-specific input takes (a mode whose extra input is not here fails: give it values)
EXTRA_VALUES = {
    "prediction_type": ("epsilon", "sample", "v_prediction"),
    "clip_sample_range": (None, 1.0),
    "prev_x0_pred": (None, "given"),  # first order, and second order with a previous data prediction
}

# (rtol, atol) of the torch backend against the float64 oracle; a gradient's atol is relative to its largest
# |element| (bfloat16 gradients are the sum of eight ops' bfloat16-rounded gradients). Measured maxima on this
# file's inputs, torch / Triton (max |err|, and for the gradient max |err| / max |grad|):
# float32: sample 5.6e-7 / 5.0e-7, mean 7.1e-7 / 4.4e-7, log-prob 1.7e-7 (mean) and 3.4e-6 (sum, |lp| ~ 20) on
#   both, KL 3.9e-7 on both, gradient 5.8e-7 / 4.1e-7 of its largest element;
# bfloat16: sample 1.5e-2 on both (its rounding, 3.0e-3 of |x'|), mean 5.4e-7 / 6.4e-7, log-prob 1.4e-7 (mean)
#   and 3.2e-6 (sum), KL 5.4e-7 / 6.5e-7, gradient 7.5e-3 of its largest element on both.
TOL = {
    torch.float32: dict(sample=(2e-6, 2e-6), mean=(2e-6, 2e-6), value=(2e-5, 2e-6), grad=(1e-5, 1e-5)),
    torch.bfloat16: dict(sample=(2**-8, 1e-6), mean=(2e-6, 2e-6), value=(2e-5, 2e-6), grad=(2**-7, 2**-6)),
}
# the losses (float32 inputs): values and gradients against float64
LOSS_TOL = dict(value=(2e-5, 2e-6), grad=(1e-5, 1e-5))


def _flow_sigmas():
    """A shifted flow schedule (shift 3, as diffusers' SD3), float32 [T + 1] from 1 to 0."""
    t = torch.linspace(1, 0, T + 1, dtype=F64)
    return (3 * t / (1 + 2 * t)).to(torch.float32)


def _alpha_bar_table():
    """ddim's (a, a') pairs [2T] of a scaled-linear SD schedule at 'leading' timesteps, a' = 1 at the end."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2
    ac = torch.cumprod(1.0 - betas, dim=0)
    ratio = 1000 // T
    pairs = []
    for k in range(T):
        t = (T - 1 - k) * ratio + 1
        pairs += [ac[t], ac[t - ratio] if t - ratio >= 0 else torch.tensor(1.0)]
    return torch.stack(pairs).to(torch.float32)


SCHEDULES = {Schedule.SIGMAS: _flow_sigmas, Schedule.ALPHA_BAR: _alpha_bar_table}


def _schedule(mode):
    assert mode.rules.schedule in SCHEDULES, f"no test schedule for {mode.rules.schedule!r}: add it to SCHEDULES"
    return SCHEDULES[mode.rules.schedule]().to(DEVICE)


def _noise_level(mode) -> float:
    lo, hi = mode.rules.noise_level
    return lo if lo == hi else min(max(0.7, lo), hi)


def _variants(mode):
    """Every combination of the mode's extra inputs' values (one empty dict for a mode without any)."""
    names = mode.rules.extra_inputs
    missing = [n for n in names if n not in EXTRA_VALUES]
    assert not missing, f"mode {mode.label!r} reads {missing}: give them values in EXTRA_VALUES"
    return [dict(zip(names, values)) for values in itertools.product(*(EXTRA_VALUES[n] for n in names))]


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, v, noise, dv, prev_x0 = (torch.randn(SHAPE, generator=g) for _ in range(5))
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(x), cast(v), noise.to(DEVICE), cast(v + 0.2 * dv), cast(prev_x0)


def _extra(variant, prev_x0):
    return {k: (prev_x0 if val == "given" else val) for k, val in variant.items() if val is not None}


def _oracle_extra(extra):
    return {k: (val.cpu() if isinstance(val, torch.Tensor) else val) for k, val in extra.items()}


KINDS = [(kind, red) for kind in ("gaussian", "kernel", "sq_err") for red in ("mean", "sum")]


def _step_values(backend, mode, dtype, variant):
    """flowrl's values (sample, mean, log-probs, KLs, gradient) and the oracle's, by name."""
    sig, eta, idx = _schedule(mode), _noise_level(mode), torch.tensor(STEPS, device=DEVICE)
    x, v, noise, v_ref, prev_x0 = _inputs(dtype)
    extra = _extra(variant, prev_x0)
    common = dict(mode=mode.label, noise_level=eta, backend=backend, **extra)
    out = flowrl.sde_step(x, v, sig, idx, noise=noise, **common)
    prev = out.prev_sample
    got = {"sample": out.prev_sample, "mean": out.prev_sample_mean, "rollout log_prob": out.log_prob}
    vv = v.clone().requires_grad_()
    total = 0
    for kind, red in KINDS:
        lp = flowrl.step_log_prob(x, vv, prev, sig, idx, log_prob_kind=kind, reduction=red, **common)
        got[f"log_prob {kind} {red}"] = lp
        total = total + lp.sum()
    for red in ("mean", "sum"):
        kl = flowrl.step_kl(x, vv, v_ref, sig, idx, reduction=red, **common)
        got[f"kl {red}"] = kl
        total = total + kl.sum()
    (got["grad"],) = torch.autograd.grad(total, vv)

    c = lambda t: t.detach().cpu()  # noqa: E731
    args = (c(x), c(v), c(sig), STEPS, mode, eta)
    ox = _oracle_extra(extra)
    want = {"sample": oracle.sample(c(x), c(v), c(noise), *args[2:], **ox),
            "mean": oracle.mean(*args, **ox),
            "rollout log_prob": oracle.log_prob(c(x), c(v), c(prev), *args[2:], **ox)}
    v64 = c(v).to(F64).requires_grad_()
    total = 0
    for kind, red in KINDS:
        lp = oracle.log_prob(c(x), v64, c(prev), *args[2:], kind, red, **ox)
        want[f"log_prob {kind} {red}"] = lp
        total = total + lp.sum()
    for red in ("mean", "sum"):
        kl = oracle.kl(c(x), v64, c(v_ref), *args[2:], red, **ox)
        want[f"kl {red}"] = kl
        total = total + kl.sum()
    (want["grad"],) = torch.autograd.grad(total, v64)
    return {k: t.detach().cpu().to(F64) for k, t in got.items()}, {k: t.detach() for k, t in want.items()}


def _quantity(name):
    return name if name in ("sample", "mean", "grad") else "value"


def _check_torch(got, want, tol, where):
    for name, w in want.items():
        rtol, atol = tol[_quantity(name)]
        atol = atol * float(w.abs().max()) if name == "grad" else atol
        torch.testing.assert_close(got[name], w, rtol=rtol, atol=atol, msg=lambda m: f"{where}, {name}: {m}")


def _check_triton(got, torch_got, want, slack, where):
    """docs/contract.md's rule: |triton - f64| <= 2 |torch - f64| + 2e-6 (1 + |f64|) (+ ``slack`` x |f64|
    for a value rounded to a low-precision dtype; a gradient's |f64| is its largest element's)."""
    for name, w in want.items():
        extra = slack.get(_quantity(name), 0.0)
        scale = w.abs().max() if name == "grad" else w.abs()
        bound = 2 * (torch_got[name] - w).abs() + (2e-6 + extra) * (1 + scale)
        err = (got[name] - w).abs()
        assert bool((err <= bound).all()), f"{where}, {name}: err {float(err.max()):.3g} > bound at {err > bound}"


def _ulp_slack(dtype):
    """One ulp of ``dtype`` relative, for what is emitted or differentiated in it (float32: none)."""
    if dtype == torch.float32:
        return {}
    eps = torch.finfo(dtype).eps
    return {"sample": eps, "grad": eps}


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.label)
def test_step_ops_against_the_float64_oracle(mode, backend, dtype):
    """sde_step's sample, mean and log-prob, step_log_prob's every kind and reduction, step_kl's, and the
    gradient of their sum in model_output, for each of the mode's variants."""
    for variant in _variants(mode):
        where = f"{mode.label} {variant} {backend} {dtype}"
        got, want = _step_values(backend, mode, dtype, variant)
        if backend == "torch":
            _check_torch(got, want, TOL[dtype], where)
        else:
            torch_got, _ = _step_values("torch", mode, dtype, variant)
            _check_triton(got, torch_got, want, _ulp_slack(dtype), where)


def test_every_mode_and_loss_has_its_oracle_row():
    """The oracle's rows are the contract's: no mode or loss of the package is missing one."""
    for mode in MODES:
        oracle.steps.mode_name(mode)  # raises NotImplementedError naming a mode without a row
    assert set(LOSSES) <= set(oracle.losses.LOSSES), sorted(set(LOSSES) - set(oracle.losses.LOSSES))
    with pytest.raises(NotImplementedError, match="no_such_loss"):
        oracle.losses.call("no_such_loss")
    with pytest.raises(NotImplementedError, match="noise_seed"):
        oracle.losses.call("awm_log_prob", *_inputs(torch.float32)[:3], 0.5, noise_seed=3)


# ------------------------------------------------------------------------------------- the losses


def _step_loss_cases(name, mode):
    """(label, args, kwargs) of a loss that scores a step of ``mode``: the defaults and the main options."""
    sig, eta, idx = _schedule(mode), _noise_level(mode), torch.tensor(STEPS, device=DEVICE)
    x, v, noise, v_ref, _ = _inputs(torch.float32)
    out = flowrl.sde_step(x, v, sig, idx, mode=mode.label, noise_level=eta, noise=noise, backend="torch")
    g = torch.Generator().manual_seed(5)
    v_new = v + 0.05 * torch.randn(SHAPE, generator=g).to(DEVICE)
    v_cond = v + 0.1 * torch.randn(SHAPE, generator=g).to(DEVICE)
    adv = torch.tensor([1.0, -0.5, 2.0], device=DEVICE)
    step = dict(mode=mode.label, noise_level=eta)
    args = (x, v_new, out.prev_sample, sig, idx)
    if name == "teacher_kl_loss":
        teacher = (x, v_new, v_ref, sig, idx)
        return [("default", teacher, step), ("sum", teacher, dict(step, reduction="sum"))]
    policy = dict(step, old_log_prob=out.log_prob, advantages=adv)
    if name == "grpo_loss":
        return [("default", args, dict(policy, clip_range=(0.01, 0.3), kl_coef=0.3, ref_model_output=v_ref)),
                ("velocity KL, guided pair, kernel, sum, IS weights", args,
                 dict(policy, clip_range=0.2, kl_coef=0.3, ref_model_output=(v_ref, v_cond), ref_guidance_scale=1.5,
                      kl_space="velocity", log_prob_kind="kernel", reduction="sum",
                      rollout_is_weights=torch.tensor([1.0, 0.5, 2.0], device=DEVICE)))]
    trust = dict(policy, old_prev_sample_mean=out.prev_sample_mean)
    if name == "grpo_guard_loss":
        return [("default", args, dict(trust, clip_range=0.2)),
                ("KL, sq_err", args, dict(trust, clip_range=(0.1, 0.3), kl_coef=0.2, ref_model_output=v_ref,
                                          log_prob_kind="sq_err"))]
    if name == "flow_dppo_loss":
        return [("default", args, dict(trust, kl_threshold=1e-3)),
                ("KL, IS weights", args, dict(trust, kl_threshold=1e9, kl_coef=0.2, ref_model_output=v_ref,
                                              rollout_is_weights=torch.tensor([0.3, 1.0, 1.5], device=DEVICE)))]
    return None


def _flow_loss_cases(name):
    """(label, args, kwargs) of a forward-process loss (no step)."""
    g = torch.Generator().manual_seed(3)
    x0, eps, v, v_old, v_ref = (torch.randn((4, 3, 7), generator=g).to(DEVICE) for _ in range(5))
    t = torch.tensor([0.3, 0.8, 0.5, 0.1], device=DEVICE)
    xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    adv = torch.tensor([0.5, -2.0, 1.0, 0.2], device=DEVICE)
    old_lp = torch.tensor([-2.0, -1.9, -2.2, -2.1], device=DEVICE)
    groups = torch.tensor([0, 1, 0, 1], device=DEVICE)
    if name == "nft_loss":
        return [("KL", (xt, v, v_old, x0, t), dict(advantages=adv, beta=0.3, adv_clip_max=1.5, kl_coef=0.2,
                                                   ref_model_output=v_ref)),
                ("default", (xt, v, v_old, x0, 0.4), dict(advantages=adv, beta=1.0, adv_clip_max=1.0))]
    if name == "awm_log_prob":
        return [(w, (v, eps, x0, t), dict(weighting=w)) for w in L.AWM_WEIGHTINGS]
    if name == "awm_loss":
        policy = dict(old_log_prob=old_lp, advantages=adv)
        return [("default", (v, eps, x0, t), dict(policy, clip_range=(0.2, 0.3))),
                ("ghuber 0.5, IS weights", (v, eps, x0, 0.5),
                 dict(policy, clip_range=0.2, weighting="ghuber", ghuber_power=0.5,
                      rollout_is_weights=torch.tensor([1.0, 0.5, 2.0, 0.0], device=DEVICE)))]
    if name == "dpo_loss":
        return [(layout, (v, v_ref, eps, x0), dict(beta=2.0, pair_layout=layout))
                for layout in ("halves", "interleaved")]
    if name == "dgpo_loss":
        common = dict(advantages=adv, group_index=groups, beta=3.0)
        return [("default", (v, v_ref, eps, x0), common),
                ("group_size, KL", (v, v_ref, eps, x0), dict(common, group_size=4, kl_coef=0.1)),
                ("clip, clip_kl", (v, v_ref, eps, x0), dict(common, old_model_output=v_old, clip_range=(0.1, 0.2),
                                                            clip_kl=True, kl_coef=0.1)),
                ("EMA reference", (v, None, eps, x0), dict(common, old_model_output=v_old, ema_reference=True))]
    return None


def _fields(out):
    """A loss's output by field name (a NamedTuple's fields, a tuple's positions, a tensor as 'value')."""
    if isinstance(out, torch.Tensor):
        return {"value": out}
    if hasattr(out, "_fields"):
        return out._asdict()
    return {str(k): t for k, t in enumerate(out)}


def _scalar_loss(out):
    if isinstance(out, torch.Tensor):
        return out.sum()
    return out.loss if hasattr(out, "loss") else out[0]


def _loss_values(name, backend, args, kwargs):
    """flowrl's and the oracle's output fields and gradients in model_output."""
    position = list(inspect.signature(getattr(L, name)).parameters).index("model_output")
    v = args[position].clone().requires_grad_()
    got = getattr(L, name)(*args[:position], v, *args[position + 1:], backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(_scalar_loss(got), v)
    c = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
    o_args = [c(a) for a in args]
    v64 = o_args[position].to(F64).requires_grad_()
    o_args[position] = v64
    o_kwargs = {k: tuple(map(c, val)) if isinstance(val, tuple) else c(val) for k, val in kwargs.items()}
    want = oracle.losses.call(name, *o_args, **o_kwargs)
    (want_grad,) = torch.autograd.grad(_scalar_loss(want), v64)
    got_f = {k: None if t is None else c(t).to(F64) for k, t in _fields(got).items()}
    want_f = {k: None if t is None else t.detach().to(F64) for k, t in _fields(want).items()}
    got_f["grad"], want_f["grad"] = c(grad).to(F64), want_grad
    return got_f, want_f


def _check_loss(name, backend, label, args, kwargs):
    where = f"{name} ({label}) {backend}"
    got, want = _loss_values(name, backend, args, kwargs)
    assert got.keys() == want.keys(), where
    for field in got:
        assert (got[field] is None) == (want[field] is None), f"{where}: {field} given by one side only"
    got = {k: t for k, t in got.items() if t is not None}
    want = {k: t for k, t in want.items() if t is not None}
    if backend == "torch":
        for field, w in want.items():
            rtol, atol = LOSS_TOL["grad" if field == "grad" else "value"]
            atol = atol * float(w.abs().max()) if field == "grad" else atol
            torch.testing.assert_close(got[field], w, rtol=rtol, atol=atol, msg=lambda m: f"{where}, {field}: {m}")
    else:
        torch_got, _ = _loss_values(name, "torch", args, kwargs)
        _check_triton(got, {k: torch_got[k] for k in want}, want, {}, where)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LOSSES)
def test_losses_against_the_float64_oracle(name, backend):
    """Every field of the loss's output and the gradient of its loss in model_output; a loss that scores a
    step, for every mode the losses take."""
    takes_mode = "mode" in inspect.signature(getattr(L, name)).parameters
    cases = ([(m, case) for m in LOSS_MODES for case in (_step_loss_cases(name, m) or [])] if takes_mode
             else [(None, case) for case in (_flow_loss_cases(name) or [])])
    assert cases, f"no input case for loss {name!r}: add one to tests/ops/test_contract.py"
    for mode, (label, args, kwargs) in cases:
        _check_loss(name, backend, f"{label}{'' if mode is None else ', ' + mode.label}", args, kwargs)
