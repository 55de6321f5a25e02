"""flowrl.FlowMatchEulerDiscreteScheduler: parity with diffusers, timestep lookup, rollout recording."""
import copy
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import flowrl
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler as Sched

BF16 = torch.bfloat16


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN included: a 1-step schedule with shift_terminal is NaN in diffusers too)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def toy_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for a model: depends on the latent and the timestep, per sample."""
    return (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)


def run_loop(sched, x, steps=None, generator=None):
    """Denoise like a pipeline (``step(...)[0]`` with each scheduler timestep); returns the output and
    the model outputs it fed."""
    outputs = []
    for t in sched.timesteps:
        v = toy_velocity(x, t)
        outputs.append(v)
        x = sched.step(v, t, x, generator=generator, return_dict=False)[0]
    return x, outputs


# ----------------------------------------------------------------------------- parity with diffusers
CONFIGS = [
    {},
    {"shift": 3.0},
    {"use_dynamic_shifting": True},
    {"use_dynamic_shifting": True, "time_shift_type": "linear"},
    {"shift": 3.0, "shift_terminal": 0.1},
    {"shift": 3.0, "use_karras_sigmas": True},
    {"use_exponential_sigmas": True},
    {"use_beta_sigmas": True},
    {"invert_sigmas": True},
]
SET_TIMESTEPS = [
    {"num_inference_steps": 10},
    {"num_inference_steps": 1},
    {"sigmas": np.linspace(1.0, 1 / 7, 7)},  # what SD3/Flux pipelines pass
    {"sigmas": [1.0, 0.5, 0.25]},
    {"timesteps": [900.0, 500.0, 100.0]},
    {"num_inference_steps": 3, "sigmas": [1.0, 0.6, 0.3], "timesteps": [999.0, 600.0, 300.0]},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_schedules_match_diffusers(config):
    diffusers = pytest.importorskip("diffusers")
    if config.get("use_beta_sigmas"):
        pytest.importorskip("scipy")
    ref = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    ours = Sched.from_config(ref.config)
    assert same_bits(ours.timesteps, ref.timesteps) and same_bits(ours.sigmas, ref.sigmas)
    assert (ours.sigma_min, ours.sigma_max, len(ours), ours.order) == (ref.sigma_min, ref.sigma_max, len(ref), ref.order)
    for kwargs in SET_TIMESTEPS:
        if config.get("use_dynamic_shifting"):
            kwargs = dict(kwargs, mu=0.9)
        ref.set_timesteps(**kwargs)
        ours.set_timesteps(**kwargs)
        assert same_bits(ours.sigmas, ref.sigmas), kwargs
        assert same_bits(ours.timesteps, ref.timesteps), kwargs
        assert ours.num_inference_steps == ref.num_inference_steps


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("config", [{"shift": 3.0}, {"use_dynamic_shifting": True}, {"stochastic_sampling": True}])
def test_step_matches_diffusers_bit_for_bit(config, dtype):
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    ours = Sched.from_config(ref.config)
    kwargs = {"num_inference_steps": 6, "mu": 0.7} if config.get("use_dynamic_shifting") else {"num_inference_steps": 6}
    ref.set_timesteps(**kwargs)
    ours.set_timesteps(**kwargs)
    x_ref = x_ours = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    for t in ref.timesteps:
        v = toy_velocity(x_ref, t)
        x_ref = ref.step(v, t, x_ref, generator=torch.Generator().manual_seed(int(t))).prev_sample
        x_ours = ours.step(v, t, x_ours, generator=torch.Generator().manual_seed(int(t))).prev_sample
        assert x_ours.dtype == x_ref.dtype == dtype
        assert torch.equal(x_ours, x_ref)
    assert ours.step_index == ref.step_index == 6


def test_per_token_timesteps_and_begin_index_match_diffusers():
    diffusers = pytest.importorskip("diffusers")
    ref, ours = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), Sched(shift=3.0)
    for s in (ref, ours):
        s.set_timesteps(8)
        s.set_begin_index(2)  # img2img: the loop starts at schedule index 2
    x = torch.randn(2, 16, 4, dtype=BF16)
    v = toy_velocity(x, ref.timesteps[2])
    per_token = ref.timesteps[2:4].repeat_interleave(8).reshape(1, 16).expand(2, 16).clone()
    a = ref.step(v, ref.timesteps[2], x, per_token_timesteps=per_token, return_dict=False)[0]
    b = ours.step(v, ours.timesteps[2], x, per_token_timesteps=per_token, return_dict=False)[0]
    assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert ours.step_index == ref.step_index == 3
    noise = torch.randn_like(x)
    for s in (ref, ours):
        s.set_timesteps(8)
    ts = ref.timesteps[[1, 5]]
    assert torch.equal(ours.scale_noise(x, ts, noise), ref.scale_noise(x, ts, noise))


def test_config_reads_like_diffusers_and_round_trips(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=128)
    with pytest.warns(UserWarning, match="use_flow_sigmas"):  # a key of another scheduler: ignored, as diffusers
        ours = Sched.from_config({**ref.config, "use_flow_sigmas": True}, max_shift=1.2)
    assert ours.config.base_image_seq_len == 128 and ours.config.get("shift") == 3.0 and ours.config["max_shift"] == 1.2
    assert ours.config.get("missing", "default") == "default"
    with pytest.raises(AttributeError, match="missing"):
        ours.config.missing
    with pytest.raises(TypeError, match="frozen"):
        ours.config.shift = 2.0
    with pytest.raises(TypeError, match="frozen"):
        ours.config["shift"] = 2.0
    back = diffusers.FlowMatchEulerDiscreteScheduler.from_config(ours.config)
    assert {k: back.config[k] for k in ours.config if not k.startswith("_")} == {
        k: v for k, v in ours.config.items() if not k.startswith("_")
    }
    ours.save_pretrained(tmp_path)
    assert dict(Sched.from_pretrained(tmp_path).config) == dict(ours.config)
    assert diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path).config.max_shift == 1.2
    assert dict(pickle.loads(pickle.dumps(ours)).config) == dict(ours.config)
    assert copy.deepcopy(ours).config == ours.config


def test_works_without_diffusers_config():
    sched = Sched.from_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0", "shift": 3.0})
    sched.set_timesteps(4)
    assert sched.sigmas.tolist()[-1] == 0 and sched.shift == 3.0
    sched.set_shift(2.0)
    assert sched.shift == 2.0


def test_from_pretrained_subfolder_and_save_config(tmp_path):
    ours = Sched(shift=3.0, use_dynamic_shifting=True, max_shift=1.2)
    ours.save_pretrained(tmp_path / "scheduler")  # the layout of a saved pipeline
    loaded = Sched.from_pretrained(tmp_path, subfolder="scheduler")
    assert type(loaded) is Sched and dict(loaded.config) == dict(ours.config)
    assert Sched.from_pretrained(tmp_path, subfolder="scheduler", shift=2.0).config.shift == 2.0
    file = tmp_path / "scheduler" / "scheduler_config.json"
    assert json.loads(file.read_text()) == dict(ours.config)
    ours.save_config(tmp_path / "again")  # diffusers' ConfigMixin name: the same file
    assert (tmp_path / "again" / "scheduler_config.json").read_text() == file.read_text()
    with pytest.raises(ValueError, match="pretrained_model_name_or_path"):
        Sched.from_pretrained(tmp_path)  # no subfolder: no config at the top
    with pytest.raises(ValueError, match="push_to_hub"):
        ours.save_pretrained(tmp_path / "hub", push_to_hub=True)
    diffusers = pytest.importorskip("diffusers")
    theirs = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert {k: theirs.config[k] for k in ours.config} == dict(ours.config)


def test_is_diffusers_scheduler_when_diffusers_is_installed():
    diffusers = pytest.importorskip("diffusers")
    ours = Sched(shift=3.0)
    # diffusers saves pipeline components that subclass its scheduler classes; pipelines check isinstance
    assert isinstance(ours, diffusers.FlowMatchEulerDiscreteScheduler) and isinstance(ours, diffusers.SchedulerMixin)
    # the instance reports diffusers' module (what a pipeline records); the class and pickles stay flowrl's
    assert ours.__module__ == diffusers.FlowMatchEulerDiscreteScheduler.__module__
    assert Sched.__module__ == "flowrl.rollout.scheduler" and type(pickle.loads(pickle.dumps(ours))) is Sched

    # every method diffusers defines for the scheduler is flowrl's: the base contributes only the type
    # (a method a new diffusers adds would run on flowrl's state untested, so this fails then)
    inherited = [
        name for name, member in vars(diffusers.FlowMatchEulerDiscreteScheduler).items()
        if callable(member) or isinstance(member, (property, classmethod, staticmethod))
        if name not in vars(Sched)
    ]
    assert inherited == []

    class Subclass(Sched):
        pass

    assert Subclass().__module__ == __name__  # diffusers has no class of that name: keep its own
    with pytest.raises(TypeError, match="frozen"):
        ours.register_to_config(shift=2.0)
    assert ours.config.shift == 3.0


def test_works_without_diffusers_installed(tmp_path):
    # a fresh interpreter where `import diffusers` fails, as when it is not installed
    script = f"""
