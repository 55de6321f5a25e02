"""torch.compile sees through flowrl's ops (docs/compile.md): a training step that rolls out
(``sde_step``), recomputes (``step_log_prob``), takes the KL (``step_kl``) and the GRPO loss, then
backpropagates, compiles with ``fullgraph=True`` (0 graph breaks) and gives eager mode's values and
gradients bit for bit on the torch backend; every op passes ``torch.library.opcheck`` (schema, fake
implementation, registered autograd). The CUDA variants (Triton backend) run in bench/gpu_check.sh.

The compiled tests use tiny shapes and few compiles: Inductor builds C++ on the CPU."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import flowrl
from flowrl import losses

SIGMAS = [0.99, 0.75, 0.5, 0.25, 0.0]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(device, dtype=torch.float32, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 8, generator=g).to(device, dtype)
    noise = torch.randn(batch, 4, 8, generator=g).to(device)
    ref = torch.randn(batch, 4, 8, generator=g).to(device, dtype)
    w = torch.randn(8, 8, generator=g).mul_(0.3).to(device)
    old_lp = torch.randn(batch, generator=g).to(device)
    adv = torch.randn(batch, generator=g).to(device)
    sigmas = torch.tensor(SIGMAS, device=device)
    return x, noise, ref, w, old_lp, adv, sigmas


def _training_step(backend):
    def step(x, noise, ref, w, old_lp, adv, sigmas):
        v = (x.float() @ w).to(x.dtype)  # the "model"
        out = flowrl.sde_step(x, v.detach(), sigmas, 1, noise=noise, backend=backend)
        lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, 1, backend=backend)
        kl = flowrl.step_kl(x, v, ref, sigmas, 1, backend=backend)
        grpo = losses.grpo_loss(x, v, out.prev_sample, sigmas, 1, old_lp, adv, clip_range=(0.2, 0.28), kl_coef=0.1,
                                ref_model_output=ref, backend=backend)
        loss = grpo.loss - lp.mean() + kl.mean()
        return loss, out.prev_sample, out.log_prob, out.prev_sample_mean, lp, kl, grpo.log_prob, grpo.ratio, grpo.kl
    return step


def _eager_and_compiled(step, args, w_index=3, **compile_kwargs):
    """(eager outputs, eager grad of w, compiled outputs, compiled grad of w); backward outside the step."""
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, **compile_kwargs)):
        w = args[w_index].detach().clone().requires_grad_(True)
        call = list(args)
        call[w_index] = w
        out = fn(*call)
        out[0].backward()
        results += [out, w.grad]
    return results


def _assert_bitwise(eager, compiled):
    for k, (a, b) in enumerate(zip(eager, compiled)):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a, b), (k, (a.double() - b.double()).abs().max().item())


def test_training_step_compiles_with_no_graph_break_and_eager_bits():
    args = _inputs("cpu")
    out_e, grad_e, out_c, grad_c = _eager_and_compiled(_training_step("torch"), args)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    _assert_bitwise(out_e, out_c)
    _assert_bitwise([grad_e], [grad_c])
