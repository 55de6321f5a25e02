"""flowrl.rollout.recorder: recording rollouts with a scheduler instance the user already has (diffusers' own
FlowMatchEulerDiscreteScheduler, a framework's subclass, or flowrl's), and restoring it afterwards."""
import copy
import inspect
import subprocess
import sys
import warnings

import pytest
import torch

import flowrl
from flowrl.rollout.recorder import RolloutRecorder, rollout
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler as Sched

diffusers = pytest.importorskip("diffusers")
BF16 = torch.bfloat16


def toy_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)


def run_loop(sched, x, **step_kwargs):
    outputs = []
    for t in sched.timesteps:
        outputs.append(toy_velocity(x, t))
        x = sched.step(outputs[-1], t, x, return_dict=False, **step_kwargs)[0]
    return x, outputs


def record(sched, x, steps=5, **kwargs):
    sched.set_timesteps(steps, device=x.device)
    with rollout(sched, **kwargs) as rec:
        out, outputs = run_loop(sched, x)
    return rec.trajectory(), out, outputs


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_wrapped_diffusers_scheduler_records_what_flowrls_records(dtype, device):
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    gen = lambda: torch.Generator(device).manual_seed(1)  # noqa: E731
    traj, out, outputs = record(theirs, x, mode="dance", noise_level=0.5, generator=gen())
    ours, _, _ = record(Sched(shift=3.0), x, mode="dance", noise_level=0.5, generator=gen())
    assert traj.latents.device == traj.sigmas.device == x.device
    for field in ("latents", "log_probs", "sigmas", "timesteps", "latent_step_indices"):
        assert torch.equal(getattr(traj, field), getattr(ours, field)), field
    assert traj.latents.dtype == dtype and torch.equal(traj.latents[:, -1], out)
    for i, v in enumerate(outputs):
        lp = flowrl.step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i, mode="dance", noise_level=0.5)
        assert torch.equal(lp, traj.log_probs[:, i]), i
    assert theirs.step_index == 5  # where diffusers' own loop leaves it


def test_scheduler_is_restored_after_the_block_and_after_an_exception():
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    other = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    x = torch.randn(2, 8)
    sched.set_timesteps(4)
    plain, _ = run_loop(sched, x)
    rec = rollout(sched, generator=torch.Generator().manual_seed(0))
    with rec:
        assert rec.active and "step" in vars(sched) and "set_timesteps" in vars(sched)
        assert "step" not in vars(other)  # the instance is patched, not the class
        sched.set_timesteps(4)
        run_loop(sched, x)
    assert not rec.active and "step" not in vars(sched) and "set_timesteps" not in vars(sched)
    sched.set_timesteps(4)
    assert torch.equal(run_loop(sched, x)[0], plain)

    with pytest.raises(ZeroDivisionError), rollout(sched):
        1 / 0
    assert "step" not in vars(sched) and "set_timesteps" not in vars(sched)

    # an instance attribute the scheduler had before (another wrapper) comes back
    def framework_step(*args, **kwargs):
        return type(sched).step(sched, *args, **kwargs)

    sched.step = framework_step
    with rollout(sched):
        assert sched.step is not framework_step
    assert sched.step is framework_step and "set_timesteps" not in vars(sched)


def test_patched_methods_keep_the_signatures_pipelines_inspect():
    # retrieve_timesteps looks for "sigmas" in set_timesteps; pipelines look for "generator" in step
    sched = diffusers.FlowMatchEulerDiscreteScheduler()
    with rollout(sched):
        assert {"sigmas", "mu", "timesteps"} <= set(inspect.signature(sched.set_timesteps).parameters)
        assert {"generator", "return_dict"} <= set(inspect.signature(sched.step).parameters)


