"""The one-line swap in a real, unmodified diffusers pipeline (StableDiffusion3Pipeline with tiny random
components built from configs: no download, no text encoders, ``prompt_embeds`` passed)."""
import pytest
import torch

import flowrl

diffusers = pytest.importorskip("diffusers")
# diffusers' SD3 pipeline module imports transformers (for its text-encoder types) even when none is used
pytest.importorskip("transformers")
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: E402

BATCH, HEIGHT, STEPS = 2, 16, 4


def tiny_pipeline(dtype: torch.dtype, scheduler_config: dict) -> StableDiffusion3Pipeline:
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=HEIGHT,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**scheduler_config),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
    ).to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
            mode=traj.mode, noise_level=traj.noise_level, log_prob=traj.log_prob, reduction=traj.reduction,
        )
        assert torch.equal(recomputed, traj.log_probs[:, i]), i

    # a second rollout with the same seed reproduces the first; the pipeline still runs plainly afterwards
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7, generator=torch.Generator().manual_seed(5)) as again:
        generate(pipe, dtype)
    assert torch.equal(again.trajectory().latents, traj.latents)
    assert torch.equal(generate(pipe, dtype), expected)
