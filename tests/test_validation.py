"""Bad input to the public functions raises a ValueError / TypeError whose message names the
argument. Devices are mismatched with the "meta" device, so these run without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl import _validate as V
from flowrl import sde_step, step_kl, step_log_prob

B, SHAPE = 2, (2, 3, 4)


def schedule():
    return torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


def valid():
    g = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(SHAPE, generator=g),
        "model_output": torch.randn(SHAPE, generator=g),
        "other": torch.randn(SHAPE, generator=g),  # prev_sample / ref_model_output
        "sigmas": schedule(),
        "step_index": 1,
    }


def call(fn, mode="sde", noise_level=0.7, backend="torch", **over):
    """Call ``fn`` ("step", "log_prob", "kl") with valid arguments, some replaced by ``over``."""
    a = valid()
    for k in ("sample", "model_output", "other", "sigmas", "step_index"):
        if k in over:
            a[k] = over.pop(k)
    kw = dict(mode=mode, noise_level=noise_level, backend=backend, **over)
    if fn == "step":
        return sde_step(a["sample"], a["model_output"], a["sigmas"], a["step_index"], **kw)
    if fn == "log_prob":
        return step_log_prob(a["sample"], a["model_output"], a["other"], a["sigmas"], a["step_index"], **kw)
    return step_kl(a["sample"], a["model_output"], a["other"], a["sigmas"], a["step_index"], **kw)


FNS = ("step", "log_prob", "kl")


@pytest.mark.parametrize("fn", FNS)
def test_valid_arguments_pass(fn):
    out = call(fn)
    lp = out.log_prob if fn == "step" else out
    assert lp.shape == (B,) and torch.isfinite(lp).all()


# (case id, overrides, exception, the argument name the message must contain)
COMMON_CASES = [
    ("sample-int", {"sample": torch.ones(SHAPE, dtype=torch.int64)}, TypeError, "sample"),
    ("sample-bool", {"sample": torch.ones(SHAPE, dtype=torch.bool)}, TypeError, "sample"),
    ("sample-list", {"sample": [[1.0, 2.0]]}, TypeError, "sample"),
    ("sample-0d", {"sample": torch.tensor(1.0)}, ValueError, "sample"),
    ("sample-empty-batch", {"sample": torch.zeros(0, 3)}, ValueError, "sample"),
    ("sample-no-elements", {"sample": torch.zeros(2, 0)}, ValueError, "sample"),
    ("model_output-shape", {"model_output": torch.zeros(2, 3, 5)}, ValueError, "model_output"),
    ("model_output-batch", {"model_output": torch.zeros(3, 3, 4)}, ValueError, "model_output"),
    ("model_output-int", {"model_output": torch.zeros(SHAPE, dtype=torch.int32)}, TypeError, "model_output"),
    ("model_output-complex", {"model_output": torch.zeros(SHAPE, dtype=torch.complex64)}, TypeError, "model_output"),
    ("model_output-device", {"model_output": torch.zeros(SHAPE, device="meta")}, ValueError, "model_output"),
    ("mode-unknown", {"mode": "ddim"}, ValueError, "mode"),
    ("mode-case", {"mode": "SDE"}, ValueError, "mode"),
    ("mode-none", {"mode": None}, ValueError, "mode"),
    ("noise_level-nan", {"noise_level": float("nan")}, ValueError, "noise_level"),
    ("noise_level-inf", {"noise_level": math.inf}, ValueError, "noise_level"),
    ("noise_level-negative", {"noise_level": -0.1}, ValueError, "noise_level"),
    ("noise_level-str", {"noise_level": "0.7"}, TypeError, "noise_level"),
    ("noise_level-bool", {"noise_level": True}, TypeError, "noise_level"),
    ("noise_level-tensor", {"noise_level": torch.tensor(0.7)}, TypeError, "noise_level"),
    ("noise_level-cps-above-1", {"mode": "cps", "noise_level": 1.01}, ValueError, "noise_level"),
    ("noise_level-dance-nan", {"mode": "dance", "noise_level": float("nan")}, ValueError, "noise_level"),
    ("step_index-negative", {"step_index": -1}, ValueError, "step_index"),
    ("step_index-T", {"step_index": 4}, ValueError, "step_index"),
    ("step_index-float", {"step_index": 1.0}, TypeError, "step_index"),
    ("step_index-bool", {"step_index": True}, TypeError, "step_index"),
    ("step_index-float-tensor", {"step_index": torch.tensor([1.0, 2.0])}, TypeError, "step_index"),
    ("step_index-bool-tensor", {"step_index": torch.tensor([True, False])}, TypeError, "step_index"),
    ("step_index-wrong-length", {"step_index": torch.tensor([0, 1, 2])}, ValueError, "step_index"),
    ("step_index-2d", {"step_index": torch.tensor([[0], [1]])}, ValueError, "step_index"),
    ("step_index-tensor-out-of-range", {"step_index": torch.tensor([0, 4])}, ValueError, "step_index"),
    ("step_index-tensor-negative", {"step_index": torch.tensor([-1, 0])}, ValueError, "step_index"),
    ("sigmas-list", {"sigmas": [1.0, 0.5, 0.0]}, TypeError, "sigmas"),
    ("sigmas-bf16", {"sigmas": schedule().bfloat16()}, TypeError, "sigmas"),
    ("sigmas-int", {"sigmas": torch.tensor([2, 1, 0])}, TypeError, "sigmas"),
    ("sigmas-2d", {"sigmas": schedule().reshape(1, -1)}, ValueError, "sigmas"),
    ("sigmas-too-short", {"sigmas": torch.tensor([0.0]), "step_index": 0}, ValueError, "sigmas"),
    ("sigmas-not-decreasing", {"sigmas": torch.tensor([1.0, 0.5, 0.6, 0.25, 0.0])}, ValueError, "sigmas"),
    ("sigmas-repeated", {"sigmas": torch.tensor([1.0, 0.5, 0.5, 0.25, 0.0])}, ValueError, "sigmas"),
    ("sigmas-above-1", {"sigmas": torch.tensor([1.5, 0.75, 0.5, 0.25, 0.0])}, ValueError, "sigmas"),
    ("sigmas-no-terminal-0", {"sigmas": torch.tensor([1.0, 0.75, 0.5, 0.25, 0.1])}, ValueError, "sigmas"),
    ("sigmas-nan", {"sigmas": torch.tensor([1.0, float("nan"), 0.5, 0.25, 0.0])}, ValueError, "sigmas"),
    # sigmas[1] within fp32 isclose(rtol 1e-5) of 1: the sde substitution sigma_t = sigmas[1] would
    # divide by zero, so the schedule is rejected (for every mode: it is a property of the schedule)
    ("sigmas-second-is-1", {"sigmas": torch.tensor([1.0, 1.0 - 3e-6, 0.5, 0.25, 0.0])}, ValueError, "sigmas"),
    ("sigmas-device", {"sigmas": schedule().to("meta")}, ValueError, "sigmas"),
    ("backend-unknown", {"backend": "cuda"}, ValueError, "backend"),
]

LOG_PROB_CASES = [
    ("log_prob-unknown", {"log_prob": "gauss"}, ValueError, "log_prob"),
    ("reduction-unknown", {"reduction": "max"}, ValueError, "reduction"),
    ("reduction-none", {"reduction": None}, ValueError, "reduction"),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("case,over,exc,name", COMMON_CASES, ids=_ids(COMMON_CASES))
def test_bad_common_argument(fn, case, over, exc, name):
    with pytest.raises(exc, match=name):
        call(fn, **over)


@pytest.mark.parametrize("fn", ["step", "log_prob"])
@pytest.mark.parametrize("case,over,exc,name", LOG_PROB_CASES, ids=_ids(LOG_PROB_CASES))
def test_bad_log_prob_argument(fn, case, over, exc, name):
    with pytest.raises(exc, match=name):
        call(fn, **over)


def test_kl_bad_reduction():
    with pytest.raises(ValueError, match="reduction"):
        call("kl", reduction="none")


# ---- arguments of one function ---------------------------------------------------------------

@pytest.mark.parametrize(
    "other,exc",
    [(torch.zeros(2, 3, 5), ValueError), (torch.zeros(SHAPE, dtype=torch.int64), TypeError),
     (torch.zeros(SHAPE, device="meta"), ValueError), (np.zeros(SHAPE, dtype=np.float32), TypeError)],
    ids=["shape", "int", "device", "numpy"],
)
def test_bad_prev_sample_and_ref_model_output(other, exc):
    with pytest.raises(exc, match="prev_sample"):
        call("log_prob", other=other)
    with pytest.raises(exc, match="ref_model_output"):
        call("kl", other=other)


@pytest.mark.parametrize(
    "noise,exc",
    [(torch.zeros(2, 3, 5), ValueError), (torch.zeros(1, 3, 4), ValueError),
     (torch.zeros(SHAPE, dtype=torch.int16), TypeError), (torch.zeros(SHAPE, device="meta"), ValueError)],
    ids=["shape", "batch", "int", "device"],
)
def test_bad_noise(noise, exc):
    with pytest.raises(exc, match="noise"):
        call("step", noise=noise)


def test_noise_and_generator_together():
    with pytest.raises(ValueError, match="noise") as info:
        call("step", noise=torch.zeros(SHAPE), generator=torch.Generator())
    assert "generator" in str(info.value)


@pytest.mark.parametrize(
    "generator,exc",
    [([torch.Generator()], ValueError), ([torch.Generator()] * 3, ValueError), ([], ValueError),
     ([torch.Generator(), 7], TypeError), (7, TypeError), ("seed", TypeError)],
    ids=["list-too-short", "list-too-long", "empty-list", "not-a-generator-in-list", "int", "str"],
)
def test_bad_generator(generator, exc):
    with pytest.raises(exc, match="generator"):
        call("step", generator=generator)


@pytest.mark.parametrize("out_dtype", [torch.int32, "float32", torch.complex64, torch.bool], ids=str)
def test_bad_out_dtype(out_dtype):
    with pytest.raises(TypeError, match="out_dtype"):
        call("step", out_dtype=out_dtype)


# ---- edges of the valid domain are accepted --------------------------------------------------

@pytest.mark.parametrize(
    "over",
    [{"mode": "cps", "noise_level": 1.0}, {"mode": "cps", "noise_level": 0}, {"mode": "sde", "noise_level": 3},
     {"noise_level": np.float32(0.5)}, {"step_index": 3}, {"step_index": torch.tensor(2)},
     {"step_index": torch.tensor([0, 3], dtype=torch.int32)}, {"step_index": np.int64(2)},
     {"sigmas": torch.tensor([0.9, 0.5, 0.2, 0.1, 0.0])}, {"sigmas": schedule().double()}],
    ids=["cps-eta-1", "cps-eta-0", "sde-eta-3", "numpy-eta", "last-step", "0d-tensor-step", "int32-steps",
         "numpy-step", "schedule-below-1", "float64-schedule"],
)
@pytest.mark.parametrize("fn", FNS)
def test_domain_edges_are_accepted(fn, over):
    out = call(fn, **over)
    lp = out.log_prob if fn == "step" else out
    assert torch.isfinite(lp).all()


def test_a_rejected_schedule_stays_rejected():
    # the schedule check is cached: a rejection must not be cached as a pass
    bad = torch.tensor([1.0, 0.5, 0.6, 0.25, 0.0])
    for _ in range(2):
        with pytest.raises(ValueError, match="sigmas"):
            call("step", sigmas=bad)


def test_a_schedule_edited_in_place_is_checked_again():
    sigmas = schedule()
    call("step", sigmas=sigmas)
    sigmas[2] = 0.9  # in-place edit: no longer decreasing
    with pytest.raises(ValueError, match="sigmas"):
        call("step", sigmas=sigmas)


def test_a_new_schedule_at_a_reused_address_is_checked():
    checked = schedule()
    call("step", sigmas=checked)
    # Write an invalid schedule into the same memory without bumping any version counter, then wrap
    # it in a fresh tensor (version 0): exactly what a new allocation reusing a freed block looks like.
    checked.numpy()[:] = [1.0, 0.5, 0.6, 0.25, 0.0]
    reused = torch.from_numpy(checked.numpy())
    assert reused.data_ptr() == checked.data_ptr() and reused is not checked
    with pytest.raises(ValueError, match="sigmas"):
        call("step", sigmas=reused)
