"""Per-token schedules, frozen-element masks, counts and joint streams (docs/contract.md: Per-token
schedules; Frozen elements and counts; Joint steps), on both backends (Triton through the interpreter).

The float64 oracle below is written from the contract per element, not from flowrl.backends.reference: each
element's (sigma, sigma') is its token's, sigma' the largest schedule value strictly below sigma - 1e-6
(diffusers' FlowMatchEulerDiscreteScheduler.step with per_token_timesteps,
diffusers/schedulers/scheduling_flow_match_euler_discrete.py), the mode's mean and std come from
flowrl/oracle's per-row formulas, and the log-prob is a plain float64 sum over the scored elements
(not frozen, std > 0; a token at sigma 0 is held: x' = x).
"""
import math

import pytest
import torch

import flowrl
from flowrl.contract import CHUNK_SIZE, Mode
from flowrl.core.step_spec import ShardContext, flat_layout, token_schedule

from flowrl import oracle
from mode_coverage import every_mode_but, noise_levels

BACKENDS = ["torch", "triton"]
# every mode but these (a new Mode joins MODES: give it its float64 row in flowrl/oracle)
MODES_ELSEWHERE = {
    **{m.label: "MODE_RULES refuses token_sigmas= and frozen= for it (tests/ops/test_per_token.py, "
                "test_ddim_and_second_order_dpm_sde_refuse_token_sigmas_and_frozen)"
       for m in Mode if not (m.rules.per_token and m.rules.frozen)},
    "dpm_sde": "the per-token oracle below has no dpm_sde row: its frozen mask only (tests/ops/test_per_token.py, "
               "test_ddim_and_second_order_dpm_sde_refuse_token_sigmas_and_frozen)",
    "flash_sde": "the per-token oracle below has no flash_sde row: its pre-pass records against the torch backend's "
                 "token coefficients (tests/kernels/test_per_token_runs.py)",
}
MODES = list(every_mode_but(MODES_ELSEWHERE))
ETA = noise_levels({"ode": 0.0, "sde": 0.7, "dance": 0.5, "cps": 0.6}, MODES)
F64 = torch.float64

# (storage dtype) -> (rtol, atol) of a value against the float64 oracle (the flash-attention rule is
# applied on top: Triton's error at most twice torch's plus a float32 slack)
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _schedule():
    # diffusers' shifted schedule of 8 steps (float32), sigmas[0] = 1 exercises sde's sigma = 1 rule
    t = torch.linspace(1.0, 1.0 / 8, 8, dtype=torch.float64)
    shifted = 3.0 * t / (1 + 2.0 * t)
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)


SIGMAS = _schedule()


def _video(b=2, f=3, h=5, w=7, dtype=torch.float32, seed=0):
    """[B, C=2, F, H, W] latents (odd sizes), with a velocity, a reference velocity and noise."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, 2, f, h, w)
    x = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    v_ref = (v.float() + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    noise = torch.randn(shape, generator=g)
    return x, v, v_ref, noise


def _frame_sigmas(b, f, steps):
    """Per-frame sigmas [B, 1, F, 1, 1]: frame 0 at 0 (a conditioning frame, held), the others at the
    schedule values of ``steps`` (one per frame after the first), different per sample."""
    rows = []
    for k in range(b):
        vals = [0.0] + [float(SIGMAS[(s + k) % 8]) for s in steps[: f - 1]]
        rows.append(vals)
    return torch.tensor(rows, dtype=torch.float32).reshape(b, 1, f, 1, 1)


def _frozen_frame0(f):
    m = torch.zeros(1, 1, f, 1, 1, dtype=torch.bool)
    m[0, 0, 0] = True
    return m


# ------------------------------------------------------------------------------- the float64 oracle


def _next_sigma(sigma: float) -> float:
    """diffusers' rule in its float32 arithmetic: the largest schedule value < float32(sigma - 1e-6)."""
    threshold = float(torch.tensor(sigma, dtype=torch.float32) - 1e-6)
    lower = [float(s) for s in SIGMAS if float(s) < threshold]
    return max(lower) if lower else 0.0


def _element_step(sigma: float, mode: str, eta: float):
    """oracle.Step of one token's step (sigma -> its next), or None when held (sigma' == sigma)."""
    sigma_next = _next_sigma(sigma)
    if sigma_next == sigma:
        return None
    d = sigma - sigma_next
    if mode == "ode":
        return oracle.Step(sigma, sigma_next, 0.0, 0.0)
    if mode == "sde":
        sigma_t = float(SIGMAS[1]) if math.isclose(sigma, 1.0, rel_tol=oracle.SIGMA_ONE_RTOL) else sigma
        s = eta * math.sqrt(sigma / (1.0 - sigma_t))
        return oracle.Step(sigma, sigma_next, s * math.sqrt(d), s)
    if mode == "dance":
        return oracle.Step(sigma, sigma_next, eta * math.sqrt(d), eta)
    return oracle.Step(sigma, sigma_next, sigma_next * math.sin(eta * math.pi / 2), 0.0)


