"""The benchmark as a pytest-benchmark suite, plus the checks that keep the benchmark honest.

    python3 -m pytest bench/test_bench_ops.py                       # checks + timings
    python3 -m pytest bench/test_bench_ops.py --benchmark-disable   # checks only, each op run once

Not collected by the default test run (setup.cfg: testpaths = tests). The timed size is one Flux-style
image latent, [1, 4096, 64] bf16; ``python bench/run.py`` runs the full sweep.
"""
from __future__ import annotations

import csv
import math

import pytest
import torch

import baseline
import flowrl
import run as bench

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BENCH_SHAPE = (1, 4096, 64)
IMPLS = [
    pytest.param("flowrl-triton", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="Triton is timed on CUDA only (the interpreter is not a measurement)")),
    "flowrl-torch",
    "eager",
    "compile",
]


def _synced(fn):
    if DEVICE.type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", baseline.MODES)
@pytest.mark.parametrize("op", bench.OPS)
def test_op(benchmark, op, mode, impl):
    case = bench.make_case(BENCH_SHAPE, torch.bfloat16, mode, DEVICE)
    expected = bench.build("eager", case, op)()
    fn = bench.build(impl, case, op)
    bench.check(fn(), expected)  # never time a wrong formula
    benchmark.extra_info["min_bytes"] = bench.min_bytes(op, case.x.numel(), BENCH_SHAPE[0], case.x.element_size())
    benchmark(_synced(fn))


# ---- the baseline is the peers' formula and agrees with flowrl -----------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", baseline.MODES)
@pytest.mark.parametrize("op", bench.OPS)
def test_flowrl_torch_agrees_with_baseline(op, mode, dtype):
    case = bench.make_case((2, 4, 8, 16), dtype, mode, torch.device("cpu"), seed=1)
    err = bench.check(bench.build("flowrl-torch", case, op)(), bench.build("eager", case, op)())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("mode", baseline.MODES)
def test_baseline_per_sample_steps_including_sigma_one(mode):
    """Per-sample step indices, with step 0 (sigma = 1, Flow-GRPO's sigma_max substitution for sde)."""
    sigmas = bench.make_sigmas()
    gen = torch.Generator().manual_seed(3)
    x, v, prev = (torch.randn(3, 2, 64, generator=gen) for _ in range(3))
    steps = torch.tensor([0, 4, 8])
    _, lp, mean, _ = baseline.flow_grpo_step(
        x, v, sigmas, steps, float(sigmas[1]), mode=mode, noise_level=0.7, prev_sample=prev)
    want = flowrl.step_log_prob(
        x, v, prev, sigmas, steps, mode=mode, noise_level=0.7, log_prob=baseline.LOG_PROB_KIND[mode], backend="torch")
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(mean).all()


def test_baseline_sde_mean_is_flow_grpo_formula():
    """Spot-check one element against the formula typed out by hand (Flow-GRPO's sde step)."""
    sigmas = bench.make_sigmas()
    sigma, sigma_prev, eta = float(sigmas[2]), float(sigmas[3]), 0.7
    x, v = torch.tensor([[0.3]]), torch.tensor([[-1.2]])
    mean, std_dev_t, step_std = baseline.flow_grpo_mean(
        x, v, sigmas, torch.tensor([2]), float(sigmas[1]), mode="sde", noise_level=eta)
    dt = sigma_prev - sigma
    s = math.sqrt(sigma / (1 - sigma)) * eta
    want = 0.3 * (1 + s**2 / (2 * sigma) * dt) + -1.2 * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    assert mean.item() == pytest.approx(want, rel=1e-6)
    assert step_std.item() == pytest.approx(s * math.sqrt(-dt), rel=1e-6)


def test_baseline_rejects_ambiguous_call():
    sigmas = bench.make_sigmas()
    x = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="exactly one of prev_sample"):
        baseline.flow_grpo_step(x, x, sigmas, torch.tensor([1]), 0.9, mode="sde", noise_level=0.7)
    with pytest.raises(ValueError, match="mode must be one of"):
        baseline.flow_grpo_mean(x, x, sigmas, torch.tensor([1]), 0.9, mode="dance", noise_level=0.7)


