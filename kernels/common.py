"""Triton helpers shared by every flowrl kernel: the modes' coefficients, the mean, and the fixed
halving-tree reduction. Each piece of math is written here once, so the rollout kernel and the
log-prob recompute kernel run the same instructions (docs/contract.md, Rounding / Reduction order).

Conventions kept by every kernel: loads are upcast to float32 right away (Triton's interpreter
mishandles bf16 arithmetic, and the contract computes in float32), division and square root are the
IEEE round-to-nearest forms (``div_rn`` / ``sqrt_rn``; Triton's plain ``sqrt`` is approximate on GPU),
and launchers pass ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA: the
arithmetic is then the reference's, operation for operation.
"""
import os

import triton
import triton.language as tl

from flowrl import contract as _contract
from flowrl.contract import HALF_LOG_2PI as _HALF_LOG_2PI
from flowrl.contract import STD_FLOOR as _STD_FLOOR
from flowrl.contract import LogProbKind, Mode, NoiseSource, Op, Prediction

# Named constexpr switches from flowrl.contract's enums: a @triton.jit function may read a module
# global only when it is a tl.constexpr (a plain int compiles under the interpreter, not for a GPU).
MODE_ODE = tl.constexpr(Mode.ODE.value)
MODE_SDE = tl.constexpr(Mode.SDE.value)
MODE_DANCE = tl.constexpr(Mode.DANCE.value)
MODE_CPS = tl.constexpr(Mode.CPS.value)
MODE_DDIM = tl.constexpr(Mode.DDIM.value)
MODE_DPM_SDE = tl.constexpr(Mode.DPM_SDE.value)
MODE_FLASH_SDE = tl.constexpr(Mode.FLASH_SDE.value)
PRED_EPSILON = tl.constexpr(Prediction.EPSILON.value)
PRED_SAMPLE = tl.constexpr(Prediction.SAMPLE.value)
PRED_V = tl.constexpr(Prediction.V_PREDICTION.value)
KIND_GAUSSIAN = tl.constexpr(LogProbKind.GAUSSIAN.value)
KIND_KERNEL = tl.constexpr(LogProbKind.KERNEL.value)
KIND_SQ_ERR = tl.constexpr(LogProbKind.SQ_ERR.value)
KIND_KL = tl.constexpr(LogProbKind.KL.value)
OP_ROLLOUT = tl.constexpr(Op.ROLLOUT.value)
OP_LOG_PROB = tl.constexpr(Op.LOG_PROB.value)
OP_KL = tl.constexpr(Op.KL.value)
NOISE_TENSOR = tl.constexpr(NoiseSource.TENSOR.value)
NOISE_PHILOX = tl.constexpr(NoiseSource.PHILOX.value)
NOISE_NONE = tl.constexpr(NoiseSource.NONE.value)
# Whether @triton.jit makes interpreted functions in this process (TRITON_INTERPRET, read at import
# like triton.jit itself): round_to's integer bfloat16 rounding is needed only there.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
HALF_LOG_2PI = tl.constexpr(_HALF_LOG_2PI)
STD_FLOOR = tl.constexpr(_STD_FLOOR)


