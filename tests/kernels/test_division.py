"""kernels.common.div_rn_by_scalar: division of a tile by a per-sample scalar through the scalar's
correctly rounded reciprocal and Markstein's correction, against IEEE float32 division (torch's on the
CPU). ddim's x0_hat / eps_hat divide by sqrt(a) / sqrt(1 - a) this way, so its means are still
diffusers' IEEE operations (docs/contract.md; the proof is in docs/kernels.md).

Two parts: the operation sequence emulated with exact float64 arithmetic (``reference.fma_f32``) over
every numerator significand for the divisor significands where the proof's error bound is tight, and
the kernel helper itself through the interpreter (CUDA when present) on zeros, infinities, NaN, the
normal range and the tiny numerators where it may be an ulp off."""
import random

import pytest
import torch
import triton
import triton.language as tl

import flowrl
from flowrl.backends import reference as R
from flowrl.kernels.common import div_rn_by_scalar

TRITON_OK = "triton" in flowrl.available_backends() and (
    torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0")
)
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ONE_BITS = 127 << 23  # 1.0f


def _f32(bits) -> torch.Tensor:
    return torch.as_tensor(bits, dtype=torch.int32).view(torch.float32)


def _emulated(a: torch.Tensor, b: torch.Tensor, correct: bool = True) -> torch.Tensor:
    """The helper's float32 operations, each rounded once as on the GPU (fma_f32 is exact)."""
    b_inv = torch.tensor(1.0) / b
    q = a * b_inv
    if not correct:
        return q
    q1 = R.fma_f32(R.fma_f32(b, q, -a), -b_inv, q)
    return torch.where(q1 == q1, q1, q)


# every float32 significand in [1, 2): scaling a or b by a power of two scales every step exactly,
# so these cover every normal numerator (within 2**-100 .. 2**100) for a divisor's significand
SIGNIFICANDS = _f32(torch.arange(1 << 23, dtype=torch.int32) + ONE_BITS)


# ~2 s each: the quick loop keeps the binade's top (the hard case), the full suite the other eight
@pytest.mark.parametrize("b_bits", [(1 << 23) - 1] + [pytest.param(b, marks=pytest.mark.slow) for b in
                                                   [(1 << 23) - 2, (1 << 23) - 3, (1 << 23) - 7, 0, 1]
                                                   + random.Random(0).sample(range(1 << 23), 3)])
def test_markstein_division_equals_ieee_division_for_every_numerator(b_bits):
    """The top of the divisor's binade is where q = a / b's first approximation can be 1.5 ulps off
    and the residual inexact (docs/kernels.md): every numerator significand there, and elsewhere."""
    b = _f32(ONE_BITS + b_bits)
    assert torch.equal(_emulated(SIGNIFICANDS, b).view(torch.int32), (SIGNIFICANDS / b).view(torch.int32))


def test_the_correction_is_needed():
    """Without Markstein's correction a b_inv misses IEEE division now and then (so the test above
    can fail): the first approximation alone is not correctly rounded."""
    b = _f32(ONE_BITS + (1 << 23) - 1)
    wrong = _emulated(SIGNIFICANDS, b, correct=False) != SIGNIFICANDS / b
    assert wrong.sum() > 1000


@triton.jit
def _divide_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    """Row r of a [R, N] divided by b[r], as the ddim kernels divide: the reciprocal once per program."""
    row = tl.program_id(0).to(tl.int64)
    i = row * N + tl.arange(0, N)
    b = tl.load(b_ptr + row)
    tl.store(out_ptr + i, div_rn_by_scalar(tl.load(a_ptr + i), b, tl.div_rn(1.0, b)))


def _divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.to(DEVICE), b.to(DEVICE)
    out = torch.empty_like(a)
    _divide_kernel[(a.shape[0],)](a, b, out, N=a.shape[1])
    return out.cpu()


# ddim's divisors: sqrt(alpha-bar) and sqrt(1 - alpha-bar) of real schedules, 1, and the ends of (0, 1]
DIVISORS = torch.tensor([1.0, 0.0683, 0.75, 0.999, 0.9995, 2.0**-12 * 1.3, 0.5, 2.0 - 2.0**-23])


@needs_triton
def test_kernel_helper_is_ieee_division_in_range_with_signed_zeros_infinities_and_nan():
    g = torch.Generator().manual_seed(3)
    n = 1 << 12
    shape = (DIVISORS.numel(), n)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    normal = sign * (1 + torch.rand(shape, generator=g)) * 2.0 ** torch.randint(-100, 100, shape, generator=g).float()
    dense = SIGNIFICANDS[torch.randint(0, 1 << 23, (DIVISORS.numel(), n), generator=g)]
    ends = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 2.0**-100, 2.0**100,
                         -(2.0**100), 1.0, -1.0, 2.0 - 2.0**-23, 1.5, 3.0, 0.1])
    a = torch.cat([normal, dense, ends.expand(DIVISORS.numel(), -1)], dim=1)
    a = torch.cat([a, a[:, : (1 << 14) - a.shape[1]]], dim=1)  # a power of two per row
    got, want = _divide(a, DIVISORS), a / DIVISORS[:, None]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN's bits, zeros' signs too
    assert (torch.signbit(a) & (a == 0)).any() and a.isinf().any() and a.isnan().any()


