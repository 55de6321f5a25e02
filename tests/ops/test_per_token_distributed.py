"""Sequence parallelism with per-token schedules and frozen masks: 2 gloo processes on CPU, [B, S, C]
bf16 samples sharded on S at a chunk boundary, each rank passing its slices of ``token_sigmas`` and
``frozen``. Counts and the rollout's samples equal one device's bit for bit; log-probs and gradients
too for the kinds without a per-token log term, the gaussian one to float32 rounding (its host log
term is summed per rank; docs/contract.md, Per-token schedules).
"""

import pytest
import torch

import flowrl
from flowrl import distributed as fd
from gloo_ranks import run_ranks

pytestmark = pytest.mark.slow  # spawns gloo process groups (./run test -m 'not slow' skips it)

B, S, C = 2, 40, 64
ROWS = [16, 24]  # 16 rows of 64 = one 1024-element chunk: the cut falls on a chunk boundary


def _check(rank, world):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(B, S, C, generator=g).to(torch.bfloat16)
    v = torch.randn(B, S, C, generator=g).to(torch.bfloat16)
    sigmas = torch.linspace(1.0, 0.0, 9)
    ts = sigmas[torch.randint(0, 9, (B, S, 1), generator=g)]
    fz = torch.rand(1, S, 1, generator=g) < 0.25
    w = torch.randn(B, generator=g)
    lo, hi = sum(ROWS[:rank]), sum(ROWS[: rank + 1])
    cut = lambda t: t[:, lo:hi].contiguous()  # noqa: E731
    gens = lambda: [torch.Generator().manual_seed(3 + i) for i in range(B)]  # noqa: E731
    kw = dict(backend="torch")
    full = flowrl.sde_step(x, v, sigmas, 2, token_sigmas=ts, frozen=fz, generator=gens(), **kw)
    part = fd.sde_step(cut(x), cut(v), sigmas, 2, token_sigmas=cut(ts), frozen=cut(fz), generator=gens(), **kw)
    assert torch.equal(part.prev_sample, full.prev_sample[:, lo:hi])
    assert torch.equal(part.count, full.count)
    for kind, exact in (("kernel", True), ("sq_err", True), ("gaussian", False)):
        vf = v.clone().requires_grad_()
        want = flowrl.step_log_prob(x, vf, full.prev_sample, sigmas, 2, token_sigmas=ts, frozen=fz, log_prob_kind=kind, **kw)
        (want * w).sum().backward()
        vs = cut(v).requires_grad_()
        got = fd.step_log_prob(cut(x), vs, cut(full.prev_sample), sigmas, 2, token_sigmas=cut(ts), frozen=cut(fz),
                               log_prob_kind=kind, **kw)
        (got * w).sum().backward()
        if exact:
            assert torch.equal(got, want), (kind, got, want)
            assert torch.equal(vs.grad, vf.grad[:, lo:hi]), kind
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(vs.grad, vf.grad[:, lo:hi])


def test_sequence_parallel_per_token_and_frozen():
    run_ranks(_check, 2, deadline_s=120)
