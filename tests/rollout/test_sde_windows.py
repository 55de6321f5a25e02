"""Per-sample SDE windows (docs/scheduler.md, Per-sample SDE windows): ``rollout(sde_steps=)`` given one
step set per sample (B index lists or a bool [B, T] mask) records each sample exactly as it records
alone with its own set, ode steps drawing no noise and scoring 0; the trajectory's ``sde_mask`` goes
through the wire format, files and SGLang responses, the replay (``step_log_prob``, ``replay_plan``)
recomputes exactly the stochastic (sample, step) pairs with ratio exactly 1 (torch; Triton under the
interpreter), shards carry the mask and recompute a mixed step on 2 gloo ranks; a batch-wide set
given per sample is today's rollout bit for bit; ``flowrl.rollout.sde_windows`` against a
transcription of verl-omni's window rule; bad inputs are named."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import flowrl
from flowrl.data.sglang import from_sglang, to_sglang
from flowrl.data.trajectory import RolloutTrajectory
from flowrl.rollout.recorder import rollout
from flowrl.rollout.windows import sde_windows

TRITON_OK = "triton" in flowrl.available_backends() and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs triton"))]
B, T, SHAPE = 3, 5, (4, 8)
ROWS = [[0, 1], [2, 3], [1]]  # step 1 mixed (samples 0, 2 stochastic), step 4 ode for all


def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (torch.sin(3 * x.float()) + t.float() / 1000).to(x.dtype)


def latents(batch=B, seed=0, shape=SHAPE):
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def record(x, steps=T, **options):
    """Records the loop; returns the trajectory and each step's velocity."""
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    outputs = []
    with rollout(sched, **options) as rec:
        for t in sched.timesteps:
            outputs.append(velocity(x, t))
            x = sched.step(outputs[-1], t, x).prev_sample
    return rec.trajectory(), outputs


def mask_of(rows, steps=T):
    m = torch.zeros(len(rows), steps, dtype=torch.bool)
    for b, r in enumerate(rows):
        m[b, r] = True
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["lists", "mask"])
def test_each_sample_records_as_it_does_alone_with_its_own_steps(backend, form):
    x = latents()
    given = ROWS if form == "lists" else mask_of(ROWS)
    traj, _ = record(x, sde_steps=given, generator=gens([1, 2, 3]), backend=backend)
    assert traj.sde_steps is None and torch.equal(traj.sde_mask, mask_of(ROWS))
    assert torch.equal(traj.step_mask(), mask_of(ROWS))
    assert bool((traj.log_probs[~mask_of(ROWS)] == 0).all()) and bool((traj.log_probs[mask_of(ROWS)] != 0).all())
    for b in range(B):
        alone, _ = record(x[b:b + 1], sde_steps=ROWS[b], generator=gens([b + 1]), backend=backend)
        assert torch.equal(alone.latents, traj.latents[b:b + 1]), b
        assert torch.equal(alone.log_probs, traj.log_probs[b:b + 1]), b


