"""flowrl's scheduler swapped into real, unmodified diffusers video pipelines (tiny random components, see
tests/tiny_pipelines.py): LTXConditionPipeline (per-token timesteps, with and without an image),
LTXImageToVideoPipeline, WanImageToVideoPipeline (Wan 2.x I2V and Wan 2.2 TI2V-5B with
``expand_timesteps``), LTX2Pipeline (video + audio, two schedulers).

Each family: without a rollout the latents are diffusers' bits (fp32 and bf16), and so is a ``mode="ode"``
rollout's output; inside an sde rollout every step recomputed through ``traj.step_inputs(j)`` equals the
recorded log-prob bit for bit, with the velocity rebuilt from the transformer's output as
docs/scheduler.md says; changing the velocity on frozen elements changes nothing, on a scored one it
does. These are the failures of issue 12 (LTX Condition raising, Wan 2.2 TI2V counting frame 0, LTX-2's
audio unrecorded with the video's noise) as passing tests.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import flowrl

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")  # the pipeline modules import it for their text-encoder types
pytest.importorskip("PIL")

import tiny_pipelines as tiny  # noqa: E402
from flowrl.rollout.recorder import RolloutRecorder  # noqa: E402

BF16 = torch.bfloat16

BUILDERS = {
    "ltx-condition": lambda dtype: tiny.tiny_ltx_condition(dtype, with_image=False),
    "ltx-condition-image": lambda dtype: tiny.tiny_ltx_condition(dtype, with_image=True),
    "ltx-i2v": tiny.tiny_ltx_i2v,
    "wan-i2v": tiny.tiny_wan_i2v,
    "wan22-ti2v": tiny.tiny_wan22_ti2v,
    "ltx2": tiny.tiny_ltx2,
}
FAMILIES = list(BUILDERS)
# families whose model output reaches a plain (not per-token) step in bf16 when the pipeline runs in bf16;
# LTX I2V and LTX-2 call .float() on it, LTX Condition's per-token step promotes it
BF16_STEP_INPUT = {"wan-i2v", "wan22-ti2v"}


def frozen_mask(family: str):
    """The ``rollout(frozen=)`` mask a family needs (docs/scheduler.md): Wan 2.2 TI2V's latent frame 0."""
    if family != "wan22-ti2v":
        return None
    mask = torch.zeros(1, 1, 3, 1, 1, dtype=torch.bool)  # [B, C, F, H, W]: 9 frames -> 3 latent frames
    mask[:, :, 0] = True
    return mask


def outputs(result) -> tuple:
    return tuple(t for t in result.to_tuple() if isinstance(t, torch.Tensor))


def assert_same_bits(a: tuple, b: tuple):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.fixture(scope="module")
def pipes():
    cache = {}

    def get(family, dtype):
        if (family, dtype) not in cache:
            cache[(family, dtype)] = BUILDERS[family](dtype)
        return cache[(family, dtype)]

    return get


def swap(pipe):
    stock = pipe.scheduler
    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(stock.config)  # the one-line swap
    return stock


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_scheduler_and_ode_rollout_give_diffusers_bits(pipes, family, dtype):
    pipe, call = pipes(family, dtype)
    stock = pipe.scheduler
    try:
        expected = outputs(pipe(**call()))
        swap(pipe)
        assert_same_bits(outputs(pipe(**call())), expected)
        with pipe.scheduler.rollout(mode="ode", frozen=frozen_mask(family)) as rec:
            got = outputs(pipe(**call()))
        if dtype == torch.float32 or family not in BF16_STEP_INPUT:
            assert_same_bits(got, expected)  # Wan 2.2 TI2V: the frozen frame 0 is replaced by the condition
        else:
            # diffusers' plain step multiplies a bf16 model output by a 0-d float32 dt in bf16 (no
            # promotion); a rollout step computes in float32 (docs/scheduler.md), so its bits differ
            assert all(torch.allclose(a.float(), b.float(), atol=0.1) for a, b in zip(got, expected))
        traj = rec.trajectory()
        assert torch.equal(traj.log_probs, torch.zeros_like(traj.log_probs))
        assert traj.num_streams == (2 if family == "ltx2" else 1)
    finally:
        pipe.scheduler = stock


