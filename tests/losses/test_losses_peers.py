"""flowrl.losses against the peers' eager loss code, transcribed below operation for operation as the
oracle (not imported: the peers are not dependencies), on identical inputs, on both backends:

- Flow-GRPO: yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd, scripts/train_sd3.py
  lines 881-927 (the training loss block; its log-prob recompute is tests/test_compat.peer_flow_grpo).
- verl-omni: verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/trainer/diffusion/diffusion_algos.py: FlowGRPOLoss, FlowDPPOLoss, GRPOGuardLoss,
  DistillKLLoss (``compute_loss``).
- Flow-Factory: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/trainers/grpo.py (GRPOGuardTrainer.optimize, lines 497-510: the guard ratio and the
  asymmetric clip range) and src/flow_factory/trainers/awm.py (``compute_weighted_log_prob``, lines
  284-330, and the clipped loss, lines 496-502).
- DiffusionNFT: NVlabs/DiffusionNFT @ 24af5554898d85e93efa492f42b5e9cdf4156e9b, scripts/train_nft_sd3.py
  lines 909-971 (policy loss and KL).

Where flowrl differs from a peer by design the test states the exact relation: Flow-GRPO's and
verl-omni's KLs divide by s^2 (``std_dev_t``), not the variance s^2 D (flowrl's exact KL x D = theirs);
GRPO-Guard's 1/D is verl-omni's, Flow-Factory leaves it out (flowrl's policy loss x D = Flow-Factory's).
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl import losses as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_compat import diffusers_scheduler, gen, peer_flow_grpo  # noqa: E402

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]
SHAPE = (3, 4, 16, 24)  # 1536 elements per sample: two chunks
TOL = dict(rtol=2e-5, atol=2e-6)  # float32 rounding: different reduction order and operation order


# ----------------------------------------------------------------------------------------- peers
def peer_flow_grpo_block(log_prob, old_log_probs, advantages, prev_sample_mean, prev_sample_mean_ref, std_dev_t,
                         clip_range, beta, adv_clip_max=5.0):
    """flow_grpo scripts/train_sd3.py, the loss block (the sample's advantages / log_probs at step j)."""
    info = {}
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_probs)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    if beta > 0:
        kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)
        info["kl_per_sample"] = kl_loss.flatten()
        kl_loss = torch.mean(kl_loss)
        loss = policy_loss + beta * kl_loss
    else:
        loss = policy_loss
    info["approx_kl"] = 0.5 * torch.mean((log_prob - old_log_probs) ** 2)
    info["clipfrac"] = torch.mean((torch.abs(ratio - 1.0) > clip_range).float())
    info["clipfrac_gt_one"] = torch.mean((ratio - 1.0 > clip_range).float())
    info["clipfrac_lt_one"] = torch.mean((1.0 - ratio > clip_range).float())
    return loss, policy_loss, info


def _cfg(**kw):
    return SimpleNamespace(diffusion_loss=SimpleNamespace(**kw))


def peer_verl_flow_grpo(old_log_prob, log_prob, advantages, config):
    """verl-omni FlowGRPOLoss.compute_loss (no rollout_is_weights)."""
    loss_cfg = config.diffusion_loss
    advantages = torch.clamp(advantages, -loss_cfg.adv_clip_max, loss_cfg.adv_clip_max)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - loss_cfg.clip_ratio, 1.0 + loss_cfg.clip_ratio)
    per_elem_loss = torch.maximum(unclipped_loss, clipped_loss)
    pg_loss = torch.mean(per_elem_loss)
    with torch.no_grad():
        metrics = {"pg_clipfrac": torch.mean((torch.abs(ratio - 1.0) > loss_cfg.clip_ratio).float()),
                   "ratio_mean": ratio.mean()}
    return pg_loss, metrics


def _broadcast_sqrt_dt(sqrt_dt, target):
    if sqrt_dt.ndim == 0:
        return sqrt_dt.reshape(1, *([1] * (target.ndim - 1)))
    return sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (target.ndim - 1)))


