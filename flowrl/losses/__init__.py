"""Fused training losses of diffusion RL (docs/losses.md): one call replaces a trainer's loss block.

- ``grpo_loss``: the PPO/GRPO clipped surrogate with its log-prob recompute (bit for bit
  ``flowrl.step_log_prob``'s, so the first ratio is exactly 1) and ``kl_coef`` x the exact KL to a
  reference policy (or, ``kl_space="velocity"``, its velocity's mean (v - v_ref)^2; the reference given
  guided or as its two CFG branches); symmetric or asymmetric clip ranges; the stats trainers log.
- ``grpo_guard_loss`` (GRPO-Guard) and ``flow_dppo_loss`` (Flow-DPPO): trust-region variants that need
  the rollout's mean mu_old, given (``old_prev_sample_mean``) or replayed from the stored x' and the
  rollout's in-kernel noise (``noise_seed``): mu_old = x' - std * eps.
- ``teacher_kl_loss`` (Diffusion-OPD): the batch mean of the exact KL to a teacher's transition.
- ``nft_loss`` (DiffusionNFT) and ``awm_loss`` / ``awm_log_prob`` (Advantage Weighted Matching):
  forward-process losses that use no SDE log-prob.

Each reaches its per-sample values through the backend table (``flowrl.backends._dispatch``), like the step
ops: the torch backend's (flowrl.backends.reference_losses, with flowrl.backends.reference's math: the oracle) or the
Triton backend's (flowrl.backends._triton_losses, kernels/loss.py: one element pass forward, one backward that
writes d loss / d model_output). Per-sample values are
reduced in the contract's fixed chunked halving-tree order: deterministic and batch-invariant; only
the final batch mean depends on the batch. The per-sample [B] arithmetic after the reductions
(ratio, clip, masks, weights) is written once for both backends (flowrl/losses/_policy.py,
_flow.py, _teacher.py), and run by eager mode and by the losses' custom ops under torch.compile
(flowrl/losses/_custom_ops.py, docs/compile.md).

Joint steps (several streams stepped together: LTX-2's and MiniMax-H3's video and audio): every loss
but the preference losses takes its sample-shaped inputs as tuples, one tensor per stream, with
``stream_weights``; each per-sample mean is ``flowrl.combine_streams`` of the streams' fused sums and
counts (flowrl/losses/_joint.py; GRPO-Guard's step quantities are verl-omni's element-count averages;
docs/losses.md, Joint steps).

Gradients flow to ``model_output`` only: ``sample``, ``prev_sample``, the reference / old / teacher
outputs and the stored means are data, and a tensor among them that requires grad is refused.

Sequence parallelism: every loss takes ``shard=`` (a ``ShardContext``; ``flowrl.distributed``'s forms
build it from a process group), and its tensors of the sample's shape are then this rank's shards. The
per-sample sums' chunk partials are gathered across the ranks (the step ops' mechanism, in the
backends' ``grpo_values`` / ``flow_sums``), so the [B] values and the [B] arithmetic after them are the
full samples', the same on every rank, and each rank's gradient is its slice of the single-device
gradient (bit for bit when every shard but the last is a whole number of chunks; docs/wire_and_sp.md).
Sharded calls run eagerly (not through the custom ops) under torch.compile, as the step ops do.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Optional, Sequence, Tuple, Union

import torch

from ..core import _validate as V
from ..contract import FlowLoss, KLSpace, TrustSource
from ..core.loss_spec import Variant as _Variant
from ..core.step_spec import ShardContext, elements_per_sample
from ..ops._custom_ops import is_empty as _empty
from ..ops._custom_ops import traced as _traced
from . import _custom_ops as _ops
from . import _joint
from . import _stream_advantages
from ._common import _check_no_grad, _check_per_sample, _check_scalar, _flow_backend, check_clip_range
from ._custom_ops import grpo_family_loss
from ._grpo import GRPOCall, validate
from ._flow import (AWM_EPS, NFTLossOutput, awm_from_args, awm_from_means, awm_log_prob_from_args, awm_sums,
                    nft_from_args, nft_from_means, nft_sums)
from ._policy import GRPOLossOutput, grpo_from_spec, policy_loss
from ._teacher import StepKLExtras as _StepKLExtras
from ._teacher import multi_teacher_loss as _multi_teacher_loss
from ._teacher import several_teachers as _several_teachers
from ._teacher import teacher_kl as _teacher_kl

ClipRange = Union[float, Tuple[float, float]]
# the reference policy's output: its (guided) output, or its two branches (uncond, cond) guided inside the
# loss's pass at ``ref_guidance_scale``
RefOutput = Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------- the GRPO family's loss block


def _grpo_family(variant: _Variant, call: GRPOCall) -> GRPOLossOutput:
    """The GRPO family's loss: a joint step's streams combined (flowrl/losses/_joint.py), or one step's spec
    and inputs (``validate``) through the backend, eager or (while torch.compile traces, one device) the
    custom op flowrl::grpo_family_loss; an empty batch (B = 0, sharded or not): its wrapper's zeros, nothing
    launched (flowrl/losses/_custom_ops.py, _call)."""
    if isinstance(call.sample, tuple):
        return _joint.grpo_family(variant, call)
    spec, inputs = validate(variant, call)
    if (_traced() and call.shard is None) or _empty(call.sample):
        return grpo_family_loss(spec, inputs)
    return grpo_from_spec(spec, inputs)


def grpo_loss(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: ClipRange,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    kl_coef: Union[float, torch.Tensor] = 0.0,
    ref_model_output: RefOutput = None,
    backend: str = "auto",
    rollout_is_weights: Optional[torch.Tensor] = None,
    stream_weights: Optional[Sequence[float]] = None,
    shard: Optional[ShardContext] = None,
    kl_space: str = "transition",
    ref_guidance_scale: Optional[float] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
) -> GRPOLossOutput:
    """Flow-GRPO's training loss block for one SDE step, in one call.

    log_prob = step_log_prob(sample, model_output, prev_sample, ...) (bit for bit), rho = exp(log_prob -
    old_log_prob), per sample -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), batch mean, plus
    ``kl_coef`` x the batch mean of the exact KL to ``ref_model_output``'s transition (docs/contract.md,
    KL). ``clip_range``: eps or (eps_low, eps_high). ``advantages`` are used as given (clamp them as
    your trainer does). On the Triton backend: one pass over x, v, x' (and v_ref) forward, one backward
    writing d loss / d model_output. ``rollout_is_weights``: [B] rollout-correction weights (detached;
    ``flowrl.consistency.correction_weights``' column of this step) multiplying each sample's surrogate
    before the batch mean, as verl-omni applies them; not the KL term (docs/consistency.md).
    ``kl_coef`` may also be a float tensor [B] (per-sample coefficients, detached, >= 0): the KL term is
    then mean_b(kl_coef_b KL_b), GARDO's gated KL with ``flowrl.advantages.gardo_kl_coef``'s weights
    (docs/losses.md, Per-sample and gated KL (GARDO)); a float is the same as before.

    Joint steps (LTX-2's video and audio): ``sample``, ``model_output``, ``prev_sample`` (and
    ``ref_model_output``) as tuples, one tensor per stream, ``sigmas`` / ``step_index`` a tuple or one
    shared value, as ``flowrl.step_log_prob`` takes them; the log-prob and the KL are
    ``flowrl.combine_streams`` of the streams' sums and counts (``stream_weights``: its weights), so
    the first ratio on a joint rollout is exactly 1 (docs/losses.md, Joint steps). Also
    ``flow_dppo_loss`` (D_s combined the same way) and ``grpo_guard_loss`` (its std, D and D_s the
    streams' element-count averages, verl-omni's MiniMax-H3 adapter).
    ``shard``: the sequence-parallel context (``flowrl.distributed.grpo_loss`` builds it; module note).

    ``kl_space="velocity"``: the KL term is instead the velocity's (v - v_ref)^2 per element, reduced
    like the log-prob (mean over the sample's elements by default), with no std scaling: Flow-Factory's
    ``kl_type="v-based"`` (docs/losses.md, KL choices). ``ref_model_output=(uncond, cond)`` with
    ``ref_guidance_scale=w``: the reference's two branches, combined in float32 inside the pass as
    uncond + w (cond - uncond) (the CFG reference of a trainer that trains without CFG); a single tensor
    is the reference's output as it is (guided or not). The same three arguments in every variant.

    ``token_sigmas`` / ``frozen``: per-token schedules and frozen masks, as ``flowrl.step_log_prob`` takes
    them: the log-prob is ``step_log_prob(..., token_sigmas=, frozen=)``'s and the KL ``step_kl``'s bit
    for bit on the same backend; refused with ``kl_space="velocity"`` and for joint steps (docs/losses.md,
    Per-token sigmas and frozen masks). Also ``flow_dppo_loss`` (D_s per element, each token's std, over
    the scored elements) and ``grpo_guard_loss`` (``frozen`` only: its std and 1/D are one step's).
    """
    return _grpo_family(_Variant.GRPO, GRPOCall(**locals()))  # the call as given, by name


def grpo_guard_loss(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: ClipRange,
    old_prev_sample_mean: Optional[torch.Tensor] = None,
    noise_seed: Union[None, int, torch.Tensor] = None,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    kl_coef: Union[float, torch.Tensor] = 0.0,
    ref_model_output: RefOutput = None,
    backend: str = "auto",
    rollout_is_weights: Optional[torch.Tensor] = None,
    stream_weights: Optional[Sequence[float]] = None,
    shard: Optional[ShardContext] = None,
    kl_space: str = "transition",
    ref_guidance_scale: Optional[float] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
) -> GRPOLossOutput:
    """GRPO-Guard (arXiv 2510.22319; verl-omni ``GRPOGuardLoss``, Flow-Factory ``GRPOGuardTrainer``).

    Per sample D_s = mean ||mu_theta - mu_old||^2 / (2 std^2), rho = exp((log_prob - old_log_prob +
    D_s) * std), the clipped surrogate divided by the step's D = sigma - sigma', batch mean. std and D
    are each sample's own (the peers use the batch's shared step). mu_old: ``old_prev_sample_mean``
    (the rollout's ``prev_sample_mean``), or replayed from ``prev_sample`` and the rollout's
    ``noise_seed`` (docs/losses.md, Replaying mu_old). ``rollout_is_weights``: as ``grpo_loss``'s (on
    the surrogate after its 1/D scale); ``kl_coef`` (a float or a per-sample [B] tensor), ``shard``,
    ``kl_space``, ``ref_model_output``, ``ref_guidance_scale``: as ``grpo_loss``'s. ``frozen``: as
    ``grpo_loss``'s; ``token_sigmas`` is refused (a ValueError): the ratio's std and the loss's 1/D are
    one step's, and per-token sigmas give each token its own.

    Joint steps (tuples, as ``grpo_loss`` takes them, ``stream_weights`` weighting the log-prob and the
    KL): std, D and D_s are the streams' element-count averages of verl-omni's MiniMax-H3 adapter,
    scale = sqrt(mean_n D_k) sqrt(mean_n std_k^2 / D_k), D_s = mean over every element of (mu -
    mu_old)^2 / (2 scale^2), ratio exp((dlogp + D_s) scale), loss / mean_n D_k (docs/losses.md, Joint
    steps)."""
    return _grpo_family(_Variant.GUARD, GRPOCall(**locals()))  # the call as given, by name


def flow_dppo_loss(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    prev_sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    kl_threshold: float,
    old_prev_sample_mean: Optional[torch.Tensor] = None,
    noise_seed: Union[None, int, torch.Tensor] = None,
    mode: str = "sde",
    noise_level: float = 0.7,
    log_prob_kind: str = "gaussian",
    reduction: str = "mean",
    kl_coef: Union[float, torch.Tensor] = 0.0,
    ref_model_output: RefOutput = None,
    backend: str = "auto",
    rollout_is_weights: Optional[torch.Tensor] = None,
    stream_weights: Optional[Sequence[float]] = None,
    shard: Optional[ShardContext] = None,
    kl_space: str = "transition",
    ref_guidance_scale: Optional[float] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
) -> GRPOLossOutput:
    """Flow-DPPO (verl-omni ``FlowDPPOLoss``): per sample -rho A, masked (0) when D_s = mean ||mu_theta -
    mu_old||^2 / (2 std^2) >= ``kl_threshold`` and the ratio moves in the advantage's direction (rho > 1
    with A > 0, or rho < 1 with A < 0); no ratio clipping; batch mean. mu_old as in
    ``grpo_guard_loss``. ``rollout_is_weights``, ``kl_coef`` (a float or a per-sample [B] tensor), ``shard``,
    ``kl_space``, ``ref_model_output``, ``ref_guidance_scale``, ``token_sigmas``, ``frozen``: as
    ``grpo_loss``'s (D_s then per element with each token's std, over the scored elements)."""
    kl_threshold = _check_scalar("kl_threshold", kl_threshold)
    return _grpo_family(_Variant.DPPO, GRPOCall(**locals()))  # the call as given, by name


def teacher_kl_loss(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    teacher_model_output: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: Union[int, torch.Tensor],
    *,
    mode: str = "sde",
    noise_level: float = 0.7,
    reduction: str = "mean",
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    token_sigmas: Optional[torch.Tensor] = None,
    frozen: Optional[torch.Tensor] = None,
    stream_weights: Optional[Sequence[float]] = None,
    teacher_weights: Optional[Sequence[float]] = None,
    teacher_index: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-OPD's teacher KL: the batch mean of ||mu_theta - mu_teacher||^2 / (2 std^2) reduced per
    sample (the exact Gaussian KL of docs/contract.md, ``flowrl.step_kl`` with the teacher as the
    reference, whose fused backward writes d / d model_output). Returns (loss, per-sample KL [B]).
    ``shard``, ``token_sigmas``, ``frozen``: step_kl's (sequence parallelism; per-token schedules and frozen
    masks, docs/contract.md), the KL is step_kl's with them bit for bit. Joint steps: ``sample``,
    ``model_output``, ``teacher_model_output`` as tuples (one tensor per stream) and ``stream_weights``,
    as ``step_kl`` takes them: the KL is ``step_kl``'s on the tuples bit for bit.

    Several teachers (docs/losses.md, Several teachers): ``teacher_model_output`` a tuple of K teachers'
    outputs (a joint step's: a tuple of K tuples of streams). With ``teacher_weights`` (K numbers >= 0,
    normalised to p_k = w_k / sum w; None: 1/K each) the KL is sum_k p_k KL(v, v_k), computed as
    KL(v, v_bar) + sum_k p_k KL(v_k, v_bar) with v_bar = sum_k p_k v_k (one fused pass with gradient);
    with ``teacher_index`` (an integer [B] tensor, each sample's teacher in [0, K)) it is each sample's KL
    to its own teacher, one pass (verl-omni's multi-teacher routing)."""
    joint = isinstance(sample, tuple)
    data = {}
    for name, value in (("sample", sample), ("teacher_model_output", teacher_model_output)):
        streams = value if joint and isinstance(value, tuple) else (value,)
        data.update({f"{name}[{k}]" if joint else name: t
                     for k, t in enumerate(streams) if isinstance(t, torch.Tensor)})
    _check_no_grad(**data)  # the tuples' other checks are step_kl's
    extras = _StepKLExtras(shard=shard, token_sigmas=token_sigmas, frozen=frozen, stream_weights=stream_weights)

    def run(v, teacher):
        args = (sample, v, teacher, sigmas, step_index, mode, noise_level, reduction, backend)
        # while torch.compile traces (one device, one stream, no per-token inputs): flowrl::teacher_kl_loss
        if _traced() and shard is None and token_sigmas is None and frozen is None and not joint:
            return _ops.teacher_kl_loss(*args)
        return _teacher_kl(*args, extras=extras)

    if _several_teachers(teacher_model_output, joint) or teacher_weights is not None or teacher_index is not None:
        return _multi_teacher_loss(run, model_output, teacher_model_output, joint, teacher_weights, teacher_index)
    return run(model_output, teacher_model_output)


