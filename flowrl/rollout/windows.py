"""Per-sample SDE windows: which loop steps of each sample are stochastic (docs/scheduler.md, Per-sample
SDE windows).

``rollout(sde_steps=...)`` takes one set of loop steps for the whole batch (an iterable of ints) or one
per sample: a list of B iterables of ints, or a bool tensor [B, T] (True: stochastic). The canonical
stored form of a per-sample choice is the trajectory's ``sde_mask``, bool [B, T]; a per-sample choice
whose rows are all equal is the batch-wide set, recorded exactly as ``sde_steps=`` that set.

``sde_windows(batch, num_steps, window_size=..., window_range=..., contiguous=..., generator=...)``
draws the mask the way verl-omni draws its windows (verl-project/verl-omni
a1139bafffb5b9711f0a6b6edff8ecaa60bfff30, verl_omni/pipelines/request_batch.py lines 32-56
``sample_per_sample_sde_windows`` and verl_omni/pipelines/ltx2_flow_grpo/vllm_omni_rollout_adapter.py lines
182-201 ``_select_sde_steps``, which its PR 341, commit a4b3af9bdfb4387dd29fd35183b3f04c9d78b7b3, added
with ``sde_contiguous``):

* ``window_size`` None: every step but the last (verl-omni's window ``(0, T - 1)``).
* contiguous: ``start = torch.randint(low, high - window_size + 1, (1,), generator=g)``, the window
  ``[start, start + window_size)``.
* not contiguous: ``low + torch.randperm(high - low, generator=g)[:window_size]``.
* ``generator``: a list of B generators draws row b from generator b alone (verl-omni's "serial B=1
  seed semantics"); one generator (or None, the global RNG) draws once and every row shares that
  window, as verl-omni does with one generator.
"""
from __future__ import annotations

from numbers import Integral
from typing import List, Optional, Sequence, Union

import torch

from ._options import _index_set

GeneratorArg = Union[None, torch.Generator, Sequence[torch.Generator]]


