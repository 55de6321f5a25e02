"""The contract's names and constants, in one place (docs/contract.md).

Every enumeration the public API accepts as a string (modes, log-prob kinds, reductions) and every
internal switch (ops, noise sources) is an ``IntEnum`` here; the Triton kernels receive the integer
values as ``tl.constexpr`` switches and compare them against named constants built from these enums
(``flowrl.kernels.common``), never against bare numbers. The numeric constants of the contract (the
reduction chunk, the Gaussian constant, the sigma == 1 tolerance, the std floor) live here too, so
neither backend imports the other to get them. No torch or triton import: the kernels read it.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Tuple


class _Named(enum.IntEnum):
    """An IntEnum whose public spelling is its lower-case name ("sq_err" is ``SQ_ERR``)."""

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def labels(cls):
        return tuple(member.label for member in cls)

    @classmethod
    def parse(cls, argument: str, value):
        """The member spelled ``value``; ValueError naming ``argument`` otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in cls.labels():
            return cls[value.upper()]
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, cls.labels()))}; got {value!r}")


class Mode(_Named):
    """The step's mean and std (docs/contract.md, Modes)."""

    ODE = 0
    SDE = 1
    DANCE = 2
    CPS = 3
    DDIM = 4
    DPM_SDE = 5
    FLASH_SDE = 6

    @property
    def rules(self) -> "ModeRules":
        """This mode's row of ``MODE_RULES``."""
        return MODE_RULES[self]


class Schedule(_Named):
    """What a mode's ``sigmas=`` holds: a flow schedule [T + 1] (sigma from <= 1 down to 0), or ddim's
    alpha-bar table [2T] of (alpha_bar_t, alpha_bar_prev) pairs."""

    SIGMAS = 0
    ALPHA_BAR = 1


class Variants(_Named):
    """How many kernel specializations flowrl/tools/aot compiles for a mode: FULL (every op x noise
    source x log-prob kind x reduction), FEW (one per op: a mode whose kernels differ from compiled ones
    in per-sample coefficients only), DDIM (ddim's own list, per prediction type and clip)."""

    FULL = 0
    FEW = 1
    DDIM = 2


@dataclass(frozen=True)
class ModeRules:
    """What a mode allows, read by every place that decides it (docs/contributing.md): the argument
    checks (``flowrl.core._validate``, ``flowrl.core.step_spec``, ``flowrl.ops.functional``), the losses, the step
    weights, the rollout recorder, the SGLang converter, the demo's CLI and flowrl/tools/aot.

    noise_level: the inclusive range [lo, hi] of ``noise_level`` (hi may be inf; lo == hi: fixed).
    fixed_why: why the noise level is fixed, for the error message ("" when it is not).
    order: 2 when the step may read the previous step's data prediction (``prev_x0_pred``), else 1.
    extra_inputs: the public keyword arguments only this mode reads.
    schedule: what ``sigmas=`` holds (``Schedule``).
    per_token, frozen: whether ``token_sigmas=`` / ``frozen=`` are defined for it (first-order steps).
    losses: whether flowrl.losses takes it (the loss kernels fuse a mean ``a x + c v``).
    sglang: SGLang's ``rollout_sde_type`` for it (the wire key), None where SGLang has none.
    aot: the kernel specializations flowrl/tools/aot compiles (``Variants``).
    """

    noise_level: Tuple[float, float] = (0.0, math.inf)
    fixed_why: str = ""
    order: int = 1
    extra_inputs: Tuple[str, ...] = ()
    schedule: Schedule = Schedule.SIGMAS
    per_token: bool = True
    frozen: bool = True
    losses: bool = True
    sglang: Optional[str] = None
    aot: Variants = Variants.FULL


MODE_RULES = {
    Mode.ODE: ModeRules(sglang="ode"),
    Mode.SDE: ModeRules(sglang="sde"),
    Mode.DANCE: ModeRules(),
    Mode.CPS: ModeRules(noise_level=(0.0, 1.0), sglang="cps"),
    Mode.DDIM: ModeRules(noise_level=(0.0, 1.0), extra_inputs=("prediction_type", "clip_sample_range"),
                         schedule=Schedule.ALPHA_BAR, per_token=False, frozen=False, losses=False, aot=Variants.DDIM),
    # SDE-DPM-Solver++ (MixGRPO): its std sigma' sqrt(1 - e^(-2h)) is fixed by the schedule
    Mode.DPM_SDE: ModeRules(noise_level=(1.0, 1.0), fixed_why="its std sigma' sqrt(1 - e^(-2h)) has no noise level",
                            order=2, extra_inputs=("prev_x0_pred",), aot=Variants.FEW),
    Mode.FLASH_SDE: ModeRules(aot=Variants.FEW),  # sde's kernel path with another noise scale
}
assert set(MODE_RULES) == set(Mode), "every Mode needs its row in MODE_RULES"