def _oracle(x, v, third, token_sigmas, frozen, mode, eta, kind="gaussian", reduction="mean", what="log_prob",
            noise=None):
    """Per element in float64: (mu, std, scored, kept) of every element, then the log-prob / KL [B]
    of ``third`` (x' or v_ref) or, with ``noise``, the float64 sample x' = mu + std eps (kept: x)."""
    shape = x.shape
    ts = token_sigmas.expand(shape) if token_sigmas is not None else None
    fz = frozen.expand(shape) if frozen is not None else torch.zeros(shape, dtype=torch.bool)
    xf, vf, tf = x.to(F64).reshape(-1), v.to(F64).reshape(-1), third.to(F64).reshape(-1)
    sig = ts.reshape(-1).tolist()
    fzl = fz.reshape(-1).tolist()
    n_per = x[0].numel()
    cache = {}
    out, counts = [], []
    prev = torch.empty(xf.shape, dtype=F64)
    for b in range(shape[0]):
        total, log_terms, count = 0.0, 0.0, 0
        for e in range(b * n_per, (b + 1) * n_per):
            if sig[e] not in cache:
                cache[sig[e]] = _element_step(sig[e], mode, eta)
            st = cache[sig[e]]
            if st is None or fzl[e]:
                prev[e] = xf[e]
                continue
            mu = oracle._row_mean(xf[e:e + 1], vf[e:e + 1], st, mode, eta)
            if noise is not None:
                prev[e] = mu + st.std * float(noise.reshape(-1)[e])
            if st.std == 0:
                continue
            count += 1
            sd = max(st.std, oracle.STD_FLOOR)
            if what == "kl":
                mu_ref = oracle._row_mean(xf[e:e + 1], tf[e:e + 1], st, mode, eta)
                total += float((mu - mu_ref) ** 2) / (2 * sd * sd)
                continue
            r = float(tf[e] - mu)
            if kind == "sq_err":
                total += -r * r
            else:
                total += -r * r / (2 * sd * sd)
                if kind == "gaussian":
                    log_terms += -math.log(sd) - math.log(math.sqrt(2 * math.pi))
        value = total + log_terms
        if reduction == "mean":
            value = value / count if count else 0.0
        out.append(value if count else 0.0)
        counts.append(count)
    if noise is not None:
        return prev.reshape(shape)
    return torch.tensor(out, dtype=F64), torch.tensor(counts, dtype=torch.float32)


