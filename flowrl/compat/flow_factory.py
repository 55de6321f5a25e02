"""Flow-Factory's SDE scheduler on flowrl's ops.

    # before: accelerate launch -m flow_factory.train config.yaml
    accelerate launch -m flowrl.compat.flow_factory config.yaml      # or: python -m flowrl.compat.flow_factory config.yaml

Flow-Factory builds its scheduler from a registry of class paths
(``src/flow_factory/scheduler/registry.py``: ``load_scheduler`` imports the class registered for the
pipeline's scheduler class name), so importing this module's class in place of Flow-Factory's does
nothing; ``register()`` points the registry's ``"FlowMatchEulerDiscreteScheduler"`` entry at
``FlowMatchEulerDiscreteSDEScheduler`` below, and running this module (``python -m
flowrl.compat.flow_factory <Flow-Factory's training arguments>``) calls ``register()`` and then
Flow-Factory's own entry, ``flow_factory.train.main``, with the arguments unchanged.

Flow-Factory (X-GenGroup/Flow-Factory, ``src/flow_factory/scheduler/flow_match_euler_discrete.py``)
wraps diffusers' ``FlowMatchEulerDiscreteScheduler`` with SDE settings (``noise_level``, ``sde_steps``,
``num_sde_steps``, ``seed``, ``dynamics_type``) and a ``step`` that samples and scores one transition.
This module has:

- ``step(self, noise_pred, timestep, latents, next_latents=None, timestep_next=None, generator=None,
  noise_level=None, compute_log_prob=True, return_dict=True, return_kwargs=[...], dynamics_type=None,
  sigma_max=None)``: Flow-Factory's ``step`` as a function of the scheduler, on flowrl's ops. Its
  result has Flow-Factory's fields ``next_latents, next_latents_mean, std_dev_t, dt, log_prob,
  noise_pred`` (``return_dict=False``: the tuple ``(next_latents, next_latents_mean, noise_pred,
  log_prob, std_dev_t, dt)``).
- ``FlowMatchEulerDiscreteSDEScheduler``: flowrl's ``FlowMatchEulerDiscreteScheduler`` (a diffusers
  scheduler) with Flow-Factory's SDE settings, step selection (``sde_steps``, ``current_sde_steps``,
  ``get_noise_level_for_timestep`` ...), ``eval()`` / ``train()`` / ``rollout()`` and this ``step``.

``dynamics_type``: ``"Flow-SDE"`` (flowrl ``sde``, Gaussian log-density), ``"Dance-SDE"`` (``dance``),
``"CPS"`` (``cps``, ``-(x' - mu)^2``), ``"ODE"`` (log-prob 0). ``std_dev_t`` is Flow-Factory's: the
per-unit-time ``s`` for Flow-SDE, ``noise_level`` for Dance-SDE (both times ``sqrt(-dt)`` give the
step's std), the step's std for CPS, 0 for ODE; ``std_dev_t`` and ``dt`` are ``[B, 1, ..., 1]``.

Flow-Factory already computes the log-prob of the sample rounded to the latents' dtype (it rounds
``next_latents`` to the input dtype and back before scoring it), which is flowrl's rule, so there is no
``peer_compatible`` flag here: on identical inputs and noise the results agree within float32
rounding. What differs (docs/integration.md):

- A deterministic step has log-prob 0: Flow-SDE and Dance-SDE at ``noise_level=0`` (the steps
  outside the SDE window) give NaN in Flow-Factory (0 / 0); CPS at the last step gives
  ``-mean((x' - mu)^2)`` of the storage rounding there.
- sigma and sigma' are always read from the float32 table. Flow-Factory uses ``timestep / 1000`` and
  ``timestep_next / 1000`` when ``timestep_next`` is given, one float32 ulp off the table for some
  entries (2 of 40 with SD3's shift 3 at 40 steps); here
  ``timestep_next`` must be the schedule's next timestep (or 0 after the last), else ``ValueError``.
- The timestep lookup is flowrl's bf16-safe one; ``sigma_max`` may only restate ``sigmas[1]`` (the
  contract's ``sigma == 1`` substitute), anything else raises ``ValueError``.
- ``return_kwargs`` naming an unknown field raises ``ValueError`` (Flow-Factory logs a warning).

Noise is drawn in float32 as diffusers' ``randn_tensor`` draws it (same generator stream), whenever
``next_latents`` is None and the dynamics are not ODE (as Flow-Factory, also at noise level 0).
Per-sample noise levels (a list or a [B] tensor, e.g. 0 outside the SDE window) are supported: the
batch is stepped in groups of equal noise level (flowrl's values do not depend on the batch).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ..ops.functional import step_log_prob
from ..rollout.scheduler import FlowMatchEulerDiscreteScheduler, _DEFAULTS
from ..core import _validate as V
from . import _common as compat_common

DYNAMICS = {"Flow-SDE": ("sde", "gaussian"), "Dance-SDE": ("dance", "gaussian"), "CPS": ("cps", "sq_err"),
            "ODE": ("ode", "gaussian")}
RETURN_KWARGS = ("next_latents", "next_latents_mean", "std_dev_t", "dt", "log_prob", "noise_pred")


@dataclass
class FlowMatchEulerDiscreteSDESchedulerOutput:
    """Flow-Factory's ``SDESchedulerOutput``: the fields ``return_kwargs`` asked for, the others None.
    Indexes like diffusers' ``BaseOutput`` (``out["log_prob"]``, ``out[0]`` over the set fields)."""

    next_latents: Optional[torch.Tensor] = None
    next_latents_mean: Optional[torch.Tensor] = None
    std_dev_t: Optional[torch.Tensor] = None
    dt: Optional[torch.Tensor] = None
    log_prob: Optional[torch.Tensor] = None
    noise_pred: Optional[torch.Tensor] = None

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "FlowMatchEulerDiscreteSDESchedulerOutput":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_tuple(self) -> tuple:
        return tuple(v for v in self.to_dict().values() if v is not None)

    def keys(self):
        return [k for k, v in self.to_dict().items() if v is not None]

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]