import sys
sys.modules["diffusers"] = None
import torch, flowrl
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler as Sched, RolloutRecorder
assert Sched.__mro__ == (Sched, object) and flowrl.RolloutRecorder is RolloutRecorder
sched = Sched(shift=3.0)
sched.set_timesteps(3)
x = torch.randn(2, 8)
with sched.rollout(generator=torch.Generator().manual_seed(0)) as rec:
    for t in sched.timesteps:
        v = torch.sin(x)
        out = sched.step(v, t, x)
        assert torch.equal(flowrl.step_log_prob(x, v, out.prev_sample, sched.sigmas, sched.step_index - 1), out.log_prob)
        x = out.prev_sample
assert rec.trajectory().log_probs.shape == (2, 3)
sched.save_pretrained({str(tmp_path)!r})
assert dict(Sched.from_pretrained({str(tmp_path)!r}).config) == dict(sched.config)
assert "diffusers" not in sys.modules or sys.modules["diffusers"] is None
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_reexports_and_lookup_module():
    import flowrl.rollout.recorder
    import flowrl.rollout.scheduler
    from flowrl.rollout import timestep_lookup

    assert flowrl.rollout.scheduler.RolloutRecorder is flowrl.rollout.recorder.RolloutRecorder is flowrl.RolloutRecorder
    assert flowrl.FlowMatchEulerDiscreteScheduler is Sched
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(28)
    # the lookup works on any scheduler's table, diffusers' own included
    got = timestep_lookup.indices_for_timesteps(ref.timesteps.to(BF16), ref.timesteps)
    assert got.tolist() == list(range(28))
    assert timestep_lookup.index_for_timestep(ref.timesteps[3].to(BF16), ref.timesteps) == 3
    with pytest.raises(TypeError, match="schedule_timesteps"):
        timestep_lookup.index_for_timestep(500.0, ref.timesteps.tolist())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"shift": 0.0}, ValueError, "shift"),
        ({"shift": float("nan")}, TypeError, "shift"),
        ({"num_train_timesteps": 0}, ValueError, "num_train_timesteps"),
        ({"time_shift_type": "cubic"}, ValueError, "time_shift_type"),
        ({"use_karras_sigmas": True, "use_beta_sigmas": True}, ValueError, "only one"),
        ({"shift_terminal": 1.5}, ValueError, "shift_terminal"),
        ({"invert_sigmas": "yes"}, TypeError, "invert_sigmas"),
    ],
)
def test_bad_config_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        Sched(**kwargs)


