"""flowrl.DDIMScheduler (flowrl/rollout/ddim.py): the drop-in subclass of diffusers' DDIMScheduler.

- bit-identical to diffusers' DDIMScheduler.step inside a rollout, for every config option it reads
  (prediction_type, clip_sample + clip_sample_range, set_alpha_to_one, steps_offset, timestep_spacing,
  rescale_betas_zero_snr), at eta = 0 in float32 and bf16 and at eta > 0 with the same variance_noise;
- rollouts recompute through step_log_prob with ratio exactly 1; save / load like diffusers;
- log-probs match DDPO's ddim_step_with_logprob on identical inputs (the peer oracle below);
- a tiny real StableDiffusionPipeline (random UNet2DConditionModel, AutoencoderKL, CLIP text encoder as
  diffusers' tests/pipelines/stable_diffusion/test_stable_diffusion.py get_dummy_components builds them)
  runs with flowrl.DDIMScheduler swapped in unmodified.
"""
import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import flowrl  # noqa: E402
import flowrl.backends.reference  # noqa: E402
from flowrl.rollout.ddim import DDIMScheduler, alpha_bar_table  # noqa: E402

SD_BETAS = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
# every option the rollout reads, each away from its default at least once
CONFIGS = [
    dict(SD_BETAS, clip_sample=False, set_alpha_to_one=False, steps_offset=1),  # Stable Diffusion 1.x
    dict(SD_BETAS, clip_sample=True, clip_sample_range=1.0),  # diffusers' defaults otherwise
    dict(SD_BETAS, clip_sample=True, clip_sample_range=1.5, prediction_type="sample", set_alpha_to_one=False),
    dict(SD_BETAS, clip_sample=False, prediction_type="v_prediction", timestep_spacing="trailing",
         rescale_betas_zero_snr=True),
    dict(clip_sample=True, prediction_type="v_prediction", timestep_spacing="linspace", steps_offset=0),
    dict(beta_schedule="squaredcos_cap_v2", clip_sample=False, timestep_spacing="trailing", set_alpha_to_one=False),
]
IDS = ["sd15", "defaults-clip", "sample-clip1.5", "v-zero-snr-trailing", "v-linspace", "cosine-trailing"]
STEPS = 7  # 1000 // 7 is not 1000 / 7: trailing / linspace pairs are not loop neighbours


def toy_model(x, t):
    """A deterministic stand-in for a denoiser, in x's dtype (large enough to hit the clip)."""
    return (torch.sin(x.float() * 1.3 + float(t) / 300.0) * 1.5).to(x.dtype)


def run_loop(scheduler, x, *, eta=0.0, noises=None, dtype=torch.float32):
    out = []
    x = x.to(dtype)
    for k, t in enumerate(scheduler.timesteps):
        kw = {} if noises is None else {"variance_noise": noises[k].to(dtype)}
        x = scheduler.step(toy_model(x, t), t, x, eta=eta, **kw).prev_sample
        out.append(x)
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rollout_step_is_diffusers_step_bit_for_bit_at_eta_zero(config, dtype):
    ours, theirs = DDIMScheduler(**config), diffusers.DDIMScheduler(**config)
    ours.set_timesteps(STEPS)
    theirs.set_timesteps(STEPS)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    expect = run_loop(theirs, x, dtype=dtype)
    assert run_loop(ours, x, dtype=dtype)[-1].equal(expect[-1])  # outside a rollout: diffusers' own step
    with ours.rollout(noise_level=0.0) as rec:
        got = run_loop(ours, x, dtype=dtype)
    for g, e in zip(got, expect):
        assert g.dtype == e.dtype and torch.equal(g, e)
    traj = rec.trajectory()
    assert torch.equal(traj.log_probs, torch.zeros(2, STEPS))
    assert torch.equal(traj.latents[:, -1], expect[-1])


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_rollout_step_is_diffusers_step_bit_for_bit_with_the_same_noise(config):
    """eta = 0.8 in float32: the rollout's x' = mu + std * variance_noise is diffusers' sample."""
    ours, theirs = DDIMScheduler(**config), diffusers.DDIMScheduler(**config)
    ours.set_timesteps(STEPS)
    theirs.set_timesteps(STEPS)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    noises = torch.randn(STEPS, 2, 4, 8, 8, generator=gen)
    expect = run_loop(theirs, x, eta=0.8, noises=noises)
    with ours.rollout(noise_level=0.8) as rec:
        got = run_loop(ours, x, eta=0.8, noises=noises)
    assert all(torch.equal(g, e) for g, e in zip(got, expect))
    # and the recorded log-probs recompute exactly
    traj = rec.trajectory()
    table = alpha_bar_table(ours)
    assert torch.equal(traj.sigmas, table)
    for i, t in enumerate(ours.timesteps):
        x_i = traj.latents[:, i]
        lp = flowrl.step_log_prob(x_i, toy_model(x_i, t), traj.latents[:, i + 1], traj.sigmas, i, **traj.step_options())
        assert torch.equal(lp, traj.log_probs[:, i])