SDESchedulerOutput = FlowMatchEulerDiscreteSDESchedulerOutput


def _step_indices(timestep, timesteps: torch.Tensor, batch: int, device):
    """Flow-Factory's rule: an int or an integer tensor is a step index (with a warning); a float or a
    float tensor (0-d or [B]) is a timestep, found with flowrl's bf16-safe lookup."""
    if isinstance(timestep, bool):
        raise TypeError("timestep must be a float, an int index or a tensor; got a bool")
    integer_tensor = isinstance(timestep, torch.Tensor) and not timestep.dtype.is_floating_point
    if isinstance(timestep, Integral) or integer_tensor:
        warnings.warn(
            "Passing integer indices (e.g. from `enumerate(timesteps)`) as timesteps to step() treats them as "
            "step indices (Flow-Factory's rule); pass one of scheduler.timesteps as a timestep"
        )
        if isinstance(timestep, torch.Tensor) and timestep.dim() > 1:
            raise ValueError(f"timestep must be a scalar or a 1-D tensor [B]; got shape {tuple(timestep.shape)}")
        return compat_common.check_index("timestep", timestep, timesteps.numel(), batch, device)
    if isinstance(timestep, torch.Tensor) and timestep.dim() > 1:
        raise ValueError(
            f"timestep must be a scalar or a 1-D tensor [B]; got shape {tuple(timestep.shape)}. Pass the original "
            "scalar timestep t, not an expanded one"
        )
    if not isinstance(timestep, (torch.Tensor, Real)):
        raise TypeError(f"timestep must be a float or a torch.Tensor; got {type(timestep).__name__}")
    return compat_common.resolve_timesteps("timestep", timestep, timesteps, batch, device)[0]


def _check_timestep_next(timestep_next, idx: torch.Tensor, timesteps: torch.Tensor) -> None:
    """``timestep_next`` must be the schedule's next timestep of each sample (0 after the last step)."""
    if isinstance(timestep_next, bool) or not isinstance(timestep_next, (Real, torch.Tensor)):
        raise TypeError(f"timestep_next must be a float or a tensor; got {type(timestep_next).__name__}")
    t = compat_common.timestep_tensor("timestep_next", timestep_next).to(idx.device)
    if t.numel() not in (1, idx.numel()):
        raise ValueError(f"timestep_next must hold 1 or B = {idx.numel()} values; got {t.numel()}")
    table = torch.cat([timesteps.to(device=idx.device, dtype=torch.float32), torch.zeros(1, device=idx.device)])
    expected = table[idx + 1]
    if t.dtype.is_floating_point and t.dtype != torch.float64:
        ok = expected.to(t.dtype) == t  # equal within the value's own rounding (bf16 timesteps)
    else:
        ok = expected.double() == t.double()
    if not bool(ok.all()):
        k = int((~ok).nonzero()[0, 0]) if ok.numel() > 1 else 0
        raise ValueError(
            f"timestep_next[{k}] = {float(t.reshape(-1)[min(k, t.numel() - 1)])} is not the schedule's next timestep "
            f"{float(expected[k])}: flowrl steps from sigmas[i] to sigmas[i + 1] of the scheduler's table (it never "
            "rebuilds sigma from timestep / 1000)"
        )