def test_bad_calls_raise():
    with pytest.raises(TypeError, match="config"):
        Sched.from_config(Sched())
    sched = Sched(use_dynamic_shifting=True)
    with pytest.raises(ValueError, match="mu"):
        sched.set_timesteps(4)
    with pytest.raises(ValueError, match="same length"):
        sched.set_timesteps(sigmas=[1.0, 0.5], timesteps=[900.0], mu=0.5)
    sched.set_timesteps(4, mu=0.5)
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="integer index"):
        sched.step(x, 3, x)
    with pytest.raises(ValueError, match="integer index"):
        sched.step(x, torch.tensor(3), x)
    with pytest.raises(TypeError, match="model_output"):
        sched.step(x.long(), sched.timesteps[0], x)
    with pytest.raises(ValueError, match="not in the scheduler's timesteps"):
        sched.step(x, 123.456, x)


# ----------------------------------------------------------------------------- timestep lookup
def test_bf16_timestep_resolves_where_diffusers_fails():
    sched = Sched(shift=3.0)
    sched.set_timesteps(28)
    for i, t in enumerate(sched.timesteps):
        assert sched.index_for_timestep(t.to(BF16)) == i
        assert sched.index_for_timestep(t.half()) == i
        assert sched.index_for_timestep(float(t)) == i
    # a whole bf16 loop: step() resolves its first timestep and runs like the float32 one
    x = torch.randn(2, 8)
    sched.set_timesteps(28)  # resets step_index: the first step() resolves its timestep
    out_bf16 = sched.step(toy_velocity(x, sched.timesteps[3]), sched.timesteps[3].to(BF16), x).prev_sample
    assert sched.step_index == 4
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(28)
    with pytest.raises(IndexError):  # diffusers' exact match finds no entry for a bf16-rounded timestep
        ref.index_for_timestep(ref.timesteps[3].to(BF16))
    ref._step_index = 3
    assert torch.equal(out_bf16, ref.step(toy_velocity(x, ref.timesteps[3]), ref.timesteps[3], x).prev_sample)


