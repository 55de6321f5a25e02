"""RolloutTrajectory construction: the default ``latent_step_indices`` for an unfiltered rollout.

Wire/file round trips and the strict decoders are tested in test_serialization.py.
"""
import base64
import json

import pytest
import torch
from safetensors.torch import save as st_save

from flowrl.data.serialization import from_wire
from flowrl.data.trajectory import RolloutTrajectory

STEPS = 4


def _parts(batch=2, kept=STEPS + 1, latent_shape=(3, 4), seed=0):
    """The four tensors an SGLang rollout response carries: latents [B, K, ...], log-probs [B, T],
    timesteps [T], sigmas [T + 1]."""
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1, dtype=torch.float32)
    return dict(
        latents=torch.randn((batch, kept, *latent_shape), generator=g).to(torch.bfloat16),
        log_probs=torch.randn((batch, STEPS), generator=g),
        timesteps=sigmas[:-1] * 1000,
        sigmas=sigmas,
    )


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(a: RolloutTrajectory, b: RolloutTrajectory):
    for name in ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and _bits(x) == _bits(y), name
    assert (a.sde_steps is None) == (b.sde_steps is None)
    assert (a.mode, a.noise_level, a.log_prob_kind, a.reduction) == (b.mode, b.noise_level, b.log_prob_kind, b.reduction)


@pytest.mark.parametrize("latent_shape", [(), (3, 4), (2, 3, 4, 4)], ids=str)
def test_default_latent_step_indices_is_arange_when_k_is_t_plus_1(latent_shape):
    parts = _parts(latent_shape=latent_shape)
    traj = RolloutTrajectory(**parts)
    assert traj.latent_step_indices.dtype == torch.int64
    assert traj.latent_step_indices.tolist() == list(range(STEPS + 1))
    explicit = RolloutTrajectory(**parts, latent_step_indices=torch.arange(STEPS + 1))
    _assert_same(traj, explicit)


def test_default_equals_explicit_through_wire_and_file(tmp_path):
    parts = _parts()
    default = RolloutTrajectory(**parts, mode="cps", noise_level=0.5, sde_steps=torch.tensor([0, 2]))
    explicit = RolloutTrajectory(**parts, latent_step_indices=torch.arange(STEPS + 1), mode="cps", noise_level=0.5,
                                 sde_steps=torch.tensor([0, 2]))
    wire = json.loads(json.dumps(default.to_wire()))
    assert wire == json.loads(json.dumps(explicit.to_wire()))  # the same payload, byte for byte
    back = RolloutTrajectory.from_wire(wire)
    _assert_same(back, explicit)
    _assert_same(back, default)
    default.save(tmp_path / "default.safetensors")
    _assert_same(RolloutTrajectory.load(tmp_path / "default.safetensors"), explicit)
    for part, whole in zip(default.split(), explicit.split()):
        _assert_same(part, whole)


def test_built_from_an_sglang_response():
    # what a trainer does with a /rollout/generate response: no indices are sent for a full rollout
    parts = _parts()

    def envelope(t):
        raw = st_save({"t": t.contiguous()})
        return {"__tensor__": True, "data": base64.b64encode(raw).decode(), "shape": list(t.shape), "dtype": str(t.dtype)}

    response = from_wire(json.loads(json.dumps({
        "trajectory_latents": envelope(parts["latents"]), "rollout_log_probs": envelope(parts["log_probs"]),
        "timesteps": envelope(parts["timesteps"]), "sigmas": envelope(parts["sigmas"]),
    })))
    traj = RolloutTrajectory(latents=response["trajectory_latents"], log_probs=response["rollout_log_probs"],
                             timesteps=response["timesteps"], sigmas=response["sigmas"])
    assert traj.latent_step_indices.tolist() == list(range(STEPS + 1))
    _assert_same(RolloutTrajectory.from_wire(traj.to_wire()), traj)


@pytest.mark.parametrize("kept", [3, STEPS, STEPS + 2])
def test_filtered_latents_require_latent_step_indices(kept):
    parts = _parts(kept=kept)
    with pytest.raises(ValueError, match=rf"latent_step_indices is required .* K = {kept} .* T = {STEPS} "):
        RolloutTrajectory(**parts)


