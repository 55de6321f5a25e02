"""Rollout-training consistency (docs/consistency.md): measure how far the rollout engine's log-probs
are from the training recompute's, and correct for it.

When the rollout log-probs come from another engine (SGLang, vLLM-Omni) or the trainer skips the
recompute, the first-update ratio is not 1 and the mismatch has to be measured and corrected:

- ``mismatch(rollout_log_probs, recomputed_log_probs, clip_range=...)``: per-step and overall mean,
  p99 and max of |dlogp| and |ratio - 1|, and the fraction of (sample, step) pairs the loss would clip
  at ``clip_range``, as plain Python floats (``.to_dict()`` for a logger).
- ``importance_weights``, ``rejection_mask`` and ``correction_weights``: verl's rollout correction
  (truncated IS "TIS", masked IS "IcePop" and rejection sampling "RS", which with IS is verl's
  "Seq-MIS"), per step (verl's "token" level: a diffusion step is a token) or per trajectory (verl's
  "sequence" level). ``correction_weights`` folds IS and RS into one [B, T] multiplier, as verl-omni
  does; pass column j as ``rollout_is_weights=`` to step j's ``flowrl.losses`` call.
- ``guard_clip_range``: warns once when the clip range is below the measured mismatch floor.

The formulas are written here from verl's definitions (not copied), and tested against a transcription
of them (tests/data/test_consistency.py):

- verl-project/verl commit 1dda039b9c6311889a9c9a26040677e1254814f9,
  verl/trainer/ppo/rollout_corr_helper.py: ``compute_rollout_correction_weights`` (IS: log-ratio
  clamped to +-20, exp; "sequence" exp of the clamped sum; threshold ``u`` truncates, ``clamp(max=u)``;
  ``"l_u"`` zeroes weights outside [l, u]; batch normalization to mean 1), ``compute_rollout_rejection_mask``
  (k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio on the clamped log-ratio;
  token, seq_sum, seq_mean, seq_max; k1 kept in [log l, log u], k2 / k3 kept <= u; several options
  AND-ed), and their threshold parsers.
- verl-project/verl-omni commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/trainer/diffusion/rollout_correction.py ``apply_rollout_correction_to_diffusion_batch``
  (dense mask, IS weights times the RS keep-mask as one ``rollout_is_weights``) and
  verl_omni/trainer/diffusion/diffusion_algos.py (``FlowGRPOLoss``, ``FlowDPPOLoss``, ``GRPOGuardLoss``:
  the per-sample policy loss multiplied by the detached weight before the batch mean).

log_ratio is ``recomputed - rollout`` (verl's ``old_log_prob - rollout_log_prob``: the training policy
over the rollout engine's).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .losses import check_clip_range as parse_clip_range

SAFETY_BOUND = 20.0  # verl's clamp of the log-ratio before exp
VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
VERL_OMNI_COMMIT = "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30"
IS_LEVELS = {"step": "step", "token": "step", "trajectory": "trajectory", "sequence": "trajectory"}
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

Threshold = Union[float, str, Tuple[float, float]]


# ------------------------------------------------------------------------------------------ inputs


def _log_prob_pair(rollout_log_probs, recomputed_log_probs) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both as [B, T] float tensors (a [B] pair is one step), same shape, dtype and device, finite."""
    pair = []
    for name, t in (("rollout_log_probs", rollout_log_probs), ("recomputed_log_probs", recomputed_log_probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float tensor [B, T] (or [B]); got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor; got {t.dtype}")
        if t.dim() not in (1, 2) or t.numel() == 0:
            raise ValueError(f"{name} must be a non-empty [B, T] (or [B]) tensor; got shape {tuple(t.shape)}")
        t = t.detach()
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} is {float(t[tuple(where)])} at index {tuple(where)}: log-probs must be finite")
        pair.append(t if t.dim() == 2 else t[:, None])
    a, b = pair
    if a.shape != b.shape:
        raise ValueError(f"rollout_log_probs {tuple(a.shape)} and recomputed_log_probs {tuple(b.shape)} must have "
                         "the same shape")
    if a.dtype != b.dtype:
        raise TypeError(f"rollout_log_probs ({a.dtype}) and recomputed_log_probs ({b.dtype}) must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"rollout_log_probs is on {a.device} but recomputed_log_probs is on {b.device}")
    return a, b


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number; got {value!r}")
    if float(value) <= 0:
        raise ValueError(f"{name} must be > 0; got {value}")
    return float(value)


def _bounds(name: str, spec: Threshold, *, pair_default: bool) -> Tuple[Optional[float], float]:
    """(lower, upper) from a float (lower None, or 1 / upper when ``pair_default``), a pair or verl's
    ``"lower_upper"`` string."""
    if isinstance(spec, str):
        text = spec.strip()
        parts = text.split("_", 1) if "_" in text else [text]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"{name} must be a number, a (lower, upper) pair or a 'lower_upper' string; "
                             f"got {spec!r}") from None
        spec = values[0] if len(values) == 1 else tuple(values)
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"{name} must be a number or a (lower, upper) pair; got {spec!r}")
        lower, upper = _positive(f"{name} lower", spec[0]), _positive(f"{name} upper", spec[1])
        if lower > upper:
            raise ValueError(f"{name}: lower {lower} must be <= upper {upper}")
        return lower, upper
    upper = _positive(name, spec)
    return (1.0 / upper if pair_default else None), upper