def _int(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {int(value)}")
    return int(value)


def sde_windows(batch: int, num_steps: int, *, window_size: Optional[int] = None, window_range=None,
                contiguous: bool = True, generator: GeneratorArg = None) -> torch.Tensor:
    """A bool [B, T] mask (on the CPU) of each sample's stochastic loop steps, drawn as verl-omni draws
    its SDE windows (module doc): pass it as ``rollout(sde_steps=mask)``.

    ``window_size``: steps per window (None: every step but the last, verl-omni's default);
    ``window_range``: ``(low, high)``, the steps a window may cover, ``0 <= low < high <= T`` (None:
    ``(0, T)``, verl-omni's LTX-2 default; its Qwen-Image / SD3 adapters default to ``(0, 5)``, pass
    that explicitly); ``contiguous``: one run of ``window_size`` steps (True) or ``window_size`` steps
    drawn without replacement from the range (False, ``sde_contiguous=False``); ``generator``: None, one
    ``torch.Generator`` (one draw, shared by every row) or a list of B (row b from generator b). The
    draws run on each generator's device."""
    batch, num_steps = _int("batch", batch, 1), _int("num_steps", num_steps, 1)
    if not isinstance(contiguous, bool):
        raise TypeError(f"contiguous must be a bool; got {contiguous!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        if not isinstance(generator, (list, tuple)) or not all(isinstance(g, torch.Generator) for g in generator):
            raise TypeError(f"generator must be None, a torch.Generator or a list of B of them; got {generator!r}")
        if len(generator) != batch:
            raise ValueError(f"generator must be a list of B = {batch} generators; got {len(generator)}")
    mask = torch.zeros(batch, num_steps, dtype=torch.bool)
    if window_size is None:
        if window_range is not None:
            raise ValueError("window_range needs a window_size (without one every step but the last is stochastic)")
        mask[:, :num_steps - 1] = True
        return mask
    size = _int("window_size", window_size, 1)
    if window_range is None:
        low, high = 0, num_steps
    else:
        if isinstance(window_range, torch.Tensor):
            window_range = window_range.tolist()
        if not isinstance(window_range, (list, tuple)) or len(window_range) != 2:
            raise TypeError(f"window_range must be a pair (low, high); got {window_range!r}")
        low, high = _int("window_range[0]", window_range[0]), _int("window_range[1]", window_range[1])
        if high > num_steps:
            raise ValueError(f"window_range must lie in [0, T = {num_steps}]; got {list(window_range)}")
    if high - low < size:
        raise ValueError(f"window_range {[low, high]} holds {max(high - low, 0)} steps, fewer than window_size = "
                         f"{size}")

    def draw(g: Optional[torch.Generator]) -> List[int]:
        device = g.device if g is not None else "cpu"
        if contiguous:
            start = int(torch.randint(low, high - size + 1, (1,), generator=g, device=device).item())
            return list(range(start, start + size))
        order = torch.randperm(high - low, generator=g, device=device)[:size].tolist()
        return sorted(low + k for k in order)

    rows = [draw(g) for g in generator] if isinstance(generator, (list, tuple)) else [draw(generator)] * batch
    for b, steps in enumerate(rows):
        mask[b, steps] = True
    return mask


def _steps(name: str, values, upper: Optional[int]) -> List[int]:
    """One sample's sorted unique loop step indices (``_options._index_set``; None is not a set here)."""
    if values is None:
        raise TypeError(f"{name} must be an iterable of ints; got None")
    return _index_set(name, values, upper)


def is_per_sample(sde_steps) -> bool:
    """Whether ``rollout(sde_steps=)`` got the per-sample form: a 2-D bool tensor, or a list/tuple
    whose entries are themselves iterables (one index set per sample)."""
    if isinstance(sde_steps, torch.Tensor):
        return sde_steps.dtype == torch.bool or sde_steps.dim() == 2
    if isinstance(sde_steps, (list, tuple)):
        return len(sde_steps) > 0 and all(
            isinstance(s, (list, tuple, set, frozenset, range, torch.Tensor)) for s in sde_steps)
    return False


def per_sample_rows(name: str, sde_steps) -> List[List[int]]:
    """The per-sample form as B sorted index lists (a bool [B, T] tensor: its True columns per row; its
    T is checked against the loop by ``check_mask``)."""
    if isinstance(sde_steps, torch.Tensor):
        if sde_steps.dtype != torch.bool or sde_steps.dim() != 2 or sde_steps.shape[0] < 1:
            raise TypeError(f"{name} as a tensor per sample must be bool [B, T]; got {sde_steps.dtype} "
                            f"{tuple(sde_steps.shape)}")
        m = sde_steps.detach().cpu()
        return [m[b].nonzero().flatten().tolist() for b in range(m.shape[0])]
    rows = []
    for b, s in enumerate(sde_steps):
        if isinstance(s, torch.Tensor) and s.dtype == torch.bool:
            raise TypeError(f"{name}[{b}] must be loop step indices (ints); got a bool tensor (pass the whole "
                            "[B, T] bool mask instead)")
        rows.append(_steps(f"{name}[{b}]", s, None))
    return rows


def mask_from_rows(rows: List[List[int]], num_steps: int, name: str = "sde_steps") -> torch.Tensor:
    """bool [B, T] from B index lists, each index checked to be a loop step."""
    mask = torch.zeros(len(rows), num_steps, dtype=torch.bool)
    for b, steps in enumerate(rows):
        if steps and steps[-1] >= num_steps:
            raise ValueError(f"{name}[{b}] entries must be in [0, {num_steps - 1}] for this {num_steps}-step loop; "
                             f"got {steps[-1]}")
        mask[b, steps] = True
    return mask


__all__ = ["sde_windows", "is_per_sample", "per_sample_rows", "mask_from_rows"]
