"""Each supported trainer's rollout + recompute loop, re-created here as the trainer's code runs it
(tiny random transformers, CFG, fp32 / bf16 / fp16 mixed precision), with flowrl swapped in by the
steps of docs/integration.md; asserts the first-update ratio is exactly 1 on every step.

The loops are written here from the trainers' code (not imported, not copied):

- Flow-GRPO: yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd,
  flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py (``pipeline_with_logprob``: the transformer's
  output rounded to ``prompt_embeds.dtype``, CFG formed in that dtype, the step in float32, the float32
  result stored and its cast fed on) and scripts/train_sd3.py (``compute_log_prob``: CFG formed on the
  transformer's float32 output; ``accelerator.prepare`` makes the transformer return float32 under
  mixed precision). The same two code paths are in the version with ``sde_type`` (@ 54809b5fcf4d).
- DanceGRPO: XueZeyue/DanceGRPO @ 15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344,
  fastvideo/train_grpo_wan_2_1.py (``run_sample_step`` / ``grpo_one_step`` with ``cfg_infer > 1``: the
  transformer under bf16 autocast, CFG formed in float32 in both, ``flux_step`` on float32 latents).
- Flow-Factory: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/models/stable_diffusion/sd3_5.py (``forward``: one function for the rollout and the
  training recompute, CFG inside it, then ``self.scheduler.step``; ``inference`` casts the returned
  latents back to the transformer's dtype) and src/flow_factory/scheduler/loader.py
  (``load_scheduler``: the class from the registry, built from ``dict(pipe.scheduler.config)`` plus the
  scheduler arguments).
- verl-omni: verl-project/verl-omni @ a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
  verl_omni/pipelines/sd3_flow_grpo/vllm_omni_rollout_adapter.py (the rollout: ``scheduler.step`` on the
  float32 latents, the transformer fed their cast to the model dtype, the float32 trajectory stored) and
  verl_omni/pipelines/sd3_flow_grpo/diffusers_training_adapter.py (``forward_and_sample_previous_step``:
  CFG, then ``scheduler.sample_previous_step(..., prev_sample=..., return_sqrt_dt=True)``).

``pytest tests/compat/test_trainer_loops.py -s`` prints the ratio table quoted in docs/integration.md.
"""
import math
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from flowrl.compat import dance_grpo, flow_factory, flow_grpo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from peer_steps import peer_flow_grpo  # noqa: E402
from tiny_pipelines import tiny_StableDiffusion3Pipeline, tiny_WanPipeline  # noqa: E402
from trainer_loops import BATCH, BF16, DTYPES, ETA, F32, SCALE, STEPS, ratio_dev, sd3_embeds  # noqa: E402

pytestmark = pytest.mark.slow  # re-creates each trainer's rollout + recompute loop on tiny diffusers transformers (./run test -m 'not slow' skips it)

RESULTS = {}


def _quiet(fn):
    import logging

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    return fn


@pytest.fixture(scope="module")
def sd3():
    return _quiet(tiny_StableDiffusion3Pipeline)(F32)


@pytest.fixture(scope="module")
def wan():
    return _quiet(tiny_WanPipeline)(F32)


def prepared(transformer, dtype):
    """The transformer as ``accelerator.prepare`` leaves it under mixed precision: its forward runs
    under autocast and its output is upcast to float32 (accelerate's ``convert_outputs_to_fp32``)."""

    def forward(**kwargs):
        if dtype == F32:
            return transformer(**kwargs, return_dict=False)[0]
        with torch.autocast("cpu", dtype=dtype):
            out = transformer(**kwargs, return_dict=False)[0]
        return out.float()

    return forward


def sd3_scheduler(steps=STEPS):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    return sched


