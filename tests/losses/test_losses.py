"""flowrl.losses on both backends (Triton under the interpreter on CPU): the log-prob recompute bit for
bit step_log_prob's (first ratio exactly 1), a float64 oracle of every loss, gradients (gradcheck on
the torch backend; Triton against torch), determinism, batch invariance, the mu_old replay bound, the
AWM reduction's float64-oracle accuracy, argument errors, and the docs/losses.md snippet."""
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl import losses as L
from flowrl.backends import reference as R

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flowrl import oracle  # noqa: E402
from loss_cases import (BACKENDS, DEVICE, F64, SHAPE, STEPS, T, advantages, oracle_grpo,  # noqa: E402
                        perturbed, rollout, schedule)

ROOT = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------- the recompute: bitwise, first ratio 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,dtype,kind", [("sde", torch.float32, "gaussian"), ("cps", torch.bfloat16, "sq_err"),
                                             ("dance", torch.float16, "kernel"), ("flash_sde", torch.float32, "gaussian"),
                                             ("dpm_sde", torch.bfloat16, "gaussian")])
def test_grpo_log_prob_is_step_log_prob_bit_for_bit_and_first_ratio_is_one(backend, mode, dtype, kind):
    """Every mode whose mean is a x + c v (docs/losses.md), dpm_sde at first order (its noise level is 1)."""
    eta = 1.0 if mode == "dpm_sde" else 0.5
    x, v, sig, _ = rollout(mode, eta, dtype)
    steps = STEPS.to(DEVICE)
    out = flowrl.sde_step(x, v, sig, steps, mode=mode, noise_level=eta, noise_seed=3, log_prob_kind=kind, backend=backend)
    res = L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=advantages(),
                      clip_range=0.2, mode=mode,
                      noise_level=eta, log_prob_kind=kind, kl_coef=0.1, ref_model_output=perturbed(v), backend=backend)
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sig, steps, mode=mode, noise_level=eta, log_prob_kind=kind,
                              backend=backend)
    assert torch.equal(res.log_prob, lp) and torch.equal(res.log_prob, out.log_prob)
    assert torch.equal(res.ratio, torch.ones_like(res.ratio))
    assert float(res.clip_fraction) == 0 and float(res.approx_kl) == 0
    kl = flowrl.step_kl(x, v, perturbed(v), sig, steps, mode=mode, noise_level=eta, backend=backend)
    torch.testing.assert_close(res.kl, kl, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------- float64 oracle


def _cpu(t):
    return t.detach().cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sde", "cps"])
def test_grpo_family_matches_the_float64_oracle(backend, mode):
    eta = 0.7 if mode == "sde" else 0.5
    x, v, sig, out = rollout(mode, eta)
    v_new, v_ref, adv, steps = perturbed(v, 0.3), perturbed(v, 0.1, seed=5), advantages(), STEPS.to(DEVICE)
    args = [_cpu(t) for t in (x, v_new, out.prev_sample)] + [sig.cpu(), STEPS, _cpu(out.log_prob), _cpu(adv)]
    common = dict(mode=mode, noise_level=eta, backend=backend)
    res = L.grpo_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                      clip_range=(0.01, 0.3), kl_coef=0.3,
                      ref_model_output=v_ref, **common)
    loss, lp, ratio, kl, _ = oracle_grpo(*args, mode, eta, (0.01, 0.3), 0.3, _cpu(v_ref))
    assert 0 < float(res.clip_fraction) <= 1  # some samples clipped: the test covers both branches
    torch.testing.assert_close(_cpu(res.loss).double(), loss, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(_cpu(res.log_prob).double(), lp, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(_cpu(res.ratio).double(), ratio, rtol=2e-5, atol=0)
    torch.testing.assert_close(_cpu(res.kl).double(), kl, rtol=2e-5, atol=1e-9)
    torch.testing.assert_close(_cpu(res.ratio_max).double(), ratio.max(), rtol=2e-5, atol=0)
    torch.testing.assert_close(_cpu(res.approx_kl).double(), 0.5 * ((lp - _cpu(out.log_prob).double()) ** 2).mean(),
                               rtol=1e-4, atol=1e-9)
    old_mean = _cpu(out.prev_sample_mean)
    guard = L.grpo_guard_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                              clip_range=0.2,
                              old_prev_sample_mean=out.prev_sample_mean, **common)
    loss, _, ratio, _, tr = oracle_grpo(*args, mode, eta, (0.2, 0.2), old_mean=old_mean, variant="guard")
    torch.testing.assert_close(_cpu(guard.trust_divergence).double(), tr, rtol=2e-5, atol=1e-9)
    torch.testing.assert_close(_cpu(guard.ratio).double(), ratio, rtol=2e-5, atol=0)
    torch.testing.assert_close(_cpu(guard.loss).double(), loss, rtol=2e-5, atol=2e-6)
    low = tr.sort().values
    threshold = float(low[0] + low[1]) / 2  # one sample below it, two above
    dppo = L.flow_dppo_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                            kl_threshold=threshold,
                            old_prev_sample_mean=out.prev_sample_mean, **common)
    loss, *_ = oracle_grpo(*args, mode, eta, None, old_mean=old_mean, variant="dppo", kl_threshold=threshold)
    torch.testing.assert_close(_cpu(dppo.loss).double(), loss, rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------------------------ gradients


def _f64_inputs(mode="sde", eta=0.7, shape=(2, 3, 7)):
    x, v, sig, out = rollout(mode, eta, shape=shape, steps=STEPS[1:])
    to = lambda t: t.detach().cpu().to(F64)  # noqa: E731
    return to(x), to(v), sig.cpu(), to(out.prev_sample), to(out.log_prob), to(out.prev_sample_mean)


@pytest.mark.parametrize("variant", ["grpo", "guard", "guard_replay", "dppo"])
def test_grpo_family_gradcheck_on_the_torch_backend(variant):
    x, v, sig, prev, old_lp, old_mean = _f64_inputs()
    steps, adv = STEPS[1:], torch.tensor([0.7, -1.3], dtype=F64)
    v_ref = perturbed(v, 0.1, seed=7)
    v0 = perturbed(v, 0.2).requires_grad_()

    def loss(vv):
        if variant == "grpo":
            return L.grpo_loss(x, vv, prev, sig, steps, old_log_prob=old_lp, advantages=adv, clip_range=(0.1, 10.0),
                               kl_coef=0.5,
                               ref_model_output=v_ref, backend="torch").loss
        if variant == "dppo":
            return L.flow_dppo_loss(x, vv, prev, sig, steps, old_log_prob=old_lp, advantages=adv, kl_threshold=1e9,
                                    old_prev_sample_mean=old_mean, backend="torch").loss
        src = dict(noise_seed=11) if variant == "guard_replay" else dict(old_prev_sample_mean=old_mean)
        return L.grpo_guard_loss(x, vv, prev, sig, steps, old_log_prob=old_lp, advantages=adv, clip_range=(0.9, 10.0),
                                 kl_coef=0.5,
                                 ref_model_output=v_ref, backend="torch", **src).loss

    assert torch.autograd.gradcheck(loss, (v0,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_flow_losses_gradcheck_on_the_torch_backend():
    g = torch.Generator().manual_seed(3)
    x0, eps, v, v_old, v_ref = (torch.randn(2, 3, 7, generator=g, dtype=F64) for _ in range(5))
    t = torch.tensor([0.3, 0.8], dtype=F64)
    xt = (1 - t.reshape(-1, 1, 1)) * x0 + t.reshape(-1, 1, 1) * eps
    adv, old_lp = torch.tensor([0.5, -2.0], dtype=F64), torch.tensor([-2.0, -1.9], dtype=F64)
    for weighting in L.AWM_WEIGHTINGS:
        fn = lambda vv: L.awm_loss(vv, eps, x0, t, old_log_prob=old_lp, advantages=adv, clip_range=(0.9, 5.0),
                                   weighting=weighting,  # noqa: E731
                                   backend="torch").loss
        assert torch.autograd.gradcheck(fn, (v.clone().requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-5), weighting
    # NFT's weights are stop-grad: compare with autograd of the formula written out instead of finite differences
    vv = v.clone().requires_grad_()
    res = L.nft_loss(xt, vv, v_old, x0, t, advantages=adv, beta=0.3, adv_clip_max=1.5, kl_coef=0.2,
                     ref_model_output=v_ref,
                     backend="torch")
    (grad,) = torch.autograd.grad(res.loss, vv)
    ve = v.clone().requires_grad_()
    expected = oracle_nft(xt, ve, v_old, x0, t, adv, 0.3, 1.5, 0.2, v_ref)
    torch.testing.assert_close(res.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, ve)[0], rtol=1e-10, atol=1e-14)


def oracle_nft(xt, v, v_old, x0, t, adv, beta, adv_max, kl_coef, v_ref):
    """DiffusionNFT's loss written from its formula in float64 (r, v+-, x0+-, stop-grad weights)."""
    dims = tuple(range(1, xt.ndim))
    tb = t.reshape(-1, *([1] * (xt.ndim - 1)))
    r = ((adv.clamp(-adv_max, adv_max) / adv_max) / 2 + 0.5).clamp(0, 1)
    e_pos = xt - tb * (beta * v + (1 - beta) * v_old) - x0
    e_neg = xt - tb * ((1 + beta) * v_old - beta * v) - x0
    w_pos = e_pos.detach().abs().mean(dims).clamp(min=1e-5)
    w_neg = e_neg.detach().abs().mean(dims).clamp(min=1e-5)
    per = (r * (e_pos ** 2).mean(dims) / w_pos + (1 - r) * (e_neg ** 2).mean(dims) / w_neg) / beta
    return (per * adv_max).mean() + kl_coef * ((v - v_ref) ** 2).mean(dims).mean()


def _grad(fn, v):
    vv = v.clone().requires_grad_()
    res = fn(vv)
    (g,) = torch.autograd.grad(res.loss, vv)
    return res, g


@pytest.mark.skipif(not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs the Triton backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_losses_and_grads_match_torch(dtype):
    x, v, sig, out = rollout("sde", 0.7, dtype)
    steps, adv, v_ref, v_new = STEPS.to(DEVICE), advantages(), perturbed(v, 0.1, seed=5), perturbed(v, 0.3)
    # bf16: the torch backend rounds each autograd path's gradient to bf16 before summing them, the kernel
    # sums in float32 and rounds once: they differ by about a bf16 ulp (2**-8) of the largest term
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    cases = {
        "grpo": lambda vv, be: L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                           advantages=adv, clip_range=(0.05, 0.3),
                                           kl_coef=0.3, ref_model_output=v_ref, backend=be),
        "guard_replay": lambda vv, be: L.grpo_guard_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                                         advantages=adv,
                                                         clip_range=0.2, noise_seed=11, backend=be),
        "dppo_given": lambda vv, be: L.flow_dppo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                                      advantages=adv,
                                                      kl_threshold=1e-3, old_prev_sample_mean=out.prev_sample_mean,
                                                      kl_coef=0.1, ref_model_output=v_ref, backend=be),
    }
    g = torch.Generator().manual_seed(9)
    x0 = torch.randn(SHAPE, generator=g).to(DEVICE, dtype)
    t = torch.tensor([0.2, 0.5, 0.9], device=DEVICE)
    cases["nft"] = lambda vv, be: L.nft_loss(x, vv, v, x0, t, advantages=adv, beta=0.5, adv_clip_max=2.0, kl_coef=0.2,
                                             ref_model_output=v_ref, backend=be)
    old_awm = L.awm_log_prob(v, x, x0, t, weighting="ghuber", backend="torch")
    cases["awm"] = lambda vv, be: L.awm_loss(vv, x, x0, t, old_log_prob=old_awm, advantages=adv, clip_range=0.5,
                                             weighting="ghuber", backend=be)
    for name, fn in cases.items():
        res_t, grad_t = _grad(lambda vv: fn(vv, "torch"), v_new)
        res_k, grad_k = _grad(lambda vv: fn(vv, "triton"), v_new)
        assert grad_k.dtype == dtype, name
        torch.testing.assert_close(res_k.loss, res_t.loss, **tol, msg=name)
        scale = grad_t.float().abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grad_k.float() / scale, grad_t.float() / scale, **tol, msg=name)