# ----------------------------------------------------------------------------- forward-process losses


def _flow_t(name, t, batch, like) -> torch.Tensor:
    if isinstance(t, Real) and not isinstance(t, bool):
        return torch.full((batch,), float(t), dtype=torch.float32, device=like.device)
    return _check_per_sample(name, t, batch, like.device)


def nft_loss(
    noised_sample: torch.Tensor,
    model_output: torch.Tensor,
    old_model_output: torch.Tensor,
    clean_sample: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    *,
    advantages: Union[torch.Tensor, Tuple[torch.Tensor, ...]],
    beta: float,
    adv_clip_max: float,
    kl_coef: float = 0.0,
    ref_model_output: Optional[torch.Tensor] = None,
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    stream_weights: Optional[Sequence[float]] = None,
) -> NFTLossOutput:
    """DiffusionNFT's loss (NVlabs/DiffusionNFT scripts/train_nft_sd3.py), one element pass.

    r = clip((clip(A, -A_max, A_max) / A_max) / 2 + 1/2, 0, 1); v+ = beta v + (1 - beta) v_old;
    v- = (1 + beta) v_old - beta v; e+- = (x_t - t v+-) - x0; w+- = stop-grad max(mean |e+-|, 1e-5);
    per sample L = r mse+ / w+ / beta + (1 - r) mse- / w- / beta; loss = mean(L * A_max) + kl_coef *
    mean(mean (v - v_ref)^2). ``sigma`` is t (a float or [B]); x_t = ``noised_sample``. ``shard``: the
    sequence-parallel context (the means are over the full sample).

    Joint steps: the five sample-shaped inputs as tuples (one tensor per stream; ``ref_model_output``
    too when given), ``sigma`` one shared value or a tuple per stream; each per-sample mean (|e+-|,
    e+-^2, the KL) is ``flowrl.combine_streams`` of the streams' sums and element counts with
    ``stream_weights`` (None: the element-count mean over every stream's elements, verl-omni's MiniMax-H3
    DiffusionNFT on its packed video + audio rows) (docs/losses.md, Joint steps).

    Per-stream advantages (a joint step only): ``advantages`` a tuple of [B] tensors, one per stream in the
    streams' order (OmniNFT's video / audio advantages): each stream's loss is ``nft_loss`` on that stream
    alone with its own advantage (its own means, w+- and r), and every output field is sum_k w_k (stream
    k's), w = ``stream_weights`` as given (None: 1/n each): verl-omni's OmniNFT loss
    (flowrl/losses/_stream_advantages.py; docs/losses.md, Joint steps, Per-stream advantages)."""
    options = _NFTOptions(advantages=advantages, beta=beta, adv_clip_max=adv_clip_max, kl_coef=kl_coef, backend=backend)
    if isinstance(noised_sample, tuple) and shard is not None:
        raise ValueError("shard: a joint step (tuples of streams) is not supported under sequence parallelism; "
                         "pass one stream's shards, or shard=None")
    if isinstance(advantages, tuple):  # per-stream advantages (OmniNFT): each stream's own NFT loss, weighted
        return _stream_advantages.nft_loss(_nft_args, (noised_sample, model_output, old_model_output, clean_sample,
                                                       sigma, ref_model_output), options, stream_weights)
    if isinstance(noised_sample, tuple):
        streams = [("noised_sample", noised_sample, "tuple"), ("model_output", model_output, "tuple"),
                   ("old_model_output", old_model_output, "tuple"), ("clean_sample", clean_sample, "tuple"),
                   ("sigma", sigma, "shared"), ("ref_model_output", ref_model_output, "optional")]
        return _joint.flow_loss(_nft_args, nft_sums, nft_from_means, stream_weights, streams, dict(options=options),
                                empty=_ops.nft_loss)
    _joint.single_stream(stream_weights, "noised_sample, model_output, old_model_output and clean_sample")
    args = _nft_args(noised_sample, model_output, old_model_output, clean_sample, sigma, ref_model_output,
                     options=options, shard=shard)
    if (_traced() and shard is None) or _empty(noised_sample):  # compiling (one device): flowrl::nft_loss; B = 0
        return _ops.nft_loss(*args)
    return nft_from_args(*args, shard=shard)


