"""flowrl.compat: the peer adapters, checked against each peer's step written out in tests/peer_steps.py
(Flow-GRPO, DanceGRPO, Flow-Factory, verl-omni: transcriptions of the peers' math, operation for operation
and dtype for dtype, not imported; tests/peer_steps.py cites each one's source).

Run the first-update ratio measurement quoted in docs/integration.md with
``pytest tests/compat/test_compat.py -k first_update_ratio -s``.
"""
import json
import math
import warnings

import pytest
import torch

import flowrl
from flowrl.compat.dance_grpo import flux_step
from flowrl.compat.flow_factory import FlowMatchEulerDiscreteSDEScheduler, FlowMatchEulerDiscreteSDESchedulerOutput
from flowrl.compat.flow_factory import step as ff_step
from flowrl.compat.flow_grpo import sde_step_with_logprob
from flowrl.rollout.recorder import rollout
from flowrl.data.trajectory import RolloutTrajectory

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler as DiffusersScheduler  # noqa: E402
from peer_steps import (TOL, diffusers_scheduler, flowrl_scheduler, gen, peer_flow_factory,  # noqa: E402
                        peer_flow_grpo, peer_flow_grpo_kl, peer_flux_step, peer_verl_omni)

F32, BF16 = torch.float32, torch.bfloat16


# ------------------------------------------------------------------------------------- fixtures
SCHEDULERS = {"diffusers": diffusers_scheduler, "flowrl": flowrl_scheduler}


def tensors(shape=(3, 4, 8, 8), dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return x, v


# ------------------------------------------------------------------------------------ Flow-GRPO
@pytest.mark.parametrize("kind", list(SCHEDULERS))
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_flow_grpo_rollout_matches_peer(kind, sde_type, per_sample):
    sched = SCHEDULERS[kind]()
    x, v = tensors()
    peer_sched = diffusers_scheduler()
    for i in range(len(sched.timesteps)):
        if per_sample:
            idx = torch.tensor([i, (i + 3) % 10, (i + 7) % 10])
            t = sched.timesteps[idx]
        else:
            t = sched.timesteps[i].unsqueeze(0)
        ours = sde_step_with_logprob(sched, v, t, x, noise_level=0.7, generator=gen(i), sde_type=sde_type,
                                     return_sqrt_dt=True)
        peer = peer_flow_grpo(peer_sched, v, t, x, noise_level=0.7, generator=gen(i), sde_type=sde_type,
                              return_sqrt_dt=True)
        assert len(ours) == len(peer) == 5
        for name, a, b in zip(("prev_sample", "log_prob", "prev_sample_mean", "std_dev_t", "sqrt_dt"), ours, peer):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"step {i} {name}: {m}")
        # without return_sqrt_dt: the 4-tuple
        assert len(sde_step_with_logprob(sched, v, t, x, generator=gen(i), sde_type=sde_type)) == 4


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_flow_grpo_recompute_and_gradient_match_peer(sde_type):
    sched = diffusers_scheduler()
    x, v = tensors()
    t = sched.timesteps[[1, 4, 8]]
    prev = peer_flow_grpo(sched, v, t, x, generator=gen(5), sde_type=sde_type)[0]
    v1, v2 = v.clone().requires_grad_(), v.clone().requires_grad_()
    ours = sde_step_with_logprob(sched, v1, t, x, prev_sample=prev, sde_type=sde_type)
    peer = peer_flow_grpo(sched, v2, t, x, prev_sample=prev, sde_type=sde_type)
    for a, b in zip(ours, peer):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)
    # the log-prob and the mean are differentiable in model_output, as Flow-GRPO's
    (ours[1].sum() + ours[2].square().mean()).backward()
    (peer[1].sum() + peer[2].square().mean()).backward()
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-4, atol=1e-6)


def test_flow_grpo_bf16_timestep_resolves_where_diffusers_lookup_raises():
    sched = diffusers_scheduler(steps=10)
    x, v = tensors()
    t = sched.timesteps[3].unsqueeze(0)
    t_bf16 = t.to(BF16)
    assert t_bf16.float() != t  # the bf16 value is not in the float32 table
    with pytest.raises(IndexError):  # diffusers' exact lookup (Flow-GRPO's) finds no entry
        sched.index_for_timestep(t_bf16[0])
    a = sde_step_with_logprob(sched, v, t, x, generator=gen(0))
    b = sde_step_with_logprob(sched, v, t_bf16, x, generator=gen(0))
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    # per-sample bf16 timesteps too
    ts = sched.timesteps[[0, 5, 9]]
    c = sde_step_with_logprob(sched, v, ts.to(BF16), x, generator=gen(0))
    d = sde_step_with_logprob(sched, v, ts, x, generator=gen(0))
    assert all(torch.equal(p, q) for p, q in zip(c, d))
    # the forms Flow-GRPO iterates over: a list of floats, a list of 0-d tensors
    for form in (ts.tolist(), list(ts)):
        e = sde_step_with_logprob(sched, v, form, x, generator=gen(0))
        assert all(torch.equal(p, q) for p, q in zip(e, d))


