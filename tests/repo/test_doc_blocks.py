"""Every ```python block of README.md and docs/*.md is run by a test, as written, or says why it is not.

The blocks are found by regex (a new block is picked up), and each one must be, exactly one of:

- run by a dedicated existing test: ``EXISTING`` maps (file, a substring only that block has) to the
  test, whose function must exist;
- run here, as written: ``RUNNERS`` maps (file, substring) to a function that executes the block in a
  namespace holding the few free names it uses (a tiny pipeline, a tiny rollout, ...) and asserts what
  the block promises (a ratio of exactly 1, a dtype, a shape, the bits of another call);
- marked in the doc: its first line is ``# not run in CI: <the reason>``.

Anything else fails, naming the file, the line and the block's first line.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import types
from typing import Optional

import pytest
import torch

import flowrl

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "# not run in CI:"
DOCS = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^([ \t]*)```(?:python|py)[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence
    code: str  # dedented by the fence's indent

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code.strip() else ""


def doc_blocks(text: str, file: str):
    for m in FENCE.finditer(text):
        indent, body = m.group(1), m.group(2)
        lines = [line[len(indent):] if line.startswith(indent) else line for line in body.splitlines()]
        yield Block(file, text.count("\n", 0, m.start()) + 1, "\n".join(lines).rstrip() + "\n")


BLOCKS = [b for f in DOCS for b in doc_blocks((ROOT / f).read_text(), f)]


# --------------------------------------------------------------------------------------- helpers


def run(block: Block, namespace: dict, code: Optional[str] = None) -> dict:
    """Execute the block (or ``code``, the block with lines added) in ``namespace`` and return it."""
    exec(compile(block.code if code is None else code, f"{block.file}:{block.line}", "exec"), namespace)
    return namespace


def collect(code: str, name: str, into: str) -> str:
    """The block with ``<into>.append(<name>)`` after every one-line assignment ``<name> = ...``, at
    its indent (what the tests check is then the block's own value, step by step)."""
    out, added = [], 0
    for line in code.splitlines():
        out.append(line)
        m = re.match(rf"^(\s*){name} = ", line)
        if m:
            statement = line.split("#", 1)[0]
            assert statement.count("(") == statement.count(")"), f"{name} = ... spans several lines: {line!r}"
            out.append(f"{m.group(1)}{into}.append({name})")
            added += 1
    assert added, f"no line assigns {name}"
    return "\n".join(out) + "\n"


def ones(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and torch.equal(t, torch.ones_like(t))


def sd3(dtype=torch.float32, flowrl_scheduler=False):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import tiny_pipelines as tp

    pipe = tp.tiny_StableDiffusion3Pipeline(dtype)
    if flowrl_scheduler:
        pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    return pipe, tp


def sd3_embeds(dtype, batch):
    g = torch.Generator().manual_seed(123)
    return torch.randn(batch, 5, 16, generator=g).to(dtype), torch.randn(batch, 8, generator=g).to(dtype)


def sd3_replay_ratios(pipe, traj):
    """Every step replayed from the recorded model calls: the ratios."""
    ratios = []
    with torch.no_grad():
        for j in range(traj.num_steps):
            v = traj.step_model_output(j, [pipe.transformer(**kw) for kw in traj.model_calls(j)])
            ratios.append(torch.exp(traj.step_log_prob(j, v) - traj.log_probs[:, j]))
    return ratios


def elementwise_rollout(steps=3, batch=2, shape=(4, 8), dtype=torch.bfloat16):
    """A rollout of flowrl.sde_step with an elementwise 'model' (a row's output does not depend on the
    batch): the schedule, the latents [B, T + 1, ...], the log-probs [B, T] and the model."""
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    bias = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(7))

    def model(x, sigma):
        return ((x.float() * -0.9 + bias) * (sigma + 0.1)).to(dtype)

    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    latents, log_probs = [x], []
    gens = [torch.Generator().manual_seed(11 + b) for b in range(batch)]
    for i in range(steps):
        out = flowrl.sde_step(latents[-1], model(latents[-1], sched.sigmas[i]), sched.sigmas, i, generator=gens)
        latents.append(out.prev_sample)
        log_probs.append(out.log_prob)
    return sched, torch.stack(latents, 1), torch.stack(log_probs, 1), model


# ----------------------------------------------------------------------------------- branching.md


def run_branching_pipeline(block, tmp_path, monkeypatch):
    pipe, tp = sd3(torch.float32)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.float32, batch=2, guidance_scale=4.5)
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    ns = run(block, {"flowrl": flowrl, "torch": torch, "pipe": pipe, "kwargs": kwargs, "latents": latents})
    traj = ns["traj"]
    assert ns["L"] == 4 and traj.batch_size == 8 and traj.tree.num_rows == 8
    # rows of a sample share the fork step's input (step 1) and differ from its output on
    assert torch.equal(traj.latents[0, 1], traj.latents[3, 1])
    assert not torch.equal(traj.latents[0, 2], traj.latents[2, 2])
    assert all(ones(r) for r in sd3_replay_ratios(pipe, traj))


