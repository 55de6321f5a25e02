"""flowrl.losses against the peers' eager loss code, transcribed operation for operation in
tests/peer_losses.py as the oracle (not imported: the peers are not dependencies), on identical inputs, on
both backends:

Flow-GRPO, verl-omni, Flow-Factory and DiffusionNFT, each at the commit and lines tests/peer_losses.py cites.

Where flowrl differs from a peer by design the test states the exact relation: Flow-GRPO's and
verl-omni's KLs divide by s^2 (``std_dev_t``), not the variance s^2 D (flowrl's exact KL x D = theirs);
GRPO-Guard's 1/D is verl-omni's, Flow-Factory leaves it out (flowrl's policy loss x D = Flow-Factory's).
"""
import os
import sys

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl import losses as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peer_losses import (SHAPE, TOL, _cfg, _setup, peer_awm_log_prob, peer_awm_loss,  # noqa: E402
                         peer_flow_factory_guard, peer_flow_grpo_block, peer_nft, peer_verl_distill_kl,
                         peer_verl_flow_dppo, peer_verl_flow_grpo, peer_verl_grpo_guard)
from peer_steps import peer_flow_grpo  # noqa: E402

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or _dispatch.interpreter_enabled()), reason="needs CUDA or TRITON_INTERPRET=1")),
]


# --------------------------------------------------------------------------------------- fixtures
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