def test_ambiguous_bf16_timestep_raises():
    sched = Sched(shift=3.0)
    sched.set_timesteps(200)  # near t = 1000 the entries are closer than bf16's spacing of 4
    ambiguous = sched.timesteps[3].to(BF16)
    with pytest.raises(ValueError, match="ambiguous"):
        sched.index_for_timestep(ambiguous)
    assert sched.index_for_timestep(sched.timesteps[3]) == 3  # float32 is exact
    assert sched.index_for_timestep(sched.timesteps[150].to(BF16)) == 150  # unique where entries are far apart
    idx = sched.indices_for_timesteps(torch.stack([ambiguous, sched.timesteps[150].to(BF16)]))
    assert idx.tolist() == [-1, 150]
    with pytest.raises(ValueError, match=r"timesteps\[0\].*ambiguous"):
        sched.indices_for_timesteps(torch.stack([ambiguous, ambiguous]), strict=True)


def test_indices_for_timesteps_vectorized():
    sched = Sched(shift=3.0)
    sched.set_timesteps(20)
    picks = torch.tensor([0, 19, 7, 7, 12])
    for dtype in (torch.float32, BF16, torch.float16, torch.float64):
        got = sched.indices_for_timesteps(sched.timesteps[picks].to(dtype))
        assert got.dtype == torch.int64 and got.tolist() == picks.tolist()
    got = sched.indices_for_timesteps(torch.tensor([sched.timesteps[4].item(), 3.5, 2000.0]))
    assert got.tolist() == [4, -1, -1]
    with pytest.raises(ValueError, match=r"timesteps\[1\].*not in"):
        sched.indices_for_timesteps(torch.tensor([sched.timesteps[4].item(), 3.5]), strict=True)
    with pytest.raises(ValueError, match="1-D"):
        sched.indices_for_timesteps(sched.timesteps[:4].reshape(2, 2))
    with pytest.raises(TypeError, match="timesteps"):
        sched.indices_for_timesteps([1.0, 2.0])


def test_repeated_timestep_follows_diffusers_rule():
    diffusers = pytest.importorskip("diffusers")
    kwargs = {"sigmas": [1.0, 0.5, 0.5, 0.2], "timesteps": [1000.0, 500.0, 500.0, 200.0]}
    ref, ours = diffusers.FlowMatchEulerDiscreteScheduler(), Sched()
    ref.set_timesteps(**kwargs)
    ours.set_timesteps(**kwargs)
    assert ours.index_for_timestep(ours.timesteps[1]) == ref.index_for_timestep(ref.timesteps[1]) == 2
    assert ours.indices_for_timesteps(ours.timesteps).tolist() == [0, 2, 2, 3]