def run_branching_driver(block, tmp_path, monkeypatch):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    g = torch.Generator().manual_seed(0)
    x0, embeds = torch.randn(2, 4, 8, generator=g), torch.randn(2, 1, 8, generator=g)

    def model(x, t, e):  # elementwise: a row's output does not depend on the batch
        return torch.sin(x * 1.3 + e) * (t / 1000 + 0.1)

    ns = run(block, {"model": model, "timesteps": sched.timesteps, "embeds": embeds, "x0": x0,
                     "sigmas": sched.sigmas.clone()})
    traj = ns["traj"]
    assert traj.batch_size == 2 * 16 and traj.tree.num_rows == 32  # k = 4 at two forks
    roots = torch.arange(2).repeat_interleave(16)
    for j in range(traj.num_steps):
        v = model(traj.latents[:, j], sched.timesteps[j], embeds[roots])
        assert ones(torch.exp(traj.step_log_prob(j, v) - traj.log_probs[:, j])), j


# ---------------------------------------------------------------------------------------- guide.md


def run_api(block, tmp_path, monkeypatch):
    # the keywords shown are keyword-only parameters, with their defaults; the positional names are the signature's
    calls = [n for n in ast.walk(ast.parse(block.code)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "flowrl"]
    assert sorted(c.func.attr for c in calls) == ["sde_step", "step_kl", "step_log_prob"]
    for call in calls:
        params = inspect.signature(getattr(flowrl, call.func.attr)).parameters
        positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [a.id for a in call.args] == positional, call.func.attr
        for kw in call.keywords:
            p = params[kw.arg]
            assert p.kind is p.KEYWORD_ONLY and p.default == ast.literal_eval(kw.value), (call.func.attr, kw.arg)
    g = torch.Generator().manual_seed(0)
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    sample, model_output, prev_sample, ref = (torch.randn(2, 4, 8, generator=g).bfloat16() for _ in range(4))
    ns = run(block, {"sample": sample, "model_output": model_output, "prev_sample": prev_sample,
                     "ref_model_output": ref, "sigmas": sched.sigmas, "step_index": 1})
    out = ns["out"]
    assert out.prev_sample.dtype == torch.bfloat16 and out.prev_sample.shape == sample.shape
    assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (2,)
    assert out.prev_sample_mean.dtype == torch.float32 and out.prev_sample_mean.shape == sample.shape
    assert out.std_dev.dtype == torch.float32 and out.std_dev.shape == (2,)
    assert ns["lp"].shape == ns["kl"].shape == (2,)


def run_step_and_recompute(block, tmp_path, monkeypatch):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 8, generator=g).bfloat16(), torch.randn(2, 4, 8, generator=g).bfloat16()
    v_new = v.clone().requires_grad_()
    ns = run(block, {"torch": torch, "flowrl": flowrl, "scheduler": sched, "seed": 5, "B": 2, "x": x, "v": v,
                     "i": 1, "v_new": v_new})
    assert ns["x_next"].dtype == torch.bfloat16
    assert ones(ns["ratio"].detach()) and ns["lp_new"].requires_grad


def run_swap(block, tmp_path, monkeypatch):
    pipe, tp = sd3(torch.float32)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.float32, steps=2)
    before = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    config = dict(pipe.scheduler.config)
    run(block, {"flowrl": flowrl, "pipe": pipe})
    assert type(pipe.scheduler) is flowrl.FlowMatchEulerDiscreteScheduler
    assert {k: v for k, v in pipe.scheduler.config.items() if not k.startswith("_")} == \
        {k: v for k, v in config.items() if not k.startswith("_")}
    assert torch.equal(pipe(generator=torch.Generator().manual_seed(0), **kwargs).images, before)  # diffusers' bits


def run_dropin_recompute(block, tmp_path, monkeypatch):
    """guide.md's drop-in block and scheduler.md's recompute block: batch 4 (one generator each), 10 steps."""
    pipe, _ = sd3(torch.bfloat16)
    embeds, pooled = sd3_embeds(torch.bfloat16, 4)
    ns = run(block, {"pipe": pipe, "embeds": embeds, "pooled": pooled})
    traj = ns["traj"]
    assert type(pipe.scheduler) is flowrl.FlowMatchEulerDiscreteScheduler
    assert traj.num_steps == 10 and traj.latents.shape[:2] == (4, 11) and traj.latents.dtype == torch.bfloat16
    assert torch.equal(ns["log_prob"], traj.log_probs[:, ns["i"]]) and bool((traj.log_probs[:, 3] != 0).all())
    if "ratio" in ns:
        assert ones(ns["ratio"].detach())


