"""Branching rollouts (docs/branching.md): the Philox key of each node (SplitMix64 known answers and an
independent numpy transcription), the tree, the functional driver == the recorder bit for bit, every
row's log-prob recomputing to ratio exactly 1 (torch; Triton under the interpreter), batch invariance
and a row replayed alone, the wire format and files, the advantages against transcriptions of
BranchGRPO's and TempFlow-GRPO's code, and the argument checks."""
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch

import flowrl
import flowrl.data.serialization
import flowrl.rollout.recorder
from flowrl.data.tree import (BranchSpec, BranchTree, depth_advantages, fork_advantages, node_key, node_rewards,
                              splitmix64)
from flowrl.data.trajectory import RolloutTrajectory
from flowrl.rollout.branching import branch_rollout

TRITON_OK = "triton" in flowrl.available_backends() and (
    torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs triton"))]
T = 6


def _setup(batch=2, shape=(4, 8)):
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, *shape, generator=g)
    cond = torch.randn(batch, 1, shape[-1], generator=g)

    def velocity(x, j, roots):  # elementwise: a row's output does not depend on the batch
        return torch.sin(x * 1.3 + cond[roots]) * (j + 1) / T

    return sched, x0, velocity


def _record(sched, x0, velocity, spec, backend="torch", **options):
    leaves = spec.leaves_per_sample
    roots = torch.arange(x0.shape[0]).repeat_interleave(leaves)
    x = x0.repeat_interleave(leaves, 0)
    with sched.rollout(mode="sde", noise_level=0.7, branch=spec, backend=backend, **options) as rec:
        for j, t in enumerate(sched.timesteps):
            x = sched.step(velocity(x, j, roots), t, x).prev_sample
    return rec.trajectory(), roots


# ------------------------------------------------------------------------------------------ keys


def test_splitmix64_known_answers():
    # Vigna's splitmix64.c from state 0: the first three outputs
    golden = 0x9E3779B97F4A7C15
    want = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [splitmix64((i * golden) % 2**64) for i in range(3)] == want


def test_node_key_matches_a_numpy_uint64_transcription():
    def oracle(seed, sample, path, step):
        with np.errstate(over="ignore"):
            h = np.uint64(0)
            for w in (seed, sample, step, len(path), *path):
                z = (h ^ np.uint64(w)) + np.uint64(0x9E3779B97F4A7C15)
                z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                h = z ^ (z >> np.uint64(31))
            return int(h.view(np.int64))

    for args in [(0, 0, (), 0), (7, 3, (1,), 4), (2**63 - 1, 12, (0, 2, 1), 39), (5, 0, (3, 3), 0)]:
        assert node_key(*args) == oracle(*args)
    # every word matters
    base = node_key(7, 3, (1, 0), 4)
    assert len({base, node_key(8, 3, (1, 0), 4), node_key(7, 4, (1, 0), 4), node_key(7, 3, (0, 1), 4),
                node_key(7, 3, (1, 0), 5), node_key(7, 3, (1, 0, 0), 4)}) == 6


def test_tree_structure_keys_and_owners():
    tree = BranchSpec(steps=[1, 3], k=[2, 3], seed=11).tree(2)
    assert tree.num_nodes == 2 + 4 + 12 and tree.num_rows == 12
    assert tree.parent.tolist()[:6] == [-1, -1, 0, 0, 1, 1] and tree.fork_step.tolist()[:6] == [0, 0, 1, 1, 1, 1]
    assert tree.path(int(tree.leaf[7])) == (0, 1)  # sample 1, first child, second grandchild
    nodes, keys = tree.row_nodes(T), tree.keys(T)
    for n in range(12):
        m = int(tree.leaf[n])
        for j in range(T):
            node = int(nodes[n, j])
            assert int(keys[j, n]) == node_key(11, int(tree.sample[node]), tree.path(node), j)
        assert nodes[n, 0] == n // 6 and nodes[n, 3] == m
    # rows share a key exactly when they share a node at that step
    for j in range(T):
        same_node = nodes[:, j, None] == nodes[None, :, j]
        assert torch.equal(same_node, keys[j][:, None] == keys[j][None, :])
    owners = tree.owners(T)
    assert owners[:, 0].sum() == 2 and owners[:, 1].sum() == 4 and owners[:, 3].all()
    # a row alone keeps its keys
    for n in (0, 7, 11):
        assert torch.equal(tree.select_row(n).keys(T)[:, 0], keys[:, n])
    tree.check(12, T)