# ----------------------------------------------------------------------------- rollout
def rollout(sched, x, steps=6, **kwargs):
    sched.set_timesteps(steps)
    with sched.rollout(**kwargs) as rec:
        out, outputs = run_loop(sched, x)
    return rec.trajectory(), out, outputs


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("mode, eta", [("sde", 0.7), ("dance", 0.5), ("cps", 0.6)])
def test_rollout_records_and_recompute_is_bit_exact(mode, eta, dtype):
    sched = Sched(shift=3.0)
    x0 = torch.randn(3, 4, 6, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    traj, out, outputs = rollout(sched, x0, mode=mode, noise_level=eta, generator=torch.Generator().manual_seed(2))
    assert isinstance(traj, flowrl.RolloutTrajectory)
    assert traj.latents.shape == (3, 7, 4, 6, 6) and traj.latents.dtype == dtype
    assert traj.log_probs.shape == (3, 6) and traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all()
    stochastic = slice(0, 5) if mode == "cps" else slice(0, 6)  # cps's last step (sigma' = 0) is deterministic
    assert (traj.log_probs[:, stochastic] != 0).all() and (traj.log_probs[:, stochastic.stop:] == 0).all()
    assert torch.equal(traj.latents[:, 0], x0) and torch.equal(traj.latents[:, -1], out)
    assert torch.equal(traj.sigmas, sched.sigmas) and torch.equal(traj.timesteps, sched.timesteps)
    assert traj.latent_step_indices.tolist() == list(range(7))
    assert (traj.mode, traj.noise_level, traj.log_prob_kind, traj.reduction, traj.sde_steps) == (mode, eta, "gaussian", "mean", None)
    for i, v in enumerate(outputs):
        lp = flowrl.step_log_prob(
            traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i,
            mode=traj.mode, noise_level=traj.noise_level, log_prob_kind=traj.log_prob_kind, reduction=traj.reduction,
        )
        assert torch.equal(lp, traj.log_probs[:, i]), i


def test_rollout_step_output_fields_and_dtype():
    sched = Sched()
    sched.set_timesteps(3)
    x = torch.randn(2, 8, dtype=BF16)
    with sched.rollout(log_prob_kind="kernel", reduction="sum"):
        out = sched.step(toy_velocity(x, sched.timesteps[0]), sched.timesteps[0], x)
        as_tuple = sched.step(toy_velocity(out.prev_sample, sched.timesteps[1]), sched.timesteps[1], out.prev_sample, return_dict=False)
    assert out.prev_sample.dtype == BF16 and out[0] is out.prev_sample and out["log_prob"] is out.log_prob
    assert out.log_prob.shape == (2,) and out.std_dev.shape == (2,) and out.prev_sample_mean.shape == (2, 8)
    assert out.prev_sample_mean.dtype == torch.float32 and (out.std_dev > 0).all()
    assert len(as_tuple) == 1  # pipelines index [0]; the tuple form stays diffusers'
    # outside the rollout the scheduler is plain diffusers again
    plain = sched.step(toy_velocity(x, sched.timesteps[2]), sched.timesteps[2], x)
    assert plain.log_prob is None and plain.to_tuple() == (plain.prev_sample,)


def test_sde_steps_and_return_step_indices_filters():
    sched = Sched(shift=3.0)
    x0 = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    traj, out, outputs = rollout(sched, x0, steps=6, sde_steps=[1, 2], return_step_indices=torch.tensor([6, 0, 2, 3]))
    assert traj.latent_step_indices.tolist() == [0, 2, 3, 6] and traj.latents.shape[1] == 4
    assert torch.equal(traj.latents[:, 0], x0) and torch.equal(traj.latents[:, -1], out)
    assert traj.sde_steps.tolist() == [1, 2]
    assert (traj.log_probs[:, [0, 3, 4, 5]] == 0).all() and (traj.log_probs[:, [1, 2]] != 0).all()
    assert traj.sigmas.numel() == 7 and traj.timesteps.numel() == 6  # schedule metadata is never filtered
    # step 2 -> 3 is stochastic and both latents were kept: recompute it
    lp = flowrl.step_log_prob(traj.latents[:, 1], outputs[2], traj.latents[:, 2], traj.sigmas, 2, mode="sde", noise_level=0.7)
    assert torch.equal(lp, traj.log_probs[:, 2])
    # an ode step is plain Euler in float32: x - D v
    sched.set_timesteps(6)
    with sched.rollout(sde_steps=[]) as rec:
        run_loop(sched, x0)
    sigmas = sched.sigmas
    first = rec.trajectory().latents[:, 1]
    assert torch.equal(first, x0 - (sigmas[0] - sigmas[1]) * outputs[0])


def test_sigmas_snapshot_is_a_copy():
    sched = Sched(shift=3.0)
    traj, _, _ = rollout(sched, torch.randn(1, 16), steps=5)
    before = traj.sigmas.clone()
    sched.sigmas.mul_(0.5)
    sched.set_timesteps(9)
    assert torch.equal(traj.sigmas, before) and traj.sigmas.numel() == 6 and traj.timesteps.numel() == 5


def test_per_sample_generators_are_batch_invariant():
    x = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(4))
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    full, _, _ = rollout(Sched(shift=3.0), x, generator=gens([10, 11, 12]))
    alone, _, _ = rollout(Sched(shift=3.0), x[1:2], generator=gens([11]))
    again, _, _ = rollout(Sched(shift=3.0), x, generator=gens([10, 11, 12]))
    assert torch.equal(full.latents[1:2], alone.latents) and torch.equal(full.log_probs[1:2], alone.log_probs)
    assert torch.equal(full.latents, again.latents)
    assert not torch.equal(full.latents[:, -1, 0], full.latents[:, -1, 2])


