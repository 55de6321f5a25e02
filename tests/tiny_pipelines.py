"""Tiny random-weight diffusers pipelines, built from configs (no download): the transformers of diffusers'
own tests' ``get_dummy_components`` (tests/pipelines/<family>/test_*.py in huggingface/diffusers), no
text encoders (callers pass prompt embeddings), no VAE where ``output_type="latent"`` does not need one.
One builder per pipeline class, ``tiny_<PipelineClass>(dtype)``, each with a matching
``<PipelineClass>_inputs(dtype, batch, steps)`` giving the call's keyword arguments.
"""
from __future__ import annotations

import torch

import diffusers
from diffusers import FlowMatchEulerDiscreteScheduler


def _finish(pipe, dtype):
    pipe = pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _randn(generator, dtype, *shape):
    return torch.randn(*shape, generator=generator).to(dtype)


# --- StableDiffusion3Pipeline (tests/pipelines/stable_diffusion_3/test_pipeline_stable_diffusion_3.py)
def tiny_StableDiffusion3Pipeline(dtype=torch.float32, scheduler_config=None):
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
    )
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
    )
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(**(scheduler_config or {"shift": 3.0})),
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
    )
    return _finish(pipe, dtype)


def StableDiffusion3Pipeline_inputs(dtype, batch=2, steps=4, guidance_scale=1.0):
    g = torch.Generator().manual_seed(123)
    kwargs = dict(prompt_embeds=_randn(g, dtype, batch, 5, 16), pooled_prompt_embeds=_randn(g, dtype, batch, 8),
                  guidance_scale=guidance_scale, num_inference_steps=steps, height=16, width=16, output_type="latent")
    if guidance_scale > 1:
        kwargs.update(negative_prompt_embeds=_randn(g, dtype, batch, 5, 16),
                      negative_pooled_prompt_embeds=_randn(g, dtype, batch, 8))
    return kwargs


# --- FluxPipeline (tests/pipelines/flux/test_pipeline_flux.py)
def tiny_FluxPipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = diffusers.FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, text_encoder_2=None, tokenizer=None,
        tokenizer_2=None, transformer=transformer, vae=vae,
    )
    return _finish(pipe, dtype)


def FluxPipeline_inputs(dtype, batch=2, steps=4, true_cfg_scale=1.0):
    g = torch.Generator().manual_seed(123)
    kwargs = dict(prompt_embeds=_randn(g, dtype, batch, 6, 32), pooled_prompt_embeds=_randn(g, dtype, batch, 32),
                  guidance_scale=3.5, num_inference_steps=steps, height=8, width=8, output_type="latent")
    if true_cfg_scale > 1:
        kwargs.update(true_cfg_scale=true_cfg_scale, negative_prompt_embeds=_randn(g, dtype, batch, 6, 32),
                      negative_pooled_prompt_embeds=_randn(g, dtype, batch, 32))
    return kwargs


# --- WanPipeline, text to video (tests/pipelines/wan/test_wan.py)
def tiny_WanPipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    pipe = diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    return _finish(pipe, dtype)


def WanPipeline_inputs(dtype, batch=2, steps=4, guidance_scale=6.0):
    g = torch.Generator().manual_seed(123)
    return dict(prompt_embeds=_randn(g, dtype, batch, 8, 32), negative_prompt_embeds=_randn(g, dtype, batch, 8, 32),
                guidance_scale=guidance_scale, num_inference_steps=steps, height=16, width=16, num_frames=5,
                output_type="latent")


# --- LTXImageToVideoPipeline (tests/pipelines/ltx/test_ltx_image2video.py)
def tiny_LTXImageToVideoPipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    pipe = diffusers.LTXImageToVideoPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None, transformer=transformer,
    )
    return _finish(pipe, dtype)


def LTXImageToVideoPipeline_inputs(dtype, batch=2, steps=4, guidance_scale=3.0):
    g = torch.Generator().manual_seed(123)
    return dict(
        image=torch.rand(batch, 3, 32, 32, generator=g), prompt_embeds=_randn(g, dtype, batch, 6, 32),
        prompt_attention_mask=torch.ones(batch, 6, dtype=torch.long),
        negative_prompt_embeds=_randn(g, dtype, batch, 6, 32),
        negative_prompt_attention_mask=torch.ones(batch, 6, dtype=torch.long),
        guidance_scale=guidance_scale, num_inference_steps=steps, height=32, width=32, num_frames=9,
        output_type="latent",
    )


# --- Lumina2Pipeline (tests/pipelines/lumina2/test_pipeline_lumina2.py)
def tiny_Lumina2Pipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.Lumina2Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=8, num_layers=2, num_attention_heads=1, num_kv_heads=1,
        multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=[4, 2, 2],
        cap_feat_dim=8,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1, latent_channels=4,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )
    pipe = diffusers.Lumina2Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None,
    )
    return _finish(pipe, dtype)


def Lumina2Pipeline_inputs(dtype, batch=2, steps=4, guidance_scale=1.0, cfg_normalization=True):
    g = torch.Generator().manual_seed(123)
    kwargs = dict(prompt_embeds=_randn(g, dtype, batch, 6, 8), prompt_attention_mask=torch.ones(batch, 6, dtype=torch.bool),
                  guidance_scale=guidance_scale, num_inference_steps=steps, height=32, width=32, output_type="latent",
                  cfg_normalization=cfg_normalization)
    if guidance_scale > 1:
        kwargs.update(negative_prompt_embeds=_randn(g, dtype, batch, 6, 8),
                      negative_prompt_attention_mask=torch.ones(batch, 6, dtype=torch.bool))
    return kwargs


# --- FluxKontextPipeline: FluxPipeline's components; the reference image's tokens follow the latents'
def tiny_FluxKontextPipeline(dtype=torch.float32):
    flux = tiny_FluxPipeline(dtype)
    pipe = diffusers.FluxKontextPipeline(
        scheduler=flux.scheduler, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
        transformer=flux.transformer, vae=flux.vae,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def FluxKontextPipeline_inputs(dtype, batch=2, steps=4):
    kwargs = FluxPipeline_inputs(dtype, batch, steps)
    g = torch.Generator().manual_seed(7)
    # max_area and _auto_resize keep the tiny size (the defaults resize to about 1024 x 1024)
    kwargs.update(image=torch.rand(batch, 3, 32, 32, generator=g), height=32, width=32, max_area=32 * 32,
                  _auto_resize=False)
    return kwargs
