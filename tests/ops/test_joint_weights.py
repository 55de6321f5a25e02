"""Weighted joint streams and a schedule per stream (docs/contract.md, Joint steps; docs/losses.md, Joint
steps), on both backends (Triton through the interpreter).

The peer: verl-omni's MiniMax-H3 FlowGRPO recipe (verl-project/verl-omni pull request 368, commit
2fbde835690680c122b5e14d953f0e5ecfe680b5, verl_omni/pipelines/minimax_h3_flow_grpo/common.py):
``combine_log_probs`` returns ``video_weight * video_log_prob + audio_weight * audio_log_prob`` of the
two modalities' mean log densities with ``H3_VIDEO_LOG_PROB_WEIGHT = H3_AUDIO_LOG_PROB_WEIGHT = 0.5``,
and ``h3_sigma_schedules`` gives the video and the audio their own time-shifted schedules
(``H3_VIDEO_SHIFT = 12.0``, ``H3_AUDIO_SHIFT = 3.0``). The float64 oracle below is that formula on
per-element Gaussian log densities (flowrl/oracle, written from the contract).
"""
import copy
import math
import json

import pytest
import torch

import flowrl
from flowrl.losses import flow_dppo_loss, grpo_guard_loss, grpo_loss
from flowrl.rollout.recorder import rollout
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler as Sched

from flowrl import oracle

BACKENDS = ["torch", "triton"]
F64 = torch.float64
H3 = (0.5, 0.5)  # verl-omni's MiniMax-H3 weights (video, audio)


def _schedule(shift, steps=6):
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=F64)
    return torch.cat([shift * t / (1 + (shift - 1) * t), torch.zeros(1, dtype=F64)]).to(torch.float32)


VIDEO_SIGMAS, AUDIO_SIGMAS = _schedule(12.0), _schedule(3.0)


def _streams(seed=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    video = [torch.randn(3, 4, 5, 6, generator=g).to(dtype) for _ in range(3)]
    audio = [torch.randn(3, 7, 8, generator=g).to(dtype) for _ in range(3)]
    return video, audio  # each: x, v, v_ref


def _oracle_mean_log_density(x, v, prev, sigmas, i, eta):
    """float64 [B]: the mean over elements of log N(x'; mu, std^2) of an sde step (flowrl/oracle)."""
    return oracle.log_prob(x, v, prev, sigmas, i, "sde", eta, reduction="mean")


# ------------------------------------------------------------------------------------ the combination


@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_combination_is_the_weighted_per_stream_means(backend):
    """combine_streams(weights=) of per-stream sums and counts is sum_k w_k (sum_k / count_k) (mean) or
    sum_k w_k sum_k (sum); step_log_prob on tuples with stream_weights gives it bit for bit, and it
    matches a float64 oracle of verl-omni's 0.5 * mean_video + 0.5 * mean_audio."""
    (xv, vv, _), (xa, va, _) = _streams()
    ov = flowrl.sde_step(xv, vv, VIDEO_SIGMAS, 2, noise_seed=5, reduction="sum", backend=backend)
    oa = flowrl.sde_step(xa, va, AUDIO_SIGMAS, 2, noise_seed=6, reduction="sum", backend=backend)
    args = ((xv, xa), (vv, va), (ov.prev_sample, oa.prev_sample), (VIDEO_SIGMAS, AUDIO_SIGMAS), 2)
    for weights in (H3, (0.25, 2.0)):
        for reduction in ("mean", "sum"):
            rollout_value = flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], reduction, weights)
            joint = flowrl.step_log_prob(*args, reduction=reduction, stream_weights=weights, backend=backend)
            assert torch.equal(joint, rollout_value)
            means = [_oracle_mean_log_density(xv, vv, ov.prev_sample, VIDEO_SIGMAS, 2, 0.7),
                     _oracle_mean_log_density(xa, va, oa.prev_sample, AUDIO_SIGMAS, 2, 0.7)]
            numel = [xv[0].numel(), xa[0].numel()]
            if reduction == "mean":
                want = weights[0] * means[0] + weights[1] * means[1]
            else:
                want = weights[0] * means[0] * numel[0] + weights[1] * means[1] * numel[1]
            torch.testing.assert_close(joint.double(), want, rtol=2e-5, atol=2e-5)
    # unweighted stays the element-count weighting, and differs from the 0.5 / 0.5 one here (unequal sizes)
    plain = flowrl.step_log_prob(*args, backend=backend)
    assert torch.equal(plain, flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], "mean"))
    assert not torch.allclose(plain, flowrl.step_log_prob(*args, stream_weights=H3, backend=backend))
    kl = flowrl.step_kl((xv, xa), (vv, va), (vv * 1.1, va * 0.9), (VIDEO_SIGMAS, AUDIO_SIGMAS), 2, stream_weights=H3,
                        backend=backend)
    kls = [flowrl.step_kl(x, v, r, s, 2, backend=backend) for x, v, r, s in
           ((xv, vv, vv * 1.1, VIDEO_SIGMAS), (xa, va, va * 0.9, AUDIO_SIGMAS))]
    torch.testing.assert_close(kl, 0.5 * kls[0] + 0.5 * kls[1], rtol=1e-6, atol=1e-7)


def test_a_stream_with_nothing_scored_adds_zero():
    s = [torch.tensor([2.0, 4.0]), torch.tensor([3.0, 3.0])]
    c = [torch.tensor([2.0, 0.0]), torch.tensor([3.0, 3.0])]
    got = flowrl.combine_streams(s, c, "mean", (0.5, 0.5))
    assert torch.equal(got, torch.tensor([1.0, 0.5]))


