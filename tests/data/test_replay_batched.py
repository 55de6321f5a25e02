"""Batched replay (issue 23, item 3): ``RolloutTrajectory.replay_plan`` cuts the recompute's (sample, step)
pairs into forwards of a chosen size with per-row step indices; with a batch-invariant model the
recomputed log-probs equal the step-by-step recompute's and the rollout's bit for bit (ratio exactly 1),
for every batch size and order; bench/replay.py (docs/performance.md) on the example's tiny transformer."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import flowrl
from flowrl.data.replay import ReplayPlan

ROOT = Path(__file__).resolve().parents[2]
B, T, SHAPE = 5, 6, (3, 8)


def per_row(f):
    """A batch-invariant model by construction: each row in its own forward of batch 1, on a contiguous
    copy (torch's CPU matmul may round a row read through the trajectory's strides differently)."""
    def model(x, t):
        return torch.cat([f(x[i:i + 1].clone(memory_format=torch.contiguous_format), t[i:i + 1])
                          for i in range(x.shape[0])])
    return model


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE[-1], SHAPE[-1], generator=g) * 0.5, torch.randn(SHAPE, generator=g)


def make_model(dtype=torch.float32):
    w, bias = weights()
    w, bias = w.to(dtype), bias.to(dtype)
    return per_row(lambda x, t: torch.tanh(x @ w) * (t[:, None, None] / 1000).to(dtype) + bias - x)


def rollout(model, dtype=torch.float32, **options):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, *SHAPE, generator=g).to(dtype)
    with sched.rollout(generator=[torch.Generator().manual_seed(10 + i) for i in range(B)], **options) as rec:
        for t in sched.timesteps:
            x = sched.step(model(x, t.expand(B)), t, x).prev_sample
    return rec.trajectory()


def step_by_step(traj, model, steps):
    out = torch.zeros(B, T)
    for j in steps:
        inputs = traj.step_inputs(j)
        out[:, j] = flowrl.step_log_prob(model_output=model(inputs["sample"], traj.timesteps[j].expand(B)), **inputs)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [
    dict(), dict(mode="cps", noise_level=0.5, log_prob_kind="sq_err"),
    dict(sde_steps=[1, 2, 4], return_step_indices=[0, 1, 2, 3, 4, 5]),
], ids=["sde", "cps", "sde-steps-filtered"])
def test_batched_replay_equals_the_step_by_step_recompute_bit_for_bit(dtype, options):
    model = make_model(dtype)
    traj = rollout(model, dtype, **options)
    steps = sorted(traj.sde_steps.tolist()) if traj.sde_steps is not None else list(range(T))
    reference = step_by_step(traj, model, steps)
    for j in steps:  # the step-by-step recompute is the rollout's (ratio exactly 1)
        assert torch.equal(reference[:, j], traj.log_probs[:, j])
    for n in (1, 3, B, 7, B * len(steps), 1000):
        for order in ("step", "sample"):
            plan = traj.replay_plan(n, order=order)
            assert all(len(c) <= n for c in plan) and len(plan) == -(-B * len(steps) // n)
            got = plan.assemble([c.log_prob(traj, model(c.inputs(traj)["sample"], c.timesteps(traj))) for c in plan])
            assert torch.equal(got, reference), (n, order)
            ratios = plan.assemble([torch.exp(c.log_prob(traj, model(c.inputs(traj)["sample"], c.timesteps(traj)))
                                              - c.old_log_probs(traj)) for c in plan], fill=1.0)
            assert torch.equal(ratios, torch.ones(B, T))


def test_plan_covers_every_pair_once_and_keeps_ode_steps_apart():
    traj = rollout(make_model(), sde_steps=[0, 2, 3])
    plan = traj.replay_plan(4, steps=[0, 1, 2, 3, 5])
    pairs = [(int(s), int(j)) for c in plan for s, j in zip(c.samples, c.steps)]
    assert sorted(pairs) == sorted((s, j) for s in range(B) for j in (0, 1, 2, 3, 5))
    for c in plan:  # a chunk is all stochastic or all ode
        assert {int(j) in (0, 2, 3) for j in c.steps} == {c.stochastic}
    step_major = traj.replay_plan(100).chunks[0]
    assert step_major.steps.tolist() == [0] * B + [2] * B + [3] * B
    assert step_major.samples.tolist() == list(range(B)) * 3
    sample_major = traj.replay_plan(100, order="sample").chunks[0]
    assert sample_major.steps.tolist() == [0, 2, 3] * B
    # the inputs of a chunk are step_inputs' rows: sample, prev_sample, per-row step_index
    c = traj.replay_plan(3, steps=[2]).chunks[1]
    ref = traj.step_inputs(2)
    inputs = c.inputs(traj)
    assert torch.equal(inputs["sample"], ref["sample"][c.samples])
    assert torch.equal(inputs["prev_sample"], ref["prev_sample"][c.samples])
    assert inputs["step_index"].tolist() == [2] * len(c) and inputs["mode"] == "sde"
    assert traj.replay_plan(3, steps=[1]).chunks[0].inputs(traj)["mode"] == "ode"
    assert torch.equal(c.old_log_probs(traj), traj.log_probs[c.samples, 2])
    assert torch.equal(c.timesteps(traj), traj.timesteps[[2] * len(c)])


def test_replay_plan_refuses_bad_arguments_naming_them():
    traj = rollout(make_model(), return_step_indices=[0, 1, 2, 4, 5, 6])
    for kwargs, exc, pattern in (
            (dict(batch_size=0), ValueError, "batch_size must be a positive int"),
            (dict(batch_size=2.0), ValueError, "batch_size must be a positive int"),
            (dict(batch_size=2, order="row"), ValueError, "order must be one of"),
            (dict(batch_size=2, steps=[6]), ValueError, r"j must be a loop step in \[0, 5\]"),
            (dict(batch_size=2, steps=[2]), ValueError, r"did not keep loop step\(s\) \[3\]"),
            (dict(batch_size=2, steps=[]), ValueError, "steps is empty"),
            (dict(batch_size=2, steps="01"), TypeError, "steps must be a sequence of ints")):
        with pytest.raises(exc, match=pattern):
            traj.replay_plan(**kwargs)
    plan = traj.replay_plan(4, steps=[0, 1])
    assert isinstance(plan, ReplayPlan)
    with pytest.raises(ValueError, match="one tensor per chunk"):
        plan.assemble([torch.zeros(4)])
    with pytest.raises(ValueError, match=r"values\[1\] must be a tensor \[N\] = \[4\]"):
        plan.assemble([torch.zeros(4), torch.zeros(3), torch.zeros(2)])


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")
def test_bench_replay_on_the_tiny_transformer_gives_ratio_one_when_batch_invariant():
    """bench/replay.py (docs/performance.md) on ``./run example``'s transformer, small: with one sample per
    forward (a batch-invariant model) every plan's first-update ratio is exactly 1, and every plan runs
    ceil(T B / N) forwards."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import replay as bench_replay
    finally:
        sys.path.remove(str(ROOT / "bench"))
    args = bench_replay.parse_args(["--prompts", "2", "--k", "2", "--steps", "3", "--size", "8", "--repeats", "1",
                                    "--chunks", "4,5,12", "--per-sample"])
    rows = bench_replay.measure(args)
    assert [r["plan"] for r in rows] == ["step", "N=4", "N=5", "N=12"]
    assert [r["forwards"] for r in rows] == [3, 3, 3, 1]
    assert all(r["max_ratio_dev"] == 0.0 for r in rows)