def test_filtered_latents_with_explicit_indices_round_trip():
    parts = _parts(kept=3)
    traj = RolloutTrajectory(**parts, latent_step_indices=torch.tensor([0, 2, STEPS]))
    back = RolloutTrajectory.from_wire(json.loads(json.dumps(traj.to_wire())))
    assert back.latent_step_indices.tolist() == [0, 2, STEPS]
    _assert_same(back, traj)


def test_default_needs_batched_latents_and_a_schedule():
    parts = _parts()
    with pytest.raises(ValueError, match=r"latents must be \[B, K, ...\] .* got shape \(4,\)"):
        RolloutTrajectory(**dict(parts, latents=parts["latents"][0, 0, 0]))
    with pytest.raises(TypeError, match="latents must be a torch.Tensor; got list"):
        RolloutTrajectory(**dict(parts, latents=[[0.0]]))
    with pytest.raises(TypeError, match="sigmas must be a torch.Tensor; got list"):
        RolloutTrajectory(**dict(parts, sigmas=[1.0, 0.0]))
    with pytest.raises(ValueError, match=r"sigmas must be 1-D \[T \+ 1\] .* got shape \(1,\)"):
        RolloutTrajectory(**dict(parts, sigmas=torch.ones(1)))


# ---------------------------------------------------------------------------------------------------
# step_inputs(j): the one recompute entry point


def _recorded(**options):
    """A recorded rollout (toy velocity) and the velocity of every step."""
    diffusers = pytest.importorskip("diffusers")  # flowrl's diffusers extra is optional

    from flowrl.rollout.recorder import rollout

    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(STEPS)
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    velocities = []
    with rollout(sched, generator=torch.Generator().manual_seed(1), **options) as rec:
        for t in sched.timesteps:
            velocities.append(torch.sin(3 * x) + t / 1000)
            x = sched.step(velocities[-1], t, x, return_dict=False)[0]
    return rec.trajectory(), velocities


def test_step_inputs_recompute_filtered_and_ode_steps_and_per_sample_indices():
    import flowrl

    traj, velocities = _recorded(sde_steps=[1, 2], return_step_indices=[0, 1, 2, 3], mode="dance", noise_level=0.5)
    for j in (0, 1, 2):  # step 0 is an ode step: log-prob 0, recomputed as one
        inputs = traj.step_inputs(j)
        assert inputs["mode"] == ("ode" if j == 0 else "dance") and inputs["noise_level"] == 0.5
        assert torch.equal(flowrl.step_log_prob(model_output=velocities[j], **inputs), traj.log_probs[:, j])
    with pytest.raises(ValueError, match=r"did not keep loop step\(s\) \[4\]"):
        traj.step_inputs(3)  # the final output was filtered out
    with pytest.raises(ValueError, match=r"loop step in \[0, 3\]"):
        traj.step_inputs(4)
    # one loop step per sample: step_index per sample, the velocities gathered the same way
    j = torch.tensor([2, 1, 2])
    v = torch.stack([velocities[int(k)][b] for b, k in enumerate(j)])
    lp = flowrl.step_log_prob(model_output=v, **traj.step_inputs(j))
    assert torch.equal(lp, traj.log_probs.gather(1, j[:, None])[:, 0])
    with pytest.raises(ValueError, match="mixes sde steps and ode steps"):
        traj.step_inputs(torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="int or an integer tensor"):
        traj.step_inputs(1.0)


def test_per_sample_split_keeps_masks_and_streams_per_sample():
    frozen = torch.zeros(1, 4, 1, dtype=torch.bool)
    frozen[:, 0] = True
    traj, _ = _recorded(frozen=frozen)
    parts = traj.split()
    assert [p.frozen.shape for p in parts] == [(1, 4, 1)] * 3 and all(torch.equal(p.frozen, frozen) for p in parts)
    assert torch.equal(parts[2].latents, traj.latents[2:3])