# -------------------------------------------------------------------- determinism, batch invariance


@pytest.mark.parametrize("backend", BACKENDS)
def test_losses_are_deterministic_and_per_sample_values_batch_invariant(backend):
    x, v, sig, out = rollout("sde", 0.7)
    steps, adv, v_new, v_ref = STEPS.to(DEVICE), advantages(), perturbed(v, 0.3), perturbed(v, 0.1, seed=5)
    t = torch.tensor([0.2, 0.5, 0.9], device=DEVICE)

    def run(rows):
        pick = lambda u: u[rows]  # noqa: E731
        seeds = torch.tensor([101, 102, 103], device=DEVICE)[rows]
        res, grad = _grad(lambda vv: L.grpo_guard_loss(
            pick(x), vv, pick(out.prev_sample), sig, pick(steps), old_log_prob=pick(out.log_prob), advantages=pick(adv), clip_range=0.2,
            noise_seed=seeds, kl_coef=0.2, ref_model_output=pick(v_ref), backend=backend), pick(v_new))
        nft = L.nft_loss(pick(x), pick(v_new), pick(v), pick(v_ref), pick(t), advantages=pick(adv), beta=0.5,
                         adv_clip_max=2.0,
                         backend=backend)
        awm = L.awm_log_prob(pick(v_new), pick(x), pick(v_ref), pick(t), weighting="huber", backend=backend)
        grpo = L.grpo_loss(pick(x), pick(v_new), pick(out.prev_sample), sig, pick(steps),
                           old_log_prob=pick(out.log_prob), advantages=pick(adv),
                           clip_range=(0.01, 0.3), kl_coef=0.2, ref_model_output=pick(v_ref), backend=backend)
        return res, grad, nft, awm, grpo

    full = run(slice(None))
    again = run(slice(None))
    assert torch.equal(full[1], again[1]) and torch.equal(full[0].loss, again[0].loss)
    for i in range(3):
        one = run(slice(i, i + 1))
        for field in ("log_prob", "kl", "trust_divergence", "ratio"):
            assert torch.equal(getattr(one[0], field), getattr(full[0], field)[i:i + 1]), (field, i)
        assert torch.equal(one[2].per_sample_loss, full[2].per_sample_loss[i:i + 1])
        assert torch.equal(one[3], full[3][i:i + 1])
        for field in ("log_prob", "kl", "ratio"):
            assert torch.equal(getattr(one[4], field), getattr(full[4], field)[i:i + 1]), (field, i)
        # a batch of one: its loss gradient is 3x its share of the batch mean's (the mean over 3 samples),
        # up to the rounding of the 1/3 the mean's backward brings in
        scale = float(one[1].abs().max())
        torch.testing.assert_close(one[1], 3 * full[1][i:i + 1], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_steps_give_finite_losses_and_zero_gradients(backend):
    """ode, or noise level 0: std is 0, the log-prob, KL and D_s are 0 by the contract's deterministic
    rule, the ratio exp(0) = 1 (GRPO-Guard's exp(0 * 0) too), and nothing is NaN."""
    x, v, sig, _ = rollout()
    steps, adv = STEPS.to(DEVICE), advantages()
    prev = flowrl.sde_step(x, v, sig, steps, mode="ode", backend=backend).prev_sample
    for fn, extra in ((L.grpo_loss, dict(clip_range=0.2, kl_coef=0.5, ref_model_output=perturbed(v))),
                      (L.grpo_guard_loss, dict(clip_range=0.2, noise_seed=3)),
                      (L.flow_dppo_loss, dict(kl_threshold=0.0, old_prev_sample_mean=prev.float()))):
        res, grad = _grad(lambda vv: fn(x, vv, prev, sig, steps, old_log_prob=torch.zeros(3, device=DEVICE),
                                        advantages=adv, mode="ode",
                                        backend=backend, **extra), perturbed(v))
        assert torch.equal(res.ratio, torch.ones(3, device=DEVICE)) and torch.equal(res.log_prob, torch.zeros(3, device=DEVICE))
        assert bool(torch.isfinite(res.loss)) and torch.equal(grad, torch.zeros_like(grad)), fn.__name__


# ------------------------------------------------------------------------------- mu_old replay


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_mean_is_within_one_rounding_of_the_stored_sample(backend, dtype):
    """docs/losses.md, Replaying mu_old: x' = round(mu + std eps); mu_old = x' - std eps is then within
    |x' - (mu + std eps)| + half an ulp of |x' - std eps| of mu, i.e. one float32 rounding of x' (float32
    storage) or one rounding to x''s dtype (half precision). D_s with the replayed mean equals D_s with
    the stored one up to that."""
    x, v, sig, out = rollout("sde", 0.7, dtype, steps=STEPS)
    steps, seed = STEPS.to(DEVICE), 11
    # the replayed mean, from flowrl's own pieces (torch backend)
    a, c, std = R.mode_coefficients(sig, steps, flowrl.contract.Mode.SDE, 0.7, torch.float32)
    spec_seed = flowrl.core._validate.check_noise_seed(seed, x)
    eps = R.philox_normal(spec_seed, x[0].numel())
    prev = out.prev_sample.float().reshape(3, -1)
    replay = prev - std.reshape(-1, 1) * eps
    mu = out.prev_sample_mean.reshape(3, -1)
    unrounded = mu + std.reshape(-1, 1) * eps
    ulp = lambda t: torch.finfo(torch.float32).eps * t.abs()  # noqa: E731
    bound = (prev - unrounded).abs() + ulp(prev) + ulp(replay)
    assert bool(((replay - mu).abs() <= bound).all())
    if dtype == torch.float32:
        assert float((replay - mu).abs().max()) <= 2 * float(ulp(prev).max())
    # the loss: D_s(replay) vs D_s(stored) with model_output == the rollout's
    common = dict(clip_range=0.2, backend=backend)
    given = L.grpo_guard_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=advantages(),
                              old_prev_sample_mean=out.prev_sample_mean, **common)
    replayed = L.grpo_guard_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=advantages(),
                                 noise_seed=seed, **common)
    if backend == "torch":  # the same float32 mu as the rollout's returned mean: exactly 0
        assert torch.equal(given.trust_divergence, torch.zeros(3, device=DEVICE))
    expected = (bound * bound).mean(1) / (2 * std * std)
    assert bool((replayed.trust_divergence <= expected * (1 + 1e-3)).all())
    # away from the rollout's policy both sources agree up to that rounding
    v_new = perturbed(v, 0.1)
    d_given = L.grpo_guard_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                advantages=advantages(),
                                old_prev_sample_mean=out.prev_sample_mean, **common).trust_divergence
    d_replay = L.grpo_guard_loss(x, v_new, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                 advantages=advantages(), noise_seed=seed,
                                 **common).trust_divergence
    # the replayed mean moves the RMS of mu_theta - mu_old by at most the RMS of the rounding (triangle inequality)
    slack = (d_replay.sqrt() - d_given.sqrt()).abs()
    assert bool((slack <= expected.sqrt() * (1 + 1e-3) + 1e-6 * d_given.sqrt()).all()), (slack, expected.sqrt())
    if dtype == torch.float32:
        torch.testing.assert_close(d_replay, d_given, rtol=1e-4, atol=0)


