"""Real diffusers video pipelines with tiny random components, built as diffusers' own tests build them
(``get_dummy_components`` in huggingface/diffusers tests/pipelines/ltx/test_ltx_condition.py,
test_ltx_image2video.py, wan/test_wan_22_image_to_video.py, ltx2/test_ltx2.py), without text encoders:
each ``tiny_<family>(dtype)`` returns ``(pipe, call_kwargs)``, and ``pipe(**call_kwargs(batch, seed))``
runs the unmodified pipeline on random prompt embeddings with ``output_type="latent"`` (no download,
no VAE decode). The scheduler is diffusers' own ``FlowMatchEulerDiscreteScheduler`` with the family's
shipped settings; tests swap in flowrl's with ``from_config``.
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
