"""A drop-in ``FlowMatchEulerDiscreteScheduler`` that records RL rollouts from unmodified pipelines.

    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7) as rec:
        pipe(...)
    traj = rec.trajectory()   # flowrl.RolloutTrajectory

Outside a rollout, ``set_timesteps`` and ``step`` compute exactly what diffusers'
``FlowMatchEulerDiscreteScheduler`` computes (same code, same operation order, so the same bits). Inside
one, every ``step`` samples with ``flowrl.sde_step`` and records the latents and log-probs.

diffusers is never imported here: the config is a plain frozen dict, so the scheduler works without it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from . import _validate as V
from ._dispatch import BACKENDS
from .functional import GeneratorArg, draw_noise, sde_step
from .trajectory import RolloutTrajectory

logger = logging.getLogger(__name__)
CONFIG_NAME = "scheduler_config.json"
# The class diffusers instantiates when it loads a saved config: a saved flowrl scheduler stays loadable
# by plain diffusers, and from_config(pipe.scheduler.config) round-trips.
_CLASS_NAME = "FlowMatchEulerDiscreteScheduler"
_DEFAULTS: Dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}


class SchedulerConfig(dict):
    """A frozen dict read like diffusers' ``FrozenDict``: ``config.shift``, ``config["shift"]``,
    ``config.get("shift")``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"scheduler config has no key {name!r}") from None

    def _frozen(self, *args, **kwargs):
        raise TypeError("the scheduler config is frozen; build a new scheduler with from_config(config, key=value)")

    __setattr__ = __setitem__ = __delitem__ = _frozen
    update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self):  # pickling (DataLoader workers, deepcopy) must not go through __setitem__
        return (SchedulerConfig, (dict(self),))


@dataclass
class FlowMatchEulerDiscreteSchedulerOutput:
    """``step``'s result. ``prev_sample`` as in diffusers; inside a rollout also the step's ``log_prob``
    (float32 [B]), ``prev_sample_mean`` (float32, the sample's shape) and ``std_dev`` (float32 [B]).

    Indexes like diffusers' ``BaseOutput``: ``out[0]`` is ``prev_sample``, ``out["log_prob"]`` a field;
    ``to_tuple()`` holds the fields that are set."""

    prev_sample: torch.Tensor
    log_prob: Optional[torch.Tensor] = None
    prev_sample_mean: Optional[torch.Tensor] = None
    std_dev: Optional[torch.Tensor] = None

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]