def test_zero_terminal_snr_at_eta_one_stays_finite_where_diffusers_is_nan():
    """At alpha_bar_t = 0 (rescale_betas_zero_snr's first step) and eta = 1, std^2 = 1 - alpha_bar_prev
    exactly, and diffusers' sqrt(1 - alpha_bar_prev - std^2) is NaN where its rounding goes negative
    (which schedules depends on the platform's float32 pow); flowrl clamps the radicand at 0 (the
    contract: no NaN in the domain), so the mean's eps term is 0 where its own rounding goes negative
    and at most sqrt of a few ulps of 1 elsewhere: finite on every schedule, exact math to 2e-3."""
    config = CONFIGS[3]
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    nan_schedules = 0
    for steps in range(2, 40):
        ours, theirs = DDIMScheduler(**config), diffusers.DDIMScheduler(**config)
        ours.set_timesteps(steps)
        theirs.set_timesteps(steps)
        t = ours.timesteps[0]
        # diffusers' own radicand, its operations (DDIMScheduler.step, eta = 1)
        prev_t = t - theirs.config.num_train_timesteps // theirs.num_inference_steps
        a_prev = theirs.alphas_cumprod[prev_t] if prev_t >= 0 else theirs.final_alpha_cumprod
        std = theirs._get_variance(t, prev_t) ** 0.5
        theirs_prev = theirs.step(toy_model(x, t), t, x, eta=1.0, variance_noise=noise).prev_sample
        if float(1 - a_prev - std ** 2) < 0:
            assert bool(theirs_prev.isnan().all())
            nan_schedules += 1
        with ours.rollout(noise_level=1.0) as rec:
            out = ours.step(toy_model(x, t), t, x, eta=1.0, variance_noise=noise)
        assert rec.steps_recorded == 1
        assert bool(torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all())
        a_prev = float(alpha_bar_table(ours)[1])  # x' = sqrt(a_prev) x0_hat + std eps, x0_hat = -v (a_t = 0)
        expect = math.sqrt(a_prev) * -toy_model(x, t).double() + math.sqrt(1 - a_prev) * noise.double()
        torch.testing.assert_close(out.prev_sample.double(), expect, rtol=0, atol=2e-3)
    assert nan_schedules > 0  # diffusers' rounding does go negative on some of these schedules


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_the_clamped_radicand_gives_an_exact_zero_eps_term(backend):
    """Where flowrl's own (1 - a') - std^2 rounds negative (a = 0, eta = 1; found under the backend's
    float32 operations) k is 0: x' = sqrt(a') x0_hat + std eps exactly as in exact math, with no NaN.
    The backend's square root: torch's for the torch backend (its CPU float32 sqrt is not always
    correctly rounded: about 1 in 5 off by an ulp on an AMD EPYC with torch 2.13), the correctly
    rounded one for the kernels' sqrt_rn (flowrl.backends.reference.sqrt_rn; docs/contract.md, ddim)."""
    root = torch.sqrt if backend == "torch" else flowrl.backends.reference.sqrt_rn
    a_prev = torch.linspace(0.001, 0.5, 2001)
    std = root((1 - a_prev) * (1 - 0.0 / a_prev))
    negative = a_prev[(1 - a_prev) - std * std < 0][:4]
    assert len(negative) == 4
    table = torch.stack([torch.zeros_like(negative), negative], 1).reshape(-1)
    v = toy_model(torch.randn(4, 64, generator=torch.Generator().manual_seed(3)), 999)
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    out = flowrl.sde_step(torch.zeros(4, 64), v, table, torch.arange(4), noise=noise, mode="ddim", noise_level=1.0,
                          prediction_type="v_prediction", backend=backend)
    assert bool(torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all())
    mean = root(negative)[:, None] * -v  # k * eps_hat is +0 exactly
    assert torch.equal(out.prev_sample_mean, mean)


