"""The peers' eager loss code, transcribed operation for operation as the oracle of flowrl.losses
(tests/losses/test_losses_peers.py; tests/compat/test_verl_omni.py and tests/ops/test_joint_weights.py reuse
them; not imported: the peers are not dependencies):

- Flow-GRPO: yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd, scripts/train_sd3.py
  lines 881-927 (the training loss block; its log-prob recompute is tests/peer_steps.peer_flow_grpo).
- verl-omni: verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/trainer/diffusion/diffusion_algos.py: FlowGRPOLoss, FlowDPPOLoss, GRPOGuardLoss,
  DistillKLLoss (``compute_loss``).
- Flow-Factory: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/trainers/grpo.py (GRPOGuardTrainer.optimize, lines 497-510: the guard ratio and the
  asymmetric clip range) and src/flow_factory/trainers/awm.py (``compute_weighted_log_prob``, lines
  284-330, and the clipped loss, lines 496-502).
- DiffusionNFT: NVlabs/DiffusionNFT @ 24af5554898d85e93efa492f42b5e9cdf4156e9b, scripts/train_nft_sd3.py
  lines 909-971 (policy loss and KL).
"""
from types import SimpleNamespace

import torch

from peer_steps import diffusers_scheduler, gen, peer_flow_grpo

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
