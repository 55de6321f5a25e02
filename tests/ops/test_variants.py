"""Flow SDE variants users already run, as modes of the same contract.

1. diffusers' ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``: its step
   ``x' = (1 - sigma') x0_hat + sigma' eps`` (diffusers 0.42 scheduling_flow_match_euler_discrete.py,
   ``step``) is ``cps`` at noise_level 1 (std = sigma' sin(pi/2) = sigma', sqrt(sigma'^2 - std^2) = 0).
   flowrl's drop-in scheduler accepts the flag and its rollout records it as cps, eta = 1.
2. ``flash_sde``: Flash-GRPO's std schedule ``std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma``,
   ``sigma_max = sigmas[1]``, ``sigma_min = sigmas[-1]`` with the Flow-SDE drift (Shredded-Pork/Flash-GRPO,
   flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py, ``sde_step_with_logprob``), times the
   noise level eta (their code is eta = 1), transcribed below in float64 as the peer oracle.
"""
from __future__ import annotations

import math

import pytest
import torch

try:  # flowrl's diffusers extra is optional: only the tests that use it skip without it
    import diffusers
except ImportError:
    diffusers = None

import flowrl
from flowrl import sde_step, step_kl, step_log_prob

F64 = torch.float64
needs_diffusers = pytest.mark.skipif(diffusers is None, reason="needs diffusers")
BACKENDS = ("torch", "triton")


def ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """max |a - b| in units of dtype's eps times max(|a|, |b|, 1): ulps of the larger value, or of 1
    below 1 (a sum of terms of size ~1 that cancels keeps their absolute rounding)."""
    a, b = a.double(), b.double()
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=1.0)
    return float(((a - b).abs() / (torch.finfo(dtype).eps * scale)).max())


# ------------------------------------------------------------------ diffusers' stochastic_sampling


@needs_diffusers
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_diffusers_stochastic_sampling_is_cps_at_noise_level_one(backend, dtype):
    """Same inputs, same noise: diffusers' stochastic step and cps(eta=1) are the same transition (the
    std is sigma' to the bit), and the samples differ by rounding only: flowrl's mean is a x + c v
    with c = -(1 - sigma') sigma rounded once, diffusers' (1 - sigma') (x - sigma v) with sigma v in
    the model output's dtype (a 0-d sigma does not promote a bf16 tensor). Measured: at most 2 float32
    ulps (of max(|x'|, 1)) in float32, bitwise at the last step (sigma' = 0, where both are x - sigma v);
    at most one such bf16 ulp of the emitted bf16 sample in bf16."""
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    sched.set_timesteps(8)
    x = torch.randn(3, 1500, generator=torch.Generator().manual_seed(0)).to(dtype)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
        theirs = sched.step(v, t, x, generator=torch.Generator().manual_seed(i)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(i))  # randn_tensor's draw
        ours = sde_step(x, v, sched.sigmas, i, mode="cps", noise_level=1.0, noise=noise, backend=backend)
        assert ours.prev_sample.dtype == theirs.dtype == dtype
        assert torch.equal(ours.std_dev, sched.sigmas[i + 1].expand(3))
        assert ulps_apart(ours.prev_sample, theirs, dtype) <= (2 if dtype == torch.float32 else 1), i
        if dtype == torch.float32 and i == len(sched.timesteps) - 1:
            assert torch.equal(ours.prev_sample, theirs)
        x = theirs


def _stochastic_loop(sched, x, record=None, backend="auto"):
    outputs, samples = [], []
    g = torch.Generator().manual_seed(7)
    for t in sched.timesteps:
        v = (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)
        outputs.append(v)
        x = sched.step(v, t, x, generator=g).prev_sample
        samples.append(x)
    return outputs, samples


@needs_diffusers
@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_in_scheduler_accepts_stochastic_sampling_and_records_it_as_cps(backend):
    """flowrl's scheduler with stochastic_sampling=True: its plain step is diffusers' bit for bit; its
    rollout(mode='cps', noise_level=1.0) records the same process (same noise draws from the step's
    generator, samples within 2 float32 ulps of diffusers') with log-probs that replay bitwise."""
    ours = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    for s in (ours, theirs):
        s.set_timesteps(6)
    _, plain_ours = _stochastic_loop(ours, x)
    outputs, plain_theirs = _stochastic_loop(theirs, x)
    assert all(torch.equal(a, b) for a, b in zip(plain_ours, plain_theirs))
    ours.set_timesteps(6)
    with ours.rollout(mode="cps", noise_level=1.0, backend=backend) as rec:
        rec_outputs, recorded = _stochastic_loop(ours, x)
    traj = rec.trajectory()
    # the recorded loop ran on its own samples: compare each step against diffusers from the same input
    for i, t in enumerate(theirs.timesteps):
        theirs._step_index = i
        g = torch.Generator().manual_seed(7)
        for _ in range(i):  # the loop's generator has made i draws before step i
            torch.randn(x.shape, generator=g)
        want = theirs.step(rec_outputs[i], t, traj.latents[:, i], generator=g).prev_sample
        assert ulps_apart(traj.latents[:, i + 1], want, torch.float32) <= 2, i
        lp = step_log_prob(traj.latents[:, i], rec_outputs[i], traj.latents[:, i + 1], traj.sigmas, i, mode="cps",
                           noise_level=1.0, backend=backend)
        assert torch.equal(lp, traj.log_probs[:, i]), i
    assert (traj.log_probs[:, -1] == 0).all()  # sigma' = 0: deterministic, as diffusers' sigma' * noise = 0


