"""Capturable steps: a T-step loop of ``flowrl.sde_step`` / ``step_log_prob`` / ``step_kl``, or of the
scheduler's ``step`` inside and outside ``rollout()`` (the model call excluded), reads no device value on
the host and allocates the same tensors every step, so it can be captured in a CUDA graph
(tests/kernels/test_gpu.py captures the ops on a GPU). These are the CPU-side checks, with two instruments:

``Watch("cpu")``: ordinary CPU tensors play the device, so *every* host read of a tensor's values counts.
  A ``TorchDispatchMode`` records each aten op that hands a value to the host or whose output shape
  depends on values: ``_local_scalar_dense`` (what ``.item()``, ``bool(t)`` / ``if t``, ``float(t)``,
  ``int(t)``, indexing a list with a tensor and ``f"{t:.2f}"`` reach on CPU), ``is_nonzero``, every op
  tagged ``data_dependent_output`` (``equal``, ``allclose``, ``item``) or ``dynamic_output_shape``
  (``nonzero``, ``masked_select``, ``unique``, ...), boolean-mask indexing (``index`` / ``index_put``
  with a bool index), and copies from the device to the host (``_to_copy``, ``copy_``, ``_copy_from``).
  On a CPU tensor ``.tolist()`` (read in C++), ``.cpu()`` (returns self), ``.numpy()`` and
  ``np.asarray(t)`` (only ``detach``) and ``repr(t)`` reach no aten op that says so (seen with a bare
  dispatch mode on torch 2.13), so ``torch.Tensor.tolist``, ``cpu``, ``numpy``, ``__array__`` and
  ``__repr__`` are wrapped while the watch is on; ``test_each_kind_of_host_read_is_caught`` is the
  negative control for every kind. What it cannot see: ``.to("cpu")`` of
  a CPU tensor, a no-op like ``.to(sample.device)``; the meta watch sees that one.
``Watch("meta")``: the same loops on meta tensors, which stand in for the accelerator: a meta tensor
  has no values, so any read raises (after the watch has recorded it), and ``.to("cpu")`` is a visible
  ``_to_copy``. Host-to-device copies are recorded as uploads. The checks that read values cannot run on
  meta tensors, so these loops run inside ``no_value_checks()`` or with capture simulated
  (``_validate.capturing`` returning True, as ``torch.cuda.is_current_stream_capturing()`` does there).

What counts as a read: a read of a tensor on the device. Host work on host state is not one: drawing
noise from CPU ``torch.Generator``s, or ``reference.sin_half_pi`` turning the Python float noise level
into a float32 constant once (lru-cached per level, a CPU tensor made from a Python float; warm-up calls
fill the cache before the CPU watch). But a CPU generator's noise reaches a CUDA sample as an upload per
step, which a graph cannot replay (pageable host-to-device copies are refused while capturing, and a
replay would not redraw): the meta watch records those uploads, and the tests assert that CPU generators
are the only per-step uploads. A captured loop draws from CUDA generators, or passes ``noise=`` or
``noise_seed=`` (a seed tensor, updated in place between replays).

What the step path reads on the host, and what a capturing user does about it:

* The value checks of the functional ops read the schedule (``check_sigmas``) and a step-index tensor's
  range (``check_step_index``) once per tensor identity and version; after that, nothing. They are
  skipped while capturing and inside ``flowrl.no_value_checks()``.
* The scheduler's first ``step`` looks the timestep up in the schedule when ``begin_index`` is None
  (``timestep_lookup.index_for_timestep``: one ``int()``, as diffusers' ``_init_step_index`` does). It
  cannot go without changing results: the index is a Python int that slices the schedule (img2img
  starts mid-schedule). A capturing user calls ``scheduler.set_begin_index(0)`` (or its img2img start)
  after ``set_timesteps``; Flux and QwenImage pipelines already do.
* A rollout validates its own copy of the schedule on its first step (once per rollout; skipped while
  capturing and inside ``no_value_checks()``), and copies the schedule to the sample's device: an upload
  unless ``set_timesteps(..., device=...)`` put it there (pipelines do, through retrieve_timesteps).
* The recorder compares a step's input with the previous step's output (``torch.equal``, for its
  changed-latents warning) when they are different tensor objects; skipped while capturing and inside
  ``no_value_checks()``, so feed each step's output to the next step or use that opt-out.

Per-step allocations: every step allocates tensors of the same shapes and dtypes, in the same order
(the Python step index changes fill values, not sizes). A rollout's first step also copies the
schedule (sigmas [T + 1], timesteps [T]); the recorder keeps the steps' outputs (views, no copies) in a
dict and a list, which hold the graph's output tensors under capture.

Triton under TRITON_INTERPRET=1: the interpreter runs kernels on the host and reads their arguments'
values, so the watch is paused inside ``_triton_ops._launch`` (a kernel launch on a GPU reads no value:
tests/kernels/test_gpu.py captures it); everything around the launches is watched.
"""
from __future__ import annotations

