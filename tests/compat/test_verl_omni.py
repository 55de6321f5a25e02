"""flowrl.compat.verl_omni against verl-omni (verl-project/verl-omni @
a1139bafffb5b9711f0a6b6edff8ecaa60bfff30): its scheduler's ``sample_previous_step``
(verl_omni/pipelines/schedulers/flow_match_sde.py, transcribed as tests/peer_steps.peer_verl_omni) and
its losses (verl_omni/trainer/diffusion/diffusion_algos.py, transcribed in tests/peer_losses.py),
its training loop re-created (tests/compat/test_trainer_loops.py has the citation), and ``register()`` against
a stand-in with verl-omni's registry contract (``register_diffusion_loss(name)`` decorating a
``DiffusionLossFn`` class; ``DIFFUSION_LOSS_REGISTRY``; ``verl_omni.pipelines.schedulers``)."""
import copy
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from flowrl.compat import flow_grpo, verl_omni as vo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peer_steps import TOL, gen, peer_verl_omni  # noqa: E402
from peer_losses import (_setup, peer_verl_flow_dppo, peer_verl_flow_grpo, peer_verl_grpo_guard,  # noqa: E402
                         TOL as LTOL)
from trainer_loops import BATCH, DTYPES, ETA, SCALE, STEPS, ratio_dev, sd3_embeds  # noqa: E402
from tiny_pipelines import tiny_StableDiffusion3Pipeline  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def scheduler(steps=10):
    s = vo.FlowMatchSDEDiscreteScheduler(shift=3.0)
    s.set_timesteps(steps)
    return s


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("normalizer", [True, False])
def test_sample_previous_step_matches_verl_omni(sde_type, normalizer):
    sched = scheduler()
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g)
    t = sched.timesteps[[1, 4, 7]]
    prev, lp, mean, std, sqrt_dt = sched.sample_previous_step(x, v, timestep=t, generator=gen(2), noise_level=0.5,
                                                              sde_type=sde_type, include_logprob_normalizer=normalizer,
                                                              return_sqrt_dt=True)
    assert prev.dtype == F32 and lp.shape == (3,) and std.shape == (3, 1, 1) and sqrt_dt.shape == (3,)
    peer_lp, peer_mean = peer_verl_omni(sched, x, v, t, 0.5, prev, sde_type, normalizer)
    torch.testing.assert_close(lp, peer_lp, **TOL)
    torch.testing.assert_close(mean, peer_mean, **TOL)
    # the rollout's sample is its mean plus verl-omni's std times the generator's float32 draw
    noise = torch.randn(3, 16, 8, generator=gen(2))
    step_std = std * sqrt_dt.view(-1, 1, 1) if sde_type == "sde" else std
    torch.testing.assert_close(prev, peer_mean + step_std * noise, **TOL)
    sigmas = sched.sigmas[[1, 4, 7]], sched.sigmas[[2, 5, 8]]
    torch.testing.assert_close(sqrt_dt, torch.sqrt(sigmas[0] - sigmas[1]))
    # the recompute: the same bits, differentiable in model_output
    vv = v.clone().requires_grad_(True)
    _, lp2, _, _ = sched.sample_previous_step(x, vv, timestep=t, noise_level=0.5, prev_sample=prev, sde_type=sde_type,
                                              include_logprob_normalizer=normalizer)
    assert torch.equal(lp2.detach(), lp)
    lp2.sum().backward()
    assert vv.grad is not None and torch.isfinite(vv.grad).all()


