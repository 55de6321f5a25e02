"""flowrl's step inside SGLang's diffusion rollout engine (``POST /rollout/generate``).

In the SGLang server process, before it serves a rollout:

    import flowrl.compat.sglang
    flowrl.compat.sglang.register()

or, in a denoising loop of your own, SGLang's seam directly:
``prepare_rollout_if_enabled(batch=..., pipeline_config=..., build_controller=flowrl.compat.sglang.build_controller)``.

SGLang (0.5.23, ``runtime/post_training/rollout_hooks.py``) builds one ``FlowRolloutController`` per rollout
request (``prepare_rollout_if_enabled(..., build_controller=)``, whose default ``register()`` replaces) and
hands its ``transition`` to ``scheduler.step``. flowrl's controller is SGLang's, with the transition
(``flow_sde_sampling``) computed by ``flowrl.sde_step`` (Triton on a GPU, torch otherwise) on the same
noise, drawn from the request's generators exactly as SGLang draws it. What changes:

- ``rollout_log_probs`` are flowrl's log-probs of the emitted sample, in the dtype ``scheduler.step``
  emits (the model output's), which is the sample the next step consumes and the response returns in
  ``dit_trajectory.latents``; SGLang's own score the float32 sample before that rounding. Training's
  ``traj.step_log_prob(j, v)`` on ``flowrl.data.sglang.from_sglang(body)`` then reproduces them bit for bit:
  a first-update ratio of exactly 1, in float32 and bf16.
- A deterministic step (noise level 0, the last ``cps`` step, ``ode``) has log-prob 0 (docs/contract.md),
  where SGLang asserts or divides 0 by 0.
- Under sequence parallelism each rank gathers the step's sample and model output (one all-gather of
  two latents per step), computes the step on the whole sample, identical on every rank, and keeps its
  shard: the log-probs are those of the unsharded step, bit for bit.
- The response's format is unchanged; the debug tensors hold flowrl's mean, per-sample std, noise and the
  model output, with SGLang's shapes and dtypes.

Every rollout option SGLang has is honoured (``rollout_sde_type`` sde / cps / ode, ``rollout_noise_level``,
``rollout_sde_step_indices``, ``rollout_return_step_indices``, ``rollout_debug_mode``,
``rollout_log_prob_no_const``, the scheduler's ``use_uniform_sigmas``, SP shard and gather), except a
model's own ``ode_transition`` (no loop in 0.5.23 passes one to the default controller), which is refused
by name, as are per-token timesteps (SGLang refuses them too).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..data.sglang import SDE_TYPES
from ..ops.functional import sde_step

_SGLANG = "sglang.multimodal_gen.runtime"
_CLASS: Optional[type] = None
_ORIGINAL: Optional[Callable[..., Any]] = None


def _hooks():
    """SGLang's rollout_hooks module (its import needs schedule_batch first: a circular import in 0.5.23)."""
    try:
        import importlib

        importlib.import_module(f"{_SGLANG}.pipelines_core.schedule_batch")
        return importlib.import_module(f"{_SGLANG}.post_training.rollout_hooks")
    except ImportError as exc:
        raise ImportError(f"flowrl.compat.sglang needs SGLang's diffusion rollout engine (sglang >= 0.5.23, "
                          f"{_SGLANG}.post_training.rollout_hooks): {exc}") from exc


def controller_class() -> type:
    """flowrl's subclass of SGLang's ``FlowRolloutController`` (made on first use: SGLang is imported then)."""
    global _CLASS
    if _CLASS is None:
        from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import FlowRolloutController
        from sglang.multimodal_gen.runtime.post_training.sp_utils import should_do_sp_collective

        _CLASS = type("FlowRLRolloutController", (FlowRolloutController,), {
            "__module__": __name__, "__doc__": FlowRLRolloutController.__doc__,
            "flow_sde_sampling": FlowRLRolloutController.flow_sde_sampling,
            "_flowrl_sigmas": FlowRLRolloutController._flowrl_sigmas,
            "_should_do_sp_collective": staticmethod(should_do_sp_collective),
        })
    return _CLASS


