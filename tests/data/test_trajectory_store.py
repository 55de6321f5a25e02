"""``rollout(..., store="device" | "cpu")`` (flowrl.data.trajectory_store): the host store records the same
values bit for bit as the device store, in every field of the trajectory, of ``step_inputs(j)``, of
the replay environment and of the debug tensors; the recorder keeps nothing but its host copies past
the current step; ``step_inputs(j, device=)`` moves a step's inputs; and the memory arithmetic of
docs/performance.md ("Memory of a recording")."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch

import flowrl
import flowrl.data.denoising_env
from flowrl.data import trajectory_store as TS
from flowrl.rollout.recorder import rollout

B, T = 2, 4
SHAPE = (B, 6, 8, 4)  # [B, S, C, D]: 192 elements per sample


class _Model(torch.nn.Module):
    """A velocity model called with kwargs (recorded by ``model=``): a conditioning tensor and the latents."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, timestep, cond):
        return (self.lin(hidden_states) * (1 + timestep.view(-1, 1, 1, 1) / 1000) + cond,)


def _scheduler():
    return flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)


def _loop(sched, model, *, dtype=torch.float32, per_token=False, audio=False, after_step=None):
    """A pipeline's loop: the model on the latents, the scheduler's step, optionally per-token timesteps
    and a second stream (a deepcopy of the scheduler, as LTX-2 makes for its audio)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)  # float32, as Wan's latents start; a step emits the model output's dtype
    cond = torch.randn(SHAPE, generator=g)
    sched.set_timesteps(T)
    second = copy.deepcopy(sched) if audio else None
    a = torch.randn(B, 5, 4, generator=g)
    for i, t in enumerate(sched.timesteps):
        timestep = t.expand(B)
        v = model(hidden_states=x.float(), timestep=timestep, cond=cond)[0].to(dtype)
        kwargs = {}
        if per_token:  # LTX Condition: token 0 held at t = 0, the others at the step's t
            pt = timestep[:, None, None].expand(B, SHAPE[1], 1).clone()  # -> token sigmas [B, S, 1, 1]
            pt[:, 0] = 0
            kwargs["per_token_timesteps"] = pt
        x = sched.step(v, t, x, **kwargs).prev_sample
        if second is not None:
            a = second.step(a * 0.5, t, a).prev_sample
        if after_step is not None:
            after_step(i, x)
    return x


SCENARIOS = {
    "sde": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "per-token": dict(per_token=True),
    "frozen": dict(options=dict(frozen=torch.tensor([True, False, False, False, False, False]).view(1, 6, 1, 1))),
    "dpm-sde-order-2": dict(options=dict(mode="dpm_sde", noise_level=1.0)),
    "ode-steps-filtered": dict(options=dict(sde_steps=[1, 2], return_step_indices=[0, 1, 2, 3])),
    "joint-streams": dict(audio=True),
    "env-and-debug": dict(options=dict(debug=True), env=True),
}


def _record(store, scenario, after_step=None):
    spec = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = _Model()
    sched = _scheduler()
    options = dict(mode="sde", noise_level=0.7, generator=[torch.Generator().manual_seed(7 + i) for i in range(B)])
    options.update(spec.get("options", {}))
    if spec.get("env"):
        options["model"] = model
    with rollout(sched, store=store, **options) as rec:
        _loop(sched, model, dtype=spec.get("dtype", torch.float32), per_token=spec.get("per_token", False),
              audio=spec.get("audio", False), after_step=None if after_step is None else (lambda i, x: after_step(rec, i, x)))
    return rec, rec.trajectory()


def _bitwise(a, b, where):
    if a is None or b is None:
        assert a is None and b is None, where
        return
    if isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _bitwise(x, y, f"{where}[{k}]")
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _bitwise(a[k], b[k], f"{where}.{k}")
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert flowrl.data.denoising_env.bitwise_equal(a, b), where
        return
    assert a == b, where


_FIELDS = ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices", "mode", "noise_level", "log_prob_kind",
           "reduction", "sde_steps", "token_sigmas", "frozen", "counts", "prev_x0_preds", "prediction_type",
           "clip_sample_range")


def _same_trajectory(a, b, where="traj"):
    for name in _FIELDS:
        _bitwise(getattr(a, name), getattr(b, name), f"{where}.{name}")
    assert (a.streams is None) == (b.streams is None), where
    for k, (sa, sb) in enumerate(zip(a.streams or (), b.streams or ())):
        _same_trajectory(sa, sb, f"{where}.streams[{k}]")


def _host_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _host_tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _host_tensors(v)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_cpu_store_records_the_device_stores_values_bit_for_bit(scenario):
    _, dev = _record("device", scenario)
    _, host = _record("cpu", scenario)
    _same_trajectory(dev, host)
    steps = [j for j in range(dev.num_steps) if {j, j + 1} <= set(dev.latent_step_indices.tolist())]
    assert steps
    for j in steps:
        _bitwise(dev.step_inputs(j), host.step_inputs(j), f"step_inputs({j})")
        _bitwise(dev.step_inputs(j), host.step_inputs(j, device="cpu"), f"step_inputs({j}, device='cpu')")
    assert all(t.device.type == "cpu" for name in _FIELDS for t in _host_tensors(getattr(host, name)))
    if SCENARIOS[scenario].get("env"):
        env_d, env_h = dev.denoising_env, host.denoising_env
        assert env_h.nbytes() == env_d.nbytes() > 0
        for j in range(T):
            _bitwise(env_d.model_calls(j), env_h.model_calls(j), f"model_calls({j})")
            torch.manual_seed(0)
            model = _Model()  # the recorded model's weights (_record seeds them the same way)
            raw = [model(**kw) for kw in env_h.model_calls(j)]
            v = host.step_model_output(j, raw)
            assert torch.equal(host.step_log_prob(j, v), host.log_probs[:, j])  # replay from the host copies
        _bitwise(dev.debug_tensors.as_dict(), host.debug_tensors.as_dict(), "debug_tensors")


def test_step_inputs_device_moves_every_tensor_and_checks_the_argument():
    _, traj = _record("cpu", "per-token")
    moved = traj.step_inputs(1, device="meta")
    for name, value in moved.items():
        for t in _host_tensors(value):
            assert t.device.type == "meta", name
    assert set(moved) == set(traj.step_inputs(1))
    j = torch.tensor([0, 2])
    assert moved_ok(traj.step_inputs(j, device=torch.device("meta")))
    with pytest.raises(TypeError, match="device"):
        traj.step_inputs(1, device=1.5)
    with pytest.raises(ValueError, match="device"):
        traj.step_inputs(1, device="no-such-device")


def moved_ok(inputs):
    return all(t.device.type == "meta" for v in inputs.values() for t in _host_tensors(v))


def test_store_argument_is_checked():
    with pytest.raises(ValueError, match="store"):
        rollout(_scheduler(), store="gpu")
    with pytest.raises(TypeError, match="store"):
        rollout(_scheduler(), store=None)
    with pytest.raises(ValueError, match="env_device"):
        rollout(_scheduler(), store="cpu", model=_Model(), env_device="meta")


def test_cpu_store_is_refused_while_capturing(monkeypatch):
    from flowrl.core import _validate

    sched = _scheduler()
    monkeypatch.setattr(_validate, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="store='device'"):
        with rollout(sched, store="cpu", mode="sde"):
            _loop(sched, _Model())


# ---------------------------------------------------------------------------------------------------
# what the recorder holds past each step


_SKIP_ATTRS = {"recorder", "scheduler", "saved", "generator", "derived", "_env_options", "_host", "modules",
               "_signatures", "_handles", "frozen", "user"}
# the current step's state, which the next step reads (not recorded values): the schedule snapshot,
# the validated mask, the step's output and its held mask, dpm_sde's last data prediction
_CURRENT = {"sigmas", "timesteps", "frozen_full", "last_prev", "last_unscored", "x0_pred"}


def _retained(obj, path="rec", seen=None):
    """Every tensor reachable from the recorder, with its attribute path (the scheduler instances, the
    user's own arguments and modules skipped; weak references not followed)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.Generator, weakref.ref, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _retained(v, f"{path}[{k!r}]", seen)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _retained(v, f"{path}[{k}]", seen)
    elif type(obj).__module__.startswith("flowrl") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if k not in _SKIP_ATTRS:
                yield from _retained(v, f"{path}.{k}", seen)


def _not_store_copies(rec):
    """The recorder's tensors that are not its store's copies and not the current step's state."""
    out = []
    for path, t in _retained(rec):
        if rec._host.is_copy(t):
            continue
        if path.rsplit(".", 1)[-1] in _CURRENT:
            continue
        out.append(path)
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_cpu_store_holds_only_its_copies_past_each_step(scenario):
    found, copies, live = [], [], []

    def after_step(rec, i, x):
        found.append(_not_store_copies(rec))
        copies.append(sum(1 for _, t in _retained(rec) if rec._host.is_copy(t)))
        live.append(x)  # the pipeline's tensors: no stored copy may share their memory

    rec, traj = _record("cpu", scenario, after_step)
    assert found == [[]] * T, found
    assert copies == sorted(copies) and copies[-1] > copies[0]  # the copies are what grows
    stored = [t for _, t in _retained(rec) if rec._host.is_copy(t)]
    assert stored
    ptrs = {t.untyped_storage().data_ptr() for t in live}
    assert not any(t.untyped_storage().data_ptr() in ptrs for t in stored)


@pytest.mark.parametrize("scenario", ["sde", "env-and-debug", "per-token"])
def test_the_holds_only_copies_check_fails_on_the_device_store(scenario):
    # the negative control: the device store keeps the pipeline's tensors, and the check says so
    found = []
    _record("device", scenario, lambda rec, i, x: found.append(_not_store_copies(rec)))
    assert all(found[1:]) and any("latents" in p for p in found[-1]), found
    if scenario == "env-and-debug":
        assert any("_rows" in p for p in found[-1]) and any("_store" in p or "_steps" in p for p in found[-1])
    if scenario == "per-token":
        assert any("token_sigmas" in p for p in found[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_of_a_cpu_store_recording_stays_at_one_steps_tensors():
    big = (2, 16, 64, 64)  # 512 KiB per latent in float32
    elem = 4 * 16 * 64 * 64 * 2

    def run(store):
        sched = _scheduler()
        sched.set_timesteps(8, device="cuda")
        sched.set_begin_index(0)
        x = torch.randn(big, device="cuda")
        v = torch.randn(big, device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        peak = 0
        with rollout(sched, store=store, mode="sde", noise_level=0.7) as rec:
            for t in sched.timesteps:
                x = sched.step(v, t, x).prev_sample
                peak = max(peak, torch.cuda.memory_allocated() - base)
        traj = rec.trajectory()
        return peak, traj

    peak_dev, traj_dev = run("device")
    peak_cpu, traj_cpu = run("cpu")
    assert traj_cpu.latents.device.type == "cpu" and traj_dev.latents.device.type == "cuda"
    assert peak_dev >= 8 * elem  # every step's latent stays on the device
    assert peak_cpu <= 3 * elem  # the step's input, output and temporaries only
    _same_trajectory(traj_dev, traj_cpu)  # the same values (bitwise_equal compares across devices)


# ---------------------------------------------------------------------------------------------------
# memory of a recording (docs/performance.md)


def test_nbytes_per_sample_step_counts_the_recorded_tensors():
    _, traj = _record("cpu", "sde")
    per = traj.nbytes_per_sample_step()
    assert per == {"latents": 192 * 4, "log_probs": 4, "total": 192 * 4 + 4}
    assert per["latents"] * B * (T + 1) == traj.latents.nbytes
    _, traj = _record("cpu", "per-token")
    assert traj.nbytes_per_sample_step()["token_sigmas"] == 6 * 4  # [B, T, S, 1, 1] float32
    _, traj = _record("device", "joint-streams")
    per = traj.nbytes_per_sample_step()
    assert per["stream0.latents"] == 192 * 4 and per["stream1.latents"] == 20 * 4
    assert per["total"] == 192 * 4 + 20 * 4 + 4 * 5  # two streams' log-probs and counts, the joint log-prob


def test_device_store_holds_what_the_peak_formula_counts():
    # the held part of the formula, measured on a recording: B (L(first) + T L(step)) in the recorder,
    # B (T + 1) L(promoted) in the trajectory
    rec, traj = _record("device", "bf16")
    stream = rec._streams[0]
    l32, l16 = 192 * 4, 192 * 2
    assert stream.latents[0].dtype == torch.float32 and stream.latents[1].dtype == torch.bfloat16
    assert sum(t.nbytes for t in stream.latents.values()) == B * (l32 + T * l16)
    assert traj.latents.nbytes == B * (T + 1) * l32
    formula = TS.recording_peak_gpu_bytes([((6, 8, 4), torch.float32, torch.bfloat16)], batch=B, steps=T, store="device")
    held = B * (l32 + T * l16) + B * T * l32 + B * (T + 1) * l32 + 2 * B * T * 4 + 4 * (2 * T + 1)
    assert formula == held
    assert TS.recording_peak_gpu_bytes([((6, 8, 4), torch.float32, torch.bfloat16)], batch=B, steps=T,
                                       store="cpu") == 4 * (2 * T + 1)
    with pytest.raises(ValueError, match="store"):
        TS.recording_peak_gpu_bytes([], batch=B, steps=T, store="host")


@pytest.mark.parametrize("eta, dtype", [(0.0, torch.bfloat16), (0.8, torch.float32)], ids=["eta0-bf16", "eta0.8-fp32"])
def test_ddim_rollout_cpu_store_matches_and_holds_only_copies(eta, dtype):
    # flowrl.DDIMScheduler's recorder replaces the last stored latent on a deterministic half-precision
    # step (its _replace_last_output): that one goes through the store too
    pytest.importorskip("diffusers")
    from flowrl.rollout.ddim import DDIMScheduler

    def run(store):
        sched = DDIMScheduler(num_train_timesteps=1000)
        sched.set_timesteps(T)
        x = torch.randn(B, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
        found = []
        with sched.rollout(noise_level=eta, store=store,
                           generator=[torch.Generator().manual_seed(3 + i) for i in range(B)]) as rec:
            for t in sched.timesteps:
                x = sched.step((x * 0.3).to(dtype), t, x, eta=eta).prev_sample
                found.append(_not_store_copies(rec))
        return rec.trajectory(), found

    dev, found_dev = run("device")
    host, found_host = run("cpu")
    _same_trajectory(dev, host)
    for j in range(T):
        _bitwise(dev.step_inputs(j), host.step_inputs(j), f"step_inputs({j})")
    assert found_host == [[]] * T and all(found_dev[1:])
