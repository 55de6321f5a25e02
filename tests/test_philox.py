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
from flowrl import reference as R
from flowrl._validate import NoiseSeed
from flowrl.step_spec import ShardContext
from flowrl.kernels.common import philox4x32_10, philox_key, philox_normal_block, philox_quad, sincospi

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
def _sincospi_kernel(u_ptr, sin_ptr, cos_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    sin_u, cos_u = sincospi(tl.load(u_ptr + i))
    tl.store(sin_ptr + i, sin_u)
    tl.store(cos_ptr + i, cos_u)


@triton.jit
def _stream_kernel(seeds_ptr, words_ptr, normals_ptr, stream_stride, first_quad, elem_offset,
                   NQ: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Program b: the uint32 words of quads first_quad + arange(NQ) and the normals of elements
    elem_offset + arange(BLOCK) of sample b, through the kernels' own helpers."""
    row = tl.program_id(0).to(tl.int64)
    k0, k1 = philox_key(tl.load(seeds_ptr + row))
    stream = (row * stream_stride).to(tl.uint32)
    q = first_quad + tl.arange(0, NQ).to(tl.int64)
    words = philox_quad(k0, k1, stream, q)
    for j in tl.static_range(4):
        tl.store(words_ptr + (row * 4 + j) * NQ + tl.arange(0, NQ), words[j].to(tl.int64))
    eps = philox_normal_block(k0, k1, stream, elem_offset, BLOCK, ALIGNED)
    tl.store(normals_ptr + row * BLOCK + tl.arange(0, BLOCK), eps)


def _triton_stream(seed: NoiseSeed, first_quad: int, nq: int, block: int):
    b = seed.seeds.shape[0]
    words = torch.empty((b, 4, nq), dtype=torch.int64, device=seed.seeds.device)
    normals = torch.empty((b, block), dtype=torch.float32, device=seed.seeds.device)
    _stream_kernel[(b,)](seed.seeds, words, normals, seed.stream_stride, first_quad, seed.elem_offset,
                         NQ=nq, BLOCK=block, ALIGNED=seed.elem_offset % 4 == 0)
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
    """Keys with both words set (including negative int64 seeds), quads past 2**32 (the counter's
    high word), several streams: every word equal."""
    seeds = torch.tensor([0, 2**63 - 1, -5, 0x1234_5678_9ABC_DEF0 - 2**63], dtype=torch.int64, device=DEVICE)
    seed = NoiseSeed(seeds, 0 if per_sample else 1)
    for first_quad in (0, 2**32 - 3):
        got, _ = _triton_stream(seed, first_quad, 8, 32)
        want = R.philox_quads(seed, first_quad, 8)
        for j in range(4):
            assert torch.equal(got[j], want[j]), f"word {j}, first quad {first_quad}"


@needs_triton
@pytest.mark.parametrize("elem_offset", [0, 4 * 2**32 - 8, 3, 2**32 + 1])
def test_normals_torch_vs_triton_and_both_kernel_paths(elem_offset):
    """Same float32 operations on the same words: equal to an ulp or so (log/cos/sin differ between
    implementations). The kernel's one-call-per-4-elements path (aligned offsets) and its
    one-call-per-element path give the same bits for the same elements."""
    seed = NoiseSeed(torch.tensor([11, 12], device=DEVICE), 1, elem_offset)
    _, got = _triton_stream(seed, 0, 1, 64)
    want = R.philox_normal(seed, 64)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=4e-7)
    # the other path on an overlapping window: elements elem_offset + 1 .. + 63
    shifted = seed._replace(elem_offset=elem_offset + 1)
    _, got_shifted = _triton_stream(shifted, 0, 1, 64)
    assert torch.equal(got_shifted[:, :63], got[:, 1:])


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
    kw = dict(mode=mode, noise_level=0.7, log_prob=kind, backend=backend)
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


# ---------------------------------------------------------------------------------- sin / cos (pi u)


def _box_muller_angles(n=1 << 16):
    """float32 u = int32(word) * 2**-31 over evenly spaced words, both ends and the quadrant edges."""
    words = torch.linspace(-(2**31), 2**31 - 1, n, dtype=torch.float64).round().to(torch.int64)
    u = (words.to(torch.float32) * 2.0**-31)
    edges = torch.tensor([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 2.0**-31, -(2.0**-31)])
    return torch.cat([u, edges, torch.nextafter(edges, torch.full_like(edges, 2.0))])


def test_sincospi_is_accurate_to_a_few_ulps():
    """The polynomial sin(pi u), cos(pi u) of the Box-Muller step against float64 over [-1, 1]."""
    u = _box_muller_angles()
    sin_u, cos_u = R.sincospi(u)
    exact = u.double() * math.pi
    assert float((sin_u.double() - torch.sin(exact)).abs().max()) < 3e-7
    assert float((cos_u.double() - torch.cos(exact)).abs().max()) < 3e-7
    assert float((sin_u.double() ** 2 + cos_u.double() ** 2 - 1).abs().max()) < 5e-7


@needs_triton
def test_sincospi_same_bits_on_both_backends():
    """Only IEEE adds, multiplies and floor: the kernels' sincospi equals the reference's bit for bit
    (unlike the platforms' sinf / cosf)."""
    u = _box_muller_angles(4096 - 22).to(DEVICE)
    sin_k, cos_k = torch.empty_like(u), torch.empty_like(u)
    _sincospi_kernel[(1,)](u, sin_k, cos_k, N=u.numel())
    sin_r, cos_r = R.sincospi(u)
    assert torch.equal(sin_k, sin_r) and torch.equal(cos_k, cos_r)
