"""The torch reference (``backend="torch"``) against the math contract (docs/contract.md) and the independent
float64 oracle (flowrl/oracle): means, stds, log-probs, KL, gradients, the rounding rule,
deterministic steps, per-sample steps and generators, and the fixed reduction order."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flowrl
import flowrl.core.step_spec
from flowrl.backends import reference as R
from flowrl import sde_step, step_kl, step_log_prob

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flowrl import oracle  # noqa: E402
from mode_coverage import every_mode_but, noise_levels, noisy  # noqa: E402

T = 10
STEPS = {"first": 0, "middle": T // 2, "last": T - 1}
# every mode but these, each against its own float64 formulas elsewhere (a new Mode joins MODES: give it
# its float64 row in flowrl/oracle)
MODES_ELSEWHERE = {
    "ddim": "its alpha-bar table, against diffusers' DDIMScheduler and float64: tests/ops/test_ddim.py",
    "dpm_sde": "its fixed noise level and second order, against float64: tests/ops/test_dpm_sde.py",
    "flash_sde": "against Flash-GRPO's formula in float64: tests/ops/test_variants.py",
}
MODES = every_mode_but(MODES_ELSEWHERE)
ETA = noise_levels({"ode": 0.7, "sde": 0.7, "dance": 0.3, "cps": 0.6}, MODES)
NOISY_MODES = noisy(MODES)  # mode_coverage.DETERMINISTIC: a log-prob and KL of exactly 0
KINDS = ("gaussian", "kernel", "sq_err")
REDUCTIONS = ("mean", "sum")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = ("torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="triton on CPU needs TRITON_INTERPRET=1")))
# 4-D image latents, 5-D video latents, one element, and sizes that are not powers of two
# (3 * 1500 crosses a CHUNK_SIZE boundary inside every sample)
SHAPES = ((2, 3, 5, 7), (2, 2, 3, 4, 5), (1, 1), (3, 1500))

# Error tables vs the float64 oracle given the SAME stored tensors. Storage dtype only changes
# what is rounded; the arithmetic is float32 in every case but float64, so the log-prob tolerance
# is the float32 one (measured worst ~1e-6 relative; 2e-5 leaves margin). The emitted sample may
# differ from the oracle's by one ulp of its dtype (a float32 mu on a rounding boundary).
LOG_PROB_TOL = {
    torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5, torch.float64: 1e-12,
}
SAMPLE_TOL = {  # (rtol, atol) for prev_sample and its mean
    torch.float32: (2e-6, 2e-6),
    torch.bfloat16: (torch.finfo(torch.bfloat16).eps, 2e-6),
    torch.float16: (torch.finfo(torch.float16).eps, 2e-6),
    torch.float64: (1e-12, 1e-12),
}


def schedule(steps: int = T, shift: float = 3.0) -> torch.Tensor:
    """diffusers-style shifted flow-matching schedule: float32, from 1 down to the terminal 0."""
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def close(actual, expected, rtol, atol, what):
    actual, expected = actual.double(), expected.double()
    bad = (actual - expected).abs() > atol + rtol * expected.abs()
    assert not bool(bad.any()), (
        f"{what}: max abs err {(actual - expected).abs().max().item():.3e}, "
        f"expected {expected.flatten()[:4].tolist()}, got {actual.flatten()[:4].tolist()}"
    )


# ---- against the oracle: every mode x kind x reduction x dtype x shape x step position ----------

@pytest.mark.parametrize("where", list(STEPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("mode", MODES)
def test_step_matches_oracle(mode, dtype, where):
    sigmas, i, eta = schedule(), STEPS[where], ETA[mode]
    lp_tol = LOG_PROB_TOL[dtype]
    rtol, atol = SAMPLE_TOL[dtype]
    for n, shape in enumerate(SHAPES):
        x, v, noise = (randn(shape, dtype, 10 * n + k) for k in range(3))
        v_ref = randn(shape, dtype, 10 * n + 3)
        mu64 = oracle.mean(x, v, sigmas, i, mode, eta)
        std64 = oracle.std(sigmas, i, mode, eta, shape[0])
        for kind in KINDS:
            for reduction in REDUCTIONS:
                what = f"{mode} {dtype} {where} {shape} {kind} {reduction}"
                out = sde_step(x, v, sigmas, i, mode=mode, noise_level=eta, noise=noise, log_prob_kind=kind,
                               reduction=reduction, backend="torch")
                assert out.prev_sample.dtype == dtype and out.prev_sample.shape == shape
                assert out.log_prob.shape == (shape[0],)
                close(out.prev_sample, oracle.sample(x, v, noise, sigmas, i, mode, eta), rtol, atol, what + " x'")
                close(out.prev_sample_mean, mu64, 1e-12 if dtype == torch.float64 else 2e-6,
                      1e-12 if dtype == torch.float64 else 2e-6, what + " mu")
                close(out.std_dev, std64, lp_tol, 0, what + " std")
                # the log-prob is of the emitted sample, as the oracle recomputes it in float64
                expected = oracle.log_prob(x, v, out.prev_sample, sigmas, i, mode, eta, kind, reduction)
                close(out.log_prob, expected, lp_tol, lp_tol, what + " log_prob")
                assert torch.isfinite(out.log_prob).all()
                # training recomputes the rollout's log-prob from the stored sample, bit for bit
                again = step_log_prob(x, v, out.prev_sample, sigmas, i, mode=mode, noise_level=eta,
                                      log_prob_kind=kind, reduction=reduction, backend="torch")
                assert torch.equal(again, out.log_prob), what
            kl = step_kl(x, v, v_ref, sigmas, i, mode=mode, noise_level=eta, reduction=reduction, backend="torch")
            close(kl, oracle.kl(x, v, v_ref, sigmas, i, mode, eta, reduction), lp_tol, lp_tol, f"{mode} kl")


@pytest.mark.parametrize("mode", NOISY_MODES)
def test_sum_is_mean_times_element_count(mode):
    sigmas, shape = schedule(), (2, 3, 37, 41)  # 4551 elements: five chunks, the last partial
    x, v, noise = (randn(shape, torch.float64, k) for k in range(3))
    numel = 3 * 37 * 41
    for kind in KINDS:
        kw = dict(mode=mode, noise_level=ETA[mode], noise=noise, log_prob_kind=kind, backend="torch")
        s = sde_step(x, v, sigmas, 4, reduction="sum", **kw).log_prob
        m = sde_step(x, v, sigmas, 4, reduction="mean", **kw).log_prob
        torch.testing.assert_close(s, m * numel, rtol=1e-12, atol=1e-9)


# ---- the rounding rule ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
    ids=["f32->bf16", "f32->f16", "bf16->f32"],
)
def test_log_prob_is_of_the_emitted_sample(in_dtype, out_dtype):
    # cps at a low eta: std ~ 0.006, small next to the rounding of x' ~ 1, so rounding matters.
    # "kernel" keeps the value near -0.5 (no large -log(std)) so a tight absolute tolerance applies:
    # the float32 path's error here is ~1e-6, the rounding's effect ~1e-3.
    sigmas, i, mode, eta, kind = schedule(), 3, "cps", 0.005, "kernel"
    shape = (2, 4, 16, 16)
    x, v, noise = (randn(shape, in_dtype, k) for k in range(3))
    out = sde_step(x, v, sigmas, i, mode=mode, noise_level=eta, noise=noise, out_dtype=out_dtype, log_prob_kind=kind,
                   backend="torch")
    assert out.prev_sample.dtype == out_dtype
    emitted = oracle.log_prob(x, v, out.prev_sample, sigmas, i, mode, eta, kind)
    close(out.log_prob, emitted, 1e-5, 1e-5, "log-prob of the emitted sample")
    stored = out.prev_sample.clone()  # what a rollout buffer keeps
    again = step_log_prob(x, v, stored, sigmas, i, mode=mode, noise_level=eta, log_prob_kind=kind, backend="torch")
    assert torch.equal(again, out.log_prob)
    if out_dtype != torch.float32:
        # the log-prob of the unrounded float64 sample differs by far more than the tolerance:
        # this test would notice a log-prob taken before rounding
        unrounded_sample = oracle.sample(x, v, noise, sigmas, i, mode, eta)
        unrounded = oracle.log_prob(x, v, unrounded_sample, sigmas, i, mode, eta, kind)
        assert ((unrounded - out.log_prob.double()).abs() > 10 * (1e-5 + 1e-5 * unrounded.abs())).all()


def test_default_out_dtype_is_model_output_dtype():
    sigmas = schedule()
    x = randn((2, 8), torch.float32, 0)
    v = randn((2, 8), torch.bfloat16, 1)
    out = sde_step(x, v, sigmas, 2, backend="torch", generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == torch.bfloat16
    assert out.log_prob.dtype == torch.float32 and out.std_dev.dtype == torch.float32


# ---- deterministic steps -------------------------------------------------------------------------

DETERMINISTIC = [("ode", 0, 0.7), ("ode", T - 1, 0.7), ("cps", T - 1, 0.6), ("cps", T - 1, 1.0),
                 ("sde", 0, 0.0), ("sde", 4, 0.0), ("dance", 4, 0.0), ("cps", 4, 0.0)]


@pytest.mark.parametrize("mode,i,eta", DETERMINISTIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_deterministic_step_has_log_prob_zero(mode, i, eta, dtype):
    sigmas, shape = schedule(), (2, 3, 7, 5)
    x, noise = randn(shape, dtype, 0), randn(shape, dtype, 2)
    v = randn(shape, dtype, 1).requires_grad_(True)
    for kind in KINDS:
        for reduction in REDUCTIONS:
            out = sde_step(x, v, sigmas, i, mode=mode, noise_level=eta, noise=noise, log_prob_kind=kind,
                           reduction=reduction, backend="torch")
            assert torch.equal(out.std_dev, torch.zeros_like(out.std_dev))
            assert torch.equal(out.log_prob, torch.zeros_like(out.log_prob)), (kind, reduction)
            # x' = mu exactly: the noise is not used
            assert torch.equal(out.prev_sample, out.prev_sample_mean.to(dtype))
            lp = step_log_prob(x, v, out.prev_sample.detach(), sigmas, i, mode=mode, noise_level=eta,
                               log_prob_kind=kind, reduction=reduction, backend="torch")
            assert torch.equal(lp, torch.zeros_like(lp))
            (grad,) = torch.autograd.grad(lp.sum(), v)
            assert torch.equal(grad, torch.zeros_like(grad)), "deterministic steps have zero gradient"
    kl = step_kl(x, v, randn(shape, dtype, 3), sigmas, i, mode=mode, noise_level=eta, backend="torch")
    assert torch.equal(kl, torch.zeros_like(kl))
    (grad,) = torch.autograd.grad(kl.sum(), v)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("backend", [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="triton on CPU needs TRITON_INTERPRET=1")),
])
@pytest.mark.parametrize("mode,eta", [("ode", 0.7), ("sde", 0.0), ("cps", 0.0)])
def test_steps_deterministic_by_their_arguments_draw_no_noise(backend, mode, eta):
    # ode and noise level 0 need no eps: no noise tensor is drawn or read, no generator advances,
    # and the result is the bits of the same step given explicit noise
    sigmas, shape = schedule(), (2, 3, 7, 5)
    x, v, noise = randn(shape, torch.bfloat16, 0), randn(shape, torch.bfloat16, 1), randn(shape, torch.float32, 2)
    gens = [torch.Generator().manual_seed(k) for k in range(2)]
    states = [g.get_state() for g in gens]
    global_state = torch.get_rng_state()
    drawn = sde_step(x, v, sigmas, 4, mode=mode, noise_level=eta, generator=gens, backend=backend)
    unseeded = sde_step(x, v, sigmas, 4, mode=mode, noise_level=eta, backend=backend)
    assert all(torch.equal(g.get_state(), st) for g, st in zip(gens, states))
    assert torch.equal(torch.get_rng_state(), global_state)
    given = sde_step(x, v, sigmas, 4, mode=mode, noise_level=eta, noise=noise, backend=backend)
    for out in (drawn, unseeded):
        assert torch.equal(out.prev_sample, given.prev_sample)
        assert torch.equal(out.prev_sample_mean, given.prev_sample_mean)
        assert torch.equal(out.log_prob, torch.zeros_like(out.log_prob))
    assert out.prev_sample.data_ptr() != out.prev_sample_mean.data_ptr()


def test_cps_eta_one_is_finite_everywhere():
    # sigma'^2 - std^2 is 0 up to rounding at eta = 1: it must not turn into sqrt(negative) = NaN
    sigmas, shape = schedule(), (2, 64)
    x, v, noise = (randn(shape, torch.float32, k) for k in range(3))
    for i in range(T):
        out = sde_step(x, v, sigmas, i, mode="cps", noise_level=1.0, noise=noise, backend="torch")
        for t in out:
            assert torch.isfinite(t).all(), i


# ---- the sigma = 1 substitution ------------------------------------------------------------------

@pytest.mark.parametrize("first", [1.0, 1.0 - 2e-6, 0.97])
def test_sde_sigma_one_substitution(first):
    tail = torch.linspace(0.9, 0.0, 10, dtype=torch.float64)
    sigmas = torch.cat([torch.tensor([first], dtype=torch.float64), tail]).float()
    eta = 0.7
    x, v = randn((2, 16), torch.float32, 0), randn((2, 16), torch.float32, 1)
    out = sde_step(x, v, sigmas, 0, mode="sde", noise_level=eta, backend="torch",
                   generator=torch.Generator().manual_seed(0))
    sigma, sigma_1 = float(sigmas[0]), float(sigmas[1])
    d = sigma - sigma_1
    # sigma within fp32 isclose(rtol 1e-5) of 1 reads sigma_t = sigmas[1]; otherwise sigma_t = sigma
    sigma_t = sigma_1 if first != 0.97 else sigma
    expected = eta * math.sqrt(sigma / (1 - sigma_t)) * math.sqrt(d)
    assert math.isfinite(float(out.std_dev[0]))
    torch.testing.assert_close(out.std_dev.double(), torch.full((2,), expected, dtype=torch.float64),
                               rtol=2e-6, atol=0)
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()


# ---- per-sample steps, per-sample generators, batch invariance, determinism ----------------------

def test_per_sample_step_indices():
    sigmas, shape = schedule(), (4, 3, 20, 30)
    x, v, noise = (randn(shape, torch.float32, k) for k in range(3))
    idx = torch.tensor([0, 7, T - 1, 4])
    for mode in MODES:
        eta = ETA[mode]
        out = sde_step(x, v, sigmas, idx, mode=mode, noise_level=eta, noise=noise, backend="torch")
        close(out.log_prob, oracle.log_prob(x, v, out.prev_sample, sigmas, idx, mode, eta), 2e-5, 2e-5, mode)
        close(out.std_dev, oracle.std(sigmas, idx, mode, eta, 4), 2e-5, 0, mode)
        for b in range(4):
            row = sde_step(x[b:b + 1], v[b:b + 1], sigmas, int(idx[b]), mode=mode, noise_level=eta,
                           noise=noise[b:b + 1], backend="torch")
            assert torch.equal(row.prev_sample[0], out.prev_sample[b]), (mode, b)
            assert torch.equal(row.log_prob[0], out.log_prob[b]), (mode, b)
        lp = step_log_prob(x, v, out.prev_sample, sigmas, idx, mode=mode, noise_level=eta, backend="torch")
        assert torch.equal(lp, out.log_prob)


def test_per_sample_generators_make_rows_independent_of_the_batch():
    sigmas, shape = schedule(), (3, 4, 8, 8)
    x, v = randn(shape, torch.float32, 0), randn(shape, torch.float32, 1)
    seeds = [11, 22, 33]
    batch = sde_step(x, v, sigmas, 2, generator=[torch.Generator().manual_seed(s) for s in seeds], backend="torch")
    for b, s in enumerate(seeds):
        alone = sde_step(x[b:b + 1], v[b:b + 1], sigmas, 2, generator=[torch.Generator().manual_seed(s)],
                         backend="torch")
        assert torch.equal(alone.prev_sample[0], batch.prev_sample[b])
        assert torch.equal(alone.log_prob[0], batch.log_prob[b])
        # row b's noise is exactly generator b's draw of one sample's shape
        eps = torch.randn((1,) + shape[1:], generator=torch.Generator().manual_seed(s))
        by_noise = sde_step(x[b:b + 1], v[b:b + 1], sigmas, 2, noise=eps, backend="torch")
        assert torch.equal(by_noise.prev_sample[0], batch.prev_sample[b])
    # reordering the batch (and its generators) reorders the rows, bit for bit
    perm = [2, 0, 1]
    shuffled = sde_step(x[perm], v[perm], sigmas, 2,
                        generator=[torch.Generator().manual_seed(seeds[p]) for p in perm], backend="torch")
    assert torch.equal(shuffled.prev_sample, batch.prev_sample[perm])
    assert torch.equal(shuffled.log_prob, batch.log_prob[perm])


def test_single_generator_draws_the_full_shape():
    sigmas, shape = schedule(), (2, 5, 7)
    x, v = randn(shape, torch.float32, 0), randn(shape, torch.float32, 1)
    a = sde_step(x, v, sigmas, 1, generator=torch.Generator().manual_seed(5), backend="torch")
    eps = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    b = sde_step(x, v, sigmas, 1, noise=eps, backend="torch")
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_invariance_and_run_to_run_determinism(dtype):
    sigmas, shape = schedule(), (5, 2, 40, 33)  # 2640 elements: three chunks, last one partial
    x, v, noise, v_ref = (randn(shape, dtype, k) for k in range(4))
    idx = torch.tensor([1, 5, 9, 0, 5])
    kw = dict(mode="sde", noise_level=0.7, backend="torch")
    full = sde_step(x, v, sigmas, idx, noise=noise, **kw)
    lp = step_log_prob(x, v, full.prev_sample, sigmas, idx, **kw)
    kl = step_kl(x, v, v_ref, sigmas, idx, **kw)
    for _ in range(2):  # same inputs, same bits
        again = sde_step(x, v, sigmas, idx, noise=noise, **kw)
        assert torch.equal(again.prev_sample, full.prev_sample) and torch.equal(again.log_prob, full.log_prob)
        assert torch.equal(step_kl(x, v, v_ref, sigmas, idx, **kw), kl)
    for rows in ([3], [1, 2], [4, 0, 2, 1, 3], [2, 2, 2]):
        sub = sde_step(x[rows], v[rows], sigmas, idx[rows], noise=noise[rows], **kw)
        assert torch.equal(sub.log_prob, full.log_prob[rows]), rows
        assert torch.equal(sub.prev_sample, full.prev_sample[rows]), rows
        sub_lp = step_log_prob(x[rows], v[rows], full.prev_sample[rows], sigmas, idx[rows], **kw)
        assert torch.equal(sub_lp, lp[rows]), rows
        assert torch.equal(step_kl(x[rows], v[rows], v_ref[rows], sigmas, idx[rows], **kw), kl[rows]), rows


# ---- the reduction order -------------------------------------------------------------------------

def tree_sum_f32(values) -> np.float32:
    """The contract's order, written out: zero-pad to a power of two, then repeatedly add the upper
    half onto the lower half (element k with element k + half), all in float32."""
    vals = [np.float32(x) for x in values]
    width = 1
    while width < len(vals):
        width *= 2
    vals += [np.float32(0)] * (width - len(vals))
    while len(vals) > 1:
        half = len(vals) // 2
        vals = [np.float32(vals[k] + vals[k + half]) for k in range(half)]
    return vals[0]


def chunk_sum_f32(chunk) -> np.float32:
    """The contract's chunk order, written out: zero-pad to CHUNK_SIZE, sum each leaf of LEAF_SIZE
    consecutive values by the tree, then the leaf sums by the tree."""
    from flowrl.contract import LEAF_SIZE

    vals = [np.float32(x) for x in chunk] + [np.float32(0)] * (R.CHUNK_SIZE - len(chunk))
    return tree_sum_f32([tree_sum_f32(vals[k:k + LEAF_SIZE]) for k in range(0, R.CHUNK_SIZE, LEAF_SIZE)])


def explicit_order(sq_row) -> np.float32:
    """CHUNK_SIZE chunks, each reduced in the chunk order; then the chunk partials reduced by the tree."""
    c = R.CHUNK_SIZE
    partials = [chunk_sum_f32(sq_row[k:k + c]) for k in range(0, len(sq_row), c)]
    return tree_sum_f32(partials)


def test_chunk_size_is_the_documented_one_and_cuts_the_reduction():
    """docs/contract.md states the chunk size; the reduction cuts samples at exactly that size."""
    from flowrl import contract

    doc = (Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
    assert f"`CHUNK_SIZE` = {contract.CHUNK_SIZE}" in doc
    assert flowrl.CHUNK_SIZE == R.CHUNK_SIZE == contract.CHUNK_SIZE
    assert R.CHUNK_SIZE & (R.CHUNK_SIZE - 1) == 0 and 1024 <= R.CHUNK_SIZE <= 65536
    for n, chunks in ((1, 1), (R.CHUNK_SIZE, 1), (R.CHUNK_SIZE + 1, 2), (3 * R.CHUNK_SIZE, 3)):
        assert R.chunk_partials(torch.ones(2, n)).shape == (2, chunks)


def test_chunk_partials_follow_the_explicit_tree():
    # values of very different magnitudes make float32 sums order-sensitive
    g = torch.Generator().manual_seed(0)
    n = 2 * R.CHUNK_SIZE + 300
    sq = (torch.randn(2, n, generator=g) * torch.logspace(-4, 4, n)) ** 2
    partials = R.chunk_partials(sq)
    assert partials.shape == (2, 3) and partials.dtype == torch.float32
    for b in range(2):
        row = sq[b].numpy()
        for k in range(3):
            chunk = row[k * R.CHUNK_SIZE:(k + 1) * R.CHUNK_SIZE]
            assert partials[b, k].item() == float(chunk_sum_f32(chunk)), (b, k)
    # and a different order would give different bits here, so the check has teeth: a running sum, and
    # the halving tree over the whole chunk (the order before the leaves)
    assert any(float(np.float32(sq[b].numpy().cumsum(dtype=np.float32)[-1])) != float(explicit_order(sq[b].numpy()))
               for b in range(2))
    assert any(float(tree_sum_f32(sq[b, k * R.CHUNK_SIZE:(k + 1) * R.CHUNK_SIZE].numpy())) != partials[b, k].item()
               for b in range(2) for k in range(3))


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13])
def test_combine_partials_follow_the_explicit_tree(p):
    g = torch.Generator().manual_seed(p)
    partials = torch.rand(3, p, generator=g) * torch.logspace(-3, 5, p)
    total = R.combine_partials(partials)
    assert total.shape == (3,)
    for b in range(3):
        assert total[b].item() == float(tree_sum_f32(partials[b].numpy()))


@pytest.mark.parametrize("n", [1, 1000, 1024, 1025, 3 * 1024 + 17])
def test_log_prob_reduces_in_the_contract_order(n):
    # with x = v = 0 the mean is exactly 0, so r = x' exactly and the sq_err sum is minus the
    # explicit-order sum of x'^2, bit for bit
    g = torch.Generator().manual_seed(n)
    prev = torch.randn(2, n, generator=g) * torch.logspace(-3, 3, n)
    zero = torch.zeros(2, n)
    lp = step_log_prob(zero, zero, prev, schedule(), 3, mode="sde", log_prob_kind="sq_err", reduction="sum",
                       backend="torch")
    for b in range(2):
        sq = (prev[b] * prev[b]).numpy()
        assert lp[b].item() == -float(explicit_order(sq))


def test_log_probs_of_the_order_before_the_leaves_recompute_within_float32_rounding():
    """docs/contract.md, Reduction order: a log-prob reduced in the order before the leaves (the halving
    tree over each chunk's 1024 elements, then the partials' tree) recomputes today within float32
    rounding of itself, not bit for bit: both trees are ceil(log2 n) additions deep over nonnegative
    squares, so each sum is within ceil(log2 n) * 2**-24 of the exact one, relative."""
    g = torch.Generator().manual_seed(11)
    n = 3 * R.CHUNK_SIZE + 40
    prev = torch.randn(4, n, generator=g) * torch.logspace(-3, 3, n)
    zero = torch.zeros(4, n)
    lp = step_log_prob(zero, zero, prev, schedule(), 3, mode="sde", log_prob_kind="sq_err", reduction="sum",
                       backend="torch")
    depth = math.ceil(math.log2(R.CHUNK_SIZE)) + math.ceil(math.log2(4))  # the chunk's tree, then 4 partials
    differ = 0
    for b in range(4):
        sq = (prev[b] * prev[b]).numpy()
        c = R.CHUNK_SIZE
        old = tree_sum_f32([tree_sum_f32(list(sq[k:k + c]) + [np.float32(0)] * (c - len(sq[k:k + c])))
                            for k in range(0, n, c)])
        exact = float(np.sum(sq.astype(np.float64)))
        assert abs(float(old) - exact) <= depth * 2.0**-24 * exact
        assert abs(-lp[b].item() - exact) <= depth * 2.0**-24 * exact
        differ += float(old) != -lp[b].item()
    assert differ > 0  # not bit for bit


@pytest.mark.parametrize("kind", KINDS + ("kl",))
def test_shard_invariance_at_a_chunk_boundary(kind):
    """A sample split across two ranks on a chunk boundary: each rank reduces its shard to chunk
    partials, the partials are concatenated in order (the ``gather`` hook), and the log-prob equals
    the single-device one bit for bit."""
    sigmas, i, eta = schedule(), 4, 0.7
    n = 3 * R.CHUNK_SIZE + 123
    cut = 2 * R.CHUNK_SIZE
    x, v, prev, v_ref = (randn((2, n), torch.float32, k) for k in range(4))

    def run(sl, gather=None, numel=None):
        shard = None if gather is None else flowrl.core.step_spec.ShardContext(numel=numel or n, offset=0, gather=gather)
        common = dict(mode="sde", noise_level=eta, reduction="mean", backend="torch", shard=shard)
        if kind == "kl":
            return step_kl(x[:, sl], v[:, sl], v_ref[:, sl], sigmas, torch.tensor([i, i]), **common)
        return step_log_prob(x[:, sl], v[:, sl], prev[:, sl], sigmas, torch.tensor([i, i]), log_prob_kind=kind, **common)

    whole = run(slice(None))
    captured = {}

    def keep(partials):
        captured["tail"] = partials
        return partials

    run(slice(cut, None), gather=keep)  # the second rank's partials
    assert captured["tail"].shape == (2, 2)
    sharded = run(slice(0, cut), gather=lambda head: torch.cat([head, captured["tail"]], dim=1), numel=n)
    assert torch.equal(sharded, whole)


# ---- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", NOISY_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_log_prob_gradients_match_float64_autograd(mode, kind):
    sigmas, shape, eta = schedule(), (2, 3, 9, 11), ETA[mode]
    idx = torch.tensor([0, 6])
    x, v, prev = (randn(shape, torch.float32, k) for k in range(3))
    # prev near the mean so the residuals are of the size a rollout produces
    prev = (oracle.mean(x, v, sigmas, idx, mode, eta) + 0.1 * prev.double()).float()
    leaves32 = [t.clone().requires_grad_(True) for t in (x, v, prev)]
    leaves64 = [t.double().requires_grad_(True) for t in (x, v, prev)]
    for reduction in REDUCTIONS:
        lp32 = step_log_prob(*leaves32, sigmas, idx, mode=mode, noise_level=eta, log_prob_kind=kind,
                             reduction=reduction, backend="torch")
        lp64 = oracle.log_prob(*leaves64, sigmas, idx, mode, eta, kind, reduction)
        weights = torch.tensor([1.0, -2.0])
        g32 = torch.autograd.grad((lp32 * weights).sum(), leaves32)
        g64 = torch.autograd.grad((lp64 * weights.double()).sum(), leaves64)
        for name, a, e in zip(("sample", "model_output", "prev_sample"), g32, g64):
            scale = e.abs().max().item()
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5 * scale, msg=f"{name} {reduction}")


@pytest.mark.parametrize("mode", NOISY_MODES)
def test_kl_value_and_gradient(mode):
    sigmas, shape, eta = schedule(), (3, 4, 10, 10), ETA[mode]
    idx = torch.tensor([0, 5, 8])
    x, v, v_ref = (randn(shape, torch.float32, k) for k in range(3))
    v_ref = v + 0.05 * v_ref  # a reference policy close to the current one, as in training
    leaf32 = v.clone().requires_grad_(True)
    leaf64 = v.double().requires_grad_(True)
    for reduction in REDUCTIONS:
        kl32 = step_kl(x, leaf32, v_ref, sigmas, idx, mode=mode, noise_level=eta, reduction=reduction, backend="torch")
        kl64 = oracle.kl(x, leaf64, v_ref, sigmas, idx, mode, eta, reduction)
        assert (kl32 > 0).all()
        close(kl32, kl64, 1e-4, 0, f"{mode} kl {reduction}")
        (g32,) = torch.autograd.grad(kl32.sum(), leaf32)
        (g64,) = torch.autograd.grad(kl64.sum(), leaf64)
        torch.testing.assert_close(g32.double(), g64, rtol=1e-4, atol=1e-5 * g64.abs().max().item())
    # v == v_ref: exactly 0, and 0 gradient (the minimum)
    kl = step_kl(x, leaf32, v.clone(), sigmas, idx, mode=mode, noise_level=eta, backend="torch")
    assert torch.equal(kl, torch.zeros(3))
    (g,) = torch.autograd.grad(kl.sum(), leaf32)
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("mode", NOISY_MODES)
def test_kl_is_the_log_ratio_at_the_mean(mode):
    """With a shared std, log p_theta(x') - log p_ref(x') at x' = mu_theta is exactly the KL: ties the
    KL to the log-prob's definition across two public functions."""
    sigmas, shape, eta = schedule(), (2, 50), ETA[mode]
    x, v, v_ref = (randn(shape, torch.float64, k) for k in range(3))
    mu = sde_step(x, v, sigmas, 3, mode=mode, noise_level=eta, noise=torch.zeros(shape, dtype=torch.float64),
                  backend="torch").prev_sample_mean
    kw = dict(mode=mode, noise_level=eta, backend="torch")
    for kind in ("gaussian", "kernel"):
        ratio = step_log_prob(x, v, mu, sigmas, 3, log_prob_kind=kind, **kw) - step_log_prob(
            x, v_ref, mu, sigmas, 3, log_prob_kind=kind, **kw)
        torch.testing.assert_close(ratio, step_kl(x, v, v_ref, sigmas, 3, **kw), rtol=1e-10, atol=1e-12)