# -------------------------------------------------------------------- rollout == recompute, tree holds


# the Triton backend's through the interpreter (~6 s): the full suite's; the quick loop keeps the
# Triton tree step below and this check on the torch backend
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=[*BACKENDS[1].marks, pytest.mark.slow])])
def test_functional_equals_recorder_and_every_row_replays_to_ratio_one(backend):
    sched, x0, velocity = _setup()
    spec = BranchSpec(steps=[1, 3], k=[2, 3], seed=11)
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), spec, mode="sde", noise_level=0.7, backend=backend)
    rec, roots = _record(sched, x0, velocity, spec, backend=backend)
    assert torch.equal(rec.latents, traj.latents) and torch.equal(rec.log_probs, traj.log_probs)
    assert torch.equal(rec.tree.parent, traj.tree.parent) and torch.equal(rec.tree.leaf, traj.tree.leaf)
    for j in range(T):
        v = velocity(traj.latents[:, j], j, roots)
        ratio = torch.exp(traj.step_log_prob(j, v, backend=backend) - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), j
    # the tree holds: rows under one node share the step's input, output and log-prob; siblings differ
    nodes = traj.tree.row_nodes(T)
    for j in range(T):
        for n in range(traj.batch_size):
            first = int((nodes[:, j] == nodes[n, j]).nonzero()[0])
            assert torch.equal(traj.latents[n, j:j + 2], traj.latents[first, j:j + 2])
            assert torch.equal(traj.log_probs[n, j], traj.log_probs[first, j])
    assert not torch.equal(traj.latents[0, 2], traj.latents[3, 2])  # children of the step-1 fork
    assert not torch.equal(traj.latents[0, 4], traj.latents[1, 4])  # children of the step-3 fork