def _check_real(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number{' or None' if allow_none else ''}; got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


class FlowMatchEulerDiscreteScheduler:
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` (same arguments, defaults, config, attributes and
    results), plus ``rollout()`` recording and a bf16-safe timestep lookup (``index_for_timestep``,
    ``indices_for_timesteps``)."""

    order = 1
    _compatibles: List[str] = []

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: Optional[float] = 0.5,
        max_shift: Optional[float] = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        invert_sigmas: bool = False,
        shift_terminal: Optional[float] = None,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        time_shift_type: str = "exponential",
        stochastic_sampling: bool = False,
    ):
        _check_positive_int("num_train_timesteps", num_train_timesteps)
        _check_real("shift", shift)
        if shift <= 0:
            raise ValueError(f"shift must be > 0; got {shift}")
        _check_real("base_shift", base_shift, allow_none=True)
        _check_real("max_shift", max_shift, allow_none=True)
        _check_positive_int("base_image_seq_len", base_image_seq_len)
        _check_positive_int("max_image_seq_len", max_image_seq_len)
        _check_real("shift_terminal", shift_terminal, allow_none=True)
        if shift_terminal is not None and not shift_terminal < 1:
            raise ValueError(f"shift_terminal must be < 1 (the schedule's last sigma); got {shift_terminal}")
        for name, flag in (
            ("use_dynamic_shifting", use_dynamic_shifting), ("invert_sigmas", invert_sigmas),
            ("use_karras_sigmas", use_karras_sigmas), ("use_exponential_sigmas", use_exponential_sigmas),
            ("use_beta_sigmas", use_beta_sigmas), ("stochastic_sampling", stochastic_sampling),
        ):
            _check_bool(name, flag)
        if use_beta_sigmas + use_exponential_sigmas + use_karras_sigmas > 1:
            raise ValueError("only one of use_beta_sigmas, use_exponential_sigmas, use_karras_sigmas can be True")
        V.check_choice("time_shift_type", time_shift_type, ("exponential", "linear"))
        if use_beta_sigmas:
            try:
                import scipy.stats  # noqa: F401
            except ImportError as exc:
                raise ImportError("use_beta_sigmas=True needs scipy: pip install scipy") from exc

        self._config = SchedulerConfig(
            num_train_timesteps=num_train_timesteps, shift=shift, use_dynamic_shifting=use_dynamic_shifting,
            base_shift=base_shift, max_shift=max_shift, base_image_seq_len=base_image_seq_len,
            max_image_seq_len=max_image_seq_len, invert_sigmas=invert_sigmas, shift_terminal=shift_terminal,
            use_karras_sigmas=use_karras_sigmas, use_exponential_sigmas=use_exponential_sigmas,
            use_beta_sigmas=use_beta_sigmas, time_shift_type=time_shift_type,
            stochastic_sampling=stochastic_sampling, _class_name=_CLASS_NAME,
        )

        # Same code as diffusers' __init__: the 1000-entry training table.
        timesteps = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy()
        timesteps = torch.from_numpy(timesteps).to(dtype=torch.float32)
        sigmas = timesteps / num_train_timesteps
        if not use_dynamic_shifting:
            sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = sigmas * num_train_timesteps
        self._step_index: Optional[int] = None
        self._begin_index: Optional[int] = None
        self._shift = shift
        self.sigmas = sigmas.to("cpu")
        self.sigma_min = self.sigmas[-1].item()
        self.sigma_max = self.sigmas[0].item()
        self.num_inference_steps: Optional[int] = None
        self._recorder: Optional[RolloutRecorder] = None
        self._table_cache: Dict[Any, torch.Tensor] = {}

    # ----------------------------------------------------------------------------- config & loading
    @property
    def config(self) -> SchedulerConfig:
        return self._config

    @classmethod
    def from_config(cls, config: Mapping, **kwargs) -> "FlowMatchEulerDiscreteScheduler":
        """Build from a diffusers scheduler config (dict or FrozenDict). Private ``_...`` keys are
        ignored, ``kwargs`` override config values, and keys this scheduler does not take are ignored
        with a warning (as diffusers does)."""
        if not isinstance(config, Mapping):
            hint = " (pass scheduler.config, not the scheduler)" if hasattr(config, "config") else ""
            raise TypeError(f"config must be a dict or FrozenDict{hint}; got {type(config).__name__}")
        merged = {k: v for k, v in config.items() if not str(k).startswith("_")}
        merged.update(kwargs)
        unknown = sorted(k for k in merged if k not in _DEFAULTS)
        if unknown:
            warnings.warn(f"FlowMatchEulerDiscreteScheduler ignores config keys it does not take: {unknown}")
        return cls(**{k: v for k, v in merged.items() if k in _DEFAULTS})

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs) -> None:
        """Write ``scheduler_config.json`` as diffusers does (so ``pipe.save_pretrained`` works)."""
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(dict(self.config), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike], subfolder: Optional[str] = None, **kwargs):
        """Load a local ``scheduler_config.json`` (a directory, or a pipeline directory with
        ``subfolder="scheduler"``). Hub downloads go through diffusers: ``from_config(diffusers_sched.config)``."""
        folder = os.path.join(path, subfolder) if subfolder else os.fspath(path)
        file = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(file):
            raise ValueError(
                f"path must be a local directory holding {CONFIG_NAME}; {file} does not exist. To load from the "
                "Hub, load diffusers' scheduler and call FlowMatchEulerDiscreteScheduler.from_config(its.config)"
            )
        with open(file, encoding="utf-8") as f:
            return cls.from_config(json.load(f), **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(dict(self.config), sort_keys=True)})"

    # ----------------------------------------------------------------------------- diffusers API
    @property
    def shift(self) -> float:
        return self._shift

    @property
    def step_index(self) -> Optional[int]:
        return self._step_index

    @property
    def begin_index(self) -> Optional[int]:
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        self._begin_index = begin_index

    def set_shift(self, shift: float) -> None:
        self._shift = shift

    def __len__(self) -> int:
        return self.config.num_train_timesteps

    def scale_noise(self, sample: torch.Tensor, timestep, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward process ``sigma * noise + (1 - sigma) * sample`` (img2img, training), as diffusers."""
        sigmas = self.sigmas.to(device=sample.device, dtype=sample.dtype)
        if sample.device.type == "mps" and torch.is_floating_point(timestep):
            schedule_timesteps = self.timesteps.to(sample.device, dtype=torch.float32)
            timestep = timestep.to(sample.device, dtype=torch.float32)
        else:
            schedule_timesteps = self.timesteps.to(sample.device)
            timestep = timestep.to(sample.device)
        if self.begin_index is None:
            step_indices = [self.index_for_timestep(t, schedule_timesteps) for t in timestep]
        elif self.step_index is not None:
            step_indices = [self.step_index] * timestep.shape[0]
        else:
            step_indices = [self.begin_index] * timestep.shape[0]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < len(sample.shape):
            sigma = sigma.unsqueeze(-1)
        return sigma * noise + (1.0 - sigma) * sample

    def _sigma_to_t(self, sigma):
        return sigma * self.config.num_train_timesteps

    def time_shift(self, mu: float, sigma: float, t):
        if self.config.time_shift_type == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)
        return mu / (mu + (1 / t - 1) ** sigma)

    def stretch_shift_to_terminal(self, t):
        """Stretch the schedule so that it ends at ``config.shift_terminal`` (LTX-Video)."""
        one_minus_z = 1 - t
        scale_factor = one_minus_z[-1] / (1 - self.config.shift_terminal)
        return 1 - (one_minus_z / scale_factor)

    def set_timesteps(
        self,
        num_inference_steps: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        sigmas: Optional[Sequence[float]] = None,
        mu: Optional[float] = None,
        timesteps: Optional[Sequence[float]] = None,
    ) -> None:
        """Build the inference schedule exactly as diffusers does (lists or numpy arrays for ``sigmas`` /
        ``timesteps``; ``mu`` for dynamic shifting)."""
        if self._recorder is not None:
            self._recorder._on_set_timesteps()
        if self.config.use_dynamic_shifting and mu is None:
            raise ValueError("mu must be passed when use_dynamic_shifting is True")
        if mu is not None:
            _check_real("mu", mu)
        if sigmas is None and timesteps is None and num_inference_steps is None:
            raise ValueError("pass num_inference_steps, sigmas or timesteps")
        if sigmas is not None and timesteps is not None and len(sigmas) != len(timesteps):
            raise ValueError("sigmas and timesteps must have the same length")
        if num_inference_steps is not None:
            _check_positive_int("num_inference_steps", num_inference_steps)
            if (sigmas is not None and len(sigmas) != num_inference_steps) or (
                timesteps is not None and len(timesteps) != num_inference_steps
            ):
                raise ValueError("sigmas and timesteps must have length num_inference_steps when it is given")
        else:
            num_inference_steps = len(sigmas) if sigmas is not None else len(timesteps)
        self.num_inference_steps = num_inference_steps

        # The same operations, in the same order and numpy dtypes, as diffusers 0.3x/0.4x.
        is_timesteps_provided = timesteps is not None
        if is_timesteps_provided and sigmas is None:
            logger.warning(
                "timesteps were passed without sigmas: the timesteps are used as given while the sigmas derived "
                "from them are shifted, so the two may disagree; pass sigmas too to control both"
            )
        if is_timesteps_provided:
            timesteps = np.array(timesteps).astype(np.float32)
        if sigmas is None:
            if timesteps is None:
                timesteps = np.linspace(
                    self._sigma_to_t(self.sigma_max), self._sigma_to_t(self.sigma_min), num_inference_steps
                )
            sigmas = timesteps / self.config.num_train_timesteps
        else:
            sigmas = np.array(sigmas).astype(np.float32)
            num_inference_steps = len(sigmas)
        if self.config.use_dynamic_shifting:
            sigmas = self.time_shift(mu, 1.0, sigmas)
        else:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        if self.config.shift_terminal:
            sigmas = self.stretch_shift_to_terminal(sigmas)
        if self.config.use_karras_sigmas:
            sigmas = self._convert_to_karras(sigmas, num_inference_steps)
        elif self.config.use_exponential_sigmas:
            sigmas = self._convert_to_exponential(sigmas, num_inference_steps)
        elif self.config.use_beta_sigmas:
            sigmas = self._convert_to_beta(sigmas, num_inference_steps)

        sigmas = torch.from_numpy(sigmas).to(dtype=torch.float32, device=device)
        if is_timesteps_provided:
            timesteps = torch.from_numpy(timesteps).to(dtype=torch.float32, device=device)
        else:
            timesteps = sigmas * self.config.num_train_timesteps
        if self.config.invert_sigmas:  # Mochi: inverted sigmas, timesteps without inversion
            sigmas = 1.0 - sigmas
            timesteps = sigmas * self.config.num_train_timesteps
            sigmas = torch.cat([sigmas, torch.ones(1, device=sigmas.device)])
        else:
            sigmas = torch.cat([sigmas, torch.zeros(1, device=sigmas.device)])

        self.timesteps = timesteps
        self.sigmas = sigmas
        self._step_index = None
        self._begin_index = None

    def _sigma_bounds(self, in_sigmas):
        # diffusers reads config.sigma_min / sigma_max when a config has them; this one never does
        return in_sigmas[-1].item(), in_sigmas[0].item()

    def _convert_to_karras(self, in_sigmas, num_inference_steps: int):
        sigma_min, sigma_max = self._sigma_bounds(in_sigmas)
        rho = 7.0
        ramp = np.linspace(0, 1, num_inference_steps)
        min_inv_rho = sigma_min ** (1 / rho)
        max_inv_rho = sigma_max ** (1 / rho)
        return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho

    def _convert_to_exponential(self, in_sigmas, num_inference_steps: int):
        sigma_min, sigma_max = self._sigma_bounds(in_sigmas)
        return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), num_inference_steps))

    def _convert_to_beta(self, in_sigmas, num_inference_steps: int, alpha: float = 0.6, beta: float = 0.6):
        import scipy.stats

        sigma_min, sigma_max = self._sigma_bounds(in_sigmas)
        return np.array(
            [
                sigma_min + (ppf * (sigma_max - sigma_min))
                for ppf in [scipy.stats.beta.ppf(t, alpha, beta) for t in 1 - np.linspace(0, 1, num_inference_steps)]
            ]
        )

    # ----------------------------------------------------------------------------- timestep lookup
    def _resolve(self, timesteps: torch.Tensor, schedule: torch.Tensor) -> torch.Tensor:
        """int64 [N]: the schedule index of each timestep; -1 where none matches, -2 where distinct
        entries match (ambiguous). Sync-free.

        A float timestep matches the schedule entries that round to it in its own dtype (exact equality
        for float32, as diffusers; within bf16/fp16 rounding otherwise). Equal entries (a repeated
        timestep) are not ambiguous: diffusers' rule picks the second occurrence."""
        schedule = schedule.to(timesteps.device)
        if timesteps.dtype.is_floating_point and timesteps.dtype != torch.float64:
            match = schedule.to(timesteps.dtype)[None, :] == timesteps[:, None]
        else:  # float64 and integer timesteps compare exactly, as diffusers' == does
            match = schedule.double()[None, :] == timesteps.double()[:, None]
        count = match.sum(dim=1)
        first = match.to(torch.uint8).argmax(dim=1)
        second = (match & (match.cumsum(dim=1) == 2)).to(torch.uint8).argmax(dim=1)
        first_value = schedule[first]
        ambiguous = (match & (schedule[None, :] != first_value[:, None])).any(dim=1)
        index = torch.where(count >= 2, second, first)
        index = torch.where(count == 0, torch.full_like(index, -1), index)
        return torch.where(ambiguous, torch.full_like(index, -2), index)

    def _explain(self, code: int, timestep: torch.Tensor, schedule: torch.Tensor) -> str:
        """The error message for a lookup code from ``_resolve`` (-1: no match, -2: ambiguous)."""
        value, dtype = float(timestep), timestep.dtype
        if code == -1:
            return (
                f"timestep {value} ({dtype}) is not in the scheduler's timesteps (no entry rounds to it in "
                f"{dtype}); pass one of scheduler.timesteps, not a loop index or a recomputed value"
            )
        schedule = schedule.to(timestep.device)
        near = schedule[schedule.to(dtype) == timestep]
        return (
            f"timestep {value} ({dtype}) is ambiguous: the schedule entries {near.tolist()} all round to it in "
            f"{dtype}. Pass the timestep in float32, or use fewer inference steps"
        )

    def index_for_timestep(self, timestep, schedule_timesteps: Optional[torch.Tensor] = None) -> int:
        """The schedule index of one timestep (a float or a one-element tensor of any float dtype).

        Unlike diffusers' exact float match, a bf16/fp16 timestep resolves to the one entry that rounds to
        it; ``ValueError`` when none does or when several distinct entries do (ambiguous)."""
        if schedule_timesteps is None:
            schedule_timesteps = self.timesteps
        if isinstance(timestep, torch.Tensor):
            if timestep.numel() != 1:
                raise ValueError(
                    f"timestep must hold one value; got shape {tuple(timestep.shape)} "
                    "(use indices_for_timesteps for a batch)"
                )
            t = timestep.reshape(1)
        elif isinstance(timestep, Real) and not isinstance(timestep, bool):
            t = torch.tensor([float(timestep)], dtype=torch.float32)
        else:
            raise TypeError(f"timestep must be a float or a one-element tensor; got {type(timestep).__name__}")
        code = int(self._resolve(t, schedule_timesteps)[0])
        if code < 0:
            raise ValueError(self._explain(code, t[0], schedule_timesteps))
        return code

    def indices_for_timesteps(self, timesteps: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
        """Vectorized lookup for training batches: int64 [B] schedule indices on ``timesteps``' device,
        with no host sync. Entries that match no schedule entry, or several distinct ones, come back as
        -1; ``strict=True`` raises ``ValueError`` for them instead (one sync)."""
        if not isinstance(timesteps, torch.Tensor):
            raise TypeError(f"timesteps must be a 1-D torch.Tensor; got {type(timesteps).__name__}")
        if timesteps.dim() != 1:
            raise ValueError(f"timesteps must be 1-D [B]; got shape {tuple(timesteps.shape)}")
        if timesteps.dtype == torch.bool or timesteps.dtype.is_complex:
            raise TypeError(f"timesteps must be a real tensor; got {timesteps.dtype}")
        codes = self._resolve(timesteps, self._timestep_table(timesteps.device))
        if strict and timesteps.numel() and bool((codes < 0).any()):
            k = int((codes < 0).nonzero()[0, 0])
            raise ValueError(f"timesteps[{k}]: " + self._explain(int(codes[k]), timesteps[k], self.timesteps))
        return codes.clamp(min=-1)

    def _timestep_table(self, device: torch.device) -> torch.Tensor:
        return self._cached("timesteps", self.timesteps, device)

    def _sigma_table(self, device: torch.device) -> torch.Tensor:
        """``self.sigmas`` as float32 on ``device``, copied once per schedule (not per step)."""
        return self._cached("sigmas", self.sigmas, device)

    def _cached(self, name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, id(table), table._version, str(device))
        hit = self._table_cache.get(key)
        if hit is None:
            self._table_cache = {k: v for k, v in self._table_cache.items() if k[0] != name or k[1] == id(table)}
            hit = self._table_cache[key] = table.to(device=device, dtype=torch.float32, copy=True)
        return hit

    def _init_step_index(self, timestep) -> None:
        if self.begin_index is None:
            if isinstance(timestep, torch.Tensor):
                timestep = timestep.to(self.timesteps.device)
            self._step_index = self.index_for_timestep(timestep)
        else:
            self._step_index = self._begin_index

    # ----------------------------------------------------------------------------- step
    def step(
        self,
        model_output: torch.Tensor,
        timestep: Union[float, torch.Tensor],
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: GeneratorArg = None,
        per_token_timesteps: Optional[torch.Tensor] = None,
        return_dict: bool = True,
    ):
        """One Euler step from ``sample`` at ``timestep``, as diffusers (``s_churn``, ``s_tmin``,
        ``s_tmax``, ``s_noise`` are accepted and unused, as there). Inside ``rollout()`` the step samples
        with ``flowrl.sde_step`` instead and is recorded. ``return_dict=False`` gives ``(prev_sample,)``."""
        if isinstance(timestep, (bool, Integral)) or (
            isinstance(timestep, torch.Tensor) and not timestep.dtype.is_floating_point
        ):
            raise ValueError(
                "timestep must be one of scheduler.timesteps (a float), not an integer index such as one "
                "from enumerate(timesteps)"
            )
        V.check_float_tensor("model_output", model_output)
        V.check_float_tensor("sample", sample)
        if self.step_index is None:
            self._init_step_index(timestep)
        if self._recorder is not None:
            out = self._recorder._step(model_output, sample, per_token_timesteps, generator)
        else:
            out = FlowMatchEulerDiscreteSchedulerOutput(
                self._euler_step(model_output, sample, per_token_timesteps, generator)
            )
        self._step_index += 1
        return out if return_dict else (out.prev_sample,)

    def _euler_step(self, model_output, sample, per_token_timesteps, generator) -> torch.Tensor:
        # diffusers' step, operation for operation: the float32 upcast, a 0-d dt that does not promote
        # model_output, and the cast back to model_output's dtype give its exact bits.
        sample = sample.to(torch.float32)
        if per_token_timesteps is not None:
            per_token_sigmas = per_token_timesteps / self.config.num_train_timesteps
            sigmas = self.sigmas[:, None, None]
            lower_mask = sigmas < per_token_sigmas[None] - 1e-6
            lower_sigmas = lower_mask * sigmas
            lower_sigmas, _ = lower_sigmas.max(dim=0)
            current_sigma = per_token_sigmas[..., None]
            next_sigma = lower_sigmas[..., None]
            dt = current_sigma - next_sigma
        else:
            current_sigma = self.sigmas[self.step_index]
            next_sigma = self.sigmas[self.step_index + 1]
            dt = next_sigma - current_sigma
        if self.config.stochastic_sampling:
            x0 = sample - current_sigma * model_output
            if isinstance(generator, (list, tuple)) and len(generator) == 1:
                generator = generator[0]  # diffusers' randn_tensor treats a list of one as one generator
            noise = draw_noise(sample.shape, V.check_generator(generator, sample.shape[0]), sample.device)
            prev_sample = (1.0 - next_sigma) * x0 + next_sigma * noise
        else:
            prev_sample = sample + dt * model_output
        if per_token_timesteps is None:
            prev_sample = prev_sample.to(model_output.dtype)
        return prev_sample

    # ----------------------------------------------------------------------------- rollout
    def rollout(
        self,
        mode: str = "sde",
        noise_level: float = 0.7,
        log_prob: str = "gaussian",
        reduction: str = "mean",
        sde_steps: Optional[Iterable[int]] = None,
        return_step_indices: Optional[Iterable[int]] = None,
        generator: GeneratorArg = None,
        backend: str = "auto",
    ) -> "RolloutRecorder":
        """A recorder: inside ``with recorder:``, every ``step`` is a rollout step (see RolloutRecorder)."""
        return RolloutRecorder(
            self, mode=mode, noise_level=noise_level, log_prob=log_prob, reduction=reduction,
            sde_steps=sde_steps, return_step_indices=return_step_indices, generator=generator, backend=backend,
        )


def _index_set(name: str, values, upper: Optional[int] = None) -> Optional[List[int]]:
    """None, or sorted unique ints from an iterable of ints / an integer tensor."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.dim() > 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or an iterable of ints; got {values.dtype} {tuple(values.shape)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of ints or None; got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must hold ints; got {v!r}")
        if v < 0 or (upper is not None and v > upper):
            raise ValueError(f"{name} entries must be in [0, {upper}]; got {int(v)}")
        out.append(int(v))
    return sorted(set(out))


class RolloutRecorder:
    """Records one denoising loop run through ``scheduler.step`` (use ``scheduler.rollout(...)``).

    While active (``with recorder:``), step ``i`` of the loop samples x' with ``flowrl.sde_step`` from
    the scheduler's float32 sigma table and index ``i`` (``mode`` on ``sde_steps``, ``ode`` with
    log-prob 0 elsewhere, drawing no noise), emits x' in the model output's dtype, and stores the step's
    input latent and log-prob. ``trajectory()`` returns a ``flowrl.RolloutTrajectory``.

    ``generator``: None (global RNG), one generator, or a list of B (sample i's noise comes from
    generator i only, so it does not depend on the batch); when None, ``step``'s own generator is used.
    ``sde_steps``: loop steps that are stochastic (None: all). ``return_step_indices``: which latents to
    keep, index T being the final output (None: all T + 1).
    """

    def __init__(self, scheduler: FlowMatchEulerDiscreteScheduler, *, mode, noise_level, log_prob, reduction,
                 sde_steps, return_step_indices, generator, backend):
        V.check_choice("mode", mode, V.MODES)
        self.noise_level = V.check_noise_level(noise_level, mode)
        V.check_choice("log_prob", log_prob, V.LOG_PROB_KINDS)
        V.check_choice("reduction", reduction, V.REDUCTIONS)
        V.check_choice("backend", backend, BACKENDS)
        if generator is not None and not isinstance(generator, (torch.Generator, list, tuple)):
            raise TypeError(f"generator must be None, a torch.Generator or a list of them; got {type(generator).__name__}")
        self.scheduler = scheduler
        self.mode, self.log_prob, self.reduction, self.backend = mode, log_prob, reduction, backend
        self.generator = list(generator) if isinstance(generator, (list, tuple)) else generator
        self.sde_steps = _index_set("sde_steps", sde_steps)
        self.return_step_indices = _index_set("return_step_indices", return_step_indices)
        self._reset()

    def _reset(self) -> None:
        self._begin: Optional[int] = None  # schedule index of the loop's first step
        self._num_steps: Optional[int] = None
        self._sigmas: Optional[torch.Tensor] = None  # snapshot, float32 on the sample's device
        self._timesteps: Optional[torch.Tensor] = None
        self._latents: Dict[int, torch.Tensor] = {}
        self._log_probs: List[torch.Tensor] = []
        self._last_prev: Optional[torch.Tensor] = None
        self._batch: Optional[int] = None

    # context manager
    def __enter__(self) -> "RolloutRecorder":
        if self.scheduler._recorder is not None:
            raise RuntimeError("this scheduler is already recording a rollout; rollouts do not nest")
        self._reset()
        self.scheduler._recorder = self
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler._recorder = None

    @property
    def active(self) -> bool:
        return self.scheduler._recorder is self

    @property
    def steps_recorded(self) -> int:
        return len(self._log_probs)

    def _on_set_timesteps(self) -> None:
        if self._log_probs:
            raise RuntimeError(
                "set_timesteps was called after this rollout recorded steps: a rollout records one denoising "
                "loop; use a new `with scheduler.rollout(...)` block for each pipeline call"
            )

    def _start(self, sample: torch.Tensor) -> None:
        sched = self.scheduler
        if sched.config.invert_sigmas:
            raise ValueError("rollout needs a decreasing schedule ending at 0; invert_sigmas=True (Mochi) is not supported")
        self._begin = sched.step_index
        table = sched._sigma_table(sample.device)
        # the loop runs schedule steps begin .. T-1 (begin > 0: img2img); loop step i is schedule step begin + i
        self._sigmas = table[self._begin:].clone()
        self._num_steps = self._sigmas.numel() - 1
        if self._num_steps < 1:
            raise ValueError(f"the loop starts at the schedule's last sigma (step index {self._begin}); nothing to sample")
        V.check_sigmas(self._sigmas, sample.device)
        self._timesteps = sched.timesteps[self._begin:].to(sample.device, copy=True)
        self._batch = sample.shape[0]
        t = self._num_steps
        for name, values, upper in (("sde_steps", self.sde_steps, t - 1), ("return_step_indices", self.return_step_indices, t)):
            if values is not None and values and values[-1] > upper:
                raise ValueError(f"{name} entries must be in [0, {upper}] for this {t}-step loop; got {values[-1]}")
        if isinstance(self.generator, list) and len(self.generator) != self._batch:
            raise ValueError(f"generator must be a list of B = {self._batch} generators; got a list of {len(self.generator)}")

    def _keep(self, loop_step: int) -> bool:
        return self.return_step_indices is None or loop_step in self.return_step_indices

    def _step(self, model_output, sample, per_token_timesteps, step_generator) -> FlowMatchEulerDiscreteSchedulerOutput:
        if per_token_timesteps is not None:
            raise ValueError("per_token_timesteps is not supported inside rollout(): a rollout step has one sigma per sample")
        if self._sigmas is None:
            self._start(sample)
        i = self.steps_recorded
        if i >= self._num_steps:
            raise RuntimeError(f"this rollout already recorded all {self._num_steps} steps of its loop")
        if sample.shape[0] != self._batch:
            raise ValueError(f"sample has batch size {sample.shape[0]}; this rollout started with B = {self._batch}")
        if self.scheduler.step_index != self._begin + i:
            raise RuntimeError(
                f"the scheduler is at step index {self.scheduler.step_index} but the rollout expects "
                f"{self._begin + i}: steps were skipped or repeated"
            )
        if self._last_prev is not None and sample is not self._last_prev and not torch.equal(sample, self._last_prev):
            warnings.warn(
                f"loop step {i}'s input is not step {i - 1}'s output (the pipeline changed the latents between "
                "steps); the trajectory stores each step's input, so recomputing step "
                f"{i - 1}'s log-prob from latents[:, {i}] will not reproduce it"
            )
        stochastic = self.sde_steps is None or i in self.sde_steps
        # an ode step draws no noise (sde_step skips the draw), so the generators advance on sde steps only
        out = sde_step(
            sample, model_output, self._sigmas, i, mode=self.mode if stochastic else "ode",
            noise_level=self.noise_level, log_prob=self.log_prob, reduction=self.reduction, backend=self.backend,
            generator=(self.generator if self.generator is not None else step_generator) if stochastic else None,
        )
        if self._keep(i):
            self._latents[i] = sample.detach()
        self._log_probs.append(out.log_prob.detach())
        self._last_prev = out.prev_sample
        if i + 1 == self._num_steps and self._keep(i + 1):
            self._latents[i + 1] = out.prev_sample.detach()
        return FlowMatchEulerDiscreteSchedulerOutput(out.prev_sample, out.log_prob, out.prev_sample_mean, out.std_dev)

    def trajectory(self) -> RolloutTrajectory:
        """The recorded ``RolloutTrajectory`` (after the loop has run all its steps)."""
        if self._num_steps is None or self.steps_recorded < self._num_steps:
            done = self.steps_recorded
            raise RuntimeError(
                f"the rollout recorded {done} of {self._num_steps or '?'} steps; run the whole denoising loop "
                "(the pipeline call) inside `with recorder:` before calling trajectory()"
            )
        keys = sorted(self._latents)
        dtype = self._latents[keys[0]].dtype
        for k in keys[1:]:
            dtype = torch.promote_types(dtype, self._latents[k].dtype)  # lossless: a bf16 latent widens exactly
        latents = torch.stack([self._latents[k].to(dtype) for k in keys], dim=1)
        device = self._sigmas.device
        return RolloutTrajectory(
            latents=latents,
            log_probs=torch.stack(self._log_probs, dim=1),
            timesteps=self._timesteps,
            sigmas=self._sigmas,
            latent_step_indices=torch.tensor(keys, dtype=torch.int64, device=device),
            mode=self.mode,
            noise_level=self.noise_level,
            log_prob=self.log_prob,
            reduction=self.reduction,
            sde_steps=None if self.sde_steps is None else torch.tensor(self.sde_steps, dtype=torch.int64, device=device),
        )


__all__ = ["FlowMatchEulerDiscreteScheduler", "FlowMatchEulerDiscreteSchedulerOutput", "RolloutRecorder", "SchedulerConfig"]
