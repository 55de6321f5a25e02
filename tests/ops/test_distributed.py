"""Sequence parallelism on CPU: 2 and 4 gloo processes, [B, S, C] bf16 samples sharded on S.

Each spawned rank builds the same full inputs, computes the single-device result itself, and checks
that its sharded call matches: log-probs, sde_step's samples and log-probs, KL, and the gradients of
its shard, bit for bit when shard boundaries fall on chunk boundaries (to float32 rounding otherwise).
"""
import os

import pytest
import torch
import torch.distributed as dist

import flowrl
from flowrl import distributed as fd
from gloo_ranks import run_ranks
from flowrl.backends.reference import CHUNK_SIZE

pytestmark = pytest.mark.slow  # spawns gloo process groups (./run test -m 'not slow' skips it)

B, C = 3, 64  # C * rows = elements per shard; 16 rows of 64 = one 1024-element chunk
assert CHUNK_SIZE == 1024, "the splits below are sized for 1024-element chunks"

# (S, rows per rank, bit exact?) for each world size
SPLITS = {
    2: [
        (80, [48, 32], True),    # 3 + 2 chunks: ranks hold different numbers of chunks
        (83, [16, 67], True),    # only the last shard is not a whole number of chunks
        (80, [37, 43], False),   # a chunk straddles the two ranks
    ],
    4: [
        (64, [16, 16, 16, 16], True),
        (80, [32, 16, 16, 16], True),
        (83, [16, 16, 16, 35], True),
        (80, [20, 20, 20, 20], False),
    ],
}


def _inputs(S, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1234 + S)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    v = torch.randn(B, S, C, generator=g).to(dtype)
    v_ref = (v.float() + 0.1 * torch.randn(B, S, C, generator=g)).to(dtype)
    sigmas = torch.linspace(1.0, 0.0, 9, dtype=torch.float32)
    step = torch.tensor([0, 3, 6])  # per-sample steps; step 0 exercises sde's sigma = 1 rule
    weights = torch.randn(B, generator=g)  # a loss that weighs samples differently
    return x, v, v_ref, sigmas, step, weights


def _same(name, got, want, exact):
    if exact:
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name}: not bit-identical (max diff {(got.float() - want.float()).abs().max()})"
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


MODES = [("sde", "gaussian", "mean"), ("cps", "sq_err", "sum"), ("dance", "kernel", "mean")]


def _check_split(rank, S, rows, exact, modes):
    x, v, v_ref, sigmas, step, w = _inputs(S)
    lo, hi = sum(rows[:rank]), sum(rows[: rank + 1])
    shard = lambda t: t[:, lo:hi].clone()  # noqa: E731
    tag = f"S={S} rows={rows} rank={rank}"

    for mode, kind, reduction in modes:
        kw = dict(mode=mode, noise_level=0.7, log_prob_kind=kind, reduction=reduction, backend="torch")
        gens = lambda: [torch.Generator().manual_seed(7 + i) for i in range(B)]  # noqa: E731

        # rollout: sde_step with per-sample generators
        full = flowrl.sde_step(x, v, sigmas, step, generator=gens(), **kw)
        part = fd.sde_step(shard(x), shard(v), sigmas, step, generator=gens(), **kw)
        _same(f"{tag} {mode} prev_sample", part.prev_sample, full.prev_sample[:, lo:hi], True)
        _same(f"{tag} {mode} prev_sample_mean", part.prev_sample_mean, full.prev_sample_mean[:, lo:hi], True)
        _same(f"{tag} {mode} sde_step log_prob", part.log_prob, full.log_prob, exact)

        # training recompute with gradients for model_output and sample
        xf, vf = x.clone().requires_grad_(), v.clone().requires_grad_()
        lp_full = flowrl.step_log_prob(xf, vf, full.prev_sample, sigmas, step, **kw)
        (lp_full * w).sum().backward()
        xs, vs = shard(x).requires_grad_(), shard(v).requires_grad_()
        lp = fd.step_log_prob(xs, vs, part.prev_sample, sigmas, step, **kw)
        _same(f"{tag} {mode} step_log_prob", lp, lp_full, exact)
        _same(f"{tag} {mode} rollout == recompute", lp, part.log_prob, True)
        (lp * w).sum().backward()
        _same(f"{tag} {mode} grad model_output", vs.grad, vf.grad[:, lo:hi], exact)
        _same(f"{tag} {mode} grad sample", xs.grad, xf.grad[:, lo:hi], exact)

    # KL and its gradient
    kw = dict(mode="sde", noise_level=0.5, reduction="mean", backend="torch")
    vf = v.clone().requires_grad_()
    kl_full = flowrl.step_kl(x, vf, v_ref, sigmas, step, **kw)
    (kl_full * w).sum().backward()
    vs = shard(v).requires_grad_()
    kl = fd.step_kl(shard(x), vs, shard(v_ref), sigmas, step, **kw)
    _same(f"{tag} step_kl", kl, kl_full, exact)
    (kl * w).sum().backward()
    _same(f"{tag} grad kl", vs.grad, vf.grad[:, lo:hi], exact)

    # explicit noise shards, and shard sizes given up front (no count exchange)
    noise = torch.randn(B, S, C, generator=torch.Generator().manual_seed(99))
    full = flowrl.sde_step(x, v, sigmas, 2, noise=noise, backend="torch")
    part = fd.sde_step(shard(x), shard(v), sigmas, 2, noise=shard(noise), backend="torch",
                       shard_numels=[r * C for r in rows])
    _same(f"{tag} noise= prev_sample", part.prev_sample, full.prev_sample[:, lo:hi], True)
    _same(f"{tag} noise= log_prob", part.log_prob, full.log_prob, exact)
    assert fd.shard_layout(shard(x)).bit_exact == exact