def test_step_sequential_loop_per_sample_noise_levels_and_bad_input():
    sched = scheduler()
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    out = sched.step(v, sched.timesteps[0], x, generator=gen(0), noise_level=0.7)
    assert sched.step_index == 1 and out.prev_sample.dtype == F32 and out.std_dev_t.dim() == 0
    # per-sample noise levels (the rollout adapters' SDE window): 0 gives log-prob 0, a deterministic step
    levels = torch.tensor([0.7, 0.0]).view(2, 1, 1)
    prev, lp, mean, std = sched.step(v, sched.timesteps[1], out.prev_sample, generator=gen(1), noise_level=levels,
                                     return_dict=False)
    assert lp[1] == 0 and torch.equal(prev[1], mean[1]) and std.shape == (2, 1, 1)
    one = sched.sample_previous_step(out.prev_sample[:1], v[:1], timestep=sched.timesteps[1:2], generator=gen(1),
                                     noise_level=0.7)
    assert torch.equal(one[1], lp[:1])
    for kwargs, err, match in [
        (dict(sde_type="ode"), ValueError, "sde_type"),
        (dict(per_token_timesteps=torch.zeros(2)), ValueError, "per_token_timesteps"),
        (dict(noise_level=-1.0), ValueError, "noise_level"),
        (dict(noise_level=torch.ones(3)), ValueError, "noise_level"),
        (dict(timestep=torch.tensor([0.5])), ValueError, "timestep"),
        (dict(return_sqrt_dt="yes"), TypeError, "return_sqrt_dt"),
        (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    ]:
        kwargs.setdefault("timestep", sched.timesteps[:1])
        with pytest.raises(err, match=match):
            sched.sample_previous_step(x, v, **kwargs)
    with pytest.raises(ValueError, match="timestep"):
        scheduler().step(v, 3, x)


# --------------------------------------------------------------------------------------- losses
def _cfg(**kw):
    return SimpleNamespace(diffusion_loss=SimpleNamespace(**kw))


def test_losses_match_verl_omni():
    s = _setup([2, 2, 2])
    cfg = _cfg(adv_clip_max=5.0, clip_ratio=0.05, kl_mask_threshold=0.0)
    loss, m = vo.flow_grpo_loss(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv, config=cfg)
    peer_loss, peer_m = peer_verl_flow_grpo(s.old_lp, s.lp, s.adv, cfg)
    torch.testing.assert_close(loss, peer_loss, **LTOL)
    assert m["actor/pg_clipfrac"] == float(peer_m["pg_clipfrac"])
    kw = dict(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv, config=cfg, old_prev_sample_mean=s.old_mean,
              prev_sample_mean=s.mean, std_dev_t=s.std_dev_t, sqrt_dt=s.sqrt_dt.flatten())
    loss, _ = vo.grpo_guard_loss(**kw)
    peer_loss, _ = peer_verl_grpo_guard(s.old_lp, s.lp, s.adv, cfg, s.old_mean, s.mean, s.std_dev_t, s.sqrt_dt.flatten())
    torch.testing.assert_close(loss, peer_loss, **LTOL)
    _, pm = peer_verl_flow_dppo(s.old_lp, s.lp, s.adv, cfg, s.old_mean, s.mean, s.std_dev_t, s.sqrt_dt.flatten())
    kl = pm["kl_per_sample"].sort().values
    cfg.diffusion_loss.kl_mask_threshold = float(kl[0] + kl[1]) / 2
    loss, m = vo.flow_dppo_loss(**kw)
    peer_loss, pm = peer_verl_flow_dppo(s.old_lp, s.lp, s.adv, cfg, s.old_mean, s.mean, s.std_dev_t,
                                        s.sqrt_dt.flatten())
    torch.testing.assert_close(loss, peer_loss, **LTOL)
    assert m["actor/masked_fraction"] == float(pm["masked_fraction"])
    # rollout_is_weights: verl-omni multiplies the per-sample loss by the detached weights
    w = torch.tensor([1.0, 0.0, 0.5])
    loss_w, _ = vo.flow_grpo_loss(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv, config=cfg,
                                  rollout_is_weights=w)
    ratio = torch.exp(s.lp - s.old_lp)
    per = torch.maximum(-s.adv * ratio, -s.adv * torch.clamp(ratio, 0.95, 1.05))
    torch.testing.assert_close(loss_w, (per * w).mean(), **LTOL)
    with pytest.raises(ValueError, match="clip_ratio"):
        vo.flow_grpo_loss(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv, config=_cfg(adv_clip_max=5.0))
    with pytest.raises(ValueError, match="advantages"):
        vo.flow_grpo_loss(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv[:2], config=cfg)


def peer_verl_nft(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, t_expanded, reward_prob, cfg):
    """verl-omni DiffusionNFTLoss.compute_loss, written out."""
    c = cfg.diffusion_loss
    beta = c.mix_beta
    dims = tuple(range(1, x0.ndim))
    pos = beta * forward_prediction + (1.0 - beta) * old_prediction
    neg = (1.0 + beta) * old_prediction - beta * forward_prediction
    x0p, x0n = xt - t_expanded * pos, xt - t_expanded * neg
    wp = torch.abs(x0p.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=c.adaptive_weight_min).to(x0p.dtype)
    wn = torch.abs(x0n.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=c.adaptive_weight_min).to(x0n.dtype)
    lp, ln = ((x0p - x0) ** 2 / wp).mean(dim=dims), ((x0n - x0) ** 2 / wn).mean(dim=dims)
    policy = ((reward_prob * lp / beta + (1.0 - reward_prob) * ln / beta) * c.adv_clip_max).mean()
    kl = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=dims).mean()
    return policy + c.ref_kl_coef * kl


