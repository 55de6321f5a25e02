"""Triton helpers shared by every flowrl kernel: the modes' coefficients, the mean, the named constexpr
switches and ddim's math, and (re-exported from their topic modules) the float32 numerics
(kernels/numerics.py), Philox noise (kernels/philox.py) and the fixed halving-tree reduction
(kernels/reduce.py). Each piece of math is written once, so the rollout kernel and the
log-prob recompute kernel run the same instructions (docs/contract.md, Rounding / Reduction order).

Conventions kept by every kernel: loads are upcast to float32 right away (Triton's interpreter
mishandles bf16 arithmetic, and the contract computes in float32), division and square root are the
IEEE round-to-nearest forms (``div_rn`` / ``sqrt_rn``; Triton's plain ``sqrt`` is approximate on GPU),
and launchers pass ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA: the
arithmetic is then the reference's, operation for operation.
"""
import triton
import triton.language as tl

from flowrl.contract import HALF_LOG_2PI as _HALF_LOG_2PI
from flowrl.contract import STD_FLOOR as _STD_FLOOR
from flowrl.contract import LogProbKind, Mode, NoiseSource, Op, Prediction

# Helpers by topic, re-exported here: ``from flowrl.kernels.common import X`` keeps working, and a kernel's
# jit function resolves them as globals of its own module wherever it imports them from.
from .numerics import INTERPRETED, bf16_words_to_f32, neg, round_pairs, round_to, to_f32, words_to_f32  # noqa: F401
from .philox import COS_B0, COS_B1, COS_B2, COS_B3, LOG_P0, LOG_P1, LOG_P2, LOG_P3, LOG_P4, LOG_P5  # noqa: F401
from .philox import LOG_P6, LOG_P7, LOG_SPLIT, NEG_2_LN2, NEG_2_LN2_M23, PHILOX_M0, PHILOX_M0_ASM  # noqa: F401
from .philox import PHILOX_M1, PHILOX_M1_ASM, PHILOX_W0, PHILOX_W1, SIN_A0, SIN_A1, SIN_A2, SIN_A3  # noqa: F401
from .philox import SIN_A4, TWO_POW_M33, U_SCALE, box_muller, box_muller_radius, mul_wide_u32  # noqa: F401
from .philox import philox4x32_10, philox4x32_10_pair, philox_key, philox_normal_block  # noqa: F401
from .philox import philox_normal_quads, philox_quad, philox_round, sqrt_rn_nonneg, sqrt_rn_normal  # noqa: F401
from .reduce import LEAF, LOG2_LEAF, carry_part_leaves, chunk_tree_rows, halving_tree_rows  # noqa: F401
from .reduce import leaf_sums_rows, part_chunk_partial  # noqa: F401

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
    NaN) keeps q, as does NaN; smaller numerators may be an ulp off (tests/kernels/test_division.py). Triton
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
