"""In-kernel Philox noise shared by the step and loss kernels (``flowrl.kernels.common`` re-exports
every name): Philox4x32-10, the float32 Box-Muller of its words and the correctly rounded square roots
they use, the same bits as the torch reference's (``flowrl.backends.reference_philox``).
"""
import triton
import triton.language as tl

from flowrl import contract as _contract

from .numerics import INTERPRETED, neg

# ------------------------------------------------------------------------------------ Philox noise
# In-kernel noise (``sde_step(noise_seed=...)``), stream version ``NOISE_STREAM_VERSION`` 4 (docs/
# contract.md, Noise): Philox4x32-10 (Salmon et al., SC'11; Random123), the same integer stream as
# ``flowrl.backends.reference.philox4x32_10`` bit for bit, then Box-Muller in float32 multiplies, adds and
# fused multiply-adds (tl.fma: one rounding, one FFMA where a multiply and an add take two; the
# reference rounds its fmas once too), the reference's operations in its order, so the normals are the
# reference's bits. Layout, shared with the reference (``flowrl.backends.reference.philox_normal``): element e
# of a flattened sample is lane e % 4 of the call with counter (q low 32 bits, q high 32 bits, stream,
# 0), q = e // 4; lanes 0, 1 are the Box-Muller pair of the words (x0, x1), lanes 2, 3 that of (x2,
# x3); even lanes take the cosine, odd lanes the sine. So eps[e] depends only on (key, stream, e),
# never on the launch. Triton 3.6's interpreter runs tl.fma as a multiply and an add (two roundings;
# the newest rounds once): under it the normals may differ from the reference's in the last bits.
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
# the rounds' multiplies as PTX (``mul_wide_u32``): outputs (high, low), input the counter word
PHILOX_M0_ASM, PHILOX_M1_ASM = (
    tl.constexpr(f"{{ .reg .b64 t; mul.wide.u32 t, $2, {m.value:#x}; mov.b64 {{$1, $0}}, t; }}")
    for m in (PHILOX_M0, PHILOX_M1))
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
TWO_POW_M33 = tl.constexpr(1.1641532182693481e-10)  # exact
U_SCALE = tl.constexpr(_contract.U_SCALE)
NEG_2_LN2 = tl.constexpr(_contract.NEG_2_LN2)
NEG_2_LN2_M23 = tl.constexpr(_contract.NEG_2_LN2_M23)
LOG_SPLIT = tl.constexpr(_contract.LOG_SPLIT)
LOG_P0 = tl.constexpr(_contract.LOG_P0)
LOG_P1 = tl.constexpr(_contract.LOG_P1)
LOG_P2 = tl.constexpr(_contract.LOG_P2)
LOG_P3 = tl.constexpr(_contract.LOG_P3)
LOG_P4 = tl.constexpr(_contract.LOG_P4)
LOG_P5 = tl.constexpr(_contract.LOG_P5)
LOG_P6 = tl.constexpr(_contract.LOG_P6)
LOG_P7 = tl.constexpr(_contract.LOG_P7)
SIN_A0 = tl.constexpr(_contract.SIN_A0)
SIN_A1 = tl.constexpr(_contract.SIN_A1)
SIN_A2 = tl.constexpr(_contract.SIN_A2)
SIN_A3 = tl.constexpr(_contract.SIN_A3)
SIN_A4 = tl.constexpr(_contract.SIN_A4)
COS_B0 = tl.constexpr(_contract.COS_B0)
COS_B1 = tl.constexpr(_contract.COS_B1)
COS_B2 = tl.constexpr(_contract.COS_B2)
COS_B3 = tl.constexpr(_contract.COS_B3)