def test_float64_reference_passes_gradcheck():
    sigmas = schedule()
    x, v, prev, v_ref = (randn((2, 3, 5), torch.float64, k).requires_grad_(True) for k in range(4))
    idx = torch.tensor([0, 7])
    for mode in NOISY_MODES:
        for kind in KINDS:
            f = lambda a, b, c: step_log_prob(a, b, c, sigmas, idx, mode=mode, noise_level=0.5, log_prob_kind=kind,  # noqa: E731
                                              backend="torch")
            assert torch.autograd.gradcheck(f, (x, v, prev))
        g = lambda a, b, c: step_kl(a, b, c, sigmas, idx, mode=mode, noise_level=0.5, backend="torch")  # noqa: E731
        assert torch.autograd.gradcheck(g, (x, v, v_ref))


# ---- tiny noise levels and the rollout's gradient -----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", NOISY_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_level_whose_variance_underflows_gives_finite_log_probs(backend, mode, dtype):
    """noise_level=1e-23: std > 0 but std**2 underflows float32 (it gave 0/0 = NaN). The value divides
    by max(std, STD_FLOOR)**2 (docs/contract.md), equal to the oracle's, and rollout == recompute."""
    from flowrl.contract import STD_FLOOR

    sigmas, shape, idx = schedule(), (3, 50), torch.tensor([0, 4, 8])
    x, v, noise = randn(shape, dtype, 0), randn(shape, dtype, 1), randn(shape, torch.float32, 2)
    out = sde_step(x, v, sigmas, idx, mode=mode, noise_level=1e-23, noise=noise, backend=backend)
    assert bool((out.std_dev > 0).all()) and bool((out.std_dev < STD_FLOOR).all())
    assert bool((out.std_dev * out.std_dev == 0).all())  # the underflow the floor guards against
    # The noise cannot move a float32 sample at this level: r is 0 in float32 and the bf16 rounding
    # error otherwise. The value is the Gaussian of std STD_FLOOR at that residual (a float64 oracle
    # of mu would see mu's own float32 rounding as a residual 1e8 std wide, so it is not the yardstick).
    r = (out.prev_sample.double() - out.prev_sample_mean.double()).reshape(3, -1)
    if dtype == torch.float32:
        assert torch.equal(out.prev_sample, out.prev_sample_mean)
    mean_sq = (r * r).mean(1)
    const = -math.log(STD_FLOOR) - 0.5 * math.log(2 * math.pi)
    want = {"gaussian": -mean_sq / (2 * STD_FLOOR**2) + const, "kernel": -mean_sq / (2 * STD_FLOOR**2),
            "sq_err": -mean_sq}
    for kind in KINDS:
        lp = step_log_prob(x, v, out.prev_sample, sigmas, idx, mode=mode, noise_level=1e-23, log_prob_kind=kind,
                           backend=backend)
        assert bool(torch.isfinite(lp).all()), (kind, lp)
        close(lp.double(), want[kind], 1e-5, 1e-6, f"{kind} at std < STD_FLOOR")
    assert torch.equal(out.log_prob, step_log_prob(x, v, out.prev_sample, sigmas, idx, mode=mode,
                                                   noise_level=1e-23, backend=backend))
    kl = step_kl(x, v, randn(shape, dtype, 3), sigmas, idx, mode=mode, noise_level=1e-23, backend=backend)
    assert bool(torch.isfinite(kl).all()) and bool((kl >= 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["sde", "cps"])
def test_rollout_log_prob_gradient_in_model_output_is_exactly_zero(backend, dtype, mode):
    """d log_prob / d model_output (and d sample) of a rollout step is exactly 0: the rounding of the
    emitted sample is a constant, so r = x' - mu moves with the noise only. Both backends, every
    storage dtype (autograd through the cast used to leave ~1e-5 in bf16 on the torch path); the
    noise gradients of the two backends agree."""
    sigmas, shape, idx = schedule(), (3, 2, 300), torch.tensor([0, 4, 8])
    grads = {}
    for b in ("torch", backend):
        x, v = randn(shape, dtype, 0).requires_grad_(True), randn(shape, dtype, 1).requires_grad_(True)
        noise = randn(shape, torch.float32, 2).requires_grad_(True)
        out = sde_step(x, v, sigmas, idx, mode=mode, noise=noise, backend=b, noise_level=ETA[mode])
        (out.log_prob * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        for t in (x, v):
            assert t.grad is None or torch.equal(t.grad, torch.zeros_like(t.grad)), (b, t.grad.abs().max())
        grads[b] = noise.grad
        assert bool(noise.grad.abs().sum() > 0)
    torch.testing.assert_close(grads[backend], grads["torch"], rtol=1e-5, atol=1e-7)
