"""The Triton backend (flowrl/backends/_triton_ops.py + flowrl.kernels) against the torch reference and a
float64 oracle. Runs under Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET) and
natively on CUDA when present; shapes stay small so the interpreter run is fast."""
import itertools
import os
import subprocess
import sys

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch, _launch, _triton_ops
from flowrl.contract import Mode, NoiseSource, Op, Prediction
from flowrl.core.step_spec import ShardContext

from mode_coverage import every_mode_but, noisy

# every mode but these, each checked against the torch backend elsewhere (a new Mode joins MODES)
MODES_ELSEWHERE = {
    "ddim": "its alpha-bar table, prediction types and clip: tests/ops/test_ddim.py",
    "dpm_sde": "its fixed noise level and second order (prev_x0_pred): tests/ops/test_dpm_sde.py",
    "flash_sde": "sde's kernel path with another std, against Flash-GRPO's formula: tests/ops/test_variants.py",
}
MODES = every_mode_but(MODES_ELSEWHERE)
KINDS = ("gaussian", "kernel", "sq_err")
REDUCTIONS = ("mean", "sum")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
T = 10
# triton vs the torch path in the same storage dtype, (rtol, atol) on the value [B]. Both compute in
# float32 from the same stored values; in half precision a 1-ulp difference of mu can flip the
# rounding of one emitted element, which moves the log-prob by ~ulp * |r| / var / N.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not _dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def schedule(device, shift=3.0):
    """A shifted flow-matching schedule as diffusers builds it: sigmas[0] = 1, sigmas[T] = 0."""
    t = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.float32).to(device)


def eta_for(mode):
    return 0.8 if mode == "cps" else 0.7