@triton.jit
def philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox4x32 round: two 32x32 -> 64-bit multiplies (``mul_wide_u32``: one IMAD.WIDE.U32
    each, where umulhi and a low multiply take two)."""
    hi0, lo0 = mul_wide_u32(c0, PHILOX_M0, PHILOX_M0_ASM)
    hi1, lo1 = mul_wide_u32(c2, PHILOX_M1, PHILOX_M1_ASM)
    return hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0


@triton.jit
def mul_wide_u32(x, M: tl.constexpr, ASM: tl.constexpr):
    """(high, low) uint32 words of the 64-bit product of uint32 ``x`` and the constant M. Compiled, one
    PTX mul.wide.u32 (``ASM``: its text for M): from the product of zero-extended words LLVM kept the
    first two rounds in 64-bit multiplies (their inputs are known to fit in 32 bits) and ptxas added
    their zero high words, 32 SASS more per 8 quads; interpreted, that product."""
    if INTERPRETED:
        p = x.to(tl.uint64) * M
        return (p >> 32).to(tl.uint32), p.to(tl.uint32)
    else:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the uint32 counter (c0, c1, c2, c3) under the uint32 key (k0, k1): ten
    rounds, the key bumped by the Weyl constants between rounds."""
    for round_ in tl.static_range(10):
        if round_ > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        c0, c1, c2, c3 = philox_round(c0, c1, c2, c3, k0, k1)
    return c0, c1, c2, c3


@triton.jit
def philox4x32_10_pair(a0, a1, a2, a3, b0, b1, b2, b3, k0, k1):
    """``philox4x32_10`` of two counters under one key, round by round (the unaligned path's first two
    quads; the same instructions as two calls)."""
    for round_ in tl.static_range(10):
        if round_ > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        a0, a1, a2, a3 = philox_round(a0, a1, a2, a3, k0, k1)
        b0, b1, b2, b3 = philox_round(b0, b1, b2, b3, k0, k1)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def philox_key(seed):
    """(k0, k1): the low and high 32-bit words of an int64 seed's two's-complement bits."""
    bits = seed.to(tl.uint64, bitcast=True)
    return bits.to(tl.uint32), (bits >> 32).to(tl.uint32)


@triton.jit
def sqrt_rn_normal(x):
    """The correctly rounded float32 square root of a normal finite x >= 2**-100: sqrt_rn's fast path
    without its range check and branch to the slow path (zeros, subnormals, infinities, NaN), 5
    instructions of its ~16: y ~ 1 / sqrt(x), s = x y, then s + (x - s^2) y / 2 by exact fmas. On the
    GPU these are sqrt.rn's own instructions (MUFU.RSQ, two FMUL, two FFMA: IEEE-rounded); in the
    interpreter y = 1 / sqrt(x) is rounded twice, and the step still rounds every float32 in [1, 4)
    correctly (checked exhaustively; scaling x by 4 scales every step by 2, so every x in range).
    Triton 3.6's interpreter does not fuse tl.fma (an ulp off there, now and then)."""
    y = tl.math.rsqrt(x)
    s = x * y
    return tl.fma(tl.fma(neg(s), s, x), y * 0.5, s)


@triton.jit
def sqrt_rn_nonneg(x):
    """The correctly rounded float32 square root of a finite x >= 0 (zero and subnormals included),
    without tl.sqrt_rn's call to its slow path: below 2**-100 x is scaled by 2**100 first and the root
    by 2**-50 after (exact powers of two), zero gives zero; the rest is ``sqrt_rn_normal``. A per-sample
    coefficient's square root: the call's register saving made ptxas spill (cps, 4-8 bytes, triton 3.9)."""
    small = x < 7.888609052210118e-31  # 2**-100
    r = sqrt_rn_normal(tl.where(small, tl.maximum(x * 1.2676506002282294e30, 7.888609052210118e-31), x))
    r = tl.where(small, r * 8.881784197001252e-16, r)  # 2**100, 2**-50
    return tl.where(x == 0.0, 0.0, r)