# ------------------------------------------------------------------ rollout, schedules, recompute, wire


def _joint_loop(sched, video, audio, audio_shift, steps=5):
    """MiniMax-H3's shape through LTX-2's: copy the scheduler inside the rollout, give the copy its own shift,
    set both schedules, step video then audio on each one's own timesteps."""
    audio_sched = copy.deepcopy(sched)
    audio_sched.set_shift(audio_shift)
    sched.set_timesteps(steps)
    audio_sched.set_timesteps(steps)
    outs = []
    for tv, ta in zip(sched.timesteps, audio_sched.timesteps):
        v = (torch.sin(3 * video) + tv / 1000).to(video.dtype)
        a = (torch.cos(2 * audio) + ta / 1000).to(audio.dtype)
        outs.append((v, a))
        video = sched.step(v, tv, video, return_dict=False)[0]
        audio = audio_sched.step(a, ta, audio, return_dict=False)[0]
    return outs, audio_sched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make", [lambda: Sched(shift=12.0),
                                  lambda: pytest.importorskip("diffusers").FlowMatchEulerDiscreteScheduler(shift=12.0)],
                         ids=["flowrl", "diffusers"])
def test_weighted_joint_rollout_with_a_shift_per_stream_recomputes_exactly(backend, make, tmp_path):
    """The copy's own shift is its stream's schedule: each stream records its own sigmas (not the
    video's), the joint log-prob is the weighted combination, and the recompute from step_inputs (which
    passes each stream's sigmas and the weights) and grpo_loss on tuples give ratio exactly 1; the weights
    survive to_wire / from_wire and save / load, and an unweighted payload has no key for them."""
    sched = make()
    video, audio = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0)), torch.randn(2, 5, 3)
    gens = [torch.Generator().manual_seed(s) for s in (7, 8)]
    with rollout(sched, stream_weights=H3, generator=gens, backend=backend) as rec:
        outs, audio_sched = _joint_loop(sched, video, audio, audio_shift=3.0)
    traj = rec.trajectory()
    assert traj.stream_weights == H3 and traj.num_streams == 2
    assert torch.equal(traj.streams[0].sigmas, sched.sigmas.float())
    assert torch.equal(traj.streams[1].sigmas, audio_sched.sigmas.float())
    assert not torch.equal(traj.streams[0].sigmas, traj.streams[1].sigmas)  # shifts 12 and 3
    for j, (v, a) in enumerate(outs):
        inputs = traj.step_inputs(j)
        assert inputs["stream_weights"] == H3 and inputs["sigmas"][1] is traj.streams[1].sigmas
        lp = flowrl.step_log_prob(model_output=(v, a), backend=backend, **inputs)
        assert torch.equal(lp, traj.log_probs[:, j]), j
        sums = [s.log_probs[:, j] for s in traj.streams]
        counts = [s.counts[:, j] for s in traj.streams]
        assert torch.equal(traj.log_probs[:, j], flowrl.combine_streams(sums, counts, "mean", H3))
        out = grpo_loss(inputs["sample"], (v, a), inputs["prev_sample"], inputs["sigmas"], j,
                        old_log_prob=traj.log_probs[:, j],
                        advantages=torch.tensor([1.0, -1.0]), clip_range=0.2, stream_weights=H3, backend=backend)
        assert torch.equal(out.ratio, torch.ones(2)) and torch.equal(out.log_prob, lp)
    # the wire format and the file keep the weights; each stream's schedule comes back
    for back in (flowrl.RolloutTrajectory.from_wire(json.loads(json.dumps(traj.to_wire()))),
                 (traj.save(tmp_path / "t.safetensors"), flowrl.RolloutTrajectory.load(tmp_path / "t.safetensors"))[1]):
        assert back.stream_weights == H3
        assert torch.equal(back.streams[1].sigmas, traj.streams[1].sigmas)
        v, a = outs[1]
        assert torch.equal(flowrl.step_log_prob(model_output=(v, a), backend=backend, **back.step_inputs(1)),
                           traj.log_probs[:, 1])
    unweighted = flowrl.RolloutTrajectory.from_wire({k: w for k, w in traj.to_wire().items() if k != "stream_weights"})
    assert unweighted.stream_weights is None and "stream_weights" not in unweighted.to_wire()
    assert "stream_weights" not in unweighted.step_inputs(0)


def test_the_recorder_refuses_weights_for_another_stream_count():
    sched = Sched(shift=12.0)
    with rollout(sched, stream_weights=(0.5, 0.3, 0.2)) as rec:
        _joint_loop(sched, torch.randn(2, 6, 4), torch.randn(2, 5, 3), audio_shift=3.0)
    with pytest.raises(ValueError, match="stream_weights has 3 weights but the rollout recorded 2"):
        rec.trajectory()


