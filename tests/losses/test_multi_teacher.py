"""teacher_kl_loss with several teachers (docs/losses.md, Several teachers), both backends (Triton under
its interpreter on CPU):

- a teacher per sample (``teacher_index``): verl-omni's multi-teacher routing (PR 427: each row scored by
  the teacher its ``teacher_key`` names, then ``DistillKLLoss`` unchanged), against a float64
  transcription of that formula written here, and bit for bit each row's single-teacher KL;
- weighted teachers (``teacher_weights``, flowrl's own: the peer has no mixture): the weighted sum of
  per-teacher float64 KLs of ``flowrl.oracle``, its gradient, and the one-pass form against the K
  separate float32 KLs;
- one teacher in a tuple and identical teachers give the single-teacher call bit for bit; B = 0; joint
  streams; argument errors; torch.compile (aot_eager, fullgraph) through flowrl::teacher_kl_loss; and
  sequence parallelism on two gloo ranks (slow).
"""
import os
import sys

import pytest
import torch

from flowrl import distributed as fd
from flowrl import losses as L
from flowrl.backends import _dispatch
from flowrl.oracle import steps as S

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gloo_ranks import run_ranks  # noqa: E402

F64 = torch.float64
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (4, 2, 750)  # 1500 elements per sample: two chunks, the second partial
STEPS = [0, 3, 6, 8]  # sigma == 1 (Flow-GRPO's sigma_max branch), middle, late
WEIGHTS = (0.5, 1.0, 2.5)


def schedule(T=10, shift=3.0):
    t = torch.linspace(1, 0, T + 1, dtype=F64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.float32).to(DEVICE)


def inputs(k=3, scale=0.3, dtype=torch.float32, shape=SHAPE, seed=0):
    """x, v, K teachers (v moved by ``scale`` each), sigmas, the [B] step indices."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    teachers = tuple((v + scale * torch.randn(shape, generator=g)).to(DEVICE, dtype) for _ in range(k))
    return x.to(DEVICE, dtype), v.to(DEVICE, dtype), teachers, schedule(), torch.tensor(STEPS[:shape[0]], device=DEVICE)


def _cpu64(t):
    return t.detach().cpu().to(F64)


def oracle_weighted(x, v, teachers, sigmas, steps, weights, mode="sde", eta=0.7, reduction="mean"):
    """sum_k (w_k / sum w) KL_k in float64, KL_k flowrl.oracle's exact Gaussian KL to teacher k."""
    total = sum(weights)
    return sum((w / total) * S.kl(_cpu64(x), v, _cpu64(t), sigmas.cpu(), [int(i) for i in steps], mode, eta, reduction)
               for w, t in zip(weights, teachers))


def peer_routed_distill_kl(x, v, teachers, sigmas, steps, teacher_index, eta=0.7):
    """float64 transcription of verl-omni's multi-teacher diffusion OPD (PR 427 routes each row to the
    teacher its teacher_key names; DistillKLLoss.compute_loss, verl_omni/trainer/diffusion/diffusion_algos.py
    @a1139baf lines 1062-1080, then scores it): per sample mean((mu - mu_teacher)^2) / (2 std_dev_t^2),
    with Flow-GRPO's SDE mean and std_dev_t (the peer's transition). Returns (per-sample KL, dt)."""
    x, v = _cpu64(x), _cpu64(v)
    sig = sigmas.cpu().to(F64)
    idx = steps.cpu()
    sigma = sig[idx].view(-1, 1, 1)
    dt = sig[idx + 1].view(-1, 1, 1) - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sig[1], sigma))) * eta

    def mean(out):
        return x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + out * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt

    routed = torch.stack([_cpu64(teachers[int(k)][b]) for b, k in enumerate(teacher_index.cpu())])
    kl = ((mean(v) - mean(routed)) ** 2).mean(dim=(1, 2)) / (2 * std_dev_t.flatten() ** 2)
    return kl, -dt.flatten()


