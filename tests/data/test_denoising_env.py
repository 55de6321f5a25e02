"""The denoising environment: ``rollout(model=pipe.transformer)`` records every call of the module, and
replaying ``pipe.transformer(**traj.model_inputs(j))`` through ``traj.step_model_output(j, ...)`` gives
the recorded log-probs bit for bit at every step, on tiny random-weight diffusers pipelines
(tests/tiny_pipelines.py). The pipelines' output transforms are read from diffusers 0.42's code:
StableDiffusion3Pipeline (batched CFG, uncond half first), FluxPipeline (true CFG over two calls),
FluxKontextPipeline (``noise_pred[:, : latents.size(1)]``), WanPipeline (cond call, then uncond),
LTXImageToVideoPipeline (``.float()``, batched CFG, ``_unpack_latents``, ``[:, :, 1:]``), Lumina2Pipeline
(``noise_pred = -noise_pred``; CFG, rescaled to the cond norm with ``cfg_normalization``)."""
import warnings

import pytest
import torch

import flowrl
import flowrl.rollout.recorder
from flowrl.data.denoising_env import OutputTransform, detect_transform

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
import tiny_pipelines as tp  # noqa: E402

STEPS = 4

# (pipeline class, extra inputs, the transform the recorder must find)
CASES = [
    ("StableDiffusion3Pipeline", {"guidance_scale": 1.0}, dict(cfg=None, sign=1)),
    ("StableDiffusion3Pipeline", {"guidance_scale": 4.5}, dict(cfg="batched", guidance_scale=4.5, uncond_index=0)),
    ("FluxPipeline", {}, dict(cfg=None)),
    ("FluxPipeline", {"true_cfg_scale": 2.0}, dict(cfg="split", guidance_scale=2.0, uncond_index=1)),
    ("FluxKontextPipeline", {}, dict(cfg=None, token_cut=16)),
    ("WanPipeline", {}, dict(cfg="split", guidance_scale=6.0, uncond_index=1)),
    ("LTXImageToVideoPipeline", {}, dict(cfg="batched", guidance_scale=3.0, frames=(3, 1, 1, 1))),
    ("Lumina2Pipeline", {}, dict(cfg=None, sign=-1)),
    ("Lumina2Pipeline", {"guidance_scale": 4.0, "cfg_normalization": False}, dict(cfg="split", sign=-1, guidance_scale=4.0)),
    ("Lumina2Pipeline", {"guidance_scale": 4.0}, dict(cfg="split", sign=-1, guidance_scale=4.0, cfg_renorm=True)),
]


class _Velocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, t, cond=None, **extra):
        return (self.lin(x) * (1 + t.view(-1, 1)) + (0 if cond is None else cond),)


def record(name, dtype, extra, steps=STEPS, **options):
    pipe = getattr(tp, "tiny_" + name)(dtype)
    inputs = getattr(tp, name + "_inputs")(dtype, steps=steps, **extra)
    with flowrl.rollout.recorder.rollout(pipe.scheduler, generator=torch.Generator().manual_seed(1), model=pipe.transformer,
                                 **options) as rec:
        pipe(**inputs, generator=torch.Generator().manual_seed(0))
    return pipe, rec.trajectory()


