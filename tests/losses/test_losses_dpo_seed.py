"""dpo_loss / dgpo_loss with ``noise_seed``: eps drawn from Philox inside the element passes (kernels/loss.py's
``_flow_noise``), never stored. The seeded path equals the tensor path fed the same Philox noise
(``flowrl.backends.reference_losses.flow_noise``, flowrl.backends.reference.philox_normal's values): bit for bit on
the torch backend and on the Triton backend, forward and backward; Triton equals torch as the tensor path
does. Also the forward-process kernels' whole-block specialization (EVEN: no masks, bfloat16 read as
uint32 pairs) against the torch backend, bit for bit, with a tail block and without.
"""
import pytest
import torch

from flowrl.backends import _dispatch
from flowrl import losses as L
from flowrl.backends import reference, reference_losses
from flowrl.contract import FlowLoss
from flowrl.core._validate import NoiseSeed
from flowrl.losses._preference import dgpo_noise_seed, dpo_noise_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or _dispatch.interpreter_enabled()
BACKENDS = ["torch"] + (["triton"] if TRITON else [])
needs_triton = pytest.mark.skipif(not TRITON, reason="needs the Triton backend")
# whole chunks (EVEN on the Triton backend) and a partial last chunk. The first, ~2-3 s a Triton case through
# the interpreter, is the full suite's; the quick loop has whole chunks in test_triton_seeded_is_batch_invariant
# (seeded) and test_flow_sums_whole_blocks_and_tail_match_torch_bit_for_bit's (2, 32, 32)
SHAPES = [pytest.param((4, 16, 32), marks=pytest.mark.slow, id="shape0"), (3, 10, 7)]


def _inputs(batch, shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x0, v_ref, v_old, v = (torch.randn((batch,) + shape, generator=g) for _ in range(4))
    return tuple(t.to(DEVICE, dtype) for t in (v, v_ref, v_old, x0))


def _grad_of(fn, v):
    vv = v.clone().requires_grad_()
    out = fn(vv)
    return out, torch.autograd.grad(out[0], vv)[0]


def _same(a, b, msg="", exact=True):
    """Equal fields: bit for bit, or (``exact`` False) to float32 rounding: the Triton kernels' Philox
    normals equal flowrl.backends.reference.philox_normal's to an ulp or so (log / cos / sin implementations
    differ; tests/backends/test_philox.py)."""
    for field in a._fields:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), (msg, field)
        if x is not None and exact:
            assert torch.equal(x, y), (msg, field)
        elif x is not None:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{msg} {field}")