def test_framework_subclass_and_bf16_timesteps():
    class FrameworkScheduler(diffusers.FlowMatchEulerDiscreteScheduler):
        pass

    sched = FrameworkScheduler(shift=3.0)
    sigmas = [0.9, 0.7, 0.5, 0.3, 0.1]  # the loop's first timestep (964.29) is not a bf16 value
    sched.set_timesteps(sigmas=sigmas)
    x = torch.randn(2, 8, dtype=BF16)
    with pytest.raises(IndexError):  # diffusers' exact lookup fails on the bf16-rounded timestep
        sched.step(toy_velocity(x, sched.timesteps[0]), sched.timesteps[0].to(BF16), x)
    sched.set_timesteps(sigmas=sigmas)
    outputs = []
    with rollout(sched, generator=torch.Generator().manual_seed(0)) as rec:
        for t in sched.timesteps:
            outputs.append(toy_velocity(x, t))
            x = sched.step(outputs[-1], t.to(BF16), x).prev_sample  # the recorder resolves bf16 timesteps
    traj = rec.trajectory()
    assert traj.log_probs.shape == (2, 5) and sched.step_index == 5
    for i, v in enumerate(outputs):
        assert torch.equal(flowrl.step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i), traj.log_probs[:, i])


def test_wrapping_and_scheduler_rollout_are_one_recorder():
    sched = Sched()
    assert type(sched.rollout()) is RolloutRecorder
    with sched.rollout() as rec:
        assert sched.step._flowrl_recorder is rec
        with pytest.raises(RuntimeError, match="nest"), rollout(sched):
            pass
    theirs = diffusers.FlowMatchEulerDiscreteScheduler()
    with rollout(theirs):
        with pytest.raises(RuntimeError, match="nest"), RolloutRecorder(theirs):
            pass


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: diffusers.EulerDiscreteScheduler(), TypeError, "scheduler must be a FlowMatchEulerDiscreteScheduler"),
        (lambda: diffusers.FlowMatchHeunDiscreteScheduler(), TypeError, "scheduler must be .*; got FlowMatchHeunDiscreteScheduler"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler, TypeError, "scheduler must be a scheduler instance, not the class"),
        (lambda: "scheduler", TypeError, "scheduler must be"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), ValueError, "scheduler has config.stochastic_sampling"),
        (lambda: Sched(stochastic_sampling=True), ValueError, "scheduler has config.stochastic_sampling"),
        (lambda: diffusers.FlowMatchEulerDiscreteScheduler(invert_sigmas=True), ValueError, "scheduler has config.invert_sigmas"),
    ],
    ids=["euler-eps", "flow-heun", "class", "str", "stochastic-diffusers", "stochastic-flowrl", "invert-sigmas"],
)
def test_schedulers_it_cannot_drive_raise(make, error, match):
    with pytest.raises(error, match=match):
        rollout(make())


def test_step_arguments_it_cannot_honor_raise():
    sched = diffusers.FlowMatchEulerDiscreteScheduler()
    sched.set_timesteps(3)
    x = torch.randn(2, 8)
    with rollout(sched):
        with pytest.raises(TypeError, match="eta"):
            sched.step(x, sched.timesteps[0], x, eta=0.5)
        with pytest.raises(ValueError, match="per_token_timesteps"):  # [B, S] per token needs [B, S, C] latents
            sched.step(x, sched.timesteps[0], x, per_token_timesteps=torch.full((2, 8), 1000.0))
        with pytest.raises(ValueError, match="integer index"):
            sched.step(x, 3, x)
        with pytest.raises(TypeError, match="model_output"):
            sched.step(x.long(), sched.timesteps[0], x)
        sched.step(x, sched.timesteps[0], x, 0.0, 0.0, float("inf"), 1.0)  # s_churn...s_noise: accepted, unused
        with pytest.raises(RuntimeError, match="one denoising loop"):
            sched.set_timesteps(3)


def test_the_recording_step_takes_flowrls_step_arguments():
    # the recorder binds step's arguments to step_output.STEP_SIGNATURE (it does not import the scheduler)
    from flowrl.rollout.step_output import STEP_SIGNATURE

    ours = inspect.signature(Sched.step)
    assert ours.replace(parameters=list(ours.parameters.values())[1:]) == STEP_SIGNATURE