# ------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", [None, H3])
def test_losses_on_tuples_are_the_combination_of_the_streams(backend, weights):
    """grpo_loss / flow_dppo_loss on tuples: log-prob and KL equal step_log_prob / step_kl on the tuples
    (bit for bit), the loss equals the single-stream formula on those values (the GRPO surrogate written
    out here), and gradients reach both streams' model outputs, equal to autograd through step_log_prob."""
    (xv, vv, rv), (xa, va, ra) = _streams(seed=4)
    ov = flowrl.sde_step(xv, vv, VIDEO_SIGMAS, 1, noise_seed=1, reduction="sum", backend=backend)
    oa = flowrl.sde_step(xa, va, AUDIO_SIGMAS, 1, noise_seed=2, reduction="sum", backend=backend)
    prev, sig = (ov.prev_sample, oa.prev_sample), (VIDEO_SIGMAS, AUDIO_SIGMAS)
    old = flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], "mean", weights) - 0.05
    adv = torch.tensor([1.0, -0.5, 2.0])
    vg, ag = vv.clone().requires_grad_(), va.clone().requires_grad_()
    out = grpo_loss((xv, xa), (vg, ag), prev, sig, 1, old_log_prob=old, advantages=adv, clip_range=0.2, kl_coef=0.3,
                    ref_model_output=(rv, ra), stream_weights=weights, backend=backend)
    out.loss.backward()
    vr, ar = vv.clone().requires_grad_(), va.clone().requires_grad_()
    lp = flowrl.step_log_prob((xv, xa), (vr, ar), prev, sig, 1, stream_weights=weights, backend=backend)
    kl = flowrl.step_kl((xv, xa), (vr, ar), (rv, ra), sig, 1, stream_weights=weights, backend=backend)
    assert torch.equal(out.log_prob, lp.detach()) and torch.equal(out.kl, kl.detach())
    ratio = torch.exp(lp - old)
    want = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean() + 0.3 * kl.mean()
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-6, atol=1e-7)
    want.backward()
    for got, ref in ((vg.grad, vr.grad), (ag.grad, ar.grad)):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    dppo = flow_dppo_loss((xv, xa), (vv, va), prev, sig, 1, old_log_prob=old, advantages=adv, kl_threshold=0.01,
                          noise_seed=(1, 2),
                          stream_weights=weights, backend=backend)
    assert torch.equal(dppo.log_prob, lp.detach())
    assert dppo.trust_divergence.abs().max() < 1e-6  # mu_old replayed from the rollout's own noise: D_s ~ 0


def peer_h3_guard(streams, old_log_prob, advantages, clip, log_prob_weights):
    """verl-omni's MiniMax-H3 FlowGRPO adapter (verl-project/verl-omni commit
    066a6cca4ae41f7e9e005e3359d2d730933a5ee7, verl_omni/pipelines/minimax_h3_flow_grpo/
    diffusers_training_adapter.py, ``forward_and_sample_previous_step``: the joint log-prob, the flattened
    joint mean, ``effective_std`` and ``effective_sqrt_dt``) feeding ``GRPOGuardLoss.compute_loss``
    (tests/peer_losses.peer_verl_grpo_guard). ``streams``: per stream (log_prob [B] its mean log
    density, mean [B, ...], old_mean [B, ...], std_dev_t (their sigma_t, std / sqrt_dt), sqrt_dt)."""
    from peer_losses import _cfg, peer_verl_grpo_guard

    (lp_v, mean_v, old_v, std_v, sdt_v), (lp_a, mean_a, old_a, std_a, sdt_a) = streams
    batch = mean_v.shape[0]
    video_weight, audio_weight = mean_v[0].numel(), mean_a[0].numel()
    total_weight = video_weight + audio_weight
    log_prob = log_prob_weights[0] * lp_v + log_prob_weights[1] * lp_a  # combine_log_probs
    mean = torch.cat([mean_v.flatten(1), mean_a.flatten(1)], dim=1).unsqueeze(1)  # flatten_joint_latents
    old_mean = torch.cat([old_v.flatten(1), old_a.flatten(1)], dim=1).unsqueeze(1)
    video_std, audio_std = std_v.reshape(-1).mean(), std_a.reshape(-1).mean()
    effective_std = torch.sqrt((video_weight * video_std.square() + audio_weight * audio_std.square()) / total_weight)
    effective_std = effective_std.reshape(1, 1, 1).expand(batch, -1, -1)
    video_dt, audio_dt = sdt_v.reshape(-1).mean().square(), sdt_a.reshape(-1).mean().square()
    effective_sqrt_dt = torch.sqrt((video_weight * video_dt + audio_weight * audio_dt) / total_weight).expand(batch)
    return peer_verl_grpo_guard(old_log_prob, log_prob, advantages, _cfg(adv_clip_max=1e9, clip_ratio=clip),
                                old_mean, mean, effective_std, effective_sqrt_dt)