import functools
import os
import traceback

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import flowrl
import flowrl.backends.reference
from flowrl.core import _validate
from flowrl.rollout.recorder import rollout
from flowrl.rollout.scheduler import FlowMatchEulerDiscreteScheduler as Sched

aten = torch.ops.aten
T, B, SHAPE = 4, 2, (2, 4, 8)

_READ_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
_READ_TAGS = tuple(  # cudagraph_unsafe is newer than torch 2.4
    getattr(torch.Tag, name) for name in ("data_dependent_output", "dynamic_output_shape", "cudagraph_unsafe")
    if hasattr(torch.Tag, name)
)
_MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_WRAPPED = ("tolist", "cpu", "numpy", "__array__", "__repr__")  # on a CPU tensor these reach no telling aten op


def _where() -> str:
    """``file:function`` of the innermost caller outside torch and this watch (a flowrl or diffusers
    function, or the test); comprehensions report their enclosing function."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" in path or (frame.filename == __file__ and frame.name in _WATCH_FRAMES):
            continue
        if frame.name in ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"):
            continue
        return f"{path.rsplit('/', 1)[-1]}:{frame.name}"
    return "?"


_WATCH_FRAMES = {"_where", "_inspect", "__torch_dispatch__", "wrapped"}


class Watch(TorchDispatchMode):
    """Records host reads of tensors on ``device``, host-to-device uploads, and the (op, shape, dtype)
    of every tensor an op returns in new storage (a return without alias info in the op's schema)."""

    active = None  # the watch that kernel launches pause

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.reads, self.uploads, self.allocs = [], [], []
        self.paused = 0
        self._saved = {}

    # ---------------------------------------------------------------- context
    def __enter__(self):
        for name in _WRAPPED:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        Watch.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            Watch.active = None
            for name, original in self._saved.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)

    def _wrap(self, name, method):
        @functools.wraps(method)
        def wrapped(t, *args, **kwargs):
            if not self.paused and self._on_device(t):
                self.reads.append((f"Tensor.{name}", _where()))
            return method(t, *args, **kwargs)

        return wrapped

    def unwatched(self, fn):
        """``fn`` with the watch paused while it runs (Triton's interpreter emulating a launch)."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return call

    # ---------------------------------------------------------------- dispatch
    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device == self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self._inspect(func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.paused:
            rets = out if isinstance(out, (tuple, list)) else (out,)
            for ret, o in zip(func._schema.returns, rets):
                if ret.alias_info is None:
                    for t in o if isinstance(o, (tuple, list)) else (o,):
                        if isinstance(t, torch.Tensor):
                            self.allocs.append((func.overloadpacket.__name__, tuple(t.shape), t.dtype))
        return out

    def _inspect(self, func, args, kwargs) -> None:
        copy = self._copy_devices(func, args, kwargs)
        if copy is not None:
            src, dst = copy
            if src == self.device and dst.type == "cpu" and self.device.type != "cpu":
                self.reads.append((f"{func} to the host", _where()))
            elif src.type == "cpu" and dst == self.device and self.device.type != "cpu":
                self.uploads.append((str(func), _where()))
            return
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not any(self._on_device(t) for t in tensors):
            return
        if func in _MASK_INDEX_OPS:  # tagged dynamic_output_shape, but an integer index has a static shape
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                self.reads.append((f"{func} with a boolean mask", _where()))
        elif func in _READ_OPS or any(tag in func.tags for tag in _READ_TAGS):
            self.reads.append((str(func), _where()))

    @staticmethod
    def _copy_devices(func, args, kwargs):
        """(source device, destination device) of a copy op, else None."""
        if func is aten._to_copy.default:
            return args[0].device, torch.device(kwargs.get("device") or args[0].device)
        if func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            return args[1].device, args[0].device
        if func in (aten._copy_from.default, aten._copy_from_and_resize.default):
            return args[0].device, args[1].device
        return None

    @property
    def read_sites(self):
        return sorted({where for _, where in self.reads})


@pytest.fixture
def kernel_launches_unwatched(monkeypatch):
    """Triton's interpreter reads kernel arguments on the host; on a GPU a launch reads nothing."""
    from flowrl.backends import _triton_ops

    launch = _triton_ops._launch

    def paused_launch(*args, **kwargs):
        watch = Watch.active
        return (watch.unwatched(launch) if watch is not None else launch)(*args, **kwargs)

    monkeypatch.setattr(_triton_ops, "_launch", paused_launch)