@pytest.mark.parametrize("backend", ("torch", "triton"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_rollout_recomputes_with_ratio_exactly_one(dtype, backend, tmp_path):
    sched = DDIMScheduler(**CONFIGS[0])
    sched.set_timesteps(STEPS)
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    gens = [torch.Generator().manual_seed(10 + b) for b in range(3)]
    with sched.rollout(noise_level=1.0, generator=gens, backend=backend) as rec:
        for t in sched.timesteps:
            x = sched.step(toy_model(x, t), t, x).prev_sample
    traj = rec.trajectory()
    assert traj.mode == "ddim" and traj.prediction_type == "epsilon" and traj.clip_sample_range is None
    assert bool((traj.log_probs[:, :-1] != 0).all())  # eta = 1 steps are stochastic; the last has a_prev = a_0
    for i, t in enumerate(sched.timesteps):
        x_i = traj.latents[:, i]
        v = toy_model(x_i, t).requires_grad_()
        lp = flowrl.step_log_prob(x_i, v, traj.latents[:, i + 1], traj.sigmas, i, backend=backend, **traj.step_options())
        assert torch.equal(torch.exp(lp - traj.log_probs[:, i]), torch.ones(3))
        lp.sum().backward()
        assert bool(torch.isfinite(v.grad).all())
    # the trajectory survives the wire and a file with its ddim settings
    again = flowrl.RolloutTrajectory.from_wire(traj.to_wire())
    assert again.step_options() == traj.step_options() and torch.equal(again.sigmas, traj.sigmas)
    wire = traj.to_wire()
    del wire["prediction_type"]
    with pytest.raises(ValueError, match="missing keys \\['prediction_type'\\]"):
        flowrl.RolloutTrajectory.from_wire(wire)
    traj.save(tmp_path / "traj.safetensors")
    again = flowrl.RolloutTrajectory.load(tmp_path / "traj.safetensors")
    assert again.step_options() == traj.step_options() and torch.equal(again.log_probs, traj.log_probs)


def test_save_and_load_like_diffusers(tmp_path):
    sched = DDIMScheduler(**CONFIGS[2])
    sched.save_pretrained(tmp_path)
    ours = DDIMScheduler.from_pretrained(tmp_path)
    theirs = diffusers.DDIMScheduler.from_pretrained(tmp_path)
    assert type(ours) is DDIMScheduler and type(theirs) is diffusers.DDIMScheduler
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(ours.config) == public(sched.config) == public(theirs.config)
    assert theirs.config.clip_sample_range == 1.5 and ours.config.prediction_type == "sample"
    assert DDIMScheduler.from_config(theirs.config).config.prediction_type == "sample"
    assert isinstance(flowrl.DDIMScheduler(), diffusers.DDIMScheduler)


def test_refusals():
    with pytest.raises(ValueError, match="thresholding=True"):
        DDIMScheduler(thresholding=True).rollout()
    with pytest.raises(TypeError, match="must be a DDIMScheduler"):
        flowrl.rollout.ddim.DDIMRolloutRecorder(diffusers.PNDMScheduler())
    sched = DDIMScheduler()
    sched.set_timesteps(4)
    x = torch.randn(1, 4)
    with sched.rollout(noise_level=1.0) as rec:
        with pytest.raises(ValueError, match="use_clipped_model_output"):
            sched.step(x, sched.timesteps[0], x, use_clipped_model_output=True)
    assert rec.steps_recorded == 0


# ------------------------------------------------------------------------------ DDPO, the peer


def ddpo_ddim_step_with_logprob(scheduler, model_output, timestep, sample, eta, prev_sample):
    """DDPO's log-prob of ``prev_sample`` (kvablack/ddpo-pytorch,
    ddpo_pytorch/diffusers_patch/ddim_with_logprob.py, ``ddim_step_with_logprob`` with its
    ``_get_variance``), transcribed for epsilon-prediction without clipping (DDPO's Stable Diffusion
    setting): batched timesteps; prev_timestep = t - num_train_timesteps // num_inference_steps clamped
    to [0, 999] (so the final step reads alphas_cumprod[0], which is final_alpha_cumprod only when
    set_alpha_to_one=False); variance = (beta_prev / beta_t) * (1 - alpha_t / alpha_prev); std = eta *
    variance ** 0.5; mean = alpha_prev ** 0.5 * x0 + (1 - alpha_prev - std ** 2) ** 0.5 * eps; log-prob
    = mean over elements of -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)."""
    prev_timestep = torch.clamp(timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps,
                                0, scheduler.config.num_train_timesteps - 1)
    shape = (-1,) + (1,) * (sample.dim() - 1)
    alpha_prod_t = scheduler.alphas_cumprod.gather(0, timestep).reshape(shape)
    alpha_prod_t_prev = torch.where(prev_timestep >= 0, scheduler.alphas_cumprod.gather(0, prev_timestep),
                                    scheduler.final_alpha_cumprod).reshape(shape)
    beta_prod_t = 1 - alpha_prod_t
    pred_original_sample = (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5
    variance = ((1 - alpha_prod_t_prev) / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = eta * variance ** 0.5
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t ** 2) ** 0.5 * model_output
    prev_sample_mean = alpha_prod_t_prev ** 0.5 * pred_original_sample + pred_sample_direction
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t ** 2) - torch.log(std_dev_t)
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_log_probs_match_ddpo(backend):
    """DDPO's training setting (SD 1.x config, set_alpha_to_one=False, eta = 1, per-sample timesteps):
    flowrl's log-prob of the same stored sample equals DDPO's at float32 rounding, on every step."""
    sched = DDIMScheduler(**CONFIGS[0])
    sched.set_timesteps(10)
    gen = torch.Generator().manual_seed(3)
    table = alpha_bar_table(sched)
    idx = torch.tensor([0, 3, 6, 9])  # shuffled per-sample steps, as DDPO trains them; 9 is the last
    t = sched.timesteps[idx]
    x = torch.randn(4, 4, 16, 16, generator=gen)
    eps_hat = torch.randn(4, 4, 16, 16, generator=gen)
    out = flowrl.sde_step(x, eps_hat, table, idx, mode="ddim", noise_level=1.0, generator=gen, backend=backend)
    ddpo = ddpo_ddim_step_with_logprob(sched, eps_hat, t, x, 1.0, out.prev_sample)
    ours = flowrl.step_log_prob(x, eps_hat, out.prev_sample, table, idx, mode="ddim", noise_level=1.0, backend=backend)
    torch.testing.assert_close(ours, ddpo, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.log_prob, ddpo, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- a real diffusers pipeline


def tiny_sd_pipeline():
    """StableDiffusionPipeline with random tiny components as diffusers' own fast tests build them
    (get_dummy_components); no tokenizer (prompt_embeds come from the random CLIP text encoder)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4,
    )
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=5, pad_token_id=1, vocab_size=1000,
    ))
    scheduler = diffusers.DDIMScheduler(**CONFIGS[0])
    pipe = diffusers.StableDiffusionPipeline(
        unet=unet, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=None, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ids = torch.randint(3, 1000, (2, 77), generator=torch.Generator().manual_seed(0))
        embeds = text_encoder(ids)[0]
    return pipe, embeds


def test_stable_diffusion_pipeline_with_flowrl_ddim_scheduler():
    pipe, embeds = tiny_sd_pipeline()
    call = dict(prompt_embeds=embeds[:1], negative_prompt_embeds=embeds[1:], guidance_scale=6.0,
                num_inference_steps=3, output_type="latent")
    expect = pipe(generator=torch.Generator().manual_seed(0), **call).images
    pipe.scheduler = flowrl.DDIMScheduler.from_config(pipe.scheduler.config)
    assert torch.equal(pipe(generator=torch.Generator().manual_seed(0), **call).images, expect)
    with pipe.scheduler.rollout(noise_level=0.0) as rec:  # eta = 0: the same bits as diffusers'
        got = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert torch.equal(got, expect) and torch.equal(rec.trajectory().latents[:, -1], expect)

    # eta = 1: a rollout through the unmodified pipeline; its log-probs recompute to ratio 1 with the
    # same classifier-free-guided model output
    with pipe.scheduler.rollout(noise_level=1.0, generator=torch.Generator().manual_seed(5)) as rec:
        pipe(generator=torch.Generator().manual_seed(0), **call)
    traj = rec.trajectory()
    assert traj.num_steps == 3 and bool((traj.log_probs[:, :-1] != 0).all())
    with torch.no_grad():
        for i, t in enumerate(traj.timesteps):
            x = traj.latents[:, i]
            uncond, cond = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([embeds[1:], embeds[:1]])).sample.chunk(2)
            eps = uncond + 6.0 * (cond - uncond)
            lp = flowrl.step_log_prob(x, eps, traj.latents[:, i + 1], traj.sigmas, i, **traj.step_options())
            assert torch.equal(torch.exp(lp - traj.log_probs[:, i]), torch.ones(1))