@pytest.mark.parametrize("weights", [None, H3])
def test_joint_grpo_guard_matches_verl_omni_h3(weights):
    """grpo_guard_loss on tuples (float64, torch backend) against verl-omni's H3 adapter + GRPOGuardLoss
    on per-stream float64 oracle values (flowrl/oracle): the video and the audio on their own schedules
    (shifts 12 and 3), the log-prob weighted by stream_weights (verl-omni: 0.5 / 0.5; None: the element
    count, verl-omni's earlier commit), std, dt and the mean drift averaged by element count."""
    (xv, vv, rv), (xa, va, ra) = [[t.double() for t in stream] for stream in _streams(seed=6)]
    step, eta, clip = 2, 0.7, 0.05
    sig = (VIDEO_SIGMAS, AUDIO_SIGMAS)
    g = torch.Generator().manual_seed(11)
    old_v = oracle.mean(xv, rv, VIDEO_SIGMAS, step, "sde", eta)  # the rollout's policy: the reference's output
    old_a = oracle.mean(xa, ra, AUDIO_SIGMAS, step, "sde", eta)
    std_v = oracle.std(VIDEO_SIGMAS, step, "sde", eta, 3).view(-1, 1, 1, 1)
    std_a = oracle.std(AUDIO_SIGMAS, step, "sde", eta, 3).view(-1, 1, 1)
    prev = (old_v + std_v * torch.randn(xv.shape, generator=g, dtype=F64),
            old_a + std_a * torch.randn(xa.shape, generator=g, dtype=F64))
    adv = torch.tensor([1.0, -0.7, 0.4], dtype=F64)

    def ours(video, audio):
        return grpo_guard_loss((xv, xa), (video, audio), prev, sig, step, old_log_prob=old_lp, advantages=adv,
                               clip_range=clip,
                               old_prev_sample_mean=(old_v, old_a), noise_level=eta, stream_weights=weights,
                               backend="torch")

    def peer(video, audio):
        streams = []
        for x, v, p, s, old, sd in ((xv, video, prev[0], VIDEO_SIGMAS, old_v, std_v),
                                    (xa, audio, prev[1], AUDIO_SIGMAS, old_a, std_a)):
            sqrt_dt = torch.full((3,), math.sqrt(float(s[step].double() - s[step + 1].double())), dtype=F64)
            streams.append((oracle.log_prob(x, v, p, s, step, "sde", eta, reduction="mean"),
                            oracle.mean(x, v, s, step, "sde", eta), old, sd / sqrt_dt.view(sd.shape), sqrt_dt))
        if weights is None:  # element-count weights of the two mean log densities
            n_v, n_a = xv[0].numel(), xa[0].numel()
            lw = (n_v / (n_v + n_a), n_a / (n_v + n_a))
        else:
            lw = weights
        return peer_h3_guard(streams, old_lp, adv, clip, lw)

    old_lp = torch.zeros(3, dtype=F64)
    old_lp = ours(rv, ra).log_prob + torch.tensor([0.3, -0.2, 0.0], dtype=F64)  # the rollout's, shifted
    v1, a1 = (rv + 0.05 * vv).requires_grad_(), (ra - 0.05 * va).requires_grad_()  # a policy update
    out = ours(v1, a1)
    out.loss.backward()
    v2, a2 = (rv + 0.05 * vv).requires_grad_(), (ra - 0.05 * va).requires_grad_()
    loss, metrics = peer(v2, a2)
    loss.backward()
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.trust_divergence, metrics["ratio_mean_bias"].detach(), **tol)
    torch.testing.assert_close(out.ratio, metrics["ratio"].detach(), **tol)
    torch.testing.assert_close(out.loss, loss.detach(), **tol)
    assert torch.equal(out.clip_fraction, metrics["pg_clipfrac"])
    assert 0 < float(out.clip_fraction) < 1 and float(out.trust_divergence.min()) > 0
    for got, want in ((v1.grad, v2.grad), (a1.grad, a2.grad)):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))
    # one stream alone is grpo_guard_loss on that stream (scale = std, loss / D)
    single = grpo_guard_loss((xv,), (vv,), prev[:1], VIDEO_SIGMAS, step, old_log_prob=old_lp, advantages=adv,
                             clip_range=clip,
                             old_prev_sample_mean=(old_v,), noise_level=eta, backend="torch")
    plain = grpo_guard_loss(xv, vv, prev[0], VIDEO_SIGMAS, step, old_log_prob=old_lp, advantages=adv, clip_range=clip,
                            old_prev_sample_mean=old_v, noise_level=eta, backend="torch")
    for field in ("loss", "log_prob", "trust_divergence", "ratio"):
        torch.testing.assert_close(getattr(single, field), getattr(plain, field), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("weights", [None, H3])
def test_joint_grpo_guard_triton_matches_torch_and_replays(weights):
    """float32: the Triton backend (interpreter) against the torch backend, mu_old given and replayed from
    the rollout's noise seeds (D_s ~ 0 at the rollout's own policy), with a KL term; gradients too."""
    (xv, vv, rv), (xa, va, ra) = _streams(seed=8)
    ov = flowrl.sde_step(xv, vv, VIDEO_SIGMAS, 1, noise_seed=3, reduction="sum", backend="torch")
    oa = flowrl.sde_step(xa, va, AUDIO_SIGMAS, 1, noise_seed=4, reduction="sum", backend="torch")
    prev, sig = (ov.prev_sample, oa.prev_sample), (VIDEO_SIGMAS, AUDIO_SIGMAS)
    old = flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], "mean", weights)
    adv = torch.tensor([1.0, -0.5, 2.0])
    outs, grads = {}, {}
    for backend in BACKENDS:
        for source, kw in (("given", dict(old_prev_sample_mean=(ov.prev_sample_mean, oa.prev_sample_mean))),
                           ("replay", dict(noise_seed=(3, 4)))):
            v, a = (vv * 1.01).requires_grad_(), (va * 0.99).requires_grad_()
            out = grpo_guard_loss((xv, xa), (v, a), prev, sig, 1, old_log_prob=old, advantages=adv, clip_range=0.2,
                                  kl_coef=0.1,
                                  ref_model_output=(rv, ra), stream_weights=weights, backend=backend, **kw)
            out.loss.backward()
            outs[backend, source], grads[backend, source] = out, (v.grad, a.grad)
        at_old = grpo_guard_loss((xv, xa), (vv, va), prev, sig, 1, old_log_prob=old, advantages=adv, clip_range=0.2,
                                 noise_seed=(3, 4),
                                 stream_weights=weights, backend=backend)
        assert at_old.trust_divergence.abs().max() < 1e-9 and torch.allclose(at_old.ratio, torch.ones(3), atol=1e-6)
    for source in ("given", "replay"):
        t, r = outs["triton", source], outs["torch", source]
        for field in ("loss", "log_prob", "kl", "trust_divergence", "ratio"):
            torch.testing.assert_close(getattr(t, field), getattr(r, field), rtol=2e-5, atol=2e-6)
        for got, want in zip(grads["triton", source], grads["torch", source]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(outs["torch", "replay"].trust_divergence, outs["torch", "given"].trust_divergence,
                               rtol=1e-3, atol=1e-9)


# ----------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("weights, exc, needle", [
    ((0.5,), ValueError, "one weight per stream"),
    ((0.5, 0.5, 0.5), ValueError, "one weight per stream"),
    ((0.5, -0.1), ValueError, r"stream_weights\[1\] must be finite and >= 0"),
    ((float("nan"), 1.0), ValueError, r"stream_weights\[0\] must be finite"),
    ((float("inf"), 1.0), ValueError, r"stream_weights\[0\] must be finite"),
    ((0.0, 0.0), ValueError, "stream_weights must have a weight > 0"),
    ((True, 1.0), TypeError, r"stream_weights\[0\] must be a real number"),
    (torch.tensor([0.5, 0.5]), TypeError, "stream_weights must be None or a tuple"),
    (0.5, TypeError, "stream_weights must be None or a tuple"),
])
def test_bad_weights_name_the_argument(weights, exc, needle):
    (xv, vv, _), (xa, va, _) = _streams()
    args = ((xv, xa), (vv, va), (xv, xa), (VIDEO_SIGMAS, AUDIO_SIGMAS), 1)
    with pytest.raises(exc, match=needle):
        flowrl.step_log_prob(*args, stream_weights=weights, backend="torch")
    with pytest.raises(exc, match=needle):
        flowrl.step_kl(*args, stream_weights=weights, backend="torch")
    with pytest.raises(exc, match=needle):
        grpo_loss(*args, old_log_prob=torch.zeros(3), advantages=torch.zeros(3), clip_range=0.2, stream_weights=weights,
                  backend="torch")
    with pytest.raises(exc, match=needle.replace("stream_weights", "weights")):
        flowrl.combine_streams([torch.zeros(3)] * 2, [torch.ones(3)] * 2, "mean", weights)
    if not isinstance(weights, (float, torch.Tensor)) and len(weights) == 2:
        with pytest.raises(exc, match=needle):
            rollout(Sched(), stream_weights=weights)