def test_flow_grpo_default_scores_the_rounded_sample_and_the_flag_reproduces_the_peer():
    sched = diffusers_scheduler()
    x, v = tensors(dtype=BF16)
    t = sched.timesteps[[2, 6, 9]]
    peer_prev, peer_lp, _, _ = peer_flow_grpo(sched, v, t, x, generator=gen(1))
    assert peer_prev.dtype == F32
    # default: the sample in model_output's dtype, the log-prob of that rounded sample: the recompute
    # from the stored sample gives the same bits (ratio exactly 1)
    prev, lp, _, _ = sde_step_with_logprob(sched, v, t, x, generator=gen(1))
    assert prev.dtype == BF16
    again = sde_step_with_logprob(sched, v, t, x, prev_sample=prev)[1]
    assert torch.equal(torch.exp(again - lp), torch.ones(3))
    assert not torch.allclose(lp, peer_lp, rtol=0, atol=1e-6)  # the rounding is in the value
    # peer_compatible: the float32 sample and its log-prob, as Flow-GRPO
    prev_c, lp_c, _, _ = sde_step_with_logprob(sched, v, t, x, generator=gen(1), peer_compatible=True)
    assert prev_c.dtype == F32
    torch.testing.assert_close(prev_c, peer_prev, **TOL)
    torch.testing.assert_close(lp_c, peer_lp, **TOL)
    # peer_compatible with a rounding out_dtype is refused: the sample would be rounded while its
    # log-prob is of the float32 one (Flow-GRPO records the float32 sample); float32 is accepted
    with pytest.raises(ValueError, match="peer_compatible=True with out_dtype"):
        sde_step_with_logprob(sched, v, t, x, generator=gen(1), peer_compatible=True, out_dtype=BF16)
    prev_r, lp_r, _, _ = sde_step_with_logprob(sched, v, t, x, generator=gen(1), peer_compatible=True, out_dtype=F32)
    assert torch.equal(prev_r, prev_c) and torch.equal(lp_r, lp_c)


def test_peer_compatible_with_a_rounding_out_dtype_would_break_the_ratio():
    """Why the combination is refused: scoring the float32 sample but storing its bf16 rounding (the
    old behaviour, done by hand here) moves the recompute's log-prob."""
    sched = diffusers_scheduler()
    x, v = tensors(dtype=BF16)
    t = sched.timesteps[[2, 6, 9]]
    prev_c, lp_c, _, _ = sde_step_with_logprob(sched, v, t, x, generator=gen(1), peer_compatible=True)
    again = sde_step_with_logprob(sched, v, t, x, prev_sample=prev_c.to(BF16))[1]
    assert (torch.exp(again - lp_c) - 1).abs().max() > 1e-4
    with pytest.raises(ValueError, match="peer_compatible=True with out_dtype"):
        flux_step(v, x.float(), 0.3, dance_sigmas(), 4, None, True, True, peer_compatible=True, out_dtype=BF16)