def test_diffusion_nft_loss_matches_verl_omni():
    g = torch.Generator().manual_seed(5)
    shape = (3, 4, 8, 8)
    xt, v, v_old, v_ref, x0 = (torch.randn(shape, generator=g) for _ in range(5))
    t = torch.tensor([0.3, 0.6, 0.9]).view(3, 1, 1, 1)
    p = torch.tensor([0.25, 0.5, 1.0])
    cfg = _cfg(mix_beta=1.0, adv_clip_max=5.0, ref_kl_coef=0.1, adaptive_weight_min=1e-5)
    loss, m = vo.diffusion_nft_loss(forward_prediction=v, old_prediction=v_old, ref_forward_prediction=v_ref, x0=x0,
                                    xt=xt, t_expanded=t, reward_prob=p, config=cfg)
    torch.testing.assert_close(loss, peer_verl_nft(v, v_old, v_ref, x0, xt, t, p, cfg), rtol=1e-5, atol=1e-6)
    cfg.diffusion_loss.adaptive_weight_min = 1e-3
    with pytest.raises(ValueError, match="adaptive_weight_min"):
        vo.diffusion_nft_loss(forward_prediction=v, old_prediction=v_old, ref_forward_prediction=v_ref, x0=x0, xt=xt,
                              t_expanded=t, reward_prob=p, config=cfg)


# ------------------------------------------------------------------------------------ the loop
@pytest.fixture(scope="module")
def sd3():
    return tiny_StableDiffusion3Pipeline(F32)