def tiny_stable_diffusion():
    """A StableDiffusionPipeline with random tiny components (no text encoder: prompt embeddings are passed)."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=8, norm_num_groups=4, attention_head_dim=2,
    )
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    )
    scheduler = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(
        unet=unet, scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_ddim(block, tmp_path, monkeypatch):
    pipe = tiny_stable_diffusion()
    g = torch.Generator().manual_seed(1)
    embeds, neg = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    ns = run(block, {"flowrl": flowrl, "torch": torch, "pipe": pipe, "embeds": embeds, "neg": neg,
                     "gens": [torch.Generator().manual_seed(s) for s in range(2)]})
    traj = ns["traj"]
    assert type(pipe.scheduler) is flowrl.DDIMScheduler and traj.mode == "ddim" and traj.sigmas.shape == (100,)
    assert torch.equal(ns["log_prob"].detach(), traj.log_probs[:, 3]) and bool((traj.log_probs[:, 3] != 0).all())


def run_dpm_sde(block, tmp_path, monkeypatch):
    pipe, tp = sd3(torch.float32, flowrl_scheduler=True)
    ns = run(block, {"flowrl": flowrl, "torch": torch, "pipe": pipe, "sched": pipe.scheduler,
                     "pipeline_kwargs": tp.StableDiffusion3Pipeline_inputs(torch.float32, guidance_scale=4.5),
                     "gens": [torch.Generator().manual_seed(s) for s in range(2)]})
    traj = ns["traj"]
    assert traj.mode == "dpm_sde" and traj.prev_x0_preds is not None
    assert torch.equal(ns["lp"].detach(), traj.log_probs[:, 2]) and bool((traj.log_probs[:, 2] != 0).all())


def run_guide_wire(block, tmp_path, monkeypatch):
    from flowrl.data.serialization import to_wire

    sched, latents, log_probs, model = elementwise_rollout()
    response = to_wire({"latents": latents, "log_probs": log_probs, "sigmas": sched.sigmas})
    response_json = json.loads(json.dumps(response))
    i = 1
    ns = run(block, {"flowrl": flowrl, "torch": torch, "response_json": response_json, "device": "cpu", "i": i,
                     "v": model(latents[:, i], sched.sigmas[i])})
    assert ns["latents"].dtype == torch.bfloat16 and torch.equal(ns["latents"], latents)
    assert ones(ns["ratio"])


# ---------------------------------------------------------------------------------- integration.md


def run_flow_grpo_import(block, tmp_path, monkeypatch):
    from flowrl.compat import flow_grpo

    assert run(block, {})["sde_step_with_logprob"] is flow_grpo.sde_step_with_logprob


def run_flow_grpo_out_dtype(block, tmp_path, monkeypatch):
    from flowrl.compat.flow_grpo import sde_step_with_logprob

    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    latents, noise_pred = torch.randn(2, 4, 8, generator=g).bfloat16(), torch.randn(2, 4, 8, generator=g).bfloat16()
    t = sched.timesteps[1]
    torch.manual_seed(0)
    ns = run(block, {"self": types.SimpleNamespace(scheduler=sched), "noise_pred": noise_pred, "t": t,
                     "latents": latents, "noise_level": 0.7, "all_latents": [],
                     "sde_step_with_logprob": sde_step_with_logprob})
    stored = ns["all_latents"][-1]
    assert stored is ns["latents"] and stored.dtype == torch.bfloat16
    # the trainer's unchanged recompute from the stored latents: the same bits
    lp = sde_step_with_logprob(sched, noise_pred.float(), t.unsqueeze(0), latents.float(), noise_level=0.7,
                               prev_sample=stored.float())[1]
    assert ones(torch.exp(lp - ns["log_prob"]))


def run_flow_grpo_guidance(block, tmp_path, monkeypatch):
    """The pipeline's lines (bf16 predictions) and the trainer's (the same predictions in float32, as
    accelerate returns them) give the same bits."""
    pipeline_part, trainer_part = block.code.split("# scripts/train_sd3.py")
    trainer_part = block.first_line + "\n# scripts/train_sd3.py" + trainer_part
    assert block.first_line == "from flowrl.compat.flow_grpo import guidance"
    g = torch.Generator().manual_seed(0)
    out = torch.randn(4, 4, 8, generator=g)  # the transformer's [uncond; cond] output
    embeds = torch.randn(2, 3, 8, generator=g).bfloat16()
    pipe_ns = run(block, {"noise_pred": out.bfloat16(), "self": types.SimpleNamespace(guidance_scale=4.5),
                          "prompt_embeds": embeds}, code=pipeline_part)
    train_ns = run(block, {"noise_pred": out, "embeds": embeds,
                           "config": types.SimpleNamespace(sample=types.SimpleNamespace(guidance_scale=4.5))},
                   code=trainer_part)
    assert pipe_ns["noise_pred"].dtype == torch.float32 and torch.equal(pipe_ns["noise_pred"], train_ns["noise_pred"])
    u, c = out.chunk(2)  # what the helper replaces does differ: bf16 guidance against float32 guidance
    assert not torch.equal((u.bfloat16() + 4.5 * (c.bfloat16() - u.bfloat16())).float(), u + 4.5 * (c - u))


def run_flow_grpo_kl(block, tmp_path, monkeypatch):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(2, 4, 8, generator=g) for _ in range(3))
    j = 2
    ns = run(block, {"flowrl": flowrl, "sample": {"timesteps": sched.timesteps.repeat(2, 1).bfloat16()}, "j": j,
                     "pipeline": types.SimpleNamespace(scheduler=sched), "x": x, "noise_pred": v,
                     "noise_pred_ref": v_ref,
                     "config": types.SimpleNamespace(sample=types.SimpleNamespace(noise_level=0.7))})
    assert ns["idx"].tolist() == [j, j]  # bf16 timesteps found
    assert torch.equal(ns["kl"], flowrl.step_kl(x, v, v_ref, sched.sigmas, j, mode="sde", noise_level=0.7))


def run_flow_grpo_solver(block, tmp_path, monkeypatch):
    from flowrl.compat.flow_grpo import flow_grpo_step

    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    z, pred = torch.randn(2, 4, 8, generator=g).bfloat16(), torch.randn(2, 4, 8, generator=g).bfloat16()
    sigmas = sched.sigmas.float()
    torch.manual_seed(0)
    ns = run(block, {"pred": pred, "z": z, "eta": 0.7, "determistic": False, "sigma_schedule": sigmas, "i": 1,
                     "dtype": torch.bfloat16})
    assert ns["z"].dtype == torch.bfloat16
    # recomputed with the same function and prev_sample= the stored latent: the same bits
    lp = flow_grpo_step(model_output=pred.float(), latents=z.float(), eta=0.7, sigmas=sigmas, index=1,
                        prev_sample=ns["z"].float(), out_dtype=torch.bfloat16)[2]
    assert ones(torch.exp(lp - ns["log_prob"]))


def run_dance_grpo_import(block, tmp_path, monkeypatch):
    from flowrl.compat import dance_grpo

    assert run(block, {})["flux_step"] is dance_grpo.flux_step


def run_verl_omni(block, tmp_path, monkeypatch):
    """On tests/compat/test_verl_omni.py's stand-in of verl-omni (its registry and scheduler module)."""
    import flowrl.compat.verl_omni as vo

    from test_verl_omni import verl_omni_stand_in

    verl_omni_stand_in(tmp_path, monkeypatch)
    try:
        ns = run(block, {})
        from verl_omni.pipelines import schedulers
        from verl_omni.trainer.diffusion import diffusion_algos as algos

        assert ns["FlowMatchSDEDiscreteScheduler"] is vo.FlowMatchSDEDiscreteScheduler
        assert schedulers.FlowMatchSDEDiscreteScheduler is vo.FlowMatchSDEDiscreteScheduler
        for name in vo.LOSS_NAMES:
            for key in (name, "flowrl_" + name):
                assert type(algos.DIFFUSION_LOSS_REGISTRY[key]).__module__ == "flowrl.compat.verl_omni", key
    finally:
        for name in [m for m in sys.modules if m == "verl_omni" or m.startswith("verl_omni.")]:
            del sys.modules[name]