@needs_triton
def test_kernel_helper_below_two_to_the_minus_100_is_within_an_ulp():
    """Numerators below 2**-100 (subnormal quotients included): the residual is no longer exact; the
    quotient stays within one unit in the last place of IEEE division (stated in docs/contract.md)."""
    g = torch.Generator().manual_seed(4)
    tiny = _f32(torch.randint(1, (127 - 100) << 23, (DIVISORS.numel(), 1 << 14), generator=g, dtype=torch.int32))
    got, want = _divide(tiny, DIVISORS), tiny / DIVISORS[:, None]
    ulps = (got.view(torch.int32) - want.view(torch.int32)).abs()
    assert ulps.max() <= 1
    assert ulps.sum() > 0  # the statement is about a real difference: a full ulp now and then


_FMA_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def fma_kernel(a_ptr, c_ptr, out_ptr):
    a = tl.load(a_ptr)
    tl.store(out_ptr, tl.fma(a, a, tl.load(c_ptr)))

a, c, out = torch.tensor([1 + 2.0**-12]), torch.tensor([-(1 + 2.0**-11)]), torch.empty(1)
fma_kernel[(1,)](a, c, out)
print(triton.__version__, out.item().hex())
"""


@pytest.mark.parametrize("which", ["installed", pytest.param("3.6", marks=pytest.mark.slow)])  # 3.6: a subprocess, ~5 s
def test_interpreters_fma(which):
    """docs/contract.md and the helpers' docstrings: triton 3.9's interpreter rounds tl.fma once (the
    kernels' div_rn_by_scalar and Box-Muller are the GPU's bits under it, as CI runs them), triton
    3.6's runs it as a multiply and an add. (1 + 2**-12)**2 - (1 + 2**-11) is 2**-24 exactly; rounding
    the product first loses it (a tie, to even)."""
    import os
    import subprocess
    import sys

    from aot_runs import TRITON36

    env = dict(os.environ, TRITON_INTERPRET="1")
    if which == "3.6":
        if not (TRITON36 / "triton").is_dir():
            pytest.skip(f"triton 3.6.0 not installed in {TRITON36} (./run's set-up installs it)")
        env["PYTHONPATH"] = os.pathsep.join([str(TRITON36), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _FMA_PROBE], env=env, capture_output=True, text=True, check=True)
    version, value = out.stdout.split()
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    assert which == "installed" or major_minor == (3, 6)
    if (3, 6) < major_minor < (3, 9):
        pytest.skip(f"triton {version}'s interpreter fma is not stated")
    assert float.fromhex(value) == (0.0 if major_minor == (3, 6) else 2.0**-24)


_SASS_PROBE = """
import sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flowrl.tools import aot
from flowrl.kernels.common import div_rn_tile

@triton.jit
def divide_tile(a_ptr, b_ptr, out_ptr, N: tl.constexpr, FAST: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, div_rn_tile(tl.load(a_ptr + i), tl.load(b_ptr), FAST))

def count(n, fast):
    signature = {"a_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr", "FAST": "constexpr"}
    aligned = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    source = ASTSource(fn=divide_tile, signature=signature, constexprs={"N": n, "FAST": fast}, attrs=aligned)
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": 1, "enable_fp_fusion": False})
    compiled = triton.compile(source, target=target, options=options.__dict__)
    return aot.sass_of(compiled)[0]

for fast in (False, True):
    print((count(512, fast) - count(256, fast)) / 8)  # per element: 8 more per thread at one warp
"""


@pytest.mark.slow  # compiles for sm_90a and counts SASS (the quick loop leaves the compile checks out)
def test_division_by_a_per_sample_scalar_issues_a_third_of_div_rn_instructions(tmp_path):
    """The docstring's and docs/kernels.md's count, compiled for sm_90a (no GPU needed): per element,
    div.rn issues 14 SASS instructions, div_rn_by_scalar 5 with triton 3.9 (5.9 with 3.6), each besides
    half an instruction of 128-bit loads and stores; the per-sample reciprocal is not per element."""
    import os
    import subprocess
    import sys

    from aot_runs import CAN_COMPILE

    if not CAN_COMPILE:
        pytest.skip("triton's CUDA backend wheels are Linux x86_64")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    probe = tmp_path / "probe.py"  # a file: triton.jit reads the kernel's source
    probe.write_text(_SASS_PROBE)
    out = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, check=True)
    div_rn, by_scalar = (float(line) - 0.5 for line in out.stdout.split())
    assert div_rn == 14 and 5 <= by_scalar <= 6
