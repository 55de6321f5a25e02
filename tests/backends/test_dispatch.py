"""The backend table and its choice (FLOWRL_BACKEND, auto), kernel build failures, launch grids for
any batch size, and the checks that read device values (cached, and the no_value_checks opt-out)."""
import inspect

import pytest
import torch

import flowrl
from flowrl.backends import _dispatch
from flowrl.core import _validate
from flowrl.contract import LogProbKind, Mode, NoiseSource, Op, Reduction

needs_interpreter = pytest.mark.skipif(not _dispatch.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")


def schedule(n=10):
    t = torch.linspace(1, 0, n + 1, dtype=torch.float64)
    return (3 * t / (1 + 2 * t)).to(torch.float32)


def data(shape=(2, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def test_backend_table_names_every_backend_and_its_ops():
    assert set(_dispatch.BACKEND_TABLE) == {"torch", "triton"}
    assert set(_dispatch.BACKENDS) == {"auto"} | set(_dispatch.BACKEND_TABLE)
    ops = _dispatch.backend("torch")
    assert ops.name == "torch"
    for op in ("sde_step", "step_log_prob", "step_kl"):
        assert list(inspect.signature(getattr(ops, op)).parameters)[0] == "spec"


@pytest.fixture
def spy_backend(monkeypatch):
    """The torch backend with its ops recording the spec they receive."""
    real = _dispatch.backend("torch")
    specs = []

    def recording(op):
        return lambda spec, *tensors: specs.append(spec) or op(spec, *tensors)
    monkeypatch.setitem(_dispatch.BACKEND_TABLE, "torch", lambda: _dispatch.Backend(
        "torch", recording(real.sde_step), recording(real.step_log_prob), recording(real.step_kl)))
    _dispatch.backend.cache_clear()
    yield specs
    _dispatch.backend.cache_clear()


def test_the_spec_carries_every_argument_to_the_backend(spy_backend):
    """A parameter is followed from the public op to the backend through the spec's named fields."""
    x, v, prev = data()
    flowrl.step_log_prob(x, v, prev, schedule(), torch.tensor([3, 4]), mode="dance", noise_level=0.25,
                         log_prob_kind="sq_err", reduction="sum", backend="torch")
    flowrl.step_kl(x, v, prev, schedule(), 2, mode="cps", noise_level=0.5, backend="torch")
    lp_spec, kl_spec = spy_backend
    assert (lp_spec.op, lp_spec.mode, lp_spec.noise_level, lp_spec.kind, lp_spec.reduction) == (
        Op.LOG_PROB, Mode.DANCE, 0.25, LogProbKind.SQ_ERR, Reduction.SUM)
    assert lp_spec.step_index.dtype == torch.int64 and lp_spec.step_index.tolist() == [3, 4]
    assert lp_spec.numel == 40 and lp_spec.shard is None and lp_spec.noise_source is NoiseSource.NONE
    assert (kl_spec.op, kl_spec.mode, kl_spec.kind, kl_spec.reduction) == (Op.KL, Mode.CPS, LogProbKind.KL, Reduction.MEAN)
    assert kl_spec.step_index.tolist() == [2, 2]
    with pytest.raises(Exception):
        lp_spec.noise_level = 0.5  # immutable


def test_the_rollout_spec_names_its_noise_source(spy_backend):
    x, v, noise = data()
    sig = schedule()
    flowrl.sde_step(x, v, sig, 1, noise=noise, out_dtype=torch.bfloat16, backend="torch")
    flowrl.sde_step(x, v, sig, 1, generator=torch.Generator().manual_seed(0), backend="torch",
                    return_prev_sample_mean=False)  # drawn by the op
    flowrl.sde_step(x, v, sig, 1, noise_seed=5, backend="torch")
    flowrl.sde_step(x, v, sig, 1, mode="ode", backend="torch")
    flowrl.sde_step(x, v, sig, 1, mode="cps", noise_level=0.0, backend="torch")
    assert [s.noise_source for s in spy_backend] == [NoiseSource.TENSOR, NoiseSource.TENSOR, NoiseSource.PHILOX,
                                                     NoiseSource.NONE, NoiseSource.NONE]
    assert spy_backend[0].out_dtype == torch.bfloat16 and spy_backend[0].return_mean
    assert spy_backend[1].out_dtype == torch.float32 and not spy_backend[1].return_mean
    assert spy_backend[2].noise_seed.seeds.tolist() == [5, 5] and spy_backend[2].noise_seed.stream_stride == 1


# ------------------------------------------------------------------------------- FLOWRL_BACKEND


def test_flowrl_backend_env_overrides_auto_only(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(_dispatch.ENV_VAR, "torch")
    assert _dispatch.resolve("auto", cpu, torch.float32) == "torch"
    monkeypatch.setenv(_dispatch.ENV_VAR, " TORCH ")  # case and spaces forgiven
    assert _dispatch.resolve("auto", cpu, torch.float32) == "torch"
    monkeypatch.setenv(_dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="FLOWRL_BACKEND must be one of auto, torch, triton; got 'cuda'"):
        _dispatch.resolve("auto", cpu, torch.float32)
    # an explicit backend= argument wins over the environment
    assert _dispatch.resolve("torch", cpu, torch.float32) == "torch"


@needs_interpreter
def test_flowrl_backend_triton_runs_the_kernels_for_auto(monkeypatch):
    from flowrl.backends import _triton_ops

    calls = []
    real = _triton_ops.step_log_prob
    monkeypatch.setitem(_dispatch.BACKEND_TABLE, "triton", lambda: _dispatch.Backend(
        "triton", _triton_ops.sde_step, lambda *a: calls.append(1) or real(*a), _triton_ops.step_kl))
    _dispatch.backend.cache_clear()
    try:
        x, v, prev = data()
        monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
        got = flowrl.step_log_prob(x, v, prev, schedule(), 2)  # backend="auto"
        assert calls == [1]
        monkeypatch.delenv(_dispatch.ENV_VAR)
        want = flowrl.step_log_prob(x, v, prev, schedule(), 2)  # auto on CPU: torch
        assert calls == [1]
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    finally:
        _dispatch.backend.cache_clear()


# --------------------------------------------------------------------------- kernel build failure


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_kernel_that_fails_to_build_raises_naming_it(monkeypatch, backend):
    """No silent fallback: whether triton was asked for or chosen by auto, the error names the
    kernel, its switches and the triton version, and says how to run the torch path."""
    import triton
    from triton.compiler.errors import CompilationError

    from flowrl.backends import _triton_ops

    class Unbuildable:
        __name__ = "finalize_kernel"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise CompilationError("<kernel source>", None, "NameError: global PLAIN_INT")
            return launch

    monkeypatch.setattr(_triton_ops, "finalize_kernel", Unbuildable())
    monkeypatch.setenv(_dispatch.ENV_VAR, "triton")
    x, v, prev = data()
    with pytest.raises(_triton_ops.KernelCompileError) as info:
        flowrl.step_log_prob(x, v, prev, schedule(), 2, backend=backend)
    message = str(info.value)
    assert f"triton {triton.__version__}" in message and "KIND=0" in message and "MODE=1" in message
    assert "backend='torch'" in message and "FLOWRL_BACKEND=torch" in message


# ------------------------------------------------------------------------------ any batch size


@needs_interpreter
def test_the_grid_is_one_program_per_sample_and_block_of_chunks(monkeypatch):
    """The element kernels launch a 1-D grid of B * blocks programs: a batch above 65,535 (the limit
    of a CUDA grid's second axis) is one launch, not an error (tests/kernels/test_gpu.py runs one on CUDA)."""
    from flowrl.backends import _triton_ops

    grids = []
    real_launch = _triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        grids.append((getattr(kernel, "__name__", getattr(getattr(kernel, "fn", None), "__name__", "?")), grid))
        if grid[0] > 4096:  # don't interpret 70,000 programs: the grid is what is checked here
            return None
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", record)
    x, v, prev = data((3, 9 * 1024 + 5))  # 10 chunks per sample
    group, _ = _triton_ops.launch_config(9 * 1024 + 5)
    flowrl.step_log_prob(x, v, prev, schedule(), 2, backend="triton")
    assert [g for _, g in grids] == [(3 * -(-10 // group),), (3,)]  # partials, finalize: two launches
    grids.clear()
    big = torch.zeros(70_000, 3)
    flowrl.step_log_prob(big, big, big, schedule(), 2, backend="triton")
    assert [g for _, g in grids] == [(70_000,), (70_000,)]


# ---------------------------------------------------------------------- checks of device values


def test_step_index_range_is_read_once_per_tensor_version(monkeypatch):
    reads = []
    real = torch.aminmax
    monkeypatch.setattr(_validate.torch, "aminmax", lambda t: reads.append(1) or real(t))
    x, v, prev = data((3, 8))
    sig = schedule()
    idx = torch.tensor([0, 5, 9])
    flowrl.step_log_prob(x, v, prev, sig, idx)
    flowrl.step_kl(x, v, prev, sig, idx)
    flowrl.step_log_prob(x, v, prev, sig, idx)
    assert len(reads) == 1  # the same tensor: checked once
    idx[1] = 10  # in place: a new version, checked again, and now out of range
    with pytest.raises(ValueError, match=r"step_index must be in \[0, 9\] .* got values in \[0, 10\]"):
        flowrl.step_log_prob(x, v, prev, sig, idx)
    assert len(reads) == 2
    flowrl.step_log_prob(x, v, prev, sig, 3)  # an int needs no read
    assert len(reads) == 2
    # the same tensor against a shorter schedule is a different check
    with pytest.raises(ValueError, match=r"step_index must be in \[0, 4\]"):
        flowrl.step_log_prob(x, v, prev, schedule(5), torch.tensor([0, 5, 4]))


def test_no_value_checks_reads_no_device_value(monkeypatch):
    reads = []
    real_aminmax, real_cpu = torch.aminmax, torch.Tensor.cpu
    monkeypatch.setattr(_validate.torch, "aminmax", lambda t: reads.append("step_index") or real_aminmax(t))
    x, v, prev = data((3, 8))
    with flowrl.no_value_checks():
        sig = schedule()  # a new schedule: its values would be read outside the context
        monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: reads.append("sigmas") or real_cpu(t, *a, **k))
        lp = flowrl.step_log_prob(x, v, prev, sig, torch.tensor([0, 5, 9]))
        monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
    assert reads == [] and torch.isfinite(lp).all()
    # outside, both are read again, and a bad value raises
    with pytest.raises(ValueError, match=r"step_index must be in \[0, 9\]"):
        flowrl.step_log_prob(x, v, prev, sig, torch.tensor([0, 5, 10]))
    assert reads == ["step_index"]
    # every check that reads no device value still runs inside
    with flowrl.no_value_checks(), pytest.raises(ValueError, match="noise_level must be >= 0; got -1.0"):
        flowrl.step_log_prob(x, v, prev, sig, 1, noise_level=-1.0)


def test_sin_half_pi_is_cached_per_noise_level(monkeypatch):
    from flowrl.backends import reference

    reference.sin_half_pi.cache_clear()
    x, v, noise = data()
    for _ in range(3):
        flowrl.sde_step(x, v, schedule(), 2, mode="cps", noise_level=0.3, noise=noise, backend="torch")
    info = reference.sin_half_pi.cache_info()
    assert info.misses == 1 and info.hits == 2


def test_a_refused_backend_draws_no_noise():
    """Arguments are refused before the generator advances: a bad backend leaves its state as it was."""
    x, v, _ = data()
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'triton'; got 'cuda'"):
        flowrl.sde_step(x, v, schedule(), 1, generator=gen, backend="cuda")
    assert torch.equal(gen.get_state(), state)