def test_replay_from_bf16_latents_moves_the_divergence_float32_does_not():
    """docs/losses.md: the replay error from a bfloat16 x' is of the order of one update's mean shift."""
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, v, sig, out = rollout("sde", 0.7, torch.bfloat16, steps=STEPS)
        out = flowrl.sde_step(x, v, sig, STEPS.to(DEVICE), noise_seed=11, out_dtype=dtype, backend="torch")
        common = dict(clip_range=0.2, backend="torch", old_log_prob=out.log_prob, advantages=advantages())
        args = (x, perturbed(v, 0.05), out.prev_sample, sig, STEPS.to(DEVICE))
        given = L.grpo_guard_loss(*args, old_prev_sample_mean=out.prev_sample_mean, **common).trust_divergence
        replay = L.grpo_guard_loss(*args, noise_seed=11, **common).trust_divergence
        moved[dtype] = float(((replay - given).abs() / given).max())
    assert moved[torch.float32] <= 1e-4 and moved[torch.bfloat16] > 1e-2, moved


# --------------------------------------------------------------------------- AWM float64 accuracy


@pytest.mark.parametrize("backend", BACKENDS)
def test_awm_float32_reduction_reaches_float64_oracle_accuracy(backend):
    """AWM reduces in float64 (Flow-Factory awm.py); flowrl sums float32 squares by the contract's chunked
    halving tree: the error of a float32 tree over n terms is ~ log2(n) eps at worst and ~ sqrt(log2 n) eps
    typically, far below a running float32 sum's ~ n eps. Measured here against the float64 oracle on
    samples whose squares share one sign and a common offset (the running sum's worst case)."""
    n = 16 * 1024 + 5
    g = torch.Generator().manual_seed(4)
    v = (3.0 + 0.1 * torch.randn(2, n, generator=g)).to(DEVICE)
    eps, x0 = torch.randn(2, n, generator=g).to(DEVICE), torch.zeros(2, n, device=DEVICE)
    lp = L.awm_log_prob(v, eps, x0, 1.0, backend=backend)
    exact = -((v.double() - (eps.double() - x0.double())) ** 2).mean(1)  # the peer's float64 reduction
    err = ((lp.double() - exact).abs() / exact.abs()).max().item()
    sequential = torch.zeros(2, dtype=torch.float32, device=DEVICE)
    sq = (v - (eps - x0)) ** 2
    # a running float32 sum, in blocks so the loop stays short (each block's sum is exact enough)
    for block in sq.split(256, dim=1):
        sequential = sequential + block.double().sum(1).float()
    seq_err = ((-(sequential / n)).double() - exact).abs().max().item() / exact.abs().min().item()
    assert err <= 4 * 2.0**-24, err  # within 4 float32 ulps of the float64 oracle
    assert err <= seq_err or seq_err <= 4 * 2.0**-24