def test_flow_grpo_deterministic_steps_give_zero_not_nan():
    sched = diffusers_scheduler()
    x, v = tensors()
    t = sched.timesteps[[0, 4, 9]]
    # sde at noise_level 0: Flow-GRPO's log-prob is 0/0 = NaN; flowrl's 0, the sample the mean
    peer = peer_flow_grpo(sched, v, t, x, noise_level=0.0, generator=gen(0))
    assert torch.isnan(peer[1]).all()
    prev, lp, mean, std = sde_step_with_logprob(sched, v, t, x, noise_level=0.0, generator=gen(0))
    assert torch.equal(lp, torch.zeros(3)) and torch.equal(prev, mean) and torch.equal(std, torch.zeros(3, 1, 1, 1))
    torch.testing.assert_close(mean, peer[2], **TOL)
    # the generator advances as Flow-GRPO's (noise is drawn at noise_level 0 too)
    g1, g2 = gen(3), gen(3)
    sde_step_with_logprob(sched, v, t, x, noise_level=0.0, generator=g1)
    peer_flow_grpo(sched, v, t, x, noise_level=0.0, generator=g2)
    assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))
    # cps at the last step (sigma' = 0): flowrl's log-prob is 0; Flow-GRPO's is -mean((x' - mu)^2),
    # the stored sample's rounding when it is stored in bf16
    last = sched.timesteps[-1:].expand(3)
    prev, lp, _, _ = sde_step_with_logprob(sched, v, last, x, sde_type="cps", generator=gen(0), out_dtype=BF16)
    assert torch.equal(lp, torch.zeros(3))
    assert torch.equal(sde_step_with_logprob(sched, v, last, x, prev_sample=prev, sde_type="cps")[1], torch.zeros(3))
    peer_lp = peer_flow_grpo(sched, v, last, x, prev_sample=prev, sde_type="cps")[1]
    assert (peer_lp < 0).all()


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_flow_grpo_kl_is_the_exact_kl_times_dt_for_sde(sde_type):
    sched = diffusers_scheduler()
    x, v = tensors()
    v_ref = v + 0.05 * tensors(seed=1)[1]
    t = sched.timesteps[[1, 5, 8]]
    prev = sde_step_with_logprob(sched, v, t, x, generator=gen(0), sde_type=sde_type)[0]
    _, _, mean, std, sqrt_dt = sde_step_with_logprob(sched, v, t, x, prev_sample=prev, sde_type=sde_type, return_sqrt_dt=True)
    mean_ref = sde_step_with_logprob(sched, v_ref, t, x, prev_sample=prev, sde_type=sde_type)[2]
    peer_kl = peer_flow_grpo_kl(mean, mean_ref, std).reshape(-1)
    idx = torch.tensor([1, 5, 8])
    exact = flowrl.step_kl(x, v, v_ref, sched.sigmas, idx, mode=sde_type, noise_level=0.7)
    d = sqrt_dt.reshape(-1) ** 2
    expected = exact * d if sde_type == "sde" else exact  # cps: Flow-GRPO's std_dev_t is the step std
    torch.testing.assert_close(peer_kl, expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sde_type="ode"), ValueError, "sde_type"),
        (dict(sde_type=None), ValueError, "sde_type"),
        (dict(noise_level=-0.1), ValueError, "noise_level"),
        (dict(noise_level=float("nan")), ValueError, "noise_level"),
        (dict(noise_level="0.7"), TypeError, "noise_level"),
        (dict(noise_level=1.5, sde_type="cps"), ValueError, "noise_level"),
        (dict(timestep=torch.tensor([123.456])), ValueError, "timestep"),
        (dict(timestep=torch.tensor([750.0, 500.0])), ValueError, "timestep"),
        (dict(timestep="750"), TypeError, "timestep"),
        (dict(model_output=torch.zeros(3, 4)), ValueError, "model_output"),
        (dict(model_output=torch.zeros(3, 4, 8, 8, dtype=torch.int32)), TypeError, "model_output"),
        (dict(sample=[1.0]), TypeError, "sample"),
        (dict(prev_sample=torch.zeros(2, 4, 8, 8)), ValueError, "prev_sample"),
        (dict(return_sqrt_dt=1), TypeError, "return_sqrt_dt"),
        (dict(peer_compatible="yes"), TypeError, "peer_compatible"),
        (dict(out_dtype=torch.int8), TypeError, "out_dtype"),
        (dict(generator=[gen(0), gen(1)]), ValueError, "generator"),
        (dict(self=object()), TypeError, "self"),
    ],
)
def test_flow_grpo_bad_input_names_the_argument(kwargs, error, match):
    sched = diffusers_scheduler()
    x, v = tensors()
    args = dict(self=sched, model_output=v, timestep=sched.timesteps[:1], sample=x)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        sde_step_with_logprob(**args)


def test_flow_grpo_peer_failures_on_bad_input():
    """What Flow-GRPO itself does with an unknown sde_type or timestep (docs/integration.md's table)."""
    sched = diffusers_scheduler()
    x, v = tensors()
    with pytest.raises(UnboundLocalError):
        peer_flow_grpo(sched, v, sched.timesteps[:1], x, sde_type="ode")
    with pytest.raises(IndexError):
        peer_flow_grpo(sched, v, torch.tensor([123.456]), x)


def test_flow_grpo_sigma_one_within_tolerance_uses_the_second_sigma():
    sched = DiffusersScheduler(shift=1.0)
    sched.set_timesteps(sigmas=[1 - 5e-6, 0.8, 0.5, 0.2])
    assert 0 < 1 - float(sched.sigmas[0]) < 1e-5
    x, v = tensors()
    t = sched.timesteps[:1]
    ours = sde_step_with_logprob(sched, v, t, x, generator=gen(0))[3]
    peer = peer_flow_grpo(sched, v, t, x, generator=gen(0))[3]
    s_expected = 0.7 * math.sqrt(float(sched.sigmas[0]) / (1 - float(sched.sigmas[1])))
    assert ours.reshape(-1).item() == pytest.approx(s_expected, rel=1e-6)
    assert peer.reshape(-1).item() > 100  # exact equality: sigma / (1 - sigma) with 1 - sigma ~ 5e-6


# ------------------------------------------------------------------------------------ DanceGRPO
def dance_sigmas(steps=10, shift=3.0):
    s = torch.linspace(1, 0, steps + 1)
    return (shift * s) / (1 + (shift - 1) * s)  # DanceGRPO's sd3_time_shift


