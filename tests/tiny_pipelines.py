"""Tiny random-weight diffusers pipelines, built from configs (no download): the components of diffusers'
own tests' ``get_dummy_components`` (tests/pipelines/<family>/test_*.py in huggingface/diffusers: ltx/
test_ltx_condition.py, test_ltx_image2video.py, wan/test_wan_22_image_to_video.py, ltx2/test_ltx2.py,
stable_diffusion_3, flux, wan, lumina2), no text encoders (callers pass prompt embeddings), no VAE
decode (``output_type="latent"``). The scheduler is diffusers' own ``FlowMatchEulerDiscreteScheduler``
with the family's shipped settings; tests swap in flowrl's with ``from_config``.

Two call conventions: the video families' ``tiny_<family>(dtype)`` return ``(pipe, call_kwargs)`` and
``pipe(**call_kwargs(batch, seed))`` runs it; ``tiny_<PipelineClass>(dtype)`` return the pipeline, with
``<PipelineClass>_inputs(dtype, batch, steps)`` giving the call's keyword arguments.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import torch

import diffusers
from diffusers import FlowMatchEulerDiscreteScheduler

STEPS = 3
TEXT_LEN = 4

Kwargs = Callable[..., Dict]


def _image(size: int, seed: int = 0):
    import PIL.Image

    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _embeds(batch: int, dim: int, dtype: torch.dtype, seed: int = 123) -> torch.Tensor:
    return torch.randn(batch, TEXT_LEN, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _finish(pipe, dtype):
    pipe = pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ltx_components(dtype):
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1), timestep_conditioning=False,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                text_encoder=None, tokenizer=None)


def _ltx_call(dtype, **extra) -> Kwargs:
    def call(batch: int = 2, seed: int = 0, **over):
        kwargs = dict(
            prompt_embeds=_embeds(batch, 32, dtype), prompt_attention_mask=torch.ones(batch, TEXT_LEN, dtype=torch.long),
            guidance_scale=1.0, num_inference_steps=STEPS, height=32, width=32, num_frames=9,
            output_type="latent", generator=torch.Generator().manual_seed(seed), **extra,
        )
        kwargs.update(over)
        return kwargs

    return call


def tiny_ltx_condition(dtype: torch.dtype, with_image: bool) -> Tuple[object, Kwargs]:
    """LTXConditionPipeline: every step passes ``per_token_timesteps`` ([B, 1] equal to t without a
    condition; [B, S] with 0 on the conditioning tokens with an image)."""
    pipe = _finish(diffusers.LTXConditionPipeline(**_ltx_components(dtype)), dtype)
    extra = dict(image=_image(32)) if with_image else {}
    return pipe, _ltx_call(dtype, **extra)


def tiny_ltx_i2v(dtype: torch.dtype) -> Tuple[object, Kwargs]:
    """LTXImageToVideoPipeline: steps the unpacked latents' frames 1: only."""
    pipe = _finish(diffusers.LTXImageToVideoPipeline(**_ltx_components(dtype)), dtype)
    return pipe, _ltx_call(dtype, image=_image(32))


def _wan_call(dtype, size: int, **extra) -> Kwargs:
    def call(batch: int = 2, seed: int = 0, **over):
        kwargs = dict(
            prompt_embeds=_embeds(batch, 32, dtype), guidance_scale=1.0, num_inference_steps=STEPS,
            height=size, width=size, num_frames=9, output_type="latent", image=_image(size),
            generator=torch.Generator().manual_seed(seed), **extra,
        )
        kwargs.update(over)
        return kwargs

    return call