def _within(got, want, ref_err, rtol, atol, what):
    """flash-attention's rule: the error against float64 within 2x the torch path's plus a slack."""
    err = (got.double() - want).abs()
    bound = 2 * ref_err + atol + rtol * want.abs()
    assert bool((err <= bound).all()), f"{what}: error {err.tolist()} above {bound.tolist()}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_and_frozen_against_the_float64_oracle(mode, dtype):
    """Rollout sample, log-prob of the emitted sample, KL and count of per-frame schedules with a frozen
    conditioning frame, both backends, against the per-element float64 oracle."""
    eta = ETA[mode]
    x, v, v_ref, noise = _video(dtype=dtype, seed=1)
    ts, fz = _frame_sigmas(2, 3, [2, 5]), _frozen_frame0(3)
    rtol, atol = TOL[dtype]
    torch_err = {}
    for backend in BACKENDS:
        out = flowrl.sde_step(x, v, SIGMAS, 2, mode=mode, noise_level=eta, noise=noise, token_sigmas=ts, frozen=fz,
                              backend=backend)
        want_prev = _oracle(x, v, x, ts, fz, mode, eta, noise=noise)
        torch.testing.assert_close(out.prev_sample.double(), want_prev, rtol=rtol, atol=atol)
        assert torch.equal(out.prev_sample[:, :, 0], x[:, :, 0])  # frozen frame unchanged, bit for bit
        want_lp, want_count = _oracle(x, v, out.prev_sample, ts, fz, mode, eta)
        assert torch.equal(out.count, want_count)
        # the log-prob is of the emitted (rounded) sample
        err = (out.log_prob.double() - want_lp).abs()
        if backend == "torch":
            torch_err["lp"] = err
        _within(out.log_prob, want_lp, torch_err["lp"], 2e-5, 2e-5 if dtype == torch.float32 else 2e-3,
                f"{backend} {mode} log_prob")
        kl = flowrl.step_kl(x, v, v_ref, SIGMAS, 2, mode=mode, noise_level=eta, token_sigmas=ts, frozen=fz,
                            backend=backend)
        want_kl, _ = _oracle(x, v, v_ref, ts, fz, mode, eta, what="kl")
        _within(kl, want_kl, torch.zeros_like(want_kl), 1e-4, 1e-5, f"{backend} {mode} kl")
        for kind in ("kernel", "sq_err"):
            for reduction in ("mean", "sum"):
                lp = flowrl.step_log_prob(x, v, out.prev_sample, SIGMAS, 2, mode=mode, noise_level=eta, token_sigmas=ts,
                                          frozen=fz, log_prob_kind=kind, reduction=reduction, backend=backend)
                want, _ = _oracle(x, v, out.prev_sample, ts, fz, mode, eta, kind=kind, reduction=reduction)
                _within(lp, want, torch.zeros_like(want), 1e-4, 1e-4 * (want.abs().max() + 1), f"{backend} {kind}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_layouts_token_rows_and_interior_ones(backend):
    """Token sigmas [B, S, 1] of [B, S, C] tokens, and a [1, 1, F, 1, W] mask (a 1 inside the span of its
    non-1 dims: materialised over the span only): against the oracle."""
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 37, 11, generator=g), torch.randn(3, 37, 11, generator=g)
    ts = SIGMAS[torch.randint(0, 9, (3, 37, 1), generator=g)]  # includes the terminal 0 (held tokens)
    fz = torch.rand(1, 37, 1, generator=g) < 0.3
    noise = torch.randn(3, 37, 11, generator=g)
    out = flowrl.sde_step(x, v, SIGMAS, 1, noise=noise, token_sigmas=ts, frozen=fz, backend=backend)
    lp, count = _oracle(x, v, out.prev_sample, ts, fz, "sde", 0.7)
    assert torch.equal(out.count, count)
    torch.testing.assert_close(out.log_prob.double(), lp, rtol=1e-4, atol=1e-4)
    x5, v5, _, n5 = _video(b=2, f=4, h=3, w=6, seed=4)
    fz5 = torch.zeros(1, 1, 4, 1, 6, dtype=torch.bool)
    fz5[..., 0, :, 2:] = True
    table, inner, groups, stride = flat_layout(fz5, x5.shape)
    assert (inner, groups, stride) == (1, 4 * 3 * 6, 0) and table.shape == (1, 72)
    out5 = flowrl.sde_step(x5, v5, SIGMAS, 3, noise=n5, frozen=fz5, backend=backend)
    lp5, count5 = _oracle(x5, v5, out5.prev_sample, SIGMAS[3].expand(2, 1, 1, 1, 1), fz5, "sde", 0.7)
    assert torch.equal(out5.count, count5) and float(count5[0]) == 2 * 4 * 3 * 6 - 2 * 3 * 4
    torch.testing.assert_close(out5.log_prob.double(), lp5, rtol=1e-4, atol=1e-4)