@needs_diffusers
def test_stochastic_sampling_rollout_must_say_it_is_cps_at_one():
    sched = flowrl.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    for options in ({}, {"mode": "cps", "noise_level": 0.5}, {"mode": "cps", "noise_level": 1.0, "sde_steps": [0]}):
        with pytest.raises(ValueError, match="stochastic_sampling=True.*cps at noise_level 1"):
            sched.rollout(**options)
    sched.rollout(mode="cps", noise_level=1.0)


# ----------------------------------------------------------------------------------- flash_sde


def flash_grpo_step(x, v, sigmas, i, eta=1.0, prev_sample=None):
    """Flash-GRPO's sde_step_with_logprob in float64 (their std_dev_t times eta): (prev_sample_mean,
    std = std_dev_t * sqrt(-dt), log_prob of prev_sample, mean over elements)."""
    sigma, sigma_prev = sigmas[i], sigmas[i + 1]
    sigma_max, sigma_min = sigmas[1].item(), sigmas[-1].item()
    dt = sigma_prev - sigma
    std_dev_t = eta * (sigma_min + (sigma_max - sigma_min) * sigma)
    prev_sample_mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * torch.sqrt(-1 * dt)
    if prev_sample is None:
        return prev_sample_mean, std, None
    log_prob = (-((prev_sample - prev_sample_mean) ** 2) / (2 * (std**2)) - torch.log(std)
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=F64))))
    return prev_sample_mean, std, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def wan_schedule(steps=8, shift=5.0):
    """A shifted schedule ending at the terminal 0 (sigma_min = sigmas[-1] = 0, as Flash-GRPO reads it)."""
    t = torch.linspace(1, 0, steps + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def latents(shape=(3, 5, 7), seed=0, dtype=torch.float32, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("eta", [1.0, 0.6])
def test_flash_sde_matches_flash_grpo_in_float64(eta):
    sigmas = wan_schedule()
    s64 = sigmas.to(F64)
    x, v, eps = latents(dtype=F64)
    for i in range(sigmas.numel() - 1):
        mean, std, _ = flash_grpo_step(x, v, s64, i, eta)
        out = sde_step(x, v, sigmas, i, mode="flash_sde", noise_level=eta, noise=eps, backend="torch")
        torch.testing.assert_close(out.prev_sample_mean, mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.std_dev, std.expand(3), rtol=1e-12, atol=0)
        _, _, lp = flash_grpo_step(x, v, s64, i, eta, prev_sample=out.prev_sample)
        torch.testing.assert_close(out.log_prob, lp, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_sde_kernel_error_within_twice_torch(backend, dtype):
    sigmas = wan_schedule()
    x, v, _ = latents(shape=(2, 1300), dtype=dtype)
    for i in range(sigmas.numel() - 1):
        zeros = torch.zeros(x.shape)
        exact = sde_step(x.double(), v.double(), sigmas, i, mode="flash_sde", noise_level=0.8, noise=zeros.double(),
                         backend="torch")
        ref = sde_step(x, v, sigmas, i, mode="flash_sde", noise_level=0.8, noise=zeros, backend="torch")
        got = sde_step(x, v, sigmas, i, mode="flash_sde", noise_level=0.8, noise=zeros, backend=backend)
        err_ref = (ref.prev_sample_mean.double() - exact.prev_sample_mean).abs().max().item()
        err = (got.prev_sample_mean.double() - exact.prev_sample_mean).abs().max().item()
        assert err <= 2 * err_ref + 1e-6, (i, err, err_ref)
        torch.testing.assert_close(got.std_dev.double(), exact.std_dev, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_sde_rollout_equals_recompute_bitwise(backend, dtype):
    sigmas = wan_schedule()
    x, v, _ = latents(shape=(3, 2, 600), dtype=dtype)
    g = torch.Generator().manual_seed(4)
    for i in range(sigmas.numel() - 1) if backend == "torch" else (0, 3, sigmas.numel() - 2):  # interpreter: 3
        out = sde_step(x, v, sigmas, i, mode="flash_sde", noise_level=0.8, generator=g, backend=backend)
        lp = step_log_prob(x, v, out.prev_sample, sigmas, i, mode="flash_sde", noise_level=0.8, backend=backend)
        assert torch.equal(out.log_prob, lp), i
        r = out.prev_sample.float() - out.prev_sample_mean  # the rounding rule: the emitted sample's log-prob
        std = out.std_dev.reshape(-1, 1, 1)
        want = (-(r * r) / (2 * std * std) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
        torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_sde_deterministic_at_noise_level_zero_and_batch_invariant(backend):
    sigmas = wan_schedule()
    x, v, eps = latents(shape=(4, 3, 500))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    out = sde_step(x, v, sigmas, 2, mode="flash_sde", noise_level=0.0, generator=g, backend=backend)
    assert torch.equal(g.get_state(), state)  # a step deterministic by its arguments draws no noise
    assert torch.equal(out.log_prob, torch.zeros(4)) and torch.equal(out.std_dev, torch.zeros(4))
    ode = sde_step(x, v, sigmas, 2, mode="ode", noise_level=0.0, backend=backend)
    torch.testing.assert_close(out.prev_sample, ode.prev_sample, rtol=0, atol=1e-6)
    steps = torch.tensor([0, 3, 5, 7])
    batch = sde_step(x, v, sigmas, steps, mode="flash_sde", noise_level=0.8, noise=eps, backend=backend)
    for b in range(4):
        one = sde_step(x[b:b + 1], v[b:b + 1], sigmas, int(steps[b]), mode="flash_sde", noise_level=0.8,
                       noise=eps[b:b + 1], backend=backend)
        assert torch.equal(batch.prev_sample[b:b + 1], one.prev_sample)
        assert torch.equal(batch.log_prob[b:b + 1], one.log_prob)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_sde_gradients_match_the_float64_oracle(backend):
    sigmas = wan_schedule()
    i = 3
    x, v, x_next = latents(shape=(2, 3, 400))
    leaves = [t.clone().requires_grad_(True) for t in (x, v)]
    lp = step_log_prob(leaves[0], leaves[1], x_next, sigmas, i, mode="flash_sde", noise_level=0.8, backend=backend)
    weights = torch.tensor([0.7, -1.3])
    (lp * weights).sum().backward()
    leaves64 = [t.double().requires_grad_(True) for t in (x, v)]
    _, _, want = flash_grpo_step(leaves64[0], leaves64[1], sigmas.to(F64), i, 0.8, prev_sample=x_next.double())
    torch.testing.assert_close(lp.double(), want.detach(), rtol=1e-5, atol=1e-5)
    (want * weights.double()).sum().backward()
    for got, exact, name in zip(leaves, leaves64, ("sample", "model_output")):
        torch.testing.assert_close(got.grad.double(), exact.grad, rtol=1e-4, atol=1e-8, msg=name)
    kl = step_kl(x, v, x_next, sigmas, i, mode="flash_sde", noise_level=0.8, backend=backend)
    m1, std, _ = flash_grpo_step(x.double(), v.double(), sigmas.to(F64), i, 0.8)
    m2, _, _ = flash_grpo_step(x.double(), x_next.double(), sigmas.to(F64), i, 0.8)
    torch.testing.assert_close(kl.double(), ((m1 - m2) ** 2).mean(dim=(1, 2)) / (2 * std**2), rtol=1e-4, atol=1e-7)


def test_flash_sde_sampler_reproduces_a_gaussian_target():
    """Driven by the exact velocity of N(1.5, 0.5^2) data, 200 flash_sde steps from pure noise
    reproduce it (the Flow-SDE drift keeps the marginals for any noise scale)."""
    m, s = 1.5, 0.5
    steps = 200
    sigmas = torch.linspace(1, 0, steps + 1, dtype=F64).float()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4096, generator=g)
    for i in range(steps):
        sigma = float(sigmas[i])
        a = 1 - sigma
        var = a * a * s * s + sigma * sigma
        v = sigma * (x - a * m) / var - (m + a * s * s * (x - a * m) / var)
        x = sde_step(x, v, sigmas, i, mode="flash_sde", noise_level=0.8, generator=g, backend="torch",
                     return_prev_sample_mean=False).prev_sample
    assert abs(x.mean().item() - m) < 0.01, x.mean().item()
    assert abs(x.std().item() - s) < 0.01, x.std().item()


@needs_diffusers
def test_flash_sde_scheduler_rollout_replays_bitwise():
    """The drop-in scheduler records flash_sde like any mode; the recompute gives the recorded bits."""
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(5)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outputs = []
    with sched.rollout(mode="flash_sde", noise_level=0.8, generator=torch.Generator().manual_seed(1)) as rec:
        for t in sched.timesteps:
            v = (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)
            outputs.append(v)
            x = sched.step(v, t, x, return_dict=False)[0]
    traj = rec.trajectory()
    assert traj.mode == "flash_sde" and (traj.log_probs != 0).all()
    for i, v in enumerate(outputs):
        lp = step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i, mode=traj.mode,
                           noise_level=traj.noise_level)
        assert torch.equal(lp, traj.log_probs[:, i]), i