class LogProbKind(_Named):
    """What is reduced per element: the log-prob kinds of ``log_prob_kind=`` and, for ``step_kl``, the KL."""

    GAUSSIAN = 0
    KERNEL = 1
    SQ_ERR = 2
    KL = 3


# the kinds ``log_prob_kind=`` accepts (KL is step_kl's value, not a log-prob kind)
LOG_PROB_KINDS = tuple(k.label for k in LogProbKind if k is not LogProbKind.KL)


class Reduction(_Named):
    MEAN = 0
    SUM = 1


class Op(_Named):
    """Which value the element pass computes: the rollout step (sample, then log-prob of the emitted
    sample), the log-prob of a stored sample, or the KL between two policies' means."""

    ROLLOUT = 0
    LOG_PROB = 1
    KL = 2


class NoiseSource(_Named):
    """Where a rollout's eps comes from: a float32 tensor (given, or drawn from torch generators),
    Philox drawn in the kernel (``noise_seed=``), or none (a step deterministic by its arguments)."""

    TENSOR = 0
    PHILOX = 1
    NONE = 2


class Prediction(_Named):
    """What a ddim model outputs (diffusers' ``prediction_type``): the noise, the clean sample, or
    the velocity ``sqrt(a) eps - sqrt(1 - a) x0`` (docs/contract.md, ddim)."""

    EPSILON = 0
    SAMPLE = 1
    V_PREDICTION = 2


class TrustSource(_Named):
    """Where the trust-region losses' mu_old comes from (kernels/loss.py's TRUST_* switches): none, a
    stored tensor (``old_prev_sample_mean``), or replayed from x' and the rollout's Philox noise."""

    NONE = 0
    GIVEN = 1
    REPLAY = 2


class FlowLoss(_Named):
    """Which forward-process loss (kernels/loss.py's LOSS_* switches)."""

    NFT = 0
    AWM = 1
    DPO = 2  # flowrl/losses/dpo.py
    DGPO = 3


class KLSpace(_Named):
    """Where the GRPO family's KL to the reference is measured (kernels/loss.py's KL_* switches): the
    exact KL of the two step transitions, (mu_theta - mu_ref)^2 / (2 std^2) per element, or the velocity
    space's (v - v_ref)^2 (Flow-Factory's ``kl_type="v-based"``); both reduced like the log-prob."""

    TRANSITION = 0
    VELOCITY = 1


# Elements per reduction chunk: the unit of the deterministic, shard-invariant reduction order. Each
# chunk (zero-padded to CHUNK_SIZE) is cut into leaves of LEAF_SIZE consecutive elements; each leaf is
# summed by the halving tree t[:h] + t[h:], then the chunk's leaf sums by the same tree; a sample's
# chunk partials by the same tree, zero-padded to a power of two (docs/contract.md, Reduction order).
# Leaves first because a GPU thread holds a leaf (16 bytes of bfloat16) in its registers: the tree
# then crosses lanes with one value per thread instead of eight.
CHUNK_SIZE = 1024
LOG2_CHUNK_SIZE = CHUNK_SIZE.bit_length() - 1
assert 1 << LOG2_CHUNK_SIZE == CHUNK_SIZE, "CHUNK_SIZE must be a power of two"
LEAF_SIZE = 8
LOG2_LEAF_SIZE = LEAF_SIZE.bit_length() - 1
assert 1 << LOG2_LEAF_SIZE == LEAF_SIZE and LEAF_SIZE < CHUNK_SIZE, "LEAF_SIZE: a power of two below CHUNK_SIZE"

# log(sqrt(2 pi)), the Gaussian log-density's constant
HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

# sde's sigma == 1 test (fp32 isclose): |sigma - 1| <= SIGMA_ONE_ATOL + SIGMA_ONE_RTOL; also rejects a
# schedule whose sigmas[1] is 1
SIGMA_ONE_RTOL = 1e-5
SIGMA_ONE_ATOL = 1e-8
SIGMA_ONE_TOL = SIGMA_ONE_ATOL + SIGMA_ONE_RTOL