# ------------------------------------------------------------------------------------- arguments


def test_bad_arguments_name_the_argument():
    x, v, sig, out = rollout()
    steps, adv = STEPS.to(DEVICE), advantages()
    base = dict(clip_range=0.2, backend="torch")

    def call(fn=L.grpo_loss, **kw):
        args = dict(base)
        args.update(kw)
        return fn(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, **args)

    with pytest.raises(ValueError, match="clip_range"):
        call(clip_range=-0.1)
    with pytest.raises(ValueError, match=r"clip_range must be a float or a pair"):
        call(clip_range=(0.1, 0.2, 0.3))
    with pytest.raises(TypeError, match="clip_range"):
        call(clip_range=float("nan"))
    with pytest.raises(ValueError, match="ref_model_output"):
        call(kl_coef=0.1)
    with pytest.raises(ValueError, match="old_log_prob"):
        L.grpo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob[:2], advantages=adv, **base)
    with pytest.raises(ValueError, match="sample requires grad"):
        L.grpo_loss(x.clone().requires_grad_(), v, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                    advantages=adv, **base)
    with pytest.raises(ValueError, match="exactly one of old_prev_sample_mean"):
        call(L.grpo_guard_loss)
    with pytest.raises(ValueError, match="exactly one of old_prev_sample_mean"):
        call(L.grpo_guard_loss, noise_seed=1, old_prev_sample_mean=out.prev_sample_mean)
    with pytest.raises(TypeError, match="kl_threshold"):
        L.flow_dppo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                         kl_threshold=None, noise_seed=1)
    with pytest.raises(ValueError, match="weighting"):
        L.awm_log_prob(v, x, x, 0.5, weighting="Uniform")
    with pytest.raises(ValueError, match="beta"):
        L.nft_loss(x, v, v, x, 0.5, advantages=adv, beta=0.0, adv_clip_max=1.0)
    with pytest.raises(ValueError, match="old_model_output"):
        L.nft_loss(x, v, v[:2], x, 0.5, advantages=adv, beta=0.1, adv_clip_max=1.0)
    alpha_bar = torch.tensor([0.5, 0.6, 0.6, 0.7], dtype=torch.float32, device=DEVICE)  # ddim's [2T] table
    with pytest.raises(ValueError, match="mode='ddim' is not supported by flowrl.losses"):
        L.grpo_loss(x, v, out.prev_sample, alpha_bar, 0, old_log_prob=out.log_prob, advantages=adv, clip_range=0.2,
                    mode="ddim",
                    noise_level=1.0, backend="torch")