def test_bad_joint_arguments_name_themselves():
    (xv, vv, _), (xa, va, _) = _streams()
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        flowrl.step_log_prob(xv, vv, xv, VIDEO_SIGMAS, 1, stream_weights=H3)
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        grpo_loss(xv, vv, xv, VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2, stream_weights=H3)
    with pytest.raises(TypeError, match="prev_sample"):
        grpo_loss((xv, xa), (vv, va), xv, VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2)
    with pytest.raises(ValueError, match="ref_model_output"):
        grpo_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2,
                  kl_coef=0.1,
                  ref_model_output=(vv,))
    with pytest.raises(ValueError, match="sigmas"):
        grpo_loss((xv, xa), (vv, va), (xv, xa), (VIDEO_SIGMAS,), 1, old_log_prob=z, advantages=z, clip_range=0.2)
    with pytest.raises(ValueError, match="shard: a joint step"):
        grpo_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2,
                  shard=object())
    with pytest.raises(ValueError, match="shard: a joint step"):
        grpo_guard_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2,
                        noise_seed=1,
                        shard=object())
    with pytest.raises(ValueError, match="old_prev_sample_mean must be a tuple of 2"):
        grpo_guard_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2,
                        old_prev_sample_mean=(xv,))
    with pytest.raises(ValueError, match="pass exactly one of old_prev_sample_mean"):
        grpo_guard_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2)
    with pytest.raises(ValueError, match="noise_seed must have one entry per stream"):
        grpo_guard_loss((xv, xa), (vv, va), (xv, xa), VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2,
                        noise_seed=(1, 2, 3))
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        grpo_guard_loss(xv, vv, xv, VIDEO_SIGMAS, 1, old_log_prob=z, advantages=z, clip_range=0.2, noise_seed=1,
                        stream_weights=H3)


def test_bad_wire_weights_are_refused(tmp_path):
    sched = Sched(shift=12.0)
    with rollout(sched, stream_weights=H3) as rec:
        _joint_loop(sched, torch.randn(2, 6, 4), torch.randn(2, 5, 3), audio_shift=3.0)
    wire = rec.trajectory().to_wire()
    for bad, needle in (([0.5], "one weight per stream"), ([0.5, -1.0], "finite and >= 0"), ("0.5", "list of numbers"),
                        ([0.5, None], "real number")):
        with pytest.raises(ValueError, match=needle):
            flowrl.RolloutTrajectory.from_wire(dict(wire, stream_weights=bad))
    single = flowrl.RolloutTrajectory.from_wire(wire).streams[0].to_wire()
    with pytest.raises(ValueError, match="no streams"):
        flowrl.RolloutTrajectory.from_wire(dict(single, stream_weights=[1.0]))
    nested = dict(wire, streams=[dict(s, stream_weights=[1.0]) for s in wire["streams"]])
    with pytest.raises(ValueError, match="unexpected keys"):
        flowrl.RolloutTrajectory.from_wire(nested)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", [None, H3])
