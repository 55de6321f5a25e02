"""flowrl's ``FlowMatchEulerDiscreteScheduler``: diffusers' scheduler, copied, plus ``rollout()``.

    pipe.scheduler = flowrl.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    with pipe.scheduler.rollout(mode="sde", noise_level=0.7) as rec:
        pipe(...)
    traj = rec.trajectory()   # flowrl.RolloutTrajectory

``set_timesteps`` and ``step`` are a copy of diffusers' code (same operations in the same order, so the
same bits), so they work without diffusers and do not change when diffusers does. With diffusers
installed the class also subclasses diffusers' ``FlowMatchEulerDiscreteScheduler``: that is what
diffusers checks to save a pipeline component, and what pipelines check with ``isinstance``; every
method diffusers defines for it is overridden here. docs/scheduler.md says why.

Copied from diffusers' ``diffusers/schedulers/scheduling_flow_match_euler_discrete.py`` as of
diffusers 0.42.1 (setup.cfg's tested upper bound); tests/rollout/test_diffusers_mirror.py fails when the
installed diffusers changes a method this copy mirrors.

The bf16-safe timestep lookup lives in ``flowrl.rollout.timestep_lookup``; the rollout recorder, which also
wraps diffusers' own scheduler, in ``flowrl.rollout.recorder`` (``RolloutRecorder`` is re-exported here).
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from numbers import Integral, Real
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..core import _validate as V
from . import timestep_lookup
from ..ops.functional import GeneratorArg, draw_noise
from .recorder import RolloutRecorder, register_scheduler_class, rollout_signature
from .step_output import FlowMatchEulerDiscreteSchedulerOutput, check_step_timestep

try:  # optional: the copy runs without diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler as DiffusersFlowMatchEulerDiscreteScheduler
except ImportError:
    DiffusersFlowMatchEulerDiscreteScheduler = None

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
_FROZEN_HINT = "the scheduler config is frozen; build a new scheduler with from_config(config, key=value)"


class SchedulerConfig(dict):
    """A frozen dict read like diffusers' ``FrozenDict``: ``config.shift``, ``config["shift"]``,
    ``config.get("shift")``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"scheduler config has no key {name!r}") from None

    def _frozen(self, *args, **kwargs):
        raise TypeError(_FROZEN_HINT)

    __setattr__ = __setitem__ = __delitem__ = _frozen
    update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self):  # pickling (DataLoader workers, deepcopy) must not go through __setitem__
        return (SchedulerConfig, (dict(self),))