def test_teacher_kl_is_step_kl_with_the_teacher_and_its_gradient():
    x, v, sig, _ = rollout()
    steps, teacher = STEPS.to(DEVICE), perturbed(v, 0.2)
    vv = v.clone().requires_grad_()
    loss, kl = L.teacher_kl_loss(x, vv, teacher, sig, steps, backend="torch")
    torch.testing.assert_close(kl.double(), oracle.kl(_cpu(x), _cpu(v), _cpu(teacher), sig.cpu(), [0, 4, 8], "sde", 0.7)
                               .to(DEVICE), rtol=2e-5, atol=0)
    (g,) = torch.autograd.grad(loss, vv)
    ve = _cpu(v).double().requires_grad_()
    expected = oracle.kl(_cpu(x), ve, _cpu(teacher), sig.cpu(), [0, 4, 8], "sde", 0.7).mean()
    torch.testing.assert_close(_cpu(g).double(), torch.autograd.grad(expected, ve)[0], rtol=1e-4, atol=1e-9)
# ------------------------------------------------------- per-token sigmas and frozen masks (docs/losses.md)


def elementwise(shape=SHAPE, steps=STEPS):
    """[B, S, 1] per-token sigmas (a third of the tokens one schedule step behind, two held at sigma 0, the
    rest at their sample's sigma) and a [1, S, 1] frozen mask (the last tokens: conditioning)."""
    b, s = shape[0], shape[1]
    sig = schedule()
    idx = steps.to(DEVICE)
    tok = sig[idx].reshape(b, 1, 1).expand(b, s, 1).clone()
    tok[:, : max(1, s // 3)] = sig[torch.clamp(idx + 1, max=T)].reshape(b, 1, 1)
    tok[1, -2:] = 0.0
    frozen = torch.zeros(1, s, 1, dtype=torch.bool, device=DEVICE)
    frozen[:, -1] = True
    return tok, frozen


ELEMENTWISE_SHAPE = (3, 6, 250)  # 1500 elements per sample, tokens of 250 elements


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("given", ["token_sigmas", "frozen", "both"])
def test_grpo_family_with_token_sigmas_and_frozen_is_step_log_prob_and_step_kl_bit_for_bit(backend, dtype, given):
    """log_prob is step_log_prob(..., token_sigmas=, frozen=)'s bit for bit (first ratio exactly 1), the KL
    step_kl's, the teacher KL step_kl's; the gradient of a loss without KL is autograd through step_log_prob
    (torch) / its fused backward (Triton) bit for bit, the teacher KL's through step_kl."""
    tok, frozen = elementwise(ELEMENTWISE_SHAPE)
    ew = dict(token_sigmas=tok if given != "frozen" else None, frozen=frozen if given != "token_sigmas" else None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ELEMENTWISE_SHAPE, generator=g).to(DEVICE, dtype)
    v = torch.randn(ELEMENTWISE_SHAPE, generator=g).to(DEVICE, dtype)
    sig, steps, adv = schedule(), STEPS.to(DEVICE), advantages()
    kw = dict(mode="sde", noise_level=0.7, backend=backend, **ew)
    out = flowrl.sde_step(x, v, sig, steps, noise_seed=5, **kw)
    v_ref, v_new = perturbed(v, 0.1, seed=5), perturbed(v, 0.2, seed=6)
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sig, steps, **kw)
    kl = flowrl.step_kl(x, v, v_ref, sig, steps, **kw)
    for fn, extra in ((L.grpo_loss, dict(clip_range=0.2, kl_coef=0.1, ref_model_output=v_ref)),
                      (L.flow_dppo_loss, dict(kl_threshold=1e-3, noise_seed=5, kl_coef=0.1, ref_model_output=v_ref)),
                      (L.flow_dppo_loss, dict(kl_threshold=1e-3, old_prev_sample_mean=out.prev_sample_mean))):
        res = fn(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv, **extra, **kw)
        assert torch.equal(res.log_prob, lp) and torch.equal(res.log_prob, out.log_prob), fn.__name__
        assert torch.equal(res.ratio, torch.ones_like(res.ratio)), fn.__name__
        if "ref_model_output" in extra:
            assert torch.equal(res.kl, kl), fn.__name__
        if res.trust_divergence is not None:  # mu_old is this policy's mean: D_s is 0 up to x' - std eps rounding
            assert res.trust_divergence.abs().max() < 1e-4, fn.__name__
    if given == "frozen":
        res = L.grpo_guard_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                                clip_range=0.2,
                                old_prev_sample_mean=out.prev_sample_mean, **kw)
        assert torch.equal(res.log_prob, lp)
    vv = v_new.clone().requires_grad_()
    res = L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                      clip_range=0.2, **kw)
    (g_loss,) = torch.autograd.grad(res.loss, vv)
    vv = v_new.clone().requires_grad_()
    lp_new = flowrl.step_log_prob(x, vv, out.prev_sample, sig, steps, **kw)
    assert torch.equal(res.log_prob, lp_new.detach())
    from flowrl.core.loss_spec import Variant
    from flowrl.losses._policy import policy_loss
    want = policy_loss(Variant.GRPO, lp_new, None, None, out.log_prob, adv, (0.2, 0.2), 0.0, None, None).loss
    (g_want,) = torch.autograd.grad(want, vv)
    assert g_loss.abs().max() > 0 and torch.equal(g_loss, g_want)
    vv = v_new.clone().requires_grad_()
    loss, kl_t = L.teacher_kl_loss(x, vv, v_ref, sig, steps, **kw)
    (g_t,) = torch.autograd.grad(loss, vv)
    vv = v_new.clone().requires_grad_()
    kl_want = flowrl.step_kl(x, vv, v_ref, sig, steps, **kw)
    (g_want,) = torch.autograd.grad(kl_want.mean(), vv)
    assert torch.equal(kl_t, kl_want.detach()) and torch.equal(g_t, g_want)