def test_teacher_kl_loss_on_tuples_is_step_kl(backend, weights):
    """teacher_kl_loss on a joint step: the per-sample KL is step_kl on the tuples bit for bit (a float64
    oracle of the weighted per-stream means checks the value), its gradient autograd through step_kl."""
    (xv, vv, rv), (xa, va, ra) = _streams(seed=9)
    sig = (VIDEO_SIGMAS, AUDIO_SIGMAS)
    v, a = vv.clone().requires_grad_(), va.clone().requires_grad_()
    loss, kl = flowrl.losses.teacher_kl_loss((xv, xa), (v, a), (rv, ra), sig, 2, stream_weights=weights,
                                             backend=backend)
    loss.backward()
    v2, a2 = vv.clone().requires_grad_(), va.clone().requires_grad_()
    want = flowrl.step_kl((xv, xa), (v2, a2), (rv, ra), sig, 2, stream_weights=weights, backend=backend)
    want.mean().backward()
    assert torch.equal(kl, want.detach()) and torch.equal(loss.detach(), want.mean().detach())
    assert torch.equal(v.grad, v2.grad) and torch.equal(a.grad, a2.grad) and v.grad.abs().sum() > 0
    kv = oracle.kl(xv.double(), vv.double(), rv.double(), VIDEO_SIGMAS, 2, "sde", 0.7)
    ka = oracle.kl(xa.double(), va.double(), ra.double(), AUDIO_SIGMAS, 2, "sde", 0.7)
    n_v, n_a = xv[0].numel(), xa[0].numel()
    w = (n_v / (n_v + n_a), n_a / (n_v + n_a)) if weights is None else weights
    torch.testing.assert_close(kl.double(), w[0] * kv + w[1] * ka, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"teacher_model_output\[1\] requires grad"):
        flowrl.losses.teacher_kl_loss((xv, xa), (vv, va), (rv, ra.clone().requires_grad_()), sig, 2, backend=backend)
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        flowrl.losses.teacher_kl_loss(xv, vv, rv, VIDEO_SIGMAS, 2, stream_weights=H3, backend=backend)


# -------------------------------------------------------------------- forward-process losses on tuples


def _count_weights(tensors, weights):
    n = [t[0].numel() for t in tensors]
    return [k / sum(n) for k in n] if weights is None else list(weights)