def test_prefix_is_the_unbranched_rollout_and_any_row_replays_alone():
    sched, x0, velocity = _setup()
    spec = BranchSpec(steps=[2, 4], k=2, seed=5)
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), spec)
    plain = branch_rollout(velocity, x0, sched.sigmas.clone(), BranchSpec(steps=[], seed=5))
    assert plain.batch_size == 2 and torch.equal(plain.tree.leaf, torch.tensor([0, 1]))
    # before the first fork the noise is the root's, whatever forks follow
    assert torch.equal(traj.latents[::4, :3], plain.latents[:, :3])
    # row n alone: its own keys (split() keeps them) redraw its noise and reproduce its path bit for bit
    for n in (1, 6):
        row = traj.split()[n]
        keys = row.tree.keys(T)
        x = row.latents[:, 0]
        for j in range(T):
            out = flowrl.sde_step(x, velocity(x, j, torch.tensor([n // 4])), row.sigmas, j, noise_seed=keys[j])
            assert torch.equal(out.log_prob, row.log_probs[:, j])
            x = out.prev_sample
            assert torch.equal(x, row.latents[:, j + 1])


def test_a_sample_does_not_depend_on_its_batch():
    sched, x0, velocity = _setup(batch=3)
    spec = BranchSpec(steps=[0, 3], k=2, seed=9, sample_ids=[10, 11, 12])
    whole = branch_rollout(velocity, x0, sched.sigmas.clone(), spec)
    alone = branch_rollout(lambda x, j, roots: velocity(x, j, roots + 2), x0[2:], sched.sigmas.clone(),
                           BranchSpec(steps=[0, 3], k=2, seed=9, sample_ids=[12]))
    assert torch.equal(alone.latents, whole.latents[8:]) and torch.equal(alone.log_probs, whole.log_probs[8:])
    # a fork at step 0: the roots drive no step
    assert (whole.tree.row_nodes(T) >= 3).all()


def test_sde_steps_and_a_fork_at_a_deterministic_step():
    sched, x0, velocity = _setup()
    spec = BranchSpec(steps=[1], k=2, seed=1)
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), spec, sde_steps=[1, 2])
    assert (traj.log_probs[:, [0, 3, 4, 5]] == 0).all() and (traj.log_probs[:, 1:3] != 0).all()
    for j in range(T):
        v = velocity(traj.latents[:, j], j, torch.arange(2).repeat_interleave(2))
        assert torch.equal(traj.step_log_prob(j, v), traj.log_probs[:, j])
    with pytest.raises(ValueError, match=r"branch.steps \[1\] are deterministic"):
        branch_rollout(velocity, x0, sched.sigmas.clone(), spec, sde_steps=[2])
    with pytest.raises(ValueError, match=r"branch.steps \[1\] are deterministic"):
        sched.rollout(mode="ode", branch=spec)


# --------------------------------------------------------------------------- a diffusers pipeline


def test_sd3_pipeline_branching_rollout_replays_to_ratio_one():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import tiny_pipelines as tp

    pipe = tp.tiny_StableDiffusion3Pipeline(torch.float32)
    spec = BranchSpec(steps=[1, 2], k=2, seed=3)
    leaves = spec.leaves_per_sample
    kwargs = tp.StableDiffusion3Pipeline_inputs(torch.float32, batch=2, guidance_scale=4.5)
    for name in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"):
        kwargs[name] = kwargs[name].repeat_interleave(leaves, 0)
    kwargs["latents"] = torch.randn(2, 4, 2, 2, generator=torch.Generator().manual_seed(1)).repeat_interleave(leaves, 0)
    with flowrl.rollout.recorder.rollout(pipe.scheduler, branch=spec, model=pipe.transformer) as rec:
        pipe(**kwargs)
    traj = rec.trajectory()
    assert traj.batch_size == 8 and traj.tree.num_rows == 8
    for j in range(traj.num_steps):
        v = traj.step_model_output(j, [pipe.transformer(**kw) for kw in traj.model_calls(j)])
        ratio = torch.exp(traj.step_log_prob(j, v) - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), j
    assert not torch.equal(traj.latents[0, 2], traj.latents[2, 2]) and torch.equal(traj.latents[0, 1], traj.latents[3, 1])


# ------------------------------------------------------------------------------- wire and files


def test_tree_survives_the_wire_and_the_file(tmp_path):
    sched, x0, velocity = _setup()
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), BranchSpec(steps=[1, 3], k=[2, 3], seed=11))
    wire = json.loads(json.dumps(traj.to_wire()))
    assert wire["format"] == "flowrl.RolloutTrajectory/2" and "tree" in wire
    for back in (RolloutTrajectory.from_wire(wire), None):
        if back is None:
            traj.save(tmp_path / "t.safetensors")
            back = RolloutTrajectory.load(tmp_path / "t.safetensors")
        assert torch.equal(back.latents, traj.latents) and torch.equal(back.log_probs, traj.log_probs)
        for name in ("parent", "fork_step", "child", "sample", "leaf"):
            assert torch.equal(getattr(back.tree, name), getattr(traj.tree, name))
        assert back.tree.seed == 11 and torch.equal(back.tree.keys(T), traj.tree.keys(T))
    # a trajectory without a tree writes no 'tree' key: its payload is unchanged
    assert "tree" not in dataclasses.replace(traj, tree=None).to_wire()


