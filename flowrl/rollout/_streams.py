"""A rollout's streams (``flowrl.rollout.recorder``): the per-stream record of a recording scheduler
(``Stream``: its schedule snapshot, latents, log-probs, per-token sigmas, noise generators), the hooks a
rollout sets on a scheduler instance and removes when it ends (``attach`` / ``detach``; a copy made while
it records joins as another stream, ``copy_as_stream``), and the assembly of the streams' records into a
``RolloutTrajectory`` (``stream_trajectory``, ``joint_trajectory``). ``RolloutRecorder`` drives them."""
from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Dict, List, Optional

import torch

from ..core import _validate as V
from ..data.trajectory import RolloutTrajectory
from ..ops.functional import GeneratorArg, combine_streams

# instance attributes a rollout sets on a recording scheduler (and removes when it ends): the two methods
# it records through, and the two hooks copy.deepcopy / copy.copy read from an instance (a copy becomes
# a stream of the rollout instead of a second scheduler sharing the first one's recorder and generator)
_PATCHED = ("step", "set_timesteps", "__deepcopy__", "__reduce_ex__")


def _derive_generator(g: torch.Generator) -> torch.Generator:
    """A generator for another stream, seeded by one draw from ``g``: deterministic given ``g``, and never
    the same sequence of numbers as ``g`` (a deep copy of ``g`` would repeat it)."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=g, device=g.device))
    return torch.Generator(device=g.device).manual_seed(seed)


def derive_generators(generator: GeneratorArg) -> GeneratorArg:
    """Another stream's generator(s) from a rollout's or a step's: None (the global RNG), one, or one per sample."""
    if generator is None:
        return None  # the global RNG: each draw continues it, so streams never repeat each other's numbers
    if isinstance(generator, torch.Generator):
        return _derive_generator(generator)
    return [_derive_generator(g) for g in generator]  # per sample: sample i's stream noise from generator i


def _same_object(x):
    return x


class Stream:
    """One scheduler recording into a rollout: the one the rollout was opened on (stream 0), or a copy the
    pipeline made of it while the rollout was active. Holds that loop's schedule snapshot and records.
    ``recorder``: the ``flowrl.rollout.recorder.RolloutRecorder`` it records into."""

    def __init__(self, recorder, scheduler, index: int, generator, frozen):
        self.recorder, self.scheduler, self.index = recorder, scheduler, index
        self.generator = generator
        self.derive_from_step_generator = index > 0 and generator is None
        self.derived: Dict[int, GeneratorArg] = {}  # id(step generator) -> this stream's generator
        self.frozen = frozen  # the user's mask (stream 0 only), as given
        self.saved: Dict[str, object] = {}
        self.begin: Optional[int] = None  # schedule index of the loop's first step
        self.num_steps: Optional[int] = None
        self.sigmas: Optional[torch.Tensor] = None  # snapshot, float32 on the sample's device
        self.timesteps: Optional[torch.Tensor] = None
        self.latents: Dict[int, torch.Tensor] = {}
        self.log_probs: List[torch.Tensor] = []
        self.counts: List[torch.Tensor] = []  # scored elements per step (joint rollouts combine with them)
        self.token_sigmas: List[torch.Tensor] = []
        self.frozen_full: Optional[torch.Tensor] = None  # the user's mask, validated, dim 0 expanded to B
        self.last_prev: Optional[torch.Tensor] = None
        self.last_unscored: Optional[torch.Tensor] = None
        self.batch: Optional[int] = None
        self.x0_pred: Optional[torch.Tensor] = None  # dpm_sde order 2: the last step's data prediction
        self.prev_x0_preds: List[torch.Tensor] = []
        # per-sample sde_steps: each loop step's (sde rows, ode rows, sde rows as a host list), when the samples differ
        self.sde_rows = None

    @property
    def steps_recorded(self) -> int:
        return len(self.log_probs)

    def generator_for(self, step_generator) -> GeneratorArg:
        """The generator of this stream's noise on a step whose ``step`` received ``step_generator``."""
        if self.generator is not None or not self.derive_from_step_generator or step_generator is None:
            return self.generator if self.generator is not None else step_generator
        key = id(step_generator)  # a stream's own noise, derived once from the generator its step receives
        if key not in self.derived:
            gens = step_generator
            if isinstance(gens, (list, tuple)) and len(gens) == 1:
                gens = gens[0]
            self.derived[key] = derive_generators(list(gens) if isinstance(gens, (list, tuple)) else gens)
        return self.derived[key]

    def token_sigmas_for(self, per_token_timesteps, sample: torch.Tensor) -> Optional[torch.Tensor]:
        """Each token's sigma as diffusers' per-token step computes it, ``(per_token_timesteps /
        num_train_timesteps)[..., None]``, checked to broadcast to the sample."""
        i = self.steps_recorded
        if per_token_timesteps is None:
            if self.token_sigmas:
                raise ValueError(f"per_token_timesteps was given on steps 0..{i - 1} of this rollout but not on step "
                                 f"{i}; a rollout takes it on every step or on none")
            return None
        if i and not self.token_sigmas:
            raise ValueError(f"per_token_timesteps is given on step {i} but was not on steps 0..{i - 1}; "
                             "a rollout takes it on every step or on none")
        if not isinstance(per_token_timesteps, torch.Tensor) or not per_token_timesteps.dtype.is_floating_point:
            raise TypeError("per_token_timesteps must be a float tensor of timesteps (0 = a conditioning token)")
        token_sigmas = (per_token_timesteps / self.scheduler.config.num_train_timesteps)[..., None]
        token_sigmas = V.check_token_sigmas(token_sigmas.to(torch.float32), sample,
                                            name="per_token_timesteps[..., None] / 1000")
        if self.token_sigmas and self.token_sigmas[0].shape[1:] != token_sigmas.shape[1:]:
            raise ValueError(
                f"per_token_timesteps changed shape between steps ({tuple(self.token_sigmas[0].shape[1:-1])} -> "
                f"{tuple(token_sigmas.shape[1:-1])} after the batch dim); a rollout records one shape"
            )
        return token_sigmas

    def second_order_input(self, sample, model_output, i: int, host) -> torch.Tensor:
        """dpm_sde at solver order 2: the data prediction of the previous step (zeros at step 0, which
        reads none), stored for replay through ``host`` (the rollout's StepStore); then keeps this step's
        ``x - sigma v`` (float32, float64 for a float64 rollout) for the next, as diffusers' DPM solvers
        keep their model_outputs."""
        dtype = torch.float64 if torch.float64 in (sample.dtype, model_output.dtype) else torch.float32
        x, v = sample.detach().to(dtype), model_output.detach().to(dtype)
        prev_x0 = torch.zeros_like(x) if self.x0_pred is None else self.x0_pred
        self.prev_x0_preds.append(host.keep(prev_x0))
        self.x0_pred = x - self.sigmas[i].to(dtype) * v
        return prev_x0