def tiny_wan_i2v(dtype: torch.dtype) -> Tuple[object, Kwargs]:
    """WanImageToVideoPipeline, Wan 2.x I2V layout (the image condition concatenated on channels;
    diffusers' Wan 2.2 I2V test components with one transformer). Shipped scheduler: UniPC with
    ``flow_shift`` 3.0, here FlowMatchEuler with ``shift`` 3.0."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    pipe = diffusers.WanImageToVideoPipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=None,
        tokenizer=None, image_encoder=None, image_processor=None, transformer_2=None, boundary_ratio=None,
    )
    return _finish(pipe, dtype), _wan_call(dtype, 16)


def tiny_wan22_ti2v(dtype: torch.dtype) -> Tuple[object, Kwargs]:
    """Wan 2.2 TI2V-5B: WanImageToVideoPipeline with ``expand_timesteps=True`` (diffusers' 5B test
    components). Latent frame 0 is stepped by the scheduler but replaced by the image condition in the
    model input and in the output: it is a frozen element."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
    )
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    pipe = diffusers.WanImageToVideoPipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder=None,
        tokenizer=None, image_encoder=None, image_processor=None, transformer_2=None, boundary_ratio=None,
        expand_timesteps=True,
    )
    return _finish(pipe, dtype), _wan_call(dtype, 32)


