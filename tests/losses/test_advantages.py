"""flowrl.advantages against float64 transcriptions of the peers' formulas, written below in numpy as
the peers write them (not imported: the peers are not dependencies), on odd group layouts (shuffled ids,
uneven sizes, a singleton group, negative and sparse ids):

- Flow-GRPO: yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd, flow_grpo/stat_tracking.py
  lines 11-31 (PerPromptStatTracker.update, ``global_std`` both ways), scripts/train_sd3.py line 782 (no
  per-prompt tracking: batch mean and std), flow_grpo/rewards.py lines 360-400 (multi_score's weighted
  sum).
- Flow-Factory: X-GenGroup/Flow-Factory @ a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
  src/flow_factory/advantage/advantage_processor.py lines 242-263 (_global_mean_std), 357-397
  (compute_weighted_sum, ``global_std`` both ways), 451-481 (compute_gdpo).
- UniRL: Tencent-Hunyuan/UniRL unirl/types/sample.py @ 09bbaa7c908ece6c8219461af8a2211e0039eb22
  (Part.compute_advantages: scope "group", ``use_global_std``, scope "global"; finite_mean_std as in
  celve/unirl unirl/types/advantages.py @ 288ce1cfad15f87d55ea3d4d710aa760e4f6f387) and PR 271's GDPO
  as its description states it (per-dimension group step, weighted sum, batch whitening with std + eps).

The agreement asserted is the float32 rounding of the result (flowrl computes in float64 and returns
float32 for float32 rewards): max |flowrl - transcription| <= 2^-24 max |A| (measured: about 1.2e-7 on
advantages up to ~3); for float64 rewards the two agree to 1e-12. Where
the peers restrict the layout (Flow-Factory: every group of ``group_size``; UniRL: contiguous groups of
one size) the transcription drops the restriction, loops over the groups as the peer does, and the
test says so.
"""
from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pytest
import torch

import flowrl
from flowrl import advantages as A