@pytest.mark.parametrize("index", [0, 4, 9])
def test_flux_step_matches_peer(index):
    sigmas = dance_sigmas()
    x, v = tensors()
    torch.manual_seed(11)
    ours = flux_step(v, x, 0.3, sigmas, index, None, True, True)
    torch.manual_seed(11)
    peer = peer_flux_step(v, x, 0.3, sigmas, index, None, True, True)
    for a, b in zip(ours, peer):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)
    # recompute: the given prev_sample comes back as given
    again = flux_step(v, x, 0.3, sigmas, index, ours[0], True, True)
    assert again[0] is ours[0]
    torch.testing.assert_close(again[2], peer_flux_step(v, x, 0.3, sigmas, index, ours[0], True, True)[2], **TOL)
    assert torch.equal(again[2], ours[2])  # float32 sample: ratio exactly 1
    # grpo=False: the deterministic mean, score-corrected or Euler
    for solver in (True, False):
        a, b = flux_step(v, x, 0.3, sigmas, index, None, False, solver), peer_flux_step(v, x, 0.3, sigmas, index, None, False, solver)
        torch.testing.assert_close(a[0], b[0], **TOL)
        torch.testing.assert_close(a[1], b[1], **TOL)


def test_flux_step_bf16_model_output_rounding_and_flag():
    sigmas = dance_sigmas()
    x, _ = tensors()
    v = tensors(dtype=BF16)[1]  # DanceGRPO: bf16 prediction (autocast), float32 latents
    torch.manual_seed(3)
    prev, x0, lp = flux_step(v, x, 0.3, sigmas, 4, None, True, True)
    assert prev.dtype == BF16  # default: emitted in model_output's dtype, scored as emitted
    assert torch.equal(flux_step(v, x, 0.3, sigmas, 4, prev, True, True)[2], lp)
    torch.manual_seed(3)
    prev_c, _, lp_c = flux_step(v, x, 0.3, sigmas, 4, None, True, True, peer_compatible=True)
    torch.manual_seed(3)
    peer_prev, peer_x0, peer_lp = peer_flux_step(v, x, 0.3, sigmas, 4, None, True, True)
    assert prev_c.dtype == peer_prev.dtype == F32
    # DanceGRPO's mean rounds dsigma * v and sigma * v to bf16; flowrl's mean is float32: the sample
    # and x0 differ by that rounding (measured here: 8.8e-4 and 1.3e-2), while the rollout's log-prob
    # agrees within float32 rounding (x' - mu is the noise term on both sides)
    diff_prev, diff_x0 = (prev_c - peer_prev).abs().max().item(), (x0 - peer_x0).abs().max().item()
    assert f"{diff_prev:.2g}" == "0.00088" and f"{diff_x0:.2g}" == "0.013"
    torch.testing.assert_close(lp_c, peer_lp, **TOL)
    # with a float32 model_output the flag reproduces DanceGRPO within float32 rounding
    torch.manual_seed(3)
    a = flux_step(v.float(), x, 0.3, sigmas, 4, None, True, True, peer_compatible=True)
    torch.manual_seed(3)
    b = peer_flux_step(v.float(), x, 0.3, sigmas, 4, None, True, True)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, **TOL)


def test_flux_step_eta_zero_and_unsupported_solver():
    sigmas = dance_sigmas()
    x, v = tensors()
    with pytest.raises(ValueError, match="math domain error"):  # DanceGRPO: math.log(0)
        peer_flux_step(v, x, 0.0, sigmas, 3, None, True, True)
    prev, _, lp = flux_step(v, x, 0.0, sigmas, 3, None, True, True)
    assert torch.equal(lp, torch.zeros(3))
    with pytest.raises(ValueError, match="sde_solver"):
        flux_step(v, x, 0.3, sigmas, 3, None, True, False)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(eta=-1.0), ValueError, "eta"),
        (dict(eta=None), TypeError, "eta"),
        (dict(index=10), ValueError, "index"),
        (dict(index=-1), ValueError, "index"),
        (dict(index=2.0), TypeError, "index"),
        (dict(latents=torch.zeros(3, 4)), ValueError, "model_output"),
        (dict(latents="x"), TypeError, "latents"),
        (dict(prev_sample=torch.zeros(1)), ValueError, "prev_sample"),
        (dict(grpo=1), TypeError, "grpo"),
        (dict(sde_solver=None), TypeError, "sde_solver"),
        (dict(sigmas=[1.0, 0.0]), TypeError, "sigmas"),
        (dict(sigmas=torch.tensor([1.0, 0.5, 0.7, 0.0])), ValueError, "sigmas"),
    ],
)
def test_flux_step_bad_input_names_the_argument(kwargs, error, match):
    x, v = tensors()
    args = dict(model_output=v, latents=x, eta=0.3, sigmas=dance_sigmas(), index=2, prev_sample=None, grpo=True,
                sde_solver=True)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        flux_step(**args)


# --------------------------------------------------------------------------------- Flow-Factory
def ff_fields(out):
    return (out.next_latents, out.next_latents_mean, out.noise_pred, out.log_prob, out.std_dev_t, out.dt)


