"""Replay under sequence parallelism (flowrl.data.trajectory_shard, docs/wire_and_sp.md): a rollout recorded
on one device, cut to each rank's shard with ``flowrl.shard_trajectory(traj, start, stop, dim=1)``, recomputed on 2 gloo
ranks from the recorded model calls (``shard.model_inputs(j)`` -> the model -> ``shard.step_model_output``
-> ``shard.step_log_prob``, i.e. ``flowrl.distributed.step_log_prob``) gives the recorded log-probs bit
for bit, shards on a chunk boundary: gaussian / kernel / sq_err, per-token sigmas and a frozen mask,
dpm_sde's second order; the per-token gaussian log term to float32 rounding (as for the step ops)."""
from __future__ import annotations

import pytest
import torch

import flowrl
from flowrl import distributed as fd
from flowrl.rollout.recorder import rollout
from flowrl.data.trajectory_shard import ShardedRolloutTrajectory
from gloo_ranks import run_ranks

pytestmark = pytest.mark.slow  # spawns gloo process groups (./run test -m 'not slow' skips it)

B, S, C, T = 2, 40, 64, 3
ROWS = [16, 24]  # 16 rows of 64 = one 1024-element chunk: the cut falls on a chunk boundary


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(C, C)

    def forward(self, hidden_states, timestep):
        h = self.lin(hidden_states)
        return (h * (1 + timestep.view(-1, 1, 1) / 1000).to(h.dtype),)


# (name, rollout options, per-token timesteps, exact)
CASES = [
    ("gaussian", dict(log_prob_kind="gaussian"), False, True),
    ("kernel-per-token-frozen", dict(log_prob_kind="kernel", frozen=True), True, True),
    ("sq-err-per-token", dict(log_prob_kind="sq_err"), True, True),
    ("gaussian-per-token-frozen", dict(log_prob_kind="gaussian", frozen=True), True, False),
    ("dpm-sde-order-2", dict(mode="dpm_sde", noise_level=1.0), False, True),
    ("bf16", dict(log_prob_kind="gaussian", dtype=torch.bfloat16), False, True),
]


def record(options, per_token):
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    torch.manual_seed(0)
    model = _Model().to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    levels = torch.randint(0, 2, (B, S), generator=g)
    if options.pop("frozen", False):
        options["frozen"] = torch.rand(1, S, 1, generator=g) < 0.25
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    with rollout(sched, **{"mode": "sde", "noise_level": 0.7, **options}, model=model,
                 generator=[torch.Generator().manual_seed(3 + i) for i in range(B)]) as rec:
        for t in sched.timesteps:
            timestep = t.expand(B)
            v = model(hidden_states=x, timestep=timestep)[0]
            kwargs = {}
            if per_token:  # some tokens one schedule step behind (held at 0 where t = 0)
                kwargs["per_token_timesteps"] = torch.where(levels == 1, timestep.view(B, 1) * 0.5, timestep.view(B, 1))
            x = sched.step(v, t, x, **kwargs).prev_sample
    return rec.trajectory(), model


def _check(rank, world):
    lo, hi = sum(ROWS[:rank]), sum(ROWS[: rank + 1])
    for name, options, per_token, exact in CASES:
        traj, model = record(options, per_token)
        shard = flowrl.shard_trajectory(traj, lo, hi, dim=1)
        assert shard.offset == lo * C and shard.numel == S * C and shard.shard_numel == (hi - lo) * C
        assert torch.equal(shard.latents, traj.latents[:, :, lo:hi])
        for j in range(T):
            with torch.no_grad():
                raw = model(**shard.model_inputs(j))  # the whole-sample call, as recorded
            v = shard.step_model_output(j, raw)
            assert v.shape == (B, hi - lo, C)
            got = shard.step_log_prob(j, v)
            direct = fd.step_log_prob(model_output=v, **shard.step_inputs(j), shard_numels=[r * C for r in ROWS])
            assert torch.equal(got, direct), (name, j)
            if exact:
                assert torch.equal(got, traj.log_probs[:, j]), (name, j, got, traj.log_probs[:, j])
            else:
                torch.testing.assert_close(got, traj.log_probs[:, j], rtol=2e-6, atol=1e-6)
            if per_token:
                assert torch.equal(shard.step_inputs(j)["token_sigmas"], traj.token_sigmas[:, j, lo:hi])


def test_each_rank_recomputes_its_shard_of_a_recorded_trajectory():
    run_ranks(_check, 2, deadline_s=240)


# ---------------------------------------------------------------------------------------------------
# one process: what a shard holds, and the arguments it refuses


def test_shard_slices_the_per_sample_tensors_and_keeps_the_rest():
    traj, _ = record(dict(log_prob_kind="kernel", frozen=True), True)
    shard = flowrl.shard_trajectory(traj, 16, 40)
    assert isinstance(shard, ShardedRolloutTrajectory)
    whole, part = traj.step_inputs(1), shard.step_inputs(1)
    assert set(whole) == set(part)
    for key, value in whole.items():
        if key in ("sample", "prev_sample", "token_sigmas", "frozen"):
            assert torch.equal(part[key], value[:, 16:40]), key
        elif isinstance(value, torch.Tensor):
            assert part[key] is value, key
        else:
            assert part[key] == value, key
    assert shard.log_probs is traj.log_probs and shard.sigmas is traj.sigmas
    assert shard.model_inputs(1)["hidden_states"].shape == (B, S, C)  # the recorded whole-sample call
    assert [s.batch_size for s in shard.split()] == [1, 1] and isinstance(shard.split()[0], ShardedRolloutTrajectory)


def test_shard_arguments_are_checked():
    traj, _ = record(dict(), False)
    with pytest.raises(ValueError, match="start, stop"):
        flowrl.shard_trajectory(traj, 10, 10)
    with pytest.raises(ValueError, match="start, stop"):
        flowrl.shard_trajectory(traj, 0, S + 1)
    with pytest.raises(TypeError, match="start"):
        flowrl.shard_trajectory(traj, 0.0, 8)
    with pytest.raises(ValueError, match="dim"):
        flowrl.shard_trajectory(traj, 0, 8, dim=0)
    with pytest.raises(ValueError, match="dim=2"):
        flowrl.shard_trajectory(traj, 0, 8, dim=2)  # [B, S, C] on C: not a contiguous range of the flattened sample
    shard = flowrl.shard_trajectory(traj, 0, 16)
    with pytest.raises(ValueError, match="already a shard"):
        flowrl.shard_trajectory(shard, 0, 8)
    with pytest.raises(ValueError, match="whole trajectory"):
        shard.to_wire()
    with pytest.raises(TypeError, match="model_output"):
        shard.step_log_prob(0, (torch.zeros(B, 16, C),))
    joint = flowrl.RolloutTrajectory(latents=traj.latents, log_probs=traj.log_probs, timesteps=traj.timesteps,
                                     sigmas=traj.sigmas, streams=(traj, traj))
    with pytest.raises(ValueError, match="streams"):
        flowrl.shard_trajectory(joint, 0, 16)
