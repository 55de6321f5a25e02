"""tests/interpreter_launches.py: Triton's interpreter with each launch's language patch done once
gives the kernels' bits of the unpatched interpreter, with fewer patches."""
import collections

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch

pytestmark = pytest.mark.skipif(not (_dispatch.triton_available() and _dispatch.interpreter_enabled()),
                                reason="needs triton under TRITON_INTERPRET=1")


def _run():
    """A Philox rollout and its recompute with gradients: nested helpers from several modules, tl.sum."""
    g = torch.Generator().manual_seed(3)
    x, v = (torch.randn(2, 4, 40, generator=g).to(torch.bfloat16) for _ in range(2))
    sigmas = torch.linspace(1.0, 0.0, 9)
    out = flowrl.sde_step(x, v, sigmas, torch.tensor([1, 4]), noise_seed=torch.tensor([5, 6]), backend="triton")
    vg = v.clone().requires_grad_()
    lp = flowrl.step_log_prob(x, vg, out.prev_sample, sigmas, torch.tensor([1, 4]), backend="triton")
    lp.sum().backward()
    return [out.prev_sample, out.log_prob, lp, vg.grad]


def test_each_launch_patches_once_and_gives_the_unpatched_bits(monkeypatch):
    from triton.runtime import interpreter

    assert interpreter._flowrl_patched_once
    calls = collections.Counter()

    def counting(patch_builtin, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return patch_builtin(*args, **kwargs)
        return wrapper

    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", counting(patch_builtin, "once"))
    once = _run()
    patch_lang, grid_call = interpreter._flowrl_unpatched
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", grid_call)
    monkeypatch.setattr(interpreter, "_patch_builtin", counting(patch_builtin, "each call"))
    each_call = _run()
    for a, b in zip(once, each_call):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    print(dict(calls))
    assert 0 < 5 * calls["once"] < calls["each call"], calls