@pytest.mark.parametrize("dynamics", ["Flow-SDE", "Dance-SDE", "CPS", "ODE"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_next_timestep", [False, True])
def test_flow_factory_step_matches_peer(dynamics, dtype, with_next_timestep):
    sched = diffusers_scheduler()
    x, v = tensors(dtype=dtype)
    eta = 0.5
    for i in range(len(sched.timesteps)):
        t = sched.timesteps[i]
        t_next = sched.timesteps[i + 1] if i + 1 < len(sched.timesteps) else torch.tensor(0)
        extra = dict(timestep_next=t_next) if with_next_timestep else {}
        ours = ff_step(sched, v, t, x, generator=gen(i), noise_level=eta, dynamics_type=dynamics, **extra)
        assert isinstance(ours, FlowMatchEulerDiscreteSDESchedulerOutput)
        peer = peer_flow_factory(sched, v, t, x, generator=gen(i), noise_level=eta, dynamics_type=dynamics, **extra)
        tol = TOL
        for name, a, b in zip(("next_latents", "mean", "noise_pred", "log_prob", "std_dev_t", "dt"), ff_fields(ours), peer):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if name == "next_latents" and dtype == BF16:
                # both round to bf16: a float32-rounding difference can flip one rounding
                assert (a != b).float().mean() < 1e-2
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
            else:
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"step {i} {name}: {m}")
        # recompute from the stored sample: the same log-prob (the rounding rule is Flow-Factory's too)
        again = ff_step(sched, v, t, x, next_latents=ours.next_latents.to(dtype), noise_level=eta, dynamics_type=dynamics)
        assert torch.equal(again.log_prob, ours.log_prob)
        peer_again = peer_flow_factory(sched, v, t, x, next_latents=ours.next_latents.to(dtype), noise_level=eta,
                                       dynamics_type=dynamics, **extra)
        torch.testing.assert_close(again.log_prob, peer_again[3], **tol)


def test_flow_factory_timestep_next_sigma_is_one_ulp_off_where_flowrl_reads_the_table():
    sched = diffusers_scheduler(steps=40, shift=3.0)
    off = (sched.timesteps / 1000 != sched.sigmas[:-1]).nonzero().reshape(-1)
    assert off.numel() == 2  # timestep / 1000 is one float32 ulp off the table here
    x, v = tensors(shape=(2, 4, 16))
    for i in off.tolist():
        t, t_next = sched.timesteps[i], sched.timesteps[i + 1]
        ours = ff_step(sched, v, t, x, timestep_next=t_next, generator=gen(0), noise_level=0.7)
        table = ff_step(sched, v, t, x, generator=gen(0), noise_level=0.7)
        assert all(torch.equal(a, b) for a, b in zip(ff_fields(ours), ff_fields(table)))  # the table's sigma
        peer = peer_flow_factory(sched, v, t, x, timestep_next=t_next, generator=gen(0), noise_level=0.7)
        assert not torch.equal(peer[5], ours.dt)  # Flow-Factory's dt from timestep / 1000
        for a, b in zip(ff_fields(ours), peer):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_flow_factory_return_forms():
    sched = diffusers_scheduler()
    x, v = tensors()
    t = sched.timesteps[2]
    full = ff_step(sched, v, t, x, generator=gen(0), noise_level=0.7)
    tup = ff_step(sched, v, t, x, generator=gen(0), noise_level=0.7, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(tup, ff_fields(full)))
    some = ff_step(sched, v, t, x, generator=gen(0), noise_level=0.7, return_kwargs=["next_latents", "log_prob"])
    assert some.next_latents_mean is None and some.keys() == ["next_latents", "log_prob"]
    assert torch.equal(some["log_prob"], full.log_prob) and torch.equal(some[0], full.next_latents)
    assert ff_step(sched, v, t, x, generator=gen(0), noise_level=0.7, compute_log_prob=False).log_prob is None


def test_flow_factory_noise_level_zero_and_cps_last_step():
    sched = diffusers_scheduler()
    x, v = tensors(dtype=BF16)
    t = sched.timesteps[3]
    # per-sample noise levels, 0 outside the SDE window: Flow-Factory's log-prob is NaN there
    levels = torch.tensor([0.7, 0.0, 0.7])
    peer = peer_flow_factory(sched, v, t, x, generator=gen(0), noise_level=levels)
    assert torch.isnan(peer[3][1]) and not torch.isnan(peer[3][[0, 2]]).any()
    ours = ff_step(sched, v, t, x, generator=gen(0), noise_level=levels)
    assert ours.log_prob[1] == 0 and torch.isfinite(ours.log_prob).all()
    torch.testing.assert_close(ours.log_prob[[0, 2]], peer[3][[0, 2]], **TOL)
    torch.testing.assert_close(ours.next_latents_mean, peer[1], **TOL)
    torch.testing.assert_close(ours.std_dev_t, peer[4], **TOL)
    # CPS at the last step: flowrl 0; Flow-Factory -mean((x' - mu)^2) of the bf16 rounding
    last = sched.timesteps[-1]
    ours = ff_step(sched, v, last, x, generator=gen(0), noise_level=0.5, dynamics_type="CPS")
    peer = peer_flow_factory(sched, v, last, x, generator=gen(0), noise_level=0.5, dynamics_type="CPS")
    assert torch.equal(ours.log_prob, torch.zeros(3)) and (peer[3] < 0).all()


def test_flow_factory_scheduler_class_selection_and_modes():
    base = DiffusersScheduler(shift=3.0)
    args = dict(noise_level=0.7, sde_steps=None, num_sde_steps=3, seed=5, dynamics_type="Flow-SDE")
    config = dict(base.config)
    config.update(args)
    sched = FlowMatchEulerDiscreteSDEScheduler(**config)  # Flow-Factory's load_scheduler does this
    assert isinstance(sched, DiffusersScheduler) and isinstance(sched, flowrl.FlowMatchEulerDiscreteScheduler)
    sched.set_timesteps(10)
    assert torch.equal(sched.sigmas, diffusers_scheduler().sigmas)
    assert torch.equal(sched.sde_steps, torch.arange(9))
    # Flow-Factory's selection: randperm under the seed
    expected = torch.arange(9)[torch.randperm(9, generator=torch.Generator().manual_seed(5))[:3]]
    assert torch.equal(sched.current_sde_steps, expected)
    levels = sched.get_noise_levels()
    assert levels[expected].eq(0.7).all() and levels.sum().item() == pytest.approx(2.1)
    x, v = tensors()
    on, off = int(expected[0]), next(i for i in range(10) if i not in expected.tolist())
    assert sched.get_noise_level_for_timestep(sched.timesteps[on].to(BF16)) == 0.7  # bf16-safe lookup
    assert sched.get_noise_level_for_timestep(sched.timesteps[off]) == 0.0
    # noise_level=None: the window decides (0 off it: log-prob 0, no NaN)
    on_out = sched.step(v, sched.timesteps[on], x, generator=gen(0))
    ref = ff_step(sched, v, sched.timesteps[on], x, generator=gen(0), noise_level=0.7)
    assert torch.equal(on_out.log_prob, ref.log_prob)
    assert torch.equal(sched.step(v, sched.timesteps[off], x, generator=gen(0)).log_prob, torch.zeros(3))
    sched.eval()
    assert sched.is_eval and torch.equal(sched.step(v, sched.timesteps[on], x, noise_level=0.7).log_prob, torch.zeros(3))
    sched.rollout()
    assert not sched.is_eval
    assert FlowMatchEulerDiscreteSDEScheduler.from_config(base.config, dynamics_type="CPS", noise_level=0.5).dynamics_type == "CPS"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(dynamics_type="SDE"), ValueError, "dynamics_type"),
        (dict(timestep_next=torch.tensor(123.0)), ValueError, "timestep_next"),
        (dict(sigma_max=0.5), ValueError, "sigma_max"),
        (dict(return_kwargs=["prev_sample"]), ValueError, "return_kwargs"),
        (dict(noise_level=-0.5), ValueError, "noise_level"),
        (dict(noise_level=[0.1, 0.2]), ValueError, "noise_level"),
        (dict(noise_level=1.5, dynamics_type="CPS"), ValueError, "noise_level"),
        (dict(noise_pred=torch.zeros(3, 4)), ValueError, "noise_pred"),
        (dict(next_latents=torch.zeros(3)), ValueError, "next_latents"),
        (dict(timestep=torch.zeros(3, 1)), ValueError, "timestep"),
        (dict(timestep=torch.tensor(123.456)), ValueError, "timestep"),
        (dict(compute_log_prob=None), TypeError, "compute_log_prob"),
    ],
)
def test_flow_factory_bad_input_names_the_argument(kwargs, error, match):
    sched = diffusers_scheduler()
    x, v = tensors()
    args = dict(self=sched, noise_pred=v, timestep=sched.timesteps[2], latents=x, noise_level=0.7)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ff_step(**args)


