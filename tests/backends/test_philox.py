"""In-kernel Philox noise (``sde_step(noise_seed=...)``): the generator against Random123's known
answers, the torch and Triton streams against each other (bit for bit in the integers), the normals'
statistics, and the contracts: reproducible, batch-invariant with per-sample seeds, shard-invariant,
rollout log-prob == recompute bit for bit, and the argument checks.

The Triton cases run through the interpreter on CPU (tests/conftest.py) and on CUDA when present."""
import math

import pytest
import torch
import triton
import triton.language as tl

import flowrl
import flowrl.data.serialization
from flowrl.backends import reference as R
from flowrl.core._validate import NoiseSeed
from flowrl.core.step_spec import ShardContext
from flowrl.kernels.common import (
    box_muller, philox4x32_10, philox_key, philox_normal_block, philox_quad, sqrt_rn_nonneg, sqrt_rn_normal,
)

TRITON_OK = "triton" in flowrl.available_backends() and (
    torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0")
)
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
M32 = 0xFFFFFFFF

# Random123 tests/kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words), output (4 words)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# ------------------------------------------------------------------------------- test-only kernels


@triton.jit
def _kat_kernel(ctr_ptr, key_ptr, out_ptr, N: tl.constexpr):
    """Philox of N (counter, key) rows given as int64 words; writes the 4 output words as int64."""
    i = tl.arange(0, N)
    c = [tl.load(ctr_ptr + 4 * i + j).to(tl.uint32) for j in tl.static_range(4)]
    k0 = tl.load(key_ptr + 2 * i).to(tl.uint32)
    k1 = tl.load(key_ptr + 2 * i + 1).to(tl.uint32)
    o0, o1, o2, o3 = philox4x32_10(c[0], c[1], c[2], c[3], k0, k1)
    tl.store(out_ptr + 4 * i, o0.to(tl.int64))
    tl.store(out_ptr + 4 * i + 1, o1.to(tl.int64))
    tl.store(out_ptr + 4 * i + 2, o2.to(tl.int64))
    tl.store(out_ptr + 4 * i + 3, o3.to(tl.int64))


@triton.jit
def _sqrt_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, sqrt_rn_normal(tl.load(x_ptr + i)))


@triton.jit
def _sqrt_nonneg_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, sqrt_rn_nonneg(tl.load(x_ptr + i)))


@triton.jit
def _box_muller_kernel(radius_ptr, angle_ptr, cos_ptr, sin_ptr, N: tl.constexpr):
    """box_muller of N pairs of words given as int64."""
    i = tl.arange(0, N)
    n_cos, n_sin = box_muller(tl.load(radius_ptr + i).to(tl.uint32), tl.load(angle_ptr + i).to(tl.uint32))
    tl.store(cos_ptr + i, n_cos)
    tl.store(sin_ptr + i, n_sin)


