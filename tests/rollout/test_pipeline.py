"""The one-line swap in a real, unmodified diffusers pipeline (StableDiffusion3Pipeline with tiny random
components built from configs: no download, no text encoders, ``prompt_embeds`` passed), saving and
reloading it, and recording rollouts with diffusers' own scheduler."""
import json
import subprocess
import sys

import pytest
import torch

import flowrl
import flowrl.rollout.recorder

diffusers = pytest.importorskip("diffusers")
# diffusers' SD3 pipeline module imports transformers (for its text-encoder types) even when none is used
pytest.importorskip("transformers")
from diffusers import StableDiffusion3Pipeline  # noqa: E402
from tiny_pipelines import tiny_StableDiffusion3Pipeline  # noqa: E402

BATCH, HEIGHT, STEPS = 2, 16, 4


def tiny_pipeline(dtype: torch.dtype, scheduler_config: dict) -> StableDiffusion3Pipeline:
    return tiny_StableDiffusion3Pipeline(dtype, scheduler_config)


def generate(pipe, dtype, seed=0):
    g = torch.Generator().manual_seed(123)
    embeds = torch.randn(BATCH, 5, 16, generator=g).to(dtype)
    pooled = torch.randn(BATCH, 8, generator=g).to(dtype)
    return pipe(
        prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=1.0, num_inference_steps=STEPS,
        height=HEIGHT, width=HEIGHT, output_type="latent", generator=torch.Generator().manual_seed(seed),
    ).images


@pytest.mark.parametrize(
    "dtype, scheduler_config",
    [(torch.float32, {"shift": 3.0}), (torch.bfloat16, {"use_dynamic_shifting": True, "shift_terminal": 0.05})],
    ids=["fp32-shift3", "bf16-dynamic-shift"],
)
def test_swapped_scheduler_matches_diffusers_and_records_rollouts(dtype, scheduler_config):
    pipe = tiny_pipeline(dtype, scheduler_config)
    expected = generate(pipe, dtype)

    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)  # the one-line swap
    assert torch.equal(generate(pipe, dtype), expected)  # default mode: diffusers' bits

    captured = []  # the transformer's outputs are the step's model outputs (no guidance at scale 1)
    hook = pipe.transformer.register_forward_hook(lambda module, args, out: captured.append(out[0].detach()))
    try:
        with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5)) as rec:
            images = generate(pipe, dtype)
    finally:
        hook.remove()
    traj = rec.trajectory()
    assert traj.latents.shape == (BATCH, STEPS + 1, 4, HEIGHT, HEIGHT) and traj.latents.dtype == dtype
    assert torch.equal(traj.latents[:, -1], images)
    assert not torch.equal(images, expected)  # the rollout sampled
    assert torch.equal(traj.sigmas, pipe.scheduler.sigmas) and torch.equal(traj.timesteps, pipe.scheduler.timesteps)
    assert len(captured) == STEPS and captured[0].dtype == dtype
    for i, v in enumerate(captured):
        recomputed = flowrl.step_log_prob(
            traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i,
            mode=traj.mode, noise_level=traj.noise_level, log_prob_kind=traj.log_prob_kind, reduction=traj.reduction,
        )
        assert torch.equal(recomputed, traj.log_probs[:, i]), i

    # a second rollout with the same seed reproduces the first; the pipeline still runs plainly afterwards
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5)) as again:
        generate(pipe, dtype)
    assert torch.equal(again.trajectory().latents, traj.latents)
    assert torch.equal(generate(pipe, dtype), expected)


# the tiny pipeline has no text encoders: reloading it needs them passed as None, before the swap as after
NO_TEXT_ENCODERS = {
    name: None for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
}