def test_flow_factory_integer_timestep_is_a_step_index():
    sched = diffusers_scheduler()
    x, v = tensors()
    with pytest.warns(UserWarning, match="step indices"):
        a = ff_step(sched, v, 4, x, generator=gen(0), noise_level=0.7)
    b = ff_step(sched, v, sched.timesteps[4], x, generator=gen(0), noise_level=0.7)
    assert torch.equal(a.log_prob, b.log_prob)


# ------------------------------------------------------------------------------------ verl-omni
VERL_OMNI_MODES = {"sde": "sde", "cps": "cps", "dance_sde": "dance"}


@pytest.mark.parametrize("sde_type", list(VERL_OMNI_MODES))
@pytest.mark.parametrize("normalizer", [True, False])
def test_verl_omni_sde_types_map_to_flowrl_modes(sde_type, normalizer):
    """docs/integration.md's verl-omni table: sde_type -> mode; include_logprob_normalizer=False ->
    log_prob_kind="kernel" (cps is "sq_err" either way)."""
    sched = diffusers_scheduler()
    x, v = tensors()
    idx = torch.tensor([0, 3, 7])
    mode = VERL_OMNI_MODES[sde_type]
    kind = "sq_err" if mode == "cps" else ("gaussian" if normalizer else "kernel")
    prev = flowrl.sde_step(x, v, sched.sigmas, idx, mode=mode, noise_level=0.5, generator=gen(0)).prev_sample
    ours = flowrl.step_log_prob(x, v, prev, sched.sigmas, idx, mode=mode, noise_level=0.5, log_prob_kind=kind)
    peer_lp, peer_mean = peer_verl_omni(sched, x, v, sched.timesteps[idx], 0.5, prev, sde_type, normalizer)
    torch.testing.assert_close(ours, peer_lp, **TOL)
    torch.testing.assert_close(flowrl.sde_step(x, v, sched.sigmas, idx, mode=mode, noise_level=0.5,
                                               noise=torch.zeros_like(x)).prev_sample_mean, peer_mean, **TOL)


