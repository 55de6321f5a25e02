"""``RolloutTrajectory``: what a rollout records, for training to recompute log-probs from. Its wire and file
formats (``to_wire`` / ``from_wire``, ``save`` / ``load``, checksums, the format tags) are in
``flowrl.data._trajectory_io``, to which those methods delegate."""
from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..ops.functional import check_stream_weights, step_log_prob
from ._trajectory_io import FILE_FORMAT, FORMAT, FORMAT_V1  # noqa: F401  (re-exported: the format tags)
from ._trajectory_io import (_DDIM_FIELDS, _OPTIONAL_TENSORS, _SETTING_FIELDS, _TENSOR_FIELDS, _alpha_bar, _attr,
                             _has_ddim_fields, _reads_prev_x0, checked_trajectory, load_trajectory, save_trajectory,
                             trajectory_from_wire, trajectory_to_wire)
from .denoising_env import env_of
from .replay import replay_plan
from .tree import BranchTree
from .trajectory_store import check_device, move, nbytes_per_sample_step


@dataclass
class RolloutTrajectory:
    """A batch of recorded rollouts.

    latents: [B, K, ...] latents; ``latents[:, j]`` is the input of loop step
        ``latent_step_indices[j]`` (index T is the final output). K = T + 1 unless filtered.
    log_probs: float32 [B, T], the log-prob of each step's emitted sample (0 on ode steps).
    timesteps: [T] the scheduler's timesteps (schedule metadata: shared, never sliced per sample).
    sigmas: float32 [T + 1] snapshot of the exact schedule, post-shift, with the terminal 0.
    latent_step_indices: int64 [K], which loop steps ``latents`` holds. Optional when K = T + 1 (every
        step's input plus the final output, as an SGLang rollout returns): it then defaults to
        ``arange(T + 1)``; a filtered K must pass it.
    mode, noise_level, log_prob_kind, reduction: the rollout settings, to recompute with the same ones.
    sde_steps: int64 [S] loop steps that were stochastic (the others ran as ``ode``), or None for all.
    sde_mask: bool [B, T] or None: per-sample SDE windows (``rollout(sde_steps=)`` given one step set
        per sample, docs/scheduler.md): True where sample b's loop step j was stochastic, False where it
        ran as ``ode`` (log-prob 0, no noise drawn). Set only when the samples' sets differ (equal sets
        are recorded as ``sde_steps``); ``sde_steps`` is then None. ``step_mask()`` gives either as [B, T].
    token_sigmas: float32 [B, T, ...] or None: each step's per-token sigmas (``per_token_timesteps /
        1000`` with a trailing 1, e.g. [B, T, S, 1] for [B, S, C] tokens), when the pipeline passed
        ``per_token_timesteps``. Tokens at sigma 0 were held (x' = x) and are not in the log-prob.
    frozen: bool [B, ...] or None: the ``rollout(frozen=)`` mask (the latents' ndim minus K, broadcast
        to them), the same on every step.
    counts: float32 [B, T] or None: elements each step scored (set on the per-stream trajectories of a
        joint rollout, whose ``log_probs`` are sums).
    streams: None, or for a joint rollout (a copied scheduler recording, LTX-2's audio) every stream's
        own trajectory in creation order; the top-level fields are then stream 0's, except
        ``log_probs``, the joint log-prob (``flowrl.combine_streams`` of the streams' sums and counts).
        Each stream keeps its own schedule (``sigmas``, ``timesteps``: a copied scheduler given other
        sigmas or another shift recorded them), and recomputes with it.
    stream_weights: None (streams combined by element count), or a joint rollout's fixed weight per
        stream (``rollout(stream_weights=(0.5, 0.5))``: the weighted per-stream means), which
        ``step_inputs`` passes on so the recompute combines exactly as the rollout did.

    prev_x0_preds: [B, T, ...] float32, the previous data prediction each step's mean read (mode
        'dpm_sde' at solver order 2: row i is ``x_{i-1} - sigma_{i-1} v_{i-1}`` of the rollout, zeros at
        step 0, which reads none), to recompute with ``step_log_prob(..., prev_x0_pred=)``; else None.
    prediction_type, clip_sample_range: mode 'ddim''s model output type and x0 clip (None otherwise);
        for ddim ``sigmas`` is the alpha-bar table [2T] of (alpha_bar_t, alpha_bar_prev) pairs
        (flowrl.rollout.ddim.alpha_bar_table). ``step_options()`` gives every setting a recompute passes.
    tree: None, or for a branching rollout (docs/branching.md) the ``flowrl.data.tree.BranchTree``
        whose leaves are the rows: which rows share which node (and so the same latents, noise and
        log-prob) at each step, and every node's Philox key.

    ``step_inputs(j)`` gives the arguments that recompute loop step ``j``'s log-prob exactly.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    latent_step_indices: Optional[torch.Tensor] = None  # a tensor after __init__
    mode: str = "sde"
    noise_level: float = 0.7
    log_prob_kind: str = "gaussian"
    reduction: str = "mean"
    sde_steps: Optional[torch.Tensor] = None
    token_sigmas: Optional[torch.Tensor] = None
    frozen: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None
    streams: Optional[Tuple["RolloutTrajectory", ...]] = None
    prev_x0_preds: Optional[torch.Tensor] = None
    prediction_type: Optional[str] = None
    clip_sample_range: Optional[float] = None
    tree: Optional[BranchTree] = None
    # recorded with scheduler.rollout(model=..., debug=...): flowrl.data.denoising_env.DenoisingEnv and
    # flowrl.data.debug.DebugTensors (in memory only: to_wire / save carry neither)
    denoising_env: Optional[Any] = None
    debug_tensors: Optional[Any] = None
    stream_weights: Optional[Tuple[float, ...]] = None
    sde_mask: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.sde_mask is not None:
            if self.sde_steps is not None:
                raise ValueError("sde_mask (per-sample SDE steps) and sde_steps (one set for the batch) are exclusive; "
                                 "pass one of them")
            m = self.sde_mask
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 2:
                raise ValueError(f"sde_mask must be a bool tensor [B, T]; got "
                                 f"{type(m).__name__ if not isinstance(m, torch.Tensor) else (m.dtype, tuple(m.shape))}")
        if self.stream_weights is not None:
            if self.streams is None:
                raise ValueError("stream_weights weights a joint rollout's streams; this trajectory has no streams")
            self.stream_weights = check_stream_weights(self.stream_weights, len(self.streams))
        if self.latent_step_indices is not None:
            return
        for name in ("latents", "sigmas"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(getattr(self, name)).__name__}")
        if self.latents.dim() < 2:
            raise ValueError(
                f"latents must be [B, K, ...] to default latent_step_indices; got shape {tuple(self.latents.shape)}"
            )
        if self.sigmas.dim() != 1 or self.sigmas.numel() < 2:
            raise ValueError(
                f"sigmas must be 1-D [T + 1] to default latent_step_indices; got shape {tuple(self.sigmas.shape)}"
            )
        kept, num_steps = int(self.latents.shape[1]), self.num_steps
        if kept != num_steps + 1:
            raise ValueError(
                f"latent_step_indices is required when latents hold K = {kept} latents per sample for "
                f"T = {num_steps} steps (the default arange(T + 1) needs K = T + 1 = {num_steps + 1})"
            )
        # on the schedule's device, as RolloutRecorder builds it
        self.latent_step_indices = torch.arange(kept, dtype=torch.int64, device=self.sigmas.device)

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        # ddim's table holds an (alpha_bar_t, alpha_bar_prev) pair per step; the flow modes' T + 1 sigmas
        return int(self.sigmas.numel() // 2 if _alpha_bar(self.mode) else self.sigmas.numel() - 1)

    def step_options(self) -> Dict[str, Any]:
        """The keyword options that recompute this rollout's steps (``flowrl.step_log_prob(x, v, x',
        traj.sigmas, i, **traj.step_options())``): mode, noise_level, log_prob_kind, reduction, and ddim's
        prediction_type / clip_sample_range. ``step_inputs(j)`` gives these and the tensors of step j."""
        options = {_attr(key): getattr(self, _attr(key)) for key in _SETTING_FIELDS}
        if _has_ddim_fields(self.mode):
            options.update({name: getattr(self, name) for name in _DDIM_FIELDS})
        return options

    # ----------------------------------------------------------------------------------------------
    # replay: the recorded model calls and the exact log-prob recompute (flowrl.data.denoising_env)

    def model_inputs(self, j: int, device=None):
        """Step ``j``'s recorded model call kwargs (a dict; a list of dicts for several calls)."""
        return env_of(self).model_inputs(j, device)

    def model_calls(self, j: int, device=None):
        """Step ``j``'s recorded model call kwargs, always a list (one dict per call)."""
        return env_of(self).model_calls(j, device)

    def model_indices(self, j: int):
        """Per call of step ``j``, the index of its module in ``rollout(model=...)`` (0 for one module)."""
        return env_of(self).model_indices(j)

    def step_model_output(self, j: int, raw_output):
        """The replayed call output(s) of step ``j`` turned into the velocity the step used (what
        ``scheduler.step`` received; negated on a per-token step): ``step_log_prob(j, ...)``'s input."""
        return env_of(self).step_model_output(j, raw_output)

    def step_log_prob(self, j: Union[int, torch.Tensor], model_output, **kwargs) -> torch.Tensor:
        """``flowrl.step_log_prob(model_output=model_output, **self.step_inputs(j), **kwargs)``, the
        trajectory's tensors moved to ``model_output``'s device (for a joint rollout, a tuple in stream
        order: the first entry's device)."""
        device = (model_output[0] if isinstance(model_output, tuple) else model_output).device
        split = self._mode_split(j)
        if split is not None:  # per-sample windows: the stochastic and the ode samples of j, as two calls
            return self._split_step_log_prob(split, j, model_output,
                                             lambda rows, jj, part: rows.step_log_prob(jj, part, **kwargs))

        def to(v):
            if isinstance(v, tuple):
                return tuple(to(x) for x in v)
            return v.to(device) if isinstance(v, torch.Tensor) else v

        inputs = {k: to(v) for k, v in self.step_inputs(j).items()}
        return step_log_prob(model_output=model_output, **{**inputs, **kwargs})

    def step_mask(self) -> torch.Tensor:
        """bool [B, T] (on the log-probs' device): True where sample b's loop step j was stochastic (its
        log-prob is a transition's, to recompute and train on), False where it ran as ``ode`` (log-prob 0).
        From ``sde_mask`` (per-sample windows), else ``sde_steps`` (one set for the batch), else all True."""
        device = self.log_probs.device
        if self.sde_mask is not None:
            return self.sde_mask.to(device)
        mask = torch.ones(self.batch_size, self.num_steps, dtype=torch.bool, device=device)
        if self.sde_steps is not None:
            mask[:] = False
            mask[:, self.sde_steps.to(device)] = True
        return mask

    def replay_plan(self, batch_size: int, **kwargs):
        """The recompute as forwards of at most ``batch_size`` (sample, step) pairs, each with its own
        step index (``flowrl.data.replay.replay_plan``; docs/performance.md, Batched replay)."""
        return replay_plan(self, batch_size, **kwargs)

    def nbytes_per_sample_step(self) -> Dict[str, int]:
        """Bytes the recording holds per sample per loop step, by field, and their ``"total"``
        (``flowrl.data.trajectory_store.nbytes_per_sample_step``; docs/performance.md)."""
        return nbytes_per_sample_step(self)

    # ----------------------------------------------------------------------------------------------
    # per-sample split, wire format, files

    def split(self) -> List["RolloutTrajectory"]:
        """One trajectory per sample (batch size 1 each; views, no copies). Per-sample fields
        (``latents``, ``log_probs``) are sliced on dim 0; the schedule (``sigmas``, ``timesteps``),
        ``latent_step_indices`` and ``sde_steps`` are shared by all samples and never sliced, even
        when their length happens to equal the batch size."""
        return [self._sample(i) for i in range(self.batch_size)]

    def _sample(self, i: int) -> "RolloutTrajectory":
        def cut(t):
            return None if t is None else t[i:i + 1]

        return replace(
            self, latents=self.latents[i:i + 1], log_probs=self.log_probs[i:i + 1], token_sigmas=cut(self.token_sigmas),
            frozen=cut(self.frozen), counts=cut(self.counts), prev_x0_preds=cut(self.prev_x0_preds),
            streams=None if self.streams is None else tuple(s._sample(i) for s in self.streams),
            tree=None if self.tree is None else self.tree.select_row(i), sde_mask=cut(self.sde_mask),
        )

    def _split_step_log_prob(self, split, j, model_output, call) -> torch.Tensor:
        """The [B] log-prob of step(s) ``j`` where ``sde_mask`` makes some samples stochastic and others ode
        (``split``: their rows, from ``_mode_split``): ``call(rows, j_rows, model_output_rows)`` per group,
        stochastic first, each on the sub-trajectory ``self._rows(rows)``, scattered back into batch order.
        Shared by ``step_log_prob`` and the sharded trajectory's (whose calls are collectives)."""
        out = None
        for idx in split:
            def cut(t):
                return t[idx.to(t.device)]

            part = tuple(cut(m) for m in model_output) if isinstance(model_output, tuple) else cut(model_output)
            lp = call(self._rows(idx), cut(j) if isinstance(j, torch.Tensor) else j, part)
            out = lp.new_empty((self.batch_size, *lp.shape[1:])) if out is None else out
            out[idx.to(out.device)] = lp
        return out

    def _rows(self, rows: torch.Tensor) -> "RolloutTrajectory":
        """The samples ``rows`` (int64 [N]) as a trajectory (copies); a branching rollout's tree is dropped
        (it is the whole batch's)."""
        def cut(t):
            return None if t is None else (t if t.shape[0] == 1 else t[rows.to(t.device)])

        return replace(
            self, latents=cut(self.latents), log_probs=cut(self.log_probs), token_sigmas=cut(self.token_sigmas),
            frozen=cut(self.frozen), counts=cut(self.counts), prev_x0_preds=cut(self.prev_x0_preds),
            streams=None if self.streams is None else tuple(s._rows(rows) for s in self.streams),
            tree=None, sde_mask=cut(self.sde_mask), denoising_env=None, debug_tensors=None,
        )

    # ----------------------------------------------------------------------------------------------
    # recompute

    @property
    def num_streams(self) -> int:
        return 1 if self.streams is None else len(self.streams)

    def step_inputs(self, j: Union[int, torch.Tensor], device=None) -> Dict[str, Any]:
        """The keyword arguments of ``flowrl.step_log_prob`` (all but ``model_output``) that recompute loop
        step ``j``'s recorded log-prob: ``flowrl.step_log_prob(model_output=v, **traj.step_inputs(j))``
        equals ``traj.log_probs[:, j]`` bit for bit when ``v`` is the velocity the rollout stepped with
        (docs/scheduler.md says, per pipeline, how to rebuild it). Per-token sigmas, the frozen mask,
        ode steps (``sde_steps``) and the settings are included. ``j``: an int, or an integer tensor [B]
        of one loop step per sample (``step_index`` is then per sample, and the recorded log-probs to
        compare with are ``traj.log_probs.gather(1, j[:, None])``). Both ``latents[:, j]`` and
        ``latents[:, j + 1]`` must have been kept (``return_step_indices``). For a joint rollout
        (``streams``), ``sample``, ``prev_sample``, ``sigmas``, ``token_sigmas`` and ``frozen`` are
        tuples in stream order, and ``model_output`` must be one too. ``device``: where to put the
        tensors (e.g. the trainer's GPU for a trajectory recorded with ``rollout(store="cpu")``, whose
        tensors are on the host); None leaves them where they are. A joint rollout with
        ``stream_weights`` adds them (``stream_weights=``)."""
        device = check_device(device)
        _, mode = self._check_loop_steps(j)
        if self.streams is None:
            parts = self._stream_inputs(j)
        else:
            per = [s._stream_inputs(j) for s in self.streams]
            parts = {k: tuple(p[k] for p in per) for k in per[0]}
            for k in ("token_sigmas", "frozen"):
                if all(v is None for v in parts[k]):
                    parts[k] = None
        out = dict(sample=parts["sample"], prev_sample=parts["prev_sample"], sigmas=parts["sigmas"], step_index=j,
                   **self.step_options())
        if mode == "ode" and _alpha_bar(self.mode):  # ddim's steps outside sde_steps ran at eta = 0
            out["noise_level"] = 0.0
        else:
            out["mode"] = mode
        if _reads_prev_x0(mode) and self.prev_x0_preds is not None:  # the second order's previous x0 (sde steps)
            out["prev_x0_pred"] = parts["prev_x0_pred"]
        for k in ("token_sigmas", "frozen"):
            if parts[k] is not None:
                out[k] = parts[k]
        if self.stream_weights is not None:
            out["stream_weights"] = self.stream_weights
        return out if device is None else {k: move(v, device) for k, v in out.items()}

    def _check_loop_steps(self, j):
        """The loop steps ``j`` names (checked by ``_check_steps_kept``) and the one mode they ran in."""
        return self._check_loop_steps_mode(j, self._check_steps_kept(j))

    def _check_steps_kept(self, j):
        """The sorted loop steps ``j`` names (an int, or an integer tensor [B]), each in range with its
        latents j and j + 1 kept."""
        num_steps = self.num_steps
        if isinstance(j, torch.Tensor):
            if j.dtype.is_floating_point or j.dtype == torch.bool or j.dim() != 1 or j.numel() != self.batch_size:
                raise ValueError(f"j must be an int or an integer tensor [B = {self.batch_size}]; got {j.dtype} "
                                 f"{tuple(j.shape)}")
            values = sorted(set(j.tolist()))
        elif isinstance(j, Integral) and not isinstance(j, bool):
            values = [int(j)]
        else:
            raise TypeError(f"j must be an int or an integer tensor [B]; got {type(j).__name__}")
        if values[0] < 0 or values[-1] >= num_steps:
            raise ValueError(f"j must be a loop step in [0, {num_steps - 1}]; got "
                             f"{values[0] if values[0] < 0 else values[-1]}")
        kept = set(self.latent_step_indices.tolist())
        missing = sorted({v for v in values for v in (v, v + 1)} - kept)
        if missing:
            raise ValueError(
                "step j needs latents[:, j] and latents[:, j + 1]; this trajectory did not keep loop step(s) "
                f"{missing} (latent_step_indices = {sorted(kept)})"
            )
        return values

    def _check_loop_steps_mode(self, j, values):
        if self.sde_mask is not None:
            flags = set(self._pair_flags(j).tolist())
            if len(flags) > 1:
                raise ValueError("at these loop steps some samples were stochastic and others ode (sde_mask, per-sample "
                                 "SDE windows): traj.step_log_prob(j, v) splits them, traj.replay_plan groups them; or "
                                 "take the samples of one kind")
            return values, self.mode if flags.pop() else "ode"
        if self.sde_steps is None:
            return values, self.mode
        sde = set(self.sde_steps.tolist())
        stochastic = {v in sde for v in values}
        if len(stochastic) > 1:
            raise ValueError("j mixes sde steps and ode steps (sde_steps); recompute them in separate calls")
        return values, self.mode if stochastic.pop() else "ode"

    def _pair_flags(self, j) -> torch.Tensor:
        """bool [B]: whether each sample's loop step ``j`` (an int, or a step per sample) was stochastic
        (``sde_mask`` set)."""
        mask = self.sde_mask.cpu()
        if isinstance(j, torch.Tensor):
            return mask[torch.arange(mask.shape[0]), j.cpu()]
        return mask[:, int(j)]

    def _mode_split(self, j) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(stochastic rows, ode rows) of step ``j`` when ``sde_mask`` makes them differ, else None."""
        if self.sde_mask is None or self.sde_mask.shape[0] != self.batch_size:
            return None
        if not (isinstance(j, torch.Tensor) or (isinstance(j, Integral) and not isinstance(j, bool))):
            return None
        if isinstance(j, torch.Tensor) and (j.dim() != 1 or j.numel() != self.batch_size):
            return None  # _check_loop_steps names it
        if isinstance(j, Integral) and not 0 <= j < self.sde_mask.shape[1]:
            return None
        flags = self._pair_flags(j)
        if bool(flags.all()) or not bool(flags.any()):
            return None
        return flags.nonzero().flatten(), (~flags).nonzero().flatten()

    def _stream_inputs(self, j) -> Dict[str, Any]:
        """This stream's tensors for loop step(s) ``j`` (checked by ``_check_loop_steps``)."""
        position = torch.full((self.num_steps + 1,), -1, dtype=torch.int64, device=self.latent_step_indices.device)
        position[self.latent_step_indices] = torch.arange(self.latents.shape[1], device=position.device)
        if isinstance(j, torch.Tensor):
            rows = torch.arange(self.batch_size, device=self.latents.device)
            steps = j.to(self.latents.device)
            k, k1 = position.to(steps.device)[steps], position.to(steps.device)[steps + 1]
            sample, prev_sample = self.latents[rows, k], self.latents[rows, k1]
            token_sigmas = prev_x0_pred = None
            if self.token_sigmas is not None:
                token_sigmas = self.token_sigmas[rows.to(self.token_sigmas.device), steps.to(self.token_sigmas.device)]
            if self.prev_x0_preds is not None:
                where = self.prev_x0_preds.device
                prev_x0_pred = self.prev_x0_preds[rows.to(where), steps.to(where)]
        else:
            k, k1 = int(position[j]), int(position[j + 1])
            sample, prev_sample = self.latents[:, k], self.latents[:, k1]
            token_sigmas = None if self.token_sigmas is None else self.token_sigmas[:, j]
            prev_x0_pred = None if self.prev_x0_preds is None else self.prev_x0_preds[:, j]
        return dict(sample=sample, prev_sample=prev_sample, sigmas=self.sigmas, token_sigmas=token_sigmas,
                    frozen=self.frozen, prev_x0_pred=prev_x0_pred)

    def _tensors(self) -> Dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        for name in _OPTIONAL_TENSORS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.sde_mask is not None:  # the key only when set: a trajectory without one writes what it did before
            out["sde_mask"] = self.sde_mask
        return out

    def to_wire(self) -> Dict[str, Any]:
        """A JSON-safe dict: tensors as SGLang tensor envelopes, settings as plain values; a joint
        rollout's ``streams`` as a list of such dicts."""
        return trajectory_to_wire(self)

    @classmethod
    def from_wire(cls, wire: Any, *, max_bytes: Optional[int] = None, device=None,
                  _where: str = "RolloutTrajectory wire payload", _nested: bool = False) -> "RolloutTrajectory":
        """Decode ``to_wire``'s dict strictly (it may come from the network): exact key set, tensors
        checked by ``flowrl.data.serialization.from_wire``, then shapes, dtypes and settings checked;
        anything malformed raises ``ValueError``. Format /1 payloads (before per-token sigmas, masks
        and streams) still load."""
        return trajectory_from_wire(cls, wire, max_bytes=max_bytes, device=device, where=_where, nested=_nested)

    def save(self, path) -> None:
        """Write a safetensors file: the tensors under their field names (a joint rollout's streams under
        ``streams.<k>.<field>``), the settings (and the format tag) as string metadata, and a checksum of
        every tensor and of the metadata (``load`` verifies them). Readable by any safetensors reader."""
        save_trajectory(self, path)

    @classmethod
    def load(cls, path, *, max_bytes: Optional[int] = None, device=None) -> "RolloutTrajectory":
        """Read a file written by ``save`` (format /3; /2 and /1 files too), validated as strictly as
        ``from_wire``; a /3 file's checksums are verified first, and a damaged tensor or metadata is
        refused by name."""
        return load_trajectory(cls, path, max_bytes=max_bytes, device=device)

    @classmethod
    def _checked(cls, tensors: Dict[str, torch.Tensor], settings: Dict[str, Any], where: str, device,
                 streams: Optional[Tuple["RolloutTrajectory", ...]] = None,
                 tree: Optional[Dict[str, torch.Tensor]] = None, stream_weights: Optional[list] = None):
        """Build a trajectory from untrusted parts, checking what the fields' docs promise."""
        return checked_trajectory(cls, tensors, settings, where, device, streams, tree, stream_weights)