# ----------------------------------------------------------------------------------------- mismatch


@dataclass(frozen=True)
class MismatchStats:
    """Statistics of dlogp = recomputed - rollout and of |ratio - 1| = |exp(dlogp) - 1| over a set of
    (sample, step) pairs, as Python floats. ``clip_fraction``: the fraction whose ratio exp(dlogp),
    formed in the log-probs' dtype as ``flowrl.losses`` forms it, is outside [1 - eps_low, 1 + eps_high]
    (None without a clip range). p99: linear interpolation (``torch.quantile``)."""

    count: int
    dlogp_abs_mean: float
    dlogp_abs_p99: float
    dlogp_abs_max: float
    ratio_dev_mean: float
    ratio_dev_p99: float
    ratio_dev_max: float
    clip_fraction: Optional[float]


@dataclass(frozen=True)
class Mismatch:
    """``mismatch``'s result: ``overall`` and one ``per_step`` entry per column (``steps`` names the
    loop step of each column), and the clip range the fractions are for."""

    overall: MismatchStats
    per_step: Tuple[MismatchStats, ...]
    steps: Tuple[int, ...]
    clip_range: Optional[Tuple[float, float]]

    def to_dict(self, prefix: str = "rollout_corr/") -> Dict[str, float]:
        """Flat {name: float} for a logger: ``{prefix}{stat}`` overall and ``{prefix}step_{j}/{stat}``
        per loop step (``clip_fraction`` only with a clip range; ``count`` as a float)."""
        out: Dict[str, float] = {}
        for label, stats in [("", self.overall)] + [(f"step_{j}/", s) for j, s in zip(self.steps, self.per_step)]:
            for key, value in asdict(stats).items():
                if value is not None:
                    out[f"{prefix}{label}{key}"] = float(value)
        return out


def _stats(dlogp64: torch.Tensor, ratio: torch.Tensor, clip: Optional[Tuple[float, float]]) -> MismatchStats:
    a = dlogp64.abs().flatten()
    r = torch.expm1(dlogp64).abs().flatten()
    frac = None
    if clip is not None:
        lo, hi = clip
        frac = float(((ratio < 1.0 - lo) | (ratio > 1.0 + hi)).double().mean())
    return MismatchStats(int(a.numel()), float(a.mean()), float(torch.quantile(a, 0.99)), float(a.max()),
                         float(r.mean()), float(torch.quantile(r, 0.99)), float(r.max()), frac)


def mismatch(rollout_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor, *,
             clip_range=None, steps: Optional[Sequence[int]] = None, warn: bool = True) -> Mismatch:
    """How far the rollout engine's log-probs are from the training recompute's, before any update.

    ``rollout_log_probs``, ``recomputed_log_probs``: [B, T] (or [B], one step), the same dtype; column j
    is loop step ``steps[j]`` (default ``range(T)``). Statistics (float64) of |dlogp| and |ratio - 1|,
    dlogp = recomputed - rollout: mean, p99, max, overall and per step; with ``clip_range`` (eps or
    (eps_low, eps_high), as ``flowrl.losses`` takes it) the fraction of pairs whose first-update ratio
    would be clipped. ``warn``: with a clip range, ``guard_clip_range`` warns (once per process) when
    the clip range is below the mismatch floor."""
    rollout, recomputed = _log_prob_pair(rollout_log_probs, recomputed_log_probs)
    num_steps = rollout.shape[1]
    if steps is None:
        steps = tuple(range(num_steps))
    else:
        steps = tuple(int(s) for s in steps)
        if len(steps) != num_steps:
            raise ValueError(f"steps must name one loop step per column: {num_steps} columns, got {len(steps)} steps")
    clip = parse_clip_range(clip_range) if clip_range is not None else None
    dlogp64 = recomputed.double() - rollout.double()
    ratio = torch.exp(recomputed - rollout)  # as flowrl.losses forms it (the log-probs' dtype)
    result = Mismatch(_stats(dlogp64, ratio, clip),
                      tuple(_stats(dlogp64[:, j], ratio[:, j], clip) for j in range(num_steps)), steps, clip)
    if warn and clip is not None:
        guard_clip_range(clip_range, result)
    return result