# ------------------------------------------------------------------- the first-update ratio
STEPS, SHAPE, CLIP_RANGE = 40, (2, 4096, 64), 1e-4


def _rollout_inputs():
    sched = diffusers_scheduler(steps=STEPS, shift=3.0)  # SD3's scheduler: shift 3, 40 steps (Flow-GRPO's eval)
    g = torch.Generator().manual_seed(2024)
    x0 = torch.randn(SHAPE, generator=g).to(BF16)  # prepare_latents in the pipeline's bf16
    velocities = [torch.randn(SHAPE, generator=g).to(BF16) for _ in range(STEPS)]  # transformer output, bf16
    return sched, x0, velocities


def _flow_grpo_style(step_fn, sched, x0, velocities, **step_kwargs):
    """Flow-GRPO's rollout loop and trainer recompute with ``step_fn`` in its place; returns
    |ratio - 1| [B, T] of the first update (the velocities are held fixed: the policy has not moved)."""
    gen_ = torch.Generator().manual_seed(7)
    latents, log_probs, x = [x0], [], x0
    for i, t in enumerate(sched.timesteps):
        latents_dtype = x.dtype
        x, lp, _, _ = step_fn(sched, velocities[i].float(), t.unsqueeze(0), x.float(), noise_level=0.7, generator=gen_,
                              **({k: (latents_dtype if v == "latents_dtype" else v) for k, v in step_kwargs.items()}))
        latents.append(x)  # stored before the cast
        log_probs.append(lp)
        if x.dtype != latents_dtype:
            x = x.to(latents_dtype)  # what the next step consumes
    latents = torch.stack(latents, dim=1)  # bf16 x0 and float32 steps: promoted to float32
    log_probs = torch.stack(log_probs, dim=1)
    timesteps = sched.timesteps.repeat(SHAPE[0], 1)
    dev = []
    for j in range(STEPS):
        lp = step_fn(sched, velocities[j].float(), timesteps[:, j], latents[:, j].float(),
                     prev_sample=latents[:, j + 1].float(), noise_level=0.7)[1]
        dev.append((torch.exp(lp - log_probs[:, j]) - 1).abs())
    return torch.stack(dev, dim=1)


def test_first_update_ratio_flow_grpo_vs_flowrl():
    sched, x0, velocities = _rollout_inputs()
    trained = int(STEPS * 0.99)  # Flow-GRPO's configs train on int(T * timestep_fraction), 0.99: steps 0..38
    peer = _flow_grpo_style(peer_flow_grpo, sched, x0, velocities)
    peer_trained, peer_all = peer[:, :trained].max().item(), peer.max().item()
    swapped = _flow_grpo_style(sde_step_with_logprob, sched, x0, velocities)
    fixed = _flow_grpo_style(sde_step_with_logprob, sched, x0, velocities, out_dtype="latents_dtype")
    print(
        f"\nfirst-update |ratio - 1|, {STEPS}-step bf16 rollout, latents {list(SHAPE)}:\n"
        f"  flow_grpo (recorded bf16/fp32 mix): max {peer_trained:.3g} over the {trained} trained steps "
        f"(clip range {CLIP_RANGE:g}), {peer_all:.3g} with the last step; "
        f"steps over the clip range: {int((peer[:, :trained] > CLIP_RANGE).any(0).sum())} of {trained}\n"
        f"  flowrl.compat, import swap only: max {swapped[:, :trained].max().item():.3g} ({trained} steps)\n"
        f"  flowrl.compat with out_dtype=latents.dtype: max {fixed.max().item():.3g} (all {STEPS} steps)"
    )
    # the numbers docs/integration.md quotes (CPU generators: the same draws everywhere)
    assert f"{peer_trained:.2g}" == "0.00036" and peer_trained > CLIP_RANGE
    assert int((peer[:, :trained] > CLIP_RANGE).any(0).sum()) == 6
    assert f"{peer_all:.2g}" == "0.025"
    last_std = flowrl.sde_step(x0, velocities[-1], sched.sigmas, STEPS - 1, noise_level=0.7, generator=gen(0)).std_dev
    assert (5e-3 < last_std).all() and (last_std < 7e-3).all()  # "its std is about 6e-3"
    assert (peer[:, 0] == 0).all()  # step 0 reads the bf16 x0 both times
    assert swapped[:, :trained].max().item() > CLIP_RANGE  # the mix is in the loop, not the step function
    assert torch.equal(fixed, torch.zeros_like(fixed))  # exactly 1 on every step