def peer_verl_flow_dppo(old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                        sqrt_dt):
    """verl-omni FlowDPPOLoss.compute_loss (add_kl_coefficient True, no rollout_is_weights)."""
    loss_cfg = config.diffusion_loss
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    sigma_t = std_dev_t * _broadcast_sqrt_dt(sqrt_dt, std_dev_t)
    kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high_kl_mask = kl_per_sample >= loss_cfg.kl_mask_threshold
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    per_elem_loss = torch.where(keep_mask, unclipped_loss, zero)
    pg_loss = torch.mean(per_elem_loss)
    return pg_loss, {"kl_per_sample": kl_per_sample, "masked_fraction": rm_mask.float().mean()}


def peer_verl_grpo_guard(old_log_prob, log_prob, advantages, config, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                         sqrt_dt):
    """verl-omni GRPOGuardLoss.compute_loss (no rollout_is_weights)."""
    loss_cfg = config.diffusion_loss
    advantages = torch.clamp(advantages, -loss_cfg.adv_clip_max, loss_cfg.adv_clip_max)
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale ** 2)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp((log_ratio + ratio_mean_bias) * scale)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - loss_cfg.clip_ratio, 1.0 + loss_cfg.clip_ratio)
    per_elem_loss = torch.maximum(unclipped_loss, clipped_loss)
    pg_loss = torch.mean(per_elem_loss) / (sqrt_dt_mean ** 2)
    return pg_loss, {"ratio": ratio, "ratio_mean_bias": ratio_mean_bias,
                     "pg_clipfrac": torch.mean((torch.abs(ratio - 1.0) > loss_cfg.clip_ratio).float())}


def peer_verl_distill_kl(prev_sample_mean, teacher_prev_sample_mean, std_dev_t):
    """verl-omni DistillKLLoss.compute_loss (Diffusion-OPD's teacher KL), for [B, ...] latents."""
    kl_loss = ((prev_sample_mean - teacher_prev_sample_mean) ** 2).mean(
        dim=tuple(range(1, prev_sample_mean.ndim)), keepdim=True) / (2 * std_dev_t ** 2)
    return kl_loss.mean(), kl_loss.flatten()


def peer_flow_factory_guard(log_prob, old_log_prob, adv, next_latents_mean, old_next_latents_mean, std_dev_t, dt,
                            adv_clip_range, ratio_clip_range):
    """Flow-Factory GRPOGuardTrainer.optimize, the loss (clip ranges are offsets: [1 + lo, 1 + hi])."""
    adv = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (next_latents_mean - old_next_latents_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor))
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + ratio_clip_range[0], 1.0 + ratio_clip_range[1])
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    return policy_loss, ratio


def peer_nft(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t, advantages, beta, adv_clip_max):
    """DiffusionNFT scripts/train_nft_sd3.py, the policy loss and KL (adv_mode unset)."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
                         .clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    loss = policy_loss
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=tuple(range(1, x0.ndim)))
    loss += beta * torch.mean(kl_div_loss)
    return loss, policy_loss, ori_policy_loss, kl_div_loss


def peer_awm_log_prob(model_output, target, t, weighting, ghuber_power=0.25):
    """Flow-Factory AWMTrainer.compute_weighted_log_prob (t = sigma = timestep / 1000)."""
    model_output = model_output.double()
    target = target.double()
    log_prob = -(model_output - target) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "Uniform":
        pass
    elif weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t ** 2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(1e-10, device=log_prob.device, dtype=log_prob.dtype)
        log_prob = -(torch.pow(-log_prob + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
    return log_prob.float()


def peer_awm_loss(log_prob, old_log_prob, adv, ratio_clip_range):
    """Flow-Factory AWMTrainer.optimize, the clipped loss."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 + ratio_clip_range[0], 1.0 + ratio_clip_range[1])
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)), ratio


# --------------------------------------------------------------------------------------- fixtures