def sd3_cfg_policy(pipe, kwargs):
    """The velocity SD3's pipeline steps with: its batched CFG call and guidance line, as the pipeline runs them."""
    embeds = torch.cat([kwargs["negative_prompt_embeds"], kwargs["prompt_embeds"]])
    pooled = torch.cat([kwargs["negative_pooled_prompt_embeds"], kwargs["pooled_prompt_embeds"]])
    scale = kwargs["guidance_scale"]

    def policy(x, t):
        with torch.no_grad():
            out = pipe.transformer(hidden_states=torch.cat([x, x]), timestep=t.expand(2 * x.shape[0]),
                                   encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]
        uncond, cond = out.chunk(2)
        return uncond + scale * (cond - uncond)

    return policy


def run_integration_recorder(block, tmp_path, monkeypatch):
    pipe, tp = sd3(torch.bfloat16)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5)
    ratios = []
    ns = run(block, {"flowrl": flowrl, "torch": torch, "pipe": pipe, "pipeline_kwargs": kwargs, "ratios": ratios,
                     "policy": sd3_cfg_policy(pipe, kwargs)}, code=collect(block.code, "ratio", "ratios"))
    assert type(pipe.scheduler) is flowrl.FlowMatchEulerDiscreteScheduler
    assert len(ratios) == ns["traj"].num_steps == 4 and all(ones(r) for r in ratios)


