"""Group advantages from one or several rewards, and the tree advantages, under one signature style:
``fn(rewards, grouping, *, options)``; docs/losses.md, "Advantages".

``group_advantages(rewards [B], group_index [B])``: GRPO's per-prompt normalization

    A_i = (r_i - mean_{g(i)}) / s_i,   s_i = std_{g(i)} (std="group") or std_batch (std="global"),
                                        then floored by eps: s + eps (eps_mode="add") or max(s, eps) ("max")

with population std (``unbiased=False``, n in the denominator; ``unbiased=True``: n - 1). ``std=None``
centers only (A = r - mean_g). A group of one sample gets 0 (its centered value is 0; with
``unbiased=True`` its n - 1 = 0 is read as 1). ``group_index`` is any integer tensor [B] of prompt ids:
any order, any group sizes, ids need not be contiguous or small; every sample with the same id is one
group. Centering on the batch mean (Flow-GRPO with ``per_prompt_stat_tracking=False``) is
``group_index = torch.zeros(B, dtype=torch.long)``.

``multi_reward_advantages(rewards [B, R] or {name: [B]}, group_index)``, weights w [R] (default 1):

* ``combine="sum_then_normalize"``: ``group_advantages(sum_k w_k r_k)`` (Flow-GRPO's ``multi_score``
  then its tracker; Flow-Factory ``advantage_aggregation: 'sum'``): weights applied before normalizing.
* ``combine="normalize_then_sum"`` (GDPO): ``a_k = group_advantages(r_k)`` per reward, ``c = sum_k w_k a_k``
  (weights applied after normalizing), then, with ``batch_norm`` (its default here), the batch-level
  renormalization ``A = (c - mean_batch(c)) / floor(std_batch(c))`` with the same std kind and eps
  (Flow-Factory ``advantage_aggregation: 'gdpo'``; UniRL PR 271).

Peers (the float64 transcriptions in tests/losses/test_advantages.py are checked against these):

* Flow-GRPO, yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd,
  ``flow_grpo/stat_tracking.py`` lines 11-31 (``PerPromptStatTracker.update``: ``np.std`` population,
  ``+ 1e-4`` after the std, ``global_std``: the std of the whole batch's rewards, the mean still per
  prompt) and ``scripts/train_sd3.py`` lines 740-782 (the tracker on ``rewards['avg']``; without it
  ``(r - r.mean()) / (r.std() + 1e-4)`` on numpy arrays), ``flow_grpo/rewards.py`` lines 360-400
  (``multi_score``: ``avg = sum_k weight_k * score_k``). ``PEER_OPTIONS["flow_grpo"]``: the defaults.
* Flow-Factory, X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  ``src/flow_factory/advantage/advantage_processor.py`` lines 357-397 (``compute_weighted_sum``: the
  std floored by ``max(std, 1e-6)``, population; ``global_std``: lines 242-263, ``_global_mean_std``) and
  lines 451-481 (``compute_gdpo``: per reward and group ``(r - mean) / max(std, 1e-6)``, times its weight,
  summed, then ``(c - mean) / max(std, 1e-6)`` over the batch). ``PEER_OPTIONS["flow_factory"]``.
* UniRL, Tencent-Hunyuan/UniRL ``unirl/types/sample.py`` @ 09bbaa7c908ece6c8219461af8a2211e0039eb22
  (``Part.compute_advantages``: population std, ``(r - mean) / (std + eps)``, eps = 1e-8, a singleton's
  std read as 1; ``use_global_std``: ``finite_mean_std``, population, as in celve/unirl
  ``unirl/types/advantages.py`` @ 288ce1cfad15f87d55ea3d4d710aa760e4f6f387) and PR 271 (GDPO: that
  per-dimension step, ``sum_k w_k A_k``, then the batch whitening ``(A - mean) / (std + eps)``; the
  PR's diff is not stored, the transcription follows its description). ``PEER_OPTIONS["unirl"]``.

Definition differences (docs/losses.md): flowrl accepts any group sizes and any order (Flow-Factory
raises on a group of another size, UniRL on non-contiguous or uneven groups); NaN / inf rewards are not
checked (a check is a host sync) and propagate: a non-finite reward makes its group's advantages NaN
(and, for std="global" or the GDPO batch step, the whole batch's), as in Flow-GRPO and Flow-Factory
(UniRL leaves non-finite rewards out of its statistics and gives them 0). Every statistic is computed in
float64 on the rewards' device (the peers compute in numpy float64; UniRL in float32) and the result is
returned in the rewards' dtype promoted to at least float32.

No host sync: groups are found by a sort and a cumulative sum (no ``torch.unique``, whose output size
the host must read), statistics by ``index_add_``; no ``.item()``, ``.tolist()`` or Python branch on a
tensor's value. Input checks read only dtypes, shapes and devices.

Tree advantages (BranchGRPO, TempFlow-GRPO; docs/branching.md) are ``flowrl.data.tree``'s
``depth_advantages(tree, rewards, num_steps)`` and ``fork_advantages(tree, rewards, num_steps)``,
re-exported here (one formula, one place); they take the rollout's ``BranchTree`` as the grouping.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Tuple, Union

import torch

from .data.tree import TreeAdvantages, depth_advantages, fork_advantages, node_rewards

STD_MODES = ("group", "global", None)
EPS_MODES = ("add", "max")
COMBINES = ("normalize_then_sum", "sum_then_normalize")

# The options that reproduce each peer's formula (module docstring); the defaults are Flow-GRPO's.
PEER_OPTIONS = {
    "flow_grpo": {"eps": 1e-4, "eps_mode": "add", "unbiased": False},
    "flow_factory": {"eps": 1e-6, "eps_mode": "max", "unbiased": False},
    "unirl": {"eps": 1e-8, "eps_mode": "add", "unbiased": False},
}

Rewards = Union[torch.Tensor, Mapping[str, torch.Tensor]]
Weights = Union[None, Sequence[float], torch.Tensor, Mapping[str, float]]


def _float_tensor(name: str, value, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float tensor; got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor; got dtype {value.dtype}")
    if value.dim() != ndim:
        shape = "[B]" if ndim == 1 else "[B, R]"
        raise ValueError(f"{name} must have shape {shape}; got {tuple(value.shape)}")
    return value


def _group_index(group_index, batch: int, device: torch.device) -> torch.Tensor:
    if not isinstance(group_index, torch.Tensor):
        raise TypeError(f"group_index must be an integer tensor [B] of prompt ids; got {type(group_index).__name__}")
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor [B] of prompt ids; got dtype {group_index.dtype}")
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must have shape [B] = [{batch}] (one id per reward); got "
                         f"{tuple(group_index.shape)}")
    if group_index.device != device:
        raise ValueError(f"group_index is on {group_index.device} but the rewards are on {device}")
    return group_index.long()


def _options(std, eps, eps_mode, unbiased) -> None:
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}; got {std!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a positive finite number; got {eps!r}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}; got {eps_mode!r}")
    if not isinstance(unbiased, bool):
        raise TypeError(f"unbiased must be a bool; got {type(unbiased).__name__}")


def dense_groups(group_index: torch.Tensor) -> torch.Tensor:
    """[B] int64 group numbers 0 .. G - 1 (in the ids' sorted order) for any integer ids [B], on their
    device, without a host sync: a sort, the positions where the sorted id changes, their running count."""
    ids = group_index.long()
    sorted_ids, order = torch.sort(ids)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    numbers = torch.cumsum(starts.long(), 0) - 1
    return torch.empty_like(numbers).scatter_(0, order, numbers)


def _floor(std: torch.Tensor, eps: float, eps_mode: str) -> torch.Tensor:
    return std + eps if eps_mode == "add" else std.clamp_min(eps)


def _batch_std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """[1, R] the std over the batch of each column of x [B, R] (B >= 1)."""
    n = x.shape[0]
    centered = x - x.mean(0, keepdim=True)
    return ((centered * centered).sum(0, keepdim=True) / max(n - 1 if unbiased else n, 1)).sqrt()


def _normalize(x: torch.Tensor, groups: torch.Tensor, std, eps: float, eps_mode: str,
               unbiased: bool) -> torch.Tensor:
    """Each column of x [B, R] (float64) normalized within its groups (``groups``: dense numbers [B])."""
    batch = x.shape[0]
    count = torch.zeros(batch, dtype=x.dtype, device=x.device).index_add_(0, groups, torch.ones_like(x[:, 0]))
    sums = torch.zeros_like(x).index_add_(0, groups, x)
    mean = sums / count.clamp_min(1).unsqueeze(1)
    centered = x - mean[groups]
    if std is None:
        return centered
    if std == "global":
        scale = _batch_std(x, unbiased)
    else:
        squares = torch.zeros_like(x).index_add_(0, groups, centered * centered)
        denom = (count - 1 if unbiased else count).clamp_min(1).unsqueeze(1)
        scale = (squares / denom).sqrt()[groups]
    return centered / _floor(scale, eps, eps_mode)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, std: Optional[str] = "group",
                     eps: float = 1e-4, eps_mode: str = "add", unbiased: bool = False) -> torch.Tensor:
    """[B] GRPO advantages of one reward per sample: ``(r - mean_g) / floor(s)`` (module docstring).

    ``rewards``: float [B]. ``group_index``: integer [B], the prompt id of each sample (any order, any
    sizes). ``std``: "group" (each prompt's std), "global" (the batch's std, Flow-GRPO's and
    Flow-Factory's ``global_std``), or None (center only). ``eps``, ``eps_mode``: the floor,
    ``s + eps`` ("add": Flow-GRPO 1e-4, UniRL 1e-8) or ``max(s, eps)`` ("max": Flow-Factory 1e-6);
    ``PEER_OPTIONS[peer]`` holds each peer's. ``unbiased``: the n - 1 std. Returns the rewards' dtype
    promoted to at least float32, on their device; B = 0 gives an empty [0]. NaN propagates to its
    group (std="global": to the batch)."""
    rewards = _float_tensor("rewards", rewards, 1)
    groups = _group_index(group_index, rewards.shape[0], rewards.device)
    _options(std, eps, eps_mode, unbiased)
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    if rewards.shape[0] == 0:
        return rewards.new_empty(0, dtype=out_dtype)
    x = rewards.to(torch.float64).unsqueeze(1)
    return _normalize(x, dense_groups(groups), std, eps, eps_mode, unbiased)[:, 0].to(out_dtype)


def _reward_matrix(rewards: Rewards, weights: Weights) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B, R], weights [R]) as given, the weights on the rewards' device in float64."""
    if isinstance(rewards, Mapping):
        if not rewards:
            raise ValueError("rewards must hold at least one reward; got an empty mapping")
        names = list(rewards)
        columns = [_float_tensor(f"rewards[{name!r}]", rewards[name], 1) for name in names]
        first = columns[0]
        for name, column in zip(names, columns):
            if column.shape != first.shape or column.device != first.device:
                raise ValueError(f"rewards[{name!r}] has shape {tuple(column.shape)} on {column.device}; "
                                 f"rewards[{names[0]!r}] has {tuple(first.shape)} on {first.device}: every "
                                 "reward must be [B] on one device")
        dtype = first.dtype
        for column in columns[1:]:
            dtype = torch.promote_types(dtype, column.dtype)
        matrix = torch.stack([c.to(dtype) for c in columns], 1)
        if isinstance(weights, Mapping):
            missing, extra = set(names) - set(weights), set(weights) - set(names)
            if missing or extra:
                raise ValueError(f"weights must name the rewards' keys {names}; missing {sorted(missing)}, "
                                 f"unknown {sorted(extra)}")
            weights = [weights[name] for name in names]
    else:
        matrix = _float_tensor("rewards", rewards, 2)
        if isinstance(weights, Mapping):
            raise TypeError("weights is a mapping but rewards is a tensor [B, R]: pass weights as a "
                            "sequence or tensor [R], or rewards as a mapping name -> [B]")
        if matrix.shape[1] == 0:
            raise ValueError("rewards must hold at least one reward column; got shape "
                             f"{tuple(matrix.shape)}")
    num = matrix.shape[1]
    if weights is None:
        w = torch.ones(num, dtype=torch.float64, device=matrix.device)
    elif isinstance(weights, torch.Tensor):
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be a float tensor [R]; got dtype {weights.dtype}")
        if weights.shape != (num,):
            raise ValueError(f"weights must have shape [R] = [{num}]; got {tuple(weights.shape)}")
        if weights.device != matrix.device:
            raise ValueError(f"weights is on {weights.device} but the rewards are on {matrix.device}")
        w = weights.to(torch.float64)
    else:
        values = list(weights)
        if len(values) != num:
            raise ValueError(f"weights must hold one weight per reward (R = {num}); got {len(values)}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"weights must be finite real numbers; got {v!r}")
        w = torch.tensor(values, dtype=torch.float64, device=matrix.device)
    return matrix, w


def multi_reward_advantages(rewards: Rewards, group_index: torch.Tensor, *, weights: Weights = None,
                            combine: str = "normalize_then_sum", std: Optional[str] = "group",
                            eps: float = 1e-4, eps_mode: str = "add", unbiased: bool = False,
                            batch_norm: Optional[bool] = None) -> torch.Tensor:
    """[B] advantages from R rewards per sample (module docstring).

    ``rewards``: float [B, R], or a mapping name -> float [B] (weights then a mapping with the same
    names, or a sequence in the mapping's order). ``weights``: [R] (default all 1). ``combine``:
    "normalize_then_sum" (GDPO: each reward normalized in its group, ``sum_k w_k a_k``) or
    "sum_then_normalize" (``sum_k w_k r_k`` normalized in its group). ``std``, ``eps``, ``eps_mode``,
    ``unbiased``: as for ``group_advantages``, for the per-group step and the batch step alike.
    ``batch_norm``: renormalize the combined values over the batch, ``(c - mean) / floor(std_batch)``;
    None: True for "normalize_then_sum" (Flow-Factory's and UniRL's GDPO), False for
    "sum_then_normalize". Returns the rewards' dtype promoted to at least float32; B = 0 gives [0]."""
    matrix, w = _reward_matrix(rewards, weights)
    groups = _group_index(group_index, matrix.shape[0], matrix.device)
    _options(std, eps, eps_mode, unbiased)
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}; got {combine!r}")
    if batch_norm is None:
        batch_norm = combine == "normalize_then_sum"
    if not isinstance(batch_norm, bool):
        raise TypeError(f"batch_norm must be a bool or None; got {type(batch_norm).__name__}")
    out_dtype = torch.promote_types(matrix.dtype, torch.float32)
    if matrix.shape[0] == 0:
        return matrix.new_empty(0, dtype=out_dtype)
    x = matrix.to(torch.float64)
    dense = dense_groups(groups)
    if combine == "sum_then_normalize":
        combined = _normalize((x * w).sum(1, keepdim=True), dense, std, eps, eps_mode, unbiased)
    else:
        combined = (_normalize(x, dense, std, eps, eps_mode, unbiased) * w).sum(1, keepdim=True)
    if batch_norm:
        combined = (combined - combined.mean(0, keepdim=True)) / _floor(_batch_std(combined, unbiased), eps, eps_mode)
    return combined[:, 0].to(out_dtype)


__all__ = ["group_advantages", "multi_reward_advantages", "dense_groups", "PEER_OPTIONS",
           "depth_advantages", "fork_advantages", "node_rewards", "TreeAdvantages"]


# ----------------------------------------------------------------------------- GARDO's gated KL
#
# GARDO (yifan123/flow_grpo @ 94e23ee5405ab7241fc1f75d30cac8147e2b1f53, scripts/train_sd3_gardo.py; its
# issue 216): the KL to the reference is applied only to the samples whose proxy reward is most
# "uncertain", a rank disagreement between the main reward and auxiliary ones; the gated fraction adapts
# over training (``RiskCompensator``). docs/losses.md, "Per-sample and gated KL (GARDO)", has the formula,
# its source lines and the definition differences; tests/losses/test_gardo.py the float64 transcriptions.


def _descending_ranks(r: torch.Tensor) -> torch.Tensor:
    """Each entry's rank in its column of r [N, K] sorted in descending order, 1 for the largest (ties in
    index order); one sort for every column."""
    order = torch.sort(r, dim=0, descending=True, stable=True).indices
    ranks = torch.arange(1, r.shape[0] + 1, device=r.device).unsqueeze(1).expand_as(order)
    return torch.empty_like(order).scatter_(0, order, ranks).to(torch.float32)


def gardo_uncertainty(main_reward: torch.Tensor, aux_rewards: Rewards) -> torch.Tensor:
    """GARDO's per-sample uncertainty [N] (float32, as its ranks): u_i = rank_i(main) - mean_k
    rank_i(aux_k), rank 1 the batch's largest reward (a descending sort; ties ranked in index order).
    ``main_reward`` [N] is the reward the advantages use (its ``main_reward``); ``aux_rewards`` [N, K] or
    {name: [N]} the auxiliary rewards (theirs: aesthetic and imagereward, u = rank_main - (rank_aes +
    rank_ir) / 2). Call it on the whole (all-gathered) rollout batch, as GARDO does. On the rewards'
    device, no host sync."""
    main = _float_tensor("main_reward", main_reward, 1)
    if isinstance(aux_rewards, Mapping):
        if not aux_rewards:
            raise ValueError("aux_rewards must hold at least one auxiliary reward")
        aux = torch.stack([_float_tensor(f"aux_rewards[{k!r}]", r, 1) for k, r in aux_rewards.items()], 1)
    else:
        aux = _float_tensor("aux_rewards", aux_rewards, 2)
    if aux.shape[0] != main.shape[0] or aux.shape[1] == 0:
        raise ValueError(f"aux_rewards must have shape [N, K] = [{main.shape[0]}, K >= 1] like main_reward "
                         f"[{main.shape[0]}]; got {tuple(aux.shape)}")
    if aux.device != main.device:
        raise ValueError(f"aux_rewards is on {aux.device} but main_reward is on {main.device}")
    return _descending_ranks(main.unsqueeze(1))[:, 0] - _descending_ranks(aux).mean(1)


def _numpy_percentile(values: torch.Tensor, keep: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``np.percentile(values[keep], q)`` of float32 ``values`` (method "linear"), float32, on the device
    without reading the count: the kept values sorted first, numpy's virtual index (n - 1) q (float64),
    its neighbours clamped to [0, n - 1], and its two-sided lerp in float32 as numpy runs it on a float32
    array (a + (b - a) f32(t), or b - (b - a) f32(1 - t) where t >= 0.5); +inf when nothing is kept
    (numpy raises)."""
    n = keep.sum().to(torch.float64)
    ordered = torch.sort(torch.where(keep, values, torch.full_like(values, math.inf))).values
    q = q / 100
    virtual = (n - 1) * q  # numpy's "linear" get_virtual_index
    last = (n - 1).clamp(min=0)
    lo = torch.floor(virtual).clamp(0, None).minimum(last)
    hi = (lo + 1).minimum(last)
    t = virtual - torch.floor(virtual)
    a = ordered.gather(0, lo.long().reshape(1))[0] if values.numel() else values.new_zeros(())
    b = ordered.gather(0, hi.long().reshape(1))[0] if values.numel() else values.new_zeros(())
    diff = b - a
    lerp = torch.where(t >= 0.5, b - diff * (1 - t).to(values.dtype), a + diff * t.to(values.dtype))  # numpy's _lerp
    lerp = torch.where(virtual >= last, b, torch.where(virtual < 0, a, lerp))
    return torch.where(n > 0, lerp, torch.full_like(lerp, math.inf))


def gardo_kl_gate(uncertainty: torch.Tensor, fraction: Union[float, torch.Tensor] = 0.1) -> torch.Tensor:
    """GARDO's KL gate, bool [N]: with P the samples of non-negative uncertainty u (``gardo_uncertainty``),
    threshold = np.percentile(u[P], 100 - 100 ``fraction``) (linear interpolation) and gate_i = u_i >
    threshold (u and the threshold compared in float32, as GARDO's float32 ranks and torch compare them):
    about the top ``fraction`` of P, every gated sample with u > 0. ``fraction``: a float in
    [0, 1] or a 0-d tensor (``GardoGateFraction.update``'s; theirs starts at 0.1, within [0.02, 0.2]). No
    sample gated when P is empty (numpy raises there). On u's device, no host sync."""
    u = _float_tensor("uncertainty", uncertainty, 1).to(torch.float32)
    if isinstance(fraction, torch.Tensor):
        if fraction.dim() != 0 or not fraction.dtype.is_floating_point:
            raise ValueError(f"fraction must be a float or a 0-d float tensor; got {fraction.dtype} "
                             f"{tuple(fraction.shape)}")
        q = 100 - fraction.to(device=u.device, dtype=torch.float64) * 100
    else:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be a number in [0, 1]; got {fraction!r}")
        q = torch.tensor(100 - float(fraction) * 100, dtype=torch.float64, device=u.device)
    return u > _numpy_percentile(u, u >= 0, q)


def gardo_kl_coef(gate: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-sample ``kl_coef`` [B] (float32) of GARDO's gated KL for one training batch: beta g_i B /
    max(sum_j g_j, 1), so the GRPO family's KL term mean_b(kl_coef_b KL_b) is beta x the mean KL of the
    gated samples (theirs: ``beta * mean(kl over the gated samples' elements)``), 0 when none is gated.
    ``gate``: bool [B], this batch's rows of ``gardo_kl_gate``'s (GARDO gates the gathered rollout, then
    normalizes by the gated count of each training batch). GARDO's KL divides by s^2 = std^2 / D, as
    Flow-GRPO's (docs/losses.md): multiply by each sample's D = sigma - sigma' to reproduce its scale."""
    if not isinstance(gate, torch.Tensor) or gate.dtype != torch.bool or gate.dim() != 1:
        raise TypeError(f"gate must be a bool tensor [B]; got {getattr(gate, 'dtype', type(gate).__name__)} "
                        f"{tuple(getattr(gate, 'shape', ()))}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0; got {beta!r}")
    g = gate.to(torch.float32)
    return g * (float(beta) * gate.shape[0]) / g.sum().clamp(min=1)


class GardoGateFraction:
    """GARDO's adaptive gated fraction (their ``RiskCompensator``; ``kl_perc`` in their logs), kept on the
    device: each ``update(u)`` reads m = mean of the rollout's non-negative uncertainties (rounded to
    float32, as numpy's mean of their float32 ranks); the first call
    sets the fraction to ``base``, later ones multiply it by (1 + alpha) when m > the max of the last
    ``window`` m's, by (1 - alpha) when m < their min; clipped to [low, high]; then m joins the window.
    Returns the new fraction (0-d float64, for ``gardo_kl_gate``). Theirs: base 0.1, alpha 0.1, [0.02, 0.2],
    window 20. No host sync. ``gardo_uncertainty``'s u sum to 0 (each rank column sums to N(N+1)/2), so
    a non-empty batch always has a u >= 0 and m is defined."""

    def __init__(self, base: float = 0.1, alpha: float = 0.1, low: float = 0.02, high: float = 0.2,
                 window: int = 20):
        self.base, self.alpha, self.low, self.high, self.window = base, alpha, low, high, int(window)
        self.fraction: Optional[torch.Tensor] = None
        self.history: Optional[torch.Tensor] = None  # the last ``window`` m's, oldest first

    def update(self, uncertainty: torch.Tensor) -> torch.Tensor:
        u = _float_tensor("uncertainty", uncertainty, 1).to(torch.float64)
        keep = u >= 0
        # the sum is exact (half-integers); one rounding to float32 as numpy's float32 mean
        m = (torch.where(keep, u, torch.zeros_like(u)).sum() / keep.sum()).to(torch.float32).to(torch.float64)
        if self.history is None:
            fraction = torch.tensor(float(self.base), dtype=torch.float64, device=u.device)
            history = m.reshape(1)
        else:
            f = self.fraction
            # numpy's max / min propagate a NaN, and a comparison with NaN is False
            fraction = torch.where(m > self.history.max(), f * (1 + self.alpha),
                                   torch.where(m < self.history.min(), f * (1 - self.alpha), f))
            history = torch.cat([self.history, m.reshape(1)])[-self.window:]
        self.fraction = fraction.clamp(self.low, self.high)
        self.history = history
        return self.fraction


__all__ += ["gardo_uncertainty", "gardo_kl_gate", "gardo_kl_coef", "GardoGateFraction"]
