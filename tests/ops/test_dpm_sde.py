"""mode='dpm_sde': SDE-DPM-Solver++ for flow models (alpha = 1 - sigma), orders 1 and 2, as MixGRPO
samples with it, on both backends (Triton under the interpreter here).

The peer oracle is MixGRPO's fastvideo/utils/sampling_utils.py (Tencent-Hunyuan/MixGRPO, commit
d270daf): ``dpm_solver_first_order_update`` and ``multistep_dpm_solver_second_order_update`` with
``dpm_algorithm_type="dpmsolver++"``, ``dpm_solver_type="midpoint"``, ``sde_solver=True``, and
``dpm_step``'s order rule (first order at the first step and at the final step,
``lower_order_final``), transcribed below in float64 with their operations (logs of alpha and sigma,
``torch.exp(-h)``). Their mean is ``prev_mean``, their std ``std_dev_t * dt_sqrt``; their model
outputs are x0 predictions ``sample - sigma * model_output`` (``convert_model_output``), which is
what flowrl's ``prev_x0_pred`` holds.
"""
from __future__ import annotations

import math

import pytest
import torch

from flowrl import sde_step, step_kl, step_log_prob

F64 = torch.float64
BACKENDS = ("torch", "triton")


def schedule(steps=6, shift=3.0):
    """A shifted flow schedule from 1 to 0 (SD3's time shift), float32 as diffusers builds it."""
    t = torch.linspace(1, 0, steps + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).float()


# ---------------------------------------------------------------- MixGRPO's formulas (the peer oracle)


def _alpha_sigma(sigma):  # MixGRPO's _sigma_to_alpha_sigma_t
    return 1 - sigma, sigma


def mixgrpo_first_order(x0, sigmas, i, sample):
    """MixGRPO dpm_solver_first_order_update (dpmsolver++): (prev_mean, std_dev_t * dt_sqrt)."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[i + 1])
    alpha_s, sigma_s = _alpha_sigma(sigmas[i])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    prev_mean = (sigma_t / sigma_s * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * x0
    return prev_mean, sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h))


def mixgrpo_second_order(model_output_list, sigmas, i, sample):
    """MixGRPO multistep_dpm_solver_second_order_update (dpmsolver++, midpoint)."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[i + 1])
    alpha_s0, sigma_s0 = _alpha_sigma(sigmas[i])
    alpha_s1, sigma_s1 = _alpha_sigma(sigmas[i - 1])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    d0, d1 = m0, (1.0 / r0) * (m0 - m1)
    prev_mean = ((sigma_t / sigma_s0 * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * d0
                 + 0.5 * (alpha_t * (1 - torch.exp(-2.0 * h))) * d1)
    return prev_mean, sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h))


def mixgrpo_step(order, x0_list, sigmas, i, sample):
    """dpm_step's order choice: first order while fewer than one earlier output is kept
    (lower_order_nums < 1, i.e. step 0) and at the final step (lower_order_final); else second."""
    final = i == sigmas.numel() - 2
    if order == 1 or i == 0 or final:
        return mixgrpo_first_order(x0_list[-1], sigmas, i, sample)
    return mixgrpo_second_order(x0_list, sigmas, i, sample)


def latents(shape=(3, 5, 7), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(4)]


# --------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("order", [1, 2])
def test_mean_and_std_match_mixgrpo_in_float64(order):
    sigmas = schedule()
    s64 = sigmas.to(F64)
    x, v, v_prev, x_prev = latents(dtype=F64)
    for i in range(sigmas.numel() - 1):
        x0 = x - s64[i] * v
        x0_prev = None if i == 0 else x_prev - s64[i - 1] * v_prev
        want_mean, want_std = mixgrpo_step(order, [x0_prev, x0], s64, i, x)
        prev = x0_prev if order == 2 and i > 0 else None
        out = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", prev_x0_pred=prev,
                       noise=torch.zeros_like(x))
        assert out.prev_sample_mean.dtype == F64
        torch.testing.assert_close(out.prev_sample_mean, want_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.std_dev, want_std.expand(3).to(F64), rtol=1e-12, atol=1e-14)