def _setup(step_indices, seed=0):
    """Flow-GRPO rollout (the peer's step) and its recompute under a moved policy, with the peer's
    means and std_dev_t; flowrl reads the same scheduler's sigmas."""
    sched = diffusers_scheduler()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    v_old = torch.randn(SHAPE, generator=g)
    v_new = v_old + 0.3 * torch.randn(SHAPE, generator=g)
    v_ref = v_old + 0.1 * torch.randn(SHAPE, generator=g)
    adv = torch.tensor([1.2, -0.7, 0.4])
    t = sched.timesteps[step_indices]
    prev, old_lp, old_mean, _ = peer_flow_grpo(sched, v_old, t, x, generator=gen(seed + 1))
    _, lp, mean, std_dev_t, sqrt_dt = peer_flow_grpo(sched, v_new, t, x, prev_sample=prev, return_sqrt_dt=True)
    _, _, mean_ref, _ = peer_flow_grpo(sched, v_ref, t, x, prev_sample=prev)
    return SimpleNamespace(sched=sched, sigmas=sched.sigmas.float(), idx=torch.tensor(step_indices), x=x, v_old=v_old,
                           v_new=v_new, v_ref=v_ref, adv=adv, prev=prev, old_lp=old_lp, old_mean=old_mean, lp=lp,
                           mean=mean, mean_ref=mean_ref, std_dev_t=std_dev_t, sqrt_dt=sqrt_dt)


def _grad_of(fn, v):
    vv = v.clone().requires_grad_()
    out = fn(vv)
    loss = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad(loss, vv)[0]


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_loss_matches_flow_grpo_training_block(backend):
    s = _setup([1, 4, 8])
    ours = L.grpo_loss(s.x, s.v_new, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp, advantages=s.adv, clip_range=0.01,
                       kl_coef=0.04,
                       ref_model_output=s.v_ref, backend=backend)
    _, policy, info = peer_flow_grpo_block(s.lp, s.old_lp, s.adv, s.mean, s.mean_ref, s.std_dev_t, 0.01, 0.04)
    torch.testing.assert_close(ours.log_prob, s.lp, **TOL)
    torch.testing.assert_close(ours.policy_loss, policy, **TOL)
    torch.testing.assert_close(ours.approx_kl, info["approx_kl"], rtol=1e-3, atol=1e-10)
    assert float(info["clipfrac"]) > 0  # both branches of the clip are exercised
    assert torch.equal(ours.clip_fraction, info["clipfrac"])
    assert torch.equal(ours.clip_fraction_high, info["clipfrac_gt_one"])
    assert torch.equal(ours.clip_fraction_low, info["clipfrac_lt_one"])
    d = s.sqrt_dt.flatten() ** 2  # Flow-GRPO's KL divides by s^2, the exact KL by s^2 D
    torch.testing.assert_close(ours.kl * d, info["kl_per_sample"], rtol=1e-4, atol=1e-9)
    # one step for the batch: kl_coef = beta * D reproduces the peer's total loss, gradient included
    s = _setup([3, 3, 3])
    d = float(s.sqrt_dt.flatten()[0] ** 2)

    def peer(vv):
        _, lp, mean, std_dev_t = peer_flow_grpo(s.sched, vv, s.sched.timesteps[s.idx], s.x, prev_sample=s.prev)
        return peer_flow_grpo_block(lp, s.old_lp, s.adv, mean, s.mean_ref, std_dev_t, 0.01, 0.04)[0]

    (res, g_ours) = _grad_of(lambda vv: L.grpo_loss(s.x, vv, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp,
                                                    advantages=s.adv, clip_range=0.01,
                                                    kl_coef=0.04 * d, ref_model_output=s.v_ref, backend=backend), s.v_new)
    loss_peer, g_peer = _grad_of(peer, s.v_new)
    torch.testing.assert_close(res.loss, loss_peer, **TOL)
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_loss_matches_verl_omni_flow_grpo_loss(backend):
    s = _setup([0, 5, 9])
    cfg = _cfg(adv_clip_max=5.0, clip_ratio=0.01)
    ours = L.grpo_loss(s.x, s.v_new, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp, advantages=s.adv, clip_range=0.01,
                       backend=backend)
    loss, metrics = peer_verl_flow_grpo(s.old_lp, s.lp, s.adv, cfg)
    torch.testing.assert_close(ours.loss, loss, **TOL)
    assert torch.equal(ours.clip_fraction, metrics["pg_clipfrac"])
    torch.testing.assert_close(ours.ratio_mean, metrics["ratio_mean"], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["given", "replay"])
