"""flowrl's ``DDIMScheduler``: diffusers' ``DDIMScheduler`` plus ``rollout()`` (mode='ddim').

    pipe.scheduler = flowrl.DDIMScheduler.from_config(pipe.scheduler.config)
    with pipe.scheduler.rollout(noise_level=1.0) as rec:     # eta = 1: DDPO's setting
        pipe(...)
    traj = rec.trajectory()   # flowrl.RolloutTrajectory, mode "ddim"
    lp = flowrl.step_log_prob(x, v, x_next, traj.sigmas, i, **traj.step_options())

The class subclasses diffusers' ``DDIMScheduler`` and changes nothing of it: same config, same
``set_timesteps``, same ``step`` outside a rollout, same ``save_pretrained`` / ``from_pretrained``.
Inside ``with scheduler.rollout(...)`` every ``step`` is ``flowrl.sde_step(mode="ddim")`` on the
alpha-bar table of the loop (``alpha_bar_table``), recorded by the same ``RolloutRecorder`` as the flow
scheduler's. Its float32 operations are diffusers' own, in diffusers' order, so on float32 latents the
rollout's samples are diffusers' bit for bit (at eta = 0, and at eta > 0 with the same noise). Half
precision: diffusers computes each operation in the latents' dtype, flowrl in float32 with one rounding
(the contract's rule; docs/contract.md, ddim), so bf16 samples can differ by an ulp; at eta = 0 (a
deterministic step: log-prob 0, and replay reads only the stored latents) a rollout's ``step`` returns
diffusers' own bf16 sample, so a pipeline's output does not change when a rollout records it.

diffusers is needed for this module (it is the base class), not for the rest of flowrl.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..core import _validate as V
from .recorder import RolloutRecorder, rollout_signature
from .scheduler import FlowMatchEulerDiscreteSchedulerOutput
from ..core.step_spec import ddim_options
from .timestep_lookup import index_for_timestep

try:
    from diffusers import DDIMScheduler as DiffusersDDIMScheduler
except ImportError as exc:  # pragma: no cover - diffusers is a test dependency
    raise ImportError("flowrl.DDIMScheduler subclasses diffusers' DDIMScheduler: install diffusers") from exc

_HALF = (torch.bfloat16, torch.float16)


def alpha_bar_table(scheduler, device=None) -> torch.Tensor:
    """mode='ddim''s schedule for the loop ``scheduler.timesteps`` (after ``set_timesteps``): float32
    [2T] with ``table[2i] = alphas_cumprod[t_i]`` and ``table[2i + 1] = alphas_cumprod[t_i - ratio]``, or
    ``final_alpha_cumprod`` where that is negative, ``ratio = num_train_timesteps // num_inference_steps``:
    exactly the values diffusers' ``DDIMScheduler.step`` reads (its ``prev_timestep`` is that stride
    whatever ``timestep_spacing`` made the loop, so a pair is not always two neighbours of the loop)."""
    if getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError("scheduler has no timesteps yet: call scheduler.set_timesteps(num_inference_steps) first")
    ratio = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    ac = scheduler.alphas_cumprod
    pairs = []
    for t in scheduler.timesteps.tolist():
        prev = int(t) - ratio
        pairs += [ac[int(t)], ac[prev] if prev >= 0 else scheduler.final_alpha_cumprod]
    table = torch.stack([p.to(torch.float32).reshape(()) for p in pairs])
    return table if device is None else table.to(device)


def check_scheduler(scheduler, mode=None, noise_level=None, sde_steps=None) -> None:
    """Raise unless a ddim rollout can drive ``scheduler``: a diffusers ``DDIMScheduler`` (flowrl's or a
    subclass) without dynamic thresholding (its per-sample quantile clip is not in the contract)."""
    if isinstance(scheduler, type):
        raise TypeError(f"scheduler must be a scheduler instance, not the class {scheduler.__name__}")
    if not isinstance(scheduler, DiffusersDDIMScheduler):
        raise TypeError(f"scheduler must be a DDIMScheduler (diffusers', flowrl's or a subclass); got {type(scheduler).__name__}")
    if scheduler.config.get("thresholding", False):
        raise ValueError(
            "scheduler has config.thresholding=True: dynamic thresholding clips x0 by a per-sample quantile, "
            "which mode='ddim' does not implement; use clip_sample=True (a fixed clip_sample_range) or "
            "type(scheduler).from_config(scheduler.config, thresholding=False)"
        )
    if mode is not None and mode != "ddim":
        raise ValueError(f"a DDIMScheduler rollout records mode='ddim'; got mode={mode!r}")


def ddim_step_options(scheduler) -> dict:
    """sde_step's ddim options from the scheduler's config: prediction_type and clip_sample_range (None
    when clip_sample is off)."""
    config = scheduler.config
    clip = float(config.clip_sample_range) if config.clip_sample else None
    options = {"prediction_type": config.prediction_type, "clip_sample_range": clip}
    ddim_options("ddim", **options)  # a bad config fails here, naming the option
    return options


_DDIM_STEP_SIGNATURE = inspect.signature(DiffusersDDIMScheduler.step)
_DDIM_STEP_SIGNATURE = _DDIM_STEP_SIGNATURE.replace(parameters=list(_DDIM_STEP_SIGNATURE.parameters.values())[1:])


class DDIMRolloutRecorder(RolloutRecorder):
    """``RolloutRecorder`` for a ``DDIMScheduler``: loop step i samples x' with ``flowrl.sde_step(mode=
    "ddim")`` from the loop's alpha-bar table (``alpha_bar_table``) and index i, ``noise_level`` being
    eta (the pipeline's ``eta`` argument is ignored inside a rollout: the recorder's noise_level is the
    rollout's eta), with the scheduler config's prediction_type and clip_sample_range. Steps outside
    ``sde_steps`` run at eta = 0 (log-prob 0). ``variance_noise=`` passed to ``step`` is the step's eps,
    as in diffusers. The options are ``RolloutRecorder``'s; ``mode`` is "ddim"."""

    _check_scheduler = staticmethod(check_scheduler)

    def __init__(self, scheduler, *, mode: str = "ddim", noise_level: float = 1.0, **options):
        if options.get("frozen") is not None:
            raise ValueError("frozen is not supported with mode='ddim': frozen masks are defined for the flow "
                             "modes' per-element steps (docs/contract.md)")
        super().__init__(scheduler, mode=mode, noise_level=noise_level, **options)  # checks via _check_scheduler

    def _reset(self) -> None:
        super()._reset()
        self._loop_step: Optional[int] = None
        self._variance_noise: Optional[torch.Tensor] = None
        self._ddim = None

    def _scheduler_step_index(self, stream) -> Optional[int]:
        return self._loop_step  # DDIMScheduler keeps no step index: the loop position of this step's timestep

    def _step_options(self, stochastic: bool) -> dict:
        options = {"mode": "ddim", "noise_level": self.noise_level if stochastic else 0.0, **self._ddim}
        if stochastic and self.noise_level > 0 and self._variance_noise is not None:
            options["noise"] = self._variance_noise
        return options

    def _step(self, stream, *args, **kwargs):
        try:
            arguments = _DDIM_STEP_SIGNATURE.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"scheduler.step while recording a rollout takes diffusers' DDIMScheduler.step arguments: {exc}") from None
        arguments.apply_defaults()
        given = arguments.arguments
        model_output, timestep, sample = given["model_output"], given["timestep"], given["sample"]
        V.check_float_tensor("model_output", model_output)
        V.check_float_tensor("sample", sample)
        if given["use_clipped_model_output"]:
            raise ValueError("use_clipped_model_output=True is not supported inside rollout(): mode='ddim' takes eps_hat "
                             "from the model output (diffusers' default)")
        if given["variance_noise"] is not None and (given["generator"] is not None or self.generator is not None):
            raise ValueError("Cannot pass both generator and variance_noise (diffusers' rule); the rollout's generator counts")
        sched = stream.scheduler
        if sched.num_inference_steps is None:
            raise ValueError("Number of inference steps is 'None', you need to run 'set_timesteps' after creating the scheduler")
        if stream.sigmas is None:
            stream.begin = index_for_timestep(timestep, sched.timesteps)
        self._loop_step = index_for_timestep(timestep, sched.timesteps)
        self._variance_noise = given["variance_noise"]
        out = self._record(stream, model_output, sample, given["generator"], None)
        if (sample.dtype in _HALF or model_output.dtype in _HALF) and out.std_dev.eq(0).all():
            # a deterministic step in half precision: diffusers' own per-operation rounding (docs: module)
            plain = type(sched).step(sched, model_output, timestep, sample, eta=0.0, return_dict=True)
            out = FlowMatchEulerDiscreteSchedulerOutput(plain.prev_sample, out.log_prob, out.prev_sample_mean, out.std_dev)
            self._replace_last_output(stream, out.prev_sample)
        return out if given["return_dict"] else (out.prev_sample,)

    def _replace_last_output(self, stream, prev_sample: torch.Tensor) -> None:
        """The emitted sample is the next step's input and, at the last step, the stored final latent."""
        stream.last_prev = prev_sample
        last = stream.steps_recorded  # the step just recorded is steps_recorded - 1; its output's index
        if last in stream.latents:
            stream.latents[last] = self._host.keep(prev_sample)

    def _loop_schedule(self, stream, sample: torch.Tensor):
        """The loop's alpha-bar table (``alpha_bar_table`` from the loop's first step; ``stream.begin`` is
        set by ``_step``) and its step count."""
        self._ddim = ddim_step_options(stream.scheduler)
        table = alpha_bar_table(stream.scheduler, sample.device)[2 * stream.begin:]
        if table.numel() < 2:
            raise ValueError(f"the loop starts after the schedule's last timestep (index {stream.begin}); nothing to sample")
        return table, table.numel() // 2

    def trajectory(self):
        from dataclasses import replace

        traj = super().trajectory()
        return replace(traj, prediction_type=self._ddim["prediction_type"],
                       clip_sample_range=self._ddim["clip_sample_range"])


