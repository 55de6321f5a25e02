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
    """How many kernel specializations kernels/aot.py compiles for a mode: FULL (every op x noise
    source x log-prob kind x reduction), FEW (one per op: a mode whose kernels differ from compiled ones
    in per-sample coefficients only), DDIM (ddim's own list, per prediction type and clip)."""

    FULL = 0
    FEW = 1
    DDIM = 2


@dataclass(frozen=True)
class ModeRules:
    """What a mode allows, read by every place that decides it (docs/contributing.md): the argument
    checks (``flowrl._validate``, ``flowrl.step_spec``, ``flowrl.functional``), the losses, the step
    weights, the rollout recorder, the SGLang converter, the demo's CLI and kernels/aot.py.

    noise_level: the inclusive range [lo, hi] of ``noise_level`` (hi may be inf; lo == hi: fixed).
    fixed_why: why the noise level is fixed, for the error message ("" when it is not).
    order: 2 when the step may read the previous step's data prediction (``prev_x0_pred``), else 1.
    extra_inputs: the public keyword arguments only this mode reads.
    schedule: what ``sigmas=`` holds (``Schedule``).
    per_token, frozen: whether ``token_sigmas=`` / ``frozen=`` are defined for it (first-order steps).
    losses: whether flowrl.losses takes it (the loss kernels fuse a mean ``a x + c v``).
    sglang: SGLang's ``rollout_sde_type`` for it (the wire key), None where SGLang has none.
    aot: the kernel specializations kernels/aot.py compiles (``Variants``).
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
    """What is reduced per element: the log-prob kinds of ``log_prob=`` and, for ``step_kl``, the KL."""

    GAUSSIAN = 0
    KERNEL = 1
    SQ_ERR = 2
    KL = 3


# the kinds ``log_prob=`` accepts (KL is step_kl's value, not a log-prob kind)
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
# chunk is summed by the halving tree t[:h] + t[h:] (zero-padded to CHUNK_SIZE), and a sample's chunk
# partials by the same tree, zero-padded to a power of two (docs/contract.md, Reduction order).
CHUNK_SIZE = 1024
LOG2_CHUNK_SIZE = CHUNK_SIZE.bit_length() - 1
assert 1 << LOG2_CHUNK_SIZE == CHUNK_SIZE, "CHUNK_SIZE must be a power of two"

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

# Box-Muller's sin(pi u), cos(pi u) (in-kernel Philox noise): Taylor coefficients of sin and cos on
# |s| <= pi / 4 (truncation error below 1e-11), rounded to float32 once here so that both backends
# multiply by the same values. A polynomial rather than the platform's sinf / cosf: those are different
# functions on each backend, and triton 3.6's cosf carries a large-argument path in local memory.
PI_F32 = 3.1415927410125732
SINPI_S3 = -0.1666666716337204
SINPI_S5 = 0.008333333767950535
SINPI_S7 = -0.00019841270113829523
SINPI_S9 = 2.7557318844628753e-06
SINPI_S11 = -2.5052107943679403e-08
COSPI_C2 = -0.5
COSPI_C4 = 0.0416666679084301
COSPI_C6 = -0.0013888889225199819
COSPI_C8 = 2.4801587642286904e-05
COSPI_C10 = -2.755731998149713e-07
COSPI_C12 = 2.0876755879584152e-09

__all__ = [
    "Mode", "ModeRules", "MODE_RULES", "Schedule", "Variants", "Prediction", "LogProbKind", "LOG_PROB_KINDS", "Reduction", "Op", "NoiseSource", "TrustSource", "FlowLoss",
    "KLSpace",
    "CHUNK_SIZE",
    "LOG2_CHUNK_SIZE", "HALF_LOG_2PI", "SIGMA_ONE_RTOL", "SIGMA_ONE_ATOL", "SIGMA_ONE_TOL", "STD_FLOOR",
]