def _flow_streams(seed, dtype=F64):
    """Per stream (x_t, v, v_old, x0, v_ref, eps) of a video [3, 4, 5, 6] and an audio [3, 7, 8] latent."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((3, 4, 5, 6), (3, 7, 8)):
        x0, eps = torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
        v_old = (eps - x0) + 0.3 * torch.randn(shape, generator=g, dtype=F64)
        v = v_old + 0.05 * torch.randn(shape, generator=g, dtype=F64)
        v_ref = v_old + 0.05 * torch.randn(shape, generator=g, dtype=F64)
        t = torch.tensor([0.3, 0.6, 0.9], dtype=F64).view(-1, *[1] * (len(shape) - 1))
        out.append([u.to(dtype) for u in ((1 - t) * x0 + t * eps, v, v_old, x0, v_ref, eps)])
    return out


def _nft_oracle(streams, ts, adv, beta, amax, kl_coef, w):
    """float64 DiffusionNFT (docs/losses.md, nft_loss) with every per-sample mean the streams' weighted
    means: sum_k w_k mean_k(.) (w_k the element-count share for stream_weights=None)."""
    def mean(f):
        return sum(wk * f(k).flatten(1).mean(1) for k, wk in enumerate(w))

    def err(k, sign):
        xt, v, v_old, x0 = streams[k][:4]
        t = ts[k].view(-1, *[1] * (xt.ndim - 1))
        pred = beta * v + (1 - beta) * v_old if sign > 0 else (1 + beta) * v_old - beta * v
        return (xt - t * pred) - x0

    pos_w = mean(lambda k: err(k, 1).abs()).detach().clamp(min=1e-5)
    neg_w = mean(lambda k: err(k, -1).abs()).detach().clamp(min=1e-5)
    r = torch.clamp((adv.clamp(-amax, amax) / amax) / 2 + 0.5, 0, 1)
    per = r * mean(lambda k: err(k, 1) ** 2) / pos_w / beta + (1 - r) * mean(lambda k: err(k, -1) ** 2) / neg_w / beta
    kl = mean(lambda k: (streams[k][1] - streams[k][4]) ** 2)
    return (per * amax).mean() + kl_coef * kl.mean(), per


@pytest.mark.parametrize("weights", [None, H3])
def test_nft_loss_on_tuples_matches_the_weighted_oracle(weights):
    """nft_loss on a joint step (float64, torch backend): each per-sample mean is the streams' weighted
    mean (None: element counts), against the float64 oracle, loss, per-sample loss and gradients; a
    sigma per stream; with None it is nft_loss on the packed streams (verl-omni's MiniMax-H3 NFT packs the
    video and audio rows into one tensor)."""
    streams = _flow_streams(5)
    adv = torch.tensor([1.5, -0.4, 0.2], dtype=F64)
    ts = (torch.tensor([0.3, 0.6, 0.9], dtype=F64), torch.tensor([0.2, 0.5, 0.8], dtype=F64))
    w = _count_weights([s[0] for s in streams], weights)
    v = [s[1].clone().requires_grad_() for s in streams]
    out = flowrl.losses.nft_loss(tuple(s[0] for s in streams), tuple(v), tuple(s[2] for s in streams),
                                 tuple(s[3] for s in streams), ts, advantages=adv, beta=0.1, adv_clip_max=1.0, kl_coef=0.2,
                                 ref_model_output=tuple(s[4] for s in streams), stream_weights=weights,
                                 backend="torch")
    out.loss.backward()
    v2 = [s[1].clone().requires_grad_() for s in streams]
    oracle_streams = [[s[0], v2[k], *s[2:]] for k, s in enumerate(streams)]
    loss, per = _nft_oracle(oracle_streams, ts, adv, 0.1, 1.0, 0.2, w)
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.per_sample_loss, per.detach(), rtol=1e-12, atol=1e-14)
    for got, want in zip((v[0].grad, v[1].grad), (v2[0].grad, v2[1].grad)):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    if weights is None:  # one shared sigma: the packed tensors, within float64 rounding
        packed = [torch.cat([s[j].flatten(1) for s in streams], 1) for j in range(5)]
        shared = flowrl.losses.nft_loss(tuple(s[0] for s in streams), tuple(s[1] for s in streams),
                                        tuple(s[2] for s in streams), tuple(s[3] for s in streams), ts[0], advantages=adv,
                                        beta=0.1, adv_clip_max=1.0, backend="torch")
        one = flowrl.losses.nft_loss(packed[0], packed[1], packed[2], packed[3], ts[0], advantages=adv, beta=0.1,
                                     adv_clip_max=1.0, backend="torch")
        torch.testing.assert_close(shared.per_sample_loss, one.per_sample_loss, rtol=1e-13, atol=1e-15)


def _awm_oracle(v, eps, x0, t, w, weighting):
    m = sum(wk * ((v[k] - (eps[k] - x0[k])) ** 2).flatten(1).mean(1) for k, wk in enumerate(w))
    lp = -m
    return {"uniform": lp, "t": lp * t, "huber": -(torch.sqrt(-lp + 1e-10) - 1e-5) * t}[weighting]


@pytest.mark.parametrize("weights", [None, H3])
@pytest.mark.parametrize("weighting", ["uniform", "t", "huber"])
def test_awm_on_tuples_matches_the_weighted_oracle(weights, weighting):
    """awm_log_prob / awm_loss on a joint step (float64, torch backend): l = -(the streams' weighted mean
    of (v - (eps - x0))^2), then the weighting with the shared t; awm_loss is the clipped surrogate on it."""
    streams = _flow_streams(7)
    t = torch.tensor([0.3, 0.6, 0.9], dtype=F64)
    v = tuple(s[1].clone().requires_grad_() for s in streams)
    eps, x0 = tuple(s[5] for s in streams), tuple(s[3] for s in streams)
    w = _count_weights(eps, weights)
    lp = flowrl.losses.awm_log_prob(v, eps, x0, t, weighting=weighting, stream_weights=weights, backend="torch")
    want = _awm_oracle([s[1] for s in streams], eps, x0, t, w, weighting)
    torch.testing.assert_close(lp, want, rtol=1e-12, atol=1e-14)
    old, adv = want.detach() + torch.tensor([0.1, -0.2, 0.0], dtype=F64), torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    out = flowrl.losses.awm_loss(v, eps, x0, t, old_log_prob=old, advantages=adv, clip_range=0.05, weighting=weighting,
                                 stream_weights=weights, backend="torch")
    out.loss.backward()
    v2 = [s[1].clone().requires_grad_() for s in streams]
    ratio = torch.exp(_awm_oracle(v2, eps, x0, t, w, weighting) - old)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.95, 1.05)).mean()
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-14)
    for got, want in zip((v[0].grad, v[1].grad), (v2[0].grad, v2[1].grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("weights", [None, H3])
def test_forward_process_losses_on_tuples_triton_matches_torch(weights):
    """float32: the Triton backend (interpreter) against the torch backend on joint nft / awm steps: the
    same per-stream sums (bit for bit, kernels/loss.py's contract) combined by one formula."""
    streams = _flow_streams(9, torch.float32)
    adv = torch.tensor([1.5, -0.4, 0.2])
    t = torch.tensor([0.3, 0.6, 0.9])
    got = {}
    for backend in BACKENDS:
        v = tuple(s[1].clone().requires_grad_() for s in streams)
        nft = flowrl.losses.nft_loss(tuple(s[0] for s in streams), v, tuple(s[2] for s in streams),
                                     tuple(s[3] for s in streams), t, advantages=adv, beta=0.1, adv_clip_max=1.0, kl_coef=0.2,
                                     ref_model_output=tuple(s[4] for s in streams), stream_weights=weights,
                                     backend=backend)
        awm = flowrl.losses.awm_loss(v, tuple(s[5] for s in streams), tuple(s[3] for s in streams), t,
                                     old_log_prob=torch.zeros(3), advantages=adv, clip_range=0.2, weighting="t", stream_weights=weights,
                                     backend=backend)
        (nft.loss + awm.loss).backward()
        got[backend] = (nft, awm, [u.grad for u in v])
    (nt, at, gt), (nr, ar, gr) = got["triton"], got["torch"]
    assert torch.equal(nt.per_sample_loss, nr.per_sample_loss) and torch.equal(nt.kl, nr.kl)
    assert torch.equal(at.log_prob, ar.log_prob) and torch.equal(nt.loss, nr.loss)
    for a, b in zip(gt, gr):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_forward_process_losses_on_tuples_name_bad_arguments():
    (xt, v, vo, x0, vr, eps), (xt2, v2, vo2, x02, vr2, eps2) = _flow_streams(3, torch.float32)
    adv, t = torch.zeros(3), 0.5
    nft = flowrl.losses.nft_loss
    with pytest.raises(ValueError, match="model_output must be a tuple of 2"):
        nft((xt, xt2), (v,), (vo, vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0)
    with pytest.raises(TypeError, match="old_model_output must be a tuple of 2"):
        nft((xt, xt2), (v, v2), vo, (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"model_output\[1\] must have the shape of noised_sample\[1\]"):
        nft((xt, xt2), (v, v), (vo, vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0)
    with pytest.raises(ValueError, match="ref_model_output: give every stream's"):
        nft((xt, xt2), (v, v2), (vo, vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0,
            ref_model_output=(vr, None))
    with pytest.raises(ValueError, match="sigma must have one entry per stream"):
        nft((xt, xt2), (v, v2), (vo, vo2), (x0, x02), (t, t, t), advantages=adv, beta=0.1, adv_clip_max=1.0)
    with pytest.raises(ValueError, match=r"old_model_output\[0\] requires grad"):
        nft((xt, xt2), (v, v2), (vo.requires_grad_(), vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0)
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        nft(xt, v, vo.detach(), x0, t, advantages=adv, beta=0.1, adv_clip_max=1.0, stream_weights=H3)
    with pytest.raises(ValueError, match="one weight per stream"):
        nft((xt, xt2), (v, v2), (vo.detach(), vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0,
            stream_weights=(1.0,))
    with pytest.raises(ValueError, match="sigma: a joint step's AWM weighting reads one t"):
        flowrl.losses.awm_log_prob((v, v2), (eps, eps2), (x0, x02), (t, t))
    with pytest.raises(ValueError, match="noise must be a tuple of 2"):
        flowrl.losses.awm_log_prob((v, v2), (eps,), (x0, x02), t)
    with pytest.raises(ValueError, match="stream_weights weights the streams of a joint step"):
        flowrl.losses.awm_loss(v, eps, x0, t, old_log_prob=adv, advantages=adv, clip_range=0.2, stream_weights=H3)
    with pytest.raises(ValueError, match="shard: a joint step"):
        flowrl.losses.awm_log_prob((v, v2), (eps, eps2), (x0, x02), t, shard=object())
    with pytest.raises(ValueError, match="shard: a joint step"):
        nft((xt, xt2), (v, v2), (vo.detach(), vo2), (x0, x02), t, advantages=adv, beta=0.1, adv_clip_max=1.0,
            shard=object())
    # the preference losses take one stream
    with pytest.raises(TypeError, match="model_output must be a torch.Tensor; got tuple"):
        flowrl.losses.dpo_loss((v, v2), (vr, vr2), (eps, eps2), (x0, x02), beta=1.0)
    with pytest.raises(TypeError, match="model_output must be a torch.Tensor; got tuple"):
        flowrl.losses.dgpo_loss((v, v2), (vr, vr2), (eps, eps2), (x0, x02), advantages=adv,
                                group_index=torch.zeros(3, dtype=torch.long),
                                beta=1.0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])  # Triton: ~5 s each
@pytest.mark.parametrize("kl_space", ["transition", "velocity"])
def test_joint_steps_take_a_guided_reference_per_stream(backend, kl_space):
    """ref_model_output as one (uncond, cond) pair per stream with ref_guidance_scale: the bits of each
    stream's CFG line uncond + w (cond - uncond) passed as one tensor (float32), in grpo_loss, grpo_guard_loss
    and flow_dppo_loss on tuples, KL and gradients included; a stream given as one tensor is refused."""
    (xv, vv, rv), (xa, va, ra) = _streams(seed=12)
    g = torch.Generator().manual_seed(2)
    cv, ca = rv + 0.1 * torch.randn(rv.shape, generator=g), ra + 0.1 * torch.randn(ra.shape, generator=g)
    w = torch.tensor(4.5, dtype=torch.float32)
    ov = flowrl.sde_step(xv, vv, VIDEO_SIGMAS, 1, noise_seed=1, reduction="sum", backend=backend)
    oa = flowrl.sde_step(xa, va, AUDIO_SIGMAS, 1, noise_seed=2, reduction="sum", backend=backend)
    prev, sig = (ov.prev_sample, oa.prev_sample), (VIDEO_SIGMAS, AUDIO_SIGMAS)
    old = flowrl.combine_streams([ov.log_prob, oa.log_prob], [ov.count, oa.count], "mean", H3) - 0.02
    adv = torch.tensor([1.0, -0.5, 2.0])
    forms = {"pair": dict(ref_model_output=((rv, cv), (ra, ca)), ref_guidance_scale=4.5),
             "one": dict(ref_model_output=(rv + w * (cv - rv), ra + w * (ca - ra)))}
    for loss, extra in ((grpo_loss, dict(clip_range=0.2)), (grpo_guard_loss, dict(clip_range=0.2, noise_seed=(1, 2))),
                        (flow_dppo_loss, dict(kl_threshold=0.01, noise_seed=(1, 2)))):
        got = {}
        for name, kw in forms.items():
            v, a = (vv * 1.01).requires_grad_(), (va * 0.99).requires_grad_()
            out = loss((xv, xa), (v, a), prev, sig, 1, old_log_prob=old, advantages=adv, kl_coef=0.3, kl_space=kl_space,
                       stream_weights=H3,
                       backend=backend, **extra, **kw)
            out.loss.backward()
            got[name] = (out, v.grad, a.grad)
        (p, pv, pa), (o, ov_, oa_) = got["pair"], got["one"]
        for field in ("loss", "kl", "log_prob", "ratio"):
            assert torch.equal(getattr(p, field), getattr(o, field)), (loss.__name__, field)
        assert torch.equal(pv, ov_) and torch.equal(pa, oa_) and float(p.kl.abs().min()) > 0
    with pytest.raises(ValueError, match="ref_guidance_scale is given but ref_model_output is not a pair"):
        grpo_loss((xv, xa), (vv, va), prev, sig, 1, old_log_prob=old, advantages=adv, clip_range=0.2, kl_coef=0.3,
                  ref_model_output=((rv, cv), ra), ref_guidance_scale=4.5)
    with pytest.raises(ValueError, match="ref_model_output is a pair"):
        grpo_loss((xv, xa), (vv, va), prev, sig, 1, old_log_prob=old, advantages=adv, clip_range=0.2, kl_coef=0.3,
                  ref_model_output=((rv, cv), (ra, ca)))