def test_malformed_trees_are_refused():
    sched, x0, velocity = _setup()
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), BranchSpec(steps=[1], k=2, seed=1))
    good = traj.to_wire()

    def payload(**tree):
        wire = json.loads(json.dumps(good))
        tensors = {**traj.tree.to_tensors(), **tree}
        wire["tree"] = flowrl.data.serialization.to_wire(tensors)
        return wire

    cases = [
        (dict(parent=torch.tensor([-1, -1, 0, 0, 3, 1])), "parent"),
        (dict(leaf=torch.tensor([2, 3, 4])), "one entry per trajectory row"),
        (dict(leaf=torch.tensor([2, 2, 4, 5])), "every leaf node"),
        (dict(fork_step=torch.tensor([0, 0, 1, 2, 1, 1])), "fork at one step"),
        (dict(fork_step=torch.tensor([0, 0, 9, 9, 9, 9])), "loop steps"),
        (dict(child=torch.tensor([0, 0, 0, 0, 0, 1])), "child indices"),
        (dict(parent=torch.tensor([-1, -1, 0, 2, 1, 1, 2]), fork_step=torch.tensor([0, 0, 1, 1, 1, 1, 1]),
              child=torch.tensor([0, 0, 0, 0, 0, 1, 1]), sample=torch.tensor([0, 1, 0, 0, 1, 1, 0]),
              leaf=torch.tensor([3, 6, 4, 5])), "fork step after its parent's"),
        (dict(parent=torch.full((30,), -1), fork_step=torch.zeros(30, dtype=torch.int64), child=torch.zeros(30, dtype=torch.int64),
              sample=torch.arange(30)), "at most 28 nodes"),
        (dict(sample=torch.tensor([0, 0, 0, 0, 1, 1])), "distinct sample ids"),
        (dict(sample=torch.tensor([0, 1, 0, 1, 1, 1])), "parent's sample"),
        (dict(parent=torch.tensor([-1, -1, 0, 0, 1, 1], dtype=torch.int32)), "int64"),
        (dict(seed=torch.tensor(-1)), "seed"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            RolloutTrajectory.from_wire(payload(**change))
    wire = json.loads(json.dumps(good))
    wire["tree"]["extra"] = wire["tree"]["seed"]
    with pytest.raises(ValueError, match="must hold exactly"):
        RolloutTrajectory.from_wire(wire)
    wire["tree"] = [1]
    with pytest.raises(ValueError, match="tensor envelopes"):
        RolloutTrajectory.from_wire(wire)


# ------------------------------------------------------------------------------------ advantages


def _branchgrpo_transcription(batch, split_points, num_steps, leaf_rewards, log_probs=None, alpha=1.0):
    """Fredreic1849/BranchGRPO ffc3c902c900284db60dc61bb02f8b475966322f, fastvideo/train_branchgrpo_flux.py:
    run_tree_sample_step's node per step (2 children at a split point; a child's ``log_prob`` is its
    step's), compute_node_rewards_from_leaves (uniform: the mean of the leaf descendants; with
    ``log_probs`` [leaves, T], its ``use_prob_weighted=True`` reward fusion: bottom up, a node with one
    child takes its reward, else the softmax(alpha * children's log_prob)-weighted sum of the children's
    rewards) and compute_hierarchical_advantages_by_depth, per root tree, in float64. Returns, per leaf,
    the advantage of its node at each depth 1..T (the edge of step depth - 1), and the root rewards."""
    class Node:
        def __init__(self, parent):
            self.parent, self.children, self.reward, self.log_prob = parent, [], None, None
            self.depth = 0 if parent is None else parent.depth + 1

        def leaves(self):
            return [self] if not self.children else [l for c in self.children for l in c.leaves()]

    roots = [Node(None) for _ in range(batch)]
    current = list(roots)
    for i in range(num_steps):
        new = []
        for node in current:
            for _ in range(2 if i in split_points else 1):
                child = Node(node)
                node.children.append(child)
                new.append(child)
        current = new
    for n, (leaf, r) in enumerate(zip(current, leaf_rewards)):
        leaf.reward = r
        node = leaf
        while log_probs is not None and node.parent is not None:
            node.log_prob = log_probs[n, node.depth - 1]
            node = node.parent
    out = torch.zeros(len(current), num_steps, dtype=torch.float64)
    for root in roots:
        by_depth = {}
        stack = [root]
        while stack:
            node = stack.pop(0)
            by_depth.setdefault(node.depth, []).append(node)
            stack.extend(node.children)
        for depth in reversed(range(max(by_depth))):
            for node in by_depth[depth]:
                if node.children and log_probs is None:
                    node.reward = torch.stack([l.reward for l in node.leaves()]).mean()
                elif len(node.children) == 1:
                    node.reward = node.children[0].reward
                elif node.children:
                    weights = torch.softmax(alpha * torch.stack([c.log_prob for c in node.children]), dim=0)
                    node.reward = torch.sum(weights * torch.stack([c.reward for c in node.children]))
        adv = {}
        for depth, nodes in by_depth.items():
            if len(nodes) <= 1:
                for node in nodes:
                    adv[node] = torch.tensor(0.0, dtype=torch.float64)
                continue
            rewards = torch.stack([node.reward for node in nodes])
            std = rewards.std()
            a = torch.zeros_like(rewards) if std < 1e-6 else (rewards - rewards.mean()) / (std + 1e-8)
            for node, v in zip(nodes, a):
                adv[node] = v
        for n, leaf in enumerate(current):
            if leaf in root.leaves():
                node = leaf
                while node.parent is not None:
                    out[n, node.depth - 1] = adv[node]
                    node = node.parent
    return out, torch.stack([root.reward for root in roots])


@pytest.mark.parametrize("splits", [[1, 3], [0, 2, 5], [4]])
def test_depth_advantages_match_branchgrpo(splits):
    tree = BranchSpec(steps=splits, k=2, seed=0).tree(3)
    rewards = torch.randn(tree.num_rows, generator=torch.Generator().manual_seed(len(splits)), dtype=torch.float64)
    rewards[:2] = rewards[0]  # a tie
    got = depth_advantages(tree, rewards, T)
    want, _ = _branchgrpo_transcription(3, splits, T, list(rewards))
    torch.testing.assert_close(got.advantages, want, rtol=0, atol=1e-12)
    assert torch.equal(got.mask, tree.owners(T))
    # equal rewards: every advantage 0 (their std < 1e-6 rule)
    assert (depth_advantages(tree, torch.ones(tree.num_rows), T).advantages == 0).all()
    # node rewards are the leaf means
    r = node_rewards(tree, rewards)
    assert torch.allclose(r[:3], rewards.view(3, -1).mean(1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("splits", [[1, 3], [0, 2, 5], [4]])
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_reward_fusion_matches_branchgrpo(splits, alpha):
    """BranchGRPO's probability-weighted reward fusion (use_prob_weighted=True): node_rewards(log_probs=)
    and depth_advantages(log_probs=) against the transcription, float64, within 1e-12; the log-probs are
    per (node, step) as a trajectory stores them (rows under one node share a step's value)."""
    tree = BranchSpec(steps=splits, k=2, seed=0).tree(3)
    g = torch.Generator().manual_seed(7 + len(splits))
    rewards = torch.randn(tree.num_rows, generator=g, dtype=torch.float64)
    table = -1.0 + 0.8 * torch.randn(tree.num_nodes, T, generator=g, dtype=torch.float64)
    nodes = tree.row_nodes(T)
    log_probs = table[nodes, torch.arange(T)]  # [N, T]: each row's node's value at each step
    got = depth_advantages(tree, rewards, T, log_probs=log_probs, alpha=alpha)
    want, roots = _branchgrpo_transcription(3, splits, T, list(rewards), log_probs, alpha)
    torch.testing.assert_close(got.advantages, want, rtol=0, atol=1e-12)
    fused = node_rewards(tree, rewards, log_probs, alpha=alpha)
    torch.testing.assert_close(fused[:3], roots, rtol=0, atol=1e-12)
    assert not torch.allclose(fused, node_rewards(tree, rewards))  # not the leaf means
    # equal log-probs at every fork: the fusion is the leaf mean
    flat = node_rewards(tree, rewards, torch.zeros(tree.num_rows, T, dtype=torch.float64))
    torch.testing.assert_close(flat, node_rewards(tree, rewards), rtol=0, atol=1e-12)
    # a float32 trajectory's log-probs: the rewards' dtype comes back
    assert node_rewards(tree, rewards.float(), log_probs.float()).dtype == torch.float32
    bad = log_probs.clone()
    bad[1, splits[0]] += 1.0  # rows 0 and 1 are under one child of the first fork when more forks follow
    if len(splits) > 1:
        assert nodes[0, splits[0]] == nodes[1, splits[0]]
        with pytest.raises(ValueError, match="differ at its fork step"):
            node_rewards(tree, rewards, bad)
    with pytest.raises(ValueError, match=r"log_probs must have shape \[N, T\]"):
        node_rewards(tree, rewards, log_probs[1:])
    with pytest.raises(ValueError, match="T = num_steps"):
        depth_advantages(tree, rewards, T, log_probs=log_probs[:, 1:])
    with pytest.raises(TypeError, match="log_probs must be a float tensor"):
        node_rewards(tree, rewards, log_probs.long())
    with pytest.raises(ValueError, match="finite"):
        node_rewards(tree, rewards, log_probs * float("nan"))
    with pytest.raises(TypeError, match="alpha"):
        node_rewards(tree, rewards, log_probs, alpha=float("inf"))


def test_reward_fusion_reads_a_branching_trajectory():
    """A branch_rollout's own log_probs: rows under one node carry its fork step's value bit for bit, so
    depth_advantages(log_probs=traj.log_probs) takes them as they are."""
    _, x0, velocity = _setup()
    sched = flowrl.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(T)
    traj = branch_rollout(velocity, x0, sched.sigmas, BranchSpec(steps=[1, 3], k=2, seed=3), backend="torch")
    rewards = torch.linspace(0.0, 1.0, traj.tree.num_rows)
    got = depth_advantages(traj.tree, rewards, T, log_probs=traj.log_probs)
    assert got.advantages.shape == (traj.tree.num_rows, T) and got.advantages.abs().sum() > 0
    fused = node_rewards(traj.tree, rewards, traj.log_probs)
    assert not torch.allclose(fused, node_rewards(traj.tree, rewards))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tree_step_trains_through_grpo_loss_on_its_masked_edges(backend):
    """docs/losses.md, Branching rollouts: the rows a TreeAdvantages mask marks at step j, passed to
    grpo_loss with the step's advantages, recompute to ratio exactly 1 at the rollout's policy, and the
    loss is the mean over the trained edges; depth and fork advantages alike."""
    sched, x0, velocity = _setup()
    traj = branch_rollout(velocity, x0, sched.sigmas.clone(), BranchSpec(steps=[1, 3], k=2, seed=5), backend=backend)
    roots = torch.arange(x0.shape[0]).repeat_interleave(4)
    rewards = torch.linspace(-1.0, 1.0, traj.tree.num_rows)
    for adv in (depth_advantages(traj.tree, rewards, T, log_probs=traj.log_probs),
                fork_advantages(traj.tree, rewards, T)):
        trained = 0
        for j in range(T):
            rows = adv.mask[:, j]
            if not rows.any():
                continue
            inputs = traj.step_inputs(j)
            a = adv.advantages[rows, j]
            out = flowrl.losses.grpo_loss(inputs["sample"][rows], velocity(inputs["sample"], j, roots)[rows],
                                          inputs["prev_sample"][rows], inputs["sigmas"], j, old_log_prob=traj.log_probs[rows, j],
                                          advantages=a, clip_range=0.2, mode=inputs["mode"], noise_level=inputs["noise_level"],
                                          backend=backend)
            assert torch.equal(out.ratio, torch.ones_like(out.ratio)), j
            torch.testing.assert_close(out.loss, -a.mean())
            trained += int(rows.sum())
        assert trained == int(adv.mask.sum()) > 0


def _tempflow_transcription(prompts, rewards):
    """yifan123/flow_grpo 94e23ee5405ab7241fc1f75d30cac8147e2b1f53, flow_grpo/stat_tracking.py
    PerPromptStatTracker.update(type='grpo') (imported by Shredded-Pork/TempFlow-GRPO 28a9b9be
    scripts/train_flux_pr.py on its [rows, steps] rewards): per prompt, per column, (r - mean) / (std +
    1e-4), numpy's population std, float64."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        r = rewards[prompts == prompt]
        advantages[prompts == prompt] = (r - np.mean(r, axis=0, keepdims=True)) / (np.std(r, axis=0, keepdims=True) + 1e-4)
    return advantages


def test_fork_advantages_match_tempflow_grpo():
    # TempFlow-GRPO's branches at step s: K children of each trunk, grouped by prompt (trunks 0, 2 share one)
    s, k = 2, 6
    tree = BranchSpec(steps=[s], k=k, seed=0).tree(3)
    rewards = torch.rand(tree.num_rows, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    prompts = torch.tensor([0, 1, 0]).repeat_interleave(k)
    got = fork_advantages(tree, rewards, T, groups=prompts)
    want = _tempflow_transcription(prompts.tolist(), rewards.numpy()[:, None])[:, 0]
    np.testing.assert_allclose(got.advantages[:, s].numpy(), want, rtol=0, atol=1e-12)
    assert (got.advantages[:, [0, 1, 3, 4, 5]] == 0).all() and got.mask[:, s].all() and got.mask.sum() == 18
    # without groups each tree is its own group
    alone = fork_advantages(tree, rewards, T)
    for b in range(3):
        rows = slice(b * k, (b + 1) * k)
        want = _tempflow_transcription([0] * k, rewards.numpy()[rows, None])[:, 0]
        np.testing.assert_allclose(alone.advantages[rows, s].numpy(), want, rtol=0, atol=1e-12)
    # nested forks: the nodes forked at each step, each with its leaves' mean reward
    nested = BranchSpec(steps=[1, 3], k=2, seed=0).tree(1)
    r = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    got = fork_advantages(nested, r, T)
    np.testing.assert_allclose(got.advantages[:, 1].numpy(), _tempflow_transcription([0] * 4, [[1.5], [1.5], [6], [6]])[:, 0])
    np.testing.assert_allclose(got.advantages[:, 3].numpy(), _tempflow_transcription([0] * 4, r.numpy()[:, None])[:, 0])
    assert got.mask[:, 1].tolist() == [True, False, True, False]


# ------------------------------------------------------------------------------- argument checks


def test_argument_errors():
    with pytest.raises(ValueError, match="strictly increasing"):
        BranchSpec(steps=[3, 1])
    with pytest.raises(ValueError, match=r"branch.steps\[0\]"):
        BranchSpec(steps=[-1])
    with pytest.raises(TypeError, match=r"branch.steps\[0\]"):
        BranchSpec(steps=[True])
    with pytest.raises(ValueError, match="one int per fork step"):
        BranchSpec(steps=[1, 2], k=[2])
    with pytest.raises(ValueError, match="branch.k"):
        BranchSpec(steps=[1], k=0)
    with pytest.raises(ValueError, match="branch.seed"):
        BranchSpec(steps=[1], seed=2**63)
    with pytest.raises(ValueError, match="distinct"):
        BranchSpec(steps=[1], sample_ids=[1, 1])
    spec = BranchSpec(steps=[1], k=2, seed=0)
    with pytest.raises(ValueError, match="not a whole number of trees"):
        spec.tree_for_rows(3)
    with pytest.raises(ValueError, match="sample_ids"):
        BranchSpec(steps=[1], sample_ids=[0, 1]).tree(3)

    sched, x0, velocity = _setup()
    with pytest.raises(TypeError, match="branch must be"):
        sched.rollout(branch={"steps": [1]})
    with pytest.raises(ValueError, match="generator=None"):
        sched.rollout(branch=spec, generator=torch.Generator())
    with pytest.raises(ValueError, match="debug"):
        sched.rollout(branch=spec, debug=True)
    with pytest.raises(ValueError, match="branch.steps entries"):
        _record(sched, x0, velocity, BranchSpec(steps=[T], k=2))
    with pytest.raises(ValueError, match="not a whole number of trees"):
        with sched.rollout(branch=spec):
            sched.step(velocity(x0[:1], 0, torch.tensor([0])), sched.timesteps[0], x0[:1])
    x = torch.cat([x0[:1], x0[:1] + 1])  # one sample's two rows from different latents
    with pytest.raises(ValueError, match=r"branch: at loop step 0, rows \[1\]"):
        with sched.rollout(branch=spec):
            sched.step(velocity(x, 0, torch.tensor([0, 0])), sched.timesteps[0], x)
    with pytest.raises(TypeError, match="velocity"):
        branch_rollout(None, x0, sched.sigmas, spec)
    with pytest.raises(TypeError, match="branch must be"):
        branch_rollout(velocity, x0, sched.sigmas, None)
    with pytest.raises(ValueError, match="branch.steps entries"):
        branch_rollout(velocity, x0, sched.sigmas, BranchSpec(steps=[T]))
    tree = spec.tree(1)
    with pytest.raises(ValueError, match=r"rewards must have shape \[N\] = \[2\]"):
        depth_advantages(tree, torch.zeros(3), T)
    with pytest.raises(TypeError, match="rewards must be a float tensor"):
        node_rewards(tree, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="finite"):
        fork_advantages(tree, torch.tensor([0.0, float("nan")]), T)
    with pytest.raises(ValueError, match="the same on every row"):
        fork_advantages(tree, torch.zeros(2), T, groups=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="groups"):
        fork_advantages(tree, torch.zeros(2), T, groups=torch.zeros(2))


def test_copies_of_a_branching_scheduler_are_refused():
    import copy
    sched, _, _ = _setup()
    with pytest.raises(RuntimeError, match="one stream"):
        with sched.rollout(branch=BranchSpec(steps=[1])):
            copy.deepcopy(sched)


def test_rows_that_diverge_later_warn_and_still_replay():
    sched, x0, velocity = _setup(batch=1)
    spec = BranchSpec(steps=[3], k=2, seed=0)
    roots = torch.zeros(2, dtype=torch.int64)

    def unequal(x, j, roots):  # a model whose equal rows gave unequal outputs at step 1
        v = velocity(x, j, roots)
        return v + torch.tensor([0.0, 1e-3]).view(2, 1, 1) if j == 1 else v

    x = x0.repeat(2, 1, 1)
    with sched.rollout(branch=spec) as rec:
        for j, t in enumerate(sched.timesteps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                x = sched.step(unequal(x, j, roots), t, x).prev_sample
            assert any("rows [1] differ" in str(w.message) for w in caught) == (j == 2)
    traj = rec.trajectory()
    for j in range(T):
        assert torch.equal(traj.step_log_prob(j, unequal(traj.latents[:, j], j, roots)), traj.log_probs[:, j])


def test_a_step_given_its_noise_is_refused():
    pytest.importorskip("diffusers")
    sched = flowrl.DDIMScheduler()
    sched.set_timesteps(4)
    x = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="branch: this step was given its noise"):
        with sched.rollout(branch=BranchSpec(steps=[1])):
            sched.step(x, sched.timesteps[0], x, variance_noise=torch.ones_like(x))