@triton.jit
def box_muller_radius(x_radius):
    """sqrt(-2 ln u) in float32 for u in (0, 1) of a uint32 word, as flowrl.backends.reference.box_muller_radius
    computes it: u = fma(x, U_SCALE, 2**-33) in [2**-33, 1 - 2**-24], u = 2**e (1 + f) with 1 + f in
    [sqrt(1/2), sqrt(2)) split from u's bits (e * 2**23 by a mask, no shift), -2 ln u = fma(f, P(f),
    e NEG_2_LN2) (flowrl.contract's polynomial, Horner by fmas; at least 1.19e-7 since u < 1), then the
    correctly rounded square root (``sqrt_rn_normal``)."""
    u = tl.fma(x_radius.to(tl.float32), U_SCALE, TWO_POW_M33)
    bits = u.to(tl.int32, bitcast=True)
    e_bits = (bits - LOG_SPLIT) & -8388608  # 0xFF800000: e * 2**23, e = floor((bits - LOG_SPLIT) / 2**23)
    f = (bits - e_bits).to(tl.float32, bitcast=True) - 1.0
    p = tl.fma(f, LOG_P7, LOG_P6)
    p = tl.fma(f, p, LOG_P5)
    p = tl.fma(f, p, LOG_P4)
    p = tl.fma(f, p, LOG_P3)
    p = tl.fma(f, p, LOG_P2)
    p = tl.fma(f, p, LOG_P1)
    p = tl.fma(f, p, LOG_P0)
    return sqrt_rn_normal(tl.fma(f, p, e_bits.to(tl.float32) * NEG_2_LN2_M23))


@triton.jit
def box_muller(x_radius, x_angle):
    """Two standard normals (r cos(theta), r sin(theta)) in float32 from two uint32 words, as
    flowrl.backends.reference.box_muller computes them: r = ``box_muller_radius(x_radius)``, negated when bit 31
    of x_angle is set (theta + pi: an xor into the sign bit); t = m - 3 in [-1, 1) for the float m in
    [2, 4) whose mantissa is x_angle's low 23 bits; phi = pi t / 2 with sine t S(t^2) and cosine 1 +
    t^2 C(t^2) (flowrl.contract's polynomials, Horner by fmas). theta takes 2**24 equally spaced values
    over the circle."""
    r = box_muller_radius(x_radius)
    r = (r.to(tl.uint32, bitcast=True) ^ (x_angle & 0x80000000)).to(tl.float32, bitcast=True)
    t = ((x_angle & 0x007FFFFF) | 0x40000000).to(tl.float32, bitcast=True) - 3.0  # exact
    t2 = t * t
    sin_p = t * tl.fma(t2, tl.fma(t2, tl.fma(t2, tl.fma(t2, SIN_A4, SIN_A3), SIN_A2), SIN_A1), SIN_A0)
    cos_p = tl.fma(t2, tl.fma(t2, tl.fma(t2, tl.fma(t2, COS_B3, COS_B2), COS_B1), COS_B0), 1.0)
    return r * cos_p, r * sin_p


@triton.jit
def philox_quad(k0, k1, stream, quad):
    """The four uint32 words that feed elements 4 * quad + (0, 1, 2, 3) (uint32 ``quad`` and
    ``stream``): counter (quad low word, quad high word, stream, 0), the high word 0 (the kernels draw
    elements below 2**32: flowrl.backends._triton_ops.check_philox_range), so the first two rounds' key
    and stream terms are per program, not per quad."""
    zero = quad * 0
    return philox4x32_10(quad, zero, zero + stream, zero, k0, k1)


@triton.jit
def philox_normal_quads(k0, k1, stream, quad):
    """The four normals of elements 4 * quad + (0, 1, 2, 3), from one Philox call each quad."""
    x0, x1, x2, x3 = philox_quad(k0, k1, stream, quad)
    n0, n1 = box_muller(x0, x1)
    n2, n3 = box_muller(x2, x3)
    return n0, n1, n2, n3