def test_ode_samples_draw_no_noise_from_one_generator():
    """One generator: a step draws for its stochastic subset only (in row order), so the generator
    stream depends on the windows; the ode samples consume nothing."""
    x = latents()
    g = torch.Generator().manual_seed(5)
    traj, _ = record(x, sde_steps=ROWS, generator=g)
    g2 = torch.Generator().manual_seed(5)
    draws = sum(len(r) for r in ROWS) * torch.Size(SHAPE).numel()
    torch.randn(draws, generator=g2)
    assert torch.equal(torch.randn(4, generator=g), torch.randn(4, generator=g2))
    # sample 0's step 0 noise is the generator's first draw of one sample's shape (the subset at step 0 is {0})
    g3 = torch.Generator().manual_seed(5)
    eps = torch.randn(1, *SHAPE, generator=g3)
    step = flowrl.sde_step(x[:1], velocity(x[:1], traj.timesteps[0]), traj.sigmas, 0, noise=eps)
    assert torch.equal(step.prev_sample, traj.latents[:1, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_recomputes_the_stochastic_pairs_with_ratio_exactly_one(backend):
    traj, outputs = record(latents(), sde_steps=ROWS, generator=gens([1, 2, 3]), backend=backend)
    for j in range(T):  # a mixed step: two calls, scattered back
        got = traj.step_log_prob(j, outputs[j], backend=backend)
        assert torch.equal(got, traj.log_probs[:, j]), j
    # one step per sample, mixing kinds
    j = torch.tensor([0, 2, 1])
    v = torch.stack([outputs[int(s)][b] for b, s in enumerate(j)])
    assert torch.equal(traj.step_log_prob(j, v, backend=backend), traj.log_probs.gather(1, j[:, None])[:, 0])
    with pytest.raises(ValueError, match="sde_mask"):
        traj.step_inputs(1)
    assert traj.step_inputs(4)["mode"] == "ode"  # a step of one kind
    assert traj.split()[0].step_inputs(1)["mode"] == "sde"
    stacked = torch.stack(outputs, dim=1)  # [B, T, ...]
    for order in ("step", "sample"):
        plan = traj.replay_plan(2, order=order)
        pairs = sorted((int(b), int(s)) for c in plan for b, s in zip(c.samples, c.steps))
        assert pairs == sorted((b, s) for b, r in enumerate(ROWS) for s in r)  # each stochastic pair once
        assert all(c.stochastic for c in plan)
        ratios = [torch.exp(c.log_prob(traj, stacked[c.samples, c.steps], backend=backend) - c.old_log_probs(traj))
                  for c in plan]
        full = plan.assemble(ratios, fill=1.0)
        assert bool((full == 1).all())
    # steps= replays every pair of those steps, the ode pairs in chunks of their own
    plan = traj.replay_plan(8, steps=[1])
    assert [(c.stochastic, c.samples.tolist()) for c in plan] == [(True, [0, 2]), (False, [1])]
    for c in plan:
        assert torch.equal(c.log_prob(traj, stacked[c.samples, c.steps], backend=backend), c.old_log_probs(traj))


def test_a_batch_wide_set_given_per_sample_is_todays_rollout():
    x = latents()
    today, _ = record(x, sde_steps=[1, 3], generator=torch.Generator().manual_seed(4))
    for given in ([[1, 3]] * B, mask_of([[1, 3]] * B), [torch.tensor([3, 1])] * B):
        same, _ = record(x, sde_steps=given, generator=torch.Generator().manual_seed(4))
        assert same.sde_mask is None and torch.equal(same.sde_steps, today.sde_steps)
        assert torch.equal(same.latents, today.latents) and torch.equal(same.log_probs, today.log_probs)
        assert same.to_wire() == today.to_wire()


def test_the_mask_round_trips_through_wire_file_and_sglang(tmp_path):
    traj, outputs = record(latents(), sde_steps=ROWS, generator=gens([1, 2, 3]))
    wire = traj.to_wire()
    assert wire["format"] == "flowrl.RolloutTrajectory/2" and "sde_mask" in wire and wire["sde_steps"] is None
    back = RolloutTrajectory.from_wire(wire)
    traj.save(tmp_path / "t.safetensors")
    loaded = RolloutTrajectory.load(tmp_path / "t.safetensors")
    responses = to_sglang(traj)
    assert [r["rollout_sde_step_indices"] for r in responses] == ROWS
    requests = [{"rollout_sde_type": "sde", "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False,
                 "rollout_sde_step_indices": r} for r in ROWS]
    plain = [{k: v for k, v in r.items() if not k.startswith("rollout_sde") and k not in (
        "rollout_noise_level", "rollout_log_prob_no_const", "rollout_return_step_indices")} for r in responses]
    for got in (back, loaded, from_sglang(responses), from_sglang(plain, request=requests)):
        assert torch.equal(got.sde_mask, traj.sde_mask) and got.sde_steps is None
        assert torch.equal(got.latents, traj.latents) and torch.equal(got.log_probs, traj.log_probs)
        for j in range(T):
            assert torch.equal(got.step_log_prob(j, outputs[j]), traj.log_probs[:, j])
    # a trajectory without the mask writes what it did before (no key): /2 payloads and files are unchanged
    today, _ = record(latents(), sde_steps=[1])
    assert "sde_mask" not in today.to_wire() and "sde_mask" not in today._tensors()
    # per-request steps equal for every sample (one as null, one listing every step) are the batch-wide form
    same = [{**r, "rollout_sde_step_indices": None if b else list(range(T))} for b, r in enumerate(requests)]
    assert from_sglang(plain, request=same).sde_mask is None
    # a split keeps each sample's row
    assert [s.sde_mask.tolist() for s in traj.split()] == [[row] for row in mask_of(ROWS).tolist()]


def test_bad_masks_in_payloads_are_refused_by_name():
    traj, _ = record(latents(), sde_steps=ROWS, generator=gens([1, 2, 3]))
    wire = traj.to_wire()
    bad = dict(wire, sde_mask=flowrl.data.serialization.to_wire({"m": torch.ones(B, T - 1, dtype=torch.bool)})["m"])
    with pytest.raises(ValueError, match="sde_mask must be bool"):
        RolloutTrajectory.from_wire(bad)
    both = dict(wire, sde_steps=flowrl.data.serialization.to_wire({"s": torch.tensor([1])})["s"])
    with pytest.raises(ValueError, match="exclusive"):
        RolloutTrajectory.from_wire(both)
    with pytest.raises(ValueError, match="unexpected keys"):
        RolloutTrajectory.from_wire(dict(wire, format="flowrl.RolloutTrajectory/1"))
    with pytest.raises(ValueError, match="exclusive"):
        dataclasses.replace(traj, sde_steps=torch.tensor([1]))
    requests = [{"rollout_sde_type": "sde", "rollout_noise_level": 0.7 + 0.1 * b, "rollout_sde_step_indices": r}
                for b, r in enumerate(ROWS)]
    plain = [{k: v for k, v in r.items() if not k.startswith("rollout_") or k == "rollout_log_probs"}
             for r in to_sglang(traj)]
    with pytest.raises(ValueError, match="only rollout_sde_step_indices may differ"):
        from_sglang(plain, request=requests)
    with pytest.raises(ValueError, match="one request per sample"):
        from_sglang(plain, request=requests[:2])
    far = [dict(r, rollout_sde_step_indices=[T]) if b == 1 else r for b, r in enumerate(to_sglang(traj, wire=False))]
    with pytest.raises(ValueError, match=r"\[1\]\['rollout_sde_step_indices'\]"):
        from_sglang([flowrl.data.serialization.to_wire(r) for r in far])


def test_format_1_refuses_the_mask_and_step_mask_covers_every_form(tmp_path):
    # docs/wire_and_sp.md: sde_mask is refused in format /1 (a /1 payload that is otherwise valid)
    today, _ = record(latents(), sde_steps=[1, 3])
    v1 = {k: v for k, v in today.to_wire().items() if k not in ("counts", "frozen", "prev_x0_preds", "streams",
                                                               "token_sigmas")}
    v1["format"] = "flowrl.RolloutTrajectory/1"
    assert torch.equal(RolloutTrajectory.from_wire(v1).latents, today.latents)
    traj, _ = record(latents(), sde_steps=ROWS, generator=gens([1, 2, 3]))
    with pytest.raises(ValueError, match=r"unexpected keys \['sde_mask'\]"):
        RolloutTrajectory.from_wire(dict(v1, sde_steps=None, sde_mask=traj.to_wire()["sde_mask"]))
    metadata = {"format": "flowrl.RolloutTrajectory/1", "mode": traj.mode, "noise_level": repr(float(traj.noise_level)),
                "log_prob": traj.log_prob_kind, "reduction": traj.reduction}
    flowrl.data.serialization.save_safetensors(tmp_path / "v1.safetensors", traj._tensors(), metadata)
    with pytest.raises(ValueError, match=r"optional \['sde_steps'\]; got .*'sde_mask'"):
        RolloutTrajectory.load(tmp_path / "v1.safetensors")
    # docs/scheduler.md: step_mask() gives either form, or all True, as bool [B, T]
    assert torch.equal(today.step_mask(), mask_of([[1, 3]] * B))
    every, _ = record(latents())
    assert every.sde_steps is None and every.sde_mask is None
    assert torch.equal(every.step_mask(), torch.ones(B, T, dtype=torch.bool))


def test_bad_rollout_arguments_are_named():
    x = latents()
    with pytest.raises(ValueError, match="3 rows; this rollout's batch is B = 2"):
        record(x[:2], sde_steps=ROWS)
    with pytest.raises(ValueError, match=r"\[B, T\] = \[3, 5\]"):
        record(x, sde_steps=mask_of(ROWS, T + 1))
    with pytest.raises(ValueError, match=r"sde_steps\[1\] entries must be in \[0, 4\]"):
        record(x, sde_steps=[[0], [5], [1]])
    with pytest.raises(TypeError, match="bool \\[B, T\\]"):
        record(x, sde_steps=torch.tensor([True, False]))
    with pytest.raises(TypeError, match=r"sde_steps\[0\] must hold ints"):
        record(x, sde_steps=[[0.5], [1], [2]])
    with pytest.raises(ValueError, match="debug"):
        rollout(flowrl.FlowMatchEulerDiscreteScheduler(), sde_steps=ROWS, debug=True)
    with pytest.raises(ValueError, match="branch"):
        rollout(flowrl.FlowMatchEulerDiscreteScheduler(), sde_steps=ROWS,
                branch=flowrl.data.tree.BranchSpec(steps=(1,), k=2, seed=0))


# --------------------------------------------------------------------------------------------------
# sde_windows: verl-omni's window rule (verl-project/verl-omni a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
# verl_omni/pipelines/request_batch.py sample_per_sample_sde_windows; the non-contiguous draw of
# verl_omni/pipelines/ltx2_flow_grpo/vllm_omni_rollout_adapter.py _select_sde_steps), restated here from
# its definition: a contiguous window starts at randint(low, high - size + 1) and covers size steps; a
# non-contiguous one is low + the first size entries of randperm(high - low), sorted; one generator
# draws once for the whole batch, a list draws row b from generator b; no size: every step but the last.

def verl_omni_rule(batch, num_steps, size, window_range, contiguous, generator):
    if size is None:
        return [list(range(num_steps - 1))] * batch
    low, high = window_range

    def one(g):
        if contiguous:
            start = int(torch.randint(low, high - size + 1, (1,), generator=g).item())
            return list(range(start, start + size))
        return sorted(low + k for k in torch.randperm(high - low, generator=g)[:size].tolist())

    return [one(g) for g in generator] if isinstance(generator, list) else [one(generator)] * batch


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("size, window_range", [(2, (0, 5)), (3, (1, 10)), (1, (0, 10)), (None, None)])
def test_sde_windows_follows_verl_omnis_rule(contiguous, size, window_range):
    steps = 10
    for generator in (lambda: gens(range(4)), lambda: torch.Generator().manual_seed(7)):
        got = sde_windows(4, steps, window_size=size, window_range=window_range, contiguous=contiguous,
                          generator=generator())
        want = verl_omni_rule(4, steps, size, window_range or (0, steps), contiguous, generator())
        assert torch.equal(got, mask_of(want, steps)), (generator, want)
    assert flowrl.rollout.sde_windows is sde_windows


def test_sde_windows_drive_a_rollout_and_bad_arguments_are_named():
    mask = sde_windows(B, T, window_size=2, generator=gens([0, 1, 2]))
    traj, outputs = record(latents(), sde_steps=mask, generator=gens([1, 2, 3]))
    assert torch.equal(traj.step_mask(), mask if traj.sde_mask is not None else traj.step_mask())
    for j in range(T):
        assert torch.equal(traj.step_log_prob(j, outputs[j]), traj.log_probs[:, j])
    for kwargs, error, match in (
            (dict(window_size=0), ValueError, "window_size must be >= 1"),
            (dict(window_size=3, window_range=(0, 2)), ValueError, "fewer than window_size"),
            (dict(window_size=2, window_range=(0, T + 1)), ValueError, "window_range must lie in"),
            (dict(window_range=(0, 2)), ValueError, "needs a window_size"),
            (dict(window_size=2, window_range=3), TypeError, "pair"),
            (dict(window_size=2, contiguous=1), TypeError, "contiguous"),
            (dict(window_size=2, generator=gens([0])), ValueError, "B = 3 generators"),
            (dict(window_size=True), TypeError, "window_size must be an int")):
        with pytest.raises(error, match=match):
            sde_windows(B, T, **kwargs)


# --------------------------------------------------------------------------------------------------
# sequence parallelism: the mask is per sample; a shard carries it and recomputes a mixed step


def test_a_shard_carries_the_mask():
    traj, _ = record(latents(), sde_steps=ROWS, generator=gens([1, 2, 3]))
    shard = flowrl.shard_trajectory(traj, 0, 2, dim=1)
    assert shard.sde_mask is traj.sde_mask and torch.equal(shard.step_mask(), traj.step_mask())


def _sp_check(rank, world):
    # 16 rows of 64 = one 1024-element chunk: the cut falls on a chunk boundary (docs/wire_and_sp.md)
    traj, outputs = record(latents(shape=(40, 64)), sde_steps=ROWS, generator=gens([1, 2, 3]))
    lo, hi = (0, 16) if rank == 0 else (16, 40)
    shard = flowrl.shard_trajectory(traj, lo, hi, dim=1)
    for j in range(T):
        got = shard.step_log_prob(j, outputs[j][:, lo:hi].contiguous())
        assert torch.equal(got, traj.log_probs[:, j]), (rank, j)


@pytest.mark.slow
def test_each_rank_recomputes_a_mixed_step_of_its_shard():
    from gloo_ranks import run_ranks

    run_ranks(_sp_check, 2, deadline_s=240)


# --------------------------------------------------------------------------------------------------
# the other recorders: joint streams (LTX-2's audio copy) and DDIM


def test_a_joint_rollout_with_per_sample_windows_records_each_sample_as_alone():
    import copy

    video, audio = latents(), torch.randn(B, 5, 3, generator=torch.Generator().manual_seed(9))

    def run(rows, seeds, video, audio):
        sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
        outs = []
        with rollout(sched, sde_steps=rows, generator=gens(seeds)) as rec:
            audio_sched = copy.deepcopy(sched)
            audio_sched.set_timesteps(T)
            sched.set_timesteps(T)
            for t in sched.timesteps:
                v, a = velocity(video, t), velocity(audio, t)
                outs.append((v, a))
                video = sched.step(v, t, video).prev_sample
                audio = audio_sched.step(a, t, audio).prev_sample
        return rec.trajectory(), outs

    traj, outs = run(ROWS, [1, 2, 3], video, audio)
    assert torch.equal(traj.sde_mask, mask_of(ROWS)) and all(torch.equal(s.sde_mask, mask_of(ROWS)) for s in traj.streams)
    for b in range(B):
        alone, _ = run(ROWS[b], [b + 1], video[b:b + 1], audio[b:b + 1])
        assert torch.equal(alone.log_probs, traj.log_probs[b:b + 1]), b
        assert torch.equal(alone.streams[1].latents, traj.streams[1].latents[b:b + 1]), b
    for j in range(T):
        assert torch.equal(traj.step_log_prob(j, outs[j]), traj.log_probs[:, j]), j


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_ddim_rollout_with_per_sample_windows_replays_exactly(backend):
    sched = flowrl.DDIMScheduler()
    sched.set_timesteps(T)
    x0 = latents()

    def run(x, rows, seeds):
        outs = []
        with sched.rollout(noise_level=1.0, sde_steps=rows, generator=gens(seeds), backend=backend) as rec:
            for t in sched.timesteps:
                outs.append(velocity(x, t))
                x = sched.step(outs[-1], t, x).prev_sample
        return rec.trajectory(), outs

    traj, outs = run(x0, ROWS, [1, 2, 3])
    assert traj.mode == "ddim" and torch.equal(traj.sde_mask, mask_of(ROWS))
    for b in range(B):
        alone, _ = run(x0[b:b + 1], ROWS[b], [b + 1])
        assert torch.equal(alone.latents, traj.latents[b:b + 1]) and torch.equal(alone.log_probs, traj.log_probs[b:b + 1])
    for j in range(T):
        assert torch.equal(traj.step_log_prob(j, outs[j], backend=backend), traj.log_probs[:, j]), j