def _noise_levels(scheduler, noise_level, sigma: torch.Tensor, batch: int, dynamics: str) -> List[float]:
    """Per-sample noise levels (a list of B floats), Flow-Factory's rule: 0 in eval mode or for ODE;
    None asks the scheduler (``get_noise_level_for_sigma``, else its ``noise_level``)."""
    if getattr(scheduler, "is_eval", False) or dynamics == "ODE":
        return [0.0] * batch
    if noise_level is None:
        if hasattr(scheduler, "get_noise_level_for_sigma"):
            noise_level = scheduler.get_noise_level_for_sigma(sigma)
        elif isinstance(getattr(scheduler, "noise_level", None), Real):
            noise_level = scheduler.noise_level
        else:
            raise ValueError("noise_level must be given: this scheduler has no noise_level setting")
    if isinstance(noise_level, torch.Tensor):
        if noise_level.dtype == torch.bool or noise_level.dtype.is_complex or noise_level.dim() > 1:
            raise TypeError(f"noise_level must be a real scalar, a list or a 1-D tensor; got {noise_level.dtype} "
                            f"{tuple(noise_level.shape)}")
        values = [float(v) for v in noise_level.reshape(-1).tolist()]
    elif isinstance(noise_level, (list, tuple)):
        values = list(noise_level)
    else:
        values = [noise_level]
    if len(values) not in (1, batch):
        raise ValueError(f"noise_level must hold 1 or B = {batch} values; got {len(values)}")
    etas = [compat_common.check_noise_level("noise_level", v, at_most_one=dynamics == "CPS") for v in values]
    return etas * batch if len(etas) == 1 else etas


def _groups(etas: Sequence[float]):
    """(eta, row indices or None for all rows) for each distinct noise level."""
    distinct = sorted(set(etas))
    if len(distinct) == 1:
        return [(distinct[0], None)]
    return [(e, [i for i, v in enumerate(etas) if v == e]) for e in distinct]