def _loss_and_grad(fn, v):
    vv = v.clone().requires_grad_()
    loss, kl = fn(vv)
    (g,) = torch.autograd.grad(loss, vv)
    return loss, kl, g


# ---------------------------------------------------------------------- a teacher per sample (the peer's)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_per_sample_matches_the_peers_routed_distill_kl(backend):
    x, v, teachers, sig, steps = inputs()
    index = torch.tensor([2, 0, 1, 2], device=DEVICE)
    loss, kl, g = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers, sig, steps, teacher_index=index,
                                                               backend=backend), v)
    peer, d = peer_routed_distill_kl(x, v, teachers, sig, steps, index)
    # verl-omni divides by std_dev_t^2, the exact KL by std^2 = std_dev_t^2 * (-dt): theirs is flowrl's x (-dt)
    torch.testing.assert_close(_cpu64(kl) * d, peer, rtol=2e-5, atol=0)
    torch.testing.assert_close(loss, kl.mean())
    # each row is that row's single-teacher KL and gradient, bit for bit
    for k in range(len(teachers)):
        _, kl_k, g_k = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers[k], sig, steps, backend=backend), v)
        rows = index == k
        assert torch.equal(kl[rows], kl_k[rows])
        # the batch mean's 1/B is the same in both calls: the per-row gradient is the same
        assert torch.equal(g[rows], g_k[rows])


# ---------------------------------------------------------------------- weighted teachers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weighted_teachers_match_the_float64_weighted_sum_and_its_gradient(backend, reduction):
    x, v, teachers, sig, steps = inputs()
    loss, kl, g = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers, sig, steps, teacher_weights=WEIGHTS,
                                                               reduction=reduction, backend=backend), v)
    ve = _cpu64(v).requires_grad_()
    want = oracle_weighted(x, ve, teachers, sig, steps, WEIGHTS, reduction=reduction)
    torch.testing.assert_close(_cpu64(kl), want.detach(), rtol=2e-5, atol=1e-12)
    (g_want,) = torch.autograd.grad(want.mean(), ve)
    torch.testing.assert_close(_cpu64(loss), want.mean().detach(), rtol=2e-5, atol=0)
    # per element, the gradient is (c^2 / std^2)(v - v_bar): float32 rounding relative to its largest element
    torch.testing.assert_close(_cpu64(g), g_want, rtol=1e-4, atol=2e-6 * g_want.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.3, 1e-3])