def test_second_order_is_used_where_mixgrpo_uses_it():
    """The second-order term is not vacuous: at a middle step it moves the mean by more than
    rounding, and MixGRPO's first-order mean is then far from flowrl's second-order one."""
    sigmas = schedule()
    s64 = sigmas.to(F64)
    x, v, v_prev, x_prev = latents(dtype=F64)
    i = 3
    x0, x0_prev = x - s64[i] * v, x_prev - s64[i - 1] * v_prev
    first = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", noise=torch.zeros_like(x))
    second = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", prev_x0_pred=x0_prev,
                      noise=torch.zeros_like(x))
    assert (first.prev_sample_mean - second.prev_sample_mean).abs().max() > 1e-2
    torch.testing.assert_close(first.prev_sample_mean, mixgrpo_first_order(x0, s64, i, x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", [1, 2])
def test_kernel_error_vs_float64_within_twice_torch(backend, dtype, order):
    """flash-attention's criterion: the backend's float32-arithmetic mean is within 2x the torch
    reference's error against the float64 oracle (plus an ulp-sized floor)."""
    sigmas = schedule()
    x, v, _, x0_prev = latents(shape=(2, 1300), dtype=dtype)
    for i in range(1, sigmas.numel() - 1):
        prev = x0_prev if order == 2 else None
        exact = sde_step(x.double(), v.double(), sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch",
                         prev_x0_pred=None if prev is None else prev.double(), noise=torch.zeros(x.shape, dtype=F64))
        ref = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", prev_x0_pred=prev,
                       noise=torch.zeros(x.shape))
        got = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend=backend, prev_x0_pred=prev,
                       noise=torch.zeros(x.shape))
        err_ref = (ref.prev_sample_mean.double() - exact.prev_sample_mean).abs().max().item()
        err = (got.prev_sample_mean.double() - exact.prev_sample_mean).abs().max().item()
        assert err <= 2 * err_ref + 1e-6, (i, err, err_ref)
        torch.testing.assert_close(got.std_dev.double(), exact.std_dev, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_equals_recompute_bitwise_and_scores_the_emitted_sample(backend, order, dtype):
    sigmas = schedule()
    x, v, x0_prev, _ = latents(shape=(3, 2, 600), dtype=dtype)
    g = torch.Generator().manual_seed(5)
    # the interpreter is slow: on Triton the first step, a second-order one and the last (sigma' = 0)
    for i in range(sigmas.numel() - 1) if backend == "torch" else (0, 2, sigmas.numel() - 2):
        prev = x0_prev if order == 2 else None
        out = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend=backend, prev_x0_pred=prev,
                       generator=g)
        assert out.prev_sample.dtype == dtype
        lp = step_log_prob(x, v, out.prev_sample, sigmas, i, mode="dpm_sde", noise_level=1.0, backend=backend,
                           prev_x0_pred=prev)
        assert torch.equal(out.log_prob, lp), (i, out.log_prob, lp)  # the first ratio is exactly 1
        assert torch.isfinite(lp).all()
        if i < sigmas.numel() - 2:
            # rounding rule: the log-prob is of the rounded x', from its float32 residual to the mean
            r = out.prev_sample.float() - out.prev_sample_mean
            std = out.std_dev.reshape(-1, 1, 1)
            want = (-(r * r) / (2 * std * std) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
            torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_step_is_deterministic_and_first_step_from_sigma_one_is_finite(backend):
    """sigma' = 0: q = e^{-h} = 0, std = 0, x' = x0_hat, log-prob 0 with zero gradient (MixGRPO's own
    log-prob there divides by 0). sigma = 1: lambda = -inf, q = 0, mu = alpha' x0_hat, std = sigma'."""
    sigmas = schedule()
    last = sigmas.numel() - 2
    x, v, x0_prev, _ = latents()
    v = v.clone().requires_grad_(True)
    out = sde_step(x, v.detach(), sigmas, last, mode="dpm_sde", noise_level=1.0, backend=backend,
                   prev_x0_pred=x0_prev, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.std_dev, torch.zeros(3))
    assert torch.equal(out.log_prob, torch.zeros(3))
    torch.testing.assert_close(out.prev_sample, x - sigmas[last] * v.detach(), rtol=0, atol=2e-7)
    lp = step_log_prob(x, v, out.prev_sample, sigmas, last, mode="dpm_sde", noise_level=1.0, backend=backend,
                       prev_x0_pred=x0_prev)
    lp.sum().backward()
    assert torch.equal(v.grad, torch.zeros_like(v))
    first = sde_step(x, v.detach(), sigmas, 0, mode="dpm_sde", noise_level=1.0, backend=backend,
                     noise=torch.zeros_like(x))
    assert float(sigmas[0]) == 1.0
    torch.testing.assert_close(first.std_dev, sigmas[1].expand(3))
    torch.testing.assert_close(first.prev_sample_mean, (1 - sigmas[1]) * (x - v.detach()), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(first.log_prob).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_with_per_sample_steps(backend):
    """A sample's x' and log-prob do not depend on its batch, with each sample at its own step (step 0
    rows take no second-order term whatever prev_x0_pred holds)."""
    sigmas = schedule()
    x, v, x0_prev, eps = latents(shape=(4, 3, 500))
    steps = torch.tensor([0, 2, 3, 5])
    out = sde_step(x, v, sigmas, steps, mode="dpm_sde", noise_level=1.0, backend=backend, prev_x0_pred=x0_prev,
                   noise=eps)
    for b in range(4):
        one = sde_step(x[b:b + 1], v[b:b + 1], sigmas, int(steps[b]), mode="dpm_sde", noise_level=1.0,
                       backend=backend, prev_x0_pred=x0_prev[b:b + 1], noise=eps[b:b + 1])
        assert torch.equal(out.prev_sample[b:b + 1], one.prev_sample)
        assert torch.equal(out.log_prob[b:b + 1], one.log_prob)
    first = sde_step(x[:1], v[:1], sigmas, 0, mode="dpm_sde", noise_level=1.0, backend=backend, noise=eps[:1])
    assert torch.equal(out.prev_sample[:1], first.prev_sample)


def _oracle_log_prob(x, v, prev_sample, x0_prev, sigmas, i):
    """MixGRPO's gaussian log-prob (dpm_step), mean over elements, in float64, with autograd."""
    s64 = sigmas.to(F64)
    x0 = x - s64[i] * v
    mean, std = mixgrpo_step(2, [x0_prev, x0], s64, i, x)
    lp = -((prev_sample - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(torch.tensor(2 * math.pi, dtype=F64)))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_the_float64_oracle_including_prev_x0_pred(backend):
    sigmas = schedule()
    i = 3
    x, v, x0_prev, x_next = latents(shape=(2, 3, 400))
    leaves = [t.clone().requires_grad_(True) for t in (x, v, x0_prev)]
    lp = step_log_prob(leaves[0], leaves[1], x_next, sigmas, i, mode="dpm_sde", noise_level=1.0, backend=backend,
                       prev_x0_pred=leaves[2])
    weights = torch.tensor([0.7, -1.3])
    (lp * weights).sum().backward()
    leaves64 = [t.double().requires_grad_(True) for t in (x, v, x0_prev)]
    want = _oracle_log_prob(leaves64[0], leaves64[1], x_next.double(), leaves64[2], sigmas, i)
    torch.testing.assert_close(lp.double(), want.detach(), rtol=1e-5, atol=1e-5)
    (want * weights.double()).sum().backward()
    for got, exact, name in zip(leaves, leaves64, ("sample", "model_output", "prev_x0_pred")):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad.double(), exact.grad, rtol=1e-4, atol=1e-8, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_mean_gradient_reaches_prev_x0_pred(backend):
    """x' = mu + std eps is differentiable in prev_x0_pred through mu: d x'/d x0_prev = p = -B2."""
    sigmas = schedule()
    x, v, x0_prev, eps = latents(shape=(2, 300))
    prev = x0_prev.clone().requires_grad_(True)
    out = sde_step(x, v, sigmas, 2, mode="dpm_sde", noise_level=1.0, backend=backend, prev_x0_pred=prev, noise=eps)
    out.prev_sample.sum().backward()
    prev64 = x0_prev.double().requires_grad_(True)
    s64 = sigmas.to(F64)
    mean, _ = mixgrpo_second_order([prev64, x.double() - s64[2] * v.double()], s64, 2, x.double())
    mean.sum().backward()
    torch.testing.assert_close(prev.grad.double(), prev64.grad, rtol=1e-5, atol=1e-7)
    assert prev.grad.abs().min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_uses_the_second_order_coefficients(backend):
    """Two policies at one step share x and x0_prev: mu - mu_ref = c (v - v_ref) with the second-order
    c = -(B + B2) sigma, so the KL is (B + B2)^2 sigma^2 |v - v_ref|^2 / (2 std^2)."""
    sigmas = schedule()
    i = 2
    x, v, v_ref, x0_prev = latents(shape=(2, 1000))
    kl = step_kl(x, v, v_ref, sigmas, i, mode="dpm_sde", noise_level=1.0, backend=backend, prev_x0_pred=x0_prev)
    zeros = torch.zeros_like(x)
    mu = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", prev_x0_pred=x0_prev, noise=zeros)
    mu_ref = sde_step(x, v_ref, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", prev_x0_pred=x0_prev,
                      noise=zeros)
    want = ((mu.prev_sample_mean - mu_ref.prev_sample_mean) ** 2).mean(dim=1) / (2 * mu.std_dev**2)
    torch.testing.assert_close(kl, want, rtol=1e-4, atol=1e-6)


def test_bad_arguments_are_refused_by_name():
    sigmas = schedule()
    x, v, x0_prev, _ = latents()
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(x, v, sigmas, 1, mode="dpm_sde", noise_level=0.7)
    with pytest.raises(ValueError, match="prev_x0_pred"):
        sde_step(x, v, sigmas, 1, mode="sde", prev_x0_pred=x0_prev)
    with pytest.raises(ValueError, match="prev_x0_pred"):
        step_log_prob(x, v, x, sigmas, 1, mode="dpm_sde", noise_level=1.0, prev_x0_pred=x0_prev[:1])
    with pytest.raises(TypeError, match="prev_x0_pred"):
        sde_step(x, v, sigmas, 1, mode="dpm_sde", noise_level=1.0, prev_x0_pred=x0_prev.long())


# Gaussian data x0 ~ N(M, S^2) per coordinate: x_sigma = (1 - sigma) x0 + sigma eps is Gaussian, and
# the exact velocity E[eps - x0 | x_sigma] is linear in x_sigma (flowrl/oracle, gaussian_velocity).
M, S = 1.5, 0.5


def exact_velocity(x, sigma):
    a = 1 - sigma
    var = a * a * S * S + sigma * sigma
    x0_mean = M + a * S * S * (x - a * M) / var
    eps_mean = sigma * (x - a * M) / var
    return eps_mean - x0_mean


@pytest.mark.parametrize("order,steps,std_tol", [(1, 300, 0.015), (2, 100, 0.006)])
def test_sampler_reproduces_a_gaussian_target(order, steps, std_tol):
    """Driven by the exact velocity from pure noise, dpm_sde steps on a linear schedule reproduce
    N(1.5, 0.5^2) (65536 coordinates: the mean's standard error is 0.002). Order 2 keeps each step's
    x0 prediction for the next, as MixGRPO's DPMState does. With posterior-mean x0 predictions each
    step loses a little variance, first order at O(step) (measured here: std 0.452 at 30 steps, 0.485
    at 100, 0.494 at 300), second order much less (0.516 at 30, 0.504 at 100, 0.5005 at 300): a
    property of the sampler, as cps' variance loss is."""
    sigmas = schedule(steps, shift=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4096, generator=g)
    x0_prev = None
    for i in range(steps):
        v = exact_velocity(x, float(sigmas[i]))
        out = sde_step(x, v, sigmas, i, mode="dpm_sde", noise_level=1.0, backend="torch", generator=g,
                       prev_x0_pred=x0_prev if order == 2 else None, return_prev_sample_mean=False)
        assert torch.isfinite(out.log_prob).all()
        x0_prev = x - sigmas[i] * v
        x = out.prev_sample
    assert abs(x.mean().item() - M) < 0.01, x.mean().item()
    assert abs(x.std().item() - S) < std_tol, x.std().item()


# ------------------------------------------------------------- the drop-in scheduler's rollout (replay)


def toy_velocity(x, t):
    """A deterministic stand-in for a model (tests/rollout/test_scheduler.py's)."""
    return (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)


def run_rollout(backend, order, dtype=torch.float32, steps=6, **options):
    import flowrl

    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    x = torch.randn(3, 4, 6, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    outputs = []
    with sched.rollout(mode="dpm_sde", noise_level=1.0, solver_order=order, backend=backend,
                       generator=torch.Generator().manual_seed(2), **options) as rec:
        for t in sched.timesteps:
            v = toy_velocity(x, t)
            outputs.append(v)
            x = sched.step(v, t, x, return_dict=False)[0]
    return rec.trajectory(), outputs


@pytest.mark.parametrize("backend,order,dtype", [
    ("torch", 1, torch.float32), ("torch", 2, torch.float32), ("torch", 1, torch.bfloat16),
    ("torch", 2, torch.bfloat16), ("triton", 2, torch.float32), ("triton", 2, torch.bfloat16)])
def test_scheduler_rollout_keeps_the_previous_prediction_and_replays_bitwise(backend, order, dtype):
    traj, outputs = run_rollout(backend, order, dtype)
    assert traj.mode == "dpm_sde" and traj.noise_level == 1.0
    assert (traj.log_probs[:, :-1] != 0).all() and (traj.log_probs[:, -1] == 0).all()  # sigma' = 0: deterministic
    if order == 1:
        assert traj.prev_x0_preds is None
    else:
        assert traj.prev_x0_preds.shape == (3, 6, 4, 6, 6) and traj.prev_x0_preds.dtype == torch.float32
        assert torch.equal(traj.prev_x0_preds[:, 0], torch.zeros(3, 4, 6, 6))
        for i in range(1, 6):  # the previous step's x - sigma v, as diffusers' DPM solvers keep it
            want = traj.latents[:, i - 1].float() - traj.sigmas[i - 1] * outputs[i - 1].float()
            assert torch.equal(traj.prev_x0_preds[:, i], want), i
    for i, v in enumerate(outputs):
        prev = None if traj.prev_x0_preds is None else traj.prev_x0_preds[:, i]
        lp = step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i, mode=traj.mode,
                           noise_level=traj.noise_level, backend=backend, prev_x0_pred=prev)
        assert torch.equal(lp, traj.log_probs[:, i]), i  # the recompute scores the rollout's transition
        if order == 2 and 1 < i < 5:  # a first-order recompute would not (step 1 follows sigma = 1: first order)
            first = step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i, mode=traj.mode,
                                  noise_level=traj.noise_level, backend=backend)
            assert not torch.equal(first, traj.log_probs[:, i])


def test_trajectory_prev_x0_preds_survive_split_wire_and_file(tmp_path):
    import flowrl

    traj, _ = run_rollout("torch", 2)
    parts = traj.split()
    assert torch.equal(parts[1].prev_x0_preds, traj.prev_x0_preds[1:2])
    back = flowrl.RolloutTrajectory.from_wire(traj.to_wire())
    assert torch.equal(back.prev_x0_preds, traj.prev_x0_preds)
    traj.save(tmp_path / "t.safetensors")
    assert torch.equal(flowrl.RolloutTrajectory.load(tmp_path / "t.safetensors").prev_x0_preds, traj.prev_x0_preds)
    first, _ = run_rollout("torch", 1)
    assert first.to_wire()["prev_x0_preds"] is None  # first order: the format's optional key is null
    wire = traj.to_wire()
    wire["mode"], wire["noise_level"] = "sde", 0.7
    with pytest.raises(ValueError, match="prev_x0_preds"):
        flowrl.RolloutTrajectory.from_wire(wire)


def test_solver_order_is_dpm_sde_only_and_one_or_two():
    import flowrl

    sched = flowrl.FlowMatchEulerDiscreteScheduler()
    with pytest.raises(ValueError, match="solver_order"):
        sched.rollout(mode="sde", solver_order=2)
    with pytest.raises(ValueError, match="solver_order"):
        sched.rollout(mode="dpm_sde", noise_level=1.0, solver_order=3)
    with pytest.raises(ValueError, match="noise_level"):
        sched.rollout(mode="dpm_sde")


# ------------------------------------------------------------------ the domain: never NaN, replay exact

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def test_adjacent_sigmas_within_rounding_fall_back_to_first_order():
    """Where h_prev rounds to 0 (q_prev == 1 in float32: here sigma_prev and sigma are one ulp apart and
    the two products of q_prev round alike), D1's h / h_prev would be inf: the step is first order
    there, on both backends, and finite. (Sigmas an ulp apart whose q_prev stays below 1 give a huge
    but finite h / h_prev: the midpoint formula's own value.)"""
    sigma_prev = 0.01735367625951767
    sigma = float(torch.nextafter(torch.tensor(sigma_prev), torch.tensor(0.0)))
    assert float(((1 - torch.tensor(sigma_prev)) * sigma) / (sigma_prev * (1 - torch.tensor(sigma)))) == 1.0
    sigmas = torch.tensor([1.0, 0.5, sigma_prev, sigma, 0.0])
    x, v, x0_prev, eps = latents(shape=(2, 300))
    for backend in BACKENDS:
        second = sde_step(x, v, sigmas, 3, mode="dpm_sde", noise_level=1.0, prev_x0_pred=x0_prev, noise=eps,
                          backend=backend)
        first = sde_step(x, v, sigmas, 3, mode="dpm_sde", noise_level=1.0, noise=eps, backend=backend)
        assert torch.isfinite(second.prev_sample).all() and torch.isfinite(second.log_prob).all()
        assert torch.equal(second.prev_sample, first.prev_sample)


def _schedules():
    import test_properties as props  # the NaN search's schedule families (tests/ops/test_properties.py)

    return props.schedule_params().map(lambda f: props.build_schedule(*f)).filter(props.valid_schedule)


@st.composite
def _cases(draw):
    sigmas = draw(_schedules())
    t = sigmas.numel() - 1
    batch = draw(st.integers(1, 3))
    steps = torch.tensor(draw(st.lists(st.integers(0, t - 1), min_size=batch, max_size=batch)))
    mode = draw(st.sampled_from(("dpm_sde", "flash_sde")))
    eta = 1.0 if mode == "dpm_sde" else draw(st.one_of(st.just(0.0), st.floats(1e-30, 1e-6), st.floats(0.0, 10.0)))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    numel = draw(st.sampled_from((1, 7, 1025)))
    scale = draw(st.floats(0.0, 10.0))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x, v, x0_prev, eps = ((torch.randn(batch, numel, generator=g) * scale).to(dtype) for _ in range(4))
    second = mode == "dpm_sde" and draw(st.booleans())
    return sigmas, steps, mode, eta, x, v, (x0_prev if second else None), eps.float()


def _check_case(case, backend):
    sigmas, steps, mode, eta, x, v, x0_prev, eps = case
    out = sde_step(x, v, sigmas, steps, mode=mode, noise_level=eta, noise=eps, prev_x0_pred=x0_prev, backend=backend)
    for name, t in (("prev_sample", out.prev_sample), ("log_prob", out.log_prob), ("std", out.std_dev)):
        assert torch.isfinite(t).all(), name
    assert (out.std_dev >= 0).all()
    leaves = [t.clone().requires_grad_(True) for t in (x, v) + (() if x0_prev is None else (x0_prev,))]
    lp = step_log_prob(leaves[0], leaves[1], out.prev_sample, sigmas, steps, mode=mode, noise_level=eta,
                       prev_x0_pred=leaves[2] if len(leaves) > 2 else None, backend=backend)
    assert torch.equal(lp.detach(), out.log_prob)  # the rollout's log-prob, bit for bit
    lp.sum().backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_no_nan_anywhere_in_the_domain_torch(case):
    """Schedule families of tests/ops/test_properties.py (shifted, dynamic, beta, Karras, exponential, 1 to
    1,000 steps, sigmas[0] = 1 or just below), per-sample steps, both orders, flash_sde noise levels
    from 0 and tiny to 10, float32 and bf16: finite samples, log-probs and gradients, and the recompute
    equals the rollout."""
    _check_case(case, "torch")


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_no_nan_anywhere_in_the_domain_triton(case):
    _check_case(case, "triton")
