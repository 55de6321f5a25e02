"""One validated, immutable description of a GRPO-family loss: ``GRPOLossSpec``, and the tensors it reads,
``GRPOInputs`` (docs/losses.md).

``flowrl.losses`` builds both once per call (``flowrl/losses/_grpo.py``: ``validate``, every check naming
its argument) from the public function's arguments; the backends read the loss's options and the step's
switches from the spec's named fields and the tensors from the inputs' named fields, eager or through
the custom op ``flowrl::grpo_family_loss`` (which packs them into schema values and back). So
``model_output`` goes ``grpo_loss`` -> ``GRPOCall.model_output`` -> ``GRPOInputs.model_output`` ->
the backend's ``grpo_values(loss, inputs)`` -> the kernel launch, never by position in a bundle.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from ..contract import KLSpace, TrustSource
from ._validate import NoiseSeed
from .step_spec import StepSpec


class Variant(enum.IntEnum):
    """Which GRPO-family loss: the clipped surrogate (GRPO), GRPO-Guard's corrected ratio, Flow-DPPO's mask."""

    GRPO = 0
    GUARD = 1
    DPPO = 2


class GRPOInputs(NamedTuple):
    """The tensors a GRPO-family loss reads, validated (each optional one may be None).

    sample, model_output, prev_sample: the step's x, v (the only one with a gradient) and stored x'.
    old_log_prob, advantages: per sample [B], the rollout's log-prob and the advantage.
    ref_model_output: the reference policy's output (its unconditional branch when ``ref_cond`` is given).
    ref_cond: the reference's conditional branch, guided inside the pass at ``GRPOLossSpec.ref_scale``.
    old_prev_sample_mean: the rollout's mean mu_old (``TrustSource.GIVEN``).
    rollout_is_weights: [B] rollout-correction weights on each sample's surrogate.
    kl_coef: [B] per-sample KL coefficients (the call's ``kl_coef`` given as a tensor: the KL term is then
        mean(kl_coef * kl), GARDO's gated KL; ``flowrl.advantages.gardo_kl_coef``), else None (the
        scalar ``GRPOLossSpec.kl_coef``).
    """

    sample: torch.Tensor
    model_output: torch.Tensor
    prev_sample: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    ref_model_output: Optional[torch.Tensor] = None
    ref_cond: Optional[torch.Tensor] = None
    old_prev_sample_mean: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    kl_coef: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class GRPOLossSpec:
    """Everything a backend needs about a GRPO-family loss besides the tensors.

    variant: GRPO, GUARD or DPPO.
    step: the log-prob's ``StepSpec`` (schedule, mode, noise level, kind, reduction, count, shard, per-token).
    trust: where mu_old comes from (NONE for GRPO; GIVEN: ``old_prev_sample_mean``; REPLAY: Philox ``seed``).
    seed: the rollout's validated noise seed (REPLAY), else None.
    clip: (eps_low, eps_high), None for Flow-DPPO (no ratio clip).
    kl_coef, kl_space: the KL term's weight and where the KL is measured (``kl_coef`` 0.0 when the call's
        is a per-sample [B] tensor, which travels as ``GRPOInputs.kl_coef``).
    kl_threshold: Flow-DPPO's divergence bound, else None.
    ref_scale: the reference's guidance scale when its two branches are given, else None.
    backend: the resolved backend's name ("torch" or "triton").
    """

    variant: Variant
    step: StepSpec
    trust: TrustSource = TrustSource.NONE
    seed: Optional[NoiseSeed] = None
    clip: Optional[Tuple[float, float]] = None
    kl_coef: float = 0.0
    kl_space: KLSpace = KLSpace.TRANSITION
    kl_threshold: Optional[float] = None
    ref_scale: Optional[float] = None
    backend: str = "torch"


__all__ = ["Variant", "GRPOInputs", "GRPOLossSpec"]