@pytest.mark.slow
def test_swapped_scheduler_saves_and_reloads_as_diffusers_scheduler(tmp_path):
    pipe = tiny_pipeline(torch.float32, {"shift": 3.0})
    expected = generate(pipe, torch.float32)
    pipe.save_pretrained(tmp_path / "before")
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.save_pretrained(tmp_path / "after")

    def model_index(folder):
        return json.loads((tmp_path / folder / "model_index.json").read_text())

    assert model_index("after")["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert model_index("after") == model_index("before")  # saved exactly as before the swap
    for pipeline_class in (diffusers.DiffusionPipeline, StableDiffusion3Pipeline):
        reloaded = pipeline_class.from_pretrained(tmp_path / "after", **NO_TEXT_ENCODERS)
        reloaded.set_progress_bar_config(disable=True)
        assert type(reloaded) is StableDiffusion3Pipeline
        assert type(reloaded.scheduler) is diffusers.FlowMatchEulerDiscreteScheduler
        assert {k: reloaded.scheduler.config[k] for k in pipe.scheduler.config} == dict(pipe.scheduler.config)
        assert torch.equal(generate(reloaded, torch.float32), expected)

    # flowrl's scheduler loads from the saved pipeline's folder and slots back in
    sched = flowrl.FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "after", subfolder="scheduler")
    assert dict(sched.config) == dict(pipe.scheduler.config)
    reloaded = StableDiffusion3Pipeline.from_pretrained(tmp_path / "after", scheduler=sched, **NO_TEXT_ENCODERS)
    reloaded.set_progress_bar_config(disable=True)
    assert reloaded.scheduler is sched and torch.equal(generate(reloaded, torch.float32), expected)

    # a process that never imports flowrl (importing it would fail) reloads the saved pipeline
    script = (
        "import sys; sys.modules['flowrl'] = None\n"
        "import diffusers\n"
        f"pipe = diffusers.DiffusionPipeline.from_pretrained({str(tmp_path / 'after')!r}, "
        f"**dict.fromkeys({sorted(NO_TEXT_ENCODERS)!r}))\n"
        "print(type(pipe.scheduler).__module__, type(pipe.scheduler).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        diffusers.FlowMatchEulerDiscreteScheduler.__module__, "FlowMatchEulerDiscreteScheduler"
    ]


@pytest.mark.parametrize(
    "dtype, scheduler_config",
    [(torch.float32, {"shift": 3.0}), (torch.bfloat16, {"use_dynamic_shifting": True, "shift_terminal": 0.05})],
    ids=["fp32-shift3", "bf16-dynamic-shift"],
)
def test_recorder_wraps_diffusers_own_scheduler(dtype, scheduler_config):
    pipe = tiny_pipeline(dtype, scheduler_config)
    expected = generate(pipe, dtype)
    sched = pipe.scheduler  # diffusers' own: no swap

    captured = []
    hook = pipe.transformer.register_forward_hook(lambda module, args, out: captured.append(out[0].detach()))
    try:
        with flowrl.rollout.recorder.rollout(sched, mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5)) as rec:
            images = generate(pipe, dtype)
    finally:
        hook.remove()
    traj = rec.trajectory()
    assert traj.latents.shape == (BATCH, STEPS + 1, 4, HEIGHT, HEIGHT) and traj.latents.dtype == dtype
    assert torch.equal(traj.latents[:, -1], images) and not torch.equal(images, expected)
    assert torch.equal(traj.sigmas, sched.sigmas) and torch.equal(traj.timesteps, sched.timesteps)
    assert len(captured) == STEPS
    for i, v in enumerate(captured):
        recomputed = flowrl.step_log_prob(
            traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i,
            mode=traj.mode, noise_level=traj.noise_level, log_prob_kind=traj.log_prob_kind, reduction=traj.reduction,
        )
        assert torch.equal(recomputed, traj.log_probs[:, i]), i

    # restored: the same object and class, no instance patches, diffusers' results again
    assert pipe.scheduler is sched and type(sched) is diffusers.FlowMatchEulerDiscreteScheduler
    assert "step" not in vars(sched) and "set_timesteps" not in vars(sched)
    assert torch.equal(generate(pipe, dtype), expected)

    # the same rollout as with flowrl's scheduler swapped in
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(sched.config)
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5)) as swapped:
        generate(pipe, dtype)
    assert torch.equal(swapped.trajectory().latents, traj.latents)
    assert torch.equal(swapped.trajectory().log_probs, traj.log_probs)