class Spy:
    """What reached each recording ``step`` (stream, model output, per-token timesteps, result) and what
    the transformer returned, in call order."""

    def __init__(self, monkeypatch, pipe):
        self.steps, self.transformer_outputs = [], []
        record = RolloutRecorder._record

        def spy(recorder, stream, model_output, sample, step_generator, per_token_timesteps):
            out = record(recorder, stream, model_output, sample, step_generator, per_token_timesteps)
            self.steps.append((stream.index, model_output, sample, per_token_timesteps, out))
            return out

        monkeypatch.setattr(RolloutRecorder, "_record", spy)
        handle = pipe.transformer.register_forward_hook(lambda m, args, out: self.transformer_outputs.append(out))
        self.remove = handle.remove

    def stream(self, k: int):
        return [s for s in self.steps if s[0] == k]


def rebuilt_velocities(family: str, pipe, spy: Spy, traj) -> list:
    """docs/scheduler.md's recipe per family: the velocity (flowrl's x' = x + (sigma' - sigma) v) of each
    step and stream, rebuilt from the transformer's output the way a trainer computes it."""
    sigmas = traj.sigmas  # the scheduler's float32 table, as the pipeline reads scheduler.sigmas[i]
    per_step = []
    for i, out in enumerate(spy.transformer_outputs):
        if family.startswith("ltx-condition"):
            # the pipeline passes -noise_pred with per_token_timesteps, whose step moves by
            # (sigma - sigma') * model_output: the velocity is the transformer's output itself
            per_step.append((out[0],))
        elif family == "ltx-i2v":
            # float32, unpacked to [B, C, F, H, W], frames 1: (frame 0 is the image, never stepped)
            batch, channels = out[0].shape[0], pipe.transformer.config.out_channels
            x = spy.stream(0)[i][2]
            v = pipe._unpack_latents(out[0].float(), x.shape[2] + 1, x.shape[3], x.shape[4], 1, 1)
            assert v.shape[:2] == (batch, channels)
            per_step.append((v[:, :, 1:],))
        elif family.startswith("wan"):
            per_step.append((out[0],))
        elif family == "ltx2":
            # float32, then v -> x0 -> v with the step's sigma: (x - (x - v * sigma)) / sigma
            sigma = sigmas[i]
            rebuilt = []
            for k, v in enumerate(out[:2]):
                x = spy.stream(k)[i][2]
                x0 = x - v.float() * sigma
                rebuilt.append((x - x0) / sigma)
            per_step.append(tuple(rebuilt))
    return per_step