class DDIMScheduler(DiffusersDDIMScheduler):
    """diffusers' ``DDIMScheduler`` (subclassed, unchanged: config, ``set_timesteps``, ``step``,
    ``save_pretrained`` / ``from_pretrained``) plus ``rollout()``, which records a rollout with mode
    'ddim' (see the module docs)."""

    def __new__(cls, *args, **kwargs):
        # (not __init__: diffusers reads the config keys from __init__'s signature, which stays its own)
        scheduler = super().__new__(cls)
        if cls is DDIMScheduler:
            # a pipeline records a component as (its class's library, its name) and saves that to
            # model_index.json: naming diffusers' module on this instance saves the pipeline as plain
            # diffusers, which reloads anywhere (as flowrl.FlowMatchEulerDiscreteScheduler does)
            scheduler.__module__ = DiffusersDDIMScheduler.__module__
        return scheduler

    def rollout(self, **options) -> DDIMRolloutRecorder:
        """A ``DDIMRolloutRecorder`` for this scheduler (``noise_level`` is eta, default 1.0; the other
        options are ``RolloutRecorder``'s)."""
        return DDIMRolloutRecorder(self, **options)

    rollout.__signature__ = rollout_signature(DDIMRolloutRecorder, mode="ddim", noise_level=1.0)


__all__ = ["DDIMScheduler", "DDIMRolloutRecorder", "alpha_bar_table", "check_scheduler", "ddim_step_options"]