@triton.jit
def _stream_kernel(seeds_ptr, words_ptr, normals_ptr, stream_stride, first_quad, elem_offset,
                   NQ: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Program b: the uint32 words of quads first_quad + arange(NQ) (below 2**32, as the kernels draw
    them) and the normals of elements elem_offset + arange(BLOCK) of sample b, through the kernels' own
    helpers."""
    row = tl.program_id(0).to(tl.int64)
    k0, k1 = philox_key(tl.load(seeds_ptr + row))
    stream = (row * stream_stride).to(tl.uint32)
    q = (first_quad + tl.arange(0, NQ).to(tl.int64)).to(tl.uint32)
    words = philox_quad(k0, k1, stream, q)
    for j in tl.static_range(4):
        tl.store(words_ptr + (row * 4 + j) * NQ + tl.arange(0, NQ), words[j].to(tl.int64))
    eps = philox_normal_block(k0, k1, stream, elem_offset, BLOCK, ALIGNED)
    tl.store(normals_ptr + row * BLOCK + tl.arange(0, BLOCK), eps)


def _triton_stream(seed: NoiseSeed, first_quad: int, nq: int, block: int, aligned=None):
    b = seed.seeds.shape[0]
    words = torch.empty((b, 4, nq), dtype=torch.int64, device=seed.seeds.device)
    normals = torch.empty((b, block), dtype=torch.float32, device=seed.seeds.device)
    _stream_kernel[(b,)](seed.seeds, words, normals, seed.stream_stride, first_quad, seed.elem_offset,
                         NQ=nq, BLOCK=block, ALIGNED=seed.elem_offset % 4 == 0 if aligned is None else aligned)
    return words.unbind(1), normals


# ------------------------------------------------------------------------------ generator identity


def test_reference_philox_known_answers():
    for ctr, key, want in KAT:
        words = R.philox4x32_10(*[torch.tensor([w]) for w in ctr], *[torch.tensor([w]) for w in key])
        assert [int(w) for w in words] == list(want), f"counter {ctr}, key {key}"


@needs_triton
def test_triton_philox_known_answers():
    ctr = torch.tensor([c for c, _, _ in KAT], dtype=torch.int64, device=DEVICE)
    key = torch.tensor([k for _, k, _ in KAT] + [(0, 0)], dtype=torch.int64, device=DEVICE)
    ctr = torch.cat([ctr, ctr[:1]])  # pad to 4 rows (power of two)
    out = torch.empty((4, 4), dtype=torch.int64, device=DEVICE)
    _kat_kernel[(1,)](ctr, key, out, N=4)
    assert out[:3].tolist() == [list(w) for _, _, w in KAT]


@needs_triton
@pytest.mark.parametrize("per_sample", [False, True])
def test_uint32_stream_identical_torch_and_triton(per_sample):
    """Keys with both words set (including negative int64 seeds), quads up to the top of the kernels'
    range (elements below 2**32: the counter's high word is 0 there; the generator's own high word is
    checked by the known answers), several streams: every word equal."""
    seeds = torch.tensor([0, 2**63 - 1, -5, 0x1234_5678_9ABC_DEF0 - 2**63], dtype=torch.int64, device=DEVICE)
    seed = NoiseSeed(seeds, 0 if per_sample else 1)
    for first_quad in (0, 2**30 - 8):
        got, _ = _triton_stream(seed, first_quad, 8, 32)
        want = R.philox_quads(seed, first_quad, 8)
        for j in range(4):
            assert torch.equal(got[j], want[j]), f"word {j}, first quad {first_quad}"


@needs_triton
@pytest.mark.parametrize("elem_offset", [0, 2**32 - 2**17, 3, 2**31 + 1])
def test_normals_torch_vs_triton_and_both_kernel_paths(elem_offset):
    """Same IEEE float32 operations on the same words: the same bits on both backends. The kernel's
    one-call-per-4-elements path (aligned offsets) and its one-call-per-element path give the same
    bits for the same elements."""
    seed = NoiseSeed(torch.tensor([11, 12], device=DEVICE), 1, elem_offset)
    _, got = _triton_stream(seed, 0, 1, 64)
    want = R.philox_normal(seed, 64)
    assert torch.equal(got, want)
    # the other path on an overlapping window: elements elem_offset + 1 .. + 63
    shifted = seed._replace(elem_offset=elem_offset + 1)
    _, got_shifted = _triton_stream(shifted, 0, 1, 64)
    assert torch.equal(got_shifted[:, :63], got[:, 1:])
    # the unaligned path holds for every offset mod 4, aligned ones included
    for shift in range(4):
        at = seed._replace(elem_offset=elem_offset + shift)
        assert torch.equal(_triton_stream(at, 0, 1, 64, aligned=False)[1], R.philox_normal(at, 64)), shift


def test_reference_normals_do_not_depend_on_the_window():
    seed = NoiseSeed(torch.tensor([7, -7]), 1)
    full = R.philox_normal(seed, 1000)
    for start, n in ((0, 1), (1, 7), (3, 500), (998, 2), (513, 487)):
        assert torch.equal(R.philox_normal(seed._replace(elem_offset=start), n), full[:, start:start + n])


# ---------------------------------------------------------------------------------------- statistics


def _normal_cdf(t):
    return 0.5 * (1 + torch.erf(t / math.sqrt(2)))


def _check_standard_normal(eps: torch.Tensor, what: str, z: float = 5.0):
    """Mean, variance and Kolmogorov-Smirnov distance of a float sample vs N(0, 1), each within
    z standard errors (KS: the asymptotic critical value at p ~ 1e-3 times z / 3.1)."""
    e = eps.double().flatten()
    n = e.numel()
    assert abs(e.mean()) < z / math.sqrt(n), f"{what}: mean {float(e.mean())}"
    assert abs(e.var() - 1) < z * math.sqrt(2 / n), f"{what}: variance {float(e.var())}"
    s = e.sort().values
    cdf = _normal_cdf(s)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max()
    assert ks < 1.95 * (z / 3.1) / math.sqrt(n), f"{what}: KS distance {float(ks)} for n = {n}"


def _check_uncorrelated(a: torch.Tensor, b: torch.Tensor, what: str, z: float = 5.0):
    a, b = a.double().flatten(), b.double().flatten()
    rho = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(rho) < z / math.sqrt(a.numel()), f"{what}: correlation {float(rho)}"


def test_reference_normals_are_standard_normal_and_uncorrelated():
    n = 1 << 16
    eps = R.philox_normal(NoiseSeed(torch.tensor([2024, 2025]), 1), n)  # two rows = streams 0 and 1
    _check_standard_normal(eps, "all")
    for lane in range(4):
        _check_standard_normal(eps[:, lane::4], f"lane {lane}")
    for lag in (1, 2, 3, 4, 5):
        _check_uncorrelated(eps[:, :-lag], eps[:, lag:], f"elements {lag} apart")
    _check_uncorrelated(eps[:, 0::2] ** 2, eps[:, 1::2] ** 2, "squares of a Box-Muller pair")  # share r
    _check_uncorrelated(eps[0], eps[1], "samples of one int seed (streams 0, 1)")
    by_seed = R.philox_normal(NoiseSeed(torch.tensor([2024, 2025]), 0), n)  # stream 0, adjacent seeds
    _check_uncorrelated(by_seed[0], by_seed[1], "adjacent seeds")
    _check_uncorrelated(by_seed[0], eps[1], "seed 2024 stream 1 vs seed 2025 stream 0")
    # the radius is bounded by the uniform's resolution: u >= 2**-33
    assert eps.abs().max() <= math.sqrt(-2 * math.log(2.0**-33)) + 1e-5


def test_the_statistical_checks_can_fail():
    eps = R.philox_normal(NoiseSeed(torch.tensor([5]), 1), 1 << 16)
    for bad, what in ((eps * 1.03, "scaled"), (eps + 0.03, "shifted"), (eps.abs() * torch.sign(eps[:, :1]), "folded")):
        with pytest.raises(AssertionError):
            _check_standard_normal(bad, what)
    with pytest.raises(AssertionError):
        _check_uncorrelated(eps[:, 1:], 0.9 * eps[:, 1:] + 0.1 * eps[:, :-1], "mixed")


@needs_triton
def test_triton_normals_are_standard_normal():
    _, eps = _triton_stream(NoiseSeed(torch.tensor([1, 2, 3, 4], device=DEVICE), 1), 0, 1, 2048)
    _check_standard_normal(eps.cpu(), "triton")
    _check_uncorrelated(eps[:, :-1].cpu(), eps[:, 1:].cpu(), "triton neighbours")


# ------------------------------------------------------------------------------ sde_step(noise_seed)


def _inputs(shape=(5, 3, 700), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return x, v, torch.linspace(1.0, 0.0, 11, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,kind,dtype", [("sde", "gaussian", torch.bfloat16), ("cps", "sq_err", torch.float32)])
def test_rollout_log_prob_equals_recompute_and_is_reproducible(backend, mode, kind, dtype):
    x, v, sigmas = _inputs(dtype=dtype)
    step = torch.tensor([0, 2, 4, 6, 8], device=DEVICE)
    kw = dict(mode=mode, noise_level=0.7, log_prob_kind=kind, backend=backend)
    out = flowrl.sde_step(x, v, sigmas, step, noise_seed=99, **kw)
    again = flowrl.sde_step(x, v, sigmas, step, noise_seed=99, **kw)
    assert torch.equal(out.prev_sample, again.prev_sample) and torch.equal(out.log_prob, again.log_prob)
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, step, **kw)
    assert torch.equal(lp, out.log_prob)
    other = flowrl.sde_step(x, v, sigmas, step, noise_seed=100, **kw)
    assert not torch.equal(other.prev_sample, out.prev_sample)
    # the noise is exactly the reference's Philox noise fed as noise= (torch), or within float32
    # rounding of it (triton: log / cos / sin implementations differ)
    eps = R.philox_normal(NoiseSeed(torch.full((5,), 99, device=DEVICE), 1), x[0].numel()).reshape(x.shape)
    explicit = flowrl.sde_step(x, v, sigmas, step, noise=eps, **kw)
    if backend == "torch":
        assert torch.equal(explicit.prev_sample, out.prev_sample)
        assert torch.equal(explicit.log_prob, out.log_prob)
    else:
        tol = torch.finfo(dtype).eps  # an ulp of eps moves x' by std * ulp, then x' is rounded
        torch.testing.assert_close(explicit.prev_sample, out.prev_sample, rtol=2 * tol, atol=4 * tol)
        torch.testing.assert_close(explicit.log_prob, out.log_prob, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int_seed_rows_differ_and_seed_tensor_is_batch_invariant(backend):
    x, v, sigmas = _inputs()
    x, v = x[:1].expand(5, -1, -1).contiguous(), v[:1].expand(5, -1, -1).contiguous()  # 5 equal rows
    out = flowrl.sde_step(x, v, sigmas, 3, noise_seed=7, backend=backend)
    for b in range(1, 5):
        assert not torch.equal(out.prev_sample[b], out.prev_sample[0]), f"row {b} repeats row 0"
    seeds = torch.tensor([7, 8, 9, 10, 11], device=DEVICE)
    batch = flowrl.sde_step(x, v, sigmas, 3, noise_seed=seeds, backend=backend)
    for b in range(5):
        alone = flowrl.sde_step(x[b:b + 1], v[b:b + 1], sigmas, 3, noise_seed=seeds[b:b + 1], backend=backend)
        assert torch.equal(alone.prev_sample[0], batch.prev_sample[b])
        assert torch.equal(alone.log_prob[0], batch.log_prob[b])
    # stream 0 of an int seed is what the per-sample seed of the same value draws
    assert torch.equal(batch.prev_sample[0], out.prev_sample[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cut", [1024, 1027])  # a chunk boundary (aligned), and an unaligned one
def test_shards_draw_their_slice_of_the_noise(backend, cut):
    """Two calls on the halves of every flattened sample, each with its elem_offset, emit exactly the
    halves of the one-call sample (what flowrl.distributed passes per rank)."""
    x, v, sigmas = _inputs(shape=(2, 2051))
    kw = dict(mode="sde", noise_level=0.7, backend=backend)
    full = flowrl.sde_step(x, v, sigmas, 2, noise_seed=31, **kw)
    for lo, hi in ((0, cut), (cut, 2051)):
        shard = ShardContext(numel=2051, offset=lo, gather=lambda partials: partials)
        part = flowrl.sde_step(x[:, lo:hi].contiguous(), v[:, lo:hi].contiguous(), sigmas, 2, noise_seed=31,
                               shard=shard, **kw)
        assert torch.equal(part.prev_sample, full.prev_sample[:, lo:hi]), f"shard [{lo}, {hi})"
        assert torch.equal(part.prev_sample_mean, full.prev_sample_mean[:, lo:hi])


@needs_triton
def test_triton_matches_torch_and_differentiates():
    x, v, sigmas = _inputs(shape=(3, 2, 600), dtype=torch.float32)
    step = torch.tensor([1, 5, 9], device=DEVICE)
    w = torch.tensor([1.0, -2.0, 0.5], device=DEVICE)
    grads = {}
    for backend in ("torch", "triton"):
        vv = v.clone().requires_grad_()
        out = flowrl.sde_step(x, vv, sigmas, step, noise_seed=torch.tensor([3, 1, 4], device=DEVICE), backend=backend)
        ((out.prev_sample.sum(dim=(1, 2)) + out.log_prob) * w).sum().backward()
        grads[backend] = (out.prev_sample.detach(), out.log_prob.detach(), vv.grad)
    for got, want in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_float64_reference_takes_philox_noise():
    x, v, sigmas = _inputs(shape=(2, 300), dtype=torch.float64)
    out = flowrl.sde_step(x, v, sigmas, 4, noise_seed=5, backend="torch")
    assert out.prev_sample.dtype == torch.float64
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, 4, backend="torch")
    assert torch.equal(lp, out.log_prob)


# ---------------------------------------------------------------------------------------- validation


def test_noise_seed_argument_errors():
    x, v, sigmas = _inputs(shape=(2, 8), dtype=torch.float32)
    call = lambda **kw: flowrl.sde_step(x, v, sigmas, 0, backend="torch", **kw)  # noqa: E731
    with pytest.raises(ValueError, match="noise_seed.*noise"):
        call(noise_seed=1, noise=torch.zeros_like(x))
    with pytest.raises(ValueError, match="noise_seed.*generator"):
        call(noise_seed=1, generator=torch.Generator())
    for bad in (True, 1.5, "7", [1, 2]):
        with pytest.raises(TypeError, match="noise_seed"):
            call(noise_seed=bad)
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=r"noise_seed must be in \[0, 2\*\*63\)"):
            call(noise_seed=bad)
    with pytest.raises(TypeError, match="noise_seed must be an integer tensor"):
        call(noise_seed=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="noise_seed must be an integer tensor"):
        call(noise_seed=torch.tensor([True, False]))
    for shape in ((), (3,), (2, 1)):
        with pytest.raises(ValueError, match=r"noise_seed must be an int or a tensor of shape \[B\] = \[2\]"):
            call(noise_seed=torch.zeros(shape, dtype=torch.int64))
    with pytest.raises(ValueError, match="noise_seed is on meta"):
        call(noise_seed=torch.zeros(2, dtype=torch.int64, device="meta"))
    # int32 seeds are their int64 values
    a = call(noise_seed=torch.tensor([3, -4], dtype=torch.int32))
    b = call(noise_seed=torch.tensor([3, -4], dtype=torch.int64))
    assert torch.equal(a.prev_sample, b.prev_sample)


# ------------------------------------------------------------------------------------- Box-Muller


def _words(n=1 << 16):
    """uint32 words (int64): evenly spaced over [0, 2**32), the ends, the angle word's mantissa and sign
    edges and the radius word's mantissa split and top (where u nears 1), each with its neighbours."""
    words = torch.linspace(0, 2**32 - 1, n, dtype=torch.float64).round().to(torch.int64)
    edges = torch.tensor([0, 2**22, 2**23, 2**31, 2**31 + 2**22, 2**31 + 2**23, 2**32 - 1, 0x3F3504F3, 0xB504F333,
                          2**32 - 128, 2**32 - 256])
    edges = torch.cat([edges, (edges + 1) % 2**32, (edges - 1) % 2**32])
    return torch.cat([words, edges])


def _theta(x):
    """The angle of word x (float64): -pi / 2 + k pi / 2**23 for k = bit 31 * 2**23 + the low 23 bits."""
    return -math.pi / 2 + (((x >> 31) & 1) * 2**23 + (x & 0x7FFFFF)).double() * (math.pi / 2**23)


def test_box_muller_is_accurate_to_a_few_ulps():
    """The polynomial radius and half-circle sine / cosine against float64 over the words."""
    from flowrl.contract import U_SCALE

    x = _words()
    u = R.fma_f32(x.to(torch.float32), U_SCALE, 2.0**-33).double()  # the float32 uniform both backends form
    assert float(u.min()) == 2.0**-33 and float(u.max()) == 1 - 2.0**-24  # never 0 or 1
    exact_r = torch.sqrt(-2 * torch.log(u))
    r = R.box_muller_radius(x).double()
    assert float(((r - exact_r).abs() / exact_r).max()) < 2e-7
    assert float(r.min()) > 3.4e-4 and float(r.max()) <= math.sqrt(-2 * math.log(2.0**-33)) + 1e-6
    half = torch.full_like(x, 2**31)  # u = 1/2: r = sqrt(2 ln 2)
    n_cos, n_sin = R.box_muller(half, x)
    r_half = R.box_muller_radius(half).double()
    theta = _theta(x)
    assert float((n_cos.double() / r_half - torch.cos(theta)).abs().max()) < 1.6e-7
    assert float((n_sin.double() / r_half - torch.sin(theta)).abs().max()) < 2.1e-7
    nonzero = torch.sin(theta).abs() > 1e-12  # sin(pi) is 1.2e-16 in float64; ours is 0 there
    assert float(((n_sin.double() / r_half - torch.sin(theta)) / torch.sin(theta))[nonzero].abs().max()) < 2.1e-7
    assert float(((n_cos.double() / r_half) ** 2 + (n_sin.double() / r_half) ** 2 - 1).abs().max()) < 4.1e-7


def test_box_muller_angle_covers_the_circle_uniformly():
    """The angle word maps onto 2**24 equally spaced angles: k = bit 31 * 2**23 + the low 23 bits gives
    theta = -pi / 2 + k pi / 2**23 (the sign of both outputs turns the half circle into the other), so
    each quadrant gets a quarter of the words, in order; bits 23 .. 30 do not move it."""
    k = torch.arange(0, 2**24, 2**24 // 64, dtype=torch.int64) + 12345
    x = ((k >> 23) << 31) | (k & 0x7FFFFF)
    n_cos, n_sin = R.box_muller(torch.full_like(x, 2**31), x)
    theta = torch.atan2(n_sin.double(), n_cos.double())
    lattice = -math.pi / 2 + k.double() * (math.pi / 2**23)
    assert float(torch.remainder(theta - lattice + math.pi, 2 * math.pi).sub(math.pi).abs().max()) < 3e-7
    quadrant = (torch.remainder(theta + math.pi / 2, 2 * math.pi) / (math.pi / 2)).floor().long()
    assert quadrant.tolist() == [q for q in range(4) for _ in range(16)]
    moved = R.box_muller(torch.full_like(x, 2**31), x | (0x7F << 23))
    assert torch.equal(moved[0], n_cos) and torch.equal(moved[1], n_sin)


@needs_triton
def test_box_muller_same_bits_on_both_backends():
    """Only IEEE adds, multiplies and square root: the kernels' box_muller equals the reference's bit
    for bit (unlike the platforms' logf / sinf / cosf)."""
    x = _words(4096 - 33)
    angle = x.flip(0).contiguous()
    radius, angle = x.to(DEVICE), angle.to(DEVICE)
    n_cos, n_sin = torch.empty(x.shape, device=DEVICE), torch.empty(x.shape, device=DEVICE)
    _box_muller_kernel[(1,)](radius, angle, n_cos, n_sin, N=x.numel())
    want_cos, want_sin = R.box_muller(radius, angle)
    assert torch.equal(n_cos, want_cos) and torch.equal(n_sin, want_sin)


@needs_triton
def test_branch_free_square_root_is_correctly_rounded():
    """The radius's square root without sqrt_rn's slow-path branch: the correctly rounded float32
    square root (float64's, rounded) over the range Box-Muller gives it, [2**-100, 46.2], and every
    float32 of a stretch of [1, 4) (both exponent parities)."""
    g = torch.Generator().manual_seed(0)
    spread = 2.0 ** (torch.rand(1 << 16, generator=g, dtype=torch.float64) * 105.6 - 100)
    dense = (torch.arange(1 << 16, dtype=torch.int32) * 255 + 0x3F800000).view(torch.float32)
    ends = torch.tensor([2.0**-100, 46.2, 1.0, 2.0, 4.0 - 2.0**-22], dtype=torch.float64)
    x = torch.cat([spread, dense.double(), ends]).to(torch.float32).to(DEVICE)
    x = torch.cat([x, x[: (1 << 18) - x.numel()]])  # a power of two
    got = torch.empty_like(x)
    _sqrt_kernel[(1,)](x, got, N=x.numel())
    assert torch.equal(got, R.sqrt_rn(x))


@needs_triton
def test_call_free_square_root_is_correctly_rounded_from_zero_up():
    """cps' coefficient square root without sqrt_rn's slow-path call: the correctly rounded float32
    square root (float64's, rounded) of zero, every subnormal exponent, the normal range, and every
    float32 of a stretch of [1, 4)."""
    g = torch.Generator().manual_seed(1)
    normal = 2.0 ** (torch.rand(1 << 15, generator=g, dtype=torch.float64) * 252 - 126)
    subnormal = (torch.randint(1, 1 << 23, (1 << 14,), generator=g, dtype=torch.int32)).view(torch.float32)
    dense = (torch.arange(1 << 14, dtype=torch.int32) * 1021 + 0x3F800000).view(torch.float32)
    ends = torch.tensor([0.0, 2.0**-149, 2.0**-126, 2.0**-100, 2.0**-100 * (1 - 2.0**-24), 1.0, 3.4e38],
                        dtype=torch.float64)
    x = torch.cat([normal.to(torch.float32), subnormal, dense, ends.to(torch.float32)]).to(DEVICE)
    x = torch.cat([x, x[: (1 << 17) - x.numel()]])  # a power of two
    got = torch.empty_like(x)
    _sqrt_nonneg_kernel[(1,)](x, got, N=x.numel())
    assert torch.equal(got, R.sqrt_rn(x))
    assert (x == 0).any() and (x < 2.0**-126).sum() > (1 << 13)


# -------------------------------------------------------------------------- the stream's version

# stream 4's first normals of seed 2024 (stream 0) and seed -7 (stream 1), float32 bits as hex: a
# change of the noise function fails here, and must bump flowrl.contract.NOISE_STREAM_VERSION
STREAM_4 = [
    ["0x1.012ca8p+0", "0x1.c75b56p-7", "0x1.a60bbp-4", "0x1.24b1cep-3", "0x1.8b524ep-1", "-0x1.3c1e92p+0",
     "0x1.d90874p-2", "0x1.6efa2ep-5"],
    ["0x1.12c6b2p+0", "-0x1.0b94acp-1", "0x1.3a8ce0p-3", "-0x1.0bd0eep+1", "-0x1.90c15cp-2", "-0x1.2a08f4p-2",
     "0x1.5184e6p+1", "-0x1.27ad0ep+1"],
]
# stream 3's (flowrl before stream 4): the same Philox words, another Box-Muller (below); stream 2 had
# -0x1.923996p-2 where stream 3 has -0x1.923998p-2 (its unfused polynomials)
STREAM_3 = [
    ["0x1.fee73p-1", "-0x1.dee4bcp-4", "0x1.38312ap-3", "0x1.69dd2p-4", "0x1.1662d2p-1", "-0x1.59dee8p+0",
     "0x1.f7e28p-3", "-0x1.92f9c6p-2"],
    ["0x1.6e407p-1", "0x1.e95a7ep-1", "0x1.a81a8cp-4", "0x1.0c359ep+1", "-0x1.923998p-2", "-0x1.280c5ap-2",
     "0x1.85ae84p+1", "0x1.bcef26p+0"],
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_version_4_known_answers(backend):
    from flowrl.contract import NOISE_STREAM_VERSION

    assert NOISE_STREAM_VERSION == 4
    want = torch.tensor([[float.fromhex(h) for h in row] for row in STREAM_4])
    seed = NoiseSeed(torch.tensor([2024, -7], device=DEVICE), 1, 0)
    got = R.philox_normal(seed, 8) if backend == "torch" else _triton_stream(seed, 0, 1, 8)[1]
    assert torch.equal(got.cpu(), want)


def _stream_3_box_muller(a, b, fma):
    """Stream 3's Box-Muller (docs/contract.md, Noise: what stream 4 changed), transcribed here with its
    constants: u = (a + 1/2) 2**-32, -2 ln u clamped to 2**-100, and an octant angle from b's low 29
    bits (bit 29 swaps sine and cosine, bit 31 negates the cosine, bit 30 the sine)."""
    from flowrl import contract

    u = (a.to(torch.float32) + 0.5) * 2.0**-32
    bits = u.view(torch.int32)
    e = (bits - contract.LOG_SPLIT) >> 23
    f = (bits - e * (1 << 23)).view(torch.float32) - 1.0
    p = fma(f, contract.LOG_P7, contract.LOG_P6)
    for coefficient in (contract.LOG_P5, contract.LOG_P4, contract.LOG_P3, contract.LOG_P2, contract.LOG_P1, contract.LOG_P0):
        p = fma(f, p, coefficient)
    r = R.sqrt_rn(torch.clamp_min(fma(f, p, e.to(torch.float32) * contract.NEG_2_LN2), 2.0**-100))
    t = (b & 0x1FFFFFFF).to(torch.float32) * 2.0**-29 + 2.0**-30
    t2 = t * t
    sin_p = t * fma(t2, fma(t2, fma(t2, -3.59504520019982e-05, 0.00249000103212893), -0.08074543625116348),
                    0.7853981852531433)
    cos_p = fma(t2, fma(t2, fma(t2, -0.00031916017178446054, 0.01585039682686329), -0.3084245026111603), 1.0)
    swap = (b & 2**29) != 0
    n_cos, n_sin = r * torch.where(swap, sin_p, cos_p), r * torch.where(swap, cos_p, sin_p)
    return torch.where((b >> 31) & 1 == 1, -n_cos, n_cos), torch.where((b >> 30) & 1 == 1, -n_sin, n_sin)


def test_streams_3_and_2_drew_the_same_words_through_another_box_muller():
    """docs/contract.md, Noise: stream 3 took stream 4's Philox words and log polynomial with u = (a +
    1/2) 2**-32 clamped at 2**-100 and an octant angle; stream 2 was stream 3 with its fmas unfused (a
    multiply and an add, two roundings). Their known answers from the shared words."""
    seed = NoiseSeed(torch.tensor([2024, -7]), 1, 0)
    x0, x1, x2, x3 = R.philox_quads(seed, 0, 2)
    stream = {}
    for version, fma in ((3, R.fma_f32), (2, lambda a, b, c: a * b + c)):
        n0, n1 = _stream_3_box_muller(x0, x1, fma)
        n2, n3 = _stream_3_box_muller(x2, x3, fma)
        stream[version] = torch.stack((n0, n1, n2, n3), dim=-1).reshape(2, 8)
    assert torch.equal(stream[3], torch.tensor([[float.fromhex(h) for h in row] for row in STREAM_3]))
    assert (stream[2] != stream[3]).nonzero().tolist() == [[1, 4]]
    assert stream[2][1, 4].item() == float.fromhex("-0x1.923996p-2")
    assert not torch.equal(stream[3], R.philox_normal(seed, 8))


def _round_f32(q):
    """A nonzero Fraction rounded to the nearest float32 (ties to even), exactly: its 24-bit
    significand by Python's round() of a Fraction (half to even)."""
    from fractions import Fraction

    e = math.frexp(float(q))[1] - 24
    while abs(q) / Fraction(2) ** e >= 2**24:
        e += 1
    while abs(q) / Fraction(2) ** e < 2**23:
        e -= 1
    return float(round(q / Fraction(2) ** e) * Fraction(2) ** e)


def test_reference_fma_rounds_once():
    """R.fma_f32 against exact rational arithmetic: random float32 triples over many exponents, their
    cancellations, and sums a hair off a float32 midpoint, where rounding to float64 and then to
    float32 (two roundings) picks the wrong neighbour: 2**24 + 2 + (1 - 2**-30) is 2**24 + 2, not + 4.
    The kernels' tl.fma rounds once (test_box_muller_same_bits_on_both_backends)."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(3)

    def rand(n, lo, hi):
        mant = torch.rand(n, generator=g, dtype=torch.float64) + 1
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (sign * mant * 2.0 ** torch.randint(lo, hi, (n,), generator=g)).to(torch.float32)

    a, b, c = rand(3000, -20, 20), rand(3000, -20, 20), rand(3000, -30, 30)
    c = torch.cat([c, -(a * b)])  # the product's rounding error: all of it must survive
    a, b = torch.cat([a, a]), torch.cat([b, b])
    ties_a = torch.tensor([1 + 2.0**-15, 1 + 2.0**-15, 2 + 2.0**-14], dtype=torch.float32)
    ties_b = torch.tensor([1 - 2.0**-15, -(1 - 2.0**-15), 2 - 2.0**-14], dtype=torch.float32)
    ties_c = torch.tensor([2.0**24 + 2, -(2.0**24 + 2), 2.0**26 + 8], dtype=torch.float32)
    a, b, c = torch.cat([a, ties_a]), torch.cat([b, ties_b]), torch.cat([c, ties_c])
    got = R.fma_f32(a, b, c)
    want = [_round_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) if float(x) * float(y) + float(z) != 0
            else 0.0 for x, y, z in zip(a, b, c)]
    assert got.tolist() == want
    assert got[-3:].tolist() == [2.0**24 + 2, -(2.0**24 + 2), 2.0**26 + 8]
    twice = (a.double() * b.double() + c.double()).float()  # rounded twice
    assert twice[-3:].tolist() != got[-3:].tolist()
    assert R.fma_f32(torch.tensor([3.0]), 0.5, 0.25).tolist() == [1.75]  # Python float operands


def test_reference_sqrt_rn_is_correctly_rounded():
    """R.sqrt_rn (the kernels' sqrt_rn in torch) against Python's IEEE double root rounded to float32
    (two roundings are exact for a square root: 53 >= 2 * 24 + 2 bits): the normal range, subnormals,
    zero, the largest float32 and every 509th float32 of [1, 4), on a CPU whose torch float32 and
    float64 roots may be an ulp off."""
    g = torch.Generator().manual_seed(5)
    normal = (2.0 ** (torch.rand(1 << 14, generator=g, dtype=torch.float64) * 254 - 126)).to(torch.float32)
    subnormal = torch.randint(1, 1 << 23, (1 << 12,), generator=g, dtype=torch.int32).view(torch.float32)
    dense = (torch.arange(32960, dtype=torch.int32) * 509 + 0x3F800000).view(torch.float32)
    x = torch.cat([normal, subnormal, dense, torch.tensor([0.0, 2.0**-149, 3.4028234663852886e38])])
    want = torch.tensor([math.sqrt(v) for v in x.tolist()], dtype=torch.float64).to(torch.float32)
    assert torch.equal(R.sqrt_rn(x), want)
    assert 3.999 < float(dense[-1]) < 4 and R.sqrt_rn(x).dtype == torch.float32


def test_branching_trees_record_the_stream_and_refuse_another():
    """A branching trajectory's tree records the noise stream its keys drew from; a tree of another
    stream (or of stream 1, from before the field) is refused, never replayed with other noise."""
    import json

    from flowrl.contract import NOISE_STREAM_VERSION
    from flowrl.data.trajectory import RolloutTrajectory
    from flowrl.data.tree import BranchSpec
    from flowrl.rollout.branching import branch_rollout

    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    x0 = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    traj = branch_rollout(lambda x, j, roots: torch.sin(x) * (j + 1) / 4, x0, sched.sigmas.clone(),
                          BranchSpec(steps=[1], k=2, seed=5))
    wire = json.loads(json.dumps(traj.to_wire()))
    assert int(traj.tree.to_tensors()["noise_stream"]) == NOISE_STREAM_VERSION
    assert RolloutTrajectory.from_wire(wire).tree.seed == 5
    for change, message in ((NOISE_STREAM_VERSION + 1, f"noise stream {NOISE_STREAM_VERSION + 1}"),
                            (3, "noise stream 3; flowrl draws stream 4"), (None, "noise stream 1 .no 'noise_stream'.")):
        tensors = dict(traj.tree.to_tensors())
        if change is None:
            del tensors["noise_stream"]
        else:
            tensors["noise_stream"] = torch.tensor(change)
        bad = dict(wire, tree=flowrl.data.serialization.to_wire(tensors))
        with pytest.raises(ValueError, match=message):
            RolloutTrajectory.from_wire(json.loads(json.dumps(bad)))


def test_reference_normals_pass_a_chi_square_test_tails_included():
    """2**20 normals (4 seeds x 2**18) in 100 equiprobable bins plus the tails beyond |x| = 4 (102
    bins): the chi-square statistic below dof + 4.5 sqrt(2 dof) + 20 (185 for 101 degrees of freedom,
    about the p = 1e-6 critical value, 183.5), and the tails reached: max |x| above 4.5, <= 6.76."""
    eps = R.philox_normal(NoiseSeed(torch.tensor([31, 32, 33, 34]), 0), 1 << 18).double().flatten()
    normal = torch.distributions.Normal(0.0, 1.0)
    inner = normal.icdf(torch.linspace(0, 1, 101, dtype=torch.float64)[1:-1])
    edges = torch.cat([torch.tensor([-4.0], dtype=torch.float64), inner[(inner > -4) & (inner < 4)],
                       torch.tensor([4.0], dtype=torch.float64)])
    counts = torch.bucketize(eps, edges).bincount(minlength=edges.numel() + 1).double()
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), normal.cdf(edges), torch.ones(1, dtype=torch.float64)])
    expected = eps.numel() * (cdf[1:] - cdf[:-1])
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    assert chi2 < dof + 4.5 * math.sqrt(2 * dof) + 20, f"chi-square {chi2:.1f} with {dof} degrees of freedom"
    assert 4.5 < float(eps.abs().max()) <= math.sqrt(-2 * math.log(2.0**-33)) + 1e-6


def test_the_chi_square_check_can_fail():
    eps = R.philox_normal(NoiseSeed(torch.tensor([31]), 0), 1 << 18).double().flatten()
    normal = torch.distributions.Normal(0.0, 1.0)
    edges = normal.icdf(torch.linspace(0, 1, 101, dtype=torch.float64)[1:-1])
    for bad in (eps * 1.01, eps + 0.01):
        counts = torch.bucketize(bad, edges).bincount(minlength=101).double()
        expected = torch.full_like(counts, bad.numel() / 100)
        assert float(((counts - expected) ** 2 / expected).sum()) > 99 + 4.5 * math.sqrt(2 * 99) + 20