# a subprocess each; with diffusers ~5 s (importing it): the full suite's
@pytest.mark.parametrize("diffusers_installed", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["diffusers", "no-diffusers"])
def test_the_recorder_imported_alone_drives_both_schedulers(diffusers_installed):
    # a fresh interpreter that imports the recorder first: it records diffusers' scheduler without
    # importing flowrl's copy, and accepts flowrl's copy once that is imported (it registers itself)
    script = f"""
import sys
if not {diffusers_installed}:
    sys.modules["diffusers"] = None
import torch
from flowrl.rollout.recorder import rollout, check_scheduler
assert "flowrl.rollout.scheduler" not in sys.modules

def loop(sched):
    sched.set_timesteps(3)
    x = torch.randn(2, 8)
    with rollout(sched, generator=torch.Generator().manual_seed(0)) as rec:
        for t in sched.timesteps:
            x = sched.step(torch.sin(x), t, x, return_dict=False)[0]
    assert rec.trajectory().log_probs.shape == (2, 3)

if {diffusers_installed}:
    import diffusers
    loop(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    assert "flowrl.rollout.scheduler" not in sys.modules
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler
check_scheduler(FlowMatchEulerDiscreteScheduler())
loop(FlowMatchEulerDiscreteScheduler(shift=3.0))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_generator_falls_back_to_steps_own_and_ode_steps_draw_none():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    with_recorder_gen, _, _ = record(theirs, x, generator=torch.Generator().manual_seed(7))
    theirs.set_timesteps(5)
    with rollout(theirs) as rec:  # generator=None: the generator passed to step() is used
        run_loop(theirs, x, generator=torch.Generator().manual_seed(7))
    assert torch.equal(rec.trajectory().latents, with_recorder_gen.latents)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    record(theirs, x, sde_steps=[], generator=g)  # all ode: no noise drawn
    assert torch.equal(g.get_state(), state)



# ---------------------------------------------------------------------------------------------------
# joint streams: a scheduler copied during a rollout (LTX-2's audio_scheduler = copy.deepcopy(...))


def joint_loop(sched, video, audio, copier=copy.deepcopy, steps=4, generator=None):
    """LTX-2's loop shape: copy the scheduler, set both schedules, step video then audio each iteration."""
    audio_sched = copier(sched)
    audio_sched.set_timesteps(steps)
    sched.set_timesteps(steps)
    sched.set_begin_index(0)
    audio_sched.set_begin_index(0)
    outs = []
    for t in sched.timesteps:
        v, a = toy_velocity(video, t), toy_velocity(audio, t)
        outs.append((v, a))
        video = sched.step(v, t, video, return_dict=False, generator=generator)[0]
        audio = audio_sched.step(a, t, audio, return_dict=False, generator=generator)[0]
    return video, audio, outs, audio_sched


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy], ids=["deepcopy", "copy"])
@pytest.mark.parametrize("make", [lambda: diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), lambda: Sched(shift=3.0)],
                         ids=["diffusers", "flowrl"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_copy_made_during_a_rollout_records_as_a_second_stream(make, copier, reduction):
    sched = make()
    video = torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(0))
    audio = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    with rollout(sched, mode="sde", reduction=reduction, generator=gens) as rec:
        v_out, a_out, outs, audio_sched = joint_loop(sched, video, audio, copier)
    assert rec.num_streams == 2
    traj = rec.trajectory()
    assert traj.num_streams == 2 and traj.streams[1].latents.shape == (2, 5, 5, 3)
    assert torch.equal(traj.streams[1].latents[:, -1], a_out) and torch.equal(traj.latents[:, -1], v_out)
    for j, (v, a) in enumerate(outs):
        lp = flowrl.step_log_prob(model_output=(v, a), **traj.step_inputs(j))
        assert torch.equal(lp, traj.log_probs[:, j]), j
    # the audio's noise is its own: not the video's first values, and sample 1's not sample 0's
    eps_v = traj.latents[:, 1] - traj.latents[:, 0]
    eps_a = traj.streams[1].latents[:, 1] - traj.streams[1].latents[:, 0]
    assert not torch.allclose(eps_a.flatten(1), eps_v.flatten(1)[:, :eps_a[0].numel()], atol=1e-3)
    # after the block both are plain schedulers: the copy steps with diffusers' Euler step again
    for s in (sched, audio_sched):
        assert not any(name in s.__dict__ for name in ("step", "set_timesteps", "__deepcopy__", "__reduce_ex__"))
    assert type(copy.deepcopy(audio_sched)) is type(sched)