@pytest.mark.parametrize("family", FAMILIES)
def test_sde_rollout_recomputes_bit_for_bit_from_step_inputs(pipes, family, monkeypatch):
    dtype = torch.float32 if family != "wan-i2v" else BF16  # one bf16 family keeps the half-precision path
    pipe, call = pipes(family, dtype)
    stock = swap(pipe)
    spy = Spy(monkeypatch, pipe)
    try:
        kwargs = call()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pipe.scheduler.rollout(mode="sde", noise_level=0.7, frozen=frozen_mask(family),
                                        generator=torch.Generator().manual_seed(5)) as rec:
                pipe(**kwargs)
        # LTX Condition re-noises its (held) conditioning tokens before each step: not a scored change
        assert not [w for w in caught if "input is not step" in str(w.message)]
    finally:
        spy.remove()
        pipe.scheduler = stock
    traj = rec.trajectory()
    streams = 2 if family == "ltx2" else 1
    assert traj.num_streams == streams and traj.num_steps == tiny.STEPS
    assert traj.log_probs.dtype == torch.float32 and bool(torch.isfinite(traj.log_probs).all())
    assert bool((traj.log_probs != 0).all())  # every step stochastic, every sample scored

    velocities = rebuilt_velocities(family, pipe, spy, traj)
    if family == "ltx2":  # v -> x0 -> v is not the transformer's output bit for bit
        assert not all(torch.equal(v, out[0].float()) for v, out in zip((s[0] for s in velocities), spy.transformer_outputs))
    for j in range(traj.num_steps):
        reached = spy.steps[j * streams:(j + 1) * streams]  # a loop step steps every stream in turn
        # the rebuilt velocity is what reached step (negated for a per-token step)
        for (k, model_output, _, per_token, _), v in zip(reached, velocities[j]):
            assert torch.equal(-model_output if per_token is not None else model_output, v), (j, k)
        v = velocities[j][0] if streams == 1 else velocities[j]
        inputs = traj.step_inputs(j)
        assert torch.equal(flowrl.step_log_prob(model_output=v, **inputs), traj.log_probs[:, j]), j

    # frozen and held elements: the velocity there does not enter the log-prob; a scored one does
    j = 1
    inputs = traj.step_inputs(j)
    v = velocities[j][0].clone()
    unscored = torch.zeros(v.shape, dtype=torch.bool)
    if inputs.get("frozen") is not None:
        unscored |= inputs["frozen"] if streams == 1 else inputs["frozen"][0]
    if inputs.get("token_sigmas") is not None:
        unscored |= inputs["token_sigmas"] == 0
    with_streams = (lambda v0: v0) if streams == 1 else (lambda v0: (v0,) + tuple(velocities[j][1:]))
    if family in ("ltx-condition-image", "wan22-ti2v"):
        assert 0 < int(unscored.sum()) < unscored.numel()
        changed = torch.where(unscored, v + 100.0, v)
        assert torch.equal(flowrl.step_log_prob(model_output=with_streams(changed), **inputs), traj.log_probs[:, j])
    else:
        assert not bool(unscored.any())
    scored = (~unscored).nonzero()[0].tolist()
    v[tuple(scored)] += 1.0
    assert not torch.equal(flowrl.step_log_prob(model_output=with_streams(v), **inputs), traj.log_probs[:, j])


def test_ltx_condition_image_tokens_are_held_at_t_zero(pipes):
    """With an image, ``per_token_timesteps`` is [B, S] with 0 on the conditioning tokens: the rollout
    records it compactly ([B, T, S, 1]) and holds those tokens; the per-token step's output stays float32."""
    pipe, call = pipes("ltx-condition-image", torch.float32)
    stock = swap(pipe)
    try:
        with pipe.scheduler.rollout(mode="sde", generator=torch.Generator().manual_seed(1)) as rec:
            pipe(**call())
    finally:
        pipe.scheduler = stock
    traj = rec.trajectory()
    tokens = traj.latents.shape[2]
    assert traj.token_sigmas.shape == (2, tiny.STEPS, tokens, 1) and traj.token_sigmas.dtype == torch.float32
    held = traj.token_sigmas[:, 0] == 0
    assert 0 < int(held.sum()) < tokens * 2
    # held tokens never change between the steps' inputs (the pipeline re-noises them before each step only
    # through its own torch.where, which the recorder does not score)
    for j in range(traj.num_steps):
        assert torch.equal((traj.token_sigmas[:, j] == 0), held)


def test_ltx2_audio_is_a_second_stream_with_independent_noise(pipes, monkeypatch):
    pipe, call = pipes("ltx2", torch.float32)
    stock = swap(pipe)
    spy = Spy(monkeypatch, pipe)
    gens = [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]  # one per sample
    try:
        with pipe.scheduler.rollout(mode="sde", generator=gens) as rec:
            pipe(**call())
    finally:
        spy.remove()
        pipe.scheduler = stock
    traj = rec.trajectory()
    video, audio = traj.streams
    assert torch.equal(video.latents, traj.latents) and audio.latents.shape != video.latents.shape
    assert video.reduction == audio.reduction == "sum" and traj.reduction == "mean"
    # the joint log-prob is combine_streams of the streams' sums and counts
    for j in range(traj.num_steps):
        joint = flowrl.combine_streams([video.log_probs[:, j], audio.log_probs[:, j]],
                                       [video.counts[:, j], audio.counts[:, j]], "mean")
        assert torch.equal(joint, traj.log_probs[:, j])
    assert torch.equal(audio.counts[:, 0], torch.full((2,), float(audio.latents[0, 0].numel())))

    def step_noise(entry):
        _, _, _, _, out = entry
        return ((out.prev_sample.float() - out.prev_sample_mean) / out.std_dev.view(-1, *[1] * (out.prev_sample.dim() - 1)))

    video_noise, audio_noise = step_noise(spy.stream(0)[0]), step_noise(spy.stream(1)[0])
    n = audio_noise[0].numel()
    for b in range(2):  # not the video's first values (what a deep-copied generator repeats), per sample
        assert not torch.allclose(audio_noise[b].flatten(), video_noise[b].flatten()[:n], atol=1e-2)
    # the audio scheduler is a plain scheduler again once the rollout ends
    assert not any(name in pipe.scheduler.__dict__ for name in ("step", "__deepcopy__"))