def test_the_one_pass_form_equals_the_separate_float32_kls(backend, scale):
    """KL(v, v_bar) + sum_k p_k KL(v_k, v_bar) against sum_k p_k KL(v, v_k), K separate float32 KLs, both
    against float64: the one-pass form is as close to float64 as the separate sum (a factor of 4 of slack),
    also with teachers 1e-3 from the policy and each other (v_bar's rounding then weighs most)."""
    x, v, teachers, sig, steps = inputs(scale=scale)
    total = sum(WEIGHTS)
    _, kl, g = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers, sig, steps, teacher_weights=WEIGHTS,
                                                           backend=backend), v)
    _, separate, g_sep = _loss_and_grad(
        lambda vv: [sum(t) for t in zip(*(((w / total) * f[0], (w / total) * f[1]) for w, f in zip(
            WEIGHTS, (L.teacher_kl_loss(x, vv, t, sig, steps, backend=backend) for t in teachers))))], v)
    ve = _cpu64(v).requires_grad_()
    want = oracle_weighted(x, ve, teachers, sig, steps, WEIGHTS)
    (g_want,) = torch.autograd.grad(want.mean(), ve)
    want, top = want.detach(), g_want.abs().max()
    err = {"kl": ((_cpu64(kl) - want).abs() / want).max().item(),
           "kl separate": ((_cpu64(separate) - want).abs() / want).max().item(),
           "grad": ((_cpu64(g) - g_want).abs().max() / top).item(),
           "grad separate": ((_cpu64(g_sep) - g_want).abs().max() / top).item()}
    assert err["kl"] <= max(4 * err["kl separate"], 2 ** -22), err
    assert err["grad"] <= max(2 * err["grad separate"], 2 ** -22), err


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_teacher_in_a_tuple_is_the_single_teacher_call_bit_for_bit(backend):
    x, v, teachers, sig, steps = inputs(k=1)
    single = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers[0], sig, steps, backend=backend), v)
    for kw in ({}, {"teacher_weights": [3.0]}, {"teacher_index": torch.zeros(4, dtype=torch.long, device=DEVICE)}):
        got = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers, sig, steps, backend=backend, **kw), v)
        for a, b in zip(got, single):
            assert torch.equal(a, b), kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_teachers_and_zero_weights_are_one_teacher_bit_for_bit(backend, dtype):
    x, v, teachers, sig, steps = inputs(dtype=dtype)
    single = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, teachers[1], sig, steps, backend=backend), v)
    same = (teachers[1],) * 3
    for t, kw in ((same, {}), (same, {"teacher_weights": WEIGHTS}), (teachers, {"teacher_weights": (0, 2.0, 0)}),
                  (same, {"teacher_index": torch.tensor([0, 2, 1, 1], device=DEVICE)})):
        got = _loss_and_grad(lambda vv: L.teacher_kl_loss(x, vv, t, sig, steps, backend=backend, **kw), v)
        for a, b in zip(got, single):
            assert torch.equal(a, b), kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_teachers_average_in_float32(backend):
    """bf16 latents and teachers: v_bar is built in float32 (not rounded back to bf16), so the value stays
    the float64 weighted sum's within float32 rounding of the bf16 inputs' exact values."""
    x, v, teachers, sig, steps = inputs(dtype=torch.bfloat16)
    _, kl = L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_weights=WEIGHTS, backend=backend)
    want = oracle_weighted(x, _cpu64(v), teachers, sig, steps, WEIGHTS)
    torch.testing.assert_close(_cpu64(kl), want, rtol=2e-5, atol=1e-12)