def inputs(shape, dtype, device, seed=0, third="prev"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    v = torch.randn(shape, generator=g).to(dtype).to(device)
    other = torch.randn(shape, generator=g)
    if third == "prev":  # a plausible stored next sample: near x
        other = x.float().cpu() + 0.3 * other
    return x, v, other.to(dtype).to(device)


def steps_for(batch, device):
    """First, middle and last step across the batch (per-sample step index tensor)."""
    return torch.tensor([(0, T // 2, T - 1)[k % 3] for k in range(batch)], device=device)


def f64(*ts):
    return [t.double() for t in ts]


def assert_no_worse(value, torch_value, oracle, what):
    """Error vs the float64 oracle at most 2x the torch path's error in the same dtype, plus a tiny floor."""
    err = (value.double() - oracle).abs()
    torch_err = (torch_value.double() - oracle).abs()
    floor = 2e-6 * (1 + oracle.abs())
    assert bool((err <= 2 * torch_err + floor).all()), f"{what}: err {err.tolist()} vs torch {torch_err.tolist()}"


def assert_close_dtype(value, expected, dtype, what):
    rtol, atol = TOL[dtype]
    scale = 1 + expected.abs()
    assert bool(((value - expected).abs() <= atol * scale + rtol * expected.abs()).all()), (
        f"{what}: {value.tolist()} vs {expected.tolist()}")


def assert_within_one_ulp(got, expected):
    finfo = torch.finfo(expected.dtype)
    g, e = got.double(), expected.double()
    # the spacing of floats near y is at most eps * |y|
    ulp = finfo.eps * torch.maximum(g.abs(), e.abs()) + finfo.tiny
    assert bool(((g - e).abs() <= ulp).all()), f"max diff {(g - e).abs().max().item()}"


# ------------------------------------------------------------------------------- forward accuracy


def check_all_ops(shape, dtype, device, mode, kind, reduction, step_index, seed=0, check_kl=True):
    sigmas = schedule(device)
    eta = eta_for(mode)
    x, v, noise = inputs(shape, dtype, device, seed, third="noise")
    common = dict(mode=mode, noise_level=eta)

    # sde_step: the emitted sample within 1 ulp of the reference's, its log-prob vs the float64
    # log-prob of that same emitted sample
    out = flowrl.sde_step(x, v, sigmas, step_index, noise=noise, log_prob_kind=kind, reduction=reduction,
                          backend="triton", **common)
    ref = flowrl.sde_step(x, v, sigmas, step_index, noise=noise, log_prob_kind=kind, reduction=reduction,
                          backend="torch", **common)
    assert out.prev_sample.dtype == dtype and out.prev_sample.shape == x.shape
    assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (shape[0],)
    assert out.prev_sample_mean.dtype == torch.float32
    assert_within_one_ulp(out.prev_sample, ref.prev_sample)
    torch.testing.assert_close(out.prev_sample_mean, ref.prev_sample_mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out.std_dev, ref.std_dev, rtol=1e-6, atol=0)
    assert_close_dtype(out.log_prob, ref.log_prob, dtype, "sde_step log_prob vs torch")
    oracle = flowrl.step_log_prob(*f64(x, v, out.prev_sample), sigmas, step_index, log_prob_kind=kind,
                                  reduction=reduction, backend="torch", **common)
    torch_oracle = flowrl.step_log_prob(*f64(x, v, ref.prev_sample), sigmas, step_index, log_prob_kind=kind,
                                        reduction=reduction, backend="torch", **common)
    err, torch_err = (out.log_prob.double() - oracle).abs(), (ref.log_prob.double() - torch_oracle).abs()
    assert bool((err <= 2 * torch_err + 2e-6 * (1 + oracle.abs())).all()), (err, torch_err)

    # step_log_prob of a stored sample
    _, _, prev = inputs(shape, dtype, device, seed + 1)
    lp = flowrl.step_log_prob(x, v, prev, sigmas, step_index, log_prob_kind=kind, reduction=reduction,
                              backend="triton", **common)
    lp_ref = flowrl.step_log_prob(x, v, prev, sigmas, step_index, log_prob_kind=kind, reduction=reduction,
                                  backend="torch", **common)
    lp64 = flowrl.step_log_prob(*f64(x, v, prev), sigmas, step_index, log_prob_kind=kind, reduction=reduction,
                                backend="torch", **common)
    assert_close_dtype(lp, lp_ref, torch.float32, "step_log_prob vs torch")
    assert_no_worse(lp, lp_ref, lp64, "step_log_prob vs float64")

    if check_kl:
        _, _, v_ref = inputs(shape, dtype, device, seed + 2, third="noise")
        kl = flowrl.step_kl(x, v, v_ref, sigmas, step_index, reduction=reduction, backend="triton", **common)
        kl_ref = flowrl.step_kl(x, v, v_ref, sigmas, step_index, reduction=reduction, backend="torch", **common)
        kl64 = flowrl.step_kl(*f64(x, v, v_ref), sigmas, step_index, reduction=reduction, backend="torch", **common)
        assert_close_dtype(kl, kl_ref, torch.float32, "step_kl vs torch")
        assert_no_worse(kl, kl_ref, kl64, "step_kl vs float64")
        assert bool((kl >= 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_full_matrix_small_shape(device, mode, kind, reduction, dtype):
    """Every mode x kind x reduction x dtype; the batch spans the first, middle and last step."""
    check_all_ops((3, 3, 5, 7), dtype, device, mode, kind, reduction, steps_for(3, device),
                  check_kl=kind == "gaussian")


@pytest.mark.parametrize("shape,mode,kind,reduction,dtype,step", [
    ((2, 3, 5, 7), "sde", "gaussian", "mean", torch.float32, 0),
    ((1, 1), "dance", "kernel", "sum", torch.bfloat16, T - 1),
    ((3, 2, 3, 4, 5), "cps", "sq_err", "mean", torch.float16, None),
    ((2, 1100), "sde", "gaussian", "sum", torch.bfloat16, None),       # crosses a chunk boundary
    ((2, 2048 + 3), "cps", "gaussian", "mean", torch.float32, T // 2),  # 3 chunks, last one ragged
    ((3, 7, 11), "dance", "sq_err", "sum", torch.float32, None),        # [B, S, C]
], ids=str)
def test_odd_shapes(device, shape, mode, kind, reduction, dtype, step):
    step_index = steps_for(shape[0], device) if step is None else step
    check_all_ops(shape, dtype, device, mode, kind, reduction, step_index, seed=3)


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_inputs_match_the_reference(device, kind):
    """Transposed and strided views (what a pipeline's permute or slice hands over): the kernels'
    values and grads against the torch reference on the same views, and the emitted sample."""
    sigmas = schedule(device)
    x, v, prev = inputs((4, 6, 8), torch.float32, device, 5)
    x, v, prev = (t.transpose(1, 2) for t in (x, v, prev))
    _, _, noise = inputs((4, 8, 12), torch.float32, device, 6, third="noise")
    noise = noise[:, :, ::2]  # strided
    assert not (x.is_contiguous() or v.is_contiguous() or prev.is_contiguous() or noise.is_contiguous())
    for backend_out in (("triton", "torch"),):
        outs = {b: _grads(lambda a, m, p: flowrl.step_log_prob(a, m, p, sigmas, steps_for(4, device), log_prob_kind=kind,
                                                                 backend=b), (x, v, prev)) for b in backend_out}
    (lp, grads), (lp_ref, grads_ref) = outs["triton"], outs["torch"]
    torch.testing.assert_close(lp, lp_ref, rtol=2e-5, atol=2e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    step = flowrl.sde_step(x, v, sigmas, 3, noise=noise, log_prob_kind=kind, backend="triton")
    step_ref = flowrl.sde_step(x, v, sigmas, 3, noise=noise, log_prob_kind=kind, backend="torch")
    assert_within_one_ulp(step.prev_sample, step_ref.prev_sample)
    assert_close_dtype(step.log_prob, step_ref.log_prob, torch.float32, "non-contiguous sde_step")


def test_float64_is_refused(device):
    sigmas = schedule(device)
    x, v, prev = inputs((2, 4), torch.float64, device)
    with pytest.raises(TypeError, match="float64"):
        flowrl.step_log_prob(x, v, prev, sigmas, 1, backend="triton")


# ------------------------------------------------------------------------------------- gradients


def _grads(fn, tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    weights = torch.linspace(0.5, 1.5, out.shape[0], device=out.device)
    (out * weights).sum().backward()
    return out, [t.grad for t in tensors]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS + ("kl",))
@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_reference_autograd(device, mode, kind, reduction):
    sigmas = schedule(device)
    shape = (3, 1100)
    step_index = steps_for(3, device)
    x, v, third = inputs(shape, torch.float32, device, 7, third="noise" if kind == "kl" else "prev")
    common = dict(mode=mode, noise_level=eta_for(mode), reduction=reduction)
    if kind == "kl":
        def run(backend):
            return lambda a, b, c: flowrl.step_kl(a, b, c, sigmas, step_index, backend=backend, **common)
    else:
        def run(backend):
            return lambda a, b, c: flowrl.step_log_prob(a, b, c, sigmas, step_index, log_prob_kind=kind,
                                                        backend=backend, **common)
    out, grads = _grads(run("triton"), (x, v, third))
    out_ref, grads_ref = _grads(run("torch"), (x, v, third))
    torch.testing.assert_close(out, out_ref, rtol=2e-5, atol=2e-5)
    for name, g, g_ref in zip(("sample", "model_output", "third"), grads, grads_ref):
        if kind == "kl" and name == "sample":  # mu - mu_ref = c v - c v_ref: no x in the graph
            assert g is None and g_ref is None
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7, msg=f"grad of {name}")


def test_backward_half_precision_grads_keep_input_dtype(device):
    sigmas = schedule(device)
    x, v, prev = inputs((2, 300), torch.bfloat16, device, 8)
    fn = lambda backend: lambda a, b, c: flowrl.step_log_prob(a, b, c, sigmas, 4, backend=backend)  # noqa: E731
    _, grads = _grads(fn("triton"), (x, v, prev))
    _, grads_ref = _grads(fn("torch"), (x, v, prev))
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.bfloat16
        assert_within_one_ulp(g, g_ref)


def test_backward_only_requested_grads(device):
    sigmas = schedule(device)
    x, v, prev = inputs((2, 50), torch.float32, device, 9)
    v = v.clone().requires_grad_(True)
    flowrl.step_log_prob(x, v, prev, sigmas, 2, backend="triton").sum().backward()
    assert v.grad is not None and x.grad is None and prev.grad is None


@pytest.mark.parametrize("mode,eta,step", [("ode", 0.7, 3), ("cps", 0.8, T - 1), ("sde", 0.0, 3), ("dance", 0.0, 0)])
@pytest.mark.parametrize("kind", KINDS + ("kl",))
def test_deterministic_steps_have_zero_value_and_grad(device, mode, eta, step, kind):
    sigmas = schedule(device)
    x, v, third = inputs((2, 40), torch.float32, device, 10)
    x, v, third = (t.clone().requires_grad_(True) for t in (x, v, third))
    if kind == "kl":
        out = flowrl.step_kl(x, v, third, sigmas, step, mode=mode, noise_level=eta, backend="triton")
    else:
        out = flowrl.step_log_prob(x, v, third, sigmas, step, mode=mode, noise_level=eta, log_prob_kind=kind,
                                   backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in (x, v, third):
        if kind == "kl" and t is x:
            assert t.grad is None  # the KL does not depend on x
            continue
        assert torch.equal(t.grad, torch.zeros_like(t.grad))


def test_sde_step_backward_matches_reference(device):
    """Grads of prev_sample, log_prob and mean w.r.t. sample, model_output and noise."""
    sigmas = schedule(device)
    step_index = steps_for(3, device)
    x, v, noise = inputs((3, 130), torch.float32, device, 11, third="noise")

    def run(backend):
        def fn(a, b, n):
            out = flowrl.sde_step(a, b, sigmas, step_index, noise=n, backend=backend)
            w = torch.linspace(-1, 1, a.numel(), device=a.device).reshape(a.shape)
            return out.log_prob * 3 + (out.prev_sample * w).flatten(1).sum(1) + out.prev_sample_mean.flatten(1).sum(1)
        return fn
    out, grads = _grads(run("triton"), (x, v, noise))
    out_ref, grads_ref = _grads(run("torch"), (x, v, noise))
    torch.testing.assert_close(out, out_ref, rtol=2e-5, atol=2e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- bit-for-bit contracts


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", noisy(MODES))  # mode_coverage.DETERMINISTIC: a log-prob of exactly 0
def test_rollout_log_prob_equals_recompute_bitwise(device, mode, dtype):
    sigmas = schedule(device)
    step_index = steps_for(3, device)
    x, v, noise = inputs((3, 1100), dtype, device, 12, third="noise")
    for kind, reduction in (("gaussian", "mean"), ("sq_err", "sum")):
        out = flowrl.sde_step(x, v, sigmas, step_index, mode=mode, noise_level=eta_for(mode), noise=noise,
                              log_prob_kind=kind, reduction=reduction, backend="triton")
        lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, step_index, mode=mode, noise_level=eta_for(mode),
                                  log_prob_kind=kind, reduction=reduction, backend="triton")
        assert torch.equal(out.log_prob, lp), (out.log_prob, lp)


def test_batch_invariance_and_run_to_run(device):
    sigmas = schedule(device)
    x, v, prev = inputs((5, 3, 700), torch.bfloat16, device, 13)
    _, _, v_ref = inputs((5, 3, 700), torch.bfloat16, device, 14, third="noise")
    step_index = torch.tensor([1, 7, 0, 9, 4], device=device)
    lp = flowrl.step_log_prob(x, v, prev, sigmas, step_index, backend="triton")
    kl = flowrl.step_kl(x, v, v_ref, sigmas, step_index, backend="triton")
    assert torch.equal(lp, flowrl.step_log_prob(x, v, prev, sigmas, step_index, backend="triton"))
    assert torch.equal(kl, flowrl.step_kl(x, v, v_ref, sigmas, step_index, backend="triton"))
    for pos in (0, 2, 4):  # the same row alone gives the same bits as inside the batch
        row = slice(pos, pos + 1)
        alone = flowrl.step_log_prob(x[row], v[row], prev[row], sigmas, step_index[row], backend="triton")
        assert torch.equal(alone, lp[row])
        alone_kl = flowrl.step_kl(x[row], v[row], v_ref[row], sigmas, step_index[row], backend="triton")
        assert torch.equal(alone_kl, kl[row])


def test_gather_identity_and_sharded_partials(device):
    """gather=identity equals no gather; two shards cut on a chunk boundary, exchanging partials,
    reproduce the unsharded value bit for bit, and their backward grads concatenate to the full grads."""
    sigmas = schedule(device)
    n = 2 * flowrl.CHUNK_SIZE + 500
    x, v, prev = inputs((2, n), torch.float32, device, 15)
    step_index = steps_for(2, device)
    full = flowrl.step_log_prob(x, v, prev, sigmas, step_index, backend="triton")
    same = flowrl.step_log_prob(x, v, prev, sigmas, step_index, backend="triton",
                                shard=ShardContext(numel=n, offset=0, gather=lambda p: p))
    assert torch.equal(full, same)

    cut = 2 * flowrl.CHUNK_SIZE
    shards = [(slice(None), slice(0, cut)), (slice(None), slice(cut, n))]
    second = {}

    def keep(p):
        second["partials"] = p
        return p
    vs = [v[s].clone().requires_grad_(True) for s in shards]
    def on_shard(k, gather):
        shard = ShardContext(numel=n, offset=cut * k, gather=gather)
        return flowrl.step_log_prob(x[shards[k]], vs[k], prev[shards[k]], sigmas, step_index, backend="triton",
                                    shard=shard)
    on_shard(1, keep)
    lp0 = on_shard(0, lambda p: torch.cat([p, second["partials"]], dim=1))
    assert torch.equal(lp0, full)
    # backward: each rank uses the same incoming grad and the global numel
    lp1 = on_shard(1, lambda p: torch.cat([second["partials"].new_zeros(2, 2), p], dim=1))
    lp0.sum().backward()
    lp1.sum().backward()
    v_full = v.clone().requires_grad_(True)
    flowrl.step_log_prob(x, v_full, prev, sigmas, step_index, backend="triton").sum().backward()
    assert torch.equal(torch.cat([vs[0].grad, vs[1].grad], dim=1), v_full.grad)


@pytest.mark.slow
@pytest.mark.parametrize("group,num_warps", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_every_launch_config_gives_the_same_bits(device, monkeypatch, group, num_warps):
    """How many chunks a program covers and how many warps it has change no bit: rollout (torch noise,
    Philox aligned and not), recompute, KL and every backward grad, against the default table."""
    sigmas = schedule(device)
    n = 5 * flowrl.CHUNK_SIZE + 37  # 6 chunks: a partial last block for every group size
    x, v, noise = inputs((3, n), torch.bfloat16, device, 21, third="noise")
    _, _, v_ref = inputs((3, n), torch.bfloat16, device, 22, third="noise")
    step = steps_for(3, device)

    def run():
        outs = []
        out = flowrl.sde_step(x, v, sigmas, step, noise=noise, backend="triton")
        outs += [out.prev_sample, out.log_prob, out.prev_sample_mean]
        out = flowrl.sde_step(x, v, sigmas, step, noise_seed=7, backend="triton")
        outs += [out.prev_sample, out.log_prob]
        shard = ShardContext(numel=n + 2, offset=2, gather=lambda p: p)  # Philox from an unaligned offset
        outs.append(flowrl.sde_step(x, v, sigmas, step, noise_seed=7, backend="triton", shard=shard).prev_sample)
        leaves = [t.clone().requires_grad_(True) for t in (x, v, out.prev_sample)]
        lp = flowrl.step_log_prob(*leaves, sigmas, step, backend="triton")
        lp.sum().backward()
        outs += [lp, *(t.grad for t in leaves)]
        vk = v.clone().requires_grad_(True)
        kl = flowrl.step_kl(x, vk, v_ref, sigmas, step, backend="triton")
        kl.sum().backward()
        return outs + [kl, vk.grad]

    want = run()
    monkeypatch.setattr(_launch, "launch_config", lambda n_per_sample, unaligned_philox=False, table=None: (group, num_warps))
    got = run()
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("n,dtype", [(8 * 1024, torch.bfloat16),
                                     pytest.param(8 * 1024 + 16, torch.float16, marks=pytest.mark.slow)])  # ~3 s
def test_multi_tile_programs_give_the_same_bits(device, monkeypatch, n, dtype):
    """Aligned 16-bit latents above 4,096 elements per sample run STEP_LAUNCH_TABLE's 4 chunks per
    one-warp program in 4 static tiles, on whole blocks (EVEN, 8,192) or masked (8,208): rollout
    (torch noise with the mean, Philox), recompute, KL and every backward grad give the one-tile
    launch's bits."""
    sigmas = schedule(device)
    x, v, noise = inputs((2, n), dtype, device, 23, third="noise")
    _, _, v_ref = inputs((2, n), dtype, device, 24, third="noise")
    step = steps_for(2, device)
    spec = type("Spec", (), {"elementwise": False, "mode": Mode.SDE, "op": Op.LOG_PROB})
    group, warps = _triton_ops.step_config(spec, n, (x, v))
    assert (group, warps) == (4, 1)
    assert _triton_ops.step_switches(group, warps, n, accessed=(x, v)) == dict(TILES=4, EVEN=n % 4096 == 0, maxnreg=128)
    launches = []
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        launches.append((kwargs.get("GROUP", kwargs.get("BLOCK", 0) // 1024), kwargs.get("TILES")))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)

    def run():
        out = flowrl.sde_step(x, v, sigmas, step, noise=noise, backend="triton")
        philox = flowrl.sde_step(x, v, sigmas, step, noise_seed=5, backend="triton")
        leaves = [t.clone().requires_grad_(True) for t in (x, v, out.prev_sample)]
        lp = flowrl.step_log_prob(*leaves, sigmas, step, backend="triton")
        lp.sum().backward()
        vk = v.clone().requires_grad_(True)
        kl = flowrl.step_kl(x, vk, v_ref, sigmas, step, backend="triton")
        kl.sum().backward()
        return [out.prev_sample, out.log_prob, out.prev_sample_mean, philox.prev_sample, philox.log_prob, lp,
                *(t.grad for t in leaves), kl, vk.grad]

    want = run()
    assert (4, 4) in launches  # the recompute's forward at least ran 4 tiles
    launches.clear()
    monkeypatch.setattr(_launch, "STEP_LAUNCH_TABLE", _launch.LAUNCH_TABLE)  # one tile everywhere
    got = run()
    assert {tiles for _, tiles in launches if tiles is not None} == {1}
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k


# ~8-10 s each through the interpreter (ddim's): the quick loop keeps dpm_sde's (4 s), the full suite all
@pytest.mark.parametrize("opts,n", [pytest.param(dict(mode="ddim", prediction_type="epsilon", clip_sample_range=1.0),
                                                 8 * 1024, marks=pytest.mark.slow),
                                    pytest.param(dict(mode="ddim", prediction_type="epsilon"), 8 * 1024,  # DDPO's (SD's config)
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(mode="ddim", prediction_type="sample", clip_sample_range=1.5), 8 * 1024,
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(mode="ddim", prediction_type="v_prediction"), 8 * 1024,
                                                 marks=pytest.mark.slow),
                                    pytest.param(dict(mode="ddim", prediction_type="epsilon", clip_sample_range=1.0),
                                                 8 * 1024 + 16, marks=pytest.mark.slow),
                                    (dict(mode="dpm_sde", noise_level=1.0), 8 * 1024)])
def test_multi_tile_ddim_and_second_order_kl_give_the_same_bits(device, monkeypatch, opts, n):
    """ddim's log-prob, rollouts (their divisions through common.div_rn_by_scalar; drawing Philox noise,
    each tile in four parts: kernels/step.py's step_partials_kernel PARTS), KL and their backward (ddim's
    gaussian and clipped-KL backward in four parts per tile: step_backward_kernel's PARTS) and
    dpm_sde's second-order KL backward
    (its x0_prev terms cancel: not read) run 4 tiles on aligned 16-bit latents of 8,192 elements, and
    masked at 8,208 (where ddim's rollouts keep one tile): the same bits as the one-tile launch."""
    ddim = opts["mode"] == "ddim"
    x, v, noise = inputs((3, n), torch.bfloat16, device, 41, third="noise")
    _, v_ref, prev_x0 = inputs((3, n), torch.bfloat16, device, 42, third="noise")
    if ddim:
        sigmas, step = torch.tensor([0.5, 0.7, 0.7, 0.9, 0.9, 0.95], device=device), torch.tensor([0, 1, 2], device=device)
        extra = {}
    else:
        sigmas, step, extra = schedule(device), torch.tensor([1, T // 2, T - 1], device=device), dict(prev_x0_pred=prev_x0)
    launches = []
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        launches.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel),
                         kwargs.get("IS_KL", kwargs.get("OP") == int(Op.KL)), kwargs.get("TILES"),
                         kwargs.get("NOISE") == int(NoiseSource.PHILOX)))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)

    def run():
        out = flowrl.sde_step(x, v, sigmas, step, noise=noise, backend="triton", **opts, **extra)
        leaves = [t.clone().requires_grad_(True) for t in (x, v, out.prev_sample)]
        lp = flowrl.step_log_prob(*leaves, sigmas, step, backend="triton", **opts, **extra)
        lp.sum().backward()
        vk = v.clone().requires_grad_(True)
        kl = flowrl.step_kl(x, vk, v_ref, sigmas, step, backend="triton", **opts, **extra)
        kl.sum().backward()
        outs = [out.prev_sample, out.log_prob, out.prev_sample_mean, lp, *(t.grad for t in leaves), kl, vk.grad]
        philox = flowrl.sde_step(x, v, sigmas, step, noise_seed=7, return_prev_sample_mean=False, backend="triton",
                                 **opts, **extra)
        outs += [philox.prev_sample, philox.log_prob]
        if ddim:  # eta = 0: no noise, the mean rounded
            outs.append(flowrl.sde_step(x, v, sigmas, step, backend="triton", **dict(opts, noise_level=0.0)).prev_sample)
        return outs

    want = run()
    tiled = {(name, is_kl) for name, is_kl, tiles, _ in launches if tiles == 4}
    philox_tiles = {tiles for name, _, tiles, philox in launches if philox}
    if ddim:  # every ddim step kernel takes tiles (the backward's and the Philox rollout's in parts)
        assert tiled == {(kernel, is_kl) for kernel in ("step_partials_kernel", "step_backward_kernel")
                         for is_kl in (False, True)}
        assert philox_tiles == ({4} if n % 4096 == 0 else {1})
    else:
        assert ("step_backward_kernel", True) in tiled and ("step_backward_kernel", False) not in tiled
        assert philox_tiles == {1}  # dpm_sde's second-order Philox rollout keeps one tile
    launches.clear()
    monkeypatch.setattr(_launch, "STEP_LAUNCH_TABLE", _launch.LAUNCH_TABLE)  # one tile everywhere
    got = run()
    assert {tiles for _, _, tiles, _ in launches if tiles is not None} == {1}
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k


def test_philox_rollouts_launch_under_the_register_cap(device, monkeypatch):
    """A one-tile rollout drawing Philox noise launches under maxnreg 128 (issue 21; unbounded, ptxas took
    up to 132 registers with triton 3.6), as flowrl/tools/aot compiles it (register_cap); ddim's does not
    (its sample-clip rollout spills under the cap), nor a rollout reading its noise or over float32
    latents."""
    caps = {}
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        if "NOISE" in kwargs:
            caps[Mode(kwargs["MODE"]), NoiseSource(kwargs["NOISE"])] = kwargs.get("maxnreg")
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)
    x, v, noise = inputs((2, 1024), torch.bfloat16, device, 3, third="noise")
    flowrl.sde_step(x, v, schedule(device), steps_for(2, device), noise_seed=5, backend="triton")
    flowrl.sde_step(x, v, schedule(device), steps_for(2, device), noise=noise, backend="triton")
    table = torch.tensor([0.5, 0.7, 0.7, 0.9], device=device)  # ddim's alpha-bar pairs
    flowrl.sde_step(x, v, table, 0, noise_seed=5, mode="ddim", backend="triton")
    assert caps == {(Mode.SDE, NoiseSource.PHILOX): 128, (Mode.SDE, NoiseSource.TENSOR): None,
                    (Mode.DDIM, NoiseSource.PHILOX): None}
    caps.clear()  # float32 latents: theirs spill under the cap
    flowrl.sde_step(x.float(), v.float(), schedule(device), steps_for(2, device), noise_seed=5, backend="triton")
    assert caps == {(Mode.SDE, NoiseSource.PHILOX): None}


def test_the_aot_compile_takes_the_launchers_configurations():
    """flowrl/tools/aot compiles each step specialization at the launcher's (chunks per program, warps)
    (``launches._step_config`` against ``_triton_ops.step_config``) for aligned 16-bit latents, whole and
    masked, every mode, op, noise source, mean switch and second order (an argument shift once made it
    count dpm_sde's second-order forward at one tile, where the launcher runs 4)."""
    from flowrl.tools.aot import launches

    cases = itertools.product((("bf16", torch.bfloat16), ("fp16", torch.float16)), (8 * 1024, 8 * 1024 + 16), Mode,
                              Op, (False, True), NoiseSource, (False, True), (False, True))
    for (storage, dtype), n, mode, op, backward, noise, write_mean, prev in cases:
        rollout = op is Op.ROLLOUT and not backward
        if (not rollout and (noise is not NoiseSource.TENSOR or write_mean)) or (prev and mode is not Mode.DPM_SDE):
            continue  # noise sources and the mean are a rollout's; x0_prev is dpm_sde's
        # the launchers' second order: not for the KL's backward (x0_prev cancels)
        second_order = prev and not (op is Op.KL and backward)
        x = torch.zeros(2, n, dtype=dtype)
        spec = type("Spec", (), {"elementwise": False, "mode": mode, "op": op, "noise_source": noise})
        want = _triton_ops.step_config(spec, n, (x, x, None, x, None), (None, x.float() if write_mean else None),
                                       backward=backward, second_order=second_order, write_mean=write_mean)
        philox = noise is NoiseSource.PHILOX
        got = launches._step_config(storage, backward=backward, masked_rollout=rollout and n % 4096 != 0,
                                    second_order=second_order, philox=philox, philox_mean=philox and write_mean)
        assert tuple(got) == tuple(want), (storage, n, mode, op, backward, noise, write_mean, second_order)


def test_philox_rollouts_take_tiles_where_they_compile_without_spills():
    """tiles_taken: a rollout drawing Philox noise over 16-bit latents runs 4 tiles above 4,096
    elements (its latents load after the noise, behind a barrier; ddim's in four parts per tile); in
    dpm_sde's second order or writing its mean it keeps one tile (at 4 tiles those spill 8-64 bytes:
    flowrl/tools/aot's compile, docs/kernels.md), as flowrl/tools/aot's hot specializations assume."""
    n = 8 * 1024

    def config(mode, dtype, write_mean=False, second_order=False):
        spec = type("Spec", (), {"elementwise": False, "mode": mode, "op": Op.ROLLOUT,
                                 "noise_source": NoiseSource.PHILOX})
        x = torch.zeros(2, n, dtype=dtype)
        return _triton_ops.step_config(spec, n, (x, x, None, x, None), (None, x.float() if write_mean else None),
                                       write_mean=write_mean, second_order=second_order)

    tiled, one = (4, 1), _triton_ops.LAUNCH_TABLE[-1][1:]
    for mode in (Mode.SDE, Mode.ODE, Mode.DANCE, Mode.CPS, Mode.FLASH_SDE, Mode.DPM_SDE):
        assert config(mode, torch.bfloat16) == tiled, mode
        assert config(mode, torch.float16) == tiled, mode
        assert config(mode, torch.bfloat16, write_mean=True) == one, mode
    assert config(Mode.DDIM, torch.bfloat16) == tiled and config(Mode.DDIM, torch.float16) == tiled
    assert config(Mode.DDIM, torch.bfloat16, write_mean=True) == one
    assert config(Mode.DPM_SDE, torch.bfloat16, second_order=True) == one
    from flowrl.tools import aot

    for storage in ("bf16", "fp16"):
        labels = {s.label for s in aot.hot_specializations(storage)}
        assert {"sde rollout noise=philox g4w1 even", "dpm_sde rollout noise=philox g4w1 even",
                "ddim[epsilon] rollout noise=philox g4w1 even",
                "sde rollout noise=philox +mean g1w1 even", "dpm_sde 2nd-order rollout noise=philox g1w1 even"} <= labels
        assert not {"sde rollout noise=philox g1w1 even", "sde rollout noise=philox +mean g4w1 even"} & labels


def test_block_division_and_ranges_are_checked_on_the_host():
    """The loss kernels' sample index is pid // n_blocks by division_magic's multiply-high and shift
    (exact for every program id below 2**31); samples past MAX_SAMPLE_ELEMENTS (32-bit in-sample
    offsets) and Philox draws past the uint32 quad counters are refused with a ValueError."""
    for d in list(range(1, 600)) + [2**20 - 1, 2**20, 2**20 + 1, 3**19, 2**31 - 1]:
        m, l = _triton_ops.division_magic(d)
        assert 2**31 <= m < 2**32
        for pid in {0, 1, d - 1, d, d + 1, 7 * d + 3, 2**31 - 1, 2**31 - 2, (2**31 - 1) // d * d}:
            assert ((2 * pid * m) >> 32) >> l == pid // d, (d, pid)
    with pytest.raises(ValueError, match="divisor"):
        _triton_ops.division_magic(0)
    big = torch.zeros(1, 1).expand(2, _triton_ops.MAX_SAMPLE_ELEMENTS + 1)
    with pytest.raises(ValueError, match="32 bits"):
        _triton_ops._rows_shape(big)
    assert _triton_ops._rows_shape(torch.zeros(1, 1).expand(3, _triton_ops.MAX_SAMPLE_ELEMENTS)) == (
        3, _triton_ops.MAX_SAMPLE_ELEMENTS)
    _triton_ops.check_philox_range(2**32 - 2**17, 2**16)
    for offset, n in ((2**32 - 2**17, 2**16 + 1), (-4, 8), (2**33, 8)):
        with pytest.raises(ValueError, match="elem_offset"):
            _triton_ops.check_philox_range(offset, n)


def test_the_launchers_refuse_what_their_index_math_cannot_reach(monkeypatch):
    """Every Triton launcher runs the host checks above, end to end: with the limits lowered
    (MAX_SAMPLE_ELEMENTS, PHILOX_ELEMENTS, MAX_TABLE_TOKENS), a step, its backward, the GRPO family's
    replayed mu_old, DPO's drawn noise and a per-token table past them raise a ValueError naming what
    is too large, where the same calls run under the real limits."""
    from flowrl import losses as L

    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(2, 3, 100, generator=g) for _ in range(3))  # 300 elements per sample
    sigmas, steps = torch.tensor([1.0, 0.7, 0.4, 0.0]), torch.tensor([1, 2])
    seeded = flowrl.sde_step(x, v, sigmas, steps, noise_seed=5, backend="triton")
    adv = torch.tensor([0.5, -0.5])
    token_sigmas = torch.tensor([[0.7, 0.7, 0.4], [0.4, 0.7, 0.7]]).reshape(2, 3, 1)
    calls = {
        "step": lambda: flowrl.sde_step(x, v, sigmas, steps, noise=v_ref, backend="triton"),
        "philox": lambda: flowrl.sde_step(x, v, sigmas, steps, noise_seed=5, backend="triton"),
        "replay": lambda: L.grpo_guard_loss(x, v, seeded.prev_sample, sigmas, steps, old_log_prob=seeded.log_prob,
                                            advantages=adv,
                                            noise_seed=5, clip_range=0.2, backend="triton"),
        "dpo": lambda: L.dpo_loss(v, v_ref, None, x, beta=1.0, noise_seed=3, backend="triton"),
        "tokens": lambda: flowrl.step_log_prob(x, v, seeded.prev_sample, sigmas, steps, token_sigmas=token_sigmas,
                                               backend="triton"),
    }
    for call in calls.values():
        call()
    lp = flowrl.step_log_prob(x, v.clone().requires_grad_(), seeded.prev_sample, sigmas, steps, backend="triton")
    with monkeypatch.context() as m:
        m.setattr(_triton_ops, "MAX_SAMPLE_ELEMENTS", 299)
        for run in (calls["step"], lambda: lp.sum().backward()):  # the forward ran under the real limit
            with pytest.raises(ValueError, match="samples of at most 299 elements"):
                run()
    for name in ("philox", "replay", "dpo"):
        with monkeypatch.context() as m:
            m.setattr(_triton_ops, "PHILOX_ELEMENTS", 299)
            with pytest.raises(ValueError, match="Philox noise for elements below 299"):
                calls[name]()
    with monkeypatch.context() as m:
        m.setattr(_triton_ops, "MAX_TABLE_TOKENS", 2)
        with pytest.raises(ValueError, match="token_sigmas: .* at most 2 tokens per sample; got 3"):
            calls["tokens"]()


def test_ddim_backward_launches_in_parts_without_a_register_cap(device, monkeypatch):
    """ddim's backward of the mean (gaussian) and of the clipped KL runs each tile in four parts
    (step_backward_kernel's PARTS: at most 65 registers on one tile, unbounded, where the clipped
    epsilon backward took 152-160 in one part and launched under the 128 cap); at one tile it launches
    without a cap, as flowrl/tools/aot compiles it (register_cap), over 16-bit and float32 latents."""
    caps = {}
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        if "IS_KL" in kwargs:
            caps[kwargs["PRED"], kwargs["CLIP"], kwargs["IS_KL"], x_now.dtype] = (kwargs.get("maxnreg"),
                                                                                 kwargs["TILES"])
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)
    table = torch.tensor([0.5, 0.7, 0.7, 0.9], device=device)
    for dtype in (torch.bfloat16, torch.float32):
        x, v, prev = inputs((2, 1024), dtype, device, 5)
        for prediction, clip in (("epsilon", 1.0), ("epsilon", None), ("sample", 1.0)):
            kw = dict(mode="ddim", noise_level=0.8, prediction_type=prediction, clip_sample_range=clip, backend="triton")
            x_now, vg = x, v.clone().requires_grad_(True)
            flowrl.step_log_prob(x, vg, prev, table, 0, **kw).sum().backward()
            flowrl.step_kl(x, vg, prev, table, 0, **kw).sum().backward()
    assert len(caps) == 12 and set(caps.values()) == {(None, 1)}
    assert _triton_ops.register_cap(1) == {} and _triton_ops.register_cap(4) == dict(maxnreg=128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_words_on_whole_blocks_give_the_masked_accesses_bits(device, monkeypatch, dtype):
    """On whole blocks (EVEN) the step kernels read bfloat16 latents as 32-bit words and store a 16-bit
    rollout's x' as words of rounded pairs (a 4-byte aligned row start: step_switches); a copy of the
    same values starting 2 bytes off a 4-byte boundary takes the masked element loads and stores
    instead: rollout, recompute, KL and every backward grad are the same bits."""
    n = 2048
    sigmas = schedule(device)
    x, v, noise = inputs((2, n), dtype, device, 31, third="noise")
    _, _, v_ref = inputs((2, n), dtype, device, 32, third="noise")
    step = steps_for(2, device)

    def shifted(t):  # the same values, 2 bytes into a buffer: data_ptr % 4 == 2
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    evens = []
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        if "EVEN" in kwargs:  # the step kernels (not the finalize)
            evens.append(kwargs["EVEN"])
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)

    def run(place):
        out = flowrl.sde_step(place(x), place(v), sigmas, step, noise=noise, backend="triton")
        leaves = [place(t).requires_grad_(True) for t in (x, v, out.prev_sample)]
        lp = flowrl.step_log_prob(*leaves, sigmas, step, backend="triton")
        lp.sum().backward()
        vk = place(v).requires_grad_(True)
        kl = flowrl.step_kl(place(x), vk, place(v_ref), sigmas, step, backend="triton")
        kl.sum().backward()
        return [out.prev_sample, out.log_prob, out.prev_sample_mean, lp, *(t.grad for t in leaves), kl, vk.grad]

    assert all(t.data_ptr() % 4 == 0 for t in (x, v, v_ref))
    want = run(torch.clone)
    assert set(evens) == {True}
    evens.clear()
    assert _triton_ops.step_switches(1, 1, n, accessed=(shifted(x), v))["EVEN"] is False
    got = run(shifted)
    assert set(evens) == {False}  # the shifted reads were all masked
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), k


def test_launch_table_covers_every_size():
    assert _triton_ops.launch_config(1) == _triton_ops.LAUNCH_TABLE[0][1:]
    assert _triton_ops.launch_config(2**40)[0] >= 1
    sizes = [1, 1024, 2048, 2049, 8192, 8193, 10**9]
    assert all(g & (g - 1) == 0 and 1 <= w <= 32 for g, w in map(_triton_ops.launch_config, sizes))
    step = [_triton_ops.launch_config(n, table=_triton_ops.STEP_LAUNCH_TABLE) for n in sizes]
    assert all(g & (g - 1) == 0 and w == 1 for g, w in step) and step[0] == (1, 1) and step[-1] == (4, 1)


# -------------------------------------------------------------------------------------- dispatch


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = (
        "import torch, flowrl\n"
        "x = torch.zeros(1, 4)\n"
        "try:\n"
        "    flowrl.step_log_prob(x, x, x, torch.tensor([1.0, 0.5, 0.0]), 0, backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ERR" in res.stdout and "TRITON_INTERPRET" in res.stdout, res.stdout + res.stderr


def test_auto_picks_torch_on_cpu(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.resolve("auto", torch.device("cpu"), torch.float32) == "torch"


@pytest.mark.parametrize("kind", KINDS + ("kl",))
def test_wide_finalize_runs_the_same_tree(device, monkeypatch, kind):
    """Above MAX_FINALIZE_WIDTH partials the tree's first levels run as elementwise torch adds before
    the finalize kernel: the same bits as one program."""
    sigmas = schedule(device)
    x, v, prev = inputs((2, 5 * flowrl.CHUNK_SIZE + 1), torch.float32, device, 16)
    steps = torch.tensor([0, 5], device=device)

    def run():
        if kind == "kl":
            return flowrl.step_kl(x, v, prev, sigmas, steps, reduction="sum", backend="triton")
        return flowrl.step_log_prob(x, v, prev, sigmas, steps, log_prob_kind=kind, backend="triton")
    want = run()
    for width in (4, 2):  # 6 partials: padded to 8, then one or two torch levels
        monkeypatch.setattr(_triton_ops, "MAX_FINALIZE_WIDTH", width)
        assert torch.equal(run(), want), width


def test_sde_step_without_mean_under_autograd(device):
    sigmas = schedule(device)
    x, v, noise = inputs((2, 64), torch.float32, device, 17, third="noise")
    grads = {}
    for backend in ("triton", "torch"):
        vb = v.clone().requires_grad_(True)
        out = flowrl.sde_step(x, vb, sigmas, 2, noise=noise, backend=backend, return_prev_sample_mean=False)
        assert out.prev_sample_mean is None
        (out.prev_sample * torch.linspace(-1, 1, x.numel(), device=x.device).reshape(x.shape)).sum().backward()
        grads[backend] = vb.grad
    # d x' / d v = c, the step's velocity coefficient, times the incoming weights
    torch.testing.assert_close(grads["triton"], grads["torch"], rtol=1e-6, atol=1e-7)
    assert bool((grads["triton"] != 0).any())