class ClipBelowMismatchWarning(UserWarning):
    """The clip range is below the rollout / recompute mismatch floor (``guard_clip_range``)."""


_warned = False
FLOORS = ("mean", "p99", "max")


def guard_clip_range(clip_range, measured: Mismatch, *, floor: str = "mean") -> bool:
    """True when the clip range is at or above the mismatch floor; else warns (a
    ``ClipBelowMismatchWarning``, once per process) and returns False.

    The floor is ``measured.overall``'s ``ratio_dev_{floor}`` (|ratio - 1| before any update: engine
    noise, not policy change); the clip range's smaller side, min(eps_low, eps_high), is compared with
    it. Below the floor, the first update already clips (or, for Flow-DPPO, masks) samples because of
    the engines' rounding; widen the clip range above the floor, or recompute the old log-probs with
    flowrl (ratio exactly 1) and correct with ``correction_weights``."""
    global _warned
    if not isinstance(measured, Mismatch):
        raise TypeError(f"measured must be flowrl.consistency.mismatch(...)'s result; got {type(measured).__name__}")
    if floor not in FLOORS:
        raise ValueError(f"floor must be one of {FLOORS}; got {floor!r}")
    lo, hi = parse_clip_range(clip_range)
    eps = min(lo, hi)
    stats = measured.overall
    value = getattr(stats, f"ratio_dev_{floor}")
    if eps >= value:
        return True
    if not _warned:
        _warned = True
        fraction = stats.clip_fraction if measured.clip_range == (lo, hi) else None
        clipped = f"; {fraction:.1%} of them would clip at this range" if fraction is not None else ""
        warnings.warn(
            f"flowrl.consistency: the clip range (eps_low={lo:g}, eps_high={hi:g}: the smaller, {eps:g}, is the "
            f"policy's trust region) is below the measured rollout/recompute mismatch floor (|ratio - 1| "
            f"{floor} = {value:.3g}, p99 {stats.ratio_dev_p99:.3g}, max {stats.ratio_dev_max:.3g} over "
            f"{stats.count} (sample, step) pairs before any update: the engines' numerical noise){clipped}. The clip "
            "then acts on noise, not on policy change: widen the clip range above the floor, or recompute the "
            "old log-probs with flowrl and correct with flowrl.consistency.correction_weights (docs/consistency.md). "
            "Warned once per process.",
            ClipBelowMismatchWarning, stacklevel=2)
    return False


def _reset_warning() -> None:
    """Forget that ``guard_clip_range`` warned (tests)."""
    global _warned
    _warned = False


# -------------------------------------------------------------------------------------- IS weights


