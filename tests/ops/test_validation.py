"""Bad input to the public functions raises a ValueError / TypeError whose message is about the
argument: it starts with the argument's name, and the rest tells this error from the others (the
messages of flowrl/core/_validate.py, flowrl/ops/functional.py and flowrl/backends/_dispatch.py). Devices are
mismatched with the "meta" device, so these run without a GPU."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from flowrl.backends import _dispatch
from flowrl.contract import Mode
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


def raises(exc, name: str, detail: str):
    """``pytest.raises`` for an error about argument ``name``: the message starts with ``name`` (the
    argument is the subject, not merely mentioned) and goes on with ``detail``, a regex for the rest
    of the exact message, enough of it to tell this error from every other message about ``name``."""
    return pytest.raises(exc, match="^" + re.escape(name) + detail)


FLOAT_DTYPES = r" must have a floating dtype in \(float32, bfloat16, float16, float64\); got "
ON_META = r" is on meta but sample is on cpu; move them to one device$"
STEP_RANGE = r" must be in \[0, 3\] \(the schedule has T = 4 steps\); got "
SCHEDULE_ENDS = r" must start at <= 1 and end at 0 \(diffusers' set_timesteps appends the terminal 0\); got "

# (case id, overrides, exception, the argument, the rest of its message as a regex)
# every mode the contract has, in the error's order ("must be one of 'ode', 'sde', ...")
MODES_RE = " must be one of " + ", ".join(f"'{m}'" for m in Mode.labels())
COMMON_CASES = [
    ("sample-int", {"sample": torch.ones(SHAPE, dtype=torch.int64)}, TypeError, "sample", FLOAT_DTYPES + r"torch\.int64$"),
    ("sample-bool", {"sample": torch.ones(SHAPE, dtype=torch.bool)}, TypeError, "sample", FLOAT_DTYPES + r"torch\.bool$"),
    ("sample-list", {"sample": [[1.0, 2.0]]}, TypeError, "sample", r" must be a torch\.Tensor; got list$"),
    ("sample-0d", {"sample": torch.tensor(1.0)}, ValueError, "sample",
     r" must have a batch dimension \(shape \[B, \.\.\.\]\); got a 0-d tensor$"),
    # B = 0 is valid (tests/ops/test_empty_batch.py); a batch the other tensors do not share is not
    ("sample-empty-batch-mismatch", {"sample": torch.zeros(0, 3, 4)}, ValueError, "model_output",
     r" must have the shape of sample \(0, 3, 4\); got \(2, 3, 4\)$"),
    ("sample-no-elements", {"sample": torch.zeros(2, 0)}, ValueError, "sample",
     r" must have at least one element per sample; got shape \(2, 0\)$"),
    ("model_output-shape", {"model_output": torch.zeros(2, 3, 5)}, ValueError, "model_output",
     r" must have the shape of sample \(2, 3, 4\); got \(2, 3, 5\)$"),
    ("model_output-batch", {"model_output": torch.zeros(3, 3, 4)}, ValueError, "model_output",
     r" must have the shape of sample \(2, 3, 4\); got \(3, 3, 4\)$"),
    ("model_output-int", {"model_output": torch.zeros(SHAPE, dtype=torch.int32)}, TypeError, "model_output",
     FLOAT_DTYPES + r"torch\.int32$"),
    ("model_output-complex", {"model_output": torch.zeros(SHAPE, dtype=torch.complex64)}, TypeError, "model_output",
     FLOAT_DTYPES + r"torch\.complex64$"),
    ("model_output-device", {"model_output": torch.zeros(SHAPE, device="meta")}, ValueError, "model_output", ON_META),
    ("mode-unknown", {"mode": "ddpm"}, ValueError, "mode", MODES_RE + r"; got 'ddpm'$"),
    ("mode-case", {"mode": "SDE"}, ValueError, "mode", MODES_RE + r"; got 'SDE'$"),
    ("mode-none", {"mode": None}, ValueError, "mode", MODES_RE + r"; got None$"),
    ("mode-int", {"mode": 1}, ValueError, "mode", MODES_RE + r"; got 1$"),
    ("noise_level-nan", {"noise_level": float("nan")}, ValueError, "noise_level", r" must be finite; got nan$"),
    ("noise_level-inf", {"noise_level": math.inf}, ValueError, "noise_level", r" must be finite; got inf$"),
    ("noise_level-negative", {"noise_level": -0.1}, ValueError, "noise_level", r" must be >= 0; got -0\.1$"),
    ("noise_level-str", {"noise_level": "0.7"}, TypeError, "noise_level", r" must be a real number; got str$"),
    ("noise_level-bool", {"noise_level": True}, TypeError, "noise_level", r" must be a real number; got bool$"),
    ("noise_level-tensor", {"noise_level": torch.tensor(0.7)}, TypeError, "noise_level", r" must be a real number; got Tensor$"),
    ("noise_level-cps-above-1", {"mode": "cps", "noise_level": 1.01}, ValueError, "noise_level",
     r" must be in \[0, 1\] for mode='cps'; got 1\.01$"),
    ("noise_level-dance-nan", {"mode": "dance", "noise_level": float("nan")}, ValueError, "noise_level", r" must be finite; got nan$"),
    ("step_index-negative", {"step_index": -1}, ValueError, "step_index", STEP_RANGE + r"-1$"),
    ("step_index-T", {"step_index": 4}, ValueError, "step_index", STEP_RANGE + r"4$"),
    ("step_index-float", {"step_index": 1.0}, TypeError, "step_index",
     r" must be an int or an integer tensor of shape \[B\]; got float$"),
    ("step_index-bool", {"step_index": True}, TypeError, "step_index",
     r" must be an int or an integer tensor of shape \[B\]; got a bool$"),
    ("step_index-float-tensor", {"step_index": torch.tensor([1.0, 2.0])}, TypeError, "step_index",
     r" must be an integer tensor; got torch\.float32$"),
    ("step_index-bool-tensor", {"step_index": torch.tensor([True, False])}, TypeError, "step_index",
     r" must be an integer tensor; got torch\.bool$"),
    ("step_index-wrong-length", {"step_index": torch.tensor([0, 1, 2])}, ValueError, "step_index",
     r" must be an int or a tensor of shape \[B\] = \[2\]; got shape \(3,\)$"),
    ("step_index-2d", {"step_index": torch.tensor([[0], [1]])}, ValueError, "step_index",
     r" must be an int or a tensor of shape \[B\] = \[2\]; got shape \(2, 1\)$"),
    ("step_index-tensor-out-of-range", {"step_index": torch.tensor([0, 4])}, ValueError, "step_index",
     STEP_RANGE + r"values in \[0, 4\]$"),
    ("step_index-tensor-negative", {"step_index": torch.tensor([-1, 0])}, ValueError, "step_index",
     STEP_RANGE + r"values in \[-1, 0\]$"),
    ("step_index-0d-tensor-out-of-range", {"step_index": torch.tensor(4)}, ValueError, "step_index",
     STEP_RANGE + r"values in \[4, 4\]$"),
    ("sigmas-list", {"sigmas": [1.0, 0.5, 0.0]}, TypeError, "sigmas", r" must be a 1-D torch\.Tensor schedule; got list$"),
    ("sigmas-bf16", {"sigmas": schedule().bfloat16()}, TypeError, "sigmas",
     r" must be float32 \(or float64\), the exact schedule table; got torch\.bfloat16\. "),
    ("sigmas-int", {"sigmas": torch.tensor([2, 1, 0])}, TypeError, "sigmas",
     r" must be float32 \(or float64\), the exact schedule table; got torch\.int64\. "),
    ("sigmas-2d", {"sigmas": schedule().reshape(1, -1)}, ValueError, "sigmas", r" must be 1-D \(length T \+ 1\); got shape \(1, 5\)$"),
    ("sigmas-too-short", {"sigmas": torch.tensor([0.0]), "step_index": 0}, ValueError, "sigmas",
     r" must hold at least 2 values \(T >= 1\); got 1$"),
    ("sigmas-not-decreasing", {"sigmas": torch.tensor([1.0, 0.5, 0.6, 0.25, 0.0])}, ValueError, "sigmas",
     r" must be strictly decreasing$"),
    ("sigmas-repeated", {"sigmas": torch.tensor([1.0, 0.5, 0.5, 0.25, 0.0])}, ValueError, "sigmas", r" must be strictly decreasing$"),
    ("sigmas-above-1", {"sigmas": torch.tensor([1.5, 0.75, 0.5, 0.25, 0.0])}, ValueError, "sigmas",
     SCHEDULE_ENDS + r"sigmas\[0\] = 1\.5, sigmas\[-1\] = 0\.0$"),
    ("sigmas-no-terminal-0", {"sigmas": torch.tensor([1.0, 0.75, 0.5, 0.25, 0.1])}, ValueError, "sigmas",
     SCHEDULE_ENDS + r"sigmas\[0\] = 1\.0, sigmas\[-1\] = 0\.1\d*$"),  # 0.1 in float32
    ("sigmas-nan", {"sigmas": torch.tensor([1.0, float("nan"), 0.5, 0.25, 0.0])}, ValueError, "sigmas", r" must be finite$"),
    # sigmas[1] within fp32 isclose(rtol 1e-5) of 1: the sde substitution sigma_t = sigmas[1] would
    # divide by zero, so the schedule is rejected (for every mode: it is a property of the schedule)
    ("sigmas-second-is-1", {"sigmas": torch.tensor([1.0, 1.0 - 3e-6, 0.5, 0.25, 0.0])}, ValueError, "sigmas",
     r"\[1\] must not be 1: the sde mode replaces sigma = 1 by sigmas\[1\] at the first step, which would divide by zero$"),
    ("sigmas-device", {"sigmas": schedule().to("meta")}, ValueError, "sigmas", ON_META),
    ("backend-unknown", {"backend": "cuda"}, ValueError, "backend", r" must be one of 'auto', 'torch', 'triton'; got 'cuda'$"),
    ("backend-triton-float64", {"sample": torch.zeros(SHAPE, dtype=torch.float64), "backend": "triton"}, TypeError, "backend",
     r"='triton' takes float32, bfloat16 or float16 tensors; float64 runs on backend='torch'$"),
]

LOG_PROB_CASES = [
    ("log_prob_kind-unknown", {"log_prob_kind": "gauss"}, ValueError, "log_prob_kind", r" must be one of 'gaussian', 'kernel', 'sq_err'; got 'gauss'$"),
    # "kl" names step_kl's value, not a log-prob kind
    ("log_prob_kind-kl", {"log_prob_kind": "kl"}, ValueError, "log_prob_kind", r" must be one of 'gaussian', 'kernel', 'sq_err'; got 'kl'$"),
    ("reduction-unknown", {"reduction": "max"}, ValueError, "reduction", r" must be one of 'mean', 'sum'; got 'max'$"),
    ("reduction-none", {"reduction": None}, ValueError, "reduction", r" must be one of 'mean', 'sum'; got None$"),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("case,over,exc,name,detail", COMMON_CASES, ids=_ids(COMMON_CASES))
def test_bad_common_argument(fn, case, over, exc, name, detail):
    with raises(exc, name, detail):
        call(fn, **over)


@pytest.mark.parametrize("fn", ["step", "log_prob"])
@pytest.mark.parametrize("case,over,exc,name,detail", LOG_PROB_CASES, ids=_ids(LOG_PROB_CASES))
def test_bad_log_prob_argument(fn, case, over, exc, name, detail):
    with raises(exc, name, detail):
        call(fn, **over)


def test_kl_bad_reduction():
    with raises(ValueError, "reduction", r" must be one of 'mean', 'sum'; got 'none'$"):
        call("kl", reduction="none")


@pytest.mark.parametrize("fn", FNS)
def test_bad_backend_environment_variable(fn, monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "gpu")
    with raises(ValueError, "FLOWRL_BACKEND", r" must be one of auto, torch, triton; got 'gpu'$"):
        call(fn, backend="auto")


def _triton_or_skip():
    # imports the kernels now, under the test session's TRITON_INTERPRET, before a test changes it
    if not _dispatch.triton_available():
        pytest.skip("triton cannot be imported here")


@pytest.mark.parametrize("fn", FNS)
def test_triton_on_cpu_tensors_without_the_interpreter(fn, monkeypatch):
    _triton_or_skip()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with raises(ValueError, "backend", r"='triton' needs CUDA tensors \(got tensors on cpu\); set TRITON_INTERPRET=1 "):
        call(fn, backend="triton")


def test_triton_out_dtype_float64(monkeypatch):
    _triton_or_skip()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors resolve to the Triton backend
    with raises(TypeError, "out_dtype", r"=float64 runs on backend='torch' only$"):
        call("step", backend="triton", out_dtype=torch.float64)


# ---- arguments of one function ---------------------------------------------------------------

BATCH_TENSOR_CASES = [
    ("shape", torch.zeros(2, 3, 5), ValueError, r" must have the shape of sample \(2, 3, 4\); got \(2, 3, 5\)$"),
    ("batch", torch.zeros(1, 3, 4), ValueError, r" must have the shape of sample \(2, 3, 4\); got \(1, 3, 4\)$"),
    ("int", torch.zeros(SHAPE, dtype=torch.int64), TypeError, FLOAT_DTYPES + r"torch\.int64$"),
    ("int16", torch.zeros(SHAPE, dtype=torch.int16), TypeError, FLOAT_DTYPES + r"torch\.int16$"),
    ("device", torch.zeros(SHAPE, device="meta"), ValueError, ON_META),
    ("numpy", np.zeros(SHAPE, dtype=np.float32), TypeError, r" must be a torch\.Tensor; got ndarray$"),
]


@pytest.mark.parametrize("case,other,exc,detail", BATCH_TENSOR_CASES, ids=_ids(BATCH_TENSOR_CASES))
def test_bad_prev_sample_and_ref_model_output(case, other, exc, detail):
    with raises(exc, "prev_sample", detail):
        call("log_prob", other=other)
    with raises(exc, "ref_model_output", detail):
        call("kl", other=other)


@pytest.mark.parametrize("case,noise,exc,detail", BATCH_TENSOR_CASES, ids=_ids(BATCH_TENSOR_CASES))
def test_bad_noise(case, noise, exc, detail):
    with raises(exc, "noise", detail):
        call("step", noise=noise)


def test_noise_and_generator_together():
    # about the pair, not one argument: the whole message
    with pytest.raises(ValueError, match=r"^pass either noise or generator, not both$"):
        call("step", noise=torch.zeros(SHAPE), generator=torch.Generator())


@pytest.mark.parametrize(
    "generator,exc,detail",
    [([torch.Generator()], ValueError, r" must be one torch\.Generator or a list of B = 2 generators; got a list of 1$"),
     ([torch.Generator()] * 3, ValueError, r" must be one torch\.Generator or a list of B = 2 generators; got a list of 3$"),
     ([], ValueError, r" must be one torch\.Generator or a list of B = 2 generators; got a list of 0$"),
     ([torch.Generator(), 7], TypeError, r"\[1\] must be a torch\.Generator; got int$"),
     (7, TypeError, r" must be None, a torch\.Generator or a list of them; got int$"),
     ("seed", TypeError, r" must be None, a torch\.Generator or a list of them; got str$")],
    ids=["list-too-short", "list-too-long", "empty-list", "not-a-generator-in-list", "int", "str"],
)
def test_bad_generator(generator, exc, detail):
    with raises(exc, "generator", detail):
        call("step", generator=generator)


@pytest.mark.parametrize("out_dtype", [torch.int32, "float32", torch.complex64, torch.bool], ids=str)
def test_bad_out_dtype(out_dtype):
    with raises(TypeError, "out_dtype", r" must be one of float32, bfloat16, float16, float64; got " + re.escape(repr(out_dtype)) + "$"):
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
        with raises(ValueError, "sigmas", r" must be strictly decreasing$"):
            call("step", sigmas=bad)


def test_a_schedule_edited_in_place_is_checked_again():
    sigmas = schedule()
    call("step", sigmas=sigmas)
    sigmas[2] = 0.9  # in-place edit: no longer decreasing
    with raises(ValueError, "sigmas", r" must be strictly decreasing$"):
        call("step", sigmas=sigmas)


def test_a_new_schedule_at_a_reused_address_is_checked():
    checked = schedule()
    call("step", sigmas=checked)
    # Write an invalid schedule into the same memory without bumping any version counter, then wrap
    # it in a fresh tensor (version 0): exactly what a new allocation reusing a freed block looks like.
    checked.numpy()[:] = [1.0, 0.5, 0.6, 0.25, 0.0]
    reused = torch.from_numpy(checked.numpy())
    assert reused.data_ptr() == checked.data_ptr() and reused is not checked
    with raises(ValueError, "sigmas", r" must be strictly decreasing$"):
        call("step", sigmas=reused)