def _triton_runs_here() -> bool:
    from flowrl.backends._dispatch import interpreter_enabled, triton_available

    return triton_available() and (torch.cuda.is_available() or interpreter_enabled())


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not _triton_runs_here(), reason="needs triton with CUDA or TRITON_INTERPRET=1"))]


def watched(fn, device="cpu"):
    with Watch(device) as w:
        result = fn()
    return w, result


def same_allocations(watches):
    first = watches[0].allocs
    assert first, "the instrument saw no allocation at all"
    for k, w in enumerate(watches[1:], 1):
        assert w.allocs == first, f"call {k} allocates differently from call 0:\n{w.allocs}\nvs\n{first}"


def schedule(device="cpu"):
    t = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    return (3.0 * t / (1 + 2.0 * t)).to(torch.float32).to(device)


# ---------------------------------------------------------------------------------- the instrument


def _host_reads():
    t, s, i = torch.tensor([1.5, -2.0]), torch.tensor(3.0), torch.tensor([1, 0])
    return {
        "item": lambda: s.item(), "bool": lambda: bool(s), "if": lambda: 1 if s else 0, "float": lambda: float(s),
        "int": lambda: int(s), "list index": lambda: [10, 20][i[0]], "format": lambda: f"{s:.2f}",
        "tolist": lambda: t.tolist(), "cpu": lambda: t.cpu(), "numpy": lambda: t.numpy(),
        "np.asarray": lambda: np.asarray(t), "repr": lambda: repr(t), "equal": lambda: torch.equal(t, t),
        "allclose": lambda: torch.allclose(t, t), "nonzero": lambda: t.nonzero(), "mask index": lambda: t[t > 0],
        "mask assign": lambda: t.clone().__setitem__(t > 0, 0.0), "unique": lambda: torch.unique(t),
        "any": lambda: bool((t > 0).any()),
    }


@pytest.mark.parametrize("kind", sorted(_host_reads()))
def test_each_kind_of_host_read_is_caught(kind):
    w, _ = watched(_host_reads()[kind])
    assert w.reads, f"{kind} was not caught"
    assert all(where == "test_capturable.py:<lambda>" for where in w.read_sites), w.reads
    # and the wrappers are gone afterwards
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist and "cpu" not in torch.Tensor.__dict__


@pytest.mark.parametrize("kind", ["item", "bool", "tolist", "cpu", "to cpu", "numpy", "equal", "nonzero"])
def test_each_kind_of_device_read_is_caught_on_meta_tensors(kind):
    t = torch.empty(2, device="meta")
    read = {
        "item": lambda: t[0].item(), "bool": lambda: bool(t[0]), "tolist": lambda: t.tolist(), "cpu": lambda: t.cpu(),
        "to cpu": lambda: t.to("cpu"), "numpy": lambda: t.numpy(), "equal": lambda: torch.equal(t, t),
        "nonzero": lambda: t.nonzero(),
    }[kind]
    with Watch("meta") as w, pytest.raises((RuntimeError, NotImplementedError, TypeError)):
        read()  # a meta tensor has no values: the read fails after the watch has recorded it
    assert w.reads and w.read_sites == ["test_capturable.py:<lambda>"], w.reads
    # host work and uploads are not reads; uploads are recorded
    with Watch("meta") as w:
        float(torch.tensor(0.5))  # a CPU value: host arithmetic
        torch.ones(2).to("meta")
    assert w.reads == [] and len(w.uploads) == 1