def test_joint_rollout_is_deterministic_and_per_sample_noise_is_batch_invariant():
    video = torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(0))
    audio = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))

    def run(rows, seeds):
        sched = Sched(shift=3.0)
        with rollout(sched, generator=[torch.Generator().manual_seed(s) for s in seeds]) as rec:
            joint_loop(sched, video[rows], audio[rows])
        return rec.trajectory()

    both, again, second = run(slice(0, 2), [7, 8]), run(slice(0, 2), [7, 8]), run(slice(1, 2), [8])
    assert torch.equal(both.log_probs, again.log_probs)
    assert torch.equal(both.streams[1].latents[1:], second.streams[1].latents)
    assert torch.equal(both.log_probs[1:], second.log_probs)


def test_copies_outside_a_rollout_are_plain_and_late_copies_are_refused():
    sched = Sched(shift=3.0)
    plain = copy.deepcopy(sched)
    assert "step" not in plain.__dict__
    x = torch.randn(2, 8)
    sched.set_timesteps(3)
    with rollout(sched) as rec:
        sched.step(x, sched.timesteps[0], x)
        with pytest.raises(RuntimeError, match="copied after this rollout recorded steps"):
            copy.deepcopy(sched)
    # a copy that never steps (made, then dropped) is no stream of the rollout
    sched.set_timesteps(3)
    with rollout(sched) as rec:
        copy.deepcopy(sched)
        run_loop(sched, x)
    assert rec.trajectory().num_streams == 1 and rec.trajectory().streams is None


def test_stream_noise_derives_from_the_step_generator_when_the_recorder_has_none():
    video, audio = torch.randn(2, 12, 4), torch.randn(2, 5, 3)

    def run():
        sched = Sched(shift=3.0)
        with rollout(sched) as rec:
            joint_loop(sched, video, audio, generator=torch.Generator().manual_seed(3))
        return rec.trajectory()

    a, b = run(), run()
    assert torch.equal(a.streams[1].latents, b.streams[1].latents)
    eps_v, eps_a = a.latents[:, 1] - a.latents[:, 0], a.streams[1].latents[:, 1] - a.streams[1].latents[:, 0]
    assert not torch.allclose(eps_a.flatten(1), eps_v.flatten(1)[:, :15], atol=1e-3)


# ---------------------------------------------------------------------------------------------------
# per-token timesteps (LTXConditionPipeline) and frozen masks (Wan 2.2 TI2V)