# ------------------------------------------------------------------------------------------ losses.md


def run_dpo_dgpo(block, tmp_path, monkeypatch):
    ns = run(block, {})
    weights, ids = ns["res"].group_weight, ns["prompt_ids"]
    assert weights.shape == (6,)  # one per sample ...
    for p in (0, 1):  # ... its prompt's
        assert bool((weights[ids == p] == weights[ids == p][0]).all())
    assert weights[0] != weights[3]
    line = next(line for line in block.code.splitlines() if line.startswith("print(res.group_weight)"))
    assert "per sample" in line.split("#", 1)[1], line  # the comment says what it prints
    assert ns["v"].grad is not None


def run_branching_loss(block, tmp_path, monkeypatch):
    from flowrl import losses
    from flowrl.data.tree import BranchSpec, depth_advantages
    from flowrl.rollout.branching import branch_rollout

    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x0, cond = torch.randn(2, 4, 8, generator=g), torch.randn(2, 1, 8, generator=g)

    def velocity(x, j, roots):
        return torch.sin(x * 1.3 + cond[roots]) * (j + 1) / 4

    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), BranchSpec(steps=[1, 2], k=2, seed=5))
    adv = depth_advantages(traj.tree, torch.linspace(-1.0, 1.0, traj.tree.num_rows), 4)
    j = 1  # the first fork's step: two nodes per sample drive it
    rows = adv.mask[:, j]
    assert 0 < int(rows.sum()) < traj.batch_size
    ns = run(block, {"losses": losses, "traj": traj, "j": j, "adv": adv,
                     "v": velocity(traj.step_inputs(j)["sample"], j, torch.arange(2).repeat_interleave(4))})
    assert ones(ns["out"].ratio)  # every trained edge at the rollout's policy
    torch.testing.assert_close(ns["out"].loss, -adv.advantages[rows, j].mean())


# ------------------------------------------------------------------------------------------ replay.md


def run_two_experts(block, tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import tiny_pipelines as tp

    pipe = tp.tiny_WanPipeline_A14B(torch.float32)
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    ratios = []
    ns = run(block, {"torch": torch, "pipe": pipe, "device": "cpu", "ratios": ratios,
                     "pipeline_kwargs": tp.WanPipeline_inputs(torch.float32, steps=4)},
             code=collect(block.code, "ratio", "ratios"))
    traj = ns["traj"]
    assert {i for j in range(traj.num_steps) for i in traj.model_indices(j)} == {0, 1}  # both experts called
    assert len(ratios) == traj.num_steps == 4 and all(ones(r.detach()) for r in ratios)


# --------------------------------------------------------------------------------------- scheduler.md


def run_from_pretrained(block, tmp_path, monkeypatch):
    import diffusers

    pipe, tp = sd3(torch.float32, flowrl_scheduler=True)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.float32, steps=2)
    expected = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.save_pretrained(tmp_path / "pipe")

    class StableDiffusion3Pipeline(diffusers.StableDiffusion3Pipeline):
        """diffusers' class; the tiny pipeline was saved without text encoders, so they are passed as None."""

        @classmethod
        def from_pretrained(cls, path, **kwargs):
            none = dict.fromkeys(("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
                                  "tokenizer_3"))
            return diffusers.StableDiffusion3Pipeline.from_pretrained(path, **none, **kwargs)

    ns = run(block, {"flowrl": flowrl, "path": str(tmp_path / "pipe"),
                     "StableDiffusion3Pipeline": StableDiffusion3Pipeline})
    reloaded = ns["pipe"]
    assert reloaded.scheduler is ns["sched"] and type(ns["sched"]) is flowrl.FlowMatchEulerDiscreteScheduler
    assert dict(ns["sched"].config) == dict(pipe.scheduler.config)
    reloaded.set_progress_bar_config(disable=True)
    assert torch.equal(reloaded(generator=torch.Generator().manual_seed(0), **kwargs).images, expected)


def run_recording(block, tmp_path, monkeypatch):
    pipe, tp = sd3(torch.bfloat16, flowrl_scheduler=True)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5)
    ns = run(block, {"pipe": pipe, "pipeline_kwargs": kwargs})
    traj = ns["traj"]
    assert isinstance(traj, flowrl.RolloutTrajectory)
    assert (traj.mode, traj.noise_level, traj.log_prob_kind) == ("sde", 0.7, "gaussian")
    assert traj.latents.shape[:2] == (2, 5) and traj.log_probs.shape == (2, 4)
    assert torch.equal(ns["images"], traj.latents[:, -1])  # output_type="latent": the final latent