def test_first_update_ratio_flowrl_recorder_and_wire():
    """The scheduler path (flowrl.rollout.recorder.rollout on diffusers' own scheduler, bf16 throughout) and an
    SGLang-style JSON round trip of the trajectory: the recompute gives ratio exactly 1."""
    sched, x0, velocities = _rollout_inputs()
    with rollout(sched, mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(7)) as rec:
        x = x0
        for i, t in enumerate(sched.timesteps):
            x = sched.step(velocities[i], t, x, return_dict=False)[0]
    traj = RolloutTrajectory.from_wire(json.loads(json.dumps(rec.trajectory().to_wire())))
    assert traj.latents.dtype == BF16
    for j in range(STEPS):
        lp = flowrl.step_log_prob(traj.latents[:, j], velocities[j], traj.latents[:, j + 1], traj.sigmas, j,
                                  mode=traj.mode, noise_level=traj.noise_level, log_prob_kind=traj.log_prob_kind,
                                  reduction=traj.reduction)
        assert torch.equal(torch.exp(lp - traj.log_probs[:, j]), torch.ones(SHAPE[0]))


def test_dance_and_flow_factory_loops_give_ratio_exactly_one():
    sigmas = dance_sigmas(steps=8)
    x, _ = tensors(shape=(2, 64, 16))
    vs = [tensors(shape=(2, 64, 16), dtype=BF16, seed=s)[1] for s in range(8)]
    stored, lps = [x], []
    for i in range(8):  # DanceGRPO's run_sample_step with the adapter
        z, _, lp = flux_step(vs[i], stored[-1].to(F32), 0.3, sigmas, i, None, True, True)
        stored.append(z)
        lps.append(lp)
    for i in range(8):  # grpo_one_step
        lp = flux_step(vs[i], stored[i].to(F32), 0.3, sigmas, i, stored[i + 1].to(F32), True, True)[2]
        assert torch.equal(lp, lps[i])
    sched = diffusers_scheduler(steps=8)
    lat, out = x.to(BF16), []
    for i, t in enumerate(sched.timesteps):  # Flow-Factory's inference loop, then its optimize replay
        o = ff_step(sched, vs[i], t, lat, generator=gen(i), noise_level=0.7, dynamics_type="Flow-SDE")
        out.append((lat, o.next_latents.to(BF16), o.log_prob))
        lat = o.next_latents.to(BF16)
    for i, (a, b, lp) in enumerate(out):
        assert torch.equal(ff_step(sched, vs[i], sched.timesteps[i], a, next_latents=b, noise_level=0.7).log_prob, lp)


def test_compat_imports():
    import flowrl.compat as compat

    assert compat.sde_step_with_logprob is sde_step_with_logprob and compat.flux_step is flux_step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FlowMatchEulerDiscreteSDEScheduler(_class_name="x", _diffusers_version="0")


def test_first_update_ratio_of_the_refused_peer_compatible_out_dtype_combination():
    """The number docs/integration.md quotes for ``peer_compatible=True`` with ``out_dtype=latents_dtype``
    (now refused): the old behaviour, the float32 sample's log-prob with its bf16 rounding stored,
    reproduced by hand in Flow-GRPO's loop."""
    sched, x0, velocities = _rollout_inputs()

    def old_behaviour(self, v, t, x, prev_sample=None, out_dtype=None, **kw):
        if prev_sample is not None:
            return sde_step_with_logprob(self, v, t, x, prev_sample=prev_sample, **kw)
        prev, lp, mean, std = sde_step_with_logprob(self, v, t, x, peer_compatible=True, **kw)
        return prev.to(out_dtype), lp, mean, std

    dev = _flow_grpo_style(old_behaviour, sched, x0, velocities, out_dtype="latents_dtype")
    print(f"\npeer_compatible + out_dtype (old behaviour): max |ratio - 1| {dev.max().item():.3g}, "
          f"{int((dev > CLIP_RANGE).any(0).sum())} of {STEPS} steps beyond the clip range")
    assert f"{dev.max().item():.2g}" == "0.025"
    assert int((dev > CLIP_RANGE).any(0).sum()) == 7