def attach(recorder, stream: Stream) -> None:
    """Set the rollout's hooks on ``stream``'s scheduler instance (``step``, ``set_timesteps`` and the copy hooks)."""
    sched = stream.scheduler
    # an instance attribute the scheduler already had (another wrapper) comes back on exit
    stream.saved = {name: sched.__dict__[name] for name in _PATCHED if name in sched.__dict__}
    original_set_timesteps = sched.set_timesteps

    # functools.wraps keeps the scheduler's signature visible: pipelines inspect step and
    # set_timesteps (retrieve_timesteps looks for "sigmas", extra-step-kwargs for "generator")
    @functools.wraps(sched.step)
    def step(*args, **kwargs):
        return recorder._step(stream, *args, **kwargs)

    @functools.wraps(original_set_timesteps)
    def set_timesteps(*args, **kwargs):
        recorder._on_set_timesteps(stream)
        return original_set_timesteps(*args, **kwargs)

    # copy.deepcopy reads __deepcopy__ from the instance, copy.copy reads __reduce_ex__ from it
    def __deepcopy__(memo):
        return copy_as_stream(recorder, stream, memo)

    def __reduce_ex__(protocol):
        return _same_object, (copy_as_stream(recorder, stream, None),)

    step._flowrl_recorder = set_timesteps._flowrl_recorder = recorder
    sched.step, sched.set_timesteps = step, set_timesteps
    sched.__deepcopy__, sched.__reduce_ex__ = __deepcopy__, __reduce_ex__


def detach(stream: Stream) -> None:
    """Remove what ``attach`` set (an attribute the instance had before comes back)."""
    sched = stream.scheduler
    for name in _PATCHED:
        if name in stream.saved:
            setattr(sched, name, stream.saved[name])
        elif name in sched.__dict__:
            delattr(sched, name)
    stream.saved = {}


