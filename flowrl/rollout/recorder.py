"""Record RL rollouts from an unmodified denoising loop, with the scheduler the pipeline already has.

    from flowrl.rollout.recorder import rollout

    with rollout(pipe.scheduler, mode="sde", noise_level=0.7) as rec:   # diffusers' or flowrl's scheduler
        pipe(...)
    traj = rec.trajectory()   # flowrl.RolloutTrajectory

While the ``with`` block runs, the recorder sets ``step`` and ``set_timesteps`` on that scheduler
*instance* (its class is untouched, other instances too); leaving the block restores them, also on an
exception. ``flowrl.FlowMatchEulerDiscreteScheduler.rollout(...)`` is the same recorder.

A rollout replaces the scheduler's Euler step ``x + (sigma' - sigma) v`` on its own sigma table, so it
drives ``FlowMatchEulerDiscreteScheduler`` (diffusers', flowrl's, or a subclass) and refuses configs
whose plain step is something else.

Streams: a copy of the recording scheduler made with ``copy.deepcopy`` / ``copy.copy`` while the
rollout is active (LTX-2's ``audio_scheduler = copy.deepcopy(self.scheduler)``) records into the same
rollout as another stream, with noise of its own; ``trajectory()`` holds every stream that stepped, and
its log-prob per step is the joint one (``flowrl.combine_streams``). A copy made outside a rollout, or
left after it, is a plain scheduler.

The per-stream records, the hooks set on a scheduler instance (and on its copies) and the assembly of the
streams' records into the trajectory are in ``flowrl.rollout._streams``; this module checks the options
and records each step; the options it checks first are in ``flowrl.rollout._options``.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Iterable, List, Optional

import torch

from ..core import _validate as V
from ..backends._dispatch import BACKENDS
from ..data.denoising_env import check_env_options, finish_env, start_env
from ..ops.functional import GeneratorArg, SDEStepOutput, check_stream_weights, combine_streams, sde_step
from .step_output import STEP_SIGNATURE as _STEP_SIGNATURE
from .step_output import FlowMatchEulerDiscreteSchedulerOutput, check_step_timestep
from .timestep_lookup import index_for_timestep
from ._streams import Stream, attach, detach, joint_trajectory, stream_trajectory
from .windows import is_per_sample, mask_from_rows, per_sample_rows
from ..data.trajectory import RolloutTrajectory
from ..data.tree import BranchSpec
from ..data.trajectory_store import StepStore, check_store

# What a recording step takes (_STEP_SIGNATURE, from step_output): the arguments of diffusers'
# FlowMatchEulerDiscreteScheduler.step, which flowrl's copy has too (without self).

# the scheduler classes a rollout drives, the scheduler check, the solver order and the index sets
from ._options import _SCHEDULER_CLASSES, _index_set, _solver_order, check_scheduler, register_scheduler_class  # noqa: F401


class RolloutRecorder:
    """Records one denoising loop run through ``scheduler.step``.

    While active (``with recorder:``), step ``i`` of the loop samples x' with ``flowrl.sde_step`` from
    the scheduler's float32 sigma table and index ``i`` (``mode`` on ``sde_steps``, ``ode`` with
    log-prob 0 elsewhere, drawing no noise), emits x' in the model output's dtype, and stores the step's
    input latent and log-prob. ``trajectory()`` returns a ``flowrl.RolloutTrajectory``.

    ``scheduler``: a ``FlowMatchEulerDiscreteScheduler`` instance, diffusers' or flowrl's (see
    ``check_scheduler``). ``generator``: None (global RNG), one generator, or a list of B (sample i's
    noise comes from generator i only, so it does not depend on the batch); when None, ``step``'s own
    generator is used. ``sde_steps``: loop steps that are stochastic (None: all); or one set per sample,
    a list of B index sets or a bool tensor [B, T] (per-sample SDE windows, ``flowrl.rollout.sde_windows``):
    a step where the samples differ runs the stochastic rows in ``mode`` and the others as ``ode``, two
    ``sde_step`` calls scattered back (the ops are batch-invariant, so each sample's bits are its own);
    the trajectory stores the sets as ``sde_mask`` [B, T], or as ``sde_steps`` when they are all equal.
    ``return_step_indices``: which latents to keep, index T being the final output (None: all T + 1).

    ``frozen``: a bool mask with the latents' ndim, broadcastable to them (dim 0 is 1 or B): True marks
    a conditioning element the pipeline does not let the step change (Wan 2.2 TI2V's latent frame 0:
    ``[1, 1, F, 1, 1]`` True at frame 0). Such elements are held (x' = x), draw no noise, and are left
    out of the log-prob and of a ``mean``'s count. Per-token timesteps: ``step(...,
    per_token_timesteps=)`` (LTX Condition) runs each token at its own sigma (``t / 1000``, diffusers'
    rule for the next one), and tokens at t = 0 are held and left out the same way.

    Streams: a copy of the scheduler made while the recorder is active (``copy.deepcopy`` or
    ``copy.copy``; LTX-2 copies its scheduler for the audio) records as another stream, with its own
    noise: generators derived from the rollout's (one draw from each seeds the stream's; per sample
    stays per sample), or from the generator passed to its ``step``, or the global RNG. Copies made
    after steps were recorded are refused. The copies' recording ends with the block.

    ``model``: the module whose calls to record (e.g. ``pipe.transformer``), or a tuple/list of modules
    (Wan 2.2 A14B's two experts; ``traj.model_indices(j)`` says which each call went to): the denoising environment,
    ``traj.model_inputs(j)`` / ``traj.step_model_output(j, out)`` (``flowrl.data.denoising_env``);
    ``env_device``: where to keep its tensors (e.g. ``"cpu"``; None: where they were);
    ``output_transform``: callable(list of the step's call outputs) -> model_output, for pipelines whose
    transform the recorder cannot detect. ``debug``: True or a file path keeps each step's mean, std,
    noise and model output (``traj.debug_tensors``, ``flowrl.data.debug``). With several streams, the
    environment's output transform and the debug tensors are stream 0's.

    ``solver_order`` (mode='dpm_sde' only; 1 or 2, default 2): at 2 the recorder keeps each step's data
    prediction ``x - sigma v`` for the next step's mean, as diffusers' DPM solvers keep their
    model_outputs, and the trajectory stores it (``prev_x0_preds``) so the recompute scores the same
    transition.

    ``store``: ``"device"`` (default) keeps the recorded tensors where the pipeline made them;
    ``"cpu"`` copies each step's (latents, log-probs, per-token sigmas, the environment's inputs, debug
    tensors) to host memory as it records them, pinned and non-blocking where CUDA exists, so the
    recording adds no device memory past the current step, and ``trajectory()`` returns host tensors
    (``traj.step_inputs(j, device=...)`` moves a step's back). Refused under CUDA-graph capture
    (``flowrl.data.trajectory_store``).

    ``branch``: a ``flowrl.data.tree.BranchSpec`` (docs/branching.md): the loop runs every leaf of the
    tree from the start (B samples times ``branch.leaves_per_sample`` rows, each sample's rows adjacent
    and starting from one latent), and step j of each row draws the Philox noise of its node
    (``sde_step(noise_seed=tree.keys(T)[j])``), so rows under one node stay equal until it forks; the
    trajectory's ``tree`` records which rows share which node. Replaces ``generator`` (and the step's).

    ``stream_weights``: a joint rollout's fixed weight per stream (one float each, >= 0, in stream
    order, e.g. ``(0.5, 0.5)`` for verl-omni's MiniMax-H3 weighting of the video's and the audio's mean
    log-probs); None combines the streams by element count. The trajectory's ``log_probs`` are
    ``combine_streams(..., weights=stream_weights)`` and it keeps the weights for the recompute. Each
    stream steps on its own scheduler's sigma table (a copy given another shift or other sigmas by
    the pipeline keeps them), which its trajectory stores.
    """

    def __init__(
        self,
        scheduler,
        *,
        mode: str = "sde",
        noise_level: float = 0.7,
        log_prob_kind: str = "gaussian",
        reduction: str = "mean",
        sde_steps: Optional[Iterable[int]] = None,
        return_step_indices: Optional[Iterable[int]] = None,
        generator: GeneratorArg = None,
        frozen: Optional[torch.Tensor] = None,
        backend: str = "auto",
        model=None,  # a torch.nn.Module, or a tuple/list of them
        env_device=None,
        output_transform=None,
        debug=None,
        solver_order: Optional[int] = None,
        store: str = "device",
        branch: Optional[BranchSpec] = None,
        stream_weights=None,
    ):
        self._check_scheduler(scheduler, mode, noise_level, sde_steps)
        V.check_choice("mode", mode, V.MODES)
        self.noise_level = V.check_noise_level(noise_level, mode)
        V.check_choice("log_prob_kind", log_prob_kind, V.LOG_PROB_KINDS)
        V.check_choice("reduction", reduction, V.REDUCTIONS)
        V.check_choice("backend", backend, BACKENDS)
        if generator is not None and not isinstance(generator, (torch.Generator, list, tuple)):
            raise TypeError("generator must be None, a torch.Generator or a list of them; got "
                            f"{type(generator).__name__}")
        if frozen is not None and (not isinstance(frozen, torch.Tensor) or frozen.dtype != torch.bool):
            raise TypeError(
                "frozen must be a bool tensor broadcastable to the latents (True: a conditioning element the "
                "pipeline keeps); got "
                f"{type(frozen).__name__ if not isinstance(frozen, torch.Tensor) else frozen.dtype}"
            )
        self.scheduler = scheduler
        self.mode, self.log_prob_kind, self.reduction, self.backend = mode, log_prob_kind, reduction, backend
        self.generator = list(generator) if isinstance(generator, (list, tuple)) else generator
        self.frozen = frozen
        self.solver_order = _solver_order(mode, solver_order)
        self._sde_rows = self._sde_width = None  # the per-sample form, as given (checked against the loop in _start)
        self.sde_mask: Optional[torch.Tensor] = None  # bool [B, T] when the samples' step sets differ
        if is_per_sample(sde_steps):
            self._sde_rows = per_sample_rows("sde_steps", sde_steps)
            self._sde_width = int(sde_steps.shape[1]) if isinstance(sde_steps, torch.Tensor) else None
            # equal rows are the batch-wide set, recorded exactly as sde_steps= that set
            uniform = all(r == self._sde_rows[0] for r in self._sde_rows)
            self.sde_steps = self._sde_rows[0] if uniform else None
            if not uniform and debug:
                raise ValueError("sde_steps per sample: debug tensors are recorded for a batch-wide step set only; "
                                 "pass debug=None")
            if not uniform and branch is not None:
                raise ValueError("sde_steps per sample and branch are not combined (a branching rollout's forks need "
                                 "every row of a node stochastic at the fork); pass one step set for the batch")
            self._sde_uniform = uniform
        else:
            self.sde_steps = _index_set("sde_steps", sde_steps)
        self.return_step_indices = _index_set("return_step_indices", return_step_indices)
        self._streams: List[Stream] = []
        # the denoising environment and debug tensors (flowrl.data.denoising_env, flowrl.data.debug): checked here,
        # created per rollout in __enter__
        self._env_options = check_env_options(model, env_device, output_transform, debug)
        self.store = check_store(store)  # where the recorded tensors go (flowrl.data.trajectory_store)
        if store == "cpu" and env_device is not None and torch.device(env_device).type != "cpu":
            raise ValueError(f"env_device={env_device!r} keeps the replay environment on a device, which store='cpu' "
                             "keeps on the host; pass one of them")
        self._host = StepStore(store)
        self.branch = self._check_branch(branch, generator, debug)
        # the joint log-prob's fixed weight per stream (checked against the stream count in trajectory())
        self.stream_weights = None if stream_weights is None else check_stream_weights(
            stream_weights, len(stream_weights) if isinstance(stream_weights, (list, tuple)) else 0)
        self._tree = self._keys = self._owner_rows = None
        self._env = self._debug = None
        self._env_result = self._debug_result = None
        self._reset()

    def _reset(self) -> None:
        self._streams = [Stream(self, self.scheduler, 0, self.generator, self.frozen)]
        self._tree = self._keys = self._owner_rows = None

    # ------------------------------------------------------------------ branching (flowrl.data.tree)
    def _check_branch(self, branch, generator, debug) -> Optional[BranchSpec]:
        if branch is None:
            return None
        if not isinstance(branch, BranchSpec):
            raise TypeError(f"branch must be a flowrl.data.tree.BranchSpec or None; got {type(branch).__name__}")
        if generator is not None:
            raise ValueError("branch draws every node's noise from branch.seed (in-kernel Philox); pass generator=None")
        if debug:
            raise ValueError("branch: debug tensors are not recorded for a branching rollout (its noise is drawn "
                             "in the kernel); pass debug=None")
        deterministic = [s for s in branch.steps if self.mode == "ode" or self.noise_level == 0
                         or (self.sde_steps is not None and s not in self.sde_steps)]
        if deterministic:
            raise ValueError(f"branch.steps {deterministic} are deterministic steps of this rollout (mode "
                             f"{self.mode!r}, noise_level {self.noise_level}, sde_steps); a fork there gives equal "
                             "children")
        return branch

    def _start_branch(self, stream: Stream) -> None:
        if self.branch.steps and self.branch.steps[-1] >= stream.num_steps:
            raise ValueError(f"branch.steps entries must be loop steps in [0, {stream.num_steps - 1}] for this "
                             f"{stream.num_steps}-step loop; got {self.branch.steps[-1]}")
        self._tree = self.branch.tree_for_rows(stream.batch)
        device = stream.sigmas.device
        self._keys = self._tree.keys(stream.num_steps).to(device)
        nodes = self._tree.row_nodes(stream.num_steps)
        first = {}
        self._owner_rows = torch.tensor(
            [[first.setdefault((j, int(m)), n) for n, m in enumerate(nodes[:, j].tolist())]
             for j in range(stream.num_steps)], dtype=torch.int64, device=device)

    def _branch_noise_seed(self, stream: Stream, sample: torch.Tensor, i: int, noise) -> torch.Tensor:
        """Step i's per-row Philox keys; checks that rows under one node received one latent."""
        if noise is not None:
            raise ValueError("branch: this step was given its noise (variance_noise); a branching rollout draws "
                             "every node's noise from branch.seed")
        if not V._skip_value_reads():
            owner = sample[self._owner_rows[i].to(sample.device)]
            if not torch.equal(owner, sample):
                rows = sorted(set((owner != sample).flatten(1).any(1).nonzero().flatten().tolist()))
                msg = (f"branch: at loop step {i}, rows {rows} differ from the rows they share a tree node with; rows "
                       "under one node must receive the same latent")
                if i == 0:
                    raise ValueError(msg + " (start each sample's rows from one latent, e.g. "
                                           "latents.repeat_interleave(branch.leaves_per_sample, 0))")
                warnings.warn(msg + " (the model's output differed between equal rows); each row still "
                                    "recomputes its own log-prob exactly")
        return self._keys[i]

    # ------------------------------------------------------- what a scheduler family changes (flowrl.rollout.ddim)
    # A recorder for another scheduler family (flowrl.rollout.ddim.DDIMRolloutRecorder) overrides these, and
    # _step / _start (its step's arguments, its schedule table); the recording itself is shared.
    _check_scheduler = staticmethod(check_scheduler)

    def _scheduler_step_index(self, stream: Stream) -> Optional[int]:
        return stream.scheduler.step_index

    def _step_options(self, stochastic: bool) -> dict:
        """sde_step's mode options for a loop step: the rollout's mode, or ode on a deterministic step
        (a ``noise`` entry, if any, is the step's given eps)."""
        return {"mode": self.mode if stochastic else "ode", "noise_level": self.noise_level}

    # ------------------------------------------------------------------ patching the scheduler instances
    def __enter__(self) -> "RolloutRecorder":
        sched = self.scheduler
        if getattr(sched.step, "_flowrl_recorder", None) is not None:
            raise RuntimeError("this scheduler is already recording a rollout; rollouts do not nest")
        self._check_scheduler(sched, self.mode, self.noise_level, self.sde_steps)  # the config may have changed
        self._reset()
        attach(self, self._streams[0])
        self._host = StepStore(self.store)
        self._env, self._debug = start_env(self._env_options, self._host)
        self._env_result = self._debug_result = None
        return self

    def __exit__(self, *exc) -> None:
        try:
            env, debug, self._env, self._debug = self._env, self._debug, None, None
            self._host.sync()  # store='cpu': the copies land before the debug tensors are stacked
            self._env_result, self._debug_result = finish_env(env, debug, exc[0] is None)
        finally:
            for stream in self._streams:
                detach(stream)

    @property
    def active(self) -> bool:
        return getattr(self.scheduler.step, "_flowrl_recorder", None) is self

    @property
    def steps_recorded(self) -> int:
        return self._streams[0].steps_recorded

    @property
    def num_streams(self) -> int:
        """Streams that recorded steps so far (the scheduler's own, then copies in creation order)."""
        return max(1, sum(1 for s in self._streams if s.steps_recorded))

    def _on_set_timesteps(self, stream: Stream) -> None:
        if stream.log_probs:
            raise RuntimeError(
                "set_timesteps was called after this rollout recorded steps: a rollout records one denoising "
                "loop; use a new `with scheduler.rollout(...)` block for each pipeline call"
            )

    # ------------------------------------------------------------------ the recording step
    def _step(self, stream: Stream, *args, **kwargs):
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
        sched = stream.scheduler
        if sched.step_index is None:
            # the scheduler's own rule, with flowrl's bf16-safe lookup (diffusers' exact match fails on bf16)
            begin = sched.begin_index
            sched._step_index = index_for_timestep(timestep, sched.timesteps) if begin is None else begin
        out = self._record(stream, model_output, sample, given["generator"], given["per_token_timesteps"])
        sched._step_index += 1
        return out if given["return_dict"] else (out.prev_sample,)

    def _loop_schedule(self, stream: Stream, sample: torch.Tensor):
        """The loop's schedule table from its first step (a snapshot on the sample's device) and its step
        count; sets ``stream.begin``. A scheduler family's recorder (flowrl.rollout.ddim) overrides this."""
        sched = stream.scheduler
        if not isinstance(sched.sigmas, torch.Tensor) or sched.sigmas.dtype != torch.float32:
            got = sched.sigmas.dtype if isinstance(sched.sigmas, torch.Tensor) else type(sched.sigmas).__name__
            raise TypeError(f"scheduler.sigmas must be a float32 tensor, diffusers' table; got {got}")
        stream.begin = sched.step_index
        # the loop runs schedule steps begin .. T-1 (begin > 0: img2img); loop step i is schedule step begin + i
        sigmas = sched.sigmas[stream.begin:].to(device=sample.device, copy=True)
        if sigmas.numel() < 2:
            raise ValueError(f"the loop starts at the schedule's last sigma (step index {stream.begin}); nothing to "
                             "sample")
        return V.check_sigmas(sigmas, sample.device), sigmas.numel() - 1

    def _start(self, stream: Stream, sample: torch.Tensor) -> None:
        stream.sigmas, stream.num_steps = self._loop_schedule(stream, sample)
        sched = stream.scheduler
        stream.timesteps = sched.timesteps[stream.begin:].to(sample.device, copy=True)
        stream.batch = sample.shape[0]
        t = stream.num_steps
        if self._sde_rows is not None:
            if len(self._sde_rows) != stream.batch:
                raise ValueError(f"sde_steps per sample has {len(self._sde_rows)} rows; this rollout's batch is B = "
                                 f"{stream.batch}")
            if self._sde_width is not None and self._sde_width != t:
                raise ValueError(f"sde_steps as a bool mask must be [B, T] = [{stream.batch}, {t}] for this {t}-step "
                                 f"loop; got {self._sde_width} columns")
            mask = mask_from_rows(self._sde_rows, t)
            if not self._sde_uniform:
                self.sde_mask = mask
                # once per rollout, on the host: each step's (sde rows, ode rows) on the device and the sde rows as
                # a list (to pick a list of generators' entries without a per-step device read)
                host = [(mask[:, j].nonzero().flatten(), (~mask[:, j]).nonzero().flatten()) for j in range(t)]
                stream.sde_rows = [(sde.to(sample.device), ode.to(sample.device), sde.tolist()) for sde, ode in host]
        for name, values, upper in (("sde_steps", self.sde_steps, t - 1),
                                    ("return_step_indices", self.return_step_indices, t)):
            if values is not None and values and values[-1] > upper:
                raise ValueError(f"{name} entries must be in [0, {upper}] for this {t}-step loop; got {values[-1]}")
        if isinstance(stream.generator, list) and len(stream.generator) != stream.batch:
            raise ValueError(f"generator must be a list of B = {stream.batch} generators; got a list of "
                             f"{len(stream.generator)}")
        if stream.frozen is not None:
            frozen = V.check_frozen(stream.frozen.to(sample.device), sample, name="frozen")
            if frozen.shape[0] != 1 and frozen.shape[0] != stream.batch:
                raise ValueError(f"frozen's dim 0 must be 1 or B = {stream.batch}; got shape {tuple(frozen.shape)}")
            stream.frozen_full = frozen.expand(stream.batch, *frozen.shape[1:]).contiguous()
        if self.branch is not None:
            self._start_branch(stream)

    def _keep(self, loop_step: int) -> bool:
        return self.return_step_indices is None or loop_step in self.return_step_indices

    def _record(self, stream: Stream, model_output, sample, step_generator, per_token_timesteps):
        if stream.sigmas is None:
            self._start(stream, sample)
        if self._host.on_host and V.capturing():
            raise RuntimeError("rollout(store='cpu') copies each step to the host from Python, which a CUDA graph's "
                               "replay does not run; record a captured loop with store='device'")
        i = stream.steps_recorded
        if i >= stream.num_steps:
            raise RuntimeError(f"this rollout already recorded all {stream.num_steps} steps of its loop")
        if sample.shape[0] != stream.batch:
            raise ValueError(f"sample has batch size {sample.shape[0]}; this rollout started with B = {stream.batch}")
        if self._scheduler_step_index(stream) != stream.begin + i:
            raise RuntimeError(
                f"the scheduler is at step index {stream.scheduler.step_index} but the rollout expects "
                f"{stream.begin + i}: steps were skipped or repeated"
            )
        token_sigmas = stream.token_sigmas_for(per_token_timesteps, sample)
        # torch.equal reads a device value (a sync, refused while capturing a CUDA graph): like the value
        # checks, skipped while capturing and inside flowrl.no_value_checks(); the warning is all it gives.
        # Elements the step held (frozen, or at token sigma 0) are not compared: the pipeline may rewrite
        # them (LTX Condition re-noises its conditioning tokens) and no log-prob reads them.
        if stream.last_prev is not None and sample is not stream.last_prev and not V._skip_value_reads():
            changed = sample != stream.last_prev
            if stream.last_unscored is not None:
                changed = changed & ~stream.last_unscored
            if bool(changed.any()):
                warnings.warn(
                    f"loop step {i}'s input is not step {i - 1}'s output on {int(changed.sum())} elements the step "
                    f"scored (the pipeline changed the latents between steps); the trajectory stores each step's "
                    f"input, so recomputing step {i - 1}'s log-prob from latents[:, {i}] will not reproduce it. If "
                    "the pipeline keeps those elements fixed (conditioning), pass their mask as rollout(frozen=...)"
                )
        split = None  # per sample: (sde rows, ode rows) on a step where the samples differ
        if self.sde_mask is not None:
            sde_rows, ode_rows, _ = stream.sde_rows[i]
            stochastic = ode_rows.numel() == 0
            if sde_rows.numel() and ode_rows.numel():
                split = sde_rows, ode_rows
        else:
            stochastic = self.sde_steps is None or i in self.sde_steps
        joint = len(self._streams) > 1
        velocity, out_dtype = model_output, None
        if token_sigmas is not None:
            # diffusers' per-token step moves by (sigma - sigma') * model_output (its sign is the opposite of
            # the plain step's) and returns float32: the velocity in flowrl's x + (sigma' - sigma) v is the
            # negated output (exact), and the emitted sample stays float32, as there
            velocity, out_dtype = -model_output, torch.float32
        # an ode step draws no noise (sde_step skips the draw), so the generators advance on sde steps only
        masks = {k: v for k, v in (("token_sigmas", token_sigmas), ("frozen", stream.frozen_full)) if v is not None}
        options = self._step_options(stochastic)
        noise = options.pop("noise", None)  # a step's given eps (ddim's variance_noise)
        generator = stream.generator_for(step_generator) if stochastic and noise is None else None
        debug = self._debug if stream.index == 0 else None
        if (debug is not None and noise is None and stochastic and options["mode"] != "ode"
                and options["noise_level"] != 0):
            noise, generator = debug.draw(sample, generator), None  # the draw sde_step would make
        # dpm_sde at solver order 2: the previous step's data prediction (the stream keeps it)
        prev_x0 = stream.second_order_input(sample, model_output, i, self._host) if self.solver_order == 2 else None
        noise_seed = None
        if self.branch is not None and stochastic:
            noise_seed, generator = self._branch_noise_seed(stream, sample, i, noise), None
        if split is not None:
            out = self._record_split(stream, split, sample, velocity, i, joint, out_dtype, masks,
                                     stream.generator_for(step_generator), prev_x0)
        else:
            out = sde_step(
                sample, velocity, stream.sigmas, i, **options, log_prob_kind=self.log_prob_kind,
                reduction="sum" if joint else self.reduction, backend=self.backend, out_dtype=out_dtype, **masks,
                generator=generator, noise=noise, prev_x0_pred=prev_x0 if stochastic else None, noise_seed=noise_seed,
            )
        if debug is not None:
            debug.record(out, noise, model_output, sample)
        if self._env is not None and stream.index == 0:
            # the velocity the step used (a per-token step's is the negated output): what
            # traj.step_model_output rebuilds and traj.step_log_prob / step_inputs take
            self._env.on_step(velocity)
        prev_sample = out.prev_sample
        if prev_sample.stride() != sample.stride():
            # diffusers' step is elementwise on the sample, so its output keeps the sample's layout (LTX-2
            # steps a transposed view); a model run on the next input can depend on that layout in bf16
            prev_sample = torch.empty_like(sample, dtype=prev_sample.dtype).copy_(prev_sample)
        log_prob = out.log_prob
        if joint:
            # the stream's own log-prob for the pipeline; the trajectory combines the streams' sums
            stream.counts.append(self._host.keep(out.count))
            log_prob = combine_streams([out.log_prob], [out.count], self.reduction)
        if self._keep(i):
            stream.latents[i] = self._host.keep(sample)
        stream.log_probs.append(self._host.keep(out.log_prob))
        if token_sigmas is not None:
            stream.token_sigmas.append(self._host.keep(token_sigmas.expand(stream.batch, *token_sigmas.shape[1:])))
        stream.last_prev = prev_sample
        unscored = stream.frozen_full
        if token_sigmas is not None:
            held = token_sigmas == 0
            unscored = held if unscored is None else (unscored | held)
        stream.last_unscored = unscored
        if i + 1 == stream.num_steps and self._keep(i + 1):
            stream.latents[i + 1] = self._host.keep(prev_sample)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample, log_prob, out.prev_sample_mean, out.std_dev)

    def _record_split(self, stream: Stream, split, sample, velocity, i: int, joint: bool, out_dtype, masks: dict,
                      generator, prev_x0) -> SDEStepOutput:
        """Loop step ``i`` where some samples are stochastic (``split[0]``, the rollout's mode) and the others
        not (``split[1]``, ode, drawing no noise): two ``sde_step`` calls on the row subsets, scattered
        back. The ops are batch-invariant (docs/contract.md, Reduction order), so each sample's bits are
        those it gets alone. Noise: a list of B generators gives each stochastic sample its own
        generator's draw; one generator (or the global RNG) draws for the stochastic subset only, in
        its row order, so its stream depends on the windows."""
        batch = sample.shape[0]

        def rows(t, idx):
            return None if t is None else (t if t.shape[0] == 1 else t[idx.to(t.device)])

        outs = []
        for stochastic, idx in zip((True, False), split):
            options = self._step_options(stochastic)
            noise = options.pop("noise", None)
            gen = None
            if stochastic and noise is None:
                gen = [generator[k] for k in stream.sde_rows[i][2]] if isinstance(generator, list) else generator
            outs.append((idx, sde_step(
                sample[idx], velocity[idx], stream.sigmas, i, **options, log_prob_kind=self.log_prob_kind,
                reduction="sum" if joint else self.reduction, backend=self.backend, out_dtype=out_dtype,
                **{k: rows(v, idx) for k, v in masks.items()}, generator=gen, noise=rows(noise, idx),
                prev_x0_pred=rows(prev_x0, idx) if stochastic else None,
            )))

        def scatter(field):
            first = getattr(outs[0][1], field)
            if first is None:
                return None
            full = first.new_empty((batch, *first.shape[1:]))
            for idx, out in outs:
                full[idx.to(full.device)] = getattr(out, field)
            return full

        return SDEStepOutput(*(scatter(f) for f in ("prev_sample", "log_prob", "prev_sample_mean", "std_dev",
                                                    "count")))

    # ------------------------------------------------------------------ the result
    def trajectory(self) -> RolloutTrajectory:
        """The recorded ``RolloutTrajectory`` (after the loop has run all its steps). With several streams,
        its fields are stream 0's except ``log_probs``, the joint log-prob of every stream per step
        (``flowrl.combine_streams`` of the streams' sums and counts), and ``streams`` holds each stream's
        own trajectory (its ``log_probs`` with ``reduction="sum"``, its ``counts``)."""
        if self._env is not None or self._debug is not None:
            raise RuntimeError("with model= or debug=, call trajectory() after the `with` block: leaving it "
                               "removes the model hooks and completes the denoising environment")
        streams = [s for s in self._streams if s.steps_recorded] or self._streams[:1]
        self._host.sync()  # store='cpu': every copy has landed before the host reads it
        for s in streams:
            if s.num_steps is None or s.steps_recorded < s.num_steps:
                raise RuntimeError(
                    f"the rollout's stream {s.index} recorded {s.steps_recorded} of {s.num_steps or '?'} steps; run "
                    "the whole denoising loop (the pipeline call) inside `with recorder:` before calling trajectory()"
                )
        if self.stream_weights is not None and len(self.stream_weights) != len(streams):
            raise ValueError(f"stream_weights has {len(self.stream_weights)} weights but the rollout recorded "
                             f"{len(streams)} stream(s); pass one weight per stream (the scheduler's own first, then "
                             "its copies in the order they were made)")
        if len(streams) == 1:
            return stream_trajectory(self, streams[0], torch.stack(streams[0].log_probs, dim=1))
        return joint_trajectory(self, streams)


def rollout_signature(recorder_class=None, **defaults) -> inspect.Signature:
    """The signature of a scheduler's ``rollout(**options)`` method: ``self``, then ``RolloutRecorder``'s
    keyword options (declared once, on its constructor) with ``defaults`` replaced (DDIM's ``mode="ddim"``,
    ``noise_level=1.0``), returning ``recorder_class``; so ``help(pipe.scheduler.rollout)`` lists them."""
    init = inspect.signature(RolloutRecorder.__init__)
    options = [p.replace(default=defaults.pop(p.name, p.default)) for p in list(init.parameters.values())[2:]]
    if defaults:
        raise TypeError(f"rollout_signature: {sorted(defaults)} are not RolloutRecorder options")
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return init.replace(parameters=[self_param, *options],
                        return_annotation=(recorder_class or RolloutRecorder).__name__)


# ``with rollout(pipe.scheduler, mode="sde") as rec:``: a recorder for a scheduler instance the pipeline
# or trainer already has (diffusers' FlowMatchEulerDiscreteScheduler, flowrl's, or a subclass); the
# constructor itself, so its options are declared once.
rollout = RolloutRecorder


__all__ = ["RolloutRecorder", "rollout", "rollout_signature", "check_scheduler", "register_scheduler_class"]