@dataclass(frozen=True)
class _NFTOptions:
    """``nft_loss``'s arguments that are not of the sample's shape, as given (``_nft_args`` validates them):
    the per-sample ``advantages`` [B], ``beta``, ``adv_clip_max``, ``kl_coef`` and ``backend``; a joint step's
    streams share them."""

    advantages: torch.Tensor
    beta: float
    adv_clip_max: float
    kl_coef: float
    backend: str


def _nft_args(noised_sample, model_output, old_model_output, clean_sample, sigma, ref_model_output, *,
              options: _NFTOptions, shard=None, stream=""):
    """``nft_loss``'s arguments validated (``options``: the ones not of the sample's shape; ``stream``: the
    joint step's suffix for the names, "[k]")."""
    advantages, beta, adv_clip_max, kl_coef, backend = (options.advantages, options.beta, options.adv_clip_max,
                                                        options.kl_coef, options.backend)
    V.check_sample(noised_sample, "noised_sample" + stream)
    elements_per_sample(noised_sample, shard)  # checks shard's type
    batch = noised_sample.shape[0]
    for name, u in (("model_output", model_output), ("old_model_output", old_model_output),
                    ("clean_sample", clean_sample)):
        V.check_batch_tensor(name + stream, u, noised_sample, "noised_sample" + stream)
    if ref_model_output is not None:
        V.check_batch_tensor("ref_model_output" + stream, ref_model_output, noised_sample, "noised_sample" + stream)
    t = _flow_t("sigma" + stream, sigma, batch, noised_sample)
    advantages = _check_per_sample("advantages", advantages, batch, noised_sample.device)
    beta = _check_scalar("beta", beta, strict=True)
    adv_clip_max = _check_scalar("adv_clip_max", adv_clip_max, strict=True)
    kl_coef = _check_scalar("kl_coef", kl_coef)
    if kl_coef != 0 and ref_model_output is None:
        raise ValueError("kl_coef is nonzero but ref_model_output is None: pass the reference policy's model_output")
    _check_no_grad(**{name + stream: u for name, u in (
        ("noised_sample", noised_sample), ("old_model_output", old_model_output), ("clean_sample", clean_sample),
        ("ref_model_output", ref_model_output), ("advantages", advantages), ("sigma", t))})
    ops = _flow_backend(backend, noised_sample, model_output, old_model_output, clean_sample, ref_model_output)
    return (ops, noised_sample, model_output, old_model_output, clean_sample, ref_model_output, t, advantages, beta,
            adv_clip_max, kl_coef)


