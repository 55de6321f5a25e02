"""mode="ddim" (DDPO; DanceGRPO's Stable Diffusion path): both backends against an independent float64
oracle written from the issue's formulas, the rounding and deterministic-step rules, rollout ==
recompute bit for bit, batch invariance, gradients (exact through x0's clip), a distribution test on
Gaussian data, and argument checks. The Triton backend runs under the interpreter on CPU."""
import math

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch

F64 = torch.float64
PREDICTIONS = ("epsilon", "sample", "v_prediction")
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not _dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
BACKENDS = ("torch", "triton")


def alpha_bar_table(num_steps=6, final=1.0, device="cpu", zero_snr=False):
    """(a_t, a_prev) pairs of a scaled-linear SD schedule at 'leading' timesteps, final value appended,
    as diffusers' DDIMScheduler reads them (flattened [2T])."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float32) ** 2
    ac = torch.cumprod(1.0 - betas, dim=0)
    if zero_snr:
        ac[-1] = 0.0
    ratio = 1000 // num_steps
    ts = [999 if zero_snr and k == 0 else (num_steps - 1 - k) * ratio + 1 for k in range(num_steps)]
    pairs = []
    for t in ts:
        prev = t - ratio if not (zero_snr and t == 999) else 999 - ratio
        pairs += [ac[t], ac[prev] if prev >= 0 else torch.tensor(final)]
    return torch.stack(pairs).to(torch.float32).to(device)


def oracle_mean_std(x, v, table, idx, eta, prediction, clip):
    """float64 mu and std per the issue: std = eta sqrt((1 - a') / (1 - a) (1 - a / a')), mu = sqrt(a')
    clip(x0) + sqrt(1 - a' - std^2) eps, written from the formulas (not from flowrl.backends.reference)."""
    x, v = x.to(F64), v.to(F64)
    mus, stds = [], []
    for b in range(x.shape[0]):
        i = int(idx[b])
        a, ap = float(table[2 * i]), float(table[2 * i + 1])
        std = eta * math.sqrt((1 - ap) / (1 - a) * (1 - a / ap))
        if prediction == "epsilon":
            x0, eps = (x[b] - math.sqrt(1 - a) * v[b]) / math.sqrt(a), v[b]
        elif prediction == "sample":
            x0, eps = v[b], (x[b] - math.sqrt(a) * v[b]) / math.sqrt(1 - a)
        else:
            x0, eps = math.sqrt(a) * x[b] - math.sqrt(1 - a) * v[b], math.sqrt(a) * v[b] + math.sqrt(1 - a) * x[b]
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        mus.append(math.sqrt(ap) * x0 + math.sqrt(max(1 - ap - std * std, 0.0)) * eps)
        stds.append(std)
    return torch.stack(mus), stds


def oracle_log_prob(x, v, prev, table, idx, eta, prediction, clip):
    mu, stds = oracle_mean_std(x, v, table, idx, eta, prediction, clip)
    out = []
    for b, sd in enumerate(stds):
        r = prev[b].to(F64) - mu[b]
        if sd == 0:
            out.append((r * 0).sum())
            continue
        out.append((-r * r / (2 * sd * sd) - math.log(sd) - 0.5 * math.log(2 * math.pi)).mean())
    return torch.stack(out)


def inputs(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (1.5 * torch.randn(shape, generator=g)).to(dtype).to(device)
    v = torch.randn(shape, generator=g).to(dtype).to(device)
    noise = torch.randn(shape, generator=g).to(device)
    v_ref = (v.float().cpu() + 0.2 * torch.randn(shape, generator=g)).to(dtype).to(device)
    return x, v, noise, v_ref


def opts(prediction, clip, eta=0.8):
    return dict(mode="ddim", noise_level=eta, prediction_type=prediction, clip_sample_range=clip)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", (None, 1.0))
@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_both_backends_against_the_float64_oracle(device, prediction, clip):
    table = alpha_bar_table(device=device)
    x, v, noise, v_ref = inputs((3, 2, 37, 29), torch.float32, device=device)  # 2146 elements: 3 chunks, odd tail
    idx = torch.tensor([0, 3, 5], device=device)
    kw = opts(prediction, clip)
    mu64, stds = oracle_mean_std(x, v, table, idx, 0.8, prediction, clip)
    results = {}
    for backend in BACKENDS:
        out = flowrl.sde_step(x, v, table, idx, noise=noise, backend=backend, **kw)
        torch.testing.assert_close(out.prev_sample_mean.double(), mu64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.std_dev.double(), torch.tensor(stds, dtype=F64), rtol=1e-6, atol=0)
        # the rounding rule: the log-prob is the emitted sample's, recomputed from it bit for bit
        oracle = oracle_log_prob(x, v, out.prev_sample, table, idx, 0.8, prediction, clip)
        torch.testing.assert_close(out.log_prob.double(), oracle, rtol=1e-5, atol=1e-5)
        again = flowrl.step_log_prob(x, v, out.prev_sample, table, idx, backend=backend, **kw)
        assert torch.equal(again, out.log_prob)
        kl = flowrl.step_kl(x, v, v_ref, table, idx, backend=backend, **kw)
        mu_ref64, _ = oracle_mean_std(x, v_ref, table, idx, 0.8, prediction, clip)
        kl64 = _kl(mu64, mu_ref64, stds)
        torch.testing.assert_close(kl.double(), kl64, rtol=1e-4, atol=1e-7)
        results[backend] = out
    # the kernel's sample is the reference's up to float32 rounding: the same float32 operations in the same
    # order, but torch's CPU float32 sqrt is not always correctly rounded (sqrt_rn is): 1 ulp on a coefficient
    torch.testing.assert_close(results["triton"].prev_sample, results["torch"].prev_sample, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(results["triton"].log_prob, results["torch"].log_prob, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_half_precision_rounding_rule_and_recompute(device, dtype):
    table = alpha_bar_table(device=device)
    x, v, noise, _ = inputs((2, 1100), dtype, seed=1, device=device)
    kw = opts("epsilon", 1.0, eta=1.0)
    for backend in BACKENDS:
        out = flowrl.sde_step(x, v, table, 2, noise=noise, backend=backend, **kw)
        assert out.prev_sample.dtype == dtype
        assert torch.equal(flowrl.step_log_prob(x, v, out.prev_sample, table, 2, backend=backend, **kw), out.log_prob)
        oracle = oracle_log_prob(x, v, out.prev_sample, table, torch.tensor([2, 2]), 1.0, "epsilon", 1.0)
        torch.testing.assert_close(out.log_prob.double(), oracle, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_steps(backend):
    """eta = 0 (and a step whose std is 0: a_prev = 1 with set_alpha_to_one) gives x' = mu, log-prob 0,
    zero gradient, and draws no noise."""
    table = alpha_bar_table()
    x, v, _, _ = inputs((2, 300), torch.float32, seed=2)
    v = v.clone().requires_grad_()
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    out = flowrl.sde_step(x, v, table, 1, generator=gen, backend=backend, **opts("v_prediction", None, eta=0.0))
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(out.prev_sample, out.prev_sample_mean)
    assert torch.equal(out.log_prob, torch.zeros(2))
    lp = flowrl.step_log_prob(x, v, out.prev_sample.detach(), table, 5, backend=backend, **opts("epsilon", 1.0, eta=1.0))
    assert float(table[11]) == 1.0 and torch.equal(lp, torch.zeros(2))  # last step: a_prev = 1, std = 0
    lp.sum().backward()
    assert torch.equal(v.grad, torch.zeros_like(v))
    # a_prev = a_t (the last step with set_alpha_to_one=False, steps_offset=0): variance exactly 0
    same = torch.tensor([0.3, 0.6, 0.9, 0.9])
    out = flowrl.sde_step(x, v.detach(), same, 1, noise=torch.randn_like(x), backend=backend, **opts("sample", 1.0, eta=1.0))
    assert torch.equal(out.std_dev, torch.zeros(2)) and torch.equal(out.log_prob, torch.zeros(2))
    assert torch.equal(out.prev_sample, out.prev_sample_mean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_and_rollout_equals_recompute(backend):
    table = alpha_bar_table()
    x, v, _, _ = inputs((4, 1500), torch.bfloat16, seed=3)
    idx = torch.tensor([0, 2, 4, 5])
    kw = opts("epsilon", 1.0, eta=1.0)
    whole = flowrl.sde_step(x, v, table, idx, noise_seed=torch.arange(4) + 7, backend=backend, **kw)
    for b in range(4):
        one = flowrl.sde_step(x[b:b + 1], v[b:b + 1], table, idx[b:b + 1], noise_seed=torch.tensor([7 + b]),
                              backend=backend, **kw)
        assert torch.equal(one.prev_sample, whole.prev_sample[b:b + 1])
        assert torch.equal(one.log_prob, whole.log_prob[b:b + 1])
    assert torch.equal(flowrl.step_log_prob(x, v, whole.prev_sample, table, idx, backend=backend, **kw), whole.log_prob)


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_gradients_exact_through_the_clip(prediction):
    """d log-prob and d KL / d (x, v, x', v_ref) of both backends against float64 autograd of the oracle;
    elements whose x0 is clipped get no gradient from the x0 term."""
    table = alpha_bar_table()
    x, v, noise, v_ref = inputs((2, 1030), torch.float32, seed=4)
    idx = torch.tensor([1, 3])
    kw = opts(prediction, 1.0)
    prev = flowrl.sde_step(x, v, table, idx, noise=noise, backend="torch", **kw).prev_sample

    def grads(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        fn(*leaves).sum().backward()
        return [t.grad for t in leaves]

    expect = grads(lambda a, b, c, d: oracle_log_prob(a, b, c, table, idx, 0.8, prediction, 1.0)
                   + _oracle_kl(a, b, d, table, idx, prediction), (x.double(), v.double(), prev.double(), v_ref.double()))
    for backend in BACKENDS:
        got = grads(lambda a, b, c, d: flowrl.step_log_prob(a, b, c, table, idx, backend=backend, **kw)
                    + flowrl.step_kl(a, b, d, table, idx, backend=backend, **kw), (x, v, prev, v_ref))
        for g, e in zip(got, expect):
            torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-9)
    # the clip is active on some elements, and there only eps's term moves mu
    a = float(table[2])
    x0 = {"epsilon": (x[0] - math.sqrt(1 - a) * v[0]) / math.sqrt(a), "sample": v[0],
          "v_prediction": math.sqrt(a) * x[0] - math.sqrt(1 - a) * v[0]}[prediction]
    assert 0 < int((x0.abs() > 1).sum()) < x0.numel()


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_unclipped_kl_is_linear_in_v(prediction):
    """Without the clip ddim's KL residual is c v - c v_ref (docs/contract.md, ddim): it reads no x (the
    same bits for any x, no x gradient) and is the float64 means' difference up to rounding, with the
    float64 oracle's gradients for v and v_ref; the clipped KL does read x, but for "sample"."""
    table = alpha_bar_table()
    x, v, _, v_ref = inputs((2, 1030), torch.float32, seed=6)
    other_x = inputs((2, 1030), torch.float32, seed=7)[0]
    idx = torch.tensor([1, 3])
    kw = opts(prediction, None)
    mu, stds = oracle_mean_std(x.double(), v.double(), table, idx, 0.8, prediction, None)
    mu_ref, _ = oracle_mean_std(x.double(), v_ref.double(), table, idx, 0.8, prediction, None)
    for backend in BACKENDS:
        leaves = [t.detach().clone().requires_grad_() for t in (x, v, v_ref)]
        kl = flowrl.step_kl(*leaves, table, idx, backend=backend, **kw)
        torch.testing.assert_close(kl.double(), _kl(mu, mu_ref, stds), rtol=1e-5, atol=1e-9)
        assert torch.equal(flowrl.step_kl(other_x, v, v_ref, table, idx, backend=backend, **kw), kl.detach())
        kl.sum().backward()
        assert leaves[0].grad is None
        expect = [t.detach().clone().double().requires_grad_() for t in (v, v_ref)]
        m = oracle_mean_std(x.double(), expect[0], table, idx, 0.8, prediction, None)[0]
        m_ref = oracle_mean_std(x.double(), expect[1], table, idx, 0.8, prediction, None)[0]
        _kl(m, m_ref, stds).sum().backward()
        for leaf, e in zip(leaves[1:], expect):
            torch.testing.assert_close(leaf.grad.double(), e.grad, rtol=1e-4, atol=1e-9)
        # the clipped KL reads x through x0_hat, but for "sample" (x0_hat = v)
        clipped = dict(kw, clip_sample_range=1.0)
        same = torch.equal(flowrl.step_kl(other_x, v, v_ref, table, idx, backend=backend, **clipped),
                           flowrl.step_kl(x, v, v_ref, table, idx, backend=backend, **clipped))
        assert same == (prediction == "sample")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_clipped_kl_residual(prediction, dtype):
    """The clipped KL's residual (docs/contract.md, ddim), written here from the contract's float32
    operations: fma(sqrt(a'), clip(x0_hat) - clip(x0_hat_ref), e (v - v_ref)). Both backends give its
    bits; at v_ref = v it is 0 with zero gradients."""
    from flowrl.backends.reference import ddim_coefficients, fma_f32

    table = alpha_bar_table()
    x, v, _, v_ref = inputs((3, 2 * 1024), dtype, seed=8)
    idx = torch.tensor([1, 3, 4])
    kw = opts(prediction, 1.0)
    sa, sb, sap, k, std = (c.reshape(-1, 1) for c in ddim_coefficients(table, idx, 0.8, torch.float32))
    e = {"epsilon": k, "sample": -((k / sb) * sa), "v_prediction": k * sa}[prediction]

    def clipped_x0(out):
        out = out.float()
        x0 = {"epsilon": lambda: fma_f32(-sb, out, x.float()) * (1 / sa), "sample": lambda: out,
              "v_prediction": lambda: fma_f32(-sb, out, sa * x.float())}[prediction]()
        return x0.clamp(-1.0, 1.0)

    r = fma_f32(sap, clipped_x0(v) - clipped_x0(v_ref), e * (v.float() - v_ref.float()))
    assert 0 < int((clipped_x0(v).abs() == 1).sum()) < r.numel()  # the clip is active on some elements
    # mean reduction: the chunk tree of r^2, then / (2 std^2 n) (a float64 sum of the float32 squares here)
    expect = (r.double() ** 2).sum(1) / (2 * std.double().squeeze(1) ** 2 * r.shape[1])
    kls = {}
    for backend in BACKENDS:
        kls[backend] = flowrl.step_kl(x, v, v_ref, table, idx, backend=backend, **kw)
        torch.testing.assert_close(kls[backend].double(), expect, rtol=2e-6, atol=0)
        vg = v.clone().requires_grad_()
        same = flowrl.step_kl(x, vg, v, table, idx, backend=backend, **kw)
        assert torch.equal(same, torch.zeros(3))
        same.sum().backward()
        assert torch.equal(vg.grad, torch.zeros_like(v))
    assert torch.equal(kls["torch"], kls["triton"])


def _oracle_kl(x, v, v_ref, table, idx, prediction):
    mu, stds = oracle_mean_std(x, v, table, idx, 0.8, prediction, 1.0)
    mu_ref, _ = oracle_mean_std(x, v_ref, table, idx, 0.8, prediction, 1.0)
    return _kl(mu, mu_ref, stds)


def _kl(mu, mu_ref, stds):
    """(mu - mu_ref)^2 / (2 std^2), mean per sample; 0 (with zero gradient) where std is 0."""
    return torch.stack([((mu[b] - mu_ref[b]) ** 2 / (2 * s * s)).mean() if s > 0 else (mu[b] * 0).sum()
                        for b, s in enumerate(stds)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_gradient_through_the_sample(backend):
    """x' = mu + std eps is differentiable in x and v through the (clipped) mean: same grads on both
    backends as the float64 oracle's."""
    table = alpha_bar_table()
    x, v, noise, _ = inputs((2, 64), torch.float32, seed=5)
    kw = opts("epsilon", 1.0)
    xs, vs = x.clone().requires_grad_(), v.clone().requires_grad_()
    flowrl.sde_step(xs, vs, table, 2, noise=noise, backend=backend, **kw).prev_sample.pow(2).sum().backward()
    x64, v64 = x.double().requires_grad_(), v.double().requires_grad_()
    mu, stds = oracle_mean_std(x64, v64, table, torch.tensor([2, 2]), 0.8, "epsilon", 1.0)
    (mu + stds[0] * noise.double()).pow(2).sum().backward()
    torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(vs.grad.double(), v64.grad, rtol=1e-4, atol=1e-6)


def _gaussian_ddim_moments(table, m, s):
    """Exact mean and std of DDIM's output when the data is N(m, s^2) per coordinate and the model is
    the exact epsilon E[eps | x_t] = sqrt(1 - a)(x_t - sqrt(a) m) / (a s^2 + 1 - a): every step is then
    affine in x plus Gaussian noise, x' = A x + B + std z, so the moments propagate in closed form."""
    a_T = float(table[0])
    mean, var = math.sqrt(a_T) * m, a_T * s * s + 1 - a_T  # the exact marginal at t_T
    for i in range(table.numel() // 2):
        a, ap = float(table[2 * i]), float(table[2 * i + 1])
        std = math.sqrt((1 - ap) / (1 - a) * (1 - a / ap))
        k, c = math.sqrt(max(1 - ap - std * std, 0.0)), math.sqrt(1 - a) / (a * s * s + 1 - a)
        slope = math.sqrt(ap) * (1 - math.sqrt(1 - a) * c) / math.sqrt(a) + k * c
        shift = (math.sqrt(ap) * math.sqrt(1 - a) * c / math.sqrt(a) - k * c) * math.sqrt(a) * m
        mean, var = slope * mean + shift, slope * slope * var + std * std
    return mean, math.sqrt(var)


@pytest.mark.parametrize("steps", (40, 1000))
def test_distribution_gaussian_data_eta_one(steps):
    """Gaussian data N(0.7, 0.4^2) with the exact epsilon model, sampled by mode='ddim' at eta = 1 from the
    exact marginal at t_T (1000-step scaled-linear schedule, set_alpha_to_one): the samples' moments are
    the closed-form ones (40 steps: std 0.345, DDIM's coarse-step variance loss), and with every
    timestep (1000 steps) they reach the data distribution."""
    m, s, n = 0.7, 0.4, 20000
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=F64) ** 2
    ac = torch.cumprod(1 - betas, 0)
    ratio = 1000 // steps
    ts = [(steps - 1 - k) * ratio + (1 if ratio > 1 else 0) for k in range(steps)]
    table = torch.tensor([v for t in ts for v in (float(ac[t]), float(ac[t - ratio]) if t - ratio >= 0 else 1.0)],
                         dtype=torch.float32)
    exact_mean, exact_std = _gaussian_ddim_moments(table, m, s)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, generator=gen, dtype=F64) * math.sqrt(1 - float(table[0]) * (1 - s * s)) + math.sqrt(float(table[0])) * m
    x = x.float()
    for i in range(steps):
        a = float(table[2 * i])
        eps = math.sqrt(1 - a) * (x.double() - math.sqrt(a) * m) / (a * s * s + 1 - a)
        x = flowrl.sde_step(x, eps.float(), table, i, generator=gen, mode="ddim", noise_level=1.0).prev_sample
    # standard errors at n = 20000: 0.003 on the mean, 0.002 on the std
    assert abs(x.mean().item() - exact_mean) < 0.01 and abs(x.std().item() - exact_std) < 0.008
    if steps == 1000:
        assert abs(x.mean().item() - m) < 0.01 and abs(x.std().item() - s) < 0.012
    else:
        assert abs(exact_std - 0.345) < 0.001


def test_argument_checks():
    table = alpha_bar_table()
    x, v, _, _ = inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match="noise_level must be in \\[0, 1\\] for mode='ddim'"):
        flowrl.sde_step(x, v, table, 0, mode="ddim", noise_level=1.5)
    with pytest.raises(ValueError, match="prediction_type must be one of"):
        flowrl.sde_step(x, v, table, 0, mode="ddim", noise_level=1.0, prediction_type="flow")
    with pytest.raises(ValueError, match="mode='ddim' options"):
        flowrl.sde_step(x, v, torch.tensor([1.0, 0.5, 0.0]), 0, mode="sde", prediction_type="epsilon")
    with pytest.raises(ValueError, match="clip_sample_range must be finite and > 0"):
        flowrl.sde_step(x, v, table, 0, mode="ddim", noise_level=1.0, clip_sample_range=0.0)
    with pytest.raises(ValueError, match="even length"):
        flowrl.sde_step(x, v, table[:-1], 0, mode="ddim", noise_level=1.0)
    with pytest.raises(ValueError, match="<= its alpha_bar_prev"):
        flowrl.sde_step(x, v, table.flip(0), 0, mode="ddim", noise_level=1.0)
    with pytest.raises(ValueError, match="step_index must be in \\[0, 5\\]"):
        flowrl.step_log_prob(x, v, x, table, 6, mode="ddim", noise_level=1.0)
    zero = alpha_bar_table(zero_snr=True)
    with pytest.raises(ValueError, match="zero terminal SNR"):
        flowrl.sde_step(x, v, zero, 0, mode="ddim", noise_level=1.0)
    # v-prediction at alpha_bar_t = 0 is finite (x0 = -v, eps = x)
    out = flowrl.sde_step(x, v, zero, 0, mode="ddim", noise_level=1.0, prediction_type="v_prediction",
                          noise=torch.zeros_like(x))
    assert bool(torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prediction,clip", [("epsilon", 1.0), ("epsilon", None), ("sample", 1.5), ("v_prediction", None)])
def test_triton_mean_is_diffusers_float32_operations_bit_for_bit(device, prediction, clip, monkeypatch):
    """The Triton kernels' ddim mean as a rollout writes it (4-tile programs, the divisions by sqrt(a) or
    sqrt(1 - a) through kernels.common.div_rn_by_scalar: a per-sample reciprocal and Markstein's
    correction) is diffusers' float32 operations in their order (reference.ddim_mean) bit for bit, given
    the same coefficients: correctly rounded square roots, the kernels' sqrt_rn (torch's CPU float32
    sqrt is not always correctly rounded: the one difference docs/contract.md states)."""
    from flowrl.backends import reference as R
    from flowrl.backends import _triton_ops

    tiles = []
    real_launch = _triton_ops._launch
    monkeypatch.setattr(_triton_ops, "_launch", lambda kernel, grid, *a, **kw: (tiles.append(kw.get("TILES")),
                                                                                 real_launch(kernel, grid, *a, **kw))[1])
    x, v, noise, _ = inputs((3, 8192), torch.bfloat16, 11, device)
    table, idx, eta = alpha_bar_table(device=device), torch.tensor([0, 2, 4], device=device), 0.8
    out = flowrl.sde_step(x, v, table, idx, noise=noise, backend="triton", **opts(prediction, clip, eta))
    assert tiles[0] == 4  # the rollout's partials (then its finalize)

    # the reference's coefficients with the kernels' correctly rounded square root (float64's, rounded)
    real_sqrt = torch.sqrt
    monkeypatch.setattr(torch, "sqrt", lambda t: real_sqrt(t.double()).to(t.dtype))
    coefficients = R.ddim_coefficients(table.cpu(), idx.cpu(), eta, torch.float32)
    monkeypatch.setattr(torch, "sqrt", real_sqrt)
    sqrt_a, sqrt_b, sqrt_a_prev, k, _ = (c[:, None] for c in coefficients)
    mu = R.ddim_mean(x.cpu().float(), v.cpu().float(), sqrt_a, sqrt_b, sqrt_a_prev, k,
                     flowrl.contract.Prediction[prediction.upper()], clip)
    assert torch.equal(out.prev_sample_mean.cpu().view(torch.int32), mu.view(torch.int32))
