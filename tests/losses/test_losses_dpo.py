"""flowrl.losses' Diffusion-DPO and DGPO (flowrl/losses/dpo.py) against the peers' own code, transcribed
below operation for operation as the oracle (not imported: the peers are not dependencies), on
identical inputs, on both backends (Triton under the interpreter on CPU):

- flow_grpo: yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd, scripts/train_sd3_dpo.py
  lines 924-950 (the DPO loss block, [chosen; rejected] halves) and flow_grpo/stat_tracking.py lines
  38-52 (``type='dpo'``: the best / worst of each prompt).
- verl-omni: verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/trainer/diffusion/diffusion_algos.py ``DPOLoss.compute_loss`` (lines 704-760, adjacent
  chosen/rejected) and ``DPOLoss.build_online_dpo_pair_indices`` (lines 598-622).
- Flow-Factory: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/trainers/dpo.py (``_form_pairs_from_advantages`` lines 323-355, the loss lines
  597-622) and src/flow_factory/trainers/dgpo.py (``_compute_per_sample_preference``,
  ``_compute_group_dgpo_loss`` lines 448-504, ``_compute_dsm_loss``, ``_maybe_clip_dsm``,
  ``_apply_total_loss_and_backward`` lines 633-708).
- DGPO: Luo-Yihong/DGPO @ 01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6, scripts/train_sd3_dgpo.py
  (``compute_group_dgpo_loss_allreduce`` lines 163-193 on one process, the loss block lines 1126-1160).

Plus a float64 oracle (the same formulas on float64 inputs: the torch backend then computes in float64),
Triton-vs-torch parity of values and gradients, gradcheck, determinism and batch invariance of the
per-sample errors, and argument errors.
"""
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.backends import _dispatch
from flowrl import losses as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (3, 4, 16, 24)  # 1536 elements per sample: two chunks, the second partial
TOL = dict(rtol=2e-5, atol=2e-6)  # float32 rounding: different reduction order and operation order
F64_TOL = dict(rtol=1e-5, atol=1e-6)  # float32 against the float64 oracle


def _randn(shape, g, dtype=torch.float32):
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def dpo_inputs(pairs=3, seed=0, dtype=torch.float32, layout="halves"):
    """x0 [2P] (chosen, rejected), eps shared by each pair, v, v_ref near the target u = eps - x0."""
    g = torch.Generator().manual_seed(seed)
    shape = (2 * pairs,) + SHAPE[1:]
    x0 = _randn(shape, g)
    eps_pair = _randn((pairs,) + SHAPE[1:], g)
    if layout == "halves":
        eps = torch.cat([eps_pair, eps_pair])
    else:
        eps = eps_pair.repeat_interleave(2, dim=0)
    u = eps - x0
    v_ref = u + 0.5 * _randn(shape, g)
    v = v_ref + 0.05 * _randn(shape, g)
    return tuple(t.to(dtype) for t in (v, v_ref, eps, x0))


def _grad_of(fn, v):
    vv = v.clone().requires_grad_()
    out = fn(vv)
    loss = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad(loss, vv)[0]


