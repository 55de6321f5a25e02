"""Debug tensors (opt-in, as SGLang's rollout_debug_mode): per step the transition mean, std, noise and
model output, in memory or in a safetensors file, for comparing two implementations step by step."""
import pytest
import torch

import flowrl
from flowrl.data.debug import DebugTensors

B, T, SHAPE = 2, 4, (4, 6)


def rollout(debug, noise_level=0.7, sde_steps=None, dtype=torch.float32):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, *SHAPE, generator=g).to(dtype)
    w = torch.randn(SHAPE[-1], SHAPE[-1], generator=g).to(dtype)
    with sched.rollout(generator=[torch.Generator().manual_seed(i) for i in range(B)], debug=debug,
                       noise_level=noise_level, sde_steps=sde_steps) as rec:
        for t in sched.timesteps:
            x = sched.step(x @ w * (t / 1000), t, x).prev_sample
    return rec.trajectory()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_debug_mode_does_not_change_the_rollout_and_its_tensors_are_consistent(dtype, tmp_path):
    plain = rollout(None, dtype=dtype)
    path = tmp_path / "debug.safetensors"
    traj = rollout(str(path), sde_steps=None, dtype=dtype)
    assert plain.debug_tensors is None
    assert torch.equal(traj.latents, plain.latents) and torch.equal(traj.log_probs, plain.log_probs)
    d = traj.debug_tensors
    assert d.rollout_prev_sample_means.shape == (B, T, *SHAPE) and d.rollout_noise_std_devs.shape == (B, T)
    for j in range(T):
        # the emitted sample is mean + std * noise (rounded to the latents' dtype)
        expected = (d.rollout_prev_sample_means[:, j] + d.rollout_noise_std_devs[:, j].view(B, 1, 1)
                    * d.rollout_variance_noises[:, j]).to(dtype)
        assert torch.allclose(expected.float(), traj.latents[:, j + 1].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                              atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        v = d.rollout_model_outputs[:, j]
        assert v.dtype == dtype
        assert torch.equal(traj.step_log_prob(j, v), traj.log_probs[:, j])
    loaded = DebugTensors.load(path)
    assert all(torch.equal(loaded.as_dict()[k], v) for k, v in d.as_dict().items())
    assert all(v == 0 for row in loaded.compare(d) for v in row.values())


def test_compare_finds_the_first_diverging_step_and_ode_steps_draw_no_noise():
    a = rollout(True, sde_steps=[0, 2])
    assert torch.equal(a.debug_tensors.rollout_variance_noises[:, 1], torch.zeros(B, *SHAPE))
    assert torch.equal(a.debug_tensors.rollout_noise_std_devs[:, 1], torch.zeros(B))
    b = rollout(True, sde_steps=[0, 2], noise_level=0.6)
    rows = a.debug_tensors.compare(b.debug_tensors)
    assert rows[0]["rollout_noise_std_devs"] > 0 and rows[0]["rollout_model_outputs"] == 0
    assert rows[1]["rollout_model_outputs"] > 0  # the next step sees a different input
    with pytest.raises(TypeError, match="debug must be"):
        rollout(5)


def test_debug_file_is_checked(tmp_path):
    from flowrl.data.serialization import save_safetensors

    path = tmp_path / "other.safetensors"
    save_safetensors(path, {"x": torch.zeros(2)}, {"format": "something"})
    with pytest.raises(ValueError, match="not a flowrl debug-tensor file"):
        DebugTensors.load(path)