TOL = 4e-7  # loose bound for comparisons of two flowrl results (float32 rounding of values up to ~3)
ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---- the transcriptions (float64 numpy, the peers' loops) ----------------------------------------

def flow_grpo_tracker(prompts, rewards, global_std=False):
    """flow_grpo/stat_tracking.py lines 11-31, type='grpo', one update (the tracker is cleared per
    epoch, train_sd3.py line 780)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(prompt_rewards, axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def flow_grpo_no_tracking(rewards):
    """scripts/train_sd3.py line 782 (numpy arrays: np.std, population)."""
    r = np.array(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + 1e-4)


def flow_grpo_multi_score(scores, weights):
    """flow_grpo/rewards.py lines 373-400: avg = sum over score names of weight * score."""
    total = None
    for name, weight in weights.items():
        weighted = np.asarray(scores[name], dtype=np.float64) * weight
        total = weighted if total is None else total + weighted
    return total


def flow_factory_sum(rewards, weights, group_indices, global_std):
    """advantage_processor.py lines 361-386 (compute_weighted_sum), _global_mean_std lines 260-263
    (the gathered path); the group-size check (lines 378-382) dropped."""
    aggregated = np.zeros_like(next(iter(rewards.values())), dtype=np.float64)
    for key, reward_array in rewards.items():
        aggregated += np.asarray(reward_array, dtype=np.float64) * weights[key]
    advantages = np.zeros_like(aggregated, dtype=np.float64)
    if global_std:
        std = max(float(np.std(aggregated)), 1e-6)
    for group_id in np.unique(group_indices):
        mask = group_indices == group_id
        group_rewards = aggregated[mask]
        mean = np.mean(group_rewards, axis=0, keepdims=True)
        if not global_std:
            std = max(np.std(group_rewards, axis=0, keepdims=True), 1e-6)
        advantages[mask] = (group_rewards - mean) / std
    return advantages


def flow_factory_gdpo(rewards, weights, group_indices):
    """advantage_processor.py lines 455-470 (compute_gdpo), the batch step through _global_mean_std."""
    all_reward_advantages = []
    for key, reward_array in rewards.items():
        reward_array = np.asarray(reward_array, dtype=np.float64)
        reward_adv = np.zeros_like(reward_array, dtype=np.float64)
        for group_id in np.unique(group_indices):
            mask = group_indices == group_id
            group_rewards = reward_array[mask]
            mean = np.mean(group_rewards)
            std = max(np.std(group_rewards), 1e-6)
            reward_adv[mask] = (group_rewards - mean) / std
        all_reward_advantages.append(reward_adv * weights[key])
    combined = np.sum(all_reward_advantages, axis=0)
    bn_mean, bn_std = float(np.mean(combined)), max(float(np.std(combined)), 1e-6)
    return (combined - bn_mean) / bn_std


def unirl_group(rewards, group_labels, eps=1e-8, use_global_std=False):
    """Part.compute_advantages(scope="group") per group (the peer reshapes contiguous equal groups to
    [G, branch]; here each group is gathered by label): finite-only population statistics, a group of
    one finite reward has std 1, ``centered / (std + eps)``; ``use_global_std``: finite_mean_std of the
    whole batch (population; one value: std 1)."""
    r = np.asarray(rewards, dtype=np.float64)
    labels = np.asarray(group_labels)
    out = np.zeros_like(r)
    if use_global_std:
        std_all = np.std(r) if r.size > 1 else 1.0
    for label in np.unique(labels):
        mask = labels == label
        g = r[mask]
        mean = g.sum() / max(g.size, 1)
        centered = g - mean
        std = np.sqrt((centered * centered).sum() / max(g.size, 1)) if g.size > 1 else 1.0
        out[mask] = centered / ((std_all if use_global_std else std) + eps)
    return out


def unirl_global(rewards, eps=1e-8):
    """Part.compute_advantages(scope="global"): finite_mean_std (population) of the batch."""
    r = np.asarray(rewards, dtype=np.float64)
    std = np.std(r) if r.size > 1 else 1.0
    return (r - r.mean()) / (std + eps)


def unirl_gdpo(components, weights, group_labels, eps=1e-8):
    """PR 271, as its description states it: A_k = the group step per dimension, A_sum = sum_k w_k A_k,
    then (A_sum - mean) / (std + eps) over the batch (std read as finite_mean_std's, population)."""
    a_sum = sum(w * unirl_group(components[k], group_labels, eps) for k, w in weights.items())
    std = np.std(a_sum) if a_sum.size > 1 else 1.0
    return (a_sum - a_sum.mean()) / (std + eps)


# ---- the layouts --------------------------------------------------------------------------------

def layout(seed, sizes=(4, 1, 7, 3, 4, 2), num_rewards=3):
    """Shuffled samples of groups of uneven sizes (a singleton among them), with sparse negative ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), pid) for n, pid in zip(sizes, (17, -5, 3, 1000, 0, 42))])
    perm = torch.randperm(len(ids), generator=g)
    ids = ids[perm]
    scales = torch.tensor([1.0, 0.05, 7.0, 2.0])[:num_rewards]
    rewards = torch.randn(len(ids), num_rewards, generator=g, dtype=torch.float64) * scales + torch.arange(num_rewards)
    return rewards.float(), ids


def np64(t):
    return t.detach().double().cpu().numpy()


def close(ours, ref):
    """max |ours - ref| within the rounding of ours' dtype: half an ulp, 2^-24 |x| in float32."""
    ref = np.asarray(ref, dtype=np.float64)
    diff = float(np.max(np.abs(np64(ours) - ref)))
    bound = 1e-12 if ours.dtype == torch.float64 else float(np.max(np.abs(ref))) * 2.0 ** -24 + 1e-12
    assert diff <= bound, (diff, bound)
    return diff


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("global_std", [False, True])
def test_group_advantages_is_flow_grpo_tracker(seed, global_std):
    rewards, ids = layout(seed, num_rewards=1)
    r = rewards[:, 0]
    ours = A.group_advantages(r, ids, std="global" if global_std else "group", **A.PEER_OPTIONS["flow_grpo"])
    assert ours.dtype == torch.float32 and ours.shape == r.shape
    close(ours, flow_grpo_tracker(np64(ids), np64(r), global_std))
    # the defaults are Flow-GRPO's
    assert torch.equal(ours, A.group_advantages(r, ids, std="global" if global_std else "group"))


def test_group_advantages_batch_centering_is_flow_grpo_without_tracking():
    rewards, ids = layout(3, num_rewards=1)
    r = rewards[:, 0]
    ours = A.group_advantages(r, torch.zeros_like(ids), std="global")
    close(ours, flow_grpo_no_tracking(np64(r)))


@pytest.mark.parametrize("seed", SEEDS)
def test_sum_then_normalize_is_flow_grpo_multi_score_then_tracker(seed):
    rewards, ids = layout(seed)
    weights = {"pickscore": 1.0, "ocr": 0.3, "aesthetic": 2.5}
    named = {k: rewards[:, i] for i, k in enumerate(weights)}
    ours = A.multi_reward_advantages(named, ids, weights=weights, combine="sum_then_normalize")
    avg = flow_grpo_multi_score({k: np64(v) for k, v in named.items()}, weights)
    close(ours, flow_grpo_tracker(np64(ids), avg))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("global_std", [False, True])
def test_sum_then_normalize_is_flow_factory_weighted_sum(seed, global_std):
    rewards, ids = layout(seed)
    weights = {"a": 0.7, "b": 3.0, "c": -0.5}
    named = {k: rewards[:, i] for i, k in enumerate(weights)}
    ours = A.multi_reward_advantages(named, ids, weights=weights, combine="sum_then_normalize",
                                     std="global" if global_std else "group", **A.PEER_OPTIONS["flow_factory"])
    ref = flow_factory_sum({k: np64(v) for k, v in named.items()}, weights, np64(ids).astype(np.int64), global_std)
    close(ours, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_normalize_then_sum_is_flow_factory_gdpo(seed):
    rewards, ids = layout(seed)
    weights = {"a": 1.0, "b": 0.5, "c": 2.0}
    named = {k: rewards[:, i] for i, k in enumerate(weights)}
    ours = A.multi_reward_advantages(named, ids, weights=weights, **A.PEER_OPTIONS["flow_factory"])
    ref = flow_factory_gdpo({k: np64(v) for k, v in named.items()}, weights, np64(ids).astype(np.int64))
    close(ours, ref)
    close(A.multi_reward_advantages({k: v.double() for k, v in named.items()}, ids, weights=weights,
                                    **A.PEER_OPTIONS["flow_factory"]), ref)  # float64 in: to 1e-12
    # the same from a [B, R] tensor and a weight tensor
    as_tensor = A.multi_reward_advantages(rewards, ids, weights=torch.tensor([1.0, 0.5, 2.0]),
                                          **A.PEER_OPTIONS["flow_factory"])
    assert torch.equal(as_tensor, ours)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("use_global_std", [False, True])
def test_group_advantages_is_unirl_part_compute_advantages(seed, use_global_std):
    rewards, ids = layout(seed, num_rewards=1)
    r = rewards[:, 0]
    ours = A.group_advantages(r, ids, std="global" if use_global_std else "group", **A.PEER_OPTIONS["unirl"])
    close(ours, unirl_group(np64(r), np64(ids), use_global_std=use_global_std))
    scope_global = A.group_advantages(r, torch.zeros_like(ids), std="global", **A.PEER_OPTIONS["unirl"])
    close(scope_global, unirl_global(np64(r)))


@pytest.mark.parametrize("seed", SEEDS)
def test_normalize_then_sum_is_unirl_pr271_gdpo(seed):
    rewards, ids = layout(seed)
    weights = {"vq": 1.0, "mq": 0.25, "ta": 1.5}
    named = {k: rewards[:, i] for i, k in enumerate(weights)}
    ours = A.multi_reward_advantages(named, ids, weights=weights, **A.PEER_OPTIONS["unirl"])
    close(ours, unirl_gdpo({k: np64(v) for k, v in named.items()}, weights, np64(ids)))


def test_singleton_and_constant_groups_give_zero():
    r = torch.tensor([3.0, 1.0, 1.0, 1.0, 2.0, 5.0])
    ids = torch.tensor([9, 4, 4, 4, 7, 7])  # 9: a singleton; 4: all equal
    for peer, options in A.PEER_OPTIONS.items():
        for unbiased in (False, True):
            adv = A.group_advantages(r, ids, **{**options, "unbiased": unbiased})
            assert torch.equal(adv[:4], torch.zeros(4)), (peer, unbiased, adv)
            assert bool(torch.isfinite(adv).all())


def test_unbiased_is_the_n_minus_1_std():
    r, ids = layout(5, num_rewards=1)
    r = r[:, 0]
    ours = A.group_advantages(r, ids, unbiased=True, eps=1e-8)
    x, g = np64(r), np64(ids)
    ref = np.zeros_like(x)
    for label in np.unique(g):
        m = g == label
        std = np.std(x[m], ddof=1) if m.sum() > 1 else 0.0
        ref[m] = (x[m] - x[m].mean()) / (std + 1e-8)
    close(ours, ref)


def test_std_none_centers_only_and_weights_apply_where_the_peers_apply_them():
    r, ids = layout(6)
    centered = A.group_advantages(r[:, 0], ids, std=None)
    x, g = np64(r[:, 0]), np64(ids)
    close(centered, np.array([v - x[g == k].mean() for v, k in zip(x, g)]))
    # sum-then-normalize is invariant to a common weight scale; normalize-then-sum without the batch step
    # scales with it (weights after normalizing)
    w = torch.tensor([1.0, 2.0, 0.5])
    s1 = A.multi_reward_advantages(r, ids, weights=w, combine="sum_then_normalize", eps_mode="max", eps=1e-12)
    s3 = A.multi_reward_advantages(r, ids, weights=3 * w, combine="sum_then_normalize", eps_mode="max", eps=1e-12)
    assert float((s1 - s3).abs().max()) <= TOL
    n1 = A.multi_reward_advantages(r, ids, weights=w, batch_norm=False)
    n3 = A.multi_reward_advantages(r, ids, weights=3 * w, batch_norm=False)
    assert float((3 * n1 - n3).abs().max()) <= 3 * TOL


def test_one_reward_gdpo_without_batch_step_is_group_advantages():
    r, ids = layout(7, num_rewards=1)
    assert torch.equal(A.multi_reward_advantages(r, ids, batch_norm=False), A.group_advantages(r[:, 0], ids))


def test_order_does_not_matter():
    r, ids = layout(8)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    adv = A.multi_reward_advantages(r, ids)
    assert float((A.multi_reward_advantages(r[perm], ids[perm]) - adv[perm]).abs().max()) <= TOL
    # relabelling the groups changes nothing
    assert torch.equal(A.group_advantages(r[:, 0], ids * 3 - 11), A.group_advantages(r[:, 0], ids))


def test_dense_groups_numbers_the_ids_in_sorted_order():
    ids = torch.tensor([5, -2, 5, 9, -2, 100, 5])
    assert torch.equal(A.dense_groups(ids), torch.tensor([1, 0, 1, 2, 0, 3, 1]))
    assert A.dense_groups(torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_empty_batch_gives_an_empty_result():
    empty = torch.zeros(0)
    ids = torch.zeros(0, dtype=torch.long)
    for std in A.STD_MODES:
        out = A.group_advantages(empty, ids, std=std)
        assert out.shape == (0,) and out.dtype == torch.float32
    assert A.multi_reward_advantages(torch.zeros(0, 2), ids).shape == (0,)
    assert A.multi_reward_advantages({"a": empty, "b": empty}, ids, combine="sum_then_normalize").shape == (0,)


def test_dtypes():
    r, ids = layout(9, num_rewards=1)
    assert A.group_advantages(r[:, 0].double(), ids).dtype == torch.float64
    assert A.group_advantages(r[:, 0].bfloat16(), ids).dtype == torch.float32
    assert A.group_advantages(r[:, 0], ids.int()).dtype == torch.float32  # any integer dtype of ids


def test_nan_propagates_to_its_group_only():
    r = torch.tensor([1.0, float("nan"), 2.0, 3.0, 4.0])
    ids = torch.tensor([0, 0, 1, 1, 1])
    adv = A.group_advantages(r, ids)
    assert bool(adv[:2].isnan().all()) and bool(torch.isfinite(adv[2:]).all())
    assert bool(A.group_advantages(r, ids, std="global").isnan()[2:].all())


def test_nan_in_the_gdpo_batch_step_reaches_the_whole_batch():
    """docs/losses.md: a non-finite reward makes the whole batch NaN through the GDPO batch step, its
    group only without it."""
    r = torch.tensor([[1.0, 0.5], [float("nan"), 0.0], [2.0, 1.0], [3.0, 2.0], [4.0, 0.0]])
    ids = torch.tensor([0, 0, 1, 1, 1])
    assert bool(A.multi_reward_advantages(r, ids).isnan().all())
    adv = A.multi_reward_advantages(r, ids, batch_norm=False)
    assert bool(adv[:2].isnan().all()) and bool(torch.isfinite(adv[2:]).all())


@pytest.mark.parametrize("call, error, words", [
    (lambda: A.group_advantages([1.0, 2.0], torch.tensor([0, 0])), TypeError, "rewards"),
    (lambda: A.group_advantages(torch.tensor([1, 2]), torch.tensor([0, 0])), TypeError, "rewards"),
    (lambda: A.group_advantages(torch.ones(2, 1), torch.tensor([0, 0])), ValueError, "rewards"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([0.0, 1.0])), TypeError, "group_index"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([True, False])), TypeError, "group_index"),
    (lambda: A.group_advantages(torch.ones(2), [0, 1]), TypeError, "group_index"),
    (lambda: A.group_advantages(torch.ones(3), torch.tensor([0, 1])), ValueError, "group_index"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([0, 1]), std="batch"), ValueError, "std"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([0, 1]), eps=0.0), ValueError, "eps"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([0, 1]), eps_mode="clip"), ValueError, "eps_mode"),
    (lambda: A.group_advantages(torch.ones(2), torch.tensor([0, 1]), unbiased=1), TypeError, "unbiased"),
    (lambda: A.multi_reward_advantages(torch.ones(2), torch.tensor([0, 1])), ValueError, "rewards"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 0), torch.tensor([0, 1])), ValueError, "rewards"),
    (lambda: A.multi_reward_advantages({}, torch.tensor([0, 1])), ValueError, "rewards"),
    (lambda: A.multi_reward_advantages({"a": torch.ones(2), "b": torch.ones(3)}, torch.tensor([0, 1])),
     ValueError, "rewards['b']"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), weights=[1.0]), ValueError, "weights"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), weights=[1.0, math.nan]),
     ValueError, "weights"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), weights=torch.ones(3)),
     ValueError, "weights"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), weights={"a": 1.0}),
     TypeError, "weights"),
    (lambda: A.multi_reward_advantages({"a": torch.ones(2)}, torch.tensor([0, 1]), weights={"b": 1.0}),
     ValueError, "weights"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), combine="gdpo"), ValueError, "combine"),
    (lambda: A.multi_reward_advantages(torch.ones(2, 2), torch.tensor([0, 1]), batch_norm=1), TypeError, "batch_norm"),
])
def test_bad_inputs_name_the_argument(call, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_no_host_sync(monkeypatch):
    """No call reads a tensor's value on the host: every way to do so raises during the calls."""
    r, ids = layout(10)
    named = {"a": r[:, 0], "b": r[:, 1], "c": r[:, 2]}

    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, refuse)
        for std in A.STD_MODES:
            A.group_advantages(r[:, 0], ids, std=std)
            A.multi_reward_advantages(r, ids, std=std, weights=torch.tensor([1.0, 2.0, 3.0]))
            A.multi_reward_advantages(named, ids, std=std, weights={"a": 1.0, "b": 2.0, "c": 3.0},
                                      combine="sum_then_normalize", **A.PEER_OPTIONS["flow_factory"])