def test_per_token_trust_divergence_is_the_per_token_kl_to_the_old_policy():
    """D_s with per-token sigmas and a frozen mask is step_kl's per-element KL (each token's std; the
    scored elements' mean) to the rollout policy: mu_old given or replayed from x' and the rollout's seed."""
    tok, frozen = elementwise(ELEMENTWISE_SHAPE)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(ELEMENTWISE_SHAPE, generator=g).to(DEVICE)
    v_old = torch.randn(ELEMENTWISE_SHAPE, generator=g).to(DEVICE)
    sig, steps, adv, v = schedule(), STEPS.to(DEVICE), advantages(), perturbed(v_old, 0.1, seed=8)
    kw = dict(mode="sde", noise_level=0.7, backend="torch", token_sigmas=tok, frozen=frozen)
    out = flowrl.sde_step(x, v_old, sig, steps, noise_seed=7, **kw)
    want = flowrl.step_kl(x, v, v_old, sig, steps, reduction="mean", **kw)
    for trust in (dict(old_prev_sample_mean=out.prev_sample_mean), dict(noise_seed=7)):
        res = L.flow_dppo_loss(x, v, out.prev_sample, sig, steps, old_log_prob=out.log_prob, advantages=adv,
                               kl_threshold=1.0, **trust, **kw)
        torch.testing.assert_close(res.trust_divergence, want, rtol=1e-3, atol=1e-6)


