"""Branching rollouts: the tree of a rollout that forks K children from a shared prefix at chosen loop
steps, the Philox key of every node's noise, and the advantages the branching methods compute from the
leaves' rewards (docs/branching.md).

Layout. A branching trajectory is an ordinary ``RolloutTrajectory`` whose rows are the tree's leaves,
each row the whole root-to-leaf path (so ``step_inputs`` / ``step_log_prob`` recompute every row as
they recompute any rollout); ``traj.tree`` (a ``BranchTree``) says which rows share which node at
each step. A *node* is ``(sample, branch path)``: a root per sample (path ``()``), and each fork at
loop step ``s`` gives each node alive there ``k`` children with paths ``path + (c,)``,
``c = 0 .. k - 1``. Node ``m`` drives the loop steps from ``fork_step[m]`` up to its children's fork
step (the last step for a leaf); rows under one node at step ``j`` share ``latents[:, j]``, the noise
and hence ``latents[:, j + 1]``.

Noise keying (docs/contract.md, Noise). Loop step ``j`` of node ``(sample, path)`` draws its noise with
``sde_step(noise_seed=key)`` (a per-sample seed: Philox stream 0, key = the seed's 64 bits), where

    key = node_key(seed, sample, path, j):  h = 0; for w in (seed, sample, j, len(path), *path):
                                             h = splitmix64(h ^ w)   (mod 2**64), read as an int64

a pure function on the host, the same for both backends: a node's noise depends on nothing else (not
the batch, not the other nodes), so any node can be replayed alone, and the steps before the first fork
(path ``()``) draw the same noise whatever forks follow.

Advantages (tensors [N, T] over rows and loop steps, with a mask of the edges to train, one row per
(node, step)): ``depth_advantages`` is BranchGRPO's depth-wise normalization (on the leaf means, or on
its probability-weighted reward fusion, ``node_rewards(..., log_probs)``),
``fork_advantages`` TempFlow-GRPO's per-step credit at the forks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..contract import NOISE_STREAM_VERSION

MASK64 = (1 << 64) - 1
_FIELDS = ("parent", "fork_step", "child", "sample", "leaf")


def splitmix64(x: int) -> int:
    """One SplitMix64 output (Steele, Lea, Flood 2014; Vigna's splitmix64.c) for the state ``x``:
    ``z = x + 0x9E3779B97F4A7C15``, then the two xor-shift-multiplies and the final xor-shift, mod 2**64."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def node_key(seed: int, sample: int, path: Sequence[int], step: int) -> int:
    """The int64 Philox key of loop step ``step`` of node ``(sample, path)`` under the rollout's
    ``seed``: SplitMix64 folded over the words (seed, sample, step, len(path), *path), each taken mod
    2**64, read back as a two's-complement int64 (``sde_step``'s per-sample ``noise_seed``)."""
    h = 0
    for word in (seed, sample, step, len(path), *path):
        h = splitmix64(h ^ (int(word) & MASK64))
    return h - (1 << 64) if h >> 63 else h


def _int(name: str, value, low: int = 0, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}]; got {int(value)}")
    return int(value)


def _ints(name: str, values) -> Tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints; got {values.dtype} "
                            f"{tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints; got {type(values).__name__}")
    return tuple(_int(f"{name}[{i}]", v, 0, 2**63 - 1) for i, v in enumerate(values))