def step(
    self,
    noise_pred: torch.Tensor,
    timestep: Union[float, torch.Tensor],
    latents: torch.Tensor,
    next_latents: Optional[torch.Tensor] = None,
    timestep_next: Optional[Union[float, torch.Tensor]] = None,
    generator=None,
    noise_level: Optional[Union[int, float, list, torch.Tensor]] = None,
    compute_log_prob: bool = True,
    return_dict: bool = True,
    return_kwargs: Sequence[str] = ("next_latents", "next_latents_mean", "std_dev_t", "dt", "log_prob", "noise_pred"),
    dynamics_type: Optional[str] = None,
    sigma_max: Optional[float] = None,
    *,
    backend: str = "auto",
):
    """Flow-Factory's ``FlowMatchEulerDiscreteSDEScheduler.step`` on flowrl's ops (module docstring).
    ``self``: a FlowMatchEulerDiscreteScheduler (diffusers', flowrl's, Flow-Factory's or the class
    below); its ``dynamics_type``, ``is_eval`` and noise-level settings are read when present."""
    sigmas, timesteps = compat_common.scheduler_tables(self, "self")
    compat_common.check_tensor("latents", latents)
    compat_common.check_tensor("noise_pred", noise_pred, latents, "latents")
    if next_latents is not None:
        compat_common.check_tensor("next_latents", next_latents, latents, "latents")
    dynamics = dynamics_type or getattr(self, "dynamics_type", None) or "Flow-SDE"
    if dynamics not in DYNAMICS:
        raise ValueError(f"dynamics_type must be one of {', '.join(map(repr, DYNAMICS))}; got {dynamics!r}")
    V.check_bool("compute_log_prob", compute_log_prob)
    V.check_bool("return_dict", return_dict)
    if isinstance(return_kwargs, str) or not all(isinstance(k, str) for k in return_kwargs):
        raise TypeError(f"return_kwargs must be a list of field names; got {return_kwargs!r}")
    unknown = [k for k in return_kwargs if k not in RETURN_KWARGS]
    if unknown:
        raise ValueError(f"return_kwargs may name {', '.join(RETURN_KWARGS)}; got unknown {unknown}")
    mode, kind = DYNAMICS[dynamics]
    batch, ndim, device = latents.shape[0], latents.dim(), latents.device
    table = compat_common.on_device(sigmas, device)
    if sigma_max is not None:
        if isinstance(sigma_max, bool) or not isinstance(sigma_max, (Real, torch.Tensor)) or float(sigma_max) != float(
            table.to(torch.float32)[1]
        ):
            raise ValueError(
                f"sigma_max must be None or sigmas[1] = {float(table[1])} (flowrl substitutes sigmas[1] for sigma = 1); "
                f"got {sigma_max!r}"
            )
    idx = _step_indices(timestep, timesteps, batch, device)
    if timestep_next is not None:
        _check_timestep_next(timestep_next, idx, timesteps)
    f32 = table.to(torch.float32)
    sigma, sigma_next = f32[idx], f32[idx + 1]
    etas = _noise_levels(self, noise_level, sigma, batch, dynamics)

    rollout = next_latents is None
    noise = compat_common.draw(latents, generator) if rollout and mode != "ode" else None
    # Flow-Factory emits the sample rounded to the latents' dtype, returned as float32; its ODE step
    # returns the float32 mean unrounded
    emit_dtype = torch.float32 if mode == "ode" else latents.dtype
    mean_parts, lp_parts, prev_parts = [], [], []
    for eta, rows in _groups(etas):
        pick = (lambda t: t) if rows is None else (lambda t, r=torch.tensor(rows, device=device): t[r])
        x, v, i = pick(latents), pick(noise_pred), pick(idx)
        if rollout:
            o = compat_common.emit(x, v, table, i, mode=mode, eta=eta, noise=None if noise is None else pick(noise), kind=kind,
                       out_dtype=emit_dtype, peer_compatible=False, backend=backend)
            prev_parts.append((rows, o[0].to(torch.float32)))
            mean_parts.append((rows, o[2]))
            lp_parts.append((rows, o[1]))
        else:
            prev_parts.append((rows, pick(next_latents).to(torch.float32)))
            mean_parts.append((rows, compat_common.step_mean(x, v, table, i, mode, eta, backend)))
            if compute_log_prob and mode != "ode":
                lp_parts.append((rows, step_log_prob(x, v, pick(next_latents), table, i, mode=mode, noise_level=eta,
                                                     log_prob_kind=kind, backend=backend)))
    out_latents, mean = _assemble(prev_parts), _assemble(mean_parts)
    if mode == "ode" or not lp_parts:  # ODE: log-prob 0, as Flow-Factory
        log_prob = torch.zeros(batch, dtype=torch.float32, device=device)
    else:
        log_prob = _assemble(lp_parts)
    eta_t = torch.tensor(etas, dtype=torch.float32, device=device)
    if mode == "sde":
        std_dev_t = eta_t * compat_common.sde_per_unit_time_std(table, idx, 1.0)
    elif mode == "dance":
        std_dev_t = eta_t
    elif mode == "cps":
        std_dev_t = torch.cat([compat_common.cps_std(sigma_next[k:k + 1], e) for k, e in enumerate(etas)])
    else:
        std_dev_t = torch.zeros_like(sigma)
    result = {
        "next_latents": out_latents,
        "next_latents_mean": mean,
        "std_dev_t": compat_common.column(std_dev_t, ndim),
        "dt": compat_common.column(sigma_next - sigma, ndim),
        "log_prob": log_prob if compute_log_prob else None,
        "noise_pred": noise_pred.float(),
    }
    if not return_dict:
        return tuple(result[k] for k in ("next_latents", "next_latents_mean", "noise_pred", "log_prob", "std_dev_t", "dt"))
    return FlowMatchEulerDiscreteSDESchedulerOutput.from_dict({k: result[k] for k in return_kwargs})