def test_float64_teachers_average_in_float64():
    """float64 latents and teachers (the torch backend's wide path): v_bar is built in float64 (docs/losses.md,
    Several teachers), so the KL is the float64 weighted sum's to float64 rounding (a float32 v_bar: ~6e-9)."""
    x, v, teachers, sig, steps = inputs(dtype=F64)
    _, kl = L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_weights=WEIGHTS, backend="torch")
    assert kl.dtype == F64
    want = oracle_weighted(x, _cpu64(v), teachers, sig, steps, WEIGHTS)
    torch.testing.assert_close(_cpu64(kl), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_joint_streams_with_weighted_teachers(backend):
    """A joint step (two streams): each teacher a tuple of streams; the KL is the weighted sum of the
    joint single-teacher KLs (step_kl on the tuples) within float32 rounding."""
    x, v, teachers, sig, steps = inputs(shape=(2, 2, 600))
    xa, va, ta, _, _ = inputs(shape=(2, 3, 100), seed=1)
    sw = (0.7, 0.3)
    joint = tuple((t, u) for t, u in zip(teachers, ta))
    loss, kl = L.teacher_kl_loss((x, xa), (v, va), joint, sig, steps[:2], teacher_weights=WEIGHTS,
                                 stream_weights=sw, backend=backend)
    total = sum(WEIGHTS)
    want = sum((w / total) * L.teacher_kl_loss((x, xa), (v, va), t, sig, steps[:2], stream_weights=sw,
                                               backend=backend)[1] for w, t in zip(WEIGHTS, joint))
    torch.testing.assert_close(kl, want, rtol=4e-6, atol=0)
    index = torch.tensor([1, 2], device=DEVICE)
    _, kl_i = L.teacher_kl_loss((x, xa), (v, va), joint, sig, steps[:2], teacher_index=index, stream_weights=sw,
                                backend=backend)
    for b, k in enumerate(index.tolist()):
        single = L.teacher_kl_loss((x, xa), (v, va), joint[k], sig, steps[:2], stream_weights=sw, backend=backend)[1]
        assert torch.equal(kl_i[b], single[b])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_batch(backend):
    x, v, teachers, sig, _ = inputs(shape=(0, 2, 750))
    steps = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for kw in ({"teacher_weights": WEIGHTS}, {"teacher_index": torch.zeros(0, dtype=torch.long, device=DEVICE)}):
        vv = v.clone().requires_grad_()
        loss, kl = L.teacher_kl_loss(x, vv, teachers, sig, steps, backend=backend, **kw)
        assert kl.shape == (0,) and loss.item() == 0.0
        loss.backward()
        assert vv.grad.shape == v.shape


def test_bad_arguments_are_named():
    x, v, teachers, sig, steps = inputs(shape=(4, 2, 40))
    cases = [
        (ValueError, r"teacher_weights has 2 weights for 3 teachers", {"teacher_weights": (1.0, 2.0)}),
        (ValueError, r"teacher_weights must be finite and >= 0", {"teacher_weights": (1.0, -1.0, 2.0)}),
        (ValueError, r"teacher_weights must be finite and >= 0", {"teacher_weights": (1.0, float("nan"), 2.0)}),
        (ValueError, r"teacher_weights sum to 0", {"teacher_weights": (0, 0, 0)}),
        (TypeError, r"teacher_weights must be a sequence", {"teacher_weights": torch.ones(3)}),
        (ValueError, r"teacher_weights and teacher_index are exclusive",
         {"teacher_weights": WEIGHTS, "teacher_index": torch.zeros(4, dtype=torch.long)}),
        (TypeError, r"teacher_index must be an integer tensor", {"teacher_index": torch.zeros(4)}),
        (TypeError, r"teacher_index must be an integer tensor", {"teacher_index": torch.zeros(4, dtype=torch.bool)}),
        (TypeError, r"teacher_index must be an integer tensor", {"teacher_index": [0, 1, 2, 0]}),
        (ValueError, r"teacher_index must have shape \[B\] = \[4\]",
         {"teacher_index": torch.zeros(3, dtype=torch.long)}),
        (ValueError, r"teacher_index must be in \[0, 3\) for 3 teachers; got values in \[0, 3\]",
         {"teacher_index": torch.tensor([0, 1, 2, 3])}),
        (ValueError, r"teacher_index must be in \[0, 3\)", {"teacher_index": torch.tensor([0, -1, 2, 1])}),
    ]
    for error, match, kw in cases:
        kw = {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) and k == "teacher_index" else t) for k, t in kw.items()}
        with pytest.raises(error, match=match):
            L.teacher_kl_loss(x, v, teachers, sig, steps, backend="torch", **kw)
    with pytest.raises(ValueError, match="teacher_weights and teacher_index need several teachers"):
        L.teacher_kl_loss(x, v, teachers[0], sig, steps, teacher_weights=[1.0])
    with pytest.raises(ValueError, match="teacher_weights and teacher_index need several teachers"):
        L.teacher_kl_loss(x, v, teachers[0], sig, steps, teacher_index=torch.zeros(4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="teacher_model_output is an empty tuple"):
        L.teacher_kl_loss(x, v, (), sig, steps)
    with pytest.raises(ValueError, match=r"teacher_model_output\[1\] has shape \(4, 2, 39\)"):
        L.teacher_kl_loss(x, v, (teachers[0], teachers[1][..., :39]), sig, steps)
    with pytest.raises(TypeError, match=r"teacher_model_output\[1\] must be a tensor"):
        L.teacher_kl_loss(x, v, (teachers[0], None), sig, steps)
    with pytest.raises(ValueError, match=r"^teacher_model_output\[2\] requires grad"):
        L.teacher_kl_loss(x, v, (teachers[0], teachers[1], teachers[2].clone().requires_grad_()), sig, steps)


# ---------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("kw", ["weights", "index"])
def test_torch_compile_through_the_custom_op_equals_eager(kw):
    """fullgraph=True (aot_eager: the graph and the registered backward, no C++ build): the same values
    and gradient as eager mode, bit for bit (torch backend); Dynamo's graph calls flowrl::teacher_kl_loss
    once (a teacher per sample) or 1 + K times (weighted)."""
    x, v, teachers, sig, steps = inputs(shape=(4, 2, 40))
    index = torch.tensor([2, 0, 1, 1], device=DEVICE)
    extra = {"teacher_weights": WEIGHTS} if kw == "weights" else {"teacher_index": index}

    def step(x, v, t0, t1, t2):
        return L.teacher_kl_loss(x, v, (t0, t1, t2), sig, 1, backend="torch", **extra)

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True, backend=record)(x, v, *teachers)
        assert seen.count("flowrl.teacher_kl_loss.default") == (4 if kw == "weights" else 1)
        torch._dynamo.reset()
        results = []
        for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            vv = v.clone().requires_grad_()
            loss, kl = fn(x, vv, *teachers)
            results.append((loss, kl, torch.autograd.grad(loss, vv)[0]))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    finally:
        torch._dynamo.reset()