@dataclass(frozen=True)
class BranchSpec:
    """Where a rollout forks: ``steps`` (strictly increasing loop steps) and ``k`` (children per fork:
    one int for every fork, or one per step), the noise ``seed`` (an int in [0, 2**63)), and
    ``sample_ids`` (the ``sample`` word of each root's key; None: 0 .. B - 1, the root's row). A
    sample's noise depends on its id only, so give global ids to make it independent of the batch."""

    steps: Tuple[int, ...]
    k: Union[int, Tuple[int, ...]] = 2
    seed: int = 0
    sample_ids: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        steps = _ints("branch.steps", self.steps)
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"branch.steps must be strictly increasing; got {list(steps)}")
        if isinstance(self.k, Integral) and not isinstance(self.k, bool):
            k = (_int("branch.k", self.k, 1),) * len(steps)
        else:
            k = _ints("branch.k", self.k)
            if len(k) != len(steps):
                raise ValueError(f"branch.k must be an int or one int per fork step ({len(steps)}); got {len(k)}")
            if any(c < 1 for c in k):
                raise ValueError(f"branch.k entries must be >= 1; got {list(k)}")
        seed = _int("branch.seed", self.seed, 0, 2**63 - 1)
        ids = None if self.sample_ids is None else _ints("branch.sample_ids", self.sample_ids)
        if ids is not None and len(set(ids)) != len(ids):
            raise ValueError("branch.sample_ids must be distinct (two roots with one id would draw the same noise)")
        for name, value in (("steps", steps), ("k", k), ("seed", seed), ("sample_ids", ids)):
            object.__setattr__(self, name, value)

    @property
    def leaves_per_sample(self) -> int:
        n = 1
        for c in self.k:
            n *= c
        return n

    def tree(self, num_roots: int) -> "BranchTree":
        """The tree of ``num_roots`` samples: nodes level by level (roots, then each fork's children,
        parent-major), its leaves in that order (the rows, as ``repeat_interleave`` at each fork
        orders them)."""
        num_roots = _int("num_roots", num_roots, 1)
        ids = list(range(num_roots)) if self.sample_ids is None else list(self.sample_ids)
        if len(ids) != num_roots:
            raise ValueError(f"branch.sample_ids has {len(ids)} ids for {num_roots} samples")
        parent, fork_step, child, sample = [-1] * num_roots, [0] * num_roots, [0] * num_roots, ids[:]
        level = list(range(num_roots))
        for step, k in zip(self.steps, self.k):
            nxt = []
            for m in level:
                for c in range(k):
                    nxt.append(len(parent))
                    parent.append(m)
                    fork_step.append(step)
                    child.append(c)
                    sample.append(sample[m])
            level = nxt

        def t(v):
            return torch.tensor(v, dtype=torch.int64)

        return BranchTree(t(parent), t(fork_step), t(child), t(sample), t(level), self.seed)

    def tree_for_rows(self, num_rows: int) -> "BranchTree":
        """The tree whose leaves are ``num_rows`` rows (a pipeline run with every leaf from the start):
        ``num_rows / leaves_per_sample`` samples, rows ``b * L .. (b + 1) * L - 1`` under sample b."""
        per = self.leaves_per_sample
        if num_rows % per:
            raise ValueError(f"branch: the batch of {num_rows} rows is not a whole number of trees of "
                             f"{per} leaves (k = {list(self.k)}); run B * {per} rows, each sample's leaves adjacent")
        return self.tree(num_rows // per)


@dataclass
class BranchTree:
    """The tree of a branching trajectory (int64 CPU tensors; M nodes, N rows):

    parent [M]: the parent node, -1 for a root; a parent comes before its children.
    fork_step [M]: the loop step at which the node forked (its first step; 0 for a root).
    child [M]: the node's index among its siblings (the last entry of its branch path; 0 for a root).
    sample [M]: the ``sample`` word of its root's key (``BranchSpec.sample_ids``).
    leaf [N]: each trajectory row's leaf node.
    seed: the rollout's noise seed.
    """

    parent: torch.Tensor
    fork_step: torch.Tensor
    child: torch.Tensor
    sample: torch.Tensor
    leaf: torch.Tensor
    seed: int

    @property
    def num_nodes(self) -> int:
        return int(self.parent.numel())

    @property
    def num_rows(self) -> int:
        return int(self.leaf.numel())

    def path(self, m: int) -> Tuple[int, ...]:
        """Node ``m``'s branch path: its child indices from the root down (``()`` for a root)."""
        out = []
        while int(self.parent[m]) >= 0:
            out.append(int(self.child[m]))
            m = int(self.parent[m])
        return tuple(reversed(out))

    def ancestors(self, m: int) -> List[int]:
        """Node ``m`` and its ancestors, root first."""
        out = [m]
        while int(self.parent[out[-1]]) >= 0:
            out.append(int(self.parent[out[-1]]))
        return out[::-1]

    def row_nodes(self, num_steps: int) -> torch.Tensor:
        """int64 [N, T]: the node that drives loop step ``j`` of row ``n`` (the deepest ancestor of
        the row's leaf whose fork step is ``<= j``)."""
        out = torch.empty(self.num_rows, num_steps, dtype=torch.int64)
        fork = self.fork_step.tolist()
        for n, leaf in enumerate(self.leaf.tolist()):
            chain = self.ancestors(leaf)
            for j in range(num_steps):
                out[n, j] = [m for m in chain if fork[m] <= j][-1]
        return out

    def keys(self, num_steps: int) -> torch.Tensor:
        """int64 [T, N]: ``node_key`` of each row's node at each loop step (``sde_step``'s
        ``noise_seed`` for step j is ``keys[j]``)."""
        nodes = self.row_nodes(num_steps)
        cache: Dict[Tuple[int, int], int] = {}
        out = torch.empty(num_steps, self.num_rows, dtype=torch.int64)
        sample = self.sample.tolist()
        for n in range(self.num_rows):
            for j in range(num_steps):
                m = int(nodes[n, j])
                if (m, j) not in cache:
                    cache[(m, j)] = node_key(self.seed, sample[m], self.path(m), j)
                out[j, n] = cache[(m, j)]
        return out

    def owners(self, num_steps: int) -> torch.Tensor:
        """bool [N, T]: True at the first row of each (node, step), the one edge a loss trains (the
        other rows under that node hold the same transition)."""
        nodes = self.row_nodes(num_steps)
        out = torch.zeros(nodes.shape, dtype=torch.bool)
        for j in range(num_steps):
            seen = set()
            for n, m in enumerate(nodes[:, j].tolist()):
                if m not in seen:
                    seen.add(m)
                    out[n, j] = True
        return out

    def select_row(self, n: int) -> "BranchTree":
        """The tree of row ``n`` alone: its root-to-leaf chain, with the same forks, child indices and
        samples, so its keys (its noise) are the row's keys in the whole tree."""
        chain = self.ancestors(int(self.leaf[n]))

        def pick(t):
            return t[chain].clone()

        parent = torch.arange(-1, len(chain) - 1, dtype=torch.int64)
        return BranchTree(parent, pick(self.fork_step), pick(self.child), pick(self.sample),
                          torch.tensor([len(chain) - 1], dtype=torch.int64), self.seed)

    # ------------------------------------------------------------------ checks, wire
    def to_tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors the wire format and files carry: the fields, the seed and the Philox noise
        stream version the keys drew from (``flowrl.contract.NOISE_STREAM_VERSION``; 0-d int64 each)."""
        out = {name: getattr(self, name) for name in _FIELDS}
        out["seed"] = torch.tensor(self.seed, dtype=torch.int64)
        out["noise_stream"] = torch.tensor(NOISE_STREAM_VERSION, dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, tensors: Dict[str, torch.Tensor], num_rows: int, num_steps: int,
                     where: str = "tree") -> "BranchTree":
        """Rebuild and check a tree from ``to_tensors``' dict (untrusted: every rule of ``check``)."""
        expected = set(_FIELDS) | {"seed", "noise_stream"}
        if isinstance(tensors, dict) and set(tensors) == expected - {"noise_stream"}:
            # recorded before the stream was versioned: stream 1, whose noise these keys no longer draw
            raise ValueError(f"{where}: recorded with Philox noise stream 1 (no 'noise_stream'); flowrl now draws "
                             f"stream {NOISE_STREAM_VERSION}, so its node keys would replay different noise")
        if not isinstance(tensors, dict) or set(tensors) != expected:
            got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise ValueError(f"{where}: must hold exactly {sorted(expected)}; got {got}")
        seed = tensors["seed"]
        if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.dim() != 0 or int(seed) < 0:
            raise ValueError(f"{where}: seed must be a 0-d int64 tensor in [0, 2**63)")
        stream = tensors["noise_stream"]
        if not isinstance(stream, torch.Tensor) or stream.dtype != torch.int64 or stream.dim() != 0:
            raise ValueError(f"{where}: noise_stream must be a 0-d int64 tensor")
        if int(stream) != NOISE_STREAM_VERSION:
            raise ValueError(f"{where}: recorded with Philox noise stream {int(stream)}; flowrl draws stream "
                             f"{NOISE_STREAM_VERSION}, so its node keys would replay different noise")
        tree = cls(**{name: tensors[name] for name in _FIELDS}, seed=int(seed))
        tree.check(num_rows, num_steps, where)
        return tree

    def check(self, num_rows: int, num_steps: int, where: str = "tree") -> "BranchTree":
        """Raise ``ValueError`` (prefixed by ``where``) unless this is a tree of ``num_rows`` leaf rows
        over ``num_steps`` loop steps: parents before children, roots at step 0 with child 0 and
        distinct samples; siblings forked at one step, after their parent's (or at a root's step 0),
        with child indices 0 .. k - 1 and their parent's sample; every leaf (a node without children) exactly one
        row's."""
        def fail(msg):
            raise ValueError(f"{where}: {msg}")

        for name in _FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                fail(f"{name} must be a 1-D int64 tensor; got "
                     f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        for name in _FIELDS:
            setattr(self, name, getattr(self, name).cpu())
        m = self.num_nodes
        if m == 0 or any(getattr(self, name).numel() != m for name in _FIELDS[:4]):
            fail(f"parent, fork_step, child and sample must have one entry per node (M >= 1); got "
                 f"{[getattr(self, name).numel() for name in _FIELDS[:4]]}")
        if self.leaf.numel() != num_rows:
            fail(f"leaf must have one entry per trajectory row ({num_rows}); got {self.leaf.numel()}")
        if m > num_rows * (num_steps + 1):  # each row's chain has at most T + 1 nodes (bounds the loops below)
            fail(f"a tree of {num_rows} rows over {num_steps} steps has at most {num_rows * (num_steps + 1)} nodes; got {m}")
        parent, fork, child, sample = (getattr(self, n).tolist() for n in _FIELDS[:4])
        if any(not -1 <= p < i for i, p in enumerate(parent)):
            fail("parent[m] must be -1 (a root) or a node before m")
        if any(not 0 <= s < num_steps for s in fork):
            fail(f"fork_step values must be loop steps in [0, {num_steps - 1}]")
        if any(s < 0 for s in sample):
            fail("sample ids must be >= 0")
        roots = [i for i, p in enumerate(parent) if p < 0]
        if any(fork[i] != 0 or child[i] != 0 for i in roots):
            fail("a root must have fork_step 0 and child 0")
        if len({sample[i] for i in roots}) != len(roots):
            fail("roots must have distinct sample ids")
        children: Dict[int, List[int]] = {}
        for i, p in enumerate(parent):
            if p >= 0:
                children.setdefault(p, []).append(i)
                if sample[i] != sample[p] or fork[i] < fork[p] or (fork[i] == fork[p] and parent[p] >= 0):
                    fail(f"node {i} must have its parent's sample and a fork step after its parent's (or equal to "
                         "a root's: a fork at step 0)")
        for p, kids in children.items():
            if len({fork[i] for i in kids}) != 1 or sorted(child[i] for i in kids) != list(range(len(kids))):
                fail(f"the children of node {p} must fork at one step with child indices 0 .. {len(kids) - 1}")
        leaves = [i for i in range(m) if i not in children]
        rows = self.leaf.tolist()
        if sorted(rows) != leaves:
            fail("leaf must list every leaf node (a node without children) exactly once")
        return self


class TreeAdvantages(NamedTuple):
    """Per-row, per-step advantages (float [N, T]) and the edges to train (bool [N, T]: one row per
    (node, step) where the method assigns a value; every other entry is 0 and False)."""

    advantages: torch.Tensor
    mask: torch.Tensor


def _rewards(tree: BranchTree, rewards) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or not rewards.dtype.is_floating_point:
        raise TypeError(f"rewards must be a float tensor [N] (one per row, the leaves); got "
                        f"{rewards.dtype if isinstance(rewards, torch.Tensor) else type(rewards).__name__}")
    if rewards.shape != (tree.num_rows,):
        raise ValueError(f"rewards must have shape [N] = [{tree.num_rows}]; got {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    return rewards


def node_rewards(tree: BranchTree, rewards: torch.Tensor, log_probs: Optional[torch.Tensor] = None, *,
                 alpha: float = 1.0) -> torch.Tensor:
    """[M] each node's reward, computed in float64 and returned in the rewards' dtype (at least float32).
    ``rewards``: [N], one per row (its leaf's).

    ``log_probs=None``: the mean of the node's leaf descendants' rewards (BranchGRPO's
    ``compute_node_rewards_from_leaves``, its uniform form). ``log_probs`` given (float [N, T], the
    trajectory's ``log_probs``): BranchGRPO's reward fusion (its ``use_prob_weighted=True``), bottom up: a
    node's reward is ``sum_c softmax_c(alpha * lp_c) R_c`` over its children c, with ``lp_c`` the log-prob
    of the step child c forked at (the transition that made the siblings differ: ``log_probs[n, s]`` of a
    row n under c, s = c's fork step) and ``R_c`` the child's fused reward; a single child passes its
    reward on. ``alpha``: their temperature coefficient (1.0 in their code)."""
    rewards = _rewards(tree, rewards)
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    if log_probs is None:
        total = torch.zeros(tree.num_nodes, dtype=torch.float64)
        count = torch.zeros(tree.num_nodes, dtype=torch.float64)
        for n, leaf in enumerate(tree.leaf.tolist()):
            for m in tree.ancestors(leaf):
                total[m] += float(rewards[n])
                count[m] += 1
        return (total / count).to(out_dtype)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise TypeError(f"alpha must be a finite real number; got {alpha!r}")
    if not isinstance(log_probs, torch.Tensor) or not log_probs.dtype.is_floating_point:
        raise TypeError("log_probs must be a float tensor [N, T] (the trajectory's log_probs), or None")
    if log_probs.dim() != 2 or log_probs.shape[0] != tree.num_rows:
        raise ValueError(f"log_probs must have shape [N, T] with N = {tree.num_rows} rows; got "
                         f"{tuple(log_probs.shape)}")
    num_steps = log_probs.shape[1]
    if int(tree.fork_step.max()) >= num_steps:
        raise ValueError(f"log_probs has {num_steps} steps but the tree forks at step {int(tree.fork_step.max())}")
    lp = log_probs.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(lp).all()):
        raise ValueError("log_probs must be finite")
    fork, parent = tree.fork_step.tolist(), tree.parent.tolist()
    edge: Dict[int, float] = {}  # a forked node's log-prob at its fork step, the same on every row under it
    for n in range(tree.num_rows):
        for m in tree.ancestors(int(tree.leaf[n])):
            if parent[m] < 0:
                continue
            value = float(lp[n, fork[m]])
            if edge.setdefault(m, value) != value:
                raise ValueError(f"log_probs: the rows under node {m} differ at its fork step {fork[m]}; pass the "
                                 "trajectory's log_probs (rows under one node share that transition)")
    reward = torch.zeros(tree.num_nodes, dtype=torch.float64)
    for n, leaf in enumerate(tree.leaf.tolist()):
        reward[leaf] = float(rewards[n])
    children: Dict[int, List[int]] = {}
    for m, p in enumerate(parent):
        if p >= 0:
            children.setdefault(p, []).append(m)
    for m in reversed(range(tree.num_nodes)):  # children come after their parent: bottom up
        kids = children.get(m)
        if kids:
            w = torch.softmax(alpha * torch.tensor([edge[c] for c in kids], dtype=torch.float64), dim=0)
            reward[m] = (w * reward[kids]).sum()
    return reward.to(out_dtype)


def _per_step(tree: BranchTree, values: torch.Tensor, num_steps: int, where) -> TreeAdvantages:
    """Scatter per-(node, step) values ``where`` [M, T] (None: not assigned) onto the owner rows."""
    nodes, owners = tree.row_nodes(num_steps), tree.owners(num_steps)
    adv = torch.zeros(tree.num_rows, num_steps, dtype=values.dtype)
    mask = torch.zeros(tree.num_rows, num_steps, dtype=torch.bool)
    for n in range(tree.num_rows):
        for j in range(num_steps):
            m = int(nodes[n, j])
            if where[m][j]:
                adv[n, j] = values[m, j]
                mask[n, j] = bool(owners[n, j])
    return TreeAdvantages(adv, mask)


def depth_advantages(tree: BranchTree, rewards: torch.Tensor, num_steps: int, *, eps: float = 1e-8,
                     min_std: float = 1e-6, log_probs: Optional[torch.Tensor] = None,
                     alpha: float = 1.0) -> TreeAdvantages:
    """BranchGRPO's depth-wise normalization (``compute_hierarchical_advantages_by_depth``): in each
    sample's tree, at each loop step j, the distinct nodes that drive step j (BranchGRPO's nodes of
    depth j + 1) with their rewards (``node_rewards``) are normalized, ``(r - mean) / (std + eps)``,
    std the unbiased (n - 1) one; 0 where the step has one node or ``std < min_std``. Every row gets
    its node's value; ``mask`` marks one row per (node, step). ``log_probs`` / ``alpha``: the node
    rewards are BranchGRPO's reward fusion (``node_rewards``) instead of the leaf means."""
    rewards = _rewards(tree, rewards)
    if log_probs is not None and log_probs.shape[-1:] != (num_steps,):
        raise ValueError(f"log_probs must have shape [N, T] with T = num_steps = {num_steps}; got "
                         f"{tuple(log_probs.shape)}")
    r = node_rewards(tree, rewards, log_probs, alpha=alpha).to(torch.float64)
    nodes = tree.row_nodes(num_steps)
    sample = tree.sample.tolist()
    values = torch.zeros(tree.num_nodes, num_steps, dtype=torch.float64)
    for j in range(num_steps):
        groups: Dict[int, List[int]] = {}
        for m in dict.fromkeys(nodes[:, j].tolist()):
            groups.setdefault(sample[m], []).append(m)
        for members in groups.values():
            if len(members) < 2:
                continue
            g = r[members]
            std = g.std()
            if std >= min_std:
                values[members, j] = (g - g.mean()) / (std + eps)
    assigned = [[True] * num_steps for _ in range(tree.num_nodes)]
    out = _per_step(tree, values, num_steps, assigned)
    return TreeAdvantages(out.advantages.to(torch.promote_types(rewards.dtype, torch.float32)), out.mask)


def fork_advantages(tree: BranchTree, rewards: torch.Tensor, num_steps: int, *, groups=None,
                    eps: float = 1e-4) -> TreeAdvantages:
    """TempFlow-GRPO's per-step credit at the forks (its per-prompt ``PerPromptStatTracker`` on the
    [rows, steps] rewards of the branches it forks at each step): each node forked at step s > its
    parent's, with its reward (``node_rewards``), is normalized against the nodes forked at step s in
    its group, ``(r - mean) / (std + eps)``, std the population (n) one; the value goes to step s (the
    step whose noise makes the children differ) and ``mask`` marks one row per forked node there.
    ``groups``: None (each sample's tree is a group), or an int tensor [N] of group ids per row (the
    prompt: trees of one prompt form one group), the same within a tree."""
    rewards = _rewards(tree, rewards)
    r = node_rewards(tree, rewards).to(torch.float64)
    sample, parent, fork = tree.sample.tolist(), tree.parent.tolist(), tree.fork_step.tolist()
    group_of_sample: Dict[int, int] = {}
    if groups is not None:
        if not isinstance(groups, torch.Tensor) or groups.dtype.is_floating_point or groups.dtype == torch.bool:
            raise TypeError("groups must be an integer tensor [N] of group ids per row, or None")
        if groups.shape != (tree.num_rows,):
            raise ValueError(f"groups must have shape [N] = [{tree.num_rows}]; got {tuple(groups.shape)}")
        for n, leaf in enumerate(tree.leaf.tolist()):
            s, g = sample[leaf], int(groups[n])
            if group_of_sample.setdefault(s, g) != g:
                raise ValueError(f"groups must be the same on every row of a sample's tree; sample {s} has "
                                 f"{group_of_sample[s]} and {g}")
    forked: Dict[Tuple[int, int], List[int]] = {}
    for m, p in enumerate(parent):
        if p >= 0:  # every non-root node forked, at its fork step
            key = (group_of_sample.get(sample[m], sample[m]) if groups is not None else sample[m], fork[m])
            forked.setdefault(key, []).append(m)
    values = torch.zeros(tree.num_nodes, num_steps, dtype=torch.float64)
    assigned = [[False] * num_steps for _ in range(tree.num_nodes)]
    for (_, s), members in forked.items():
        g = r[members]
        values[members, s] = (g - g.mean()) / (g.std(unbiased=False) + eps)
        for m in members:
            assigned[m][s] = True
    out = _per_step(tree, values, num_steps, assigned)
    return TreeAdvantages(out.advantages.to(torch.promote_types(rewards.dtype, torch.float32)), out.mask)


__all__ = ["BranchSpec", "BranchTree", "TreeAdvantages", "splitmix64", "node_key", "node_rewards",
           "depth_advantages", "fork_advantages"]