# ----------------------------------------------------------------------------------------- peers
def peer_flow_grpo_dpo(model_pred, model_pred_ref, noise, model_input, beta):
    """flow_grpo scripts/train_sd3_dpo.py lines 924-950: the batch is [chosen; rejected]."""
    bsz = model_input.shape[0] // 2
    target = noise - model_input
    theta_mse = ((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    ref_mse = ((model_pred_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    model_w_err = theta_mse[:bsz]
    model_l_err = theta_mse[bsz:]
    ref_w_err = ref_mse[:bsz]
    ref_l_err = ref_mse[bsz:]
    w_diff = model_w_err - ref_w_err
    l_diff = model_l_err - ref_l_err
    w_l_diff = w_diff - l_diff
    inside_term = -0.5 * beta * w_l_diff
    loss = -F.logsigmoid(inside_term)
    loss = torch.mean(loss)
    implicit_acc = (inside_term > 0).sum().float() / inside_term.size(0)
    return loss, inside_term, implicit_acc, theta_mse, ref_mse


def peer_verl_omni_dpo(noise, latent, model_noise_pred, ref_noise_pred, beta):
    """verl-omni DPOLoss.compute_loss: adjacent (chosen, rejected) pairs."""
    target = noise.float() - latent.float()
    model_err = ((model_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((ref_noise_pred.float() - target) ** 2).flatten(1).mean(dim=1)
    model_w_err = model_err[0::2]
    model_l_err = model_err[1::2]
    ref_w_err = ref_err[0::2]
    ref_l_err = ref_err[1::2]
    w_diff = model_w_err - ref_w_err
    l_diff = model_l_err - ref_l_err
    inside_term = -0.5 * beta * (w_diff - l_diff)
    implicit_acc = (inside_term > 0).sum().float() / inside_term.size(0)
    dpo_loss = -F.logsigmoid(inside_term).mean()
    with torch.no_grad():
        implicit_reward_chosen = -0.5 * beta * w_diff
        implicit_reward_rejected = -0.5 * beta * l_diff
        reward_margins = implicit_reward_chosen - implicit_reward_rejected
        metrics = {"implicit_acc": implicit_acc, "chosen": implicit_reward_chosen.mean(),
                   "rejected": implicit_reward_rejected.mean(), "margins": reward_margins.mean()}
    return dpo_loss, metrics


def peer_flow_factory_dpo(theta_w_pred, theta_l_pred, ref_w_pred, ref_l_pred, noise, chosen_latents,
                          rejected_latents, beta):
    """Flow-Factory DPOTrainer.optimize, lines 597-622 (chosen and rejected batches apart)."""
    target_w = noise - chosen_latents
    target_l = noise - rejected_latents
    spatial_dims = tuple(range(1, theta_w_pred.ndim))
    theta_w_err = ((theta_w_pred.float() - target_w.float()) ** 2).mean(dim=spatial_dims)
    theta_l_err = ((theta_l_pred.float() - target_l.float()) ** 2).mean(dim=spatial_dims)
    ref_w_err = ((ref_w_pred.float() - target_w.float()) ** 2).mean(dim=spatial_dims)
    ref_l_err = ((ref_l_pred.float() - target_l.float()) ** 2).mean(dim=spatial_dims)
    w_diff = theta_w_err - ref_w_err
    l_diff = theta_l_err - ref_l_err
    w_l_diff = w_diff - l_diff
    inside_term = -0.5 * beta * w_l_diff
    loss = -F.logsigmoid(inside_term).mean()
    with torch.no_grad():
        implicit_reward_chosen = -0.5 * beta * w_diff
        implicit_reward_rejected = -0.5 * beta * l_diff
        implicit_accuracy = (implicit_reward_chosen > implicit_reward_rejected).float().mean()
    return loss, implicit_accuracy, implicit_reward_chosen, implicit_reward_rejected


def peer_verl_omni_pairs(uids, scores):
    """verl-omni DPOLoss.build_online_dpo_pair_indices (flat [chosen, rejected, ...])."""
    score_values = scores.detach().cpu().float().tolist()
    uid_to_indices = {}
    for idx, uid in enumerate(uids):
        uid_to_indices.setdefault(uid, []).append(idx)
    selected = []
    for group_indices in uid_to_indices.values():
        if len(group_indices) < 2:
            continue
        sorted_indices = sorted(group_indices, key=lambda idx: score_values[idx], reverse=True)
        selected.extend([sorted_indices[0], sorted_indices[-1]])
    return selected


def peer_flow_factory_pairs(unique_ids, advantages):
    """Flow-Factory DPOTrainer._form_pairs_from_advantages, on indices."""
    unique_ids = np.array(unique_ids, dtype=np.int64)
    _, group_indices = np.unique(unique_ids, return_inverse=True)
    advantages = np.array(advantages, dtype=np.float64)
    pairs = []
    for gid in np.unique(group_indices):
        mask = np.where(group_indices == gid)[0]
        if len(mask) < 2:
            continue
        group_adv = advantages[mask]
        best = mask[np.argmax(group_adv)]
        worst = mask[np.argmin(group_adv)]
        pairs.append((int(best), int(worst)))
    return pairs


def peer_flow_grpo_pair_advantages(prompts, rewards):
    """flow_grpo PerPromptStatTracker.update(type='dpo'): +1 on the best, -1 on the worst."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_advantages = torch.tensor(rewards[prompts == prompt])
        max_idx = torch.argmax(prompt_advantages)
        min_idx = torch.argmin(prompt_advantages)
        if max_idx == min_idx:
            min_idx = 0
            max_idx = 1
        result = torch.zeros_like(prompt_advantages).float()
        result[max_idx] = 1.0
        result[min_idx] = -1.0
        advantages[prompts == prompt] = result.numpy()
    return advantages


def peer_dgpo_official(model_v, ref_old_v, old_v, target_v, advantages, local_group_indices, num_groups, beta_dpo,
                       group_size, clip_range, clip_dsm, clip_kl, kl_beta, use_ema_ref):
    """Luo-Yihong/DGPO train_sd3_dgpo.py: the loss block (lines 1126-1160) and
    compute_group_dgpo_loss_allreduce (one process: the all_reduce is the identity)."""
    use_old = old_v is not None
    ref_dgpo_v = old_v if use_ema_ref else ref_old_v
    x0_shape0 = model_v.shape[0]
    dsm_loss = 1 * (target_v - model_v).square().reshape(x0_shape0, -1).mean(dim=1)
    should_clip = None
    if use_old:
        old_dsm_loss = 1 * (target_v - old_v).square().reshape(x0_shape0, -1).mean(dim=1)
        ratio = torch.exp(-dsm_loss + old_dsm_loss)
        should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        if clip_dsm:
            dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    # compute_group_dgpo_loss_allreduce
    batch_size = model_v.shape[0]
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_dgpo_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    local_group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    local_group_sums.scatter_add_(0, local_group_indices, per_sample_term)
    global_group_sums = local_group_sums.clone().detach()
    group_weights = torch.sigmoid(global_group_sums)
    local_weights = group_weights[local_group_indices]
    dgpo_loss = (local_weights.detach() * advantages * dsm_loss).mean()
    if kl_beta > 0:
        kl_loss = 1 * (model_v - ref_old_v).square().reshape(x0_shape0, -1).mean(dim=1)
        if clip_kl:
            kl_loss = torch.where(should_clip, kl_loss.detach(), kl_loss)
        kl_loss = torch.mean(kl_loss)
        loss = dgpo_loss + kl_beta * kl_loss
    else:
        loss = dgpo_loss
    clip_ratio = should_clip.float().mean() if use_old else None
    return loss, dgpo_loss, local_weights, clip_ratio


def peer_dgpo_flow_factory(model_v, ref_v, old_v, target_v, adv, local_group_indices, num_groups, dpo_beta,
                           group_size, clip_range, clip_dsm, clip_kl, kl_beta, use_ema_ref):
    """Flow-Factory DGPOTrainer: _compute_dsm_loss, _maybe_clip_dsm (clip_range the (lo, hi) pair of
    _standardize_clip_range), _compute_group_dgpo_loss, _apply_total_loss_and_backward."""
    ref_dgpo_v = old_v if use_ema_ref else ref_v
    batch_size = target_v.shape[0]
    dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    should_clip = None
    if (clip_dsm or clip_kl) and old_v is not None:
        old_dsm = (target_v - old_v).square().reshape(batch_size, -1).mean(dim=1)
        ratio = torch.exp(-dsm_loss.detach() + old_dsm)
        should_clip = torch.where(adv > 0, ratio > 1.0 + clip_range[1], ratio < 1.0 + clip_range[0])
        if clip_dsm:
            dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    with torch.no_grad():
        ref_dsm = (target_v - ref_dgpo_v).square().reshape(batch_size, -1).mean(dim=1)
    delta = dsm_loss.detach() - ref_dsm
    per_sample = adv * dpo_beta * delta / group_size
    local_sums = torch.zeros(num_groups, dtype=per_sample.dtype)
    local_sums.scatter_add_(0, local_group_indices, per_sample)
    global_sums = local_sums.detach()
    group_weights = torch.sigmoid(global_sums)[local_group_indices].detach()
    dgpo_loss = (group_weights * adv * dsm_loss).mean()
    loss = dgpo_loss
    if kl_beta > 0.0:
        kl_div = (model_v - ref_v).square().reshape(batch_size, -1).mean(dim=1)
        if clip_kl and should_clip is not None:
            kl_div = torch.where(should_clip, kl_div.detach(), kl_div)
        loss = loss + kl_beta * kl_div.mean()
    return loss, dgpo_loss, group_weights


# ------------------------------------------------------------------------------------- Diffusion-DPO


@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_matches_flow_grpo_and_flow_factory(backend):
    v, v_ref, eps, x0 = dpo_inputs()
    beta = 2000.0  # verl-omni's default dpo_beta: logits of order 1 at these errors
    (loss, logits, acc, theta, ref), g_peer = _grad_of(lambda vv: peer_flow_grpo_dpo(vv, v_ref, eps, x0, beta), v)
    ours, g_ours = _grad_of(lambda vv: L.dpo_loss(vv, v_ref, eps, x0, beta=beta, backend=backend), v)
    assert 0 < float(acc) < 1  # both outcomes occur: the accuracy is a real test
    torch.testing.assert_close(ours.model_error, theta, **TOL)
    torch.testing.assert_close(ours.ref_error, ref, **TOL)
    torch.testing.assert_close(ours.logits, logits, rtol=2e-4, atol=2e-4)  # beta x the error's rounding
    torch.testing.assert_close(ours.loss, loss, **TOL)
    assert float(ours.implicit_accuracy) == float(acc)
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))
    p = v.shape[0] // 2
    ff_loss, ff_acc, ff_chosen, ff_rejected = peer_flow_factory_dpo(v[:p], v[p:], v_ref[:p], v_ref[p:], eps[:p], x0[:p],
                                                                    x0[p:], beta)
    torch.testing.assert_close(ours.loss, ff_loss, **TOL)
    assert float(ours.implicit_accuracy) == float(ff_acc)
    torch.testing.assert_close(ours.reward_chosen, ff_chosen, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(ours.reward_rejected, ff_rejected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_matches_verl_omni_interleaved(backend):
    v, v_ref, eps, x0 = dpo_inputs(layout="interleaved", seed=3)
    beta = 2000.0
    (loss, metrics), g_peer = _grad_of(lambda vv: peer_verl_omni_dpo(eps, x0, vv, v_ref, beta), v)
    ours, g_ours = _grad_of(lambda vv: L.dpo_loss(vv, v_ref, eps, x0, beta=beta, pair_layout="interleaved",
                                                  backend=backend), v)
    torch.testing.assert_close(ours.loss, loss, **TOL)
    assert float(ours.implicit_accuracy) == float(metrics["implicit_acc"])
    torch.testing.assert_close(ours.reward_chosen.mean(), metrics["chosen"], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(ours.reward_rejected.mean(), metrics["rejected"], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(ours.reward_margin, metrics["margins"], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_matches_the_float64_oracle(backend):
    v, v_ref, eps, x0 = dpo_inputs(seed=5)
    beta = 500.0
    ours, g_ours = _grad_of(lambda vv: L.dpo_loss(vv, v_ref, eps, x0, beta=beta, backend=backend), v)
    d = [t.double() for t in (v, v_ref, eps, x0)]
    oracle, g_oracle = _grad_of(lambda vv: L.dpo_loss(vv, *d[1:], beta=beta, backend="torch"), d[0])
    assert oracle.loss.dtype == torch.float64
    loss64, *_ = peer_flow_grpo_dpo(*[t.double() for t in (v, v_ref, eps, x0)], beta)  # the peer's float() upcasts
    torch.testing.assert_close(ours.model_error.double(), oracle.model_error, **F64_TOL)
    torch.testing.assert_close(ours.loss.double(), oracle.loss, **F64_TOL)
    torch.testing.assert_close(g_ours.double(), g_oracle, rtol=1e-4, atol=1e-5 * float(g_oracle.abs().max()))


def test_dpo_gradcheck_and_sign():
    """Gradcheck in float64; lowering the chosen sample's error (relative to the reference) lowers the loss."""
    v, v_ref, eps, x0 = (t[..., :5].double().contiguous() for t in dpo_inputs(pairs=2, seed=7))
    assert torch.autograd.gradcheck(lambda vv: L.dpo_loss(vv, v_ref, eps, x0, beta=50.0, backend="torch").loss,
                                    (v.clone().requires_grad_(),))
    u = eps - x0
    better = v.clone()
    better[:2] = u[:2] + 0.5 * (v[:2] - u[:2])  # chosen samples closer to their target
    assert L.dpo_loss(better, v_ref, eps, x0, beta=50.0).loss < L.dpo_loss(v, v_ref, eps, x0, beta=50.0).loss


@pytest.mark.parametrize("ties", L.dpo.PAIR_TIES)
def test_dpo_pairs_match_each_peer(ties):
    # groups (prompt ids) out of order, ties at the top and bottom, a group of equal rewards, a singleton
    ids = torch.tensor([7, 3, 7, 3, 7, 9, 3, 7, 5, 5, 5])
    rewards = torch.tensor([0.2, 1.0, 0.9, 1.0, 0.2, 0.4, -1.0, 0.9, 0.3, 0.3, 0.3])
    chosen, rejected = L.dpo_pairs(rewards, ids, ties=ties)
    ours = sorted(zip(chosen.tolist(), rejected.tolist()), key=lambda p: int(ids[p[0]]))
    if ties == "verl_omni":
        flat = peer_verl_omni_pairs(ids.tolist(), rewards)
        peer = sorted(zip(flat[0::2], flat[1::2]), key=lambda p: int(ids[p[0]]))
    elif ties == "flow_factory":
        peer = peer_flow_factory_pairs(ids.tolist(), rewards.tolist())
    else:  # flow_grpo's tracker indexes out of range on a singleton group: give it the others
        keep = [i for i in range(len(ids)) if int(ids[i]) != 9]
        adv = peer_flow_grpo_pair_advantages(ids[keep].tolist(), rewards[keep].tolist())
        peer = []
        for gid in sorted(set(ids[keep].tolist())):
            members = [j for j in range(len(keep)) if int(ids[keep[j]]) == gid]
            peer.append((keep[[j for j in members if adv[j] == 1.0][0]], keep[[j for j in members if adv[j] == -1.0][0]]))
    assert ours == peer
    assert [int(ids[c]) for c, _ in ours] == [3, 5, 7]  # increasing group id, the singleton 9 skipped
    assert all(float(rewards[c]) >= float(rewards[r]) for c, r in ours)


def test_online_dpo_from_a_rollout_group_end_to_end():
    """dpo_pairs -> the pair batch ("halves") -> dpo_loss equals the peer on the gathered batch."""
    g = torch.Generator().manual_seed(11)
    n, shape = 8, SHAPE[1:]
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.randn(n, generator=g)
    x0_all = torch.randn((n,) + shape, generator=g)
    chosen, rejected = L.dpo_pairs(rewards, ids)
    x0 = torch.cat([x0_all[chosen], x0_all[rejected]])
    eps_pair = torch.randn((2,) + shape, generator=g)
    eps = torch.cat([eps_pair, eps_pair])
    v_ref = (eps - x0) + 0.5 * torch.randn(x0.shape, generator=g)
    v = v_ref + 0.05 * torch.randn(x0.shape, generator=g)
    loss, *_ = peer_flow_grpo_dpo(v, v_ref, eps, x0, 1000.0)
    torch.testing.assert_close(L.dpo_loss(v, v_ref, eps, x0, beta=1000.0).loss, loss, **TOL)


# --------------------------------------------------------------------------------------------- DGPO

DGPO_CASES = {  # (clip, clip_dsm, clip_kl, kl_beta, use_ema_ref): the configs of DGPO's config/*.py and more
    "plain": (False, False, False, 0.0, False),
    "clip_dsm": (True, True, False, 0.0, False),  # config/dgpo.py
    "clip_kl": (True, True, True, 0.1, False),
    "ema_ref_kl": (True, True, False, 0.1, True),  # config/dgpo_wocfg_emaref.py with a KL
}


def dgpo_inputs(seed=0, dtype=torch.float32):
    """Two groups of three (group ids out of order), noise shared per group, v_ref / v_old / v near u."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([4, 1, 4, 1, 1, 4])
    x0 = _randn((6,) + SHAPE[1:], g)
    group_eps = _randn((2,) + SHAPE[1:], g)
    inverse = torch.unique(ids, return_inverse=True)[1]
    eps = group_eps[inverse.to(DEVICE)]
    u = eps - x0
    v_ref = u + 0.5 * _randn(x0.shape, g)
    v_old = v_ref + 0.02 * _randn(x0.shape, g)
    v = v_old + 0.05 * _randn(x0.shape, g)
    adv = torch.tensor([1.2, -0.3, -0.9, 1.0, -0.7, -0.3]).to(DEVICE)
    return tuple(t.to(dtype) for t in (v, v_ref, v_old, eps, x0)) + (adv, ids.to(DEVICE), inverse.to(DEVICE))


def _ours_dgpo(case, backend, v, v_ref, v_old, eps, x0, adv, ids, clip_range=0.002, beta=100.0, group_size=3):
    clip, clip_dsm, clip_kl, kl_beta, ema = DGPO_CASES[case]
    return L.dgpo_loss(v, v_ref, eps, x0, advantages=adv, group_index=ids, beta=beta, group_size=group_size,
                       old_model_output=v_old if clip or ema else None, clip_range=clip_range if clip else None,
                       clip_dsm=clip_dsm, clip_kl=clip_kl, ema_reference=ema, kl_coef=kl_beta, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(DGPO_CASES))
def test_dgpo_matches_the_official_code_and_flow_factory(backend, case):
    v, v_ref, v_old, eps, x0, adv, ids, inverse = dgpo_inputs()
    clip, clip_dsm, clip_kl, kl_beta, ema = DGPO_CASES[case]
    old = v_old if clip or ema else None
    ours, g_ours = _grad_of(lambda vv: _ours_dgpo(case, backend, vv, v_ref, v_old, eps, x0, adv, ids), v)
    (loss, policy, weights, clip_ratio), g_peer = _grad_of(
        lambda vv: peer_dgpo_official(vv, v_ref, old, eps - x0, adv, inverse, 2, 100.0, 3, 0.002, clip_dsm, clip_kl,
                                      kl_beta, ema), v)
    torch.testing.assert_close(ours.loss, loss, **TOL)
    torch.testing.assert_close(ours.policy_loss, policy, **TOL)
    torch.testing.assert_close(ours.group_weight, weights, **TOL)
    assert not torch.allclose(weights, weights[0].expand(6))  # the two groups' weights differ
    if clip:
        assert float(ours.clip_fraction) == float(clip_ratio)
        assert 0 < float(clip_ratio) < 1  # some samples clipped, some not: the clip is exercised
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))
    (ff_loss, ff_policy, ff_weights), g_ff = _grad_of(
        lambda vv: peer_dgpo_flow_factory(vv, v_ref, old, eps - x0, adv, inverse, 2, 100.0, 3, (-0.002, 0.002),
                                          clip_dsm, clip_kl, kl_beta, ema), v)
    torch.testing.assert_close(ours.loss, ff_loss, **TOL)
    torch.testing.assert_close(g_ours, g_ff, rtol=1e-4, atol=1e-4 * float(g_ff.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dgpo_matches_the_float64_oracle_and_group_size_none(backend):
    v, v_ref, v_old, eps, x0, adv, ids, inverse = dgpo_inputs(seed=2)
    ours, g_ours = _grad_of(lambda vv: _ours_dgpo("clip_kl", backend, vv, v_ref, v_old, eps, x0, adv, ids), v)
    d = [t.double() for t in (v, v_ref, v_old, eps, x0, adv)]
    oracle, g_oracle = _grad_of(lambda vv: _ours_dgpo("clip_kl", "torch", vv, *d[1:], ids), d[0])
    assert oracle.loss.dtype == torch.float64
    torch.testing.assert_close(ours.loss.double(), oracle.loss, **F64_TOL)
    torch.testing.assert_close(g_ours.double(), g_oracle, rtol=1e-4, atol=1e-5 * float(g_oracle.abs().max()))
    # group_size=None: each group's count in the call (3 here), the same numbers
    counted = _ours_dgpo("clip_kl", backend, v, v_ref, v_old, eps, x0, adv, ids, group_size=None)
    torch.testing.assert_close(counted.loss, ours.loss, rtol=0, atol=0)


def test_dgpo_sums_gradcheck_on_the_torch_backend():
    """The group weight is a stop-grad function of v, so the loss itself is a surrogate (its gradient is
    compared with the peers' autograd above); the differentiable part, the per-sample sums [5, B] (dsm,
    the references' errors, the KLs), passes gradcheck in float64."""
    v, v_ref, v_old, eps, x0, *_ = dgpo_inputs(seed=4, dtype=torch.float64)
    v, v_ref, v_old, eps, x0 = (t[..., :5].contiguous() for t in (v, v_ref, v_old, eps, x0))
    assert torch.autograd.gradcheck(
        lambda vv: L.dpo._preference_sums("torch", L.FlowLoss.DGPO, vv, eps, x0, v_ref, v_old),
        (v.clone().requires_grad_(),))


# ------------------------------------------------------------------------ Triton parity, invariance


@pytest.mark.skipif(not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs the Triton backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    v, v_ref, eps, x0 = dpo_inputs(dtype=dtype)
    cases = {"dpo": (lambda vv, be: L.dpo_loss(vv, v_ref, eps, x0, beta=300.0, backend=be), v)}
    dv, dv_ref, dv_old, deps, dx0, adv, ids, _ = dgpo_inputs(dtype=dtype)
    for case in DGPO_CASES:
        cases[case] = (lambda vv, be, case=case: _ours_dgpo(case, be, vv, dv_ref, dv_old, deps, dx0, adv, ids), dv)
    for name, (fn, v0) in cases.items():
        res_t, grad_t = _grad_of(lambda vv: fn(vv, "torch"), v0)
        res_k, grad_k = _grad_of(lambda vv: fn(vv, "triton"), v0)
        assert grad_k.dtype == dtype, name
        for field in res_t._fields:
            a, b = getattr(res_k, field), getattr(res_t, field)
            if a is None:
                assert b is None, (name, field)
                continue
            if dtype == torch.float32:  # the same sums, the same [B] ops: equal bit for bit
                assert torch.equal(a, b), (name, field)
            else:
                torch.testing.assert_close(a, b, **tol, msg=f"{name} {field}")
        scale = grad_t.float().abs().max()
        assert scale > 0, name
        torch.testing.assert_close(grad_k.float() / scale, grad_t.float() / scale, **tol, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sample_errors_are_deterministic_and_batch_invariant(backend):
    v, v_ref, eps, x0 = dpo_inputs(pairs=3, seed=8)
    full = L.dpo_loss(v, v_ref, eps, x0, beta=100.0, backend=backend)
    again = L.dpo_loss(v, v_ref, eps, x0, beta=100.0, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    sub = [0, 3]  # pair 0 alone
    alone = L.dpo_loss(v[sub], v_ref[sub], eps[sub], x0[sub], beta=100.0, backend=backend)
    assert torch.equal(alone.model_error, full.model_error[sub])
    assert torch.equal(alone.ref_error, full.ref_error[sub])
    assert torch.equal(alone.logits, full.logits[:1])
    dv, dv_ref, dv_old, deps, dx0, adv, ids, _ = dgpo_inputs(seed=9)
    full = _ours_dgpo("ema_ref_kl", backend, dv, dv_ref, dv_old, deps, dx0, adv, ids)
    grp = (ids == 4).nonzero().flatten()  # one whole group alone: its weights and per-sample values unchanged
    alone = _ours_dgpo("ema_ref_kl", backend, dv[grp], dv_ref[grp], dv_old[grp], deps[grp], dx0[grp], adv[grp], ids[grp])
    for field in ("dsm", "ref_dsm", "group_weight", "kl", "ratio"):
        assert torch.equal(getattr(alone, field), getattr(full, field)[grp]), field


# ----------------------------------------------------------------------------------- argument errors


def test_bad_arguments_name_the_argument():
    v, v_ref, eps, x0 = dpo_inputs(pairs=1)
    with pytest.raises(ValueError, match="even batch"):
        L.dpo_loss(v[:1], v_ref[:1], eps[:1], x0[:1], beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        L.dpo_loss(v, v_ref, eps, x0, beta=0.0)
    with pytest.raises(ValueError, match="pair_layout"):
        L.dpo_loss(v, v_ref, eps, x0, beta=1.0, pair_layout="adjacent")
    with pytest.raises(ValueError, match="noise"):
        L.dpo_loss(v, v_ref, eps[:, :1], x0, beta=1.0)
    with pytest.raises(ValueError, match="ref_model_output requires grad"):
        L.dpo_loss(v, v_ref.requires_grad_(), eps, x0, beta=1.0)
    with pytest.raises(TypeError, match="rewards"):
        L.dpo_pairs(torch.tensor([1, 2]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="group_ids"):
        L.dpo_pairs(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="ties"):
        L.dpo_pairs(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), ties="first")
    with pytest.raises(ValueError, match="rewards must be finite"):
        L.dpo_pairs(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    dv, dv_ref, dv_old, deps, dx0, adv, ids, _ = dgpo_inputs()
    with pytest.raises(ValueError, match="old_model_output"):
        L.dgpo_loss(dv, dv_ref, deps, dx0, advantages=adv, group_index=ids, beta=1.0, clip_range=0.1)
    with pytest.raises(ValueError, match="ref_model_output"):
        L.dgpo_loss(dv, None, deps, dx0, advantages=adv, group_index=ids, beta=1.0)
    with pytest.raises(TypeError, match="group_index"):
        L.dgpo_loss(dv, dv_ref, deps, dx0, advantages=adv, group_index=ids.float(), beta=1.0)
    with pytest.raises(ValueError, match="group_size"):
        L.dgpo_loss(dv, dv_ref, deps, dx0, advantages=adv, group_index=ids, beta=1.0, group_size=0)
    with pytest.raises(ValueError, match="advantages"):
        L.dgpo_loss(dv, dv_ref, deps, dx0, advantages=adv[:2], group_index=ids, beta=1.0)
    with pytest.raises(TypeError, match="clip_kl"):
        L.dgpo_loss(dv, dv_ref, deps, dx0, advantages=adv, group_index=ids, beta=1.0, clip_kl=1)


def test_docs_snippet_runs():
    text = (ROOT / "docs" / "losses.md").read_text()
    block = re.search(r"## Diffusion-DPO and DGPO.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "docs/losses.md", "exec"), {})


# ------------------------------------------------------------------------------------ AOT compile

def test_aot_lists_every_preference_specialization():
    """flowrl/tools/aot lists what dpo_loss / dgpo_loss launch: DPO (one reference, HAS_REF off) and DGPO
    with one or two references, forward and backward, for every storage dtype, with eps given or drawn
    from Philox (aligned or not) on a tail or on whole blocks (EVEN)."""
    from flowrl.tools import aot

    for storage in aot.STORAGES:
        listed = {(s.kernel, s.constexprs["LOSS"], s.constexprs["HAS_REF"]) for s in aot.loss_specializations(storage)
                  if s.kernel.startswith("flow_")}
        assert listed >= {(k, loss, ref) for k in ("flow_partials_kernel", "flow_backward_kernel")
                          for loss, ref in ((int(L.FlowLoss.DPO), False), (int(L.FlowLoss.DGPO), False),
                                            (int(L.FlowLoss.DGPO), True))}
        # the noise and block switches: eps given or drawn (aligned or not), tail or whole blocks
        switches = {(s.kernel, s.constexprs["LOSS"], s.constexprs["PHILOX"], s.constexprs["PHILOX_ALIGNED"],
                     s.constexprs["EVEN"]) for s in aot.loss_specializations(storage) if s.kernel.startswith("flow_")}
        assert switches >= {(k, int(loss), philox, aligned, even)
                            for k in ("flow_partials_kernel", "flow_backward_kernel")
                            for loss in (L.FlowLoss.DPO, L.FlowLoss.DGPO)
                            for philox, aligned, even in ((False, False, False), (False, False, True),
                                                          (True, True, False), (True, True, True),
                                                          (True, False, False))}
        # the Philox row's layout (kernels/loss.py's NOISE_DIV): halves and DGPO, interleaved pairs, any
        assert {(s.kernel, s.constexprs["NOISE_DIV"]) for s in aot.loss_specializations(storage)
                if s.kernel.startswith("flow_") and s.constexprs["PHILOX"]} == {
            (k, d) for k in ("flow_partials_kernel", "flow_backward_kernel") for d in (0, 1, 2)}
        paired = {(s.kernel, s.constexprs["LOSS"], s.constexprs["PAIRED"], s.constexprs["EVEN"])
                  for s in aot.loss_specializations(storage) if s.kernel.startswith("flow_")}
        assert paired >= {(k, loss, p, even) for k in ("flow_partials_kernel", "flow_backward_kernel")
                          for loss in range(4) for p, even in ((True, False), (True, True), (False, False))}


def test_the_roofline_counts_the_bytes_the_preference_kernels_move():
    """flowrl/tools/aot's ELEMENT_TRAFFIC (roofline.py): DPO reads v, eps, x0 and v_ref (the xt slot), DGPO also its second
    reference (the ref slot); eps drawn from Philox is not read; the DPO backward does not read v_ref."""
    from flowrl.tools import aot
    from flowrl.tools.aot.loss_specs import _flow_loss

    g = (1, 1)
    dpo, dgpo = int(L.FlowLoss.DPO), int(L.FlowLoss.DGPO)
    assert aot.bytes_per_element(_flow_loss("bf16", dpo, False, *g)) == 8
    assert aot.bytes_per_element(_flow_loss("bf16", dgpo, False, *g)) == 8
    assert aot.bytes_per_element(_flow_loss("bf16", dgpo, True, *g)) == 10
    assert aot.bytes_per_element(_flow_loss("bf16", dpo, False, *g, philox=True)) == 6
    assert aot.bytes_per_element(_flow_loss("bf16", dgpo, True, *g, even=True, philox=True)) == 8
    assert aot.bytes_per_element(_flow_loss("bf16", dpo, False, *g, backward=True)) == 8  # v, eps, x0, grad_v
    assert aot.bytes_per_element(_flow_loss("bf16", dgpo, True, *g, backward=True)) == 12
    assert aot.bytes_per_element(_flow_loss("bf16", 0, True, *g)) == 10  # NFT: x_t, v, v_old, x0, v_ref
    assert aot.bytes_per_element(_flow_loss("bf16", 1, False, *g)) == 6  # AWM: v, eps, x0


@pytest.mark.skipif(not (sys.platform == "linux" and __import__("platform").machine() == "x86_64"),
                    reason="triton's CUDA backend wheels are Linux x86_64")
@pytest.mark.slow  # reads the full AOT run (tests/aot_runs.py): minutes
@pytest.mark.aot
@pytest.mark.parametrize("version", ["installed", "3.6"])
def test_preference_kernels_compile_without_spills(version):
    """The DPO / DGPO specializations, every storage dtype, for tests/kernels/test_compile.py's targets (sm_90a
    and sm_80's spot check, its hot bf16 ones, with the installed triton; sm_90a with triton 3.6.0),
    with no register spill, their latents loaded 128 bits at a time except unpaired: these rows of
    the shared AOT run."""
    from collections import Counter

    from aot_runs import ARCHS_36, ARCHS_NEWEST, SPOT_NEWEST, TRITON36, rows as aot_rows
    from flowrl.tools import aot

    if version == "3.6" and not (TRITON36 / "triton").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"triton 3.6.0 is missing from {TRITON36}: ./run's set-up installs it")
        pytest.skip(f"triton 3.6.0 not installed in {TRITON36} (./run's set-up installs it)")
    _, rows = aot_rows(TRITON36 if version == "3.6" else None)
    archs, spot = (ARCHS_36, ()) if version == "3.6" else (ARCHS_NEWEST, SPOT_NEWEST)
    preference = lambda kernel, label: kernel.startswith("flow_") and label.split()[0] in ("dpo", "dgpo")  # noqa: E731
    rows = [r for r in rows if preference(r["kernel"], r["label"])]
    # storages x (forward, backward) x ((DPO, DGPO one / two references, DPO and DGPO (two references)
    # with Philox noise) x (tail, whole blocks, unpaired) + DPO and DGPO with Philox from an unaligned
    # offset + DPO's Philox rows of interleaved pairs and of any (div, mod), whole blocks) per arch
    hot = sum(preference(s.kernel, s.label) for s in aot.hot_specializations("bf16"))
    assert 0 < hot < 2 * (5 * 3 + 2 + 2)
    assert Counter(r["arch"] for r in rows) == {f"sm_{a}": hot if a in spot else 3 * 2 * (5 * 3 + 2 + 2)
                                                for a in archs}
    for r in rows:
        # unpaired: compiled without the alignment attributes (an odd count or misaligned rows)
        assert r["ok"] and r["spill_bytes"] == 0, r
        assert r["loads_128"] == 0 if "unaligned-tensors" in r["label"] else r["loads_128"] >= 2, r
        if version == "3.6":
            assert r["triton"] == "3.6.0", r


# ------------------------------------------------------------------------------------------- bench


def test_bench_rows_check_against_the_peers_code():
    """bench/run.py's losses suite: the dpo_loss and dgpo_loss rows pass their check against the eager
    peer code (flow_grpo's DPO block, DGPO's loss block) in float32 and bfloat16; dpo_loss skips an odd
    batch with a note."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import run as bench
    finally:
        sys.path.pop(0)
    rows, _, notes = bench.run_loss_sweep(torch.device("cpu"), [(4, 8, 64), (3, 64)], ["fp32", "bf16"],
                                          ("dpo_loss", "dgpo_loss"), ["flowrl-torch", "eager"],
                                          timing_budget_s=0.01, log=lambda s: None)
    assert len(rows) == 2 * 2 * 2 + 2 * 2  # dpo_loss only at the even batch
    assert all(not r.note for r in rows), [r.note for r in rows if r.note]
    assert any("dpo_loss needs chosen/rejected pairs" in n for n in notes)
    assert bench.loss_kernel_bytes("dpo_loss", 1024, 1, 4) < bench.loss_kernel_bytes("dgpo_loss", 1024, 1, 4)