def test_wan22_ti2v_frame0_is_frozen_and_without_the_mask_it_is_counted(pipes, monkeypatch):
    """Issue 12's failure 3: Wan 2.2 TI2V steps latent frame 0 but replaces it by the image condition
    (pipeline_wan_i2v.py: ``latent_model_input = (1 - first_frame_mask) * condition + first_frame_mask *
    latents`` and the same after the loop). With ``frozen`` the log-prob ignores frame 0's velocity."""
    pipe, call = pipes("wan22-ti2v", torch.float32)
    stock = swap(pipe)
    spy = Spy(monkeypatch, pipe)
    try:
        with pipe.scheduler.rollout(mode="sde", generator=torch.Generator().manual_seed(2)) as rec:
            pipe(**call())
    finally:
        spy.remove()
        pipe.scheduler = stock
    traj = rec.trajectory()
    assert traj.frozen is None
    v = spy.transformer_outputs[0][0]
    changed = v.clone()
    changed[:, :, 0] += 1.0
    inputs = traj.step_inputs(0)
    # without the mask, frame 0 counts: the log-prob moves though the video cannot (the bug the mask fixes)
    assert not torch.equal(flowrl.step_log_prob(model_output=changed, **inputs),
                           flowrl.step_log_prob(model_output=v, **inputs))
    all_count = flowrl.step_log_prob(model_output=v, **inputs, return_count=True).count
    inputs["frozen"] = frozen_mask("wan22-ti2v")
    assert torch.equal(flowrl.step_log_prob(model_output=changed, **inputs),
                       flowrl.step_log_prob(model_output=v, **inputs))
    # frame 0 is one of the 3 latent frames of the 9-frame video: a third of the elements
    assert torch.equal(flowrl.step_log_prob(model_output=v, **inputs, return_count=True).count * 3, all_count * 2)


@pytest.mark.parametrize("module, cls, lines", [
    ("lumina2.pipeline_lumina2", "Lumina2Pipeline", ["noise_pred = -noise_pred",
                                                     "latents = self.scheduler.step(noise_pred, t, latents"]),
    ("flux.pipeline_flux_kontext", "FluxKontextPipeline", ["noise_pred = noise_pred[:, : latents.size(1)]",
                                                           "latents = self.scheduler.step(noise_pred, t, latents"]),
    ("flux2.pipeline_flux2", "Flux2Pipeline", ["noise_pred = noise_pred[:, : latents.size(1) :]",
                                               "latents = self.scheduler.step(noise_pred, t, latents"]),
    ("flux2.pipeline_flux2_klein", "Flux2KleinPipeline", ["noise_pred = noise_pred[:, : latents.size(1) :]",
                                                          "latents = self.scheduler.step(noise_pred, t, latents"]),
])
def test_docs_velocity_rules_match_the_installed_pipelines(module, cls, lines):
    """docs/scheduler.md's rows for pipelines not run here: the lines that build what reaches ``step``
    are in the installed diffusers' ``__call__``, in this order (a diffusers change fails this test)."""
    import importlib
    import inspect

    source = inspect.getsource(getattr(importlib.import_module(f"diffusers.pipelines.{module}"), cls).__call__)
    positions = [source.find(line) for line in lines]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions
