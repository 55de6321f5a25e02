"""flowrl's math in float64, slow and readable: the contract's formulas as written.

``flowrl.oracle`` is an independent float64 implementation of docs/contract.md (the step's mean, std,
sample, log-prob kinds, KL and reductions, for every mode of ``flowrl.contract.Mode``: ``steps``) and of
docs/losses.md's "Formulas" (every loss of ``flowrl.losses``: ``losses``). It is written from those
pages' formulas, not from ``flowrl.backends.reference``, which stays the bit-exact emulator of the
kernels (their float32 operations in their order, their reduction tree): where the two disagree beyond
float32 rounding, one of them is a bug. So flash-linear-attention keeps ``naive.py`` beside ``chunk.py``.

Everything here is float64: step scalars are Python floats computed from the float32 schedule, the
elementwise work is float64 torch ops (autograd differentiates it), per-sample reductions are plain
float64 sums, and rows are handled one sample at a time. It is for tests (tests/ops/test_contract.py
holds every mode and every loss to it on both backends) and for users checking a kernel::

    from flowrl import oracle
    lp64 = oracle.log_prob(x, v, out.prev_sample, sigmas, i, "sde", 0.7)   # float64 [B]
    err = (flowrl.step_log_prob(x, v, out.prev_sample, sigmas, i).double() - lp64).abs().max()

A new mode adds its row to ``flowrl/oracle/steps.py``, a new loss its function to
``flowrl/oracle/losses.py`` (docs/contributing.md); a mode or loss without one raises
``NotImplementedError`` naming it.
"""
from . import losses, steps
from .fields import gaussian_velocity, mixture_velocity
from .steps import (DDIM, F64, MODES, SIGMA_ONE_RTOL, STD_FLOOR, Step, kl, log_prob, mean, mode_name, reduce,
                    row_mean, sample, std, step_scalars)

_row_mean = row_mean  # the name tests/oracle.py gave it

__all__ = [
    "steps", "losses", "Step", "DDIM", "MODES", "F64", "SIGMA_ONE_RTOL", "STD_FLOOR", "step_scalars", "mode_name",
    "row_mean", "mean", "std", "sample", "log_prob", "kl", "reduce", "gaussian_velocity", "mixture_velocity",
]