class FlowRLRolloutController:
    """SGLang's rollout controller with flowrl's transition (the methods below are installed on the
    subclass ``controller_class()`` returns; this class only holds them)."""

    def _flowrl_sigmas(self, device) -> torch.Tensor:
        cached = getattr(self, "_flowrl_table", None)
        if cached is None or cached.device != device:
            cached = self._flowrl_table = self.sigmas.detach().to(device=device, dtype=torch.float32)
        return cached

    def flow_sde_sampling(self, batch: Any, model_output: torch.Tensor, sample: torch.Tensor,
                          current_sigma: torch.Tensor, next_sigma: torch.Tensor, step_index: int) -> torch.Tensor:
        """One rollout step by ``flowrl.sde_step`` (same arguments and return as SGLang's): the emitted
        sample in the model output's dtype, its log-prob recorded for ``collect_rollout_log_probs``."""
        ode = self.sde_type == "ode" or (self.sde_step_indices is not None and step_index not in self.sde_step_indices)
        sigmas = self._flowrl_sigmas(sample.device)
        if not _reads_table(current_sigma, self.sigmas, step_index):
            raise ValueError(f"flowrl.compat.sglang: step {step_index}'s sigma {float(current_sigma)} is not the "
                             f"controller's schedule's ({float(self.sigmas[step_index])}): set_timesteps ran again "
                             "after the rollout began")
        # SGLang's float32 model output (its noise's dtype, and its debug tensor on sde steps), made once
        v32 = None if ode else model_output.float()
        local_noise = None if ode else self._rollout_variance_noise(batch, v32)
        out_dtype = model_output.dtype
        sp = self._should_do_sp_collective(batch)
        if sp:  # the whole sample on every rank: the unsharded step's log-prob, bit for bit
            x = self.gather_for_sp(batch, sample.unsqueeze(1)).squeeze(1)
            v = self.gather_for_sp(batch, model_output.unsqueeze(1)).squeeze(1)
            noise = None if ode else self.noise_buffer
        else:
            x, v, noise = sample, model_output, local_noise
        out = sde_step(x, v, sigmas, step_index, mode="ode" if ode else SDE_TYPES[self.sde_type],
                       noise_level=float(self.noise_level), noise=noise,
                       log_prob_kind="sq_err" if self.log_prob_no_const else "gaussian",
                       out_dtype=out_dtype, return_prev_sample_mean=True)
        prev, mean = out.prev_sample, out.prev_sample_mean
        if sp:
            prev, mean = self.shard_for_sp(batch, prev), self.shard_for_sp(batch, mean)
        if self.debug_mode:  # SGLang's debug tensors: float32 noise and output on sde steps, zeros on ode ones
            self.append_local_rollout_debug_tensors(
                variance_noise=torch.zeros_like(model_output) if ode else local_noise,
                prev_sample_mean=mean, noise_std_dev=out.std_dev.reshape(-1, 1),
                model_output=model_output if ode else v32)
        # the mean itself (count 1): collect_rollout_log_probs divides the sums by the counts
        self.append_local_rollout_log_probs(out.log_prob, torch.ones_like(out.log_prob))
        return prev


def _reads_table(sigma: torch.Tensor, table: torch.Tensor, index: int) -> bool:
    """Whether ``sigma`` is ``table[index]``: by storage when it is a view of the table (no host sync:
    scheduler.step passes ``self.sigmas[step_index]``), else by value."""
    if sigma.device == table.device and sigma.untyped_storage().data_ptr() == table.untyped_storage().data_ptr():
        return sigma.storage_offset() == table.storage_offset() + index * table.stride(0)
    return float(sigma) == float(table[index])


def as_flowrl(controller):
    """SGLang's ``FlowRolloutController`` as flowrl's (the same state, flowrl's transition); refuses what
    flowrl cannot honour, by name."""
    cls = controller_class()
    if not isinstance(controller, cls.__mro__[1]):
        raise TypeError(f"controller must be SGLang's FlowRolloutController; got {type(controller).__name__}")
    if controller.sde_type not in SDE_TYPES:
        raise ValueError(f"rollout_sde_type must be one of {sorted(SDE_TYPES)}; got {controller.sde_type!r}")
    if controller.ode_transition is not None:
        raise ValueError("flowrl.compat.sglang cannot honour ode_transition (a model's own deterministic update, "
                         "whose log-prob flowrl cannot recompute); use SGLang's controller for this model")
    converted = cls.__new__(cls)
    converted.__dict__.update(controller.__dict__)
    return converted


def wrap(build: Callable[..., Any]) -> Callable[..., Any]:
    """A ``build_controller`` that builds with ``build`` and returns flowrl's controller."""
    def build_flowrl(*, batch, pipeline_config):
        return as_flowrl(build(batch=batch, pipeline_config=pipeline_config))

    build_flowrl.__wrapped__ = build
    return build_flowrl


def build_controller(*, batch, pipeline_config):
    """``prepare_rollout_if_enabled``'s ``build_controller`` for a loop that steps ``batch.scheduler``:
    SGLang's default controller, made flowrl's."""
    return as_flowrl(_hooks()._build_scheduler_rollout_controller(batch=batch, pipeline_config=pipeline_config))


def register() -> Callable[..., Any]:
    """Make flowrl's controller SGLang's default (``prepare_rollout_if_enabled``'s ``build_controller``,
    used by every denoising loop that does not pass its own), in this process. Idempotent; returns the
    builder now in place. ``unregister()`` restores SGLang's."""
    global _ORIGINAL
    defaults = _hooks().prepare_rollout_if_enabled.__kwdefaults__
    if defaults["build_controller"] is not build_controller:
        _ORIGINAL = defaults["build_controller"]
        defaults["build_controller"] = build_controller
    return build_controller


def unregister() -> None:
    """Restore SGLang's default controller."""
    global _ORIGINAL
    defaults = _hooks().prepare_rollout_if_enabled.__kwdefaults__
    if _ORIGINAL is not None and defaults["build_controller"] is build_controller:
        defaults["build_controller"] = _ORIGINAL
    _ORIGINAL = None


def registered() -> bool:
    return _hooks().prepare_rollout_if_enabled.__kwdefaults__["build_controller"] is build_controller


__all__ = ["register", "unregister", "registered", "build_controller", "wrap", "as_flowrl", "controller_class"]