@triton.jit
def coefficients_of(sigma, sigma_next, sigmas_ptr, sigma_one_tol, eta, sin_half_pi_eta, MODE: tl.constexpr,
                    last_index):
    """``(a, c, std)`` with ``mu = a * x + c * v`` (docs/contract.md, Modes) for steps sigma -> sigma_next (scalars
    or blocks), as flowrl.backends.reference.coefficients_of computes them. ``sigmas_ptr`` is the float32
    table (sde's sigma == 1 rule reads its second value; flash_sde's sigma_min is its last,
    ``sigmas[last_index]``); ``sin_half_pi_eta`` is ``sin(eta * pi / 2)`` computed once on the host in
    float32 (only cps reads it; it depends on the scalar ``eta`` alone). dpm_sde's are its first order
    (``dpm_sde_coefficients`` has the second)."""
    d = sigma - sigma_next  # D > 0; diffusers' dt is -D
    if MODE == MODE_ODE:
        a = sigma * 0.0 + 1.0
        c = -d
        std = sigma * 0.0
    elif MODE == MODE_CPS:
        std = sigma_next * sin_half_pi_eta
        # clamp: at eta = 1, sigma'^2 - std^2 is 0 up to rounding and may come out a hair negative
        k = sqrt_rn_nonneg(tl.maximum(sigma_next * sigma_next - std * std, 0.0))
        a = (1.0 - sigma_next) + k
        c = k * (1.0 - sigma) - (1.0 - sigma_next) * sigma
    elif MODE == MODE_DPM_SDE:
        big_a, b, _, std = dpm_sde_first_order(sigma, sigma_next)
        a = big_a + b
        c = -(b * sigma)
    else:  # sde, dance or flash_sde
        if MODE == MODE_SDE:
            # sigma == 1 would divide by zero: use the schedule's second value (Flow-GRPO, SGLang)
            sigma_sub = tl.load(sigmas_ptr + 1)
            sigma_t = tl.where(tl.abs(sigma - 1.0) <= sigma_one_tol, sigma_sub, sigma)
            s = eta * tl.sqrt_rn(tl.div_rn(sigma, 1.0 - sigma_t))
        elif MODE == MODE_FLASH_SDE:  # Flash-GRPO: sigma_max = sigmas[1], sigma_min = sigmas[T]
            sigma_max = tl.load(sigmas_ptr + 1)
            sigma_min = tl.load(sigmas_ptr + last_index)
            s = eta * (sigma_min + (sigma_max - sigma_min) * sigma)
        else:
            s = sigma * 0.0 + eta
        s2 = s * s
        two_sigma = 2.0 * sigma
        a = 1.0 - tl.div_rn(s2 * d, two_sigma)
        c = -(1.0 + tl.div_rn(s2 * (1.0 - sigma), two_sigma)) * d
        std = s * tl.sqrt_rn(d)
    return a, c, std


@triton.jit
def mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE: tl.constexpr, last_index):
    """Per-sample ``(a, c, std)`` of the sample's step ``step`` in the float32 table."""
    sigma = tl.load(sigmas_ptr + step)
    sigma_next = tl.load(sigmas_ptr + step + 1)
    return coefficients_of(sigma, sigma_next, sigmas_ptr, sigma_one_tol, eta, sin_half_pi_eta, MODE, last_index)


@triton.jit
def magic_quotient(n, m, l):
    """n // d for uint32 ``n`` < 2**31 by the host's ``(m, l)`` of d (_triton_ops.division_magic, with
    the proof): umulhi(2 n, m) >> l, a multiply-high and a shift."""
    return tl.umulhi(n + n, m) >> l


@triton.jit
def compact_index(e, magic_ptr, groups):
    """``(e // inner) % groups``, the column of in-sample element ``e`` (uint32, e < 2**31) in a compact
    per-token table (flowrl.core.step_spec.flat_layout), by multiply-highs instead of divisions: ``magic_ptr``
    holds the pre-pass's ``(m, l)`` of ``inner`` then of ``groups`` (kernels/token.py; the host's
    _triton_ops.division_magic) as uint32 bit patterns in float32 words, uniform loads for every element."""
    m_inner = tl.load(magic_ptr).to(tl.uint32, bitcast=True)
    l_inner = tl.load(magic_ptr + 1).to(tl.uint32, bitcast=True)
    m_groups = tl.load(magic_ptr + 2).to(tl.uint32, bitcast=True)
    l_groups = tl.load(magic_ptr + 3).to(tl.uint32, bitcast=True)
    q = magic_quotient(e, m_inner, l_inner)  # e // inner
    return q - magic_quotient(q, m_groups, l_groups) * groups


