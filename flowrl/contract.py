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
    "Mode", "Prediction", "LogProbKind", "LOG_PROB_KINDS", "Reduction", "Op", "NoiseSource", "TrustSource", "FlowLoss",
    "CHUNK_SIZE",
    "LOG2_CHUNK_SIZE", "HALF_LOG_2PI", "SIGMA_ONE_RTOL", "SIGMA_ONE_ATOL", "SIGMA_ONE_TOL", "STD_FLOOR",
]