def test_per_token_refusals_name_the_argument():
    """GRPO-Guard's per-step weights (std, 1/D) are one step's: token_sigmas is refused (a frozen mask is
    not); the velocity KL and joint steps take neither."""
    tok, frozen = elementwise(ELEMENTWISE_SHAPE)
    x, v, sig, out = rollout(shape=ELEMENTWISE_SHAPE)
    steps, adv = STEPS.to(DEVICE), advantages()
    args = (x, v, out.prev_sample, sig, steps)
    args_kw = dict(old_log_prob=out.log_prob, advantages=adv)
    with pytest.raises(ValueError, match="token_sigmas.*grpo_guard_loss"):
        L.grpo_guard_loss(*args, **args_kw, clip_range=0.2, noise_seed=11, token_sigmas=tok, backend="torch")
    with pytest.raises(ValueError, match="frozen.*kl_space='velocity'"):
        L.grpo_loss(*args, **args_kw, clip_range=0.2, kl_coef=0.1, ref_model_output=v, kl_space="velocity",
                    frozen=frozen,
                    backend="torch")
    with pytest.raises(ValueError, match="token_sigmas: a joint step"):
        L.grpo_loss((x, x), (v, v), (out.prev_sample,) * 2, sig, steps, **args_kw, clip_range=0.2,
                    token_sigmas=tok, backend="torch")
    with pytest.raises(ValueError, match="token_sigmas"):
        L.grpo_loss(*args, **args_kw, clip_range=0.2, token_sigmas=tok[:, :2],
                    backend="torch")  # step_log_prob's shape check


