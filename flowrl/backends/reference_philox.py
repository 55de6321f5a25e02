"""Philox noise for the torch reference backend (``flowrl.backends.reference`` re-exports every name).

Philox4x32-10 and the float32 Box-Muller of the noise stream (docs/contract.md), in torch integer and
exactly rounded float32 ops, so the normals are the Triton kernels' bits (kernels/philox.py).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import contract
from ..core._validate import NoiseSeed


# ------------------------------------------------------------- Philox noise (sde_step(noise_seed=))
# Philox4x32-10 (Salmon et al., SC'11; Random123) in torch integer ops: int64 tensors holding uint32
# values, every product split so it stays below 2**63. The same integer stream, bit for bit, as the
# Triton helpers in kernels/philox.py; the float32 normals (stream version
# C.NOISE_STREAM_VERSION) use the same IEEE float32 multiplies, adds, fused multiply-adds and square
# root in the same order (no platform log / sin / cos), so they are the kernels' bits too.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # key bumps (Weyl sequence)
_MASK32 = 0xFFFFFFFF


def _mulhilo32(m: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of the 64-bit product m * x (uint32 m, x), in int64 arithmetic:
    x is split in 16-bit halves so each partial product is below 2**48."""
    p_lo = (x & 0xFFFF).mul_(m)  # in-place ops on temporaries: on the CPU the allocations dominate
    p_hi = (x >> 16).mul_(m)
    lo = (p_hi & 0xFFFF).bitwise_left_shift_(16).add_(p_lo).bitwise_and_(_MASK32)
    hi = p_lo.bitwise_right_shift_(16).add_(p_hi).bitwise_right_shift_(16)
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1): int64 tensors holding
    uint32 values, broadcast together; returns the four output words."""
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)  # views; every round writes new tensors
    for round_ in range(10):
        if round_ > 0:
            k0, k1 = (k0 + PHILOX_W0) & _MASK32, (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1.bitwise_xor_(c1).bitwise_xor_(k0), lo1, hi0.bitwise_xor_(c3).bitwise_xor_(k1), lo0
    return c0, c1, c2, c3


def philox_quads(seed: NoiseSeed, first_quad: int, n_quads: int):
    """The four uint32 words (int64 [B, n_quads] each) of quads first_quad + arange(n_quads): Philox
    with key (seed low word, seed high word) and counter (quad low word, quad high word, stream, 0),
    stream = b * seed.stream_stride."""
    seeds = seed.seeds.reshape(-1, 1)
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32  # the seed's two's-complement words
    quad = torch.arange(first_quad, first_quad + n_quads, dtype=torch.int64, device=seeds.device).reshape(1, -1)
    stream = torch.arange(seeds.shape[0], dtype=torch.int64, device=seeds.device).reshape(-1, 1) * seed.stream_stride
    return philox4x32_10(quad & _MASK32, quad >> 32, stream, torch.zeros_like(quad), k0, k1)


def fma_f32(a, b, c) -> torch.Tensor:
    """a * b + c rounded once to float32 (IEEE fma, the kernels' ``tl.fma``), for float32 tensors or
    float32-valued Python floats (at least one tensor). The product is
    exact in float64 (24 + 24 bits); the sum is rounded to odd in float64 (rounded to nearest, then one
    ulp toward the exact sum when inexact and even, the exact error from TwoSum), and rounding that
    once to float32 gives the correctly rounded fma (53 >= 24 + 2 bits: Boldo and Melquiond, IEEE TC
    2008). Rounding the float64 sum to nearest instead would round twice, an ulp off now and then."""
    a, b, c = (t.double() if isinstance(t, torch.Tensor) else float(t) for t in (a, b, c))
    p = a * b
    s = p + c
    z = s - p
    err = (p - (s - z)) + (c - z)  # p + c = s + err exactly (Knuth's TwoSum)
    bits = s.view(torch.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0)  # an inexact sum is never 0
    toward = torch.where((err > 0) == (s > 0), 1, -1)  # +1 on the bits moves away from zero
    rounded = (bits + toward * inexact_even).view(torch.float64).to(torch.float32)
    return torch.where(torch.isfinite(s), rounded, s.to(torch.float32))  # inf, NaN: the IEEE fma's


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 ``x`` (the kernels' ``tl.sqrt_rn``), where
    torch's CPU float32 sqrt is not always (about 1 in 5 an ulp off on an AMD EPYC, torch 2.13):
    float64's root rounded to float32. A float32's exact root lies at least 4 float64 ulps from every
    float32 rounding midpoint, so a float64 root within 3 ulps (torch's CPU float64 sqrt is not always
    correctly rounded either) rounds to the right float32 (tests/backends/test_philox.py)."""
    return torch.sqrt(x.double()).to(torch.float32)


def box_muller_radius(x_radius: torch.Tensor) -> torch.Tensor:
    """float32 sqrt(-2 ln u) for u = fma(x_radius, U_SCALE, 2**-33) in [2**-33, 1 - 2**-24] of uint32
    words (int64 tensor), the same float32 operations as the kernels' ``box_muller_radius``: u = 2**e (1
    + f) with 1 + f in [sqrt(1/2), sqrt(2)) split from u's bits, -2 ln u = fma(f, P(f), e NEG_2_LN2)
    (flowrl.contract's degree-7 polynomial, Horner by fmas; positive since u < 1), then the correctly
    rounded square root."""
    u = fma_f32(x_radius.to(torch.float32), contract.U_SCALE, 2.0**-33)
    bits = u.view(torch.int32)
    e = (bits - contract.LOG_SPLIT) >> 23  # arithmetic shift: floor division by 2**23
    f = (bits - e * (1 << 23)).view(torch.float32) - 1.0
    p = fma_f32(f, contract.LOG_P7, contract.LOG_P6)
    for coefficient in (contract.LOG_P5, contract.LOG_P4, contract.LOG_P3,
                        contract.LOG_P2, contract.LOG_P1, contract.LOG_P0):
        p = fma_f32(f, p, coefficient)
    r2 = fma_f32(f, p, e.to(torch.float32) * contract.NEG_2_LN2)
    return sqrt_rn(r2)


def box_muller(x_radius: torch.Tensor, x_angle: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two float32 standard normals (r cos(theta), r sin(theta)) from uint32 words (int64 tensors), the
    same float32 operations as the kernels' ``box_muller``: r = ``box_muller_radius(x_radius)``, negated
    when bit 31 of x_angle is set (theta + pi); t = (x_angle's low 23 bits) / 2**22 - 1 in [-1, 1), phi
    = pi t / 2 with sine t S(t^2) and cosine 1 + t^2 C(t^2) (flowrl.contract's polynomials, Horner by
    fmas): theta takes 2**24 equally spaced values over the circle."""
    r = box_muller_radius(x_radius)
    # negation flips the sign bit only, as the kernels' xor does
    r = torch.where(((x_angle >> 31) & 1) == 1, -r, r)
    # the kernels' float in [2, 4) with the word's low 23 bits as mantissa, minus 3: exact either way
    t = (x_angle & 0x7FFFFF).to(torch.float32) * 2.0**-22 - 1.0
    t2 = t * t
    sin_p = fma_f32(t2, fma_f32(t2, contract.SIN_A4, contract.SIN_A3), contract.SIN_A2)
    sin_p = t * fma_f32(t2, fma_f32(t2, sin_p, contract.SIN_A1), contract.SIN_A0)
    cos_p = fma_f32(t2, fma_f32(t2, contract.COS_B3, contract.COS_B2), contract.COS_B1)
    cos_p = fma_f32(t2, fma_f32(t2, cos_p, contract.COS_B0), 1.0)
    return r * cos_p, r * sin_p


def philox_normal(seed: NoiseSeed, numel: int) -> torch.Tensor:
    """float32 [B, numel] standard normal noise of elements seed.elem_offset + arange(numel) of each
    flattened sample. Element e is lane e % 4 of quad e // 4: lanes 0, 1 are (r cos, r sin) of the
    words (x0, x1), lanes 2, 3 of (x2, x3). A pure function of (seed, stream, e): the same values
    whatever the chunking, launch or sharding."""
    first_quad = seed.elem_offset // 4
    n_quads = (seed.elem_offset + numel - 1) // 4 - first_quad + 1
    x0, x1, x2, x3 = philox_quads(seed, first_quad, n_quads)
    n0, n1 = box_muller(x0, x1)
    n2, n3 = box_muller(x2, x3)
    lanes = torch.stack((n0, n1, n2, n3), dim=-1).reshape(n0.shape[0], 4 * n_quads)
    start = seed.elem_offset - 4 * first_quad
    return lanes[:, start: start + numel]