# The std the log-prob and the KL divide by is max(std, STD_FLOOR) (std == 0 is the deterministic
# rule instead). Below 2**-40 ~ 9.1e-13 the noise cannot move a float32 sample of magnitude above
# ~1e-5 at all, std**2 underflows float32 below ~1e-23, and r**2 / std**2 of the rounding residual
# overflows; with the floor, std**2 >= 2**-80 is a normal float32 and the quotient stays finite for
# any |r| < 2.4e7 (docs/contract.md, Deterministic steps and tiny noise).
STD_FLOOR = 2.0**-40

# The in-kernel Philox noise stream's version (docs/contract.md, Noise): which function of (seed,
# stream, element) ``noise_seed`` draws. Bumped whenever that function changes, so a record of seeds
# (a branching trajectory's tree) drawn under another stream is refused, never replayed silently wrong.
# 1: Box-Muller with the platforms' logf and a Taylor sin(pi u) / cos(pi u) (flowrl <= this change);
# 2: the polynomial log and octant sin / cos by separate multiplies and adds;
# 3: the same polynomials by Horner with fused multiply-adds (one rounding each);
# 4: u scaled to stay below 1 (no clamp), a half-circle angle from 23 bits (sin / cos of pi t / 2 by
#    longer polynomials) and one sign for both outputs: 4-5 GPU instructions fewer per pair
#    (docs/kernels_log.md, fourth round). The same bits on every backend.
NOISE_STREAM_VERSION = 4

# Box-Muller (stream 4) in float32 multiplies, adds and fmas (no platform log / sin / cos, which differ
# between backends; the torch reference rounds each fma once, as the GPU's FFMA does), so the torch
# reference draws the kernels' bits. The coefficients are minimax fits (Lawson's iteration) rounded to
# float32 once here, so both backends multiply by the same values.
# u = fma(word, U_SCALE, 2**-33) lies in [2**-33, 1 - 2**-24] (never 0 or 1, so -2 ln u > 0 always)
U_SCALE = (1.0 - 2.0**-24) * 2.0**-32  # exact in float32
# -2 ln(u) = e * NEG_2_LN2 + f * P(f) for u = 2**e * (1 + f), 1 + f in [sqrt(1/2), sqrt(2)):
# P(f) ~ -2 ln(1 + f) / f, degree 7, relative error 1.7e-7 (before float32 rounding); the kernels
# multiply e * 2**23 (the exponent field as an integer) by NEG_2_LN2 * 2**-23: the same product
NEG_2_LN2 = -1.3862943649291992
NEG_2_LN2_M23 = NEG_2_LN2 * 2.0**-23  # exact: a power of two
LOG_SPLIT = 0x3F3504F3  # float32 bits of sqrt(1/2): where the mantissa range [sqrt(1/2), sqrt(2)) starts
LOG_P0 = -1.9999998807907104
LOG_P1 = 1.0000072717666626
LOG_P2 = -0.6667011976242065
LOG_P3 = 0.4993981420993805
LOG_P4 = -0.39800316095352173
LOG_P5 = 0.34501683712005615
LOG_P6 = -0.3244529366493225
LOG_P7 = 0.20213879644870758
# sin(pi t / 2) = t * S(t^2), cos(pi t / 2) = 1 + t^2 * C(t^2) for t in [-1, 1] (a half circle): S
# relative error 5.3e-9, C's cosine absolute error 5.3e-8 (below float32's half ulp at 1)
SIN_A0 = 1.5707963705062866
SIN_A1 = -0.645963728427887
SIN_A2 = 0.07968968152999878
SIN_A3 = -0.004673766437917948
SIN_A4 = 0.00015148513193707913
COS_B0 = -1.233698844909668
COS_B1 = 0.2536531984806061
COS_B2 = -0.020813966169953346
COS_B3 = 0.0008596900734119117

__all__ = [
    "Mode", "ModeRules", "MODE_RULES", "Schedule", "Variants", "Prediction", "LogProbKind", "LOG_PROB_KINDS", "Reduction", "Op", "NoiseSource", "TrustSource", "FlowLoss",
    "KLSpace",
    "CHUNK_SIZE",
    "LOG2_CHUNK_SIZE", "LEAF_SIZE", "LOG2_LEAF_SIZE", "HALF_LOG_2PI", "SIGMA_ONE_RTOL", "SIGMA_ONE_ATOL", "SIGMA_ONE_TOL", "STD_FLOOR",
    "NOISE_STREAM_VERSION",
]
