"""``teacher_kl_loss``'s block (``flowrl.losses`` checks its no-grad inputs): ``flowrl.step_kl``, which
validates the step's arguments, and the batch mean. Eager mode calls ``teacher_kl``; under
``torch.compile`` the custom op ``flowrl::teacher_kl_loss`` (flowrl/losses/_custom_ops.py) runs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..core import _validate as V
from ..core.step_spec import ShardContext
from ..ops._custom_ops import traced
from ..ops.functional import step_kl
from ._common import _check_no_grad


@dataclass(frozen=True)
class StepKLExtras:
    """``step_kl``'s inputs beyond one stream's step on one device, each None when not used: ``shard``
    (the sequence-parallel context), ``token_sigmas`` and ``frozen`` (per-token schedules and frozen masks)
    and ``stream_weights`` (a joint step's, with tuples of streams). The custom op
    ``flowrl::teacher_kl_loss`` takes none of them: a call with any runs eagerly."""

    shard: Optional[ShardContext] = None
    token_sigmas: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None
    stream_weights: Optional[Sequence[float]] = None


def teacher_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode, noise_level, reduction, backend,
               extras: StepKLExtras = StepKLExtras()):
    """(loss, per-sample KL [B] detached): the batch mean of ``flowrl.step_kl`` to the teacher (``extras``:
    step_kl's sequence-parallel context, per-token inputs and stream weights, ``StepKLExtras``)."""
    kl = step_kl(sample, model_output, teacher_model_output, sigmas, step_index, mode=mode, noise_level=noise_level,
                 reduction=reduction, backend=backend, shard=extras.shard, token_sigmas=extras.token_sigmas,
                 frozen=extras.frozen, stream_weights=extras.stream_weights)
    return batch_mean(kl), kl.detach()


def batch_mean(kl):
    """The loss of a per-sample KL [B]: its batch mean; on an empty batch (B = 0: kl is [0] on
    model_output's graph) its sum, the loss's zero (a mean is 0/0)."""
    return kl.sum() if kl.shape[0] == 0 else kl.mean()


# ------------------------------------------------------------------ several teachers (docs/losses.md)
#
# One teacher's KL is a quadratic form of the two outputs' difference: per element
# (c v - c v_k)^2 / (2 std^2), reduced, with c and std the step's (the same for every teacher). So for
# weights p_k >= 0 summing to 1 and v_bar = sum_k p_k v_k:
#     sum_k p_k KL(v, v_k) = KL(v, v_bar) + sum_k p_k KL(v_k, v_bar)
# (the cross terms sum to 0). The first term carries all of the value's dependence on v and its exact
# gradient, in one fused step_kl pass over (v, v_bar); the second reads the teachers only (no gradient).


def _streams(teacher, name: str):
    """A teacher's tensors with their names: one tensor, or a joint step's tuple of streams."""
    if isinstance(teacher, (tuple, list)):
        return [(f"{name}[{s}]", t) for s, t in enumerate(teacher)]
    return [(name, teacher)]


def _map_streams(fn, teachers):
    """``fn(list of the teachers' tensors of one stream)`` per stream, as a teacher's structure."""
    if isinstance(teachers[0], (tuple, list)):
        return tuple(fn([t[s] for t in teachers]) for s in range(len(teachers[0])))
    return fn(list(teachers))


def several_teachers(teacher_model_output, joint: bool) -> bool:
    """Whether ``teacher_model_output`` holds several teachers: a tuple or list of tensors (a joint
    step's: a tuple or list of tuples of streams)."""
    if not isinstance(teacher_model_output, (tuple, list)):
        return False
    return not joint or (len(teacher_model_output) > 0 and isinstance(teacher_model_output[0], (tuple, list)))


def check_teachers(teachers, joint: bool) -> None:
    """Every teacher a tensor (joint: a tuple of the same number of streams), each stream of the first
    teacher's shape, dtype-compatible and device, none requiring grad."""
    if len(teachers) == 0:
        raise ValueError("teacher_model_output is an empty tuple: give one teacher's output, or several")
    first = _streams(teachers[0], "teacher_model_output[0]")
    for k, teacher in enumerate(teachers):
        streams = _streams(teacher, f"teacher_model_output[{k}]")
        if joint and not isinstance(teacher, (tuple, list)) or len(streams) != len(first):
            like = f"a tuple of {len(first)} streams" if joint else "a tensor"
            raise ValueError(f"teacher_model_output[{k}] must be {like}, like teacher_model_output[0]")
        for (name, t), (_, t0) in zip(streams, first):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor; got {type(t).__name__}")
            if t.shape != t0.shape or t.device != t0.device:
                raise ValueError(f"{name} has shape {tuple(t.shape)} on {t.device}; every teacher must have "
                                 f"teacher_model_output[0]'s {tuple(t0.shape)} on {t0.device}")
        _check_no_grad(**dict(streams))


def teacher_probabilities(teacher_weights, count: int) -> list:
    """The normalised weights p_k = w_k / sum_j w_j (Python floats); None: 1/K each."""
    if teacher_weights is None:
        return [1.0 / count] * count
    if isinstance(teacher_weights, torch.Tensor):
        raise TypeError("teacher_weights must be a sequence of Python numbers (one per teacher), not a tensor")
    weights = [float(w) for w in teacher_weights]
    if len(weights) != count:
        raise ValueError(f"teacher_weights has {len(weights)} weights for {count} teachers")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"teacher_weights must be finite and >= 0; got {weights}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError(f"teacher_weights sum to {total}: at least one weight must be > 0")
    return [w / total for w in weights]


def check_teacher_index(teacher_index, count: int, batch: int, device, check_values: bool) -> torch.Tensor:
    """``teacher_index``: an integer [B] tensor on model_output's device, each value in [0, K) (read only
    when ``check_values`` and the project reads values: not while torch.compile traces, under CUDA graph
    capture or inside ``flowrl.no_value_checks()``)."""
    if not isinstance(teacher_index, torch.Tensor) or teacher_index.dtype.is_floating_point \
            or teacher_index.dtype.is_complex or teacher_index.dtype == torch.bool:
        raise TypeError("teacher_index must be an integer tensor [B] (each sample's teacher, 0 .. K-1)")
    if teacher_index.shape != (batch,):
        raise ValueError(f"teacher_index must have shape [B] = [{batch}]; got {tuple(teacher_index.shape)}")
    if teacher_index.device != device:
        raise ValueError(f"teacher_index is on {teacher_index.device} but model_output is on {device}")
    # read as check_step_index reads a step index: one device-to-host copy, none while torch.compile traces,
    # a CUDA graph is captured or inside flowrl.no_value_checks() (the range is then the caller's)
    if check_values and not V._skip_value_reads(teacher_index):
        low, high = torch.stack(torch.aminmax(teacher_index)).tolist()
        if low < 0 or high >= count:
            raise ValueError(f"teacher_index must be in [0, {count}) for {count} teachers; got values in "
                             f"[{low}, {high}]")
    return teacher_index


def _wide(tensors) -> torch.dtype:
    """float32, or float64 when a teacher is float64 (the torch backend's wide path)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def teacher_mean(teachers, probabilities):
    """v_bar = sum_k p_k v_k per stream, in float32 (float64 given float64 teachers), as the running
    weighted mean v <- lerp(v, v_k, p_k / P_k) (P_k = p_0 + ... + p_k; teachers of weight 0 skipped; one
    teacher of weight > 0: that tensor as given): eagerly one elementwise pass per further teacher,
    reading the running mean and v_k (under torch.compile Inductor may fuse them into one pass reading the
    K teachers). Identical teachers give v_0 exactly (lerp(a, a, w) = a)."""
    def mean(tensors):
        dtype = _wide(tensors)
        active = [(t, p) for t, p in zip(tensors, probabilities) if p > 0]
        if len(active) == 1:  # that teacher, as given
            return active[0][0]
        acc, seen = None, 0.0
        for t, p in active:
            seen += p
            acc = t.to(dtype) if acc is None else torch.lerp(acc, t.to(dtype), p / seen)
        return acc
    return _map_streams(mean, teachers)


def routed_teacher(teachers, teacher_index):
    """Each sample's row of its teacher ``teacher_model_output[teacher_index[b]]`` per stream (torch.where over
    the teachers; the rows are the teachers' values unchanged, in their common dtype)."""
    def route(tensors):
        out = tensors[0]
        for k in range(1, len(tensors)):
            pick = (teacher_index == k).reshape((-1,) + (1,) * (tensors[k].dim() - 1))
            out = torch.where(pick, tensors[k], out)
        return out
    return _map_streams(route, teachers)


def multi_teacher_kl(run, model_output, teachers, probabilities, teacher_index):
    """(loss, per-sample KL [B] detached) over several teachers. ``run(v, teacher)``: one teacher KL
    (``teacher_kl``, or its custom op while torch.compile traces) of output ``v`` with the call's other
    arguments.

    - ``teacher_index`` given: each sample's KL to its own teacher (``routed_teacher``), one pass.
    - else sum_k p_k KL(v, v_k) as KL(v, v_bar) + sum_k p_k KL(v_k, v_bar): one pass over (v, v_bar) with
      its fused backward, then one no-grad pass over (v_k, v_bar) per teacher of weight > 0 (none when
      only one teacher has weight > 0: v_bar is that teacher)."""
    if teacher_index is not None:
        return run(model_output, routed_teacher(teachers, teacher_index))
    v_bar = teacher_mean(teachers, probabilities)
    loss, kl = run(model_output, v_bar)
    active = [(t, p) for t, p in zip(teachers, probabilities) if p > 0]
    if len(active) == 1:  # v_bar is that teacher: the KL is its KL
        return loss, kl
    with torch.no_grad():
        const = None
        for teacher, p in active:
            term = p * run(teacher, v_bar)[1]
            const = term if const is None else const + term
    return loss + batch_mean(const), (kl + const).detach()


def multi_teacher_loss(run, model_output, teacher_model_output, joint: bool, teacher_weights, teacher_index):
    """``teacher_kl_loss`` with several teachers (or ``teacher_weights`` / ``teacher_index`` given): the
    arguments checked (a ValueError / TypeError naming the argument), then ``multi_teacher_kl``."""
    if not several_teachers(teacher_model_output, joint):
        raise ValueError("teacher_weights and teacher_index need several teachers: teacher_model_output as a "
                         "tuple of the teachers' outputs" + (" (each a tuple of streams)" if joint else ""))
    if teacher_weights is not None and teacher_index is not None:
        raise ValueError("teacher_weights and teacher_index are exclusive: weighted teachers, or a teacher per "
                         "sample")
    teachers = tuple(teacher_model_output)
    check_teachers(teachers, joint)
    probabilities = teacher_probabilities(teacher_weights, len(teachers))
    if teacher_index is not None:
        like = model_output[0] if joint else model_output
        teacher_index = check_teacher_index(teacher_index, len(teachers), like.shape[0], like.device,
                                            check_values=not traced())
    return multi_teacher_kl(run, model_output, teachers, probabilities, teacher_index)
