"""flowrl.recorder: recording rollouts with a scheduler instance the user already has (diffusers' own
FlowMatchEulerDiscreteScheduler, a framework's subclass, or flowrl's), and restoring it afterwards."""
import inspect

import pytest
import torch

import flowrl
from flowrl.recorder import RolloutRecorder, rollout
from flowrl.scheduler import FlowMatchEulerDiscreteScheduler as Sched

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
        with pytest.raises(ValueError, match="per_token_timesteps"):
            sched.step(x, sched.timesteps[0], x, per_token_timesteps=torch.full((2, 8), 1000.0))
        with pytest.raises(ValueError, match="integer index"):
            sched.step(x, 3, x)
        with pytest.raises(TypeError, match="model_output"):
            sched.step(x.long(), sched.timesteps[0], x)
        sched.step(x, sched.timesteps[0], x, 0.0, 0.0, float("inf"), 1.0)  # s_churn...s_noise: accepted, unused
        with pytest.raises(RuntimeError, match="one denoising loop"):
            sched.set_timesteps(3)


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
