"""Record RL rollouts from an unmodified denoising loop, with the scheduler the pipeline already has.

    from flowrl.recorder import rollout

    with rollout(pipe.scheduler, mode="sde", noise_level=0.7) as rec:   # diffusers' or flowrl's scheduler
        pipe(...)
    traj = rec.trajectory()   # flowrl.RolloutTrajectory

While the ``with`` block runs, the recorder sets ``step`` and ``set_timesteps`` on that scheduler
*instance* (its class is untouched, other instances too); leaving the block restores them, also on an
exception. ``flowrl.FlowMatchEulerDiscreteScheduler.rollout(...)`` is the same recorder.

A rollout replaces the scheduler's Euler step ``x + (sigma' - sigma) v`` on its own sigma table, so it
drives ``FlowMatchEulerDiscreteScheduler`` (diffusers', flowrl's, or a subclass) and refuses configs
whose plain step is something else.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from numbers import Integral
from typing import Dict, Iterable, List, Optional

import torch

from . import _validate as V
from ._dispatch import BACKENDS
from .functional import GeneratorArg, sde_step
from .scheduler import (
    DiffusersFlowMatchEulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchEulerDiscreteSchedulerOutput,
    check_step_timestep,
)
from .timestep_lookup import index_for_timestep
from .trajectory import RolloutTrajectory

_PATCHED = ("step", "set_timesteps")


# What a recording step takes: the arguments of diffusers' FlowMatchEulerDiscreteScheduler.step, which
# flowrl's copy has too (without self).
_STEP_SIGNATURE = inspect.signature(FlowMatchEulerDiscreteScheduler.step)
_STEP_SIGNATURE = _STEP_SIGNATURE.replace(parameters=list(_STEP_SIGNATURE.parameters.values())[1:])


def check_scheduler(scheduler, mode: Optional[str] = None, noise_level: Optional[float] = None,
                    sde_steps=None) -> None:
    """Raise ``TypeError`` / ``ValueError`` (naming ``scheduler``) unless a rollout can drive this
    scheduler: a ``FlowMatchEulerDiscreteScheduler`` instance (diffusers', flowrl's or a subclass) whose
    plain step is the Euler step on a decreasing sigma table, or, with ``stochastic_sampling=True``,
    the step x' = (1 - sigma') x0_hat + sigma' eps, which is cps at noise_level 1: then the rollout's
    ``mode``, ``noise_level`` and ``sde_steps`` must be that process (docs/contract.md, Variants)."""
    if isinstance(scheduler, type):
        raise TypeError(f"scheduler must be a scheduler instance, not the class {scheduler.__name__}")
    classes = tuple(c for c in (FlowMatchEulerDiscreteScheduler, DiffusersFlowMatchEulerDiscreteScheduler) if c)
    if not isinstance(scheduler, classes):
        raise TypeError(
            f"scheduler must be a FlowMatchEulerDiscreteScheduler (diffusers', flowrl's or a subclass); got "
            f"{type(scheduler).__name__}. A rollout replaces the Euler step x + (sigma' - sigma) v of that "
            "scheduler; other schedulers (Heun, LCM, multistep, DDIM) step differently"
        )
    if mode == "ddim":
        raise ValueError("mode='ddim' steps an alpha-bar (DDPM) schedule, not this scheduler's sigma table: record it "
                         "with flowrl.DDIMScheduler(...).rollout() (or flowrl.ddim.DDIMRolloutRecorder)")
    config = scheduler.config
    if config.get("stochastic_sampling", False) and (mode != "cps" or noise_level != 1 or sde_steps is not None):
        raise ValueError(
            "scheduler has config.stochastic_sampling=True: its step x' = (1 - sigma') x0_hat + sigma' eps is "
            "cps at noise_level 1 on every step, so record it with mode='cps', noise_level=1.0 and sde_steps=None "
            f"(got mode={mode!r}, noise_level={noise_level!r}, sde_steps={sde_steps!r}), or use "
            "type(scheduler).from_config(scheduler.config, stochastic_sampling=False)"
        )
    if config.get("invert_sigmas", False):
        raise ValueError(
            "scheduler has config.invert_sigmas=True (Mochi): rollout needs a decreasing schedule ending at 0"
        )
    if getattr(scheduler, "order", 1) != 1:
        raise ValueError(f"scheduler has order {scheduler.order}; a rollout records one step per model call (order 1)")
    missing = [a for a in ("sigmas", "timesteps", "_step_index", "_begin_index") if not hasattr(scheduler, a)]
    if missing or not hasattr(scheduler, "__dict__"):
        raise TypeError(
            f"scheduler ({type(scheduler).__name__}) lacks {missing or '__dict__'}, which a rollout reads and "
            "sets as diffusers' FlowMatchEulerDiscreteScheduler has them"
        )


def _solver_order(mode: str, solver_order) -> Optional[int]:
    """dpm_sde's solver order (1 or 2; default 2, diffusers' DPM solvers' default); None for other modes."""
    if mode != "dpm_sde":
        if solver_order is not None:
            raise ValueError(f"solver_order is mode='dpm_sde''s; got it with mode={mode!r}")
        return None
    if solver_order is None:
        return 2
    if isinstance(solver_order, bool) or solver_order not in (1, 2):
        raise ValueError(f"solver_order must be 1 or 2 for mode='dpm_sde'; got {solver_order!r}")
    return int(solver_order)


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
    """Records one denoising loop run through ``scheduler.step``.

    While active (``with recorder:``), step ``i`` of the loop samples x' with ``flowrl.sde_step`` from
    the scheduler's float32 sigma table and index ``i`` (``mode`` on ``sde_steps``, ``ode`` with
    log-prob 0 elsewhere, drawing no noise), emits x' in the model output's dtype, and stores the step's
    input latent and log-prob. ``trajectory()`` returns a ``flowrl.RolloutTrajectory``.

    ``scheduler``: a ``FlowMatchEulerDiscreteScheduler`` instance, diffusers' or flowrl's (see
    ``check_scheduler``). ``generator``: None (global RNG), one generator, or a list of B (sample i's
    noise comes from generator i only, so it does not depend on the batch); when None, ``step``'s own
    generator is used. ``sde_steps``: loop steps that are stochastic (None: all).
    ``return_step_indices``: which latents to keep, index T being the final output (None: all T + 1).
    ``solver_order`` (mode='dpm_sde' only; 1 or 2, default 2): at 2 the recorder keeps each step's data
    prediction ``x - sigma v`` for the next step's mean, as diffusers' DPM solvers keep their
    model_outputs, and the trajectory stores it (``prev_x0_preds``) so the recompute scores the same
    transition.
    """

    def __init__(
        self,
        scheduler,
        *,
        mode: str = "sde",
        noise_level: float = 0.7,
        log_prob: str = "gaussian",
        reduction: str = "mean",
        sde_steps: Optional[Iterable[int]] = None,
        return_step_indices: Optional[Iterable[int]] = None,
        generator: GeneratorArg = None,
        backend: str = "auto",
        solver_order: Optional[int] = None,
    ):
        self._check_scheduler(scheduler, mode, noise_level, sde_steps)
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
        self.solver_order = _solver_order(mode, solver_order)
        self.return_step_indices = _index_set("return_step_indices", return_step_indices)
        self._saved: Dict[str, object] = {}
        self._reset()

    def _reset(self) -> None:
        self._begin: Optional[int] = None  # schedule index of the loop's first step
        self._num_steps: Optional[int] = None
        self._sigmas: Optional[torch.Tensor] = None  # snapshot, float32 on the sample's device
        self._timesteps: Optional[torch.Tensor] = None
        self._latents: Dict[int, torch.Tensor] = {}
        self._log_probs: List[torch.Tensor] = []
        self._last_prev: Optional[torch.Tensor] = None
        self._x0_pred: Optional[torch.Tensor] = None  # dpm_sde order 2: the last step's data prediction
        self._prev_x0_preds: List[torch.Tensor] = []
        self._batch: Optional[int] = None

    # ------------------------------------------------------- what a scheduler family changes (flowrl.ddim)
    # A recorder for another scheduler family (flowrl.ddim.DDIMRolloutRecorder) overrides these, and
    # _step / _start (its step's arguments, its schedule table); the recording itself is shared.
    _check_scheduler = staticmethod(check_scheduler)

    def _scheduler_step_index(self) -> Optional[int]:
        return self.scheduler.step_index

    def _step_options(self, stochastic: bool) -> dict:
        """sde_step's mode options for a loop step: the rollout's mode, or ode on a deterministic step."""
        return {"mode": self.mode if stochastic else "ode", "noise_level": self.noise_level}

    # ------------------------------------------------------------------ patching the scheduler instance
    def __enter__(self) -> "RolloutRecorder":
        sched = self.scheduler
        if getattr(sched.step, "_flowrl_recorder", None) is not None:
            raise RuntimeError("this scheduler is already recording a rollout; rollouts do not nest")
        self._check_scheduler(sched, self.mode, self.noise_level, self.sde_steps)  # the config may have changed
        self._reset()
        # an instance attribute the scheduler already had (another wrapper) comes back on exit
        self._saved = {name: sched.__dict__[name] for name in _PATCHED if name in sched.__dict__}
        original_set_timesteps = sched.set_timesteps

        # functools.wraps keeps the scheduler's signature visible: pipelines inspect step and
        # set_timesteps (retrieve_timesteps looks for "sigmas", extra-step-kwargs for "generator")
        @functools.wraps(sched.step)
        def step(*args, **kwargs):
            return self._step(*args, **kwargs)

        @functools.wraps(original_set_timesteps)
        def set_timesteps(*args, **kwargs):
            self._on_set_timesteps()
            return original_set_timesteps(*args, **kwargs)

        step._flowrl_recorder = set_timesteps._flowrl_recorder = self
        sched.step, sched.set_timesteps = step, set_timesteps
        return self

    def __exit__(self, *exc) -> None:
        sched = self.scheduler
        for name in _PATCHED:
            if name in self._saved:
                setattr(sched, name, self._saved[name])
            elif name in sched.__dict__:
                delattr(sched, name)
        self._saved = {}

    @property
    def active(self) -> bool:
        return getattr(self.scheduler.step, "_flowrl_recorder", None) is self

    @property
    def steps_recorded(self) -> int:
        return len(self._log_probs)

    def _on_set_timesteps(self) -> None:
        if self._log_probs:
            raise RuntimeError(
                "set_timesteps was called after this rollout recorded steps: a rollout records one denoising "
                "loop; use a new `with scheduler.rollout(...)` block for each pipeline call"
            )

    # ------------------------------------------------------------------ the recording step
    def _step(self, *args, **kwargs):
        try:
            arguments = _STEP_SIGNATURE.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"scheduler.step while recording a rollout takes diffusers' FlowMatchEulerDiscreteScheduler.step "
                f"arguments: {exc}"
            ) from None
        arguments.apply_defaults()
        given = arguments.arguments  # s_churn, s_tmin, s_tmax, s_noise: accepted and unused, as in diffusers
        model_output, timestep, sample = given["model_output"], given["timestep"], given["sample"]
        check_step_timestep(timestep)
        V.check_float_tensor("model_output", model_output)
        V.check_float_tensor("sample", sample)
        if given["per_token_timesteps"] is not None:
            raise ValueError("per_token_timesteps is not supported inside rollout(): a rollout step has one sigma per sample")
        sched = self.scheduler
        if sched.step_index is None:
            # the scheduler's own rule, with flowrl's bf16-safe lookup (diffusers' exact match fails on bf16)
            begin = sched.begin_index
            sched._step_index = index_for_timestep(timestep, sched.timesteps) if begin is None else begin
        out = self._record(model_output, sample, given["generator"])
        sched._step_index += 1
        return out if given["return_dict"] else (out.prev_sample,)

    def _start(self, sample: torch.Tensor) -> None:
        sched = self.scheduler
        if not isinstance(sched.sigmas, torch.Tensor) or sched.sigmas.dtype != torch.float32:
            got = sched.sigmas.dtype if isinstance(sched.sigmas, torch.Tensor) else type(sched.sigmas).__name__
            raise TypeError(f"scheduler.sigmas must be a float32 tensor, diffusers' table; got {got}")
        self._begin = sched.step_index
        # the loop runs schedule steps begin .. T-1 (begin > 0: img2img); loop step i is schedule step begin + i
        self._sigmas = sched.sigmas[self._begin:].to(device=sample.device, copy=True)
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

    def _record(self, model_output, sample, step_generator) -> FlowMatchEulerDiscreteSchedulerOutput:
        if self._sigmas is None:
            self._start(sample)
        i = self.steps_recorded
        if i >= self._num_steps:
            raise RuntimeError(f"this rollout already recorded all {self._num_steps} steps of its loop")
        if sample.shape[0] != self._batch:
            raise ValueError(f"sample has batch size {sample.shape[0]}; this rollout started with B = {self._batch}")
        if self._scheduler_step_index() != self._begin + i:
            raise RuntimeError(
                f"the scheduler is at step index {self.scheduler.step_index} but the rollout expects "
                f"{self._begin + i}: steps were skipped or repeated"
            )
        # torch.equal reads a device value (a sync, refused while capturing a CUDA graph): like the value
        # checks, skipped while capturing and inside flowrl.no_value_checks(); the warning is all it gives
        if (self._last_prev is not None and sample is not self._last_prev and not V._skip_value_reads()
                and not torch.equal(sample, self._last_prev)):
            warnings.warn(
                f"loop step {i}'s input is not step {i - 1}'s output (the pipeline changed the latents between "
                "steps); the trajectory stores each step's input, so recomputing step "
                f"{i - 1}'s log-prob from latents[:, {i}] will not reproduce it"
            )
        stochastic = self.sde_steps is None or i in self.sde_steps
        prev_x0 = self._second_order_input(sample, model_output, i)
        # an ode step draws no noise (sde_step skips the draw), so the generators advance on sde steps only
        out = sde_step(
            sample, model_output, self._sigmas, i, **self._step_options(stochastic),
            log_prob=self.log_prob, reduction=self.reduction, backend=self.backend,
            generator=(self.generator if self.generator is not None else step_generator) if stochastic else None,
            prev_x0_pred=prev_x0 if stochastic else None,
        )
        if self._keep(i):
            self._latents[i] = sample.detach()
        self._log_probs.append(out.log_prob.detach())
        self._last_prev = out.prev_sample
        if i + 1 == self._num_steps and self._keep(i + 1):
            self._latents[i + 1] = out.prev_sample.detach()
        return FlowMatchEulerDiscreteSchedulerOutput(out.prev_sample, out.log_prob, out.prev_sample_mean, out.std_dev)

    def _second_order_input(self, sample, model_output, i: int) -> Optional[torch.Tensor]:
        """dpm_sde at solver order 2: the data prediction of the previous step (zeros at step 0, which
        reads none), stored for replay; then keeps this step's ``x - sigma v`` (float32, float64 for a
        float64 rollout) for the next, as diffusers' DPM solvers keep their model_outputs."""
        if self.solver_order != 2:
            return None
        dtype = torch.float64 if torch.float64 in (sample.dtype, model_output.dtype) else torch.float32
        x, v = sample.detach().to(dtype), model_output.detach().to(dtype)
        prev_x0 = torch.zeros_like(x) if self._x0_pred is None else self._x0_pred
        self._prev_x0_preds.append(prev_x0)
        self._x0_pred = x - self._sigmas[i].to(dtype) * v
        return prev_x0

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
            prev_x0_preds=torch.stack(self._prev_x0_preds, dim=1) if self._prev_x0_preds else None,
        )


# ``with rollout(pipe.scheduler, mode="sde") as rec:``: a recorder for a scheduler instance the pipeline
# or trainer already has (diffusers' FlowMatchEulerDiscreteScheduler, flowrl's, or a subclass); the
# constructor itself, so its options are declared once.
rollout = RolloutRecorder


__all__ = ["RolloutRecorder", "rollout", "check_scheduler"]