def run_own_scheduler(block, tmp_path, monkeypatch):
    import diffusers

    pipe, tp = sd3(torch.bfloat16)
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5)
    torch.manual_seed(0)  # the pipeline's initial latents
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    ns = run(block, {"pipe": pipe, "pipeline_kwargs": kwargs, "gens": gens})
    assert type(pipe.scheduler) is diffusers.FlowMatchEulerDiscreteScheduler and "step" not in vars(pipe.scheduler)
    # the same trajectory, bit for bit, as flowrl's scheduler swapped in
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    torch.manual_seed(0)
    gens = [torch.Generator().manual_seed(s) for s in range(2)]
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=gens) as rec:
        pipe(**kwargs)
    traj, swapped = ns["traj"], rec.trajectory()
    assert torch.equal(traj.latents, swapped.latents) and torch.equal(traj.log_probs, swapped.log_probs)


# -------------------------------------------------------------------------------------- wire_and_sp.md


def run_wire_response(block, tmp_path, monkeypatch):
    from flowrl.data.serialization import to_wire

    sched, latents, log_probs, model = elementwise_rollout()
    body = json.dumps(to_wire({"trajectory_latents": latents, "rollout_log_probs": log_probs, "sigmas": sched.sigmas}))
    reply, posted = types.SimpleNamespace(json=functools.partial(json.loads, body)), []

    def post(url, json):  # requests.post's keyword
        posted.append((url, json))
        return reply

    monkeypatch.setitem(sys.modules, "requests", types.SimpleNamespace(post=post))  # the server
    ratios = []
    run(block, {"url": "http://rollout", "request": {"prompt": "p"}, "model": model, "device": "cpu", "ratios": ratios},
        code=collect(block.code, "ratio", "ratios"))
    assert posted == [("http://rollout/rollout/generate", {"prompt": "p"})]
    assert len(ratios) == 3 and all(ones(r) for r in ratios)


SP_B, SP_S, SP_C = 2, 32, 64  # each of 2 ranks holds 16 rows of 64: one 1024-element chunk


def _SPModel():
    """tests/data/test_trajectory_shard.py's model (its width is SP_C)."""
    from test_trajectory_shard import C, _Model

    assert C == SP_C
    return _Model()


def _sp_block(key):
    return next(b for b in BLOCKS if b.file == key[0] and key[1] in b.code)


def _sp_check(key, rank, world):
    """One rank of a 2-rank gloo group: the block on this rank's shards, against the single-device call."""
    from flowrl import losses

    block = _sp_block(key)
    lo, hi = rank * SP_S // world, (rank + 1) * SP_S // world
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x, v, x_next, v_ref = (torch.randn(SP_B, SP_S, SP_C, generator=g) for _ in range(4))
    shard = lambda t: t[:, lo:hi].clone()  # noqa: E731
    if "fd.sde_step" in block.code:
        seeds = [3, 4]
        v_shard = shard(v).requires_grad_()
        ns = run(block, {"torch": torch, "x": shard(x), "v": v_shard, "x_next": shard(x_next), "sigmas": sched.sigmas,
                         "step_index": 1, "seeds": seeds})
        v_full = v.clone().requires_grad_()
        lp = flowrl.step_log_prob(x, v_full, x_next, sched.sigmas, 1, mode="sde", noise_level=0.7)
        assert torch.equal(ns["lp"], lp)
        ns["lp"].sum().backward()
        lp.sum().backward()
        assert torch.equal(v_shard.grad, v_full.grad[:, lo:hi])
        out = flowrl.sde_step(x, v, sched.sigmas, 1, generator=[torch.Generator().manual_seed(s) for s in seeds])
        assert torch.equal(ns["out"].prev_sample, out.prev_sample[:, lo:hi])
        assert torch.equal(ns["out"].log_prob, out.log_prob)
    elif "shard_trajectory" in block.code:
        from flowrl.rollout.recorder import rollout

        torch.manual_seed(0)
        model = _SPModel()
        with rollout(sched, mode="sde", noise_level=0.7, model=model,
                     generator=[torch.Generator().manual_seed(3 + b) for b in range(SP_B)]) as rec:
            latent = x
            for t in sched.timesteps:
                latent = sched.step(model(hidden_states=latent, timestep=t.expand(SP_B))[0], t, latent).prev_sample
        traj = rec.trajectory()
        lps = []
        with torch.no_grad():
            run(block, {"flowrl": flowrl, "rank": rank, "world": world, "S": SP_S, "traj": traj, "model": model,
                        "group": None, "lps": lps}, code=collect(block.code, "lp", "lps"))
        assert len(lps) == 4 and all(torch.equal(lp, traj.log_probs[:, j]) for j, lp in enumerate(lps))
    else:
        old_lp, adv = torch.randn(SP_B, generator=g) * 0.01 - 1, torch.tensor([1.0, -0.5])
        v_shard = shard(v).requires_grad_()
        ns = run(block, {"x": shard(x), "v": v_shard, "x_next": shard(x_next), "sigmas": sched.sigmas, "step_index": 1,
                         "old_lp": old_lp, "adv": adv, "v_ref": shard(v_ref), "group": None})
        v_full = v.clone().requires_grad_()
        one = losses.grpo_loss(x, v_full, x_next, sched.sigmas, 1, old_log_prob=old_lp, advantages=adv, clip_range=0.2,
                               kl_coef=0.04,
                               ref_model_output=v_ref)
        one.loss.backward()
        assert torch.equal(ns["out"].loss, one.loss) and torch.equal(v_shard.grad, v_full.grad[:, lo:hi])