def _same_grad(a, b, exact):
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def _pair_eps(seed, pairs, shape, layout):
    """Each pair's noise, from flowrl.backends.reference.philox_normal: an int seed keys every pair, pair p on
    stream p; a seed tensor [P] keys each pair, stream 0. Then each sample takes its pair's."""
    if isinstance(seed, int):
        ns = NoiseSeed(torch.full((pairs,), seed, dtype=torch.int64, device=DEVICE), 1, 0)
    else:
        ns = NoiseSeed(seed, 0, 0)
    rows = reference.philox_normal(ns, int(torch.tensor(shape).prod())).reshape((pairs,) + shape)
    return torch.cat([rows, rows]) if layout == "halves" else rows.repeat_interleave(2, dim=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
@pytest.mark.parametrize("shape", SHAPES)
def test_dpo_noise_seed_is_the_tensor_path_on_the_pairs_philox_noise(backend, layout, shape):
    v, v_ref, _, x0 = _inputs(6, shape, seed=1)
    for seed in (12345, torch.tensor([7, -3, 2**40], dtype=torch.int64, device=DEVICE)):
        eps = _pair_eps(seed, 3, shape, layout)
        seeded, g_seeded = _grad_of(lambda vv: L.dpo_loss(vv, v_ref, None, x0, beta=50.0, pair_layout=layout,
                                                           noise_seed=seed, backend=backend), v)
        given, g_given = _grad_of(lambda vv: L.dpo_loss(vv, v_ref, eps, x0, beta=50.0, pair_layout=layout,
                                                        backend=backend), v)
        _same(seeded, given, backend, exact=backend == "torch")
        _same_grad(g_seeded, g_given, exact=backend == "torch")
        assert g_seeded.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dgpo_noise_seed_is_the_tensor_path_on_the_samples_philox_noise(backend, shape):
    v, v_ref, v_old, x0 = _inputs(6, shape, seed=2)
    adv = torch.tensor([1.2, -0.3, -0.9, 1.0, -0.7, -0.3], device=DEVICE)
    ids = torch.tensor([4, 1, 4, 1, 1, 4], device=DEVICE)
    n = int(torch.tensor(shape).prod())
    group_seeds = torch.tensor([0, 11, 0, 0, 99], dtype=torch.int64, device=DEVICE)
    for seed, ns in ((2024, NoiseSeed(torch.full((6,), 2024, dtype=torch.int64, device=DEVICE), 1, 0)),
                     (group_seeds[ids], NoiseSeed(group_seeds[ids], 0, 0))):  # DGPO's shared noise per group
        eps = reference.philox_normal(ns, n).reshape(v.shape)
        kw = dict(beta=100.0, group_size=3, old_model_output=v_old, clip_range=0.002, kl_coef=0.1, backend=backend)
        seeded, g_seeded = _grad_of(lambda vv: L.dgpo_loss(vv, v_ref, None, x0, advantages=adv, group_index=ids,
                                                           noise_seed=seed, **kw), v)
        given, g_given = _grad_of(lambda vv: L.dgpo_loss(vv, v_ref, eps, x0, advantages=adv, group_index=ids, **kw), v)
        _same(seeded, given, backend, exact=backend == "torch")
        _same_grad(g_seeded, g_given, exact=backend == "torch")
    # per-sample seeds: a group's samples share eps exactly
    eps = reference_losses.flow_noise(dgpo_noise_seed(group_seeds[ids], v), 6, n)
    assert torch.equal(eps[0], eps[2]) and torch.equal(eps[1], eps[3]) and not torch.equal(eps[0], eps[1])


def test_a_pairs_two_samples_draw_one_noise():
    like = torch.zeros(6, 8, device=DEVICE)
    for layout, partner in (("halves", 3), ("interleaved", 1)):
        eps = reference_losses.flow_noise(dpo_noise_seed(5, 6, like.device, layout), 6, 40)
        first = 0
        assert torch.equal(eps[first], eps[first + partner])
        assert not torch.equal(eps[0], eps[2 if layout == "interleaved" else 1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_seeded_matches_torch_seeded(dtype, shape):
    v, v_ref, v_old, x0 = _inputs(4, shape, seed=3, dtype=dtype)
    adv = torch.tensor([0.5, -1.0, 1.5, -0.2], device=DEVICE)
    ids = torch.tensor([0, 0, 1, 1], device=DEVICE)
    cases = {
        "dpo": lambda vv, be: L.dpo_loss(vv, v_ref, None, x0, beta=20.0, noise_seed=77, backend=be),
        "dgpo": lambda vv, be: L.dgpo_loss(vv, v_ref, None, x0, advantages=adv, group_index=ids, beta=10.0,
                                           old_model_output=v_old,
                                           clip_range=0.5, kl_coef=0.1, noise_seed=torch.tensor(
                                               [3, 3, 8, 8], device=DEVICE), backend=be),
    }
    for name, fn in cases.items():
        res_t, grad_t = _grad_of(lambda vv: fn(vv, "torch"), v)
        res_k, grad_k = _grad_of(lambda vv: fn(vv, "triton"), v)
        # the same operations on the same Philox words (normals equal to an ulp or so, _same)
        _same(res_k, res_t, name, exact=False)
        scale = float(grad_t.float().abs().max())
        torch.testing.assert_close(grad_k.float(), grad_t.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 * scale if dtype == torch.float32 else 1e-2 * scale, msg=name)
        again = fn(v, "triton")  # run to run: bit for bit
        _same(again, res_k, name)


@needs_triton
def test_triton_seeded_is_batch_invariant():
    """A pair alone draws its own row (its seed's stream): the same bits as inside the batch."""
    v, v_ref, _, x0 = _inputs(6, (4, 16, 32), seed=6)
    seeds = torch.tensor([5, 6, 7], device=DEVICE)
    full = L.dpo_loss(v, v_ref, None, x0, beta=30.0, noise_seed=seeds, backend="triton")
    sub = [1, 4]
    alone = L.dpo_loss(v[sub], v_ref[sub], None, x0[sub], beta=30.0, noise_seed=seeds[1:2], backend="triton")
    assert torch.equal(alone.model_error, full.model_error[sub])
    assert torch.equal(alone.ref_error, full.ref_error[sub])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES + [(2, 32, 32), (1, 2050), (3, 5, 7), "misaligned"])
def test_flow_sums_whole_blocks_and_tail_match_torch_bit_for_bit(dtype, shape):
    """Every forward-process kind's sums on the Triton backend equal the torch backend's, and its
    backward the torch backend's autograd: whole chunks (EVEN), a tail (PAIRED for bfloat16: an even
    count), an odd count and rows 2 bytes off a 4-byte boundary (neither)."""
    from flowrl.backends import _triton_losses

    misaligned = shape == "misaligned"
    shape = (4, 16, 32) if misaligned else shape
    v, a, b, x0 = _inputs(3, shape, seed=4, dtype=dtype)
    if misaligned:  # contiguous views one element into their storage
        a = torch.cat([a.new_zeros(1), a.flatten()])[1:].view(a.shape)
        x0 = torch.cat([x0.new_zeros(1), x0.flatten()])[1:].view(x0.shape)
        assert a.is_contiguous() and a.data_ptr() % 4 == (2 if dtype != torch.float32 else 0)
    c = _inputs(3, shape, seed=5, dtype=dtype)[0]
    t = torch.tensor([0.3, 0.7, 0.9], device=DEVICE)
    coefs = (0.8, 0.2, 1.8)
    cases = [(FlowLoss.NFT, 5, a, b, c), (FlowLoss.AWM, 1, None, b, None), (FlowLoss.DPO, 2, a, b, None),
             (FlowLoss.DGPO, 3, a, b, None), (FlowLoss.DGPO, 5, a, b, c)]
    for kind, count, xt, other, ref in cases:
        def sums(backend, vv):
            fn = _triton_losses.flow_sums if backend == "triton" else reference_losses.flow_sums
            return fn(kind, count, xt, vv, other, x0, ref, t, coefs)

        want, got = sums("torch", v), sums("triton", v)
        assert torch.equal(got, want), kind
        w = torch.linspace(-1.0, 1.0, count * 3, device=DEVICE).reshape(count, 3)
        if kind is FlowLoss.NFT:  # the backward differentiates the squared sums (the |e| rows are logged)
            w[0] = w[2] = 0.0
        vv = v.clone().requires_grad_()
        g_got = torch.autograd.grad((sums("triton", vv) * w).sum(), vv)[0]
        vt = v.float().clone().requires_grad_()
        g_ref = torch.autograd.grad((reference_losses.flow_sums(kind, count, xt, vt, other, x0, ref, t, coefs)
                                     * w).sum(), vt)[0]
        torch.testing.assert_close(g_got.float(), g_ref.to(dtype).float(), rtol=1e-5 if dtype == torch.float32
                                   else 1e-2, atol=1e-6, msg=str(kind))


def test_exactly_one_of_noise_and_noise_seed():
    v, v_ref, _, x0 = _inputs(2, (8,))
    eps = torch.zeros_like(v)
    with pytest.raises(ValueError, match="noise_seed"):
        L.dpo_loss(v, v_ref, None, x0, beta=1.0)
    with pytest.raises(ValueError, match="noise_seed"):
        L.dpo_loss(v, v_ref, eps, x0, beta=1.0, noise_seed=3)
    with pytest.raises(TypeError, match="noise_seed"):
        L.dpo_loss(v, v_ref, None, x0, beta=1.0, noise_seed=1.5)
    with pytest.raises(TypeError, match="noise_seed"):
        L.dpo_loss(v, v_ref, None, x0, beta=1.0, noise_seed=torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"noise_seed must be an int or a tensor of shape \[P\] = \[1\]"):
        L.dpo_loss(v, v_ref, None, x0, beta=1.0, noise_seed=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="noise_seed must be in"):
        L.dpo_loss(v, v_ref, None, x0, beta=1.0, noise_seed=-1)
    adv, ids = torch.tensor([1.0, -1.0], device=DEVICE), torch.tensor([0, 0], device=DEVICE)
    with pytest.raises(ValueError, match="noise_seed"):
        L.dgpo_loss(v, v_ref, None, x0, advantages=adv, group_index=ids, beta=1.0)
    with pytest.raises(ValueError, match="noise_seed"):
        L.dgpo_loss(v, v_ref, eps, x0, advantages=adv, group_index=ids, beta=1.0, noise_seed=torch.tensor([1, 2],
                                                                                                          device=DEVICE))
    with pytest.raises(TypeError, match="noise_seed"):
        L.dgpo_loss(v, v_ref, None, x0, advantages=adv, group_index=ids, beta=1.0, noise_seed="7")
    with pytest.raises(ValueError, match="noise_seed"):
        L.dgpo_loss(v, v_ref, None, x0, advantages=adv, group_index=ids, beta=1.0, noise_seed=torch.tensor([1, 2, 3],
                                                                                                           device=DEVICE))


def test_dpo_noise_and_dgpo_noise_are_the_losses_draws():
    """The public draws (to form x_t = (1 - sigma) x0 + sigma eps) are the eps the losses use."""
    v, v_ref, _, x0 = _inputs(4, (3, 10, 7), seed=7)
    eps = L.dpo_noise(9, v, pair_layout="interleaved")
    assert eps.dtype == torch.float32 and eps.shape == v.shape and torch.equal(eps[0], eps[1])
    _same(L.dpo_loss(v, v_ref, None, x0, beta=5.0, pair_layout="interleaved", noise_seed=9, backend="torch"),
          L.dpo_loss(v, v_ref, eps, x0, beta=5.0, pair_layout="interleaved", backend="torch"))
    seeds = torch.tensor([1, 2, 1, 2], device=DEVICE)
    eps = L.dgpo_noise(seeds, v)
    assert torch.equal(eps[0], eps[2]) and not torch.equal(eps[0], eps[1])
    adv, ids = torch.tensor([1.0, -1.0, 0.5, -0.5], device=DEVICE), torch.tensor([0, 1, 0, 1], device=DEVICE)
    _same(L.dgpo_loss(v, v_ref, None, x0, advantages=adv, group_index=ids, beta=3.0, noise_seed=seeds, backend="torch"),
          L.dgpo_loss(v, v_ref, eps, x0, advantages=adv, group_index=ids, beta=3.0, backend="torch"))


@pytest.mark.slow  # an Inductor compile (the quick loop leaves them out, as tests/ops/test_torch_compile.py's)
def test_seeded_preference_losses_compile_with_no_graph_break_and_eager_bits():
    """Under torch.compile the seeded calls go through flowrl::dpo_loss / flowrl::dgpo_loss (the resolved
    seed as a tensor and ints): 0 graph breaks, every output and d loss / d w bit for bit."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 6, 8, generator=g)
    w0 = torch.randn(8, 8, generator=g) * 0.1
    ref = torch.randn(4, 6, 8, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    seeds = torch.tensor([5, 5, 6, 6])

    def step(x, ref, w, adv, seeds):
        v = x @ w
        groups = torch.arange(x.shape[0]) // 2
        dpo = L.dpo_loss(v, ref, None, x, beta=50.0, noise_seed=seeds[:2], backend="torch")
        dgpo = L.dgpo_loss(v, ref, None, x, advantages=adv, group_index=groups, beta=10.0, group_size=2, kl_coef=0.1,
                           noise_seed=seeds,
                           backend="torch")
        return (dpo.loss + dgpo.loss, *dpo, *[t for t in dgpo if t is not None])

    counters.clear()
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        w = w0.clone().requires_grad_()
        out = fn(x, ref, w, adv, seeds)
        out[0].backward()
        results.append((out, w.grad))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for a, b in zip(results[0][0] + (results[0][1],), results[1][0] + (results[1][1],)):
        assert torch.equal(a, b)


@needs_triton
@pytest.mark.slow  # six layouts through the interpreter (~8 s); the quick loop keeps the DPO / DGPO ones below
def test_triton_noise_rows_for_any_div_and_mod(monkeypatch):
    """Sample b draws Philox row (b // noise_div) % noise_mod on the Triton backend as on the torch one,
    bit for bit, forward and backward: the layouts flowrl.losses makes (NOISE_DIV 1 or 2, one wrap:
    kernels/loss.py's _flow_noise) and others (NOISE_DIV 0, the general modulo)."""
    from flowrl.backends import _triton_losses

    seen = []
    real_launch = _triton_losses._launch

    def record(kernel, grid, *args, **kwargs):
        seen.append(kwargs.get("NOISE_DIV"))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_losses, "_launch", record)
    shape = (4, 16, 32)
    # (batch, div, mod, NOISE_DIV): DPO halves and DGPO (1), interleaved (2); a wrap past 2 mod, div 3 (0)
    for batch, div, mod, want in ((6, 1, 3, 1), (6, 2, 3, 2), (5, 1, 5, 1), (7, 1, 2, 0), (7, 3, 2, 0), (9, 2, 2, 0)):
        v, v_ref, _, x0 = _inputs(batch, shape, seed=batch + div)
        seeds = torch.arange(11, 11 + mod, device=DEVICE)
        noise_seed = (seeds, 1, 0, div, mod)
        t = torch.zeros(batch, device=DEVICE)
        seen.clear()
        outs = {}
        for name, fn in (("triton", _triton_losses.flow_sums), ("torch", reference_losses.flow_sums)):
            vv = v.clone().requires_grad_()
            sums = fn(FlowLoss.DPO, 2, v_ref, vv, None, x0, None, t, (0.0, 0.0, 0.0), noise_seed=noise_seed)
            w = torch.linspace(-1.0, 1.0, 2 * batch, device=DEVICE).reshape(2, batch)
            outs[name] = (sums, torch.autograd.grad((sums * w).sum(), vv)[0])
        assert seen == [want, want], (batch, div, mod, seen)
        assert torch.equal(outs["triton"][0], outs["torch"][0]), (batch, div, mod)
        assert torch.equal(outs["triton"][1], outs["torch"][1]), (batch, div, mod)
        # each sample's row: its error sum equals that of the noise drawn for row (b // div) % mod
        rows = reference.philox_normal(NoiseSeed(seeds, 1, 0), shape[0] * shape[1] * shape[2]).reshape((mod,) + shape)
        eps = rows[(torch.arange(batch, device=DEVICE) // div) % mod]
        direct = reference_losses.flow_sums(FlowLoss.DPO, 2, v_ref, v, eps, x0, None, t, (0.0, 0.0, 0.0))
        assert torch.equal(outs["triton"][0], direct), (batch, div, mod)