def verl_omni_loop(pipe, dtype, cfg, sde_type):
    """The SD3 rollout adapter (scheduler.step on float32 latents, the transformer fed their cast to the
    model dtype, the float32 trajectory stored) and the training adapter's
    ``forward_and_sample_previous_step`` (two forwards for CFG, then ``sample_previous_step`` on
    ``.float()`` inputs), the model as FSDP2 mixed precision runs it (parameters and float inputs in the
    model dtype). CFG is formed with ``flowrl.compat.flow_grpo.guidance`` in both (docs)."""
    transformer = copy.deepcopy(pipe.transformer).to(dtype)

    def forward(**kw):
        return transformer(**{k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
                              for k, v in kw.items()}, return_dict=False)[0]

    sched = scheduler(STEPS)
    e = sd3_embeds(dtype)

    def velocity(latents, timesteps):
        v = forward(hidden_states=latents, timestep=timesteps, encoder_hidden_states=e["pos"],
                    pooled_projections=e["pos_pooled"])
        if not cfg:
            return v.float()
        nv = forward(hidden_states=latents, timestep=timesteps, encoder_hidden_states=e["neg"],
                     pooled_projections=e["neg_pooled"])
        return flow_grpo.guidance(nv, v, SCALE, dtype=dtype)

    latents = torch.randn(BATCH, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    gen_ = torch.Generator().manual_seed(8)
    traj, log_probs = [latents.float().clone()], []
    sched.set_begin_index(0)
    with torch.no_grad():
        for t in sched.timesteps:
            noise_pred = velocity(latents.to(dtype), t.expand(BATCH))
            latents, log_prob, _, _ = sched.step(noise_pred.float(), t, latents, generator=gen_, noise_level=ETA,
                                                 sde_type=sde_type, return_dict=False)
            traj.append(latents.float().clone())
            log_probs.append(log_prob)
    all_latents, all_timesteps = torch.stack(traj, dim=1), sched.timesteps.repeat(BATCH, 1)
    dev = []
    for step in range(STEPS):
        noise_pred = velocity(all_latents[:, step], all_timesteps[:, step])
        _, lp, _, _, _ = sched.sample_previous_step(
            sample=all_latents[:, step].float(), model_output=noise_pred.float(), timestep=all_timesteps[:, step],
            noise_level=ETA, prev_sample=all_latents[:, step + 1].float(), sde_type=sde_type, return_logprobs=True,
            return_sqrt_dt=True)
        dev.append(ratio_dev(lp.detach(), log_probs[step]))
    return torch.stack(dev, dim=1).max().item()


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verl_omni_loop_ratio_exactly_one(sd3, dtype, cfg, sde_type):
    dev = verl_omni_loop(sd3, DTYPES[dtype], cfg, sde_type)
    print(f"\nverl-omni {dtype} CFG {'on' if cfg else 'off'} {sde_type}: max |ratio - 1| {dev:.3g}")
    assert dev == 0.0


# ------------------------------------------------------------------------------------ register()
FAKE_ALGOS = '''
from abc import ABC
from dataclasses import dataclass
from typing import Any

@dataclass
class DiffusionLossResult:
    loss: Any
    metrics: dict
    add_loss_metric: bool = False

class DiffusionLossFn(ABC):  # an ABC, as verl-omni's is
    required_model_output_keys = ()
    required_data_keys = ()
    def prepare_actor_batch(self, batch, reward_tensor, config):
        return batch

DIFFUSION_LOSS_REGISTRY = {}

def register_diffusion_loss(name):
    def decorator(cls):
        DIFFUSION_LOSS_REGISTRY[name] = cls()
        return cls
    return decorator

@register_diffusion_loss("flow_grpo")
class FlowGRPOLoss(DiffusionLossFn):
    pass

def get_diffusion_loss_fn(name):
    return DIFFUSION_LOSS_REGISTRY[name]
'''


def verl_omni_stand_in(tmp_path, monkeypatch):
    """A verl_omni package under tmp_path (FAKE_ALGOS, its scheduler module and an adapter that bound the
    scheduler's name), first on sys.path, with any verl_omni imported before dropped."""
    root = tmp_path / "verl_omni"
    for sub in ("trainer/diffusion", "pipelines/schedulers", "pipelines/sd3_flow_grpo"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for d in (root, root / "trainer", root / "trainer/diffusion", root / "pipelines"):
        (d / "__init__.py").write_text("")
    (root / "trainer/diffusion/diffusion_algos.py").write_text(FAKE_ALGOS)
    (root / "pipelines/schedulers/__init__.py").write_text("class FlowMatchSDEDiscreteScheduler:\n    pass\n")
    (root / "pipelines/sd3_flow_grpo/__init__.py").write_text(
        "from verl_omni.pipelines.schedulers import FlowMatchSDEDiscreteScheduler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("verl_omni")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.slow  # ~5 s: a stand-in verl-omni package run end to end (the full suite's)
def test_register_with_a_verl_omni_stand_in(tmp_path, monkeypatch):
    verl_omni_stand_in(tmp_path, monkeypatch)
    try:
        import verl_omni.pipelines.sd3_flow_grpo as adapter
        from verl_omni.trainer.diffusion import diffusion_algos as algos

        done = vo.register()
        assert set(done) == set(vo.LOSS_NAMES) | {"FlowMatchSDEDiscreteScheduler"}
        assert adapter.FlowMatchSDEDiscreteScheduler is vo.FlowMatchSDEDiscreteScheduler
        fn = algos.get_diffusion_loss_fn("flow_grpo")
        assert fn.required_data_keys == ("old_log_probs", "advantages")
        s = _setup([2, 2, 2])
        cfg = _cfg(adv_clip_max=5.0, clip_ratio=0.05)
        res = fn(config=cfg, model_output={"log_probs": s.lp}, data={"old_log_probs": s.old_lp, "advantages": s.adv})
        torch.testing.assert_close(res.loss, peer_verl_flow_grpo(s.old_lp, s.lp, s.adv, cfg)[0], **LTOL)
        assert fn.compute_loss(old_log_prob=s.old_lp, log_prob=s.lp, advantages=s.adv, config=cfg)[0] == res.loss
        vo.register(prefix="flowrl_", scheduler=False)
        assert "flowrl_grpo_guard" in algos.DIFFUSION_LOSS_REGISTRY
        # Ray and multiprocessing pickle loss objects: flowrl's classes live in flowrl.compat.verl_omni
        for key in ("flow_grpo", "flowrl_grpo_guard"):
            obj = algos.DIFFUSION_LOSS_REGISTRY[key]
            assert type(obj).__module__ == "flowrl.compat.verl_omni"
            back = pickle.loads(pickle.dumps(obj))
            assert type(back) is type(obj) and back.required_data_keys == obj.required_data_keys
        res2 = pickle.loads(pickle.dumps(fn))(config=cfg, model_output={"log_probs": s.lp},
                                              data={"old_log_probs": s.old_lp, "advantages": s.adv})
        assert torch.equal(res2.loss, res.loss)
        # a fresh process that imports flowrl (and verl-omni) but never called register() unpickles them
        blob = pickle.dumps(algos.DIFFUSION_LOSS_REGISTRY["flowrl_grpo_guard"])
        code = ("import pickle, sys; obj = pickle.loads(sys.stdin.buffer.read()); "
                "print(type(obj).__module__, type(obj).__name__, obj.required_data_keys[:2])")
        out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}).stdout
        assert out.decode().split()[:2] == ["flowrl.compat.verl_omni", "FlowRL_flowrl_grpo_guard"]
    finally:
        for name in [m for m in sys.modules if m.startswith("verl_omni")]:
            del sys.modules[name]


def test_register_without_verl_omni_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl_omni", None)
    with pytest.raises(ImportError, match="verl-omni"):
        vo.register()