def _forked_rank(check, rank, world, port, errors):
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    code = 1
    try:
        torch.set_num_threads(1)  # no OpenMP team of the parent's to join in a forked child
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        check(rank, world)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        os._exit(code)  # not pytest's exit handlers: this is a fork of the test process


def run_forked_ranks(check, world=2, deadline_s=120):
    """``check(rank, world)`` on ``world`` gloo ranks forked from this process (no re-import: the
    spawned ranks of tests/gloo_ranks.py cost seconds each); fails with the ranks' tracebacks."""
    import multiprocessing
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_forked_rank, args=(check, rank, world, port, errors)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures and all(p.exitcode == 0 for p in procs), (
        "\n".join(failures) or f"exit codes {[p.exitcode for p in procs]} (deadline {deadline_s} s)")


def run_sp(block, tmp_path, monkeypatch):
    key = next(k for k in RUNNERS if k[0] == block.file and k[1] in block.code)
    run_forked_ranks(functools.partial(_sp_check, key))


# -------------------------------------------------------------------------------------- the tables

# (file, a substring only that block has) -> the existing test that runs the block as written
EXISTING = {
    ("README.md", "gens = [torch.Generator().manual_seed(i) for i in range(2)]"):
        "tests/repo/test_readme.py::test_the_example_runs_as_written_with_ratio_exactly_one",
    ("docs/consistency.md", "consistency.mismatch(engine, recomputed"):
        "tests/data/test_consistency.py::test_docs_consistency_snippet_runs",
    ("docs/losses.md", "result = losses.grpo_loss("): "tests/losses/test_losses.py::test_docs_snippet_runs",
    ("docs/replay.md", 'env_device="cpu"'): "tests/repo/test_replay_doc.py::test_recorder_loop_in_the_docs_gives_ratio_one",
    ("docs/replay.md", "from_sglang(responses, request=request)"):
        "tests/repo/test_replay_doc.py::test_sglang_loop_in_the_docs_gives_ratio_one",
    # these two need SGLang's package (./run installs it): tests/sglang_engine.py runs them in SGLang's engine
    ("docs/replay.md", "server's msgpack bytes"):
        "tests/data/test_sglang_engine.py::test_the_docs_loop_on_the_engines_body_gives_ratio_one",
    ("docs/integration.md", "flowrl.compat.sglang.register()"):
        "tests/data/test_sglang_engine.py::test_with_flowrl_in_the_engine_the_ratio_is_exactly_one",
}

# (file, a substring only that block has) -> run here: runner(block, tmp_path, monkeypatch)
RUNNERS = {
    ("docs/branching.md", "branch=spec"): run_branching_pipeline,
    ("docs/branching.md", "traj = branch_rollout(lambda x, j, roots"): run_branching_driver,
    ("docs/guide.md", "out.std_dev"): run_api,
    ("docs/guide.md", "lp_new = flowrl.step_log_prob"): run_step_and_recompute,
    ("docs/guide.md", "pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config"): run_swap,
    ("docs/guide.md", "traj.latent_step_indices, and the settings"): run_dropin_recompute,
    ("docs/guide.md", "flowrl.DDIMScheduler.from_config"): run_ddim,
    ("docs/guide.md", 'mode="dpm_sde", noise_level=1.0, solver_order=2'): run_dpm_sde,
    ("docs/guide.md", "from_wire(response_json"): run_guide_wire,
    ("docs/integration.md", "# from flow_grpo.diffusers_patch.sd3_sde_with_logprob import"): run_flow_grpo_import,
    ("docs/integration.md", "out_dtype=latents_dtype,"): run_flow_grpo_out_dtype,
    ("docs/integration.md", "from flowrl.compat.flow_grpo import guidance"): run_flow_grpo_guidance,
    ("docs/integration.md", "indices_for_timesteps(sample["): run_flow_grpo_kl,
    ("docs/integration.md", "z, pred_original, log_prob = flow_grpo_step("): run_flow_grpo_solver,
    ("docs/integration.md", "from flowrl.compat.dance_grpo import flux_step"): run_dance_grpo_import,
    ("docs/integration.md", "fv.register()"): run_verl_omni,
    ("docs/integration.md", "keeping diffusers' scheduler instance"): run_integration_recorder,
    ("docs/losses.md", "res = losses.dgpo_loss("): run_dpo_dgpo,
    ("docs/losses.md", "rows = adv.mask[:, j]"): run_branching_loss,
    ("docs/replay.md", "experts = (pipe.transformer, pipe.transformer_2)"): run_two_experts,
    ("docs/scheduler.md", "pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config"): run_swap,
    ("docs/scheduler.md", 'from_pretrained(path, subfolder="scheduler")'): run_from_pretrained,
    ("docs/scheduler.md", "rec = pipe.scheduler.rollout("): run_recording,
    ("docs/scheduler.md", 'with rollout(pipe.scheduler, mode="sde", noise_level=0.7, generator=gens)'): run_own_scheduler,
    ("docs/scheduler.md", "same weights: same bits"): run_dropin_recompute,
    ("docs/wire_and_sp.md", 'requests.post(url + "/rollout/generate"'): run_wire_response,
    ("docs/wire_and_sp.md", "out = fd.sde_step("): run_sp,
    ("docs/wire_and_sp.md", "shard = flowrl.shard_trajectory(traj, lo, hi, dim=1)"): run_sp,
    ("docs/wire_and_sp.md", "out = fd.grpo_loss("): run_sp,
}


