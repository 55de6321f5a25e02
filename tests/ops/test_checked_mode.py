"""What used to pass silently (issue "As a new user meets it", item 2): the checked mode that finds a NaN's
source, the refused arguments, shape inference on meta tensors, and the documented dtype rule."""
import os
import subprocess
import sys

import pytest
import torch

import flowrl
from flowrl.core._validate import checks
from flowrl.losses import grpo_loss

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


def _step(batch=2):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(batch, 4, 8, generator=g), torch.randn(batch, 4, 8, generator=g)
    out = flowrl.sde_step(x, v, SIGMAS, 1, generator=g, backend="torch")
    return x, v, out.prev_sample, out.log_prob, torch.randn(batch, generator=g)


@pytest.mark.parametrize("name", ["old_log_prob", "advantages", "model_output", "sample", "prev_sample"])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_the_checked_mode_names_the_input_that_is_not_finite(name, bad):
    x, v, prev, old, adv = _step()
    args = dict(sample=x, model_output=v, prev_sample=prev, old_log_prob=old, advantages=adv)
    args[name] = args[name].clone()
    args[name].view(-1)[1] = bad

    def loss():
        return grpo_loss(args["sample"], args["model_output"], args["prev_sample"], SIGMAS, 1,
                         old_log_prob=args["old_log_prob"],
                         advantages=args["advantages"], clip_range=0.2, backend="torch").loss

    assert not checks.enabled()
    silent = loss()  # off: no check (a NaN loss, or a finite one: -inf makes a ratio 0 or inf, then clipped)
    if bad != bad and name in ("old_log_prob", "advantages"):
        assert torch.isnan(silent)
    if bad < 0 and name == "old_log_prob":  # docs/guide.md: a ratio of inf, bounded by the clip
        assert torch.isfinite(silent)
    with checks():
        with pytest.raises(RuntimeError, match=f"flowrl.checks: {name} holds a NaN or an infinity"):
            loss()
    assert not checks.enabled()
    checks(True)
    try:
        with pytest.raises(RuntimeError, match=name):
            loss()
    finally:
        checks(False)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        checks("yes")


def test_the_checked_mode_covers_the_step_ops_and_starts_from_the_environment():
    x, v, prev, _, _ = _step()
    v = v.clone()
    v[0, 0, 0] = float("nan")
    with checks(), pytest.raises(RuntimeError, match="model_output holds a NaN"):
        flowrl.sde_step(x, v, SIGMAS, 1, generator=torch.Generator().manual_seed(0), backend="torch")
    with checks(), pytest.raises(RuntimeError, match="model_output holds a NaN"):
        flowrl.step_log_prob(x, v, prev, SIGMAS, 1, backend="torch")
    code = ("import flowrl; from flowrl.core._validate import checks; print(checks.enabled(), flowrl.checks.enabled())")
    for value, expected in (("1", "True True"), ("0", "False False")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FLOWRL_CHECKS": value},
                             capture_output=True, text=True, check=True).stdout.split()
        assert " ".join(out) == expected


@pytest.mark.parametrize("clip_range, name", [(1.5, "clip_range"), (1.0, "clip_range"),
                                              ((1.2, 0.3), r"clip_range\[0\] \(eps_low\)")])
def test_a_clip_range_whose_lower_bound_is_not_positive_is_refused(clip_range, name):
    x, v, prev, old, adv = _step()
    with pytest.raises(ValueError, match=f"^{name} must be < 1"):
        grpo_loss(x, v, prev, SIGMAS, 1, old_log_prob=old, advantages=adv, clip_range=clip_range)
    grpo_loss(x, v, prev, SIGMAS, 1, old_log_prob=old, advantages=adv,
              clip_range=(0.2, 1.5))  # a high clip above 1 is a setting


def test_a_schedule_that_requires_grad_is_refused():
    x, v, prev, old, adv = _step()
    sigmas = SIGMAS.clone().requires_grad_()
    for call in (lambda: flowrl.sde_step(x, v, sigmas, 1, noise=torch.zeros_like(x)),
                 lambda: flowrl.step_log_prob(x, v, prev, sigmas, 1),
                 lambda: grpo_loss(x, v, prev, sigmas, 1, old_log_prob=old, advantages=adv, clip_range=0.2)):
        with pytest.raises(ValueError, match="sigmas requires grad.*sigmas.detach"):
            call()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_meta_tensors_give_shapes_without_reading_values(backend):
    meta = dict(device="meta")
    x, v = torch.empty(3, 4, 8, **meta), torch.empty(3, 4, 8, **meta)
    sigmas = torch.empty(5, **meta)
    out = flowrl.sde_step(x, v, sigmas, 1, noise=torch.empty(3, 4, 8, **meta), backend=backend)
    assert out.prev_sample.shape == (3, 4, 8) and out.log_prob.shape == (3,) and out.prev_sample.is_meta
    assert flowrl.step_log_prob(x, v, x, sigmas, torch.zeros(3, dtype=torch.int64, **meta), backend=backend).shape == (3,)
    res = grpo_loss(x, v, x, sigmas, 1, old_log_prob=torch.empty(3, **meta), advantages=torch.empty(3, **meta),
                    clip_range=0.2, backend=backend)
    assert res.loss.shape == () and res.loss.is_meta


def test_a_float64_input_makes_the_torch_reference_compute_in_float64():
    """docs/contract.md, Precision: any float64 tensor among x, v makes the torch backend compute in float64
    (mean and log-prob float64); the emitted sample takes out_dtype (model_output's dtype by default)."""
    x, v, *_ = _step()
    out = flowrl.sde_step(x.double(), v, SIGMAS, 1, noise=torch.zeros_like(x), backend="torch")
    assert (out.prev_sample.dtype, out.log_prob.dtype, out.prev_sample_mean.dtype) == (
        torch.float32, torch.float64, torch.float64)
    full = flowrl.sde_step(x.double(), v.double(), SIGMAS, 1, noise=torch.zeros_like(x), backend="torch")
    assert torch.equal(out.prev_sample_mean, full.prev_sample_mean)
    # the log-prob is of the emitted (float32) sample, computed in float64
    again = flowrl.step_log_prob(x.double(), v.double(), out.prev_sample.double(), SIGMAS, 1, backend="torch")
    assert torch.equal(out.log_prob, again)
    with pytest.raises(TypeError, match="float64 runs on backend='torch'"):
        flowrl.sde_step(x.double(), v, SIGMAS, 1, noise=torch.zeros_like(x), backend="triton")