def test_the_module_has_no_host_reads():
    tree = ast.parse((ROOT / "flowrl" / "advantages.py").read_text())
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not calls & {"item", "tolist", "numpy", "cpu", "unique", "nonzero", "bincount"}


def test_compiles_without_graph_breaks():
    r, ids = layout(11)
    fn = torch.compile(A.multi_reward_advantages, fullgraph=True, backend="eager")
    assert torch.equal(fn(r, ids), A.multi_reward_advantages(r, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_matches_cpu_without_a_sync():
    r, ids = layout(12)
    cpu = A.multi_reward_advantages(r, ids)
    r_gpu, ids_gpu, w_gpu = r.cuda(), ids.cuda(), torch.ones(3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        gpu = A.multi_reward_advantages(r_gpu, ids_gpu, weights=w_gpu)
        one = A.group_advantages(r_gpu[:, 0], ids_gpu, std="global")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gpu.device.type == "cuda" and float((gpu.cpu() - cpu).abs().max()) <= TOL
    assert float((one.cpu() - A.group_advantages(r[:, 0], ids, std="global")).abs().max()) <= TOL


def test_the_package_exposes_the_module_and_the_tree_advantages():
    assert flowrl.advantages is A
    from flowrl.data import tree
    assert A.depth_advantages is tree.depth_advantages and A.fork_advantages is tree.fork_advantages