def coverage(block: Block, existing=EXISTING, runners=RUNNERS):
    """("existing", test id) / ("run", runner) / ("marker", reason); pytest.fail for anything else."""
    where = f"{block.file}, line {block.line}, the block starting {block.first_line!r}"
    found = [("existing", test) for (f, key), test in existing.items() if f == block.file and key in block.code]
    found += [("run", fn) for (f, key), fn in runners.items() if f == block.file and key in block.code]
    if block.first_line.startswith(MARKER):
        reason = block.first_line[len(MARKER):].strip()
        if not reason:
            pytest.fail(f"{where}: the marker gives no reason")
        if found:
            pytest.fail(f"{where}: marked as not run, but a test runs it: {found}")
        return "marker", reason
    if len(found) != 1:
        pytest.fail(f"{where}: " + (f"matched by {len(found)} entries of the tables: {found}" if found else
                                    f"not run by any test, and its first line is not '{MARKER} <why>'"))
    return found[0]


def test_every_table_entry_names_one_block():
    for file, key in list(EXISTING) + list(RUNNERS):
        assert file in DOCS, file
        assert sum(key in b.code for b in BLOCKS if b.file == file) == 1, (file, key)


def test_an_uncovered_or_unexplained_block_fails():
    tables = {"existing": {}, "runners": {}}
    with pytest.raises(pytest.fail.Exception, match="x.md, line 3, the block starting 'y = 1'"):
        coverage(Block("x.md", 3, "y = 1\n"), **tables)
    with pytest.raises(pytest.fail.Exception, match="gives no reason"):
        coverage(Block("x.md", 3, f"{MARKER}\ny = 1\n"), **tables)
    assert coverage(Block("x.md", 3, f"{MARKER} needs a CUDA GPU\ny = 1\n"), **tables) == ("marker", "needs a CUDA GPU")
    text = "a\n\n   ```python\n   y = 1\n   ```\n\n```py\nz = 2\n```\n"
    assert list(doc_blocks(text, "x.md")) == [Block("x.md", 3, "y = 1\n"), Block("x.md", 7, "z = 2\n")]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.file}:{b.line}" for b in BLOCKS])
def test_doc_block(block, tmp_path, monkeypatch):
    kind, how = coverage(block)
    if kind == "run":
        how(block, tmp_path, monkeypatch)
    elif kind == "existing":
        path, name = how.split("::")
        tests = {n.name for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"{block.file}:{block.line} is mapped to {how}, which does not exist"


# ------------------------------------------------------------------------------- names the docs use
# (the blocks' module paths, with every other file's: tests/repo/test_tree.py)


def test_subpackages_resolve_after_import_flowrl(tmp_path):
    """``import flowrl`` then ``flowrl.consistency``, ``flowrl.compat``, ``flowrl.kernels`` (lazily, as
    ``flowrl.losses``), in a fresh process; ``flowrl.kernels`` imports no triton, its kernel modules do."""
    code = textwrap.dedent("""
        import sys
        import flowrl
        assert not {"flowrl.consistency", "flowrl.compat", "flowrl.kernels"} & set(sys.modules)
        print(flowrl.consistency.__name__, flowrl.compat.__name__, flowrl.kernels.__name__)
        sys.modules["triton"] = None  # as without triton
        try:
            import flowrl.kernels.step
        except ImportError as e:
            print("ImportError", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "flowrl.consistency flowrl.compat flowrl.kernels"
    assert lines[1].startswith("ImportError") and "triton" in lines[1]