@pytest.mark.skipif(not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs the Triton backend")
def test_triton_per_token_losses_and_grads_match_torch():
    tok, frozen = elementwise(ELEMENTWISE_SHAPE)
    x, v, sig, out = rollout(shape=ELEMENTWISE_SHAPE)
    steps, adv, v_ref, v_new = STEPS.to(DEVICE), advantages(), perturbed(v, 0.1, seed=5), perturbed(v, 0.3)
    kw = dict(token_sigmas=tok, frozen=frozen)
    cases = {
        "grpo": lambda vv, be: L.grpo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                           advantages=adv, clip_range=(0.05, 0.3),
                                           kl_coef=0.3, ref_model_output=v_ref, backend=be, **kw),
        "dppo_replay": lambda vv, be: L.flow_dppo_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                                       advantages=adv,
                                                       kl_threshold=1e-3, noise_seed=11, kl_coef=0.1,
                                                       ref_model_output=v_ref, backend=be, **kw),
        "guard_frozen": lambda vv, be: L.grpo_guard_loss(x, vv, out.prev_sample, sig, steps, old_log_prob=out.log_prob,
                                                         advantages=adv,
                                                         clip_range=0.2, old_prev_sample_mean=out.prev_sample_mean,
                                                         backend=be, frozen=frozen),
    }
    for name, fn in cases.items():
        res_t, grad_t = _grad(lambda vv: fn(vv, "torch"), v_new)
        res_k, grad_k = _grad(lambda vv: fn(vv, "triton"), v_new)
        torch.testing.assert_close(res_k.loss, res_t.loss, rtol=1e-5, atol=1e-6, msg=name)
        scale = grad_t.float().abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grad_k.float() / scale, grad_t.float() / scale, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------- docs


def test_docs_snippet_runs():
    """docs/losses.md's trainer snippet, run as written (its first ratio is exactly 1)."""
    text = (ROOT / "docs" / "losses.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(snippet, "docs/losses.md", "exec"), scope)
    assert torch.equal(scope["result"].ratio, torch.ones(4))
    assert scope["model_output"].grad is not None


def test_readme_links_the_losses_page():
    readme = (ROOT / "README.md").read_text()
    assert "docs/losses.md" in readme and "flowrl.losses.grpo_loss" in readme