def test_teacher_index_range_read_as_step_index_is():
    """The range check reads the index as check_step_index reads a step index: one device-to-host copy,
    and none inside flowrl.no_value_checks() (the range then the caller's), so no host sync there."""
    import flowrl
    x, v, teachers, sig, steps = inputs(shape=(4, 2, 40))
    bad = torch.tensor([0, 1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match=r"teacher_index must be in \[0, 3\)"):
        L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_index=bad, backend="torch")
    good = torch.tensor([0, 1, 2, 1], device=DEVICE)
    with flowrl.no_value_checks():
        L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_index=bad, backend="torch")  # not read
        loss, kl = L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_index=good, backend="torch")
    ref_loss, ref_kl = L.teacher_kl_loss(x, v, teachers, sig, steps, teacher_index=good, backend="torch")
    assert torch.equal(loss, ref_loss) and torch.equal(kl, ref_kl)


# ---------------------------------------------------------------------- sequence parallelism (gloo ranks)

SP_SHAPE = (3, 2, 1024)  # 2048 elements per sample: two whole chunks, one per rank (bit-exact layout)


def _check_sp(rank, world):
    x, v, teachers, sig, steps = inputs(shape=SP_SHAPE, seed=3)
    lo, hi = rank * SP_SHAPE[1] // world, (rank + 1) * SP_SHAPE[1] // world  # cut on S, as sequence parallelism
    cut = lambda t: t[:, lo:hi].contiguous()  # noqa: E731
    for kw in ({"teacher_weights": WEIGHTS}, {"teacher_index": torch.tensor([1, 2, 0])}):
        vf = v.clone().requires_grad_()
        loss, kl = L.teacher_kl_loss(x, vf, teachers, sig, steps, backend="torch", **kw)
        loss.backward()
        vs = cut(v).requires_grad_()
        loss_s, kl_s = fd.teacher_kl_loss(cut(x), vs, tuple(cut(t) for t in teachers), sig, steps, backend="torch",
                                          **kw)
        loss_s.backward()
        assert torch.equal(kl_s, kl) and torch.equal(loss_s, loss), (rank, kw)
        assert torch.equal(vs.grad, vf.grad[:, lo:hi]), (rank, kw)


@pytest.mark.slow  # spawns a gloo process group
def test_several_teachers_under_sequence_parallelism_match_single_device():
    """Two ranks, each holding half of every sample's elements (a chunk each): the KL, loss and each
    rank's slice of the gradient equal the single-device call's bit for bit (every pass is step_kl's,
    whose chunk partials the ranks exchange)."""
    run_ranks(_check_sp, 2)