def test_grpo_guard_matches_verl_omni_and_flow_factory(backend, source):
    """One step for the batch (the peers use the batch's mean std and sqrt_dt). ``replay``: the rollout
    is flowrl's with in-kernel noise; the peers get its stored mean, flowrl replays it from noise_seed."""
    s = _setup([2, 2, 2])
    if source == "replay":
        out = flowrl.sde_step(s.x, s.v_old, s.sigmas, s.idx, noise_seed=7, backend=backend)
        s.prev, s.old_lp, s.old_mean = out.prev_sample, out.log_prob, out.prev_sample_mean
        _, s.lp, s.mean, _ = peer_flow_grpo(s.sched, s.v_new, s.sched.timesteps[s.idx], s.x, prev_sample=s.prev)
        mu_old = dict(noise_seed=7)
    else:
        mu_old = dict(old_prev_sample_mean=s.old_mean)
    cfg = _cfg(adv_clip_max=5.0, clip_ratio=0.05)
    fn = lambda vv: L.grpo_guard_loss(s.x, vv, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp, advantages=s.adv,
                                      clip_range=0.05,  # noqa: E731
                                      backend=backend, **mu_old)
    ours, g_ours = _grad_of(fn, s.v_new)

    def peer(vv):
        _, lp, mean, _ = peer_flow_grpo(s.sched, vv, s.sched.timesteps[s.idx], s.x, prev_sample=s.prev)
        return peer_verl_grpo_guard(s.old_lp, lp, s.adv, cfg, s.old_mean, mean, s.std_dev_t, s.sqrt_dt)

    (loss, metrics), g_peer = _grad_of(peer, s.v_new)
    torch.testing.assert_close(ours.trust_divergence, metrics["ratio_mean_bias"], rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(ours.ratio, metrics["ratio"], **TOL)
    torch.testing.assert_close(ours.loss, loss, **TOL)
    assert torch.equal(ours.clip_fraction, metrics["pg_clipfrac"])
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))
    # Flow-Factory: the same ratio; an asymmetric clip range given as offsets; no 1/D on the loss
    asym = L.grpo_guard_loss(s.x, s.v_new, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp, advantages=s.adv,
                             clip_range=(0.02, 0.05),
                             backend=backend, **mu_old)
    dt = -(s.sqrt_dt ** 2)
    ff_loss, ff_ratio = peer_flow_factory_guard(s.lp, s.old_lp, s.adv, s.mean, s.old_mean, s.std_dev_t.flatten(),
                                                dt.flatten(), (-5.0, 5.0), (-0.02, 0.05))
    torch.testing.assert_close(asym.ratio, ff_ratio, **TOL)
    torch.testing.assert_close(asym.policy_loss * float(s.sqrt_dt.flatten()[0] ** 2), ff_loss, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flow_dppo_matches_verl_omni(backend):
    s = _setup([1, 4, 8])
    _, metrics = peer_verl_flow_dppo(s.old_lp, s.lp, s.adv, _cfg(kl_mask_threshold=0.0), s.old_mean, s.mean,
                                     s.std_dev_t, s.sqrt_dt.flatten())
    kl = metrics["kl_per_sample"].sort().values
    threshold = float(kl[0] + kl[1]) / 2  # one sample below, two above
    loss, metrics = peer_verl_flow_dppo(s.old_lp, s.lp, s.adv, _cfg(kl_mask_threshold=threshold), s.old_mean, s.mean,
                                        s.std_dev_t, s.sqrt_dt.flatten())
    ours = L.flow_dppo_loss(s.x, s.v_new, s.prev, s.sigmas, s.idx, old_log_prob=s.old_lp, advantages=s.adv,
                            kl_threshold=threshold,
                            old_prev_sample_mean=s.old_mean, backend=backend)
    torch.testing.assert_close(ours.trust_divergence, metrics["kl_per_sample"], rtol=1e-4, atol=1e-9)
    assert float(metrics["masked_fraction"]) > 0
    assert torch.equal(ours.masked_fraction, metrics["masked_fraction"])
    torch.testing.assert_close(ours.loss, loss, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_kl_matches_verl_omni_distill_kl(backend):
    s = _setup([1, 4, 8])
    loss, kl = L.teacher_kl_loss(s.x, s.v_new, s.v_ref, s.sigmas, s.idx, backend=backend)
    _, peer_kl = peer_verl_distill_kl(s.mean, s.mean_ref, s.std_dev_t)
    d = s.sqrt_dt.flatten() ** 2  # verl-omni divides by s^2, the exact KL by s^2 D
    torch.testing.assert_close(kl * d, peer_kl, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(loss, kl.mean())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nft_loss_matches_diffusion_nft(backend):
    g = torch.Generator().manual_seed(5)
    x0, noise, v_old = (torch.randn(SHAPE, generator=g) for _ in range(3))
    v_new = v_old + 0.2 * torch.randn(SHAPE, generator=g)
    v_ref = v_old + 0.1 * torch.randn(SHAPE, generator=g)
    t = torch.tensor([0.25, 0.6, 0.95])
    te = t.view(-1, 1, 1, 1)
    xt = (1 - te) * x0 + te * noise
    adv = torch.tensor([3.0, -0.4, 1.1])  # one beyond adv_clip_max
    ours, g_ours = _grad_of(lambda vv: L.nft_loss(xt, vv, v_old, x0, t, advantages=adv, beta=0.1, adv_clip_max=2.0,
                                                  kl_coef=0.1,
                                                  ref_model_output=v_ref, backend=backend), v_new)
    (loss, policy, per_sample, kl), g_peer = _grad_of(
        lambda vv: peer_nft(vv, v_old, v_ref, x0, xt, t, adv, 0.1, 2.0), v_new)
    torch.testing.assert_close(ours.loss, loss.float(), **TOL)
    # the peer's ``loss += ...`` adds the KL in place into the tensor it also returns as policy_loss
    assert policy is loss
    torch.testing.assert_close(ours.policy_loss, (loss - 0.1 * kl.mean()).float(), **TOL)
    torch.testing.assert_close(ours.per_sample_loss, per_sample.float(), **TOL)
    torch.testing.assert_close(ours.kl, kl, **TOL)
    torch.testing.assert_close(g_ours, g_peer.float(), rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighting", L.AWM_WEIGHTINGS)
def test_awm_matches_flow_factory(backend, weighting):
    g = torch.Generator().manual_seed(6)
    x0, noise, v = (torch.randn(SHAPE, generator=g) for _ in range(3))
    v_new = v + 0.05 * torch.randn(SHAPE, generator=g)
    t = torch.tensor([0.25, 0.6, 0.95])
    adv = torch.tensor([1.0, -0.5, 0.3])
    peer_weighting = "Uniform" if weighting == "uniform" else weighting
    old_lp = peer_awm_log_prob(v, noise - x0, t, peer_weighting)
    ours_old = L.awm_log_prob(v, noise, x0, t, weighting=weighting, backend=backend)
    torch.testing.assert_close(ours_old, old_lp, rtol=4 * 2.0**-24, atol=0)  # float64-reduction accuracy
    ours, g_ours = _grad_of(lambda vv: L.awm_loss(vv, noise, x0, t, old_log_prob=old_lp, advantages=adv,
                                                  clip_range=(0.01, 0.02),
                                                  weighting=weighting, backend=backend), v_new)
    (loss, ratio), g_peer = _grad_of(
        lambda vv: peer_awm_loss(peer_awm_log_prob(vv, noise - x0, t, peer_weighting), old_lp, adv, (-0.01, 0.02)),
        v_new)
    torch.testing.assert_close(ours.ratio, ratio, **TOL)
    torch.testing.assert_close(ours.loss, loss, **TOL)
    torch.testing.assert_close(g_ours, g_peer, rtol=1e-4, atol=1e-4 * float(g_peer.abs().max()))
