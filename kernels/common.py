"""Triton helpers shared by every flowrl kernel: the modes' coefficients, the mean, and the fixed
halving-tree reduction. Each piece of math is written here once, so the rollout kernel and the
log-prob recompute kernel run the same instructions (SPEC, Rounding / Reduction order).

Conventions kept by every kernel: loads are upcast to float32 right away (Triton's interpreter
mishandles bf16 arithmetic, and the contract computes in float32), division and square root are the
IEEE round-to-nearest forms (``div_rn`` / ``sqrt_rn``; Triton's plain ``sqrt`` is approximate on GPU),
and launchers pass ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA: the
arithmetic is then the reference's, operation for operation.
"""
import triton
import triton.language as tl

# Integer codes of the string options, shared by the launchers (flowrl/_triton_ops.py) and kernels.
MODE_CODES = {"ode": 0, "sde": 1, "dance": 2, "cps": 3}
KIND_CODES = {"gaussian": 0, "kernel": 1, "sq_err": 2, "kl": 3}
SQ_ERR_CODE = 2
KL_CODE = 3
GAUSSIAN_CODE = 0


@triton.jit
def mode_coefficients(sigmas_ptr, step, sigma_one_tol, eta, sin_half_pi_eta, MODE: tl.constexpr):
    """Per-sample ``(a, c, std)`` with ``mu = a * x + c * v`` (SPEC, Modes), from the float32 table.

    ``step`` is the sample's step index; ``sin_half_pi_eta`` is ``sin(eta * pi / 2)`` computed once on
    the host in float32 (only cps reads it; it depends on the scalar ``eta`` alone)."""
    sigma = tl.load(sigmas_ptr + step)
    sigma_next = tl.load(sigmas_ptr + step + 1)
    d = sigma - sigma_next  # D > 0; diffusers' dt is -D
    if MODE == 0:  # ode
        a = sigma * 0.0 + 1.0
        c = -d
        std = sigma * 0.0
    elif MODE == 3:  # cps
        std = sigma_next * sin_half_pi_eta
        # clamp: at eta = 1, sigma'^2 - std^2 is 0 up to rounding and may come out a hair negative
        k = tl.sqrt_rn(tl.maximum(sigma_next * sigma_next - std * std, 0.0))
        a = (1.0 - sigma_next) + k
        c = k * (1.0 - sigma) - (1.0 - sigma_next) * sigma
    else:  # sde (1) or dance (2)
        if MODE == 1:
            # sigma == 1 would divide by zero: use the schedule's second value (Flow-GRPO, SGLang)
            sigma_sub = tl.load(sigmas_ptr + 1)
            sigma_t = tl.where(tl.abs(sigma - 1.0) <= sigma_one_tol, sigma_sub, sigma)
            s = eta * tl.sqrt_rn(tl.div_rn(sigma, 1.0 - sigma_t))
        else:
            s = sigma * 0.0 + eta
        s2 = s * s
        two_sigma = 2.0 * sigma
        a = 1.0 - tl.div_rn(s2 * d, two_sigma)
        c = -(1.0 + tl.div_rn(s2 * (1.0 - sigma), two_sigma)) * d
        std = s * tl.sqrt_rn(d)
    return a, c, std


@triton.jit
def step_mean(a, c, x, v):
    """mu = a * x + c * v in float32 (x, v already upcast)."""
    return a * x + c * v


@triton.jit
def halving_tree_sum(t, WIDTH: tl.constexpr, LOG2_WIDTH: tl.constexpr):
    """Sum of a 1-D float32 block of WIDTH = 2**LOG2_WIDTH values by the fixed halving tree
    ``t[:h] + t[h:]`` repeated (flowrl.reference._pairwise_sum). Each level sums an axis of length
    2, i.e. one IEEE add per output, so the bits do not depend on the compiler's register layout,
    the kernel it is inlined in, or the launch settings."""
    for level in tl.static_range(LOG2_WIDTH):
        t = tl.sum(tl.reshape(t, (2, WIDTH >> (level + 1))), axis=0)
    return tl.sum(t, axis=0)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to the storage dtype DTYPE, to nearest even (torch's ``.to``).

    bfloat16 is rounded here with integer ops: Triton's interpreter truncates float32 -> bfloat16, and
    the explicit rounding gives the same bits on GPU and interpreter (finite inputs; an overflow
    carries into the exponent and gives inf, as hardware rounding does)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