def test_check_catches_a_wrong_formula():
    """Flow-GRPO's own KL divides by std_dev_t**2, not the variance: off by a factor 1/D, caught."""
    case = bench.make_case((2, 256), torch.float32, "sde", torch.device("cpu"))
    sigmas = case.sigmas
    d = float(sigmas[bench.STEP_INDEX] - sigmas[bench.STEP_INDEX + 1])
    kl, grad = bench.build("eager", case, "kl_fwd_bwd")()
    with pytest.raises(AssertionError, match="differs from the eager baseline"):
        bench.check((kl * d, grad), (kl, grad))
    with pytest.raises(AssertionError, match="non-finite"):
        bench.check((kl * math.nan,), (kl,))
    assert bench.check((kl, grad), (kl, grad)) == 0.0


# ---- the runner's accounting --------------------------------------------------------------------

def test_min_bytes():
    n, b = 1000, 2
    assert bench.min_bytes("rollout", n, b, 2) == n * (2 + 2 + 4 + 2) + 4 * b  # x, v, fp32 noise, x'
    assert bench.min_bytes("recompute_fwd", n, b, 4) == n * 12 + 4 * b
    assert bench.min_bytes("recompute_fwd_bwd", n, b, 2) == n * 8 + 8 * b
    assert bench.min_bytes("kl_fwd_bwd", n, b, 4) == n * 16 + 8 * b
    with pytest.raises(ValueError, match="unknown op"):
        bench.min_bytes("step", n, b, 4)


def test_cpu_peak_bytes_sees_temporaries():
    x = torch.randn(1 << 18)  # 1 MiB

    def two_temporaries():
        return ((x * 2) + 1).sum()  # x * 2 and its + 1 are alive together: 2 MiB

    peak = bench.peak_extra_bytes(two_temporaries, torch.device("cpu"))
    assert 2 * x.nbytes <= peak < 3 * x.nbytes


def test_parse_arguments():
    assert bench.parse_shapes("1x4096x64,2x16x8x8") == [(1, 4096, 64), (2, 16, 8, 8)]
    for bad in ("1x", "0x8", "8", "axb"):
        with pytest.raises(Exception, match="shape"):
            bench.parse_shapes(bad)
    with pytest.raises(SystemExit):
        bench.main(["--ops", "rollout,nope"])


def test_cli_writes_csv_and_table(tmp_path, capsys):
    rc = bench.main([
        "--device", "cpu", "--shapes", "2x8x64", "--modes", "cps", "--dtypes", "bf16",
        "--ops", "recompute_fwd,recompute_fwd_bwd", "--impls", "flowrl-torch", "--timing-budget", "0.01",
        "--out", str(tmp_path),
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "CPU results on" in out and "| recompute_fwd_bwd | cps | bf16 | 2x8x64 | flowrl-torch |" in out
    (csv_path,) = tmp_path.glob("*.csv")
    assert (tmp_path / (csv_path.stem + ".md")).exists()
    rows = list(csv.DictReader(csv_path.open()))
    # eager is always added: every row is checked and compared against it
    assert sorted((r["op"], r["impl"]) for r in rows) == [
        ("recompute_fwd", "eager"), ("recompute_fwd", "flowrl-torch"),
        ("recompute_fwd_bwd", "eager"), ("recompute_fwd_bwd", "flowrl-torch")]
    for r in rows:
        assert r["device"] == "cpu" and r["note"] == ""
        assert float(r["time_ms"]) > 0 and float(r["gbps"]) > 0 and float(r["pct_copy"]) > 0
        assert float(r["check_err"]) < 1e-2
        if r["op"] == "recompute_fwd_bwd":
            assert float(r["peak_extra_mib"]) > 0
            assert float(r["grad_mib"]) == pytest.approx(2 * 8 * 64 * 2 / 2**20)
        if r["impl"] == "eager":
            assert float(r["x_eager"]) == 1.0