AWM_WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")


def awm_log_prob(
    model_output: torch.Tensor,
    noise: torch.Tensor,
    clean_sample: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    *,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
    backend: str = "auto",
    shard: Optional[ShardContext] = None,
    stream_weights: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """AWM's per-sample matching "log-prob" [B] (Flow-Factory trainers/awm.py
    ``compute_weighted_log_prob``): l = -mean (v - (eps - x0))^2, then weighted by ``weighting``:
    "uniform" l, "t" l t, "t**2" l t^2, "huber" -(sqrt(-l + 1e-10) - 1e-5) t, "ghuber"
    -((-l + 1e-10)^p - 1e-10^p) t / p with p = ``ghuber_power``; t = ``sigma``. The reference reduces in
    float64; this reduces float32 squares by the contract's chunked halving tree, within a few float32
    ulps of the float64 result (tested). ``shard``: the sequence-parallel context (the mean is over the
    full sample).

    Joint steps: ``model_output``, ``noise``, ``clean_sample`` as tuples (one tensor per stream); the mean
    of (v - (eps - x0))^2 is ``flowrl.combine_streams`` of the streams' sums and element counts with
    ``stream_weights``, then weighted as above with the one shared ``sigma`` (a tuple is refused: the
    weighting reads one t per sample)."""
    if isinstance(model_output, tuple):
        return _awm_joint(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard,
                          stream_weights)
    _joint.single_stream(stream_weights, "model_output, noise and clean_sample")
    args = _awm_args(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard)
    if (_traced() and shard is None) or _empty(model_output):  # compiling (one device): flowrl::awm_log_prob; B = 0
        return _ops.awm_log_prob(*args)
    return awm_log_prob_from_args(*args, shard=shard)


def _awm_joint(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard, stream_weights,
               empty=_ops.awm_log_prob):
    """``awm_log_prob`` of a joint step (tuples): the streams' sums combined, then the weighting (``empty``:
    the output on an empty batch from stream 0's arguments, ``_joint.flow_loss``'s)."""
    if shard is not None:
        raise ValueError("shard: a joint step (tuples of streams) is not supported under sequence parallelism; "
                         "pass one stream's shards, or shard=None")
    if isinstance(sigma, tuple):
        raise ValueError("sigma: a joint step's AWM weighting reads one t per sample; pass one shared sigma (a float "
                         "or [B]), not a tuple per stream")

    def stream_args(v, eps, x0, *, stream):
        return _awm_args(v, eps, x0, sigma, weighting, ghuber_power, backend, None, stream)

    streams = [("model_output", model_output, "tuple"), ("noise", noise, "tuple"),
               ("clean_sample", clean_sample, "tuple")]
    return _joint.flow_loss(stream_args, awm_sums, awm_from_means, stream_weights, streams, {}, empty=empty)


def _awm_args(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard=None, stream=""):
    """``awm_log_prob``'s arguments validated: (ops, model_output, noise, clean_sample, t [B], weighting, p)
    (``stream``: a joint step's suffix for the names, "[k]")."""
    V.check_sample(model_output, "model_output" + stream)
    elements_per_sample(model_output, shard)  # checks shard's type
    batch = model_output.shape[0]
    V.check_batch_tensor("noise" + stream, noise, model_output, "model_output" + stream)
    V.check_batch_tensor("clean_sample" + stream, clean_sample, model_output, "model_output" + stream)
    V.check_choice("weighting", weighting, AWM_WEIGHTINGS)
    p = _check_scalar("ghuber_power", ghuber_power, strict=True)
    t = _flow_t("sigma", sigma, batch, model_output)
    _check_no_grad(**{"noise" + stream: noise, "clean_sample" + stream: clean_sample, "sigma": t})
    return _flow_backend(backend, model_output, noise, clean_sample), model_output, noise, clean_sample, t, weighting, p


def awm_loss(
    model_output: torch.Tensor,
    noise: torch.Tensor,
    clean_sample: torch.Tensor,
    sigma: Union[float, torch.Tensor],
    *,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: ClipRange,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
    backend: str = "auto",
    rollout_is_weights: Optional[torch.Tensor] = None,
    shard: Optional[ShardContext] = None,
    stream_weights: Optional[Sequence[float]] = None,
) -> GRPOLossOutput:
    """Advantage Weighted Matching (Flow-Factory trainers/awm.py): ``awm_log_prob`` under the current
    policy, rho = exp(l - old_log_prob), the clipped surrogate of ``grpo_loss``, batch mean.
    ``rollout_is_weights``: as ``grpo_loss``'s; ``shard``, joint steps (tuples) and ``stream_weights``:
    as ``awm_log_prob``'s."""
    like = model_output[0] if isinstance(model_output, tuple) and model_output else model_output
    if not isinstance(like, torch.Tensor):
        V.check_sample(like, "model_output")
    batch = like.shape[0]
    old_log_prob = _check_per_sample("old_log_prob", old_log_prob, batch, like.device)
    advantages = _check_per_sample("advantages", advantages, batch, like.device)
    if rollout_is_weights is not None:
        rollout_is_weights = _check_per_sample("rollout_is_weights", rollout_is_weights, batch, like.device)
    _check_no_grad(old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights)
    clip = check_clip_range(clip_range)
    if isinstance(model_output, tuple):  # a joint step: the combined log-prob, then the surrogate
        lp = _awm_joint(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard,
                        stream_weights, empty=lambda *first: _ops.awm_loss(*first, old_log_prob, advantages, clip,
                                                                           rollout_is_weights))
        if isinstance(lp, GRPOLossOutput):  # an empty batch (B = 0): the loss's empty output
            return lp
        return policy_loss(_Variant.GRPO, lp, None, None, old_log_prob.to(lp.dtype), advantages.to(lp.dtype), clip,
                           0.0, None, None, None if rollout_is_weights is None else rollout_is_weights.to(lp.dtype))
    _joint.single_stream(stream_weights, "model_output, noise and clean_sample")
    args = (*_awm_args(model_output, noise, clean_sample, sigma, weighting, ghuber_power, backend, shard),
            old_log_prob, advantages, clip, rollout_is_weights)
    if (_traced() and shard is None) or _empty(model_output):  # compiling (one device): flowrl::awm_loss; B = 0
        return _ops.awm_loss(*args)
    return awm_from_args(*args, shard=shard)


from .dpo import DGPOLossOutput, DPOLossOutput, dgpo_loss, dgpo_noise, dpo_loss, dpo_noise, dpo_pairs  # noqa: E402

__all__ = [
    "grpo_loss", "grpo_guard_loss", "flow_dppo_loss", "teacher_kl_loss", "nft_loss", "awm_log_prob", "awm_loss",
    "GRPOLossOutput", "NFTLossOutput", "check_clip_range", "TrustSource", "FlowLoss", "KLSpace", "AWM_WEIGHTINGS", "AWM_EPS",
    "dpo_loss", "dpo_pairs", "dgpo_loss", "dpo_noise", "dgpo_noise", "DPOLossOutput", "DGPOLossOutput",
]