def importance_weights(rollout_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor, *,
                       level: str = "step", threshold: Threshold = 2.0, batch_normalize: bool = False) -> torch.Tensor:
    """verl's rollout-correction IS weights pi_train / pi_rollout, [B, T] in the log-probs' dtype, detached.

    ``level``: "step" (verl "token": w = exp(clamp(log_ratio, -20, 20)) per step) or "trajectory" (verl
    "sequence": w = exp(clamp(sum over steps of log_ratio, -20, 20)), the same in every column).
    ``threshold``: a number u truncates, min(w, u) (TIS); a pair (l, u) or verl's "l_u" string masks,
    w outside [l, u] -> 0 (verl's IcePop, a masked IS). ``batch_normalize``: divide by the batch mean
    (over all [B, T] weights per step; over the B trajectory weights per trajectory) when it is > 1e-8
    (verl's, single process: verl all-reduces the mean under torch.distributed)."""
    rollout, recomputed = _log_prob_pair(rollout_log_probs, recomputed_log_probs)
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {sorted(IS_LEVELS)}; got {level!r}")
    if not isinstance(batch_normalize, bool):
        raise TypeError(f"batch_normalize must be a bool; got {batch_normalize!r}")
    lower, upper = _bounds("threshold", threshold, pair_default=False)
    log_ratio = recomputed - rollout
    if IS_LEVELS[level] == "step":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        raw = torch.exp(log_ratio.sum(dim=-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        if IS_LEVELS[level] == "step":
            mean = weights.sum() / (weights.numel() + 1e-8)
        else:
            per_trajectory = weights.sum(dim=-1) / (weights.shape[1] + 1e-8)
            mean = per_trajectory.sum() / per_trajectory.numel()
        if mean > 1e-8:
            weights = weights / mean
    return weights.contiguous()


# ---------------------------------------------------------------------------------- rejection mask


def rejection_mask(rollout_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor, *,
                   criterion: str, threshold: Union[Threshold, Sequence[Threshold]]) -> torch.Tensor:
    """verl's rollout-correction rejection sampling: a keep-mask [B, T] (1 keep, 0 reject) in the
    log-probs' dtype.

    ``criterion``: one of ``RS_OPTIONS`` or several, comma-separated (all must pass). With lr =
    clamp(log_ratio, -20, 20): k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr; "token_*" per step
    ("token" = a diffusion step), "seq_sum_*" / "seq_mean_*" / "seq_max_*" over a trajectory's steps
    (the whole trajectory kept or rejected). k1 options keep log(l) <= stat <= log(u) (``threshold``: a
    pair (l, u), "l_u", or u alone meaning (1/u, u)); k2 / k3 options keep stat <= u (a single number).
    ``threshold``: one for all options, or one per option (a sequence, or verl's comma-separated string).
    """
    rollout, recomputed = _log_prob_pair(rollout_log_probs, recomputed_log_probs)
    if not isinstance(criterion, str) or not criterion.strip():
        raise ValueError(f"criterion must be a non-empty string of {list(RS_OPTIONS)} (comma-separated); got {criterion!r}")
    options = []
    for opt in (o.strip() for o in criterion.split(",")):
        if opt not in RS_OPTIONS:
            raise ValueError(f"criterion: {opt!r} is not one of {list(RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if isinstance(threshold, str):
        specs = [p.strip() for p in threshold.split(",") if p.strip()]
    elif isinstance(threshold, (list, tuple)) and len(threshold) and isinstance(threshold[0], (list, tuple, str)):
        specs = list(threshold)
    elif isinstance(threshold, (list, tuple)) and len(options) > 1 and len(threshold) == len(options):
        specs = list(threshold)  # one number per option
    else:
        specs = [threshold]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"threshold: give one for all {len(options)} criteria or one each; got {len(specs)}")
    specs = specs * len(options) if len(specs) == 1 else specs

    lr = (recomputed - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_step = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    count = lr.shape[1]
    keep = torch.ones_like(lr)
    for opt, spec in zip(options, specs):
        estimator = opt[-2:]
        stat = per_step[estimator]
        if opt.startswith("seq_sum"):
            stat = stat.sum(dim=-1, keepdim=True)
        elif opt.startswith("seq_mean"):
            stat = stat.sum(dim=-1, keepdim=True) / (count + 1e-8)
        elif opt.startswith("seq_max"):
            stat = stat.max(dim=-1, keepdim=True).values
        if estimator == "k1":
            lower, upper = _bounds(f"threshold for {opt}", spec, pair_default=True)
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            if isinstance(spec, (tuple, list)) or (isinstance(spec, str) and "_" in spec):
                raise ValueError(f"threshold for {opt} must be a single upper bound; got {spec!r}")
            _, upper = _bounds(f"threshold for {opt}", spec, pair_default=False)
            ok = stat <= upper
        keep = keep * ok.expand_as(lr).to(lr.dtype)
    return keep


def correction_weights(rollout_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor, *,
                       rollout_is: Optional[str] = None, rollout_is_threshold: Threshold = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
                       rollout_rs_threshold=None) -> torch.Tensor:
    """The [B, T] multiplier of verl-omni's decoupled rollout correction (its config keys): the IS
    weights (``importance_weights(level=rollout_is, threshold=rollout_is_threshold, ...)``, or 1 when
    ``rollout_is`` is None) times the RS keep-mask (``rejection_mask(criterion=rollout_rs, ...)``, or 1).
    Column j is step j's ``rollout_is_weights=`` for ``flowrl.losses``. verl's presets: Token-TIS
    ``rollout_is="token"``; Seq-TIS ``"sequence"``; Seq-MIS ``rollout_is="sequence", rollout_rs="seq_sum_k1",
    rollout_rs_threshold=(0.5, 2.0)``."""
    rollout, recomputed = _log_prob_pair(rollout_log_probs, recomputed_log_probs)
    if rollout_is is None and rollout_rs is None:
        raise ValueError("pass rollout_is (an IS level) or rollout_rs (a rejection criterion), or both")
    weights = None
    if rollout_is is not None:
        weights = importance_weights(rollout, recomputed, level=rollout_is, threshold=rollout_is_threshold,
                                     batch_normalize=rollout_is_batch_normalize)
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be given with rollout_rs")
        keep = rejection_mask(rollout, recomputed, criterion=rollout_rs, threshold=rollout_rs_threshold)
        weights = keep if weights is None else weights * keep
    return weights


__all__ = [
    "mismatch", "Mismatch", "MismatchStats", "guard_clip_range", "ClipBelowMismatchWarning", "importance_weights",
    "rejection_mask", "correction_weights", "RS_OPTIONS", "IS_LEVELS", "SAFETY_BOUND", "FLOORS",
]