def test_next_sigma_is_diffusers_per_token_rule_bit_for_bit():
    """An ode step with per-token timesteps equals diffusers' FlowMatchEulerDiscreteScheduler.step(...,
    per_token_timesteps=) in float32 bit for bit (diffusers adds dt * v with dt = sigma - sigma' > 0
    there, so its model_output is ours negated, as LTX Condition passes it), tokens at t = 0 unchanged."""
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(8)
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(2, 19, 6, generator=g), torch.randn(2, 19, 6, generator=g)
    t = sched.timesteps[torch.randint(0, 8, (2, 19), generator=g)]
    t[:, :4] = 0.0  # conditioning tokens
    t[1, 7] = t[1, 7] - 0.3  # a timestep off the schedule
    want = sched.step(v, sched.timesteps[2], x, per_token_timesteps=t, return_dict=False)[0]
    ts = (t / sched.config.num_train_timesteps).unsqueeze(-1)
    for backend in BACKENDS:
        got = flowrl.sde_step(x, -v, sched.sigmas, 2, mode="ode", token_sigmas=ts, backend=backend)
        assert torch.equal(got.prev_sample, want), backend
        assert torch.equal(got.prev_sample[:, :4], x[:, :4])
    sigma, sigma_next = token_schedule(sched.sigmas, ts)
    assert torch.equal(sigma_next[:, :4], torch.zeros_like(sigma_next[:, :4]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_uniform_token_sigmas_are_the_ordinary_step_bit_for_bit(backend, mode):
    """token_sigmas equal to sigmas[step_index] per sample (and an all-False mask) give the ordinary
    step's bits: sample, log-prob, mean, count, KL, gradients."""
    eta = ETA[mode]
    x, v, v_ref, noise = _video(dtype=torch.bfloat16, seed=2)
    step = torch.tensor([0, 4])
    ts = SIGMAS[step].reshape(2, 1, 1, 1, 1)
    none = torch.zeros(1, 2, 1, 1, 1, dtype=torch.bool)
    kw = dict(mode=mode, noise_level=eta, backend=backend)
    plain = flowrl.sde_step(x, v, SIGMAS, step, noise=noise, **kw)
    for extra in (dict(token_sigmas=ts), dict(frozen=none), dict(token_sigmas=ts.expand(2, 1, 3, 5, 1), frozen=none)):
        out = flowrl.sde_step(x, v, SIGMAS, step, noise=noise, **kw, **extra)
        for name in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev", "count"):
            assert torch.equal(getattr(out, name), getattr(plain, name)), (name, extra)
        for kind in ("gaussian", "sq_err"):
            vg1, vg2 = v.clone().requires_grad_(), v.clone().requires_grad_()
            a = flowrl.step_log_prob(x, vg1, plain.prev_sample, SIGMAS, step, log_prob_kind=kind, reduction="sum", **kw)
            b = flowrl.step_log_prob(x, vg2, plain.prev_sample, SIGMAS, step, log_prob_kind=kind, reduction="sum", **kw,
                                     **extra)
            assert torch.equal(a, b)
            a.sum().backward()
            b.sum().backward()
            assert torch.equal(vg1.grad, vg2.grad)
        assert torch.equal(flowrl.step_kl(x, v, v_ref, SIGMAS, step, **kw),
                           flowrl.step_kl(x, v, v_ref, SIGMAS, step, **kw, **extra))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_equals_recompute_and_batch_invariance(backend):
    """The rollout's log-prob is the recompute's bit for bit (tensor noise and in-kernel Philox, per-sample
    steps, per-frame sigmas, a frozen frame); a sample's values do not depend on its batch."""
    x, v, _, noise = _video(b=3, f=3, dtype=torch.bfloat16, seed=6)
    ts, fz = _frame_sigmas(3, 3, [1, 3]), _frozen_frame0(3)
    step = torch.tensor([1, 2, 3])
    kw = dict(token_sigmas=ts, frozen=fz, backend=backend)
    for source in (dict(noise=noise), dict(noise_seed=torch.tensor([11, 12, 13]))):
        for kind, reduction in (("gaussian", "mean"), ("kernel", "sum")):
            out = flowrl.sde_step(x, v, SIGMAS, step, log_prob_kind=kind, reduction=reduction, **source, **kw)
            lp = flowrl.step_log_prob(x, v, out.prev_sample, SIGMAS, step, log_prob_kind=kind, reduction=reduction,
                                      return_count=True, **kw)
            assert torch.equal(lp.log_prob, out.log_prob) and torch.equal(lp.count, out.count)
            # sample 1 alone (its own token sigmas, the shared mask)
            one = dict(noise=noise[1:2]) if "noise" in source else dict(noise_seed=torch.tensor([12]))
            alone = flowrl.sde_step(x[1:2], v[1:2], SIGMAS, step[1:2], log_prob_kind=kind, reduction=reduction,
                                    token_sigmas=ts[1:2], frozen=fz, backend=backend, **one)
            assert torch.equal(alone.prev_sample, out.prev_sample[1:2]) and torch.equal(alone.log_prob, out.log_prob[1:2])


def _simulated_shards(run, n_shards):
    """Run ``run(k, shard_context)`` for every shard k of a sequence-parallel split in one process: the
    all-gather is simulated by recording every shard's local partials first (pass 1), then returning
    the concatenation in rank order with the live local tensor in place (pass 2, differentiable)."""
    recorded = [[] for _ in range(n_shards)]

    def context(k, numel, offset, live):
        calls = iter(range(10 ** 6))

        def gather(local):
            i = next(calls)
            if not live:
                recorded[k].append(local.detach())
                return torch.cat([local] * n_shards, dim=1)
            parts = [recorded[j][i] if j != k else local for j in range(n_shards)]
            return torch.cat(parts, dim=1)

        return ShardContext(numel=numel, offset=offset, gather=gather)

    for k in range(n_shards):
        run(k, lambda numel, offset, kk=k: context(kk, numel, offset, False))
    return [run(k, lambda numel, offset, kk=k: context(kk, numel, offset, True)) for k in range(n_shards)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_invariance(backend):
    """Shards of [B, S, C] on S at chunk boundaries, each with its slice of the per-token sigmas and of the
    mask: log-probs, counts, and the shards' gradients equal one device's bit for bit (kinds whose
    per-token log term is absent; the gaussian one within float32 rounding)."""
    g = torch.Generator().manual_seed(8)
    b, s, c = 2, 40, 64  # 16 rows of 64 = one chunk
    rows = [16, 24]
    x, v = torch.randn(b, s, c, generator=g).to(torch.bfloat16), torch.randn(b, s, c, generator=g).to(torch.bfloat16)
    ts = SIGMAS[torch.randint(1, 9, (b, s, 1), generator=g)]
    fz = torch.rand(1, s, 1, generator=g) < 0.2
    prev = flowrl.sde_step(x, v, SIGMAS, 2, token_sigmas=ts, frozen=fz, generator=g, backend=backend).prev_sample
    for kind, exact in (("kernel", True), ("sq_err", True), ("gaussian", False)):
        vf = v.clone().requires_grad_()
        full = flowrl.step_log_prob(x, vf, prev, SIGMAS, 2, token_sigmas=ts, frozen=fz, log_prob_kind=kind,
                                    return_count=True, backend=backend)
        full.log_prob.sum().backward()
        bounds = [(0, rows[0]), (rows[0], s)]

        def run(k, make):
            lo, hi = bounds[k]
            vs = v[:, lo:hi].clone().requires_grad_()
            out = flowrl.step_log_prob(x[:, lo:hi], vs, prev[:, lo:hi], SIGMAS, 2, token_sigmas=ts[:, lo:hi],
                                       frozen=fz[:, lo:hi], log_prob_kind=kind, return_count=True, backend=backend,
                                       shard=make(s * c, lo * c))
            return out, vs

        for k, (out, vs) in enumerate(_simulated_shards(run, 2)):
            assert torch.equal(out.count, full.count)
            if exact:
                assert torch.equal(out.log_prob, full.log_prob), (kind, k)
            else:
                torch.testing.assert_close(out.log_prob, full.log_prob, rtol=2e-6, atol=1e-6)
            out.log_prob.sum().backward()
            lo, hi = bounds[k]
            if exact:
                assert torch.equal(vs.grad, vf.grad[:, lo:hi])
            else:
                torch.testing.assert_close(vs.grad, vf.grad[:, lo:hi])
    assert (s * c) // 2 >= CHUNK_SIZE


def test_gradcheck_float64():
    """torch.autograd.gradcheck of the per-token, masked log-prob (every kind) and KL on the float64
    torch backend, in sample, model_output and prev_sample."""
    g = torch.Generator().manual_seed(9)
    x, v, xp = (torch.randn(2, 3, 4, 3, generator=g, dtype=F64) for _ in range(3))
    ts = torch.tensor([[0.0, float(SIGMAS[2]), float(SIGMAS[4])], [float(SIGMAS[1]), 0.5, 1.0]]).reshape(2, 3, 1, 1)
    fz = torch.zeros(1, 3, 4, 1, dtype=torch.bool)
    fz[0, 1, 0] = True
    for kind, reduction in (("gaussian", "mean"), ("kernel", "sum"), ("sq_err", "mean")):
        def f(a, b, c, kind=kind, reduction=reduction):
            return flowrl.step_log_prob(a, b, c, SIGMAS, 3, token_sigmas=ts, frozen=fz, log_prob_kind=kind,
                                        reduction=reduction, backend="torch")
        assert torch.autograd.gradcheck(f, (x.clone().requires_grad_(), v.clone().requires_grad_(),
                                            xp.clone().requires_grad_()))
    assert torch.autograd.gradcheck(
        lambda b, c: flowrl.step_kl(x, b, c, SIGMAS, 3, token_sigmas=ts, frozen=fz, mode="cps", noise_level=0.5,
                                    backend="torch"), (v.clone().requires_grad_(), xp.clone().requires_grad_()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_gradients_match_torch(dtype):
    """Triton's fused backward of the per-token, masked log-prob and KL equals the torch backend's
    autograd: float32 within 1e-5 relative, half precision within one storage ulp; frozen elements get
    exactly 0."""
    x, v, v_ref, noise = _video(dtype=dtype, seed=10)
    ts, fz = _frame_sigmas(2, 3, [3, 6]), _frozen_frame0(3)
    prev = flowrl.sde_step(x, v, SIGMAS, 3, noise=noise, token_sigmas=ts, frozen=fz, backend="torch").prev_sample
    grads = {}
    for backend in BACKENDS:
        xs, vs, ps = (t.clone().requires_grad_() for t in (x, v, prev))
        lp = flowrl.step_log_prob(xs, vs, ps, SIGMAS, 3, token_sigmas=ts, frozen=fz, backend=backend)
        vk = v.clone().requires_grad_()
        kl = flowrl.step_kl(x, vk, v_ref, SIGMAS, 3, token_sigmas=ts, frozen=fz, backend=backend)
        lp.sum().backward()
        kl.sum().backward()
        grads[backend] = (xs.grad, vs.grad, ps.grad, vk.grad)
    for got, want in zip(grads["triton"], grads["torch"]):
        assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=torch.finfo(dtype).tiny)
            assert bool(((got.float() - want.float()).abs() <= ulp * 2 + 1e-30).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_elements_are_unchanged_and_do_not_score(backend):
    """Frozen elements emit x' = x exactly; changing model_output (and prev_sample) only there leaves the
    log-prob, KL and count unchanged (the Wan 2.2 TI2V failure); unfrozen elements' noise is the same
    with or without the mask; every element frozen gives log-prob 0 and count 0, never NaN."""
    x, v, v_ref, noise = _video(seed=11)
    fz = _frozen_frame0(3)
    kw = dict(frozen=fz, backend=backend)
    out = flowrl.sde_step(x, v, SIGMAS, 2, noise=noise, **kw)
    plain = flowrl.sde_step(x, v, SIGMAS, 2, noise=noise, backend=backend)
    assert torch.equal(out.prev_sample[:, :, 0], x[:, :, 0])
    assert torch.equal(out.prev_sample_mean[:, :, 0], x[:, :, 0].float())  # a frozen element's mean is x
    assert torch.equal(out.prev_sample[:, :, 1:], plain.prev_sample[:, :, 1:])
    assert torch.equal(out.prev_sample_mean[:, :, 1:], plain.prev_sample_mean[:, :, 1:])
    assert torch.equal(out.count, torch.full((2,), float(x[0, :, 1:].numel())))
    v2, p2, r2 = v.clone(), out.prev_sample.clone(), v_ref.clone()
    v2[:, :, 0] += 5.0
    p2[:, :, 0] -= 3.0
    r2[:, :, 0] *= -1
    lp = flowrl.step_log_prob(x, v, out.prev_sample, SIGMAS, 2, **kw)
    assert torch.equal(lp, out.log_prob)
    assert torch.equal(flowrl.step_log_prob(x, v2, p2, SIGMAS, 2, **kw), lp)
    assert not torch.equal(flowrl.step_log_prob(x, v2, p2, SIGMAS, 2, backend=backend), plain.log_prob)
    assert torch.equal(flowrl.step_kl(x, v2, r2, SIGMAS, 2, **kw), flowrl.step_kl(x, v, v_ref, SIGMAS, 2, **kw))
    everything = torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)
    vg = v.clone().requires_grad_()
    allf = flowrl.step_log_prob(x, vg, out.prev_sample, SIGMAS, 2, frozen=everything, backend=backend,
                                return_count=True)
    assert torch.equal(allf.log_prob, torch.zeros(2)) and torch.equal(allf.count, torch.zeros(2))
    allf.log_prob.sum().backward()
    assert torch.equal(vg.grad, torch.zeros_like(vg))
    ro = flowrl.sde_step(x, v, SIGMAS, 2, noise=noise, frozen=everything, backend=backend)
    assert torch.equal(ro.prev_sample, x) and torch.equal(ro.log_prob, torch.zeros(2))
    # in-kernel Philox noise keeps its element positions too
    seeded = flowrl.sde_step(x, v, SIGMAS, 2, noise_seed=5, **kw)
    seeded_plain = flowrl.sde_step(x, v, SIGMAS, 2, noise_seed=5, backend=backend)
    assert torch.equal(seeded.prev_sample[:, :, 1:], seeded_plain.prev_sample[:, :, 1:])
    # without a mask the count is every element, or none for a deterministic step (value 0)
    assert torch.equal(plain.count, torch.full((2,), float(x[0].numel())))
    ode = flowrl.sde_step(x, v, SIGMAS, 2, mode="ode", backend=backend)
    assert torch.equal(ode.count, torch.zeros(2)) and torch.equal(ode.log_prob, torch.zeros(2))
    lp_ode = flowrl.step_log_prob(x, v, ode.prev_sample, SIGMAS, 2, mode="cps", noise_level=0.0, backend=backend,
                                  return_count=True)
    assert torch.equal(lp_ode.count, torch.zeros(2)) and torch.equal(lp_ode.log_prob, torch.zeros(2))


def test_trainer_aggregations_sum_sample_mean_frame_mean():
    """docs/contract.md, Frozen elements and counts: a trainer's three aggregations from the public API.
    sum: reduction="sum"; per-sample mean: reduction="mean" (= sum / count); per-frame mean: one call per
    frame with the other frames frozen, then the mean of the frames' means; each against the oracle."""
    x, v, _, noise = _video(b=2, f=4, seed=12)
    ts = _frame_sigmas(2, 4, [1, 3, 5])
    out = flowrl.sde_step(x, v, SIGMAS, 1, noise=noise, token_sigmas=ts, reduction="sum", backend="torch")
    want_sum, count = _oracle(x, v, out.prev_sample, ts, None, "sde", 0.7, reduction="sum")
    torch.testing.assert_close(out.log_prob.double(), want_sum, rtol=1e-5, atol=1e-4)
    mean = flowrl.step_log_prob(x, v, out.prev_sample, SIGMAS, 1, token_sigmas=ts, return_count=True, backend="torch")
    torch.testing.assert_close(mean.log_prob.double(), want_sum / count.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(mean.count, count) and float(count[0]) == 2 * 3 * 5 * 7  # C * 3 frames * H * W: frame 0 is held
    frame_means = []
    for f in range(1, 4):
        others = torch.ones(1, 1, 4, 1, 1, dtype=torch.bool)
        others[0, 0, f] = False
        frame_means.append(flowrl.step_log_prob(x, v, out.prev_sample, SIGMAS, 1, token_sigmas=ts, frozen=others,
                                                backend="torch"))
        want_f, _ = _oracle(x, v, out.prev_sample, ts, others, "sde", 0.7)
        torch.testing.assert_close(frame_means[-1].double(), want_f, rtol=1e-5, atol=1e-5)
    # frames of equal size: the mean of the frames' means is the sample's mean
    torch.testing.assert_close(torch.stack(frame_means).mean(0), mean.log_prob, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------- joint streams


def _streams(seed=13):
    g = torch.Generator().manual_seed(seed)
    video = tuple(torch.randn(2, 4, 3, 5, 6, generator=g).to(torch.bfloat16) for _ in range(2))
    audio = tuple(torch.randn(2, 9, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    return video, audio


@pytest.mark.parametrize("backend", BACKENDS)
def test_joint_streams_rollout_equals_recompute_and_combination(backend):
    """Two streams (video with a frozen frame, audio) rolled out separately with reduction="sum" and
    combined by combine_streams equal step_log_prob on tuples bit for bit, for "mean" and "sum"; the
    mean is the streams' summed log-probs over their total count; gradients reach both streams."""
    (xv, vv), (xa, va) = _streams()
    fz = torch.zeros(1, 1, 3, 1, 1, dtype=torch.bool)
    fz[0, 0, 0] = True
    audio_sigmas = torch.linspace(1.0, 0.0, 9)
    for reduction in ("mean", "sum"):
        ov = flowrl.sde_step(xv, vv, SIGMAS, 3, frozen=fz, noise_seed=1, reduction="sum", backend=backend)
        oa = flowrl.sde_step(xa, va, audio_sigmas, 3, noise_seed=2, reduction="sum", backend=backend)
        rollout = flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], reduction)
        vvg, vag = vv.clone().requires_grad_(), va.clone().requires_grad_()
        joint = flowrl.step_log_prob((xv, xa), (vvg, vag), (ov.prev_sample, oa.prev_sample), (SIGMAS, audio_sigmas), 3,
                                     frozen=(fz, None), reduction=reduction, return_count=True, backend=backend)
        assert torch.equal(joint.log_prob, rollout) and torch.equal(joint.count, ov.count + oa.count)
        if reduction == "mean":
            torch.testing.assert_close(rollout, (ov.log_prob + oa.log_prob) / (ov.count + oa.count))
        joint.log_prob.sum().backward()
        assert vvg.grad.abs().sum() > 0 and vag.grad.abs().sum() > 0
        assert torch.equal(vvg.grad[:, :, 0], torch.zeros_like(vvg.grad[:, :, 0]))
    kl = flowrl.step_kl((xv, xa), (vv, va), (vv, va * 1.5), (SIGMAS, audio_sigmas), 3, frozen=(fz, None),
                        backend=backend)
    assert bool((kl > 0).all())
    empty = flowrl.combine_streams([torch.zeros(2)], [torch.zeros(2)], "mean")
    assert torch.equal(empty, torch.zeros(2))


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("case, kwargs, exc, needle", [
    ("ndim", dict(token_sigmas=torch.zeros(2, 3)), ValueError, "token_sigmas"),
    ("shape", dict(token_sigmas=torch.zeros(2, 4, 1)), ValueError, "token_sigmas"),
    ("half", dict(token_sigmas=torch.zeros(2, 3, 1, dtype=torch.bfloat16)), TypeError, "token_sigmas"),
    ("negative", dict(token_sigmas=torch.full((2, 3, 1), -0.1)), ValueError, "token_sigmas"),
    ("above one", dict(token_sigmas=torch.full((2, 3, 1), 1.5)), ValueError, "token_sigmas"),
    ("nan", dict(token_sigmas=torch.full((2, 3, 1), float("nan"))), ValueError, "token_sigmas"),
    ("list", dict(token_sigmas=[0.5, 0.5]), TypeError, "token_sigmas"),
    ("mask dtype", dict(frozen=torch.zeros(2, 3, 1)), TypeError, "frozen"),
    ("mask ndim", dict(frozen=torch.zeros(3, dtype=torch.bool)), ValueError, "frozen"),
    ("mask shape", dict(frozen=torch.zeros(1, 1, 5, dtype=torch.bool)), ValueError, "frozen"),
    ("return_count", dict(return_count=1), TypeError, "return_count"),
])
def test_bad_arguments_name_themselves(case, kwargs, exc, needle):
    x = torch.randn(2, 3, 4)
    with pytest.raises(exc, match=needle):
        flowrl.step_log_prob(x, x, x, SIGMAS, 1, backend="torch", **kwargs)
    if "return_count" not in kwargs:
        with pytest.raises(exc, match=needle):
            flowrl.sde_step(x, x, SIGMAS, 1, backend="torch", **kwargs)
        with pytest.raises(exc, match=needle):
            flowrl.step_kl(x, x, x, SIGMAS, 1, backend="torch", **kwargs)


def test_bad_streams_name_themselves():
    x, y = torch.randn(2, 3, 4), torch.randn(2, 5)
    with pytest.raises(TypeError, match="model_output"):
        flowrl.step_log_prob((x, y), x, (x, y), SIGMAS, 1)
    with pytest.raises(ValueError, match="prev_sample"):
        flowrl.step_log_prob((x, y), (x, y), (x,), SIGMAS, 1)
    with pytest.raises(ValueError, match="sigmas"):
        flowrl.step_log_prob((x, y), (x, y), (x, y), (SIGMAS,), 1)
    with pytest.raises(ValueError, match="frozen"):
        flowrl.step_log_prob((x, y), (x, y), (x, y), SIGMAS, 1, frozen=(None, None, None))
    with pytest.raises(ValueError, match="combine_streams"):
        flowrl.combine_streams([torch.zeros(2)], [], "mean")
    with pytest.raises(ValueError, match="reduction"):
        flowrl.combine_streams([torch.zeros(2)], [torch.zeros(2)], "avg")


def test_rollout_gradients_triton_equal_torch():
    """sde_step with per-token sigmas and a mask is differentiable on both backends alike: x' and the
    mean in x and v (kept elements pass x' = x's gradient to x, none to v), the log-prob in the noise."""
    g = torch.Generator().manual_seed(14)
    x, v, n = (torch.randn(2, 3, 4, 5, generator=g) for _ in range(3))
    ts = SIGMAS[torch.tensor([0, 2, 8])].reshape(1, 3, 1, 1).expand(2, 3, 1, 1).contiguous()  # frame 2 held
    fz = torch.zeros(1, 3, 4, 1, dtype=torch.bool)
    fz[0, 1, 1] = True
    grads = {}
    for backend in BACKENDS:
        xs, vs, ns = (t.clone().requires_grad_() for t in (x, v, n))
        out = flowrl.sde_step(xs, vs, SIGMAS, 2, noise=ns, token_sigmas=ts, frozen=fz, backend=backend)
        (0.3 * out.prev_sample.sum() + out.log_prob.sum() + 0.1 * out.prev_sample_mean.pow(2).sum()).backward()
        grads[backend] = (xs.grad, vs.grad, ns.grad)
    for got, want in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    gx, gv, gn = grads["torch"]
    assert torch.equal(gv[:, 2], torch.zeros_like(gv[:, 2])) and torch.equal(gn[:, 2], torch.zeros_like(gn[:, 2]))
    assert torch.equal(gv[:, 1, 1], torch.zeros_like(gv[:, 1, 1])) and bool((gx[:, 2] != 0).all())


def test_ddim_and_second_order_dpm_sde_refuse_token_sigmas_and_frozen():
    """Per-token schedules and masks are the flow modes' per-element steps: ddim (an alpha-bar table)
    and dpm_sde's second order (prev_x0_pred) refuse them by name instead of approximating
    (docs/contract.md, Per-token schedules)."""
    x, v, _, _ = _video()
    frozen = torch.zeros(1, 1, x.shape[2], 1, 1, dtype=torch.bool)
    token_sigmas = _frame_sigmas(x.shape[0], x.shape[2], [2, 3])
    alpha_bar = torch.tensor([0.5, 0.6, 0.6, 0.7, 0.7, 0.8], dtype=torch.float32)
    for kwargs, needle in ((dict(frozen=frozen), "frozen"), (dict(token_sigmas=token_sigmas), "token_sigmas")):
        with pytest.raises(ValueError, match=f"{needle} is not supported with mode='ddim'"):
            flowrl.step_log_prob(x, v, x, alpha_bar, 1, mode="ddim", noise_level=1.0, backend="torch", **kwargs)
        with pytest.raises(ValueError, match=f"{needle} is not supported with a second-order dpm_sde"):
            flowrl.sde_step(x, v, SIGMAS, 2, mode="dpm_sde", noise_level=1.0, prev_x0_pred=x, backend="torch",
                            **kwargs)
    # first-order dpm_sde and flash_sde take them: frozen elements stay x
    for mode in ("dpm_sde", "flash_sde"):
        out = flowrl.sde_step(x, v, SIGMAS, 2, mode=mode, noise_level=1.0, frozen=frozen | True, backend="torch")
        assert torch.equal(out.prev_sample, x) and torch.equal(out.count, torch.zeros(x.shape[0]))