def test_varying_allocations_are_caught():
    with pytest.raises(AssertionError, match="call 1 allocates differently"):
        same_allocations([watched(lambda: torch.empty(k + 1) * 2)[0] for k in range(2)])


# ---------------------------------------------------------------------------------- functional ops


def _op_loop_inputs(step_kind, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(SHAPE, generator=g).to(device) for _ in range(3))
    noises = [torch.randn(SHAPE, generator=g).to(device) for _ in range(T)]
    if step_kind == "int":
        steps = list(range(T))
    else:  # one per-sample step-index tensor, reused by every call (a training batch's)
        steps = [torch.tensor([1, 3]).to(device)] * T
    return x, v, v_ref, noises, steps


def _noise_kwargs(noise_kind, noise, gens, device="cpu"):
    return {
        "noise": {"noise": noise},
        "generators": {"generator": gens},
        "seed int": {"noise_seed": 7},
        "seed tensor": {"noise_seed": torch.tensor([5, 9]).to(device)},
    }[noise_kind]


def _ops(x, v, v_ref, sigmas, step, backend, noise_kwargs):
    out = flowrl.sde_step(x, v, sigmas, step, backend=backend, **noise_kwargs)
    lp = flowrl.step_log_prob(x, v, out.prev_sample, sigmas, step, backend=backend)
    kl = flowrl.step_kl(x, v, v_ref, sigmas, step, backend=backend)
    return out.prev_sample, out.log_prob, lp, kl