# ------------------------------------------------------------------------------------ Flow-GRPO
def flow_grpo_loop(pipe, dtype, cfg, variant):
    """Flow-GRPO's rollout (pipeline_with_logprob) and its trainer's recompute (compute_log_prob) for
    every step; returns max |ratio - 1|. ``variant``: "peer" (Flow-GRPO as is), "import" (the import
    swapped), "out_dtype" (docs step 2), "guidance" (docs steps 2 and 3: the documented setup)."""
    step_fn = peer_flow_grpo if variant == "peer" else flow_grpo.sde_step_with_logprob
    model = prepared(pipe.transformer, dtype)
    sched = sd3_scheduler()
    e = sd3_embeds(dtype)
    prompt_embeds = torch.cat([e["neg"], e["pos"]]) if cfg else e["pos"]
    pooled = torch.cat([e["neg_pooled"], e["pos_pooled"]]) if cfg else e["pos_pooled"]

    def cfg_velocity(noise_pred, embeds_dtype, in_pipeline):
        uncond, text = noise_pred.chunk(2)
        if variant == "guidance":
            return flow_grpo.guidance(uncond, text, SCALE, dtype=embeds_dtype)
        return uncond + SCALE * (text - uncond)  # bf16 in the pipeline, float32 in compute_log_prob

    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(BATCH, 4, 8, 8, generator=torch.Generator().manual_seed(3)).to(prompt_embeds.dtype)
    all_latents, all_log_probs = [latents], []
    with torch.no_grad():
        for t in sched.timesteps:
            inp = torch.cat([latents] * 2) if cfg else latents
            noise_pred = model(hidden_states=inp, timestep=t.expand(inp.shape[0]), encoder_hidden_states=prompt_embeds,
                               pooled_projections=pooled)
            noise_pred = noise_pred.to(prompt_embeds.dtype)
            if cfg:
                noise_pred = cfg_velocity(noise_pred, prompt_embeds.dtype, True)
            latents_dtype = latents.dtype
            extra = dict(out_dtype=latents_dtype) if variant in ("out_dtype", "guidance") else {}
            latents, log_prob, _, _ = step_fn(sched, noise_pred.float(), t.unsqueeze(0), latents.float(),
                                              noise_level=ETA, generator=gen, **extra)
            all_latents.append(latents)
            all_log_probs.append(log_prob)
            if latents.dtype != latents_dtype:
                latents = latents.to(latents_dtype)
    stacked, log_probs = torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)
    sample = dict(latents=stacked[:, :-1], next_latents=stacked[:, 1:], timesteps=sched.timesteps.repeat(BATCH, 1),
                  log_probs=log_probs)
    embeds, pooled_embeds = prompt_embeds, pooled  # train_neg_prompt_embeds[:B] with the sample's embeds
    dev = []
    for j in range(STEPS):  # compute_log_prob, with gradients as in training
        if cfg:
            noise_pred = model(hidden_states=torch.cat([sample["latents"][:, j]] * 2),
                               timestep=torch.cat([sample["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                               pooled_projections=pooled_embeds)
            noise_pred = cfg_velocity(noise_pred, embeds.dtype, False)
        else:
            noise_pred = model(hidden_states=sample["latents"][:, j], timestep=sample["timesteps"][:, j],
                               encoder_hidden_states=embeds, pooled_projections=pooled_embeds)
        log_prob = step_fn(sched, noise_pred.float(), sample["timesteps"][:, j], sample["latents"][:, j].float(),
                           prev_sample=sample["next_latents"][:, j].float(), noise_level=ETA)[1]
        dev.append(ratio_dev(log_prob.detach(), sample["log_probs"][:, j]))
    return torch.stack(dev, dim=1).max().item()


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_flow_grpo_loop_ratio_exactly_one_with_the_documented_steps(sd3, dtype, cfg):
    dev = flow_grpo_loop(sd3, DTYPES[dtype], cfg, "guidance")
    RESULTS[("Flow-GRPO", dtype, cfg, "documented steps")] = dev
    assert dev == 0.0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flow_grpo_cfg_without_the_guidance_helper_is_not_one(sd3, dtype):
    """The mismatch the helper removes: with the import swapped and out_dtype set, Flow-GRPO's own
    CFG lines (bf16 / fp16 in the pipeline, float32 in the trainer) still give ratio != 1; without CFG
    the same loop is exact."""
    dev = flow_grpo_loop(sd3, DTYPES[dtype], True, "out_dtype")
    RESULTS[("Flow-GRPO", dtype, True, "import + out_dtype, Flow-GRPO's CFG lines")] = dev
    assert dev > 0
    assert flow_grpo_loop(sd3, DTYPES[dtype], False, "out_dtype") == 0.0
    peer = flow_grpo_loop(sd3, DTYPES[dtype], True, "peer")
    RESULTS[("Flow-GRPO", dtype, True, "Flow-GRPO as is")] = peer
    assert peer > 0
    # the numbers docs/integration.md quotes: bf16's exactly; fp16's vary with the CPU's half-precision
    # arithmetic (2.9e-5 / 2.9e-3 measured without AVX-512 FP16, 4.1e-5 / 2.1e-3 with it): their decade
    if dtype == "bf16":
        assert (f"{dev:.2g}", f"{peer:.2g}") == ("0.00039", "0.035")
    else:
        assert 1e-5 < dev < 1e-4 and 1e-3 < peer < 1e-2, (dev, peer)


def test_flow_grpo_fp32_cfg_is_exact_with_the_out_dtype_step_alone(sd3):
    assert flow_grpo_loop(sd3, F32, True, "out_dtype") == 0.0


def test_guidance_helper_values_gradient_and_bad_input():
    g = torch.Generator().manual_seed(0)
    u, t = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    out = flow_grpo.guidance(u, t, 4.5)
    assert out.dtype == F32 and torch.equal(out, u + 4.5 * (t - u))
    # rounding to the embeddings' dtype first, then float32: the same bits from bf16 inputs and from
    # their float32 upcast (the pipeline's and the trainer's views of the same prediction)
    ub, tb = u.to(BF16), t.to(BF16)
    assert torch.equal(flow_grpo.guidance(ub, tb, 4.5, dtype=BF16), flow_grpo.guidance(ub.float(), tb.float(), 4.5,
                                                                                      dtype=BF16))
    tt = t.clone().requires_grad_(True)
    flow_grpo.guidance(u, tt, 4.5, dtype=BF16).sum().backward()
    assert torch.equal(tt.grad, torch.full_like(t, 4.5))
    with pytest.raises(ValueError, match="noise_pred_text"):
        flow_grpo.guidance(u, t[:1], 4.5)
    with pytest.raises(TypeError, match="noise_pred_uncond"):
        flow_grpo.guidance(u.long(), t, 4.5)
    with pytest.raises(TypeError, match="guidance_scale"):
        flow_grpo.guidance(u, t, "4.5")
    with pytest.raises(ValueError, match="guidance_scale"):
        flow_grpo.guidance(u, t, float("nan"))
    with pytest.raises(TypeError, match="dtype"):
        flow_grpo.guidance(u, t, 4.5, dtype=torch.int32)


# ------------------------------------------------------------------------------------ DanceGRPO
def dance_grpo_loop(pipe, dtype, cfg_infer, eta=0.3):
    """DanceGRPO's run_sample_step / grpo_one_step (Wan 2.1) with flowrl's flux_step; max |ratio - 1|."""
    model = prepared(pipe.transformer, dtype)
    sigma_schedule = torch.linspace(1, 0, STEPS + 1)
    shift = 3.0
    sigma_schedule = shift * sigma_schedule / (1 + (shift - 1) * sigma_schedule)  # DanceGRPO's sd3_time_shift
    g = torch.Generator().manual_seed(4)
    enc = torch.randn(BATCH, 8, 32, generator=g).to(dtype)
    neg = torch.randn(BATCH, 8, 32, generator=g).to(dtype)
    z = torch.randn(BATCH, 16, 2, 4, 4, generator=g).to(BF16 if dtype != F32 else F32)

    def velocity(x, timesteps):
        if cfg_infer > 1:
            pred = model(hidden_states=torch.cat([x, x]), timestep=torch.cat([timesteps, timesteps]),
                         encoder_hidden_states=torch.cat([enc, neg]))
            model_pred, uncond_pred = pred.chunk(2)
            return uncond_pred.to(F32) + cfg_infer * (model_pred.to(F32) - uncond_pred.to(F32))
        return model(hidden_states=x, timestep=timesteps, encoder_hidden_states=enc)

    torch.manual_seed(9)  # flux_step draws from the global RNG, as DanceGRPO
    all_latents, all_log_probs = [z], []
    with torch.no_grad():
        for i in range(STEPS):
            timesteps = torch.full([BATCH], int(sigma_schedule[i] * 1000), dtype=torch.long)
            pred = velocity(z, timesteps)
            z, _, log_prob = dance_grpo.flux_step(pred, z.to(F32), eta, sigma_schedule, i, None, True, True)
            all_latents.append(z)
            all_log_probs.append(log_prob)
    all_latents, all_log_probs = torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)
    dev = []
    for i in range(STEPS):  # train_one_step -> grpo_one_step
        timesteps = torch.full([BATCH], int(sigma_schedule[i] * 1000), dtype=torch.long)
        pred = velocity(all_latents[:, i], timesteps)
        log_prob = dance_grpo.flux_step(pred, all_latents[:, i].to(F32), eta, sigma_schedule, i,
                                        all_latents[:, i + 1].to(F32), True, True)[2]
        dev.append(ratio_dev(log_prob.detach(), all_log_probs[:, i]))
    return torch.stack(dev, dim=1).max().item()


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dance_grpo_loop_ratio_exactly_one(wan, dtype, cfg):
    dev = dance_grpo_loop(wan, DTYPES[dtype], 5.0 if cfg else 1.0)
    RESULTS[("DanceGRPO", dtype, cfg, "import swapped")] = dev
    assert dev == 0.0


# ---------------------------------------------------------------------------------- Flow-Factory
def flow_factory_scheduler(steps=STEPS, noise_level=ETA, dynamics_type="Flow-SDE"):
    """load_scheduler as Flow-Factory runs it once ``register()`` has pointed its registry here: the
    class imported from the registered path, built from the pipeline scheduler's config plus the
    scheduler arguments, then ``set_timesteps``."""
    import importlib

    module, name = flow_factory.SCHEDULER_PATH.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    base = dict(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).config)
    base.update(noise_level=noise_level, num_sde_steps=None, sde_steps=None, seed=42, dynamics_type=dynamics_type)
    sched = cls(**base)
    sched.set_timesteps(steps)
    return sched


def flow_factory_loop(pipe, dtype, cfg, dynamics_type):
    """Flow-Factory's SD3 adapter: ``inference`` (rollout) and the trainer's replay both call ``forward``
    (CFG, then ``scheduler.step``); the rollout casts the returned latents to the transformer's dtype."""
    sched = flow_factory_scheduler(dynamics_type=dynamics_type)
    model = prepared(pipe.transformer, dtype)
    e = sd3_embeds(dtype)
    scale = SCALE if cfg else 1.0

    def forward(t, t_next, latents, next_latents=None, noise_level=None, compute_log_prob=True):
        timestep = t.expand(BATCH).to(latents.dtype)
        if scale > 1.0:
            inp, ts = torch.cat([latents, latents]), timestep.repeat(2)
            enc, pooled = torch.cat([e["neg"], e["pos"]]), torch.cat([e["neg_pooled"], e["pos_pooled"]])
        else:
            inp, ts, enc, pooled = latents, timestep, e["pos"], e["pos_pooled"]
        noise_pred = model(hidden_states=inp, timestep=ts, encoder_hidden_states=enc, pooled_projections=pooled)
        if scale > 1.0:
            uncond, text = noise_pred.chunk(2)
            noise_pred = uncond + scale * (text - uncond)
        return sched.step(noise_pred=noise_pred, timestep=t, latents=latents, timestep_next=t_next,
                          next_latents=next_latents, compute_log_prob=compute_log_prob, return_dict=True,
                          noise_level=noise_level, generator=gen if next_latents is None else None)

    gen = torch.Generator().manual_seed(6)
    timesteps = sched.timesteps
    latents = torch.randn(BATCH, 4, 8, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    stored, log_probs = [latents], {}
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            level = sched.get_noise_level_for_timestep(t)
            t_next = timesteps[i + 1] if i + 1 < len(timesteps) else torch.tensor(0)
            out = forward(t, t_next, latents, noise_level=level, compute_log_prob=level > 0)
            latents = out.next_latents.to(dtype)  # cast_latents(..., default_dtype=transformer dtype)
            stored.append(latents)
            if level > 0:
                log_probs[i] = out.log_prob
    dev = []
    for i in sorted(log_probs):  # the trainer's optimize: forward with next_latents on the SDE steps
        t = timesteps[i]
        t_next = timesteps[i + 1] if i + 1 < len(timesteps) else torch.tensor(0)
        out = forward(t, t_next, stored[i], next_latents=stored[i + 1], noise_level=sched.get_noise_level_for_timestep(t))
        dev.append(ratio_dev(out.log_prob.detach(), log_probs[i]))
    assert len(dev) == STEPS - 1  # every step but the last is an SDE step by default
    return torch.stack(dev, dim=1).max().item()


@pytest.mark.parametrize("dynamics_type", ["Flow-SDE", "Dance-SDE", "CPS"])
@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flow_factory_loop_ratio_exactly_one(sd3, dtype, cfg, dynamics_type):
    dev = flow_factory_loop(sd3, DTYPES[dtype], cfg, dynamics_type)
    RESULTS[("Flow-Factory", dtype, cfg, f"registered scheduler, {dynamics_type}")] = dev
    assert dev == 0.0


FAKE_REGISTRY = '''
import importlib
_SCHEDULER_REGISTRY = {"FlowMatchEulerDiscreteScheduler": "flow_factory.scheduler.own.FlowMatchEulerDiscreteSDEScheduler"}

def register_scheduler(diffusers_class_name, sde_class_path):
    _SCHEDULER_REGISTRY[diffusers_class_name] = sde_class_path

def get_sde_scheduler_class(scheduler):
    name = scheduler.__name__ if isinstance(scheduler, type) else type(scheduler).__name__
    module, cls = _SCHEDULER_REGISTRY[name].rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)
'''

FAKE_TRAIN = '''
import argparse, json, os, sys
from diffusers import FlowMatchEulerDiscreteScheduler
from flow_factory.scheduler import get_sde_scheduler_class

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    args, unknown = parser.parse_known_args()
    pipe_scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    cls = get_sde_scheduler_class(pipe_scheduler)
    sched = cls(**dict(pipe_scheduler.config), noise_level=0.5, sde_steps=None, num_sde_steps=None, seed=1,
                dynamics_type="CPS")
    with open(os.environ["FAKE_FF_OUT"], "w") as f:
        json.dump({"config": args.config, "unknown": unknown, "class": cls.__module__ + "." + cls.__name__,
                   "noise_level": sched.noise_level, "dynamics_type": sched.dynamics_type}, f)
'''


def test_flow_factory_entry_point_registers_then_runs_flow_factory_train(tmp_path):
    """``python -m flowrl.compat.flow_factory cfg.yaml ...`` against a stand-in ``flow_factory`` package
    written here with Flow-Factory's registry contract (scheduler/registry.py: ``register_scheduler``
    maps a diffusers class name to a class path; ``load_scheduler`` imports the class registered for the
    pipeline's scheduler and builds it from its config plus the scheduler arguments) and a ``train.main``
    that parses ``sys.argv`` as Flow-Factory's does."""
    import json
    import subprocess

    pkg = tmp_path / "flow_factory"
    (pkg / "scheduler").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler" / "__init__.py").write_text(FAKE_REGISTRY)
    (pkg / "train.py").write_text(FAKE_TRAIN)
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               FAKE_FF_OUT=str(out))
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "flowrl.compat.flow_factory",
                           "cfg.yaml", "--extra", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got == {"config": "cfg.yaml", "unknown": ["--extra", "1"], "class": flow_factory.SCHEDULER_PATH,
                   "noise_level": 0.5, "dynamics_type": "CPS"}


def test_flow_factory_register_without_flow_factory_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flow_factory", None)
    with pytest.raises(ImportError, match="Flow-Factory"):
        flow_factory.register()


def test_print_ratio_table():
    """Runs last in this file (pytest keeps file order): the table docs/integration.md quotes."""
    if not RESULTS:
        pytest.skip("run the whole file to print the table")
    print("\nfirst-update max |ratio - 1| over every step, trainer loops re-created (tests/compat/test_trainer_loops.py):")
    for (trainer, dtype, cfg, setup), dev in sorted(RESULTS.items(), key=lambda kv: kv[0]):
        print(f"  {trainer:12s} {dtype:5s} CFG {'on ' if cfg else 'off'}  {setup:45s} {dev:.3g}")