def copy_as_stream(recorder, source: Stream, memo: Optional[dict]):
    """``copy.deepcopy`` (``memo`` a dict) or ``copy.copy`` (``memo`` None) of a recording scheduler: a
    plain copy of its state, recording as a new stream of ``recorder``'s rollout."""
    if not recorder.active:
        raise RuntimeError("a scheduler of a finished rollout still had its copy hooks; this is a flowrl bug")
    if recorder.branch is not None:
        raise RuntimeError("branch: a branching rollout records one stream; the scheduler was copied while it "
                           "was recording (joint streams and branching are not combined)")
    if any(s.steps_recorded for s in recorder._streams):
        raise RuntimeError(
            "the scheduler was copied after this rollout recorded steps: a copy joins the rollout as "
            "another stream only when made before the first step (as LTX-2 copies its scheduler for the audio)"
        )
    sched = source.scheduler
    state = {k: v for k, v in sched.__dict__.items() if k not in _PATCHED}
    clone = object.__new__(type(sched))
    if memo is not None:
        memo[id(sched)] = clone
        state = copy.deepcopy(state, memo)
    clone.__dict__.update(state)
    stream = Stream(recorder, clone, len(recorder._streams), derive_generators(recorder.generator), None)
    recorder._streams.append(stream)
    attach(recorder, stream)
    return clone


def stream_trajectory(recorder, stream: Stream, log_probs: torch.Tensor) -> RolloutTrajectory:
    """One stream's ``RolloutTrajectory`` with ``log_probs`` [B, T] (the environment, debug tensors and tree
    are stream 0's)."""
    keys = sorted(stream.latents)
    dtype = stream.latents[keys[0]].dtype
    for k in keys[1:]:
        dtype = torch.promote_types(dtype, stream.latents[k].dtype)  # lossless: a bf16 latent widens exactly
    latents = torch.stack([stream.latents[k].to(dtype) for k in keys], dim=1)
    device = recorder._host.device or stream.sigmas.device
    return RolloutTrajectory(
        latents=latents,
        log_probs=log_probs,
        timesteps=recorder._host.to_host(stream.timesteps),
        sigmas=recorder._host.to_host(stream.sigmas),
        latent_step_indices=torch.tensor(keys, dtype=torch.int64, device=device),
        mode=recorder.mode,
        noise_level=recorder.noise_level,
        log_prob_kind=recorder.log_prob_kind,
        reduction=recorder.reduction,
        sde_steps=(None if recorder.sde_steps is None
                   else torch.tensor(recorder.sde_steps, dtype=torch.int64, device=device)),
        sde_mask=None if recorder.sde_mask is None else recorder.sde_mask.to(device),
        token_sigmas=torch.stack(stream.token_sigmas, dim=1) if stream.token_sigmas else None,
        frozen=recorder._host.to_host(stream.frozen_full),
        prev_x0_preds=torch.stack(stream.prev_x0_preds, dim=1) if stream.prev_x0_preds else None,
        denoising_env=recorder._env_result if stream.index == 0 else None,
        debug_tensors=recorder._debug_result if stream.index == 0 else None,
        tree=recorder._tree if stream.index == 0 else None,
    )


def joint_trajectory(recorder, streams: List[Stream]) -> RolloutTrajectory:
    """The trajectory of a joint rollout: stream 0's fields, the joint log-prob per step
    (``combine_streams`` of the streams' sums and counts, with the rollout's ``stream_weights``) and
    each stream's own trajectory in ``streams``."""
    num_steps = {s.num_steps for s in streams}
    if len(num_steps) != 1:
        raise RuntimeError(f"the rollout's streams ran different numbers of steps {sorted(num_steps)}; a joint "
                           "rollout steps every stream once per model call")
    sums = [torch.stack(s.log_probs, dim=1) for s in streams]
    counts = [torch.stack(s.counts, dim=1) for s in streams]
    weights = recorder.stream_weights
    joint = torch.stack([
        combine_streams([x[:, j] for x in sums], [c[:, j] for c in counts], recorder.reduction, weights)
        for j in range(streams[0].num_steps)
    ], dim=1)
    per_stream = tuple(
        replace(stream_trajectory(recorder, s, x), reduction="sum", counts=c) for s, x, c in zip(streams, sums, counts)
    )
    return replace(per_stream[0], log_probs=joint, reduction=recorder.reduction, counts=None, streams=per_stream,
                   stream_weights=weights)


__all__ = ["Stream", "attach", "detach", "copy_as_stream", "stream_trajectory", "joint_trajectory", "derive_generators"]