def test_img2img_rollout_starts_at_begin_index():
    sched = Sched(shift=3.0)
    sched.set_timesteps(8)
    sched.set_begin_index(3)
    x = torch.randn(2, 32)
    timesteps = sched.timesteps[3:]
    outputs = []
    with sched.rollout(generator=torch.Generator().manual_seed(0)) as rec:
        for t in timesteps:
            outputs.append(toy_velocity(x, t))
            x = sched.step(outputs[-1], t, x)[0]
    traj = rec.trajectory()
    assert traj.log_probs.shape == (2, 5) and torch.equal(traj.sigmas, sched.sigmas[3:])
    assert torch.equal(traj.timesteps, timesteps) and torch.equal(traj.latents[:, -1], x)
    for i, v in enumerate(outputs):
        lp = flowrl.step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i)
        assert torch.equal(lp, traj.log_probs[:, i])


def test_rollout_bad_arguments_raise():
    sched = Sched()
    with pytest.raises(ValueError, match="mode"):
        sched.rollout(mode="ddim")
    with pytest.raises(ValueError, match="noise_level"):
        sched.rollout(mode="cps", noise_level=1.5)
    with pytest.raises(TypeError, match="noise_level"):
        sched.rollout(noise_level="high")
    with pytest.raises(ValueError, match="log_prob"):
        sched.rollout(log_prob_kind="exact")
    with pytest.raises(ValueError, match="reduction"):
        sched.rollout(reduction="max")
    with pytest.raises(TypeError, match="sde_steps"):
        sched.rollout(sde_steps=[0.5])
    with pytest.raises(ValueError, match="return_step_indices"):
        sched.rollout(return_step_indices=[-1])
    with pytest.raises(TypeError, match="generator"):
        sched.rollout(generator=0)
    x = torch.randn(2, 8)
    sched.set_timesteps(4)
    for kwargs, match in [
        ({"sde_steps": [4]}, "sde_steps"),
        ({"return_step_indices": [5]}, "return_step_indices"),
        ({"generator": [torch.Generator()]}, "list of B = 2"),
    ]:
        sched.set_timesteps(4)
        with pytest.raises(ValueError, match=match), sched.rollout(**kwargs):
            sched.step(x, sched.timesteps[0], x)
    sched.set_timesteps(4)
    rec = sched.rollout()
    with rec:
        with pytest.raises(RuntimeError, match="nest"), sched.rollout():
            pass
        with pytest.raises(ValueError, match="per_token_timesteps"):
            sched.step(x, sched.timesteps[0], x, per_token_timesteps=torch.full((2, 8), 1000.0))
        sched.step(x, sched.timesteps[0], x)
        with pytest.raises(RuntimeError, match="one denoising loop"):
            sched.set_timesteps(4)
    with pytest.raises(RuntimeError, match="1 of 4 steps"):
        rec.trajectory()
    inverted = Sched(invert_sigmas=True)
    inverted.set_timesteps(4)
    with pytest.raises(ValueError, match="invert_sigmas"), inverted.rollout():
        inverted.step(x, inverted.timesteps[0], x)