NOISE_KINDS = ["noise", "generators", "seed int", "seed tensor"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("step_kind", ["int", "tensor"])
def test_ops_read_only_the_first_calls_checks(step_kind, noise_kind, backend, request):
    if backend == "triton":
        request.getfixturevalue("kernel_launches_unwatched")
    x, v, v_ref, noises, steps = _op_loop_inputs(step_kind)
    gens = [torch.Generator().manual_seed(s) for s in range(B)]
    flowrl.backends.reference.sin_half_pi(0.7, torch.float32)  # host constant of the noise level, cached
    sigmas = schedule()  # a new schedule: its values are read by the first call
    watches = []
    for i in range(T):
        w, _ = watched(lambda: _ops(x, v, v_ref, sigmas, steps[i], backend, _noise_kwargs(noise_kind, noises[i], gens)))
        watches.append(w)
    expected = {"_validate.py:check_sigmas"} | ({"_validate.py:check_step_index"} if step_kind == "tensor" else set())
    assert set(watches[0].read_sites) == expected, watches[0].reads
    for i, w in enumerate(watches[1:], 1):
        assert w.reads == [], f"call {i} read {w.reads}"
    same_allocations(watches[1:])

    # a new step-index tensor is read once (the range check); inside no_value_checks(), a new schedule and
    # a new step-index tensor are not read at all
    fresh = torch.tensor([0, 2])
    w, _ = watched(lambda: _ops(x, v, v_ref, sigmas, fresh, backend, _noise_kwargs(noise_kind, noises[0], gens)))
    assert w.read_sites == ["_validate.py:check_step_index"], w.reads
    with flowrl.no_value_checks():
        w, _ = watched(lambda: _ops(x, v, v_ref, schedule(), torch.tensor([0, 2]), backend,
                                    _noise_kwargs(noise_kind, noises[0], gens)))
    assert w.reads == [], w.reads


@pytest.mark.parametrize("skip", ["no_value_checks", "capturing"])
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("step_kind", ["int", "tensor"])
def test_ops_read_no_device_value_on_meta_tensors(step_kind, noise_kind, skip, monkeypatch):
    # backend="torch" only: Triton's interpreter needs values. CPU generators are the only uploads.
    x, v, v_ref, noises, steps = _op_loop_inputs(step_kind, "meta")
    gens = [torch.Generator().manual_seed(s) for s in range(B)]
    sigmas = schedule("meta")
    if skip == "capturing":
        monkeypatch.setattr(_validate, "capturing", lambda: True)
    watches = []
    with flowrl.no_value_checks() if skip == "no_value_checks" else _nothing():
        for i in range(T):
            kwargs = _noise_kwargs(noise_kind, noises[i], gens, "meta")
            watches.append(watched(lambda: _ops(x, v, v_ref, sigmas, steps[i], "torch", kwargs), "meta")[0])
    for i, w in enumerate(watches):
        assert w.reads == [], f"call {i} read {w.reads}"
        assert len(w.uploads) == (B if noise_kind == "generators" else 0), w.uploads  # one row per generator
        if w.uploads:
            assert {where for _, where in w.uploads} == {"step_spec.py:draw_noise"}
    same_allocations(watches)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------- scheduler loops


def _scheduler(kind):
    if kind == "diffusers":
        diffusers = pytest.importorskip("diffusers")
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return Sched(shift=3.0)


def _rollout_loop(sched, x, velocities, device=None, on_step=None, **options):
    """T steps of ``sched.step`` inside a rollout, each under its own watch (``device``, or none).
    ``on_step(i, x)`` may replace a step's input."""
    watches = []
    with rollout(sched, **options) as rec:
        for i, t in enumerate(sched.timesteps):
            sample = x if on_step is None else on_step(i, x)
            if device is None:
                x = sched.step(velocities[i], t, sample).prev_sample
            else:
                w, x = watched(lambda: sched.step(velocities[i], t, sample).prev_sample, device)
                watches.append(w)
    return watches, rec, x


def _loop_data(device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, generator=g).to(device=device, dtype=dtype)
    return x, [torch.randn(SHAPE, generator=g).to(device=device, dtype=dtype) for _ in range(T)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("begin", [None, 0])
@pytest.mark.parametrize("kind", ["flowrl", "diffusers"])
def test_rollout_loop_reads_on_its_first_step_only(kind, begin, backend, request):
    if backend == "triton":
        request.getfixturevalue("kernel_launches_unwatched")
    flowrl.backends.reference.sin_half_pi(0.7, torch.float32)
    x, velocities = _loop_data()
    options = dict(mode="sde", noise_level=0.7, backend=backend)

    def run(device):
        sched = _scheduler(kind)
        sched.set_timesteps(T)
        if begin is not None:
            sched.set_begin_index(begin)
        gens = [torch.Generator().manual_seed(s) for s in range(B)]
        return _rollout_loop(sched, x, velocities, device, generator=gens, **options)

    watches, rec, out = run("cpu")
    # step 0: the timestep lookup (unless begin_index is set) and the check of the rollout's schedule copy
    expected = {"_validate.py:check_sigmas"} | ({"timestep_lookup.py:index_for_timestep"} if begin is None else set())
    assert set(watches[0].read_sites) == expected, watches[0].reads
    for i, w in enumerate(watches[1:], 1):
        assert w.reads == [], f"step {i} read {w.reads}"
    same_allocations(watches[1:])
    # step 0 allocates what every step does, plus the rollout's copies of the schedule
    extra = list(watches[0].allocs)
    for a in watches[1].allocs:
        extra.remove(a)
    assert ("_to_copy", (T + 1,), torch.float32) in extra and ("_to_copy", (T,), torch.float32) in extra, extra

    if begin is not None:  # with the begin index set, no_value_checks() leaves nothing to read, first step included
        with flowrl.no_value_checks():
            quiet, _, _ = run("cpu")
        assert [w.reads for w in quiet] == [[]] * T, [w.reads for w in quiet]

    # the watch changes nothing: the same bits as an unwatched loop
    _, rec2, out2 = run(None)
    assert torch.equal(out, out2)
    for field in ("latents", "log_probs"):
        assert torch.equal(getattr(rec.trajectory(), field), getattr(rec2.trajectory(), field))


@pytest.mark.parametrize("schedule_on", ["device", "host"])
@pytest.mark.parametrize("skip", ["no_value_checks", "capturing"])
@pytest.mark.parametrize("kind", ["flowrl", "diffusers"])
def test_rollout_loop_with_begin_index_reads_no_device_value(kind, skip, schedule_on, monkeypatch):
    # the loop as a capturing user runs it: set_timesteps, set_begin_index(0), then T steps
    x, velocities = _loop_data("meta")
    sched = _scheduler(kind)
    sched.set_timesteps(T, device="meta" if schedule_on == "device" else None)
    sched.set_begin_index(0)
    if skip == "capturing":
        monkeypatch.setattr(_validate, "capturing", lambda: True)
    with flowrl.no_value_checks() if skip == "no_value_checks" else _nothing():
        # generator=None: the default generator of the device (capture-safe on CUDA); CPU generators upload
        watches, rec, _ = _rollout_loop(sched, x, velocities, "meta", mode="sde", noise_level=0.7, backend="torch")
        gens = [torch.Generator().manual_seed(s) for s in range(B)]
        sched.set_timesteps(T, device="meta" if schedule_on == "device" else None)
        sched.set_begin_index(0)
        with_gens, _, _ = _rollout_loop(sched, x, velocities, "meta", mode="sde", noise_level=0.7, generator=gens)
    for i, w in enumerate(watches + with_gens):
        assert w.reads == [], f"step {i % T} read {w.reads}"
    for w in watches[1:]:
        assert w.uploads == []
    # a schedule on the host is uploaded once, on the first step (sigmas and timesteps), when the
    # rollout takes its snapshot (RolloutRecorder._start and its _loop_schedule)
    assert len(watches[0].uploads) == (2 if schedule_on == "host" else 0), watches[0].uploads
    assert {where for _, where in watches[0].uploads} <= {"recorder.py:_start", "recorder.py:_loop_schedule"}
    assert all(len(w.uploads) == B + (2 if schedule_on == "host" and i == 0 else 0) for i, w in enumerate(with_gens))
    same_allocations(watches[1:])
    assert rec.trajectory().log_probs.shape == (B, T)


def test_first_step_timestep_lookup_is_a_device_read_without_begin_index():
    # why a capturing user calls set_begin_index(0): without it the first step finds its schedule index by
    # looking the timestep up, a Python int read from the device (diffusers' own step does the same)
    x, velocities = _loop_data("meta")
    sched = Sched(shift=3.0)
    sched.set_timesteps(T, device="meta")
    with flowrl.no_value_checks(), Watch("meta") as w, pytest.raises(RuntimeError, match="meta"):
        with sched.rollout(mode="sde", noise_level=0.7):
            sched.step(velocities[0], sched.timesteps[0], x)
    assert w.read_sites == ["timestep_lookup.py:index_for_timestep"], w.reads


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("begin", [None, 0])
def test_plain_step_loop_reads_only_the_first_lookup(begin, device):
    x, velocities = _loop_data(device)
    sched = Sched(shift=3.0)
    sched.set_timesteps(T, device=device)
    if begin is not None:
        sched.set_begin_index(begin)
    watches = []
    for i, t in enumerate(sched.timesteps):
        if device == "meta" and i == 0 and begin is None:
            with Watch(device) as w, pytest.raises(RuntimeError, match="meta"):
                sched.step(velocities[i], t, x)
            assert w.read_sites == ["timestep_lookup.py:index_for_timestep"], w.reads
            sched._step_index = 0  # what the lookup would have found
        w, x = watched(lambda: sched.step(velocities[i], t, x).prev_sample, device)
        watches.append(w)
    if begin is None and device == "cpu":
        assert watches[0].read_sites == ["timestep_lookup.py:index_for_timestep"], watches[0].reads
        watches = watches[1:]
    for w in watches:
        assert w.reads == [] and w.uploads == [], (w.reads, w.uploads)
    same_allocations(watches)


@pytest.mark.parametrize("skip", [None, "no_value_checks", "capturing"])
def test_changed_latents_check_reads_only_when_value_reads_are_allowed(skip, monkeypatch):
    # a step whose input is not the previous step's output (an inpainting blend, a copy) is compared with
    # it for the recorder's warning: a device read, skipped while capturing and inside no_value_checks()
    x, velocities = _loop_data()
    sched = Sched(shift=3.0)
    sched.set_timesteps(T)
    sched.set_begin_index(0)
    if skip == "capturing":
        monkeypatch.setattr(_validate, "capturing", lambda: True)
    with flowrl.no_value_checks() if skip == "no_value_checks" else _nothing():
        watches, _, _ = _rollout_loop(sched, x, velocities, "cpu", on_step=lambda i, x: x.clone(), mode="sde")
    for w in watches[1:]:
        assert w.read_sites == ([] if skip else ["recorder.py:_record"]), w.reads