@triton.jit
def philox_normal_block(k0, k1, stream, first, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Normals of elements first + arange(BLOCK) (int64 ``first``, first + BLOCK <= 2**32: the quads
    are uint32, ``philox_quad``; BLOCK a power of two >= 8). ALIGNED
    (first % 4 == 0): one Philox call per 4 elements, interleaved back to element order; otherwise 3
    calls per 8 elements, each element picking its lane (any first; the same values: same integers,
    same float32 operations)."""
    if ALIGNED:
        # a thread computes whole octets (quads 2g, 2g + 1: elements 8g .. 8g + 7), as the latents'
        # 16-byte loads hold them, and each join adds an in-register dimension, so the interleave to
        # element order moves no data (from a 1-D arange of quads, or a 2-D [g, h] one, Triton's
        # layouts take warp shuffles to interleave)
        quad = first.to(tl.uint32) // 4 + 2 * tl.arange(0, BLOCK // 8).to(tl.uint32)
        a0, a1, a2, a3 = philox_normal_quads(k0, k1, stream, quad)
        b0, b1, b2, b3 = philox_normal_quads(k0, k1, stream, quad + 1)
        # [g, h, i, j] = lane 2i + j of quad 2g + h: row-major flattening is element 8g + 4h + 2i + j
        evens = tl.join(tl.join(a0, b0), tl.join(a2, b2))
        odds = tl.join(tl.join(a1, b1), tl.join(a3, b3))
        eps = tl.reshape(tl.join(evens, odds), (BLOCK,))
    else:
        # octet g holds elements first + 8g + k (k = 0 .. 7): words j = s + k (s = first % 4) of the
        # three quads from (first + 8g) // 4, whose Box-Muller pairs P0 .. P0 + 4 (P0 = s // 2) cover
        # them: 3 Philox calls and 5 pairs per 8 elements, then each element picks its lane (a call
        # and a pair per element before). Selects on the uniform s, no branch.
        quad = first.to(tl.uint32) // 4 + 2 * tl.arange(0, BLOCK // 8).to(tl.uint32)  # (first + 8 g) // 4
        shift = first.to(tl.uint32) % 4
        zero = quad * 0
        x = philox4x32_10_pair(quad, zero, zero + stream, zero, quad + 1, zero, zero + stream, zero, k0, k1)
        y0, y1, y2, y3 = philox_quad(k0, k1, stream, quad + 2)
        upper = shift >= 2  # P0 = 1: the pairs start one later
        n0, n1 = box_muller(tl.where(upper, x[2], x[0]), tl.where(upper, x[3], x[1]))
        n2, n3 = box_muller(tl.where(upper, x[4], x[2]), tl.where(upper, x[5], x[3]))
        n4, n5 = box_muller(tl.where(upper, x[6], x[4]), tl.where(upper, x[7], x[5]))
        n6, n7 = box_muller(tl.where(upper, y0, x[6]), tl.where(upper, y1, x[7]))
        n8, n9 = box_muller(tl.where(upper, y2, y0), tl.where(upper, y3, y1))
        odd = (shift % 2) == 1  # element k is normal d + k of the five pairs, d = s - 2 P0
        e0 = tl.where(odd, n1, n0)
        e1 = tl.where(odd, n2, n1)
        e2 = tl.where(odd, n3, n2)
        e3 = tl.where(odd, n4, n3)
        e4 = tl.where(odd, n5, n4)
        e5 = tl.where(odd, n6, n5)
        e6 = tl.where(odd, n7, n6)
        e7 = tl.where(odd, n8, n7)
        # [g, h, i, j] = element 8g + 4h + 2i + j, as on the aligned path
        evens = tl.join(tl.join(e0, e4), tl.join(e2, e6))
        odds = tl.join(tl.join(e1, e5), tl.join(e3, e7))
        eps = tl.reshape(tl.join(evens, odds), (BLOCK,))
    return eps