def test_changed_latents_between_steps_warn():
    sched = Sched()
    sched.set_timesteps(3)
    x = torch.randn(1, 8)
    with sched.rollout():
        x = sched.step(x, sched.timesteps[0], x)[0]
        with pytest.warns(UserWarning, match="changed the latents"):
            sched.step(x, sched.timesteps[1], x + 1)


def _triton_runs_here() -> bool:
    from flowrl.backends._dispatch import interpreter_enabled, triton_available

    return triton_available() and (torch.cuda.is_available() or interpreter_enabled())


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton with CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rollout_through_triton_kernels_recomputes_bit_exact(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sched = Sched(shift=3.0)
    sched.set_timesteps(3, device=device)
    x = torch.randn(2, 4, 8, 8, device=device).to(dtype)
    gens = [torch.Generator(device).manual_seed(s) for s in (1, 2)]
    with sched.rollout(backend="triton", generator=gens) as rec:
        out, outputs = run_loop(sched, x)
    traj = rec.trajectory()
    assert traj.sigmas.device == out.device and torch.equal(traj.latents[:, -1], out)
    for i, v in enumerate(outputs):
        lp = flowrl.step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i, backend="triton")
        assert torch.equal(lp, traj.log_probs[:, i]), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_cuda_parity_and_default_backend_rollout(dtype):
    diffusers = pytest.importorskip("diffusers")
    ref, ours = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), Sched(shift=3.0)
    ref.set_timesteps(5, device="cuda")
    ours.set_timesteps(5, device="cuda")
    x0 = torch.randn(2, 16, 32, device="cuda").to(dtype)
    a, _ = run_loop(ref, x0)
    b, _ = run_loop(ours, x0)
    assert torch.equal(a, b)
    ours.set_timesteps(5, device="cuda")
    with ours.rollout(generator=torch.Generator("cuda").manual_seed(0)) as rec:  # backend "auto": the kernels
        out, outputs = run_loop(ours, x0)
    traj = rec.trajectory()
    assert torch.equal(traj.latents[:, -1], out) and traj.log_probs.is_cuda
    for i, v in enumerate(outputs):
        lp = flowrl.step_log_prob(traj.latents[:, i], v, traj.latents[:, i + 1], traj.sigmas, i)
        assert torch.equal(lp, traj.log_probs[:, i]), i
    assert ours.indices_for_timesteps(ours.timesteps.to(BF16)).tolist() == list(range(5))


@pytest.mark.parametrize("family", ["wan-unipc", "sana-dpm"])
def test_flow_shift_of_wan_and_sana_configs_becomes_shift(family, caplog):
    """Wan's shipped scheduler is UniPCMultistepScheduler(flow_shift=3.0 for 480p, 5.0 for 720p,
    use_flow_sigmas=True, prediction_type="flow_prediction"); Sana's is DPMSolverMultistepScheduler with the
    same keys. Their shift is ``flow_shift`` (diffusers' scheduling_unipc_multistep.py: ``sigmas =
    flow_shift * sigmas / (1 + (flow_shift - 1) * sigmas)``), which a plain from_config would drop."""
    import logging

    diffusers = pytest.importorskip("diffusers")
    make = {"wan-unipc": diffusers.UniPCMultistepScheduler, "sana-dpm": diffusers.DPMSolverMultistepScheduler}[family]
    shipped = make(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0).config
    assert "shift" not in shipped and shipped["flow_shift"] == 5.0
    with caplog.at_level(logging.INFO, logger="flowrl.rollout.scheduler"):
        ours = Sched.from_config(shipped)
    assert ours.config.shift == 5.0
    assert [r.levelno for r in caplog.records if "flow_shift" in r.getMessage()] == [logging.INFO]
    ours.set_timesteps(6)
    ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
    ref.set_timesteps(6)
    assert torch.equal(ours.sigmas, ref.sigmas)
    assert Sched.from_config(shipped, shift=2.0).config.shift == 2.0  # an explicit shift wins