def replay_log_probs(pipe, traj):
    out = []
    for j in range(traj.num_steps):
        with torch.no_grad():
            raw = [pipe.transformer(**kwargs) for kwargs in traj.model_calls(j)]
        out.append(traj.step_log_prob(j, traj.step_model_output(j, raw)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, extra, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_replay_reproduces_rollout_log_probs_bit_for_bit(name, extra, expected, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no flowrl warning: every transform is known
        warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
        pipe, traj = record(name, dtype, extra)
    # the hooks are gone after the rollout
    assert not pipe.transformer._forward_hooks and not pipe.transformer._forward_pre_hooks
    env = traj.denoising_env
    assert env.num_steps == STEPS
    for j in range(STEPS):
        t = env.transform(j)
        for field, value in expected.items():
            if field == "frames":
                assert t.frames is not None and t.frames[3] == value[3], t
            elif field == "token_cut":
                assert t.token_cut is not None, t
            else:
                assert getattr(t, field) == value, (field, t)
    lps = replay_log_probs(pipe, traj)
    for j, lp in enumerate(lps):
        assert torch.equal(lp, traj.log_probs[:, j]), (name, j)
    # one call per step returns a dict that replays with **
    calls = traj.model_calls(0)
    if len(calls) == 1:
        assert isinstance(traj.model_inputs(0), dict)
        with torch.no_grad():
            v = traj.step_model_output(0, pipe.transformer(**traj.model_inputs(0)))
        assert torch.equal(traj.step_log_prob(0, v), traj.log_probs[:, 0])
    else:
        assert isinstance(traj.model_inputs(0), list) and len(traj.model_inputs(0)) == len(calls)


def test_unchanged_tensors_stored_once_and_memory_of_a_20_step_rollout(capsys):
    """Prompt embeddings (and other conditioning) are stored once for the whole rollout; the per-step
    tensors are the latents fed to the model and the timestep. The number printed here is the one in
    docs/replay.md (SD3 with CFG, bf16, batch 2, 16 x 16 latents 4 channels, 20 steps)."""
    pipe, traj = record("StableDiffusion3Pipeline", torch.bfloat16, {"guidance_scale": 4.5}, steps=20, env_device="cpu")
    env = traj.denoising_env
    first, last = traj.model_inputs(0), traj.model_inputs(19)
    assert first["encoder_hidden_states"] is last["encoder_hidden_states"]
    assert first["pooled_projections"] is last["pooled_projections"]
    assert first["hidden_states"] is not last["hidden_states"]
    assert all(t.device.type == "cpu" for t in first.values() if isinstance(t, torch.Tensor))
    naive = sum(v.numel() * v.element_size() for j in range(20) for v in traj.model_inputs(j).values()
                if isinstance(v, torch.Tensor))
    stored = env.nbytes()
    per_step = first["hidden_states"].numel() * 2 + first["timestep"].numel() * first["timestep"].element_size()
    shared = sum(first[k].numel() * 2 for k in ("encoder_hidden_states", "pooled_projections"))
    assert stored == 20 * per_step + shared, (stored, per_step, shared)
    assert stored < naive
    with capsys.disabled():
        print(f"\n[denoising env] SD3 CFG bf16 B=2 20 steps: {stored} bytes stored ({naive} without sharing)")


def _tanh_loop(sched, model, x, cond):
    sched.set_timesteps(3)
    for t in sched.timesteps:
        out = model(x, t.expand(x.shape[0]) / 1000, cond=cond)[0]
        x = sched.step(torch.tanh(out), t, x).prev_sample  # a transform outside the recorder's list


def test_unknown_transform_warns_once_and_step_model_output_refuses():
    """A pipeline whose transform is none of the known ones: the rollout warns once, the replay refuses,
    and the user's output_transform makes it exact."""
    torch.manual_seed(0)
    model, cond, x = _Velocity(), torch.randn(2, 4), torch.randn(2, 4)
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    with pytest.warns(UserWarning, match="could not tell how the pipeline") as caught:
        with sched.rollout(model=model, generator=torch.Generator().manual_seed(0)) as rec:
            _tanh_loop(sched, model, x, cond)
    assert sum("could not tell" in str(w.message) for w in caught) == 1
    traj = rec.trajectory()
    with pytest.raises(ValueError, match="output_transform"):
        traj.step_model_output(0, model(**traj.model_inputs(0)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with sched.rollout(model=model, generator=torch.Generator().manual_seed(0),
                           output_transform=lambda outputs: torch.tanh(outputs[0])) as rec:
            _tanh_loop(sched, model, x, cond)
    traj = rec.trajectory()
    for j in range(3):
        with torch.no_grad():
            v = traj.step_model_output(j, model(**traj.model_inputs(j)))
        assert torch.equal(traj.step_log_prob(j, v), traj.log_probs[:, j])
    # a user transform that does not reproduce the output is reported the same way
    with pytest.warns(UserWarning, match="did not reproduce"):
        with sched.rollout(model=model, output_transform=lambda outputs: outputs[0]) as rec:
            _tanh_loop(sched, model, x, cond)


def test_hooks_removed_on_exception_and_option_checks():
    pipe = tp.tiny_StableDiffusion3Pipeline(torch.float32)
    inputs = tp.StableDiffusion3Pipeline_inputs(torch.float32)

    def boom(*args, **kwargs):
        raise KeyError("stop")

    with pytest.raises(KeyError):
        with flowrl.rollout.recorder.rollout(pipe.scheduler, model=pipe.transformer) as rec:
            pipe(**inputs, callback_on_step_end=boom)
    assert not pipe.transformer._forward_hooks and not pipe.transformer._forward_pre_hooks
    assert "step" not in vars(pipe.scheduler)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        flowrl.rollout.recorder.rollout(pipe.scheduler, model=lambda x: x)
    with pytest.raises(ValueError, match="need model="):
        flowrl.rollout.recorder.rollout(pipe.scheduler, env_device="cpu")
    with pytest.raises(TypeError, match="output_transform must be callable"):
        flowrl.rollout.recorder.rollout(pipe.scheduler, model=pipe.transformer, output_transform=3)
    with pytest.raises(TypeError, match="debug must be"):
        flowrl.rollout.recorder.rollout(pipe.scheduler, debug=3)
    # inside the block the environment is not complete yet
    with flowrl.rollout.recorder.rollout(pipe.scheduler, model=pipe.transformer) as rec:
        pipe(**inputs)
        with pytest.raises(RuntimeError, match="after the `with` block"):
            rec.trajectory()
    traj = rec.trajectory()
    with pytest.raises(ValueError, match="step must be an int"):
        traj.model_inputs(STEPS)
    with pytest.raises(ValueError, match="made 1 model call"):
        traj.step_model_output(0, [torch.zeros(1), torch.zeros(1)])
    # a split trajectory keeps the batch's environment: a batch-sized replay is refused, not misread
    with torch.no_grad():
        v = traj.step_model_output(0, pipe.transformer(**traj.model_inputs(0)))
    one = traj.split()[0]
    assert one.denoising_env is traj.denoising_env
    with pytest.raises(ValueError):
        one.step_log_prob(0, v)
    plain = flowrl.RolloutTrajectory(latents=traj.latents, log_probs=traj.log_probs, timesteps=traj.timesteps,
                                     sigmas=traj.sigmas)
    with pytest.raises(ValueError, match="no denoising environment"):
        plain.model_inputs(0)


def test_positional_calls_are_named_and_replay_in_a_hand_written_loop():
    torch.manual_seed(0)
    model = _Velocity()
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(3)
    cond = torch.randn(2, 4)
    x = torch.randn(2, 4)
    with sched.rollout(model=model, generator=torch.Generator().manual_seed(0)) as rec:
        for t in sched.timesteps:
            out = model(x, t.expand(2) / 1000, cond=cond, scale=2)[0]
            x = sched.step(-out, t, x).prev_sample  # a sign the recorder must find
    traj = rec.trajectory()
    kwargs = traj.model_inputs(1)
    assert set(kwargs) == {"x", "t", "cond", "scale"} and kwargs["scale"] == 2
    assert kwargs["cond"] is traj.model_inputs(0)["cond"]
    for j in range(3):
        with torch.no_grad():
            v = traj.step_model_output(j, model(**traj.model_inputs(j)))
        assert torch.equal(traj.step_log_prob(j, v), traj.log_probs[:, j])


def test_several_modules_record_which_module_each_call_went_to():
    """model=(a, b): both are hooked, each call records its module's index (traj.model_indices), and
    replaying each call on that module gives the log-probs bit for bit, as for Wan 2.2 A14B's experts
    (tests/rollout/test_pipeline_table.py, row wan22-a14b). Step 1 calls both (CFG with cond on a, uncond on b)."""
    torch.manual_seed(0)
    a, b = _Velocity(), _Velocity()
    models = (a, b)
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(3)
    cond, x = torch.randn(2, 4), torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with sched.rollout(model=[a, b], generator=torch.Generator().manual_seed(0)) as rec:
            for j, t in enumerate(sched.timesteps):
                if j == 1:
                    c, u = a(x, t.expand(2) / 1000, cond=cond)[0], b(x, t.expand(2) / 1000)[0]
                    out = u + 2.5 * (c - u)
                else:
                    out = models[j // 2](x, t.expand(2) / 1000, cond=cond)[0]
                x = sched.step(out, t, x).prev_sample
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in models)
    traj = rec.trajectory()
    assert [traj.model_indices(j) for j in range(3)] == [[0], [0, 1], [1]]
    assert traj.denoising_env.transform(1).cfg == "split"
    for j in range(3):
        with torch.no_grad():
            raw = [models[i](**kw) for i, kw in zip(traj.model_indices(j), traj.model_calls(j))]
        assert torch.equal(traj.step_log_prob(j, traj.step_model_output(j, raw)), traj.log_probs[:, j]), j
    # one module: every call's index is 0
    with sched.rollout(model=a) as rec:
        sched.set_timesteps(2)
        for t in sched.timesteps:
            x = sched.step(a(x, t.expand(2) / 1000)[0], t, x).prev_sample
    assert [rec.trajectory().model_indices(j) for j in range(2)] == [[0], [0]]

    with pytest.raises(TypeError, match=r"model\[1\] must be a torch.nn.Module"):
        sched.rollout(model=(a, lambda x: x))
    with pytest.raises(ValueError, match=r"model\[1\] is model\[0\]"):
        sched.rollout(model=(a, a))
    with pytest.raises(ValueError, match=r"model\[1\] is a submodule of model\[0\]"):
        sched.rollout(model=(a, a.lin))
    with pytest.raises(ValueError, match="non-empty"):
        sched.rollout(model=())


def test_detect_transform_on_synthetic_outputs():
    g = torch.Generator().manual_seed(0)
    u, c = torch.randn(2, 8, 3, generator=g), torch.randn(2, 8, 3, generator=g)
    assert detect_transform([c], c) == OutputTransform(out_dtype=torch.float32)
    assert detect_transform([c], -c).sign == -1
    t = detect_transform([torch.cat([u, c])], u + 7.5 * (c - u))
    assert (t.cfg, t.guidance_scale, t.uncond_index) == ("batched", 7.5, 0)
    t = detect_transform([c, u], u + 1.25 * (c - u))
    assert (t.cfg, t.guidance_scale, t.uncond_index) == ("split", 1.25, 1)
    assert detect_transform([c], c[:, :5]).token_cut == 5
    assert detect_transform([c.bfloat16()], c.bfloat16().float()).out_dtype == torch.float32
    # a transform outside the list: rescaled CFG; an unrelated tensor; three calls
    assert detect_transform([c, u], (u + 2 * (c - u)) * 1.1) is None
    p = u + 3.5 * (c - u)
    t = detect_transform([c, u], -(p * (c.norm(dim=-1, keepdim=True) / p.norm(dim=-1, keepdim=True))))
    assert (t.cfg, t.guidance_scale, t.cfg_renorm, t.sign) == ("split", 3.5, True, -1)
    assert detect_transform([c], torch.randn(2, 8, 3, generator=g)) is None
    assert detect_transform([c, c, c], c) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rollout_with_environment_on_cpu_replays_on_cuda():
    pipe = tp.tiny_StableDiffusion3Pipeline(torch.bfloat16).to("cuda")
    inputs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
              for k, v in tp.StableDiffusion3Pipeline_inputs(torch.bfloat16, guidance_scale=4.5).items()}
    with flowrl.rollout.recorder.rollout(pipe.scheduler, model=pipe.transformer, env_device="cpu",
                                 generator=torch.Generator("cuda").manual_seed(1)) as rec:
        pipe(**inputs, generator=torch.Generator("cuda").manual_seed(0))
    traj = rec.trajectory()
    assert traj.model_inputs(0)["hidden_states"].device.type == "cpu"
    for j in range(traj.num_steps):
        with torch.no_grad():
            v = traj.step_model_output(j, pipe.transformer(**traj.model_inputs(j, device="cuda")))
        assert torch.equal(traj.step_log_prob(j, v), traj.log_probs[:, j]), j