def tiny_ltx2(dtype: torch.dtype) -> Tuple[object, Kwargs]:
    """LTX2Pipeline (video + audio; ``audio_scheduler = copy.deepcopy(self.scheduler)`` in its call)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    caption, layers = 32, 2  # the connectors keep caption_channels = heads * head_dim (4 * 8)
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=1, qk_norm="rms_norm_across_heads",
        caption_channels=caption, rope_double_precision=False, rope_type="split",
    )
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=caption, text_proj_in_factor=layers, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split",
    )
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    )
    pipe = diffusers.LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
        connectors=connectors, transformer=transformer, vocoder=vocoder,
    )

    def call(batch: int = 2, seed: int = 0, **over):
        kwargs = dict(
            prompt_embeds=_embeds(batch, caption * layers, dtype),
            prompt_attention_mask=torch.ones(batch, TEXT_LEN, dtype=torch.long), guidance_scale=1.0,
            stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0, audio_stg_scale=0.0,
            audio_modality_scale=1.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
            use_cross_timestep=False, num_inference_steps=STEPS, height=32, width=32, num_frames=5, frame_rate=25.0,
            output_type="latent", generator=torch.Generator().manual_seed(seed),
        )
        kwargs.update(over)
        return kwargs

    return _finish(pipe, dtype), call


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
        transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**({"shift": 3.0} if scheduler_config is None else scheduler_config)),
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
    return _finish(diffusers.LTXImageToVideoPipeline(**_ltx_components(dtype)), dtype)


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


# --- Flux2Pipeline (tests/pipelines/flux2/test_pipeline_flux2.py; no Mistral3 text encoder)
def _flux2_components(guidance_embeds: bool):
    torch.manual_seed(0)
    transformer = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=guidance_embeds,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    )
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None,
                transformer=transformer, vae=vae)


def tiny_Flux2Pipeline(dtype=torch.float32):
    return _finish(diffusers.Flux2Pipeline(**_flux2_components(guidance_embeds=True)), dtype)


def Flux2Pipeline_inputs(dtype, batch=2, steps=4):
    g = torch.Generator().manual_seed(123)
    return dict(prompt_embeds=_randn(g, dtype, batch, 6, 16), guidance_scale=4.0, num_inference_steps=steps, height=8,
                width=8, output_type="latent")


# --- Flux2KleinPipeline (tests/pipelines/flux2/test_pipeline_flux2_klein.py; no Qwen3 text encoder)
def tiny_Flux2KleinPipeline(dtype=torch.float32):
    return _finish(diffusers.Flux2KleinPipeline(**_flux2_components(guidance_embeds=False)), dtype)


def Flux2KleinPipeline_inputs(dtype, batch=2, steps=4, guidance_scale=4.0):
    g = torch.Generator().manual_seed(123)
    kwargs = dict(prompt_embeds=_randn(g, dtype, batch, 6, 16), guidance_scale=guidance_scale, num_inference_steps=steps,
                  height=8, width=8, output_type="latent")
    if guidance_scale > 1:  # CFG over two calls (cond, then uncond) when the model is not distilled
        kwargs.update(negative_prompt_embeds=_randn(g, dtype, batch, 6, 16))
    return kwargs


# --- QwenImagePipeline (tests/pipelines/qwenimage/test_qwenimage.py; no Qwen2.5-VL text encoder)
def tiny_QwenImagePipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=4 * 6, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    pipe = diffusers.QwenImagePipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                                       text_encoder=None, tokenizer=None)
    return _finish(pipe, dtype)


def QwenImagePipeline_inputs(dtype, batch=2, steps=4):
    g = torch.Generator().manual_seed(123)
    return dict(prompt_embeds=_randn(g, dtype, batch, 6, 16), prompt_embeds_mask=torch.ones(batch, 6, dtype=torch.long),
                true_cfg_scale=1.0, num_inference_steps=steps, height=32, width=32, output_type="latent")


# --- WanPipeline with two experts, Wan 2.2 T2V-A14B (tests/pipelines/wan/test_wan_22.py): transformer
# above boundary_ratio * 1000, transformer_2 below
def tiny_WanPipeline_A14B(dtype=torch.float32):
    experts = []
    for _ in range(2):
        torch.manual_seed(0)
        experts.append(diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ))
    with torch.no_grad():  # diffusers' test seeds both alike; make the experts differ so routing shows
        for p in experts[1].parameters():
            p.mul_(0.5)
    pipe = diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, transformer=experts[0], transformer_2=experts[1], vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), boundary_ratio=0.875,
    )
    return _finish(pipe, dtype)


# --- LTXPipeline, text to video (tests/pipelines/ltx/test_ltx.py)
def tiny_LTXPipeline(dtype=torch.float32):
    return _finish(diffusers.LTXPipeline(**_ltx_components(dtype)), dtype)


def LTXPipeline_inputs(dtype, batch=2, steps=4, guidance_scale=3.0):
    kwargs = LTXImageToVideoPipeline_inputs(dtype, batch, steps, guidance_scale)
    del kwargs["image"]
    return kwargs


# --- CogView4Pipeline (tests/pipelines/cogview4/test_cogview4.py; no GLM text encoder)
def tiny_CogView4Pipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=4, out_channels=4,
        text_embed_dim=32, time_embed_dim=8, condition_dim=4,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4, sample_size=128,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    pipe = diffusers.CogView4Pipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                      scheduler=scheduler)
    return _finish(pipe, dtype)


def CogView4Pipeline_inputs(dtype, batch=2, steps=4, guidance_scale=1.0):
    g = torch.Generator().manual_seed(123)
    kwargs = dict(prompt_embeds=_randn(g, dtype, batch, 16, 32), guidance_scale=guidance_scale,
                  num_inference_steps=steps, height=16, width=16, output_type="latent")
    if guidance_scale > 1:
        kwargs.update(negative_prompt_embeds=_randn(g, dtype, batch, 16, 32))
    return kwargs


# --- HunyuanVideoPipeline (tests/pipelines/hunyuan_video/test_hunyuan_video.py; no Llama/CLIP encoders)
def tiny_HunyuanVideoPipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True,
    )
    pipe = diffusers.HunyuanVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None, tokenizer_2=None,
    )
    return _finish(pipe, dtype)


def HunyuanVideoPipeline_inputs(dtype, batch=2, steps=4):
    g = torch.Generator().manual_seed(123)
    return dict(prompt_embeds=_randn(g, dtype, batch, 6, 16), pooled_prompt_embeds=_randn(g, dtype, batch, 8),
                prompt_attention_mask=torch.ones(batch, 6, dtype=torch.long), guidance_scale=4.5, true_cfg_scale=1.0,
                num_inference_steps=steps, height=16, width=16, num_frames=9, output_type="latent")


# --- SanaPipeline (tests/pipelines/sana/test_sana.py; no Gemma2 text encoder). The shipped scheduler is
# DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0) (Sana_1600M_1024px_diffusers); flowrl's
# from_config reads flow_shift as shift.
def tiny_SanaPipeline(dtype=torch.float32):
    torch.manual_seed(0)
    transformer = diffusers.SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        sample_size=32,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )
    scheduler = diffusers.DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                      flow_shift=3.0)
    pipe = diffusers.SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=scheduler)
    return _finish(pipe, dtype)


def SanaPipeline_inputs(dtype, batch=2, steps=4):
    g = torch.Generator().manual_seed(123)
    return dict(prompt_embeds=_randn(g, dtype, batch, 6, 8), prompt_attention_mask=torch.ones(batch, 6, dtype=torch.long),
                guidance_scale=1.0, num_inference_steps=steps, height=32, width=32, use_resolution_binning=False,
                output_type="latent")