def _assemble(parts):
    """Scatter per-group results (rows None: the whole batch) back into batch order."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    total = sum(len(r) for r, _ in parts)
    first = parts[0][1]
    out = first.new_empty((total,) + tuple(first.shape[1:]))
    for rows, value in parts:
        out[torch.tensor(rows, device=out.device)] = value
    return out


_SDE_KEYS = ("noise_level", "sde_steps", "num_sde_steps", "seed", "dynamics_type")


class FlowMatchEulerDiscreteSDEScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow-Factory's ``FlowMatchEulerDiscreteSDEScheduler`` on flowrl's scheduler and ops.

    The constructor takes Flow-Factory's SDE settings plus the scheduler config (private ``_...`` keys
    are ignored; unknown keys are ignored with a warning), so Flow-Factory's
    ``sde_class(**dict(pipe.scheduler.config), **scheduler_args)`` builds it. Step selection follows
    Flow-Factory: ``sde_steps`` (default: every step but the last), ``num_sde_steps`` of them drawn by
    ``torch.randperm`` under ``seed`` (``current_sde_steps``); ``get_noise_level_for_*`` give
    ``noise_level`` on those steps and 0 elsewhere. ``eval()`` makes every step deterministic,
    ``train()`` / ``rollout()`` stochastic; ``rollout`` here is Flow-Factory's mode switch, not
    flowrl's recorder (use ``flowrl.rollout.recorder.rollout(scheduler)`` for that)."""

    def __init__(
        self,
        noise_level: float = 0.7,
        sde_steps: Optional[Union[int, list, torch.Tensor]] = None,
        num_sde_steps: Optional[int] = None,
        seed: int = 42,
        dynamics_type: str = "Flow-SDE",
        **kwargs,
    ):
        config = {k: v for k, v in kwargs.items() if not str(k).startswith("_")}
        unknown = sorted(k for k in config if k not in _DEFAULTS)
        if unknown:
            warnings.warn(f"FlowMatchEulerDiscreteSDEScheduler ignores config keys it does not take: {unknown}")
        super().__init__(**{k: v for k, v in config.items() if k in _DEFAULTS})
        if dynamics_type not in DYNAMICS:
            raise ValueError(f"dynamics_type must be one of {', '.join(map(repr, DYNAMICS))}; got {dynamics_type!r}")
        self.noise_level = compat_common.check_noise_level("noise_level", noise_level, at_most_one=dynamics_type == "CPS")
        if num_sde_steps is not None and (isinstance(num_sde_steps, bool) or not isinstance(num_sde_steps, Integral)
                                          or num_sde_steps < 0):
            raise ValueError(f"num_sde_steps must be None or an int >= 0; got {num_sde_steps!r}")
        if isinstance(seed, bool) or not isinstance(seed, Integral):
            raise TypeError(f"seed must be an int; got {seed!r}")
        self._sde_steps = None if sde_steps is None else _index_tensor("sde_steps", sde_steps)
        self._num_sde_steps = num_sde_steps
        self.seed = int(seed)
        self.dynamics_type = dynamics_type
        self._is_eval = False

    @classmethod
    def from_config(cls, config, **kwargs) -> "FlowMatchEulerDiscreteSDEScheduler":
        """Build from a scheduler config (dict or FrozenDict); SDE settings from ``kwargs`` or the config."""
        if not hasattr(config, "items"):
            raise TypeError(f"config must be a dict or FrozenDict; got {type(config).__name__}")
        merged = {k: v for k, v in config.items() if not str(k).startswith("_")}
        merged.update(kwargs)
        return cls(**merged)

    # Flow-Factory's mode switches
    @property
    def is_eval(self) -> bool:
        return self._is_eval

    def eval(self) -> None:
        """Deterministic sampling (noise level 0 on every step)."""
        self._is_eval = True

    def train(self, mode: bool = True) -> None:
        """Stochastic sampling on the SDE steps (``mode=False``: as ``eval()``)."""
        self._is_eval = not V.check_bool("mode", mode)

    def rollout(self, mode: bool = True) -> None:  # Flow-Factory's meaning (an alias of train)
        self.train(mode=mode)

    def set_seed(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, Integral):
            raise TypeError(f"seed must be an int; got {seed!r}")
        self.seed = int(seed)

    # step selection
    @property
    def sde_steps(self) -> torch.Tensor:
        """Step indices eligible for noise (default: all but the last)."""
        if self._sde_steps is not None:
            return self._sde_steps
        return torch.arange(0, len(self.timesteps) - 1, dtype=torch.int64)

    @property
    def num_sde_steps(self) -> int:
        return self._num_sde_steps if self._num_sde_steps is not None else len(self.sde_steps)

    @property
    def current_sde_steps(self) -> torch.Tensor:
        """``num_sde_steps`` of ``sde_steps``, drawn by ``torch.randperm`` under ``seed``."""
        if self.num_sde_steps >= len(self.sde_steps):
            return self.sde_steps
        generator = torch.Generator().manual_seed(self.seed)
        return self.sde_steps[torch.randperm(len(self.sde_steps), generator=generator)[: self.num_sde_steps]]

    @property
    def train_timesteps(self) -> torch.Tensor:
        return self.current_sde_steps

    def get_train_timesteps(self) -> torch.Tensor:
        return self.timesteps[self.train_timesteps]

    def get_train_sigmas(self) -> torch.Tensor:
        return self.sigmas[self.train_timesteps]

    def get_noise_levels(self) -> torch.Tensor:
        levels = torch.zeros_like(self.timesteps, dtype=torch.float32)
        levels[self.current_sde_steps] = self.noise_level
        return levels

    def get_noise_level_for_timestep(self, timestep):
        """``noise_level`` if the timestep's step is a current SDE step, else 0 (a float for a scalar,
        a tensor of the timesteps' dtype for a 1-D tensor); bf16-safe lookup."""
        scalar = not isinstance(timestep, torch.Tensor) or timestep.dim() == 0
        idx, _ = compat_common.resolve_timesteps("timestep", timestep, self.timesteps, 1 if scalar else timestep.numel(), "cpu")
        hit = torch.isin(idx, self.current_sde_steps)
        if scalar:
            return self.noise_level if bool(hit[0]) else 0.0
        return torch.where(hit, self.noise_level, 0.0).to(timestep.dtype)

    def get_noise_level_for_sigma(self, sigma):
        """As ``get_noise_level_for_timestep``, for sigmas of the table (exact match)."""
        scalar = not isinstance(sigma, torch.Tensor)
        values = torch.tensor([float(sigma)], dtype=self.sigmas.dtype) if scalar else sigma
        match = values.reshape(-1, 1).to(self.sigmas.device) == self.sigmas.reshape(1, -1)
        if not bool(match.any(dim=-1).all()):
            raise ValueError(f"sigma {values[~match.any(dim=-1)].tolist()} not found in the scheduler's sigmas")
        hit = torch.isin(match.int().argmax(dim=-1), self.current_sde_steps.to(match.device))
        result = torch.where(hit, torch.tensor(self.noise_level, dtype=values.dtype, device=hit.device),
                             torch.tensor(0.0, dtype=values.dtype, device=hit.device))
        return float(result[0]) if scalar else result.to(values.device)

    step = step


