"""Which sampler modes a test module covers (docs/contributing.md, "Adding a mode").

A test module that runs its checks over a list of modes builds that list here, from
``flowrl.contract.Mode`` less the modes it names in ``MODES_ELSEWHERE``, each with why and the test
file that covers it instead. A new ``Mode`` then joins every such list at once (and fails there until
its formulas are in the module's float64 oracle), or is named as excluded with a reason: it is never
left out silently. tests/repo/test_recipes.py checks every module in ``SUITES``, and that no test module
holds a hand-written list of mode names again.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Tuple

from flowrl.contract import Mode

# the modules that run their checks over a list of modes: each has MODES (this file's ``every_mode_but``)
# and MODES_ELSEWHERE (label -> why it is not in MODES, naming the test file that covers it instead)
SUITES = ("test_kernels", "test_properties", "test_per_token", "test_reference", "test_demo", "test_step_weights")

# modes whose step is deterministic at every noise level (std 0): their log-prob and KL are exactly 0, so
# the checks of a noisy step (rollout == recompute, gradients of the log-prob, variance) do not apply
DETERMINISTIC = {"ode": "the probability-flow ODE: std 0 at every noise level, its log-prob and KL exactly 0 "
                        "(tests/kernels/test_kernels.py, test_deterministic_steps_have_zero_value_and_grad)"}


def every_mode_but(elsewhere: Mapping[str, str]) -> Tuple[str, ...]:
    """Every Mode's label, in Mode order, but those ``elsewhere`` names (label -> why, and where it is
    tested instead)."""
    unknown = set(elsewhere) - set(Mode.labels())
    assert not unknown, f"not modes: {sorted(unknown)}"
    assert all(isinstance(why, str) and why.strip() for why in elsewhere.values()), elsewhere
    return tuple(label for label in Mode.labels() if label not in elsewhere)


def noisy(modes: Iterable[str]) -> Tuple[str, ...]:
    """``modes`` less the DETERMINISTIC ones."""
    return tuple(m for m in modes if m not in DETERMINISTIC)


def noise_levels(chosen: Mapping[str, float], modes: Iterable[str], default: float = 0.5) -> Dict[str, float]:
    """The noise level a test uses for each of ``modes``: ``chosen``'s, or for a mode it does not name
    (a new one) ``default`` clamped into the mode's MODE_RULES range."""
    levels = {}
    for label in modes:
        lo, hi = Mode.parse("mode", label).rules.noise_level
        levels[label] = chosen[label] if label in chosen else min(max(default, lo), hi)
    return levels