@triton.jit
def run_heads(t, RUN: tl.constexpr):
    """The first of each run of RUN (a power of two) consecutive values of the 1-D block ``t``
    ([BLOCK // RUN]): repeated even halves of ``tl.split``, no arithmetic. A run that lies in one
    thread's registers (RUN at most the loads' vector width) costs no instruction."""
    for level in tl.static_range(10):
        if RUN > (1 << level):
            t, _odd = tl.split(tl.reshape(t, (t.shape[0] // 2, 2)))
    return t


@triton.jit
def run_spread(t, RUN: tl.constexpr):
    """``run_heads``' inverse for values constant over each run: each of the [n] values repeated RUN
    times ([n * RUN], element order), by ``tl.join``, no arithmetic."""
    for level in tl.static_range(10):
        if RUN > (1 << level):
            t = tl.reshape(tl.join(t, t), (t.shape[0] * 2,))
    return t


@triton.jit
def token_coefficients(tok_ptr, index, mask, sigmas_ptr, sigma_one_tol, eta, sin_half_pi_eta, MODE: tl.constexpr,
                       last_index):
    """Per-element ``(a, c, std, held)`` of per-token steps: the token's (sigma, sigma') pair read from
    the compact [Bt, G, 2] table at ``index``, ``coefficients_of`` on it, and a held token (D = 0)
    given (1, 0, 0) (flowrl.backends.reference.token_coefficients)."""
    sigma = tl.load(tok_ptr + 2 * index, mask=mask, other=0.0)
    sigma_next = tl.load(tok_ptr + 2 * index + 1, mask=mask, other=0.0)
    a, c, std = coefficients_of(sigma, sigma_next, sigmas_ptr, sigma_one_tol, eta, sin_half_pi_eta, MODE,
                                last_index)
    held = sigma == sigma_next
    return tl.where(held, 1.0, a), tl.where(held, 0.0, c), tl.where(held, 0.0, std), held


@triton.jit
def dpm_sde_first_order(sigma, sigma_next):
    """SDE-DPM-Solver++'s first-order ``(A, B, q, std)``: ``mu = A x + B x0_hat``, q = e^{-h} =
    (alpha sigma') / (sigma alpha') without logs (0 exactly at sigma = 1 and at sigma' = 0),
    A = (sigma' / sigma) q, B = alpha' (1 - q^2), std = sigma' sqrt(1 - q^2)."""
    alpha_next = 1.0 - sigma_next
    q = tl.div_rn((1.0 - sigma) * sigma_next, sigma * alpha_next)
    one_minus_q2 = 1.0 - q * q
    return tl.div_rn(sigma_next, sigma) * q, alpha_next * one_minus_q2, q, sigma_next * tl.sqrt_rn(one_minus_q2)


@triton.jit
def dpm_sde_coefficients(sigmas_ptr, step, SECOND_ORDER: tl.constexpr):
    """SDE-DPM-Solver++'s ``(a, c, p, std)`` with ``mu = a * x + c * v + p * x0_prev``, as
    flowrl.backends.reference.dpm_sde_coefficients computes them: q = e^{-h} = (alpha sigma') / (sigma alpha')
    without logs (0 exactly at sigma = 1 and at sigma' = 0), B = alpha' (1 - q^2), std = sigma'
    sqrt(1 - q^2); SECOND_ORDER adds B2 = B h / (2 h_prev) (0 at step 0, sigma' = 0, sigma_prev = 1)."""
    sigma = tl.load(sigmas_ptr + step)
    sigma_next = tl.load(sigmas_ptr + step + 1)
    big_a, b, q, std = dpm_sde_first_order(sigma, sigma_next)
    if SECOND_ORDER:
        sigma_prev = tl.load(sigmas_ptr + tl.maximum(step - 1, 0))
        alpha = 1.0 - sigma  # 0 only at sigma = 1, i.e. step 0 (first order): 1 there keeps q_prev finite
        q_prev = tl.div_rn((1.0 - sigma_prev) * sigma, sigma_prev * tl.where(alpha > 0.0, alpha, 1.0))
        # (q_prev == 1: h_prev rounds to 0, where D1's h / h_prev would be inf)
        first_order = (step == 0) | (q == 0.0) | (q_prev == 0.0) | (q_prev == 1.0)
        # any q in (0, 1) keeps the unused branch finite
        h_ratio = tl.div_rn(tl.log(tl.where(first_order, 0.5, q)), tl.log(tl.where(first_order, 0.5, q_prev)))
        b2 = tl.where(first_order, 0.0, 0.5 * b * h_ratio)
    else:
        b2 = sigma * 0.0
    bb = b + b2
    return big_a + bb, -(bb * sigma), -b2, std


@triton.jit
def neg(x):
    """-x exactly (IEEE negation, -0.0 for +0.0). Triton 3.6 lowers unary minus to 0 - x: an FADD the
    consumer cannot absorb (and +0.0 for +0.0), where a multiply by -1.0 becomes LLVM's fneg, which an
    FFMA or FMUL takes as an operand modifier, free."""
    return x * -1.0


@triton.jit
def step_mean(a, c, x, v):
    """mu = a * x + c * v in float32 (x, v already upcast)."""
    return a * x + c * v


@triton.jit
def policy_difference(c, v, v_ref):
    """mu(v) - mu(v_ref) = c v - c v_ref: the a * x terms of the two means cancel exactly, so the KL
    neither reads x nor carries its rounding (flowrl.backends.reference.step_kl computes the same)."""
    return c * v - c * v_ref


@triton.jit
def density_std(std):
    """The deterministic-step rule and the std floor (docs/contract.md), for every kernel: returns
    (deterministic, the std the value divides by). std == 0 is deterministic (value 0, gradient 0;
    1.0 keeps the masked branch finite); otherwise max(std, STD_FLOOR), so std**2 never underflows."""
    deterministic = std == 0.0
    return deterministic, tl.where(deterministic, 1.0, tl.maximum(std, STD_FLOOR))


@triton.jit
def value_from_total(total, std, count, log_term, KIND: tl.constexpr, MEAN: tl.constexpr, HAS_LOG: tl.constexpr):
    """A sample's log-prob (KIND gaussian/kernel/sq_err) or KL (KIND_KL) from its total of (weighted)
    squared residuals over its ``count`` scored elements, as flowrl.backends.reference.value_from_total
    computes it (``log_term``: the per-token schedules' sum of log(std_token / std), read when HAS_LOG).
    No scored element: 0."""
    none_scored = count == 0.0
    safe_count = tl.where(none_scored, 1.0, count)
    if MEAN:
        total = tl.div_rn(total, safe_count)
    deterministic, std_d = density_std(std)
    var = std_d * std_d
    if KIND == KIND_SQ_ERR:
        value = -total
    elif KIND == KIND_KL:
        value = tl.div_rn(total, 2.0 * var)
    else:
        value = tl.div_rn(-total, 2.0 * var)
        if KIND == KIND_GAUSSIAN:
            const = -tl.log(std_d) - HALF_LOG_2PI
            if MEAN:
                if HAS_LOG:
                    const = const - tl.div_rn(log_term, safe_count)
                value = value + const
            else:
                const = const * count
                if HAS_LOG:
                    const = const - log_term
                value = value + const
    return tl.where(none_scored, 0.0, value)


@triton.jit
def ordinary_count(std, numel_f):
    """The scored count of a step without per-token sigmas or a mask: every element, or none on a
    deterministic step (std 0); flowrl.backends.reference.ordinary_count."""
    return tl.where(std > 0.0, numel_f, 0.0)


@triton.jit
def total_grad(grad, std, count, KIND: tl.constexpr, MEAN: tl.constexpr):
    """d value / d total times the incoming ``grad``: the backward of value_from_total (0 when no
    element is scored)."""
    none_scored = count == 0.0
    deterministic, std_d = density_std(std)
    var = std_d * std_d
    g = tl.where(none_scored, 0.0, grad)
    if KIND == KIND_SQ_ERR:
        coef = -g
    elif KIND == KIND_KL:
        coef = tl.div_rn(g, 2.0 * var)
    else:
        coef = -tl.div_rn(g, 2.0 * var)
    if MEAN:
        coef = tl.div_rn(coef, tl.where(none_scored, 1.0, count))
    return coef


@triton.jit
def halving_tree_rows(t, ROWS: tl.constexpr, WIDTH: tl.constexpr, LOG2_WIDTH: tl.constexpr):
    """The sums [ROWS] of the rows of a 1-D float32 block of ROWS * WIDTH values (row-major, WIDTH =
    2**LOG2_WIDTH), each by the fixed halving tree ``t[:h] + t[h:]`` repeated
    (flowrl.backends.reference._pairwise_sum). Each level sums an axis of length 2, i.e. one IEEE add per
    output, so the bits do not depend on the compiler's register layout, the kernel it is inlined
    in, how many rows a program holds, or the launch settings."""
    t = tl.reshape(t, (ROWS, WIDTH))
    for level in tl.static_range(LOG2_WIDTH):
        t = tl.sum(tl.reshape(t, (ROWS, 2, WIDTH >> (level + 1))), axis=1)
    return tl.sum(t, axis=1)


# The contract's leaves (flowrl.contract.LEAF_SIZE): a chunk's runs of consecutive elements summed first.
LEAF = tl.constexpr(_contract.LEAF_SIZE)
LOG2_LEAF = tl.constexpr(_contract.LOG2_LEAF_SIZE)


@triton.jit
def chunk_tree_rows(t, ROWS: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """The partials [ROWS] of a 1-D float32 block of ROWS chunks of CHUNK values (row-major), each in
    the contract's chunk order (flowrl.backends.reference._chunk_partials): every leaf of LEAF consecutive
    values by the halving tree, then the chunk's CHUNK / LEAF leaf sums by the same tree. Each level
    sums an axis of length 2 (one IEEE add per output), so the bits do not depend on the layout or
    the launch; a thread's 16-byte load of bfloat16 is one leaf, so the leaves add up in registers
    and the tree crosses lanes with one value per thread (``halving_tree_rows`` over the chunk would
    cross them with eight)."""
    return halving_tree_rows(leaf_sums_rows(t, ROWS, CHUNK), ROWS, CHUNK // LEAF, LOG2_CHUNK - LOG2_LEAF)


@triton.jit
def leaf_sums_rows(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The sums [ROWS, WIDTH / LEAF] of each LEAF consecutive values of a 1-D float32 block of ROWS rows of
    WIDTH values (row-major), each by the halving tree: a chunk tree's first levels
    (``chunk_tree_rows``)."""
    t = tl.reshape(t, (ROWS, WIDTH // LEAF, LEAF))
    for level in tl.static_range(LOG2_LEAF):
        t = tl.sum(tl.reshape(t, (ROWS, WIDTH // LEAF, 2, LEAF >> (level + 1))), axis=2)
    return t


@triton.jit
def carry_part_leaves(even, odd, t, part: tl.constexpr, PART: tl.constexpr):
    """A chunk run in 2 or 4 parts of PART consecutive values (one chunk per program): part ``part``'s
    leaf sums [PART / LEAF] of ``t`` added into the carried (even, odd), so that ``even + odd`` is the
    chunk tree's first levels over the parts' leaves Q0 | Q1 (| Q2 | Q3): Q0 + Q1, or (Q0 + Q2) + (Q1 +
    Q3), element by element (``part_chunk_partial`` finishes the tree)."""
    leaves = tl.reshape(leaf_sums_rows(t, 1, PART), (PART // LEAF,))
    if part == 0:
        even = leaves
    elif part == 1:
        odd = leaves
    elif part % 2 == 0:
        even = even + leaves
    else:
        odd = odd + leaves
    return even, odd


@triton.jit
def part_chunk_partial(even, odd, PARTS: tl.constexpr, PART: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """The chunk's partial [1] from the leaf sums its PARTS parts carried (``carry_part_leaves``): the
    halving tree within a part after the levels across them, the contract's order
    (``chunk_tree_rows``), the same bits."""
    tl.static_assert(PARTS == 2 or PARTS == 4)
    LOG2_PARTS: tl.constexpr = 1 if PARTS == 2 else 2
    return halving_tree_rows(even + odd, 1, PART // LEAF, LOG2_CHUNK - LOG2_LEAF - LOG2_PARTS)


@triton.jit
def bf16_words_to_f32(words):
    """bfloat16 pairs read as uint32 words, as float32 in element order: each half one integer op
    (low << 16, high & 0xffff0000) where a bfloat16 load's conversion takes 1.5 per value; the same
    bits. Little-endian: element 2i is word i's low half."""
    low = (words << 16).to(tl.float32, bitcast=True)
    high = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.interleave(low, high)


@triton.jit
def to_f32(x):
    """``x`` as float32. Compiled bfloat16 (two values per 32-bit register as loaded): one integer op
    per value, ``bf16_words_to_f32``'s (low << 16, high & 0xffff0000) by inline PTX on each register,
    where Triton's conversion takes 1.5; the same bits (bfloat16 is float32's upper half).
    Interpreted, and for the other dtypes, the cast."""
    if INTERPRETED or x.dtype != tl.bfloat16:
        return x.to(tl.float32)
    else:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to the storage dtype DTYPE, to nearest even (torch's ``.to``).

    Compiled, the conversion is the hardware's round-to-nearest-even (cvt.rn.bf16.f32 / cvt.rn.f16.f32,
    one per value; ``round_pairs`` converts a pair at once). Triton's interpreter truncates float32 ->
    bfloat16, so there (INTERPRETED) bfloat16 is rounded with integer ops first: the same bits for
    finite values (an overflow carries into the exponent and gives inf, as the hardware does); the
    integer form costs 3-4 instructions per value, which the compiled kernels do not pay."""
    if DTYPE == tl.bfloat16:
        if INTERPRETED:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def round_pairs(x, DTYPE: tl.constexpr):
    """float32 ``x`` (1-D, even length) rounded to 16-bit DTYPE (bfloat16 / float16) to nearest even,
    as ``round_to``, two values per uint32 word as memory holds them (element 2i in word i's low
    half). Compiled, one cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 per word (the PTX ISA's packed
    conversion: its first source goes to the upper half), where Triton converts each value apart and
    then packs the halves; interpreted, ``round_to`` on each value."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
    if INTERPRETED:
        low = round_to(even, DTYPE).to(tl.uint16, bitcast=True).to(tl.uint32)
        high = round_to(odd, DTYPE).to(tl.uint16, bitcast=True).to(tl.uint32)
        return low | (high << 16)
    elif DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=tl.uint32,
                                         is_pure=True, pack=1)


@triton.jit
def words_to_f32(words, DTYPE: tl.constexpr):
    """16-bit DTYPE pairs held as uint32 words (``round_pairs``' layout), as float32 in element order."""
    if DTYPE == tl.bfloat16:
        return bf16_words_to_f32(words)
    low = (words & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (words >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.interleave(low, high)


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


# -------------------------------------------------------------------------------------------- ddim
# ddim's math (docs/contract.md, ddim), as flowrl.backends.reference.ddim_coefficients / ddim_mean write it:
# diffusers' DDIMScheduler.step operations in its order, so float32 results are diffusers' bits.


@triton.jit
def ddim_coefficients(table_ptr, step, eta):
    """(sqrt(a_t), sqrt(1 - a_t), sqrt(a_prev), k, std) of a step, from the alpha-bar table [2T]
    (a_t = table[2 step], a_prev = table[2 step + 1]): variance = ((1 - a_prev) / (1 - a_t)) * (1 -
    a_t / a_prev), std = eta * sqrt(variance), k = sqrt(max((1 - a_prev) - std^2, 0)). tl.sqrt_rn, not
    the call-free ``sqrt_rn_nonneg``: with it the clipped Philox rollouts took 150-167 registers
    (triton 3.6) for about 2 SASS per element less."""
    a_t = tl.load(table_ptr + 2 * step)
    a_prev = tl.load(table_ptr + 2 * step + 1)
    beta_t = 1.0 - a_t
    beta_prev = 1.0 - a_prev
    std = eta * tl.sqrt_rn(tl.div_rn(beta_prev, beta_t) * (1.0 - tl.div_rn(a_t, a_prev)))
    # clamp: at eta = 1, (1 - a_prev) - std^2 is >= 0 exactly but may round a hair negative
    k = tl.sqrt_rn(tl.maximum(beta_prev - std * std, 0.0))
    return tl.sqrt_rn(a_t), tl.sqrt_rn(beta_t), tl.sqrt_rn(a_prev), k, std


@triton.jit
def div_rn_by_scalar(a, b, b_inv):
    """a / b correctly rounded (div.rn's bits) for a per-sample divisor b > 0 (normal, 1 / b normal) given
    b_inv = tl.div_rn(1.0, b), computed once per program: q = a b_inv, then Markstein's correction
    q - (b q - a) b_inv by two fmas (the residual b q - a is exact), 5-6 SASS per element where div.rn
    issues 14 (its own reciprocal, FCHK and the branch to its slow path, per element). Proof and
    exhaustive checks: docs/kernels.md ("Division by a per-sample scalar"); exact for numerators with
    2**-100 <= |a| <= 2**100 and for zeros (signs kept); an infinite quotient (the residual inf - inf is
    NaN) keeps q, as does NaN; smaller numerators may be an ulp off (tests/test_division.py). Triton
    3.6's interpreter runs tl.fma unfused: an ulp off there now and then."""
    q = a * b_inv
    q1 = tl.fma(tl.fma(b, q, neg(a)), neg(b_inv), q)
    return tl.where(q1 == q1, q1, q)


@triton.jit
def div_rn_tile(a, b, FAST: tl.constexpr):
    """a / b for a per-sample b, IEEE-rounded: div_rn_by_scalar (FAST) or tl.div_rn per element. ddim's
    Philox rollouts keep tl.div_rn: one-tile programs, where without div.rn's per-element calls ptxas
    took up to 168 registers, and spilled under the 128 cap."""
    if FAST:
        q = div_rn_by_scalar(a, b, tl.div_rn(1.0, b))
    else:
        q = tl.div_rn(a, b)
    return q


@triton.jit
def ddim_x0_eps(x, v, sqrt_a, sqrt_b, PRED: tl.constexpr, FAST_DIV: tl.constexpr):
    """(x0_hat, eps_hat) from the model output v (diffusers' prediction_type), before any clip (IEEE
    divisions either way, ``div_rn_tile``)."""
    if PRED == PRED_EPSILON:
        x0 = div_rn_tile(x - sqrt_b * v, sqrt_a, FAST_DIV)
        eps = v
    elif PRED == PRED_SAMPLE:
        x0 = v
        eps = div_rn_tile(x - sqrt_a * x0, sqrt_b, FAST_DIV)
    else:  # PRED_V
        x0 = sqrt_a * x - sqrt_b * v
        eps = sqrt_a * v + sqrt_b * x
    return x0, eps


@triton.jit
def ddim_clip(x0, clip_range):
    """x0 clamped to [-clip_range, clip_range] (diffusers' clip_sample)."""
    return tl.minimum(tl.maximum(x0, -clip_range), clip_range)


@triton.jit
def ddim_mean(x, v, sqrt_a, sqrt_b, sqrt_a_prev, k, clip_range, PRED: tl.constexpr, CLIP: tl.constexpr,
              FAST_DIV: tl.constexpr):
    """mu = sqrt(a_prev) * clip(x0_hat) + k * eps_hat (CLIP: x0_hat clamped to [-clip_range, clip_range])."""
    x0, eps = ddim_x0_eps(x, v, sqrt_a, sqrt_b, PRED, FAST_DIV)
    if CLIP:
        x0 = ddim_clip(x0, clip_range)
    return sqrt_a_prev * x0 + k * eps


@triton.jit
def ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, PRED: tl.constexpr):
    """d mu / d v of ddim's unclipped mean, one per sample: mu = A x + C v is linear without the clip, so
    two policies' means differ by C v - C v_ref exactly (policy_difference), as in every other mode."""
    if PRED == PRED_EPSILON:
        c = k - tl.div_rn(sqrt_a_prev, sqrt_a) * sqrt_b
    elif PRED == PRED_SAMPLE:
        c = sqrt_a_prev - tl.div_rn(k, sqrt_b) * sqrt_a
    else:  # PRED_V
        c = k * sqrt_a - sqrt_a_prev * sqrt_b
    return c


@triton.jit
def ddim_clipped_kl_coefficients(sqrt_a, sqrt_b, k, PRED: tl.constexpr):
    """(e, inv_sqrt_a) of ddim's clipped KL (``ddim_clipped_difference``), once per sample: e = d (k
    eps_hat) / d v (eps_hat is linear in v: k, -(k / sqrt(1 - a)) sqrt(a), k sqrt(a) per prediction)
    and epsilon's 1 / sqrt(a) (its x0_hat; sqrt(a) itself for the others, unused)."""
    inv_sqrt_a = sqrt_a
    if PRED == PRED_EPSILON:
        e = k
        inv_sqrt_a = tl.div_rn(1.0, sqrt_a)
    elif PRED == PRED_SAMPLE:
        e = neg(tl.div_rn(k, sqrt_b) * sqrt_a)
    else:  # PRED_V
        e = k * sqrt_a
    return e, inv_sqrt_a


@triton.jit
def ddim_kl_x0(x, v, sqrt_a, sqrt_b, inv_sqrt_a, PRED: tl.constexpr):
    """x0_hat of the clipped KL, unclipped: fma(-sqrt(1 - a), v, x) / sqrt(a) as the product with the
    per-sample reciprocal (epsilon), v (sample), fma(-sqrt(1 - a), v, sqrt(a) x) (v_prediction)."""
    if PRED == PRED_EPSILON:
        x0 = tl.fma(neg(sqrt_b), v, x) * inv_sqrt_a
    elif PRED == PRED_SAMPLE:
        x0 = v
    else:  # PRED_V
        x0 = tl.fma(neg(sqrt_b), v, sqrt_a * x)
    return x0


@triton.jit
def ddim_clipped_difference(x, v, v_ref, sqrt_a, sqrt_b, sqrt_a_prev, inv_sqrt_a, e, clip_range, PRED: tl.constexpr):
    """mu(v) - mu(v_ref) of ddim's clipped mean (docs/contract.md, ddim): fma(sqrt(a'), clip(x0_hat) -
    clip(x0_hat_ref), e (v - v_ref)), the eps terms' difference taken in v (flowrl.backends.reference's
    ddim_clipped_difference computes the same): no division per element, where diffusers' two means
    took one each."""
    c0 = ddim_clip(ddim_kl_x0(x, v, sqrt_a, sqrt_b, inv_sqrt_a, PRED), clip_range)
    c0_ref = ddim_clip(ddim_kl_x0(x, v_ref, sqrt_a, sqrt_b, inv_sqrt_a, PRED), clip_range)
    return tl.fma(sqrt_a_prev, c0 - c0_ref, e * (v - v_ref))


@triton.jit
def ddim_clipped_kl_grads(x, v, v_ref, sqrt_a, sqrt_b, sqrt_a_prev, inv_sqrt_a, e, clip_range, PRED: tl.constexpr):
    """(d r / d x, d r / d v, -d r / d v_ref) per element of ``ddim_clipped_difference``'s r: the clip
    passes x0_hat's derivative where |x0_hat| <= clip_range (bounds included, as torch.clamp's
    gradient), so d r / d v is e + sqrt(a') d x0 / d v inside and e outside, and d r / d x is
    sqrt(a') d x0 / d x for each side inside (none for sample: x0_hat = v)."""
    inside = tl.abs(ddim_kl_x0(x, v, sqrt_a, sqrt_b, inv_sqrt_a, PRED)) <= clip_range
    inside_ref = tl.abs(ddim_kl_x0(x, v_ref, sqrt_a, sqrt_b, inv_sqrt_a, PRED)) <= clip_range
    if PRED == PRED_EPSILON:
        gx = sqrt_a_prev * inv_sqrt_a
        gv = e - gx * sqrt_b
    elif PRED == PRED_SAMPLE:
        gx = 0.0
        gv = e + sqrt_a_prev
    else:  # PRED_V
        gx = sqrt_a_prev * sqrt_a
        gv = e - sqrt_a_prev * sqrt_b
    dx = tl.where(inside, gx, 0.0) - tl.where(inside_ref, gx, 0.0)
    return dx, tl.where(inside, gv, e), tl.where(inside_ref, gv, e)


@triton.jit
def ddim_mean_grads(x, v, sqrt_a, sqrt_b, sqrt_a_prev, k, clip_range, PRED: tl.constexpr, CLIP: tl.constexpr):
    """(d mu / d x, d mu / d v) per element; the clip passes x0's derivative inside [-range, range]
    (bounds included, as torch.clamp's gradient) and 0 outside. x0's divisions are div_rn_by_scalar's
    (the backward's), and g0 / sqrt(a) is one of two per-sample quotients (0 / sqrt(a) = +0): selected,
    the same bits as dividing per element."""
    if not CLIP:  # per sample, broadcast: dv is ddim_velocity_coefficient's
        if PRED == PRED_EPSILON:
            dx = tl.div_rn(sqrt_a_prev, sqrt_a) + x * 0.0
        elif PRED == PRED_SAMPLE:
            dx = tl.div_rn(k, sqrt_b) + x * 0.0
        else:  # PRED_V
            dx = sqrt_a_prev * sqrt_a + k * sqrt_b + x * 0.0
        dv = ddim_velocity_coefficient(sqrt_a, sqrt_b, sqrt_a_prev, k, PRED) + x * 0.0
    else:
        x0, _ = ddim_x0_eps(x, v, sqrt_a, sqrt_b, PRED, True)
        # -range <= x0 <= range (NaN: outside) as one compare of |x0|: one predicate per element, where
        # ptxas packed two into registers and back under the 128 cap (ddim[epsilon clip]'s gaussian
        # backward 50.8 -> 42.2 SASS per element, triton 3.6); sample's x0 = v keeps the two (its KL
        # backward took 2 more per element with the one)
        inside = tl.abs(x0) <= clip_range
        if PRED == PRED_EPSILON:
            gx0 = tl.where(inside, tl.div_rn(sqrt_a_prev, sqrt_a), 0.0)
            dx = gx0
            dv = k - gx0 * sqrt_b
        elif PRED == PRED_SAMPLE:
            g0 = tl.where((x0 >= -clip_range) & (x0 <= clip_range), sqrt_a_prev, 0.0)
            ge = tl.div_rn(k, sqrt_b)
            dx = ge + x * 0.0
            dv = g0 - ge * sqrt_a
        else:  # PRED_V
            g0 = tl.where(inside, sqrt_a_prev, 0.0)
            dx = g0 * sqrt_a + k * sqrt_b
            dv = k * sqrt_a - g0 * sqrt_b
    return dx, dv