def _index_tensor(name: str, values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers; got {values.dtype}")
        return values.reshape(-1).to(torch.int64)
    if isinstance(values, Integral) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, Integral) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be an int, a list of ints or an integer tensor; got {values!r}")
    return torch.tensor(list(values), dtype=torch.int64)


SCHEDULER_PATH = "flowrl.compat.flow_factory.FlowMatchEulerDiscreteSDEScheduler"
REGISTRY_KEY = "FlowMatchEulerDiscreteScheduler"  # the diffusers class name Flow-Factory's registry maps


def register() -> str:
    """Point Flow-Factory's scheduler registry at flowrl's scheduler: every pipeline whose scheduler is a
    ``FlowMatchEulerDiscreteScheduler`` (SD3, Flux, Qwen-Image, Wan, Z-Image ...) then gets
    ``FlowMatchEulerDiscreteSDEScheduler`` from ``load_scheduler``. Call it in each process before the
    trainer is built (running this module does). Returns the registered class path; ``ImportError``
    when Flow-Factory is not installed."""
    try:
        from flow_factory.scheduler import register_scheduler
    except ImportError as e:
        raise ImportError("flowrl.compat.flow_factory.register() needs Flow-Factory (X-GenGroup/Flow-Factory) "
                          "installed: flow_factory.scheduler.register_scheduler was not found") from e
    register_scheduler(REGISTRY_KEY, SCHEDULER_PATH)
    return SCHEDULER_PATH


def main() -> None:
    """``python -m flowrl.compat.flow_factory <args>``: ``register()``, then Flow-Factory's training
    entry ``flow_factory.train.main()``, which reads the same command line (``sys.argv``)."""
    register()
    from flow_factory.train import main as flow_factory_main

    flow_factory_main()


__all__ = [
    "register", "main", "SCHEDULER_PATH", "step", "FlowMatchEulerDiscreteSDEScheduler", "FlowMatchEulerDiscreteSDESchedulerOutput", "SDESchedulerOutput",
    "DYNAMICS", "RETURN_KWARGS",
]


if __name__ == "__main__":
    main()