def ltx_condition_loop(sched, x, conditioning, steps=4, dtype=torch.float32):
    """pipeline_ltx_condition.py's loop, operation for operation: per-token timesteps min(t, (1 - mask) *
    1000) as [B, S], ``step(-noise_pred, ..., per_token_timesteps=)``, then torch.where keeping the
    conditioning tokens."""
    sched.set_timesteps(steps)
    outs = []
    for t in sched.timesteps:
        timestep = t.expand(x.shape[0]).unsqueeze(-1).float()
        timestep = torch.min(timestep, (1 - conditioning) * 1000.0)
        noise_pred = toy_velocity(x, t).to(dtype)
        outs.append(noise_pred)
        denoised = sched.step(-noise_pred, t, x, per_token_timesteps=timestep, return_dict=False)[0]
        keep = (t / 1000 - 1e-6 < (1.0 - conditioning)).unsqueeze(-1)
        x = torch.where(keep, denoised, x)
    return x, outs


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("conditioned", [False, True], ids=["uniform", "image"])
def test_per_token_timesteps_ode_rollout_is_diffusers_bits_and_sde_recomputes(dtype, conditioned):
    x = torch.randn(2, 10, 6, generator=torch.Generator().manual_seed(0))
    conditioning = torch.zeros(2, 10)
    if conditioned:
        conditioning[:, :3] = 1.0  # tokens 0..2 hold the image: per-token timestep 0
    expected, _ = ltx_condition_loop(diffusers.FlowMatchEulerDiscreteScheduler(shift=2.0), x, conditioning, dtype=dtype)
    sched = Sched(shift=2.0)
    with rollout(sched, mode="ode"):
        got, _ = ltx_condition_loop(sched, x, conditioning, dtype=dtype)
    assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(got[:, :3], x[:, :3]) == conditioned  # conditioning tokens unchanged

    with rollout(sched, mode="sde", generator=torch.Generator().manual_seed(4)) as rec:
        got, outs = ltx_condition_loop(sched, x, conditioning, dtype=dtype)
    traj = rec.trajectory()
    assert traj.token_sigmas.shape == (2, 4, 10, 1) and torch.equal(traj.latents[:, -1], got)
    if conditioned:
        assert torch.equal(got[:, :3], x[:, :3])  # held: no noise either
    for j, noise_pred in enumerate(outs):
        inputs = traj.step_inputs(j)
        assert torch.equal(flowrl.step_log_prob(model_output=noise_pred, **inputs), traj.log_probs[:, j])
        if conditioned:  # the velocity on held tokens does not enter the log-prob
            changed = noise_pred.clone()
            changed[:, :3] = 5.0
            assert torch.equal(flowrl.step_log_prob(model_output=changed, **inputs), traj.log_probs[:, j])


def test_per_token_timesteps_given_on_some_steps_only_raise():
    sched = Sched()
    sched.set_timesteps(3)
    x = torch.randn(2, 4, 3)
    with rollout(sched):
        sched.step(x, sched.timesteps[0], x, per_token_timesteps=torch.full((2, 1), float(sched.timesteps[0])))
        with pytest.raises(ValueError, match="every step or on none"):
            sched.step(x, sched.timesteps[1], x)


def test_frozen_mask_holds_elements_and_keeps_them_out_of_the_log_prob():
    x = torch.randn(2, 4, 3, 2, 2, generator=torch.Generator().manual_seed(0))  # [B, C, F, H, W]
    frozen = torch.zeros(1, 1, 3, 1, 1, dtype=torch.bool)
    frozen[:, :, 0] = True
    sched = Sched(shift=3.0)
    traj, out, outputs = record(sched, x, frozen=frozen, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out[:, :, 0], x[:, :, 0]) and not torch.equal(out[:, :, 1], x[:, :, 1])
    assert traj.frozen.shape == (2, 1, 3, 1, 1) and traj.frozen.dtype == torch.bool
    for j, v in enumerate(outputs):
        changed = v.clone()
        changed[:, :, 0] += 3.0
        inputs = traj.step_inputs(j)
        assert torch.equal(flowrl.step_log_prob(model_output=changed, **inputs), traj.log_probs[:, j])
    with pytest.raises(TypeError, match="frozen must be a bool tensor"):
        rollout(sched, frozen=frozen.float())
    sched.set_timesteps(2)
    with rollout(sched, frozen=torch.zeros(1, 1, 5, 1, 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match="frozen"):
            sched.step(x, sched.timesteps[0], x)


def test_pipeline_overwriting_scored_elements_warns_but_not_held_ones():
    x = torch.randn(2, 4, 3)
    sched = Sched()
    frozen = torch.zeros(1, 4, 1, dtype=torch.bool)
    frozen[:, 0] = True
    sched.set_timesteps(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overwriting a frozen element is the pipeline's right
        with rollout(sched, frozen=frozen):
            y = x
            for t in sched.timesteps:
                y = sched.step(toy_velocity(y, t), t, y, return_dict=False)[0].clone()
                y[:, 0] = 7.0
    sched.set_timesteps(3)
    with rollout(sched):
        with pytest.warns(UserWarning, match="pass their mask as rollout\\(frozen=...\\)"):
            y = x
            for t in sched.timesteps:
                y = sched.step(toy_velocity(y, t), t, y, return_dict=False)[0].clone()
                y[:, 0] = 7.0