def _check_triton(rank, S, rows):
    """The Triton backend (through the interpreter on CPU) calls the same gather: single-device
    Triton bits on every rank, including its own backward."""
    x, v, _, sigmas, step, w = _inputs(S)
    lo, hi = sum(rows[:rank]), sum(rows[: rank + 1])
    kw = dict(mode="sde", noise_level=0.7, backend="triton")
    gens = lambda: [torch.Generator().manual_seed(7 + i) for i in range(B)]  # noqa: E731
    full = flowrl.sde_step(x, v, sigmas, step, generator=gens(), **kw)
    part = fd.sde_step(x[:, lo:hi], v[:, lo:hi], sigmas, step, generator=gens(), **kw)
    _same("triton prev_sample", part.prev_sample, full.prev_sample[:, lo:hi], True)
    _same("triton sde_step log_prob", part.log_prob, full.log_prob, True)
    vf = v.clone().requires_grad_()
    lp_full = flowrl.step_log_prob(x, vf, full.prev_sample, sigmas, step, **kw)
    (lp_full * w).sum().backward()
    vs = v[:, lo:hi].clone().requires_grad_()
    lp = fd.step_log_prob(x[:, lo:hi], vs, part.prev_sample, sigmas, step, **kw)
    (lp * w).sum().backward()
    _same("triton step_log_prob", lp, lp_full, True)
    _same("triton grad model_output", vs.grad, vf.grad[:, lo:hi], True)


def _check_noise_seed(rank, world, backend):
    """sde_step(noise_seed=...): each rank draws only its elements of the single-device Philox noise
    (keyed by the element's index in the full sample), so its prev_sample is exactly its slice of the
    single-process one. Odd sizes: shards start off the Philox quads and off chunk boundaries."""
    S, c = 83, 5
    rows = [37, 46] if world == 2 else [20, 21, 20, 22]
    lo, hi = sum(rows[:rank]), sum(rows[: rank + 1])
    x, v, _, sigmas, step, _ = _inputs(S)
    x, v = x[..., :c].contiguous(), v[..., :c].contiguous()
    kw = dict(mode="sde", noise_level=0.7, backend=backend)
    for seed in (1234, torch.tensor([5, 6, 7])):
        full = flowrl.sde_step(x, v, sigmas, step, noise_seed=seed, **kw)
        part = fd.sde_step(x[:, lo:hi].contiguous(), v[:, lo:hi].contiguous(), sigmas, step, noise_seed=seed, **kw)
        tag = f"{backend} noise_seed={seed} rank={rank}"
        _same(f"{tag} prev_sample", part.prev_sample, full.prev_sample[:, lo:hi], True)
        _same(f"{tag} log_prob", part.log_prob, full.log_prob, False)  # shards cut inside a chunk
        lp = fd.step_log_prob(x[:, lo:hi].contiguous(), v[:, lo:hi].contiguous(), part.prev_sample, sigmas, step, **kw)
        _same(f"{tag} rollout == recompute", lp, part.log_prob, True)


def _triton_runs_here():
    if "triton" not in flowrl.available_backends():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_errors(rank, world):
    x, v, _, sigmas, _, _ = _inputs(64)
    # batch sizes that disagree across ranks: every rank raises the same ValueError
    b = B if rank else B - 1
    with pytest.raises(ValueError, match="same batch"):
        fd.step_log_prob(x[:b, :8], v[:b, :8], v[:b, :8], sigmas, 1, backend="torch")
    with pytest.raises(ValueError, match="shard_numels"):
        fd.step_log_prob(x[:, :8], v[:, :8], v[:, :8], sigmas, 1, backend="torch", shard_numels=[8 * C] * (world + 1))
    with pytest.raises(ValueError, match=r"shard_numels\[\d\]"):
        fd.step_log_prob(x[:, :8], v[:, :8], v[:, :8], sigmas, 1, backend="torch", shard_numels=[7 * C] * world)


def _check_rank(rank, world):
    for k, (S, rows, exact) in enumerate(SPLITS[world]):
        # every mode on the first split, then one mode per split (keeps the run short)
        _check_split(rank, S, rows, exact, MODES if k == 0 else [MODES[k % len(MODES)]])
    _check_noise_seed(rank, world, "torch")
    if world == 2 and _triton_runs_here():
        _check_triton(rank, 80, [48, 32])
        _check_noise_seed(rank, world, "triton")
    _check_errors(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_matches_single_device(world):
    run_ranks(_check_rank, world)


def test_needs_an_initialized_group():
    assert not dist.is_initialized()
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.step_log_prob(x, x, x, torch.linspace(1, 0, 3), 0)


def test_noise_slices_equal_single_device_noise():
    """No process group needed: the layout's noise for each rank is its slice of the full noise."""
    S = 83
    rows = [16, 16, 16, 35]
    gens = lambda: [torch.Generator().manual_seed(3 + i) for i in range(B)]  # noqa: E731
    full = flowrl.draw_noise((B, S, C), gens(), torch.device("cpu"))
    for rank in range(len(rows)):
        lo, hi = sum(rows[:rank]), sum(rows[: rank + 1])
        layout = fd.ShardLayout([r * C for r in rows], rank, None)
        assert torch.equal(layout.noise((B, hi - lo, C), gens(), torch.device("cpu")), full[:, lo:hi])
        torch.manual_seed(5)
        global_full = torch.randn(B, S, C)
        torch.manual_seed(5)
        assert torch.equal(layout.noise((B, hi - lo, C), None, torch.device("cpu")), global_full[:, lo:hi])