def _check_real(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise TypeError(f"{name} must be a finite real number{' or None' if allow_none else ''}; got {value!r}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


class FlowMatchEulerDiscreteScheduler(
    *((DiffusersFlowMatchEulerDiscreteScheduler,) if DiffusersFlowMatchEulerDiscreteScheduler else ())
):
    """diffusers' ``FlowMatchEulerDiscreteScheduler`` (same arguments, defaults, config, attributes and
    results; a subclass of it when diffusers is installed), plus ``rollout()`` recording and a bf16-safe
    timestep lookup (``index_for_timestep``, ``indices_for_timesteps``).

    ``pipe.save_pretrained`` saves it as diffusers' scheduler (``model_index.json`` names
    ``["diffusers", "FlowMatchEulerDiscreteScheduler"]``), so the saved pipeline reloads with plain
    diffusers, flowrl imported or not, and its scheduler computes the same results."""

    order = 1
    config_name = CONFIG_NAME
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
            V.check_bool(name, flag)
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
        if DiffusersFlowMatchEulerDiscreteScheduler is not None and type(self) is FlowMatchEulerDiscreteScheduler:
            # A pipeline records a component as (the library of its __module__, its class name) when it is
            # assigned, and save_pretrained writes that to model_index.json. Naming diffusers' module (on
            # this instance only; the class and pickling keep flowrl's) saves the pipeline as plain
            # diffusers, which reloads anywhere. A subclass keeps its own module: diffusers has no class
            # of its name.
            self.__module__ = DiffusersFlowMatchEulerDiscreteScheduler.__module__

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
        self._table_cache: Dict[Any, torch.Tensor] = {}

    # ----------------------------------------------------------------------------- config & loading
    @property
    def config(self) -> SchedulerConfig:
        return self._config

    def register_to_config(self, **kwargs) -> None:
        """Refused: the config is frozen (diffusers would change the config without rebuilding the
        schedule, so the two would disagree)."""
        raise TypeError(_FROZEN_HINT)

    @classmethod
    def from_config(cls, config: Mapping, **kwargs) -> "FlowMatchEulerDiscreteScheduler":
        """Build from a diffusers scheduler config (dict or FrozenDict). Private ``_...`` keys are
        ignored, ``kwargs`` override config values, and keys this scheduler does not take are ignored
        with a warning (as diffusers does). A ``flow_shift`` (Wan's UniPC and Sana's DPM configs) is
        used as ``shift`` when no ``shift`` is given, with an info-level log saying so."""
        if not isinstance(config, Mapping):
            hint = " (pass scheduler.config, not the scheduler)" if hasattr(config, "config") else ""
            raise TypeError(f"config must be a dict or FrozenDict{hint}; got {type(config).__name__}")
        merged = {k: v for k, v in config.items() if not str(k).startswith("_")}
        merged.update(kwargs)
        if merged.get("flow_shift") is not None and "shift" not in merged:
            # Wan's UniPC and Sana's DPM configs call this scheduler's shift flow_shift; dropping it would
            # run shift 1.0 silently (diffusers' own from_config does, with only an ignored-keys warning)
            merged["shift"] = merged.pop("flow_shift")
            logger.info("from_config: config key flow_shift=%s is used as shift (Wan/Sana UniPC/DPM configs "
                        "name this scheduler's shift flow_shift)", merged["shift"])
        unknown = sorted(k for k in merged if k not in _DEFAULTS)
        if unknown:
            warnings.warn(f"FlowMatchEulerDiscreteScheduler ignores config keys it does not take: {unknown}")
        return cls(**{k: v for k, v in merged.items() if k in _DEFAULTS})

    def to_json_string(self) -> str:
        """The config as ``scheduler_config.json`` holds it (diffusers' ``ConfigMixin`` name)."""
        return json.dumps(dict(self.config), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: Union[str, os.PathLike], push_to_hub: bool = False, **kwargs) -> None:
        """Write ``save_directory/scheduler_config.json`` as diffusers does; ``pipe.save_pretrained``
        calls this. ``push_to_hub`` is not supported (upload the folder with huggingface_hub)."""
        if push_to_hub:
            raise ValueError("push_to_hub=True is not supported; save locally and upload the folder with huggingface_hub")
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    save_config = save_pretrained  # diffusers' ConfigMixin name for the same file

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Union[str, os.PathLike], subfolder: Optional[str] = None, **kwargs
    ) -> "FlowMatchEulerDiscreteScheduler":
        """Load a local ``scheduler_config.json`` (a directory, or a pipeline directory with
        ``subfolder="scheduler"``); ``kwargs`` override config values. Hub downloads go through diffusers:
        ``from_config(diffusers_sched.config)``."""
        path = pretrained_model_name_or_path
        folder = os.path.join(path, subfolder) if subfolder else os.fspath(path)
        file = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(file):
            raise ValueError(
                f"pretrained_model_name_or_path must be a local directory holding {CONFIG_NAME} (with subfolder); "
                f"{file} does not exist. To load from the Hub, load diffusers' scheduler and call "
                "FlowMatchEulerDiscreteScheduler.from_config(its.config)"
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
            return self._time_shift_exponential(mu, sigma, t)
        return self._time_shift_linear(mu, sigma, t)

    def _time_shift_exponential(self, mu: float, sigma: float, t):
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)

    def _time_shift_linear(self, mu: float, sigma: float, t):
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
    def index_for_timestep(self, timestep, schedule_timesteps: Optional[torch.Tensor] = None) -> int:
        """The schedule index of one timestep (a float or a one-element tensor of any float dtype).

        Unlike diffusers' exact float match, a bf16/fp16 timestep resolves to the one entry that rounds to
        it; ``ValueError`` when none does or when several distinct entries do (ambiguous). See
        ``flowrl.rollout.timestep_lookup``."""
        return timestep_lookup.index_for_timestep(
            timestep, self.timesteps if schedule_timesteps is None else schedule_timesteps
        )

    def indices_for_timesteps(self, timesteps: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
        """Vectorized lookup for training batches: int64 [B] schedule indices on ``timesteps``' device,
        with no host sync. Entries that match no schedule entry, or several distinct ones, come back as
        -1; ``strict=True`` raises ``ValueError`` for them instead (one sync)."""
        if not isinstance(timesteps, torch.Tensor):
            raise TypeError(f"timesteps must be a 1-D torch.Tensor; got {type(timesteps).__name__}")
        return timestep_lookup.indices_for_timesteps(timesteps, self._timestep_table(timesteps.device), strict=strict)

    def _timestep_table(self, device: torch.device) -> torch.Tensor:
        """``self.timesteps`` on ``device``, copied once per schedule (not per lookup)."""
        table = self.timesteps
        key = (id(table), table._version, str(device))
        hit = self._table_cache.get(key)
        if hit is None:
            # drop copies of replaced schedules; keep this schedule's copies on other devices
            self._table_cache = {k: v for k, v in self._table_cache.items() if k[0] == id(table)}
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
        ``s_tmax``, ``s_noise`` are accepted and unused, as there). ``return_dict=False`` gives
        ``(prev_sample,)``. Inside ``rollout()`` the recorder runs in this method's place."""
        check_step_timestep(timestep)
        V.check_float_tensor("model_output", model_output)
        V.check_float_tensor("sample", sample)
        if self.step_index is None:
            self._init_step_index(timestep)
        out = FlowMatchEulerDiscreteSchedulerOutput(self._euler_step(model_output, sample, per_token_timesteps, generator))
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
    def rollout(self, **options):
        """A ``flowrl.rollout.recorder.RolloutRecorder`` for this scheduler: inside ``with recorder:``, every
        ``step`` is a rollout step. ``options`` are the recorder's (``mode``, ``noise_level``,
        ``log_prob_kind``, ``reduction``, ``sde_steps``, ``return_step_indices``, ``generator``, ``frozen``,
        ``backend``, ``solver_order`` for mode='dpm_sde', and the replay options ``model``, ``env_device``,
        ``output_transform``, ``debug``; ``store="device" | "cpu"``, where the recording is kept); same as
        ``flowrl.rollout.recorder.rollout(scheduler, **options)``.
        ``per_token_timesteps`` and copies of the scheduler made during the rollout (streams) are
        recorded too. With ``stochastic_sampling=True`` in the config the step is cps at noise_level 1:
        record it with ``mode="cps", noise_level=1.0``."""
        return RolloutRecorder(self, **options)

    rollout.__signature__ = rollout_signature()


# a rollout drives this copy too (the recorder does not import this module: it imports the recorder)
register_scheduler_class(FlowMatchEulerDiscreteScheduler)


__all__ = [
    "FlowMatchEulerDiscreteScheduler", "FlowMatchEulerDiscreteSchedulerOutput", "RolloutRecorder", "SchedulerConfig",
]
