"""``RolloutTrajectory``: what a rollout records, for training to recompute log-probs from."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..contract import Mode, ModeRules, Schedule
from ..core import _validate as V
from ..core.step_spec import ddim_options
from ..ops.functional import check_stream_weights, step_log_prob
from .denoising_env import env_of
from .replay import replay_plan
from .serialization import DEFAULT_MAX_BYTES, from_wire, load_safetensors, save_safetensors, to_wire
from .tree import BranchTree
from .trajectory_store import check_device, move, nbytes_per_sample_step

# identifies the wire dict and the safetensors file; bump the version when the layout changes.
# /2 adds token_sigmas, frozen, counts and streams (all optional); /1 payloads and files still load.
# A branching rollout's tree (flowrl.data.tree) adds the key "tree" (files: tensors "tree.<field>"),
# present only when there is a tree, so a /2 payload without one is unchanged.
FORMAT = "flowrl.RolloutTrajectory/2"
FORMAT_V1 = "flowrl.RolloutTrajectory/1"
# files only: /2 plus the metadata key "checksums" (a digest of every tensor's bytes, dtype and shape, and
# one of the other metadata), verified on load; /2 and /1 files (written before) load without it
FILE_FORMAT = "flowrl.RolloutTrajectory/3"
_TENSOR_FIELDS = ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices")
# /2 adds the last four (prev_x0_preds: dpm_sde's second order)
_OPTIONAL_TENSORS = ("sde_steps", "token_sigmas", "frozen", "counts", "prev_x0_preds")
_SETTING_FIELDS = ("mode", "noise_level", "log_prob", "reduction")  # the keys in payloads and files
# a key's attribute where they differ: the formats keep "log_prob" for the kind (a renamed key would be a new
# format); the attribute says what it is, beside the log_probs tensor
_ATTRIBUTES = {"log_prob": "log_prob_kind"}


_DDIM_FIELDS = ("prediction_type", "clip_sample_range")  # mode='ddim' settings (keys only for ddim)


def _attr(key: str) -> str:
    return _ATTRIBUTES.get(key, key)


def _rules(mode) -> Optional[ModeRules]:
    """The mode table's row (``contract.MODE_RULES``) for the label ``mode``; None when ``mode`` names
    no mode (an untrusted payload's, which its checks reject)."""
    return Mode[mode.upper()].rules if isinstance(mode, str) and mode in Mode.labels() else None


def _alpha_bar(mode) -> bool:
    """Whether ``mode``'s ``sigmas`` is an alpha-bar table (ddim): a pair per step, not T + 1 sigmas."""
    rules = _rules(mode)
    return rules is not None and rules.schedule is Schedule.ALPHA_BAR


def _has_ddim_fields(mode) -> bool:
    """Whether ``mode`` reads the settings ``_DDIM_FIELDS`` (ddim's prediction type and clip range)."""
    rules = _rules(mode)
    return rules is not None and set(_DDIM_FIELDS) <= set(rules.extra_inputs)


def _reads_prev_x0(mode) -> bool:
    """Whether ``mode`` reads the previous step's data prediction (dpm_sde at order 2)."""
    rules = _rules(mode)
    return rules is not None and "prev_x0_pred" in rules.extra_inputs


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

    def __post_init__(self) -> None:
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

        def to(v):
            if isinstance(v, tuple):
                return tuple(to(x) for x in v)
            return v.to(device) if isinstance(v, torch.Tensor) else v

        inputs = {k: to(v) for k, v in self.step_inputs(j).items()}
        return step_log_prob(model_output=model_output, **{**inputs, **kwargs})

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
            tree=None if self.tree is None else self.tree.select_row(i),
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
        num_steps = self.num_steps
        if isinstance(j, torch.Tensor):
            if j.dtype.is_floating_point or j.dtype == torch.bool or j.dim() != 1 or j.numel() != self.batch_size:
                raise ValueError(f"j must be an int or an integer tensor [B = {self.batch_size}]; got {j.dtype} {tuple(j.shape)}")
            values = sorted(set(j.tolist()))
        elif isinstance(j, Integral) and not isinstance(j, bool):
            values = [int(j)]
        else:
            raise TypeError(f"j must be an int or an integer tensor [B]; got {type(j).__name__}")
        if values[0] < 0 or values[-1] >= num_steps:
            raise ValueError(f"j must be a loop step in [0, {num_steps - 1}]; got {values[0] if values[0] < 0 else values[-1]}")
        kept = set(self.latent_step_indices.tolist())
        missing = sorted({v for v in values for v in (v, v + 1)} - kept)
        if missing:
            raise ValueError(
                f"step j needs latents[:, j] and latents[:, j + 1]; this trajectory did not keep loop step(s) {missing} "
                f"(latent_step_indices = {sorted(kept)})"
            )
        if self.sde_steps is None:
            return values, self.mode
        sde = set(self.sde_steps.tolist())
        stochastic = {v in sde for v in values}
        if len(stochastic) > 1:
            raise ValueError("j mixes sde steps and ode steps (sde_steps); recompute them in separate calls")
        return values, self.mode if stochastic.pop() else "ode"

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
                prev_x0_pred = self.prev_x0_preds[rows.to(self.prev_x0_preds.device), steps.to(self.prev_x0_preds.device)]
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
        return out

    def to_wire(self) -> Dict[str, Any]:
        """A JSON-safe dict: tensors as SGLang tensor envelopes, settings as plain values; a joint
        rollout's ``streams`` as a list of such dicts."""
        wire = to_wire(self._tensors())
        for name in _OPTIONAL_TENSORS:
            wire[name] = wire.get(name)
        wire.update({key: getattr(self, _attr(key)) for key in _SETTING_FIELDS})
        wire["noise_level"] = float(self.noise_level)
        if _has_ddim_fields(self.mode):
            wire.update({name: getattr(self, name) for name in _DDIM_FIELDS})
        wire["streams"] = None if self.streams is None else [s.to_wire() for s in self.streams]
        if self.stream_weights is not None:  # the key only when weighted: an unweighted payload is unchanged
            wire["stream_weights"] = list(self.stream_weights)
        if self.tree is not None:
            wire["tree"] = to_wire(self.tree.to_tensors())
        wire["format"] = FORMAT
        return wire

    @classmethod
    def from_wire(cls, wire: Any, *, max_bytes: Optional[int] = None, device=None,
                  _where: str = "RolloutTrajectory wire payload", _nested: bool = False) -> "RolloutTrajectory":
        """Decode ``to_wire``'s dict strictly (it may come from the network): exact key set, tensors
        checked by ``flowrl.data.serialization.from_wire``, then shapes, dtypes and settings checked;
        anything malformed raises ``ValueError``. Format /1 payloads (before per-token sigmas, masks
        and streams) still load."""
        where = _where
        if not isinstance(wire, dict):
            raise ValueError(f"{where} must be an object; got {type(wire).__name__}")
        version = wire.get("format")
        if version not in (FORMAT, FORMAT_V1):
            raise ValueError(f"{where}: format must be {FORMAT!r} (or {FORMAT_V1!r}); got {version!r}")
        optional = ("sde_steps",) if version == FORMAT_V1 else _OPTIONAL_TENSORS
        expected = set(_TENSOR_FIELDS) | set(_SETTING_FIELDS) | set(optional) | {"format"}
        if version == FORMAT:
            expected.add("streams")
            if "tree" in wire and not _nested:
                expected.add("tree")
            if "stream_weights" in wire and not _nested:
                expected.add("stream_weights")
        if _has_ddim_fields(wire.get("mode")):
            expected |= set(_DDIM_FIELDS)
        if set(wire) != expected:
            raise ValueError(
                f"{where}: missing keys {sorted(expected - set(wire))}, unexpected keys {sorted(set(wire) - expected)}"
            )
        tensor_names = list(_TENSOR_FIELDS) + [name for name in optional if wire[name] is not None]
        for name in tensor_names:
            if not isinstance(wire[name], dict) or wire[name].get("__tensor__") is not True:
                raise ValueError(f"{where}: {name} must be a tensor envelope")
        max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        tensors = from_wire({name: wire[name] for name in tensor_names}, max_bytes=max_bytes)
        settings = {name: wire[name] for name in _SETTING_FIELDS + _DDIM_FIELDS if name in wire}
        streams = None
        if wire.get("streams") is not None:
            if _nested or not isinstance(wire["streams"], list) or len(wire["streams"]) < 2:
                raise ValueError(f"{where}: streams must be null or a list of at least 2 stream payloads (not nested)")
            streams = tuple(
                cls.from_wire(w, max_bytes=max_bytes, device=device, _where=f"{where}: streams[{k}]", _nested=True)
                for k, w in enumerate(wire["streams"])
            )
        tree = None
        if "tree" in expected:
            envelopes = wire["tree"]
            if not isinstance(envelopes, dict) or not all(
                    isinstance(e, dict) and e.get("__tensor__") is True for e in envelopes.values()):
                raise ValueError(f"{where}: tree must be an object of tensor envelopes")
            tree = from_wire(envelopes, max_bytes=max_bytes)
        weights = wire.get("stream_weights") if "stream_weights" in expected else None
        if "stream_weights" in expected and not isinstance(weights, list):
            raise ValueError(f"{where}: stream_weights must be a list of numbers (one per stream)")
        return cls._checked(tensors, settings, where, device, streams, tree, weights)

    def save(self, path) -> None:
        """Write a safetensors file: the tensors under their field names (a joint rollout's streams under
        ``streams.<k>.<field>``), the settings (and the format tag) as string metadata, and a checksum of
        every tensor and of the metadata (``load`` verifies them). Readable by any safetensors reader."""
        metadata = {key: str(getattr(self, _attr(key))) for key in ("mode", "log_prob", "reduction")}
        metadata["noise_level"] = repr(float(self.noise_level))  # repr round-trips a float exactly
        if _has_ddim_fields(self.mode):  # JSON: None and a float round-trip exactly
            metadata.update({name: json.dumps(getattr(self, name)) for name in _DDIM_FIELDS})
        metadata["format"] = FORMAT
        metadata["streams"] = str(self.num_streams if self.streams is not None else 0)
        tensors = self._tensors()
        for k, stream in enumerate(self.streams or ()):
            tensors.update({f"streams.{k}.{name}": t for name, t in stream._tensors().items()})
        if self.tree is not None:
            tensors.update({f"tree.{name}": t for name, t in self.tree.to_tensors().items()})
        if self.stream_weights is not None:  # JSON: a float round-trips exactly
            metadata["stream_weights"] = json.dumps(list(self.stream_weights))
        metadata["format"] = FILE_FORMAT
        metadata["checksums"] = json.dumps(_checksums(tensors, metadata))
        save_safetensors(path, tensors, metadata)

    @classmethod
    def load(cls, path, *, max_bytes: Optional[int] = None, device=None) -> "RolloutTrajectory":
        """Read a file written by ``save`` (format /3; /2 and /1 files too), validated as strictly as
        ``from_wire``; a /3 file's checksums are verified first, and a damaged tensor or metadata is
        refused by name."""
        where = f"RolloutTrajectory file {str(path)!r}"
        try:
            tensors, metadata = load_safetensors(path, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        except ValueError as exc:
            raise ValueError(f"{where}: not a readable flowrl trajectory file: {exc}") from None
        version = metadata.get("format")
        if version == FILE_FORMAT:
            _verify_checksums(tensors, metadata, where)
            metadata = {k: v for k, v in metadata.items() if k != "checksums"}
            version = metadata["format"] = FORMAT
        elif version not in (FORMAT, FORMAT_V1):
            raise ValueError(f"{where}: metadata format must be {FILE_FORMAT!r} (or the older {FORMAT!r}, "
                             f"{FORMAT_V1!r}); got {version!r}: not a flowrl trajectory file")
        expected = set(_SETTING_FIELDS) | {"format"} | (set(_DDIM_FIELDS) if _has_ddim_fields(metadata.get("mode")) else set())
        optional_keys = {"streams", "stream_weights"}
        if set(metadata) - optional_keys != expected or (version == FORMAT_V1 and optional_keys & set(metadata)):
            extra = " plus optional 'streams', 'stream_weights'" if version == FORMAT else ""
            raise ValueError(f"{where}: metadata keys must be {sorted(expected)}{extra}; got {sorted(metadata)}")
        num_streams = 0
        if "streams" in metadata:
            if not metadata["streams"].isdigit() or int(metadata["streams"]) == 1 or int(metadata["streams"]) > 64:
                raise ValueError(f"{where}: metadata streams must be 0 or a count in [2, 64]; got {metadata['streams']!r}")
            num_streams = int(metadata["streams"])
        optional = {"sde_steps"} if version == FORMAT_V1 else set(_OPTIONAL_TENSORS)
        allowed = set(_TENSOR_FIELDS) | optional
        groups: List[Dict[str, torch.Tensor]] = [dict() for _ in range(num_streams + 1)]
        tree = None
        if version == FORMAT and any(name.startswith("tree.") for name in tensors):
            tree = {name[5:]: tensors.pop(name) for name in list(tensors) if name.startswith("tree.")}
        for name, t in tensors.items():
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "streams" and parts[1].isdigit() and int(parts[1]) < num_streams:
                groups[1 + int(parts[1])][parts[2]] = t
            else:
                groups[0][name] = t
        for k, group in enumerate(groups):
            if not set(_TENSOR_FIELDS) <= set(group) <= allowed:
                label = "tensors" if k == 0 else f"stream {k - 1} tensors"
                raise ValueError(
                    f"{where}: {label} must be {sorted(_TENSOR_FIELDS)} plus optional {sorted(optional)}; got {sorted(group)}"
                )
        try:
            noise_level = float(metadata["noise_level"])
        except ValueError:
            raise ValueError(f"{where}: noise_level {metadata['noise_level']!r} is not a number") from None
        settings = {name: metadata[name] for name in ("mode", "log_prob", "reduction")}
        settings["noise_level"] = noise_level
        for name in _DDIM_FIELDS:
            if name in metadata:
                try:
                    settings[name] = json.loads(metadata[name])
                except ValueError:
                    raise ValueError(f"{where}: {name} {metadata[name]!r} is not JSON") from None
        streams = None
        if num_streams:
            streams = tuple(
                cls._checked(g, dict(settings, reduction="sum"), f"{where}: stream {k}", device)
                for k, g in enumerate(groups[1:])
            )
        weights = None
        if "stream_weights" in metadata:
            try:
                weights = json.loads(metadata["stream_weights"])
            except ValueError:
                raise ValueError(f"{where}: stream_weights {metadata['stream_weights']!r} is not JSON") from None
            if not isinstance(weights, list):
                raise ValueError(f"{where}: stream_weights must be a list of numbers (one per stream)")
        return cls._checked(groups[0], settings, where, device, streams, tree, weights)

    @classmethod
    def _checked(cls, tensors: Dict[str, torch.Tensor], settings: Dict[str, Any], where: str, device,
                 streams: Optional[Tuple["RolloutTrajectory", ...]] = None, tree: Optional[Dict[str, torch.Tensor]] = None,
                 stream_weights: Optional[list] = None):
        """Build a trajectory from untrusted parts, checking what the fields' docs promise."""
        mode, noise_level = settings["mode"], settings["noise_level"]
        try:
            V.check_choice("mode", mode, V.MODES)
            V.check_choice("log_prob", settings["log_prob"], V.LOG_PROB_KINDS)
            V.check_choice("reduction", settings["reduction"], V.REDUCTIONS)
            if isinstance(noise_level, bool) or not isinstance(noise_level, Real):
                raise ValueError(f"noise_level must be a number; got {noise_level!r}")
            noise_level = V.check_noise_level(noise_level, mode)
            ddim = ddim_options(mode, settings.get("prediction_type"), settings.get("clip_sample_range"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None

        latents, log_probs = tensors["latents"], tensors["log_probs"]
        timesteps, sigmas, steps = tensors["timesteps"], tensors["sigmas"], tensors["latent_step_indices"]
        sde_steps = tensors.get("sde_steps")
        token_sigmas, frozen, counts = tensors.get("token_sigmas"), tensors.get("frozen"), tensors.get("counts")

        def fail(msg: str):
            raise ValueError(f"{where}: {msg}")

        try:
            if _alpha_bar(mode):
                sigmas = V.check_alpha_bar_table(sigmas, sigmas.device, allow_zero_alpha=ddim["prediction"].label != "epsilon")
            else:
                sigmas = V.check_sigmas(sigmas, sigmas.device)
        except (ValueError, TypeError) as exc:
            fail(str(exc))
        num_steps = sigmas.numel() // 2 if _alpha_bar(mode) else sigmas.numel() - 1
        if not latents.dtype.is_floating_point or latents.dim() < 2:
            fail(f"latents must be a float tensor [B, K, ...]; got {latents.dtype} {tuple(latents.shape)}")
        batch, kept = latents.shape[0], latents.shape[1]
        if log_probs.dtype != torch.float32 or tuple(log_probs.shape) != (batch, num_steps):
            fail(f"log_probs must be float32 [B, T] = [{batch}, {num_steps}]; got {log_probs.dtype} {tuple(log_probs.shape)}")
        if timesteps.dim() != 1 or timesteps.numel() != num_steps or timesteps.dtype == torch.bool:
            fail(f"timesteps must be 1-D numeric of length T = {num_steps}; got {timesteps.dtype} {tuple(timesteps.shape)}")
        if counts is not None and (counts.dtype != torch.float32 or tuple(counts.shape) != (batch, num_steps)):
            fail(f"counts must be float32 [B, T] = [{batch}, {num_steps}]; got {counts.dtype} {tuple(counts.shape)}")
        latent = latents.shape[2:]

        def broadcasts(t: torch.Tensor, lead: tuple) -> bool:
            return (t.dim() == len(lead) + len(latent) and tuple(t.shape[:len(lead)]) == lead
                    and all(d in (1, s) for d, s in zip(t.shape[len(lead):], latent)))

        if token_sigmas is not None:
            if token_sigmas.dtype != torch.float32 or not broadcasts(token_sigmas, (batch, num_steps)):
                fail(f"token_sigmas must be float32 [B, T, ...] broadcastable to a latent {tuple(latent)}; got "
                     f"{token_sigmas.dtype} {tuple(token_sigmas.shape)}")
            lo, hi = (float(token_sigmas.min()), float(token_sigmas.max())) if token_sigmas.numel() else (0.0, 0.0)
            if not (0.0 <= lo and hi <= 1.0):
                fail(f"token_sigmas must lie in [0, 1]; got values in [{lo}, {hi}]")
        if frozen is not None and (frozen.dtype != torch.bool or not broadcasts(frozen, (batch,))):
            fail(f"frozen must be bool [B, ...] broadcastable to a latent {tuple(latent)}; got {frozen.dtype} {tuple(frozen.shape)}")

        def check_index(name: str, t: torch.Tensor, length: Optional[int], upper: int):
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
                fail(f"{name} must be a 1-D integer tensor; got {t.dtype} {tuple(t.shape)}")
            if length is not None and t.numel() != length:
                fail(f"{name} must have length {length}; got {t.numel()}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) > upper):
                fail(f"{name} values must lie in [0, {upper}]")
            return t.to(torch.int64)

        steps = check_index("latent_step_indices", steps, kept, num_steps)
        if sde_steps is not None:
            sde_steps = check_index("sde_steps", sde_steps, None, num_steps - 1)
        prev_x0_preds = tensors.get("prev_x0_preds")
        if prev_x0_preds is not None and (
                prev_x0_preds.dtype not in (torch.float32, torch.float64)
                or tuple(prev_x0_preds.shape) != (batch, num_steps) + tuple(latents.shape[2:])):
            fail(f"prev_x0_preds must be float32 (float64) [B, T, ...] = {[batch, num_steps, *latents.shape[2:]]}; got "
                 f"{prev_x0_preds.dtype} {tuple(prev_x0_preds.shape)}")
        if prev_x0_preds is not None and not _reads_prev_x0(mode):
            fail(f"prev_x0_preds is mode 'dpm_sde''s; got mode {mode!r}")
        if streams is not None:
            if any(st.batch_size != batch or st.num_steps != num_steps for st in streams):
                fail("every stream must have the batch size and step count of the trajectory")
            if not torch.equal(streams[0].latents.to(latents.device), latents):
                fail("streams[0] must be the trajectory's own stream (the same latents)")
        if tree is not None:
            if streams is not None:
                fail("a branching rollout's tree and joint streams are not combined")
            tree = BranchTree.from_tensors(tree, batch, num_steps, where=f"{where}: tree")
        if stream_weights is not None:
            if streams is None:
                fail("stream_weights weights a joint rollout's streams; this payload has no streams")
            try:
                stream_weights = check_stream_weights(stream_weights, len(streams))
            except (ValueError, TypeError) as exc:
                fail(str(exc))
        fields = dict(
            latents=latents, log_probs=log_probs, timesteps=timesteps, sigmas=sigmas, latent_step_indices=steps,
            sde_steps=sde_steps, token_sigmas=token_sigmas, frozen=frozen, counts=counts, prev_x0_preds=prev_x0_preds,
        )
        if device is not None:
            fields = {k: (v.to(device) if v is not None else None) for k, v in fields.items()}
        if ddim:
            fields.update(prediction_type=ddim["prediction"].label, clip_sample_range=ddim["clip_sample_range"])
        return cls(**fields, mode=mode, noise_level=noise_level, log_prob_kind=settings["log_prob"],
                   reduction=settings["reduction"], streams=streams, tree=tree, stream_weights=stream_weights)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _checksums(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> Dict[str, Any]:
    """A digest per tensor (its dtype, shape and bytes) and one of the metadata (every key but this one)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        h = hashlib.blake2b(f"{t.dtype}{list(t.shape)}".encode(), digest_size=16)
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the bytes
        out[name] = h.hexdigest()
    settings = {k: v for k, v in metadata.items() if k != "checksums"}
    return {"tensors": out, "metadata": _digest(json.dumps(settings, sort_keys=True).encode())}


def _verify_checksums(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str], where: str) -> None:
    try:
        recorded = json.loads(metadata.get("checksums", ""))
        recorded["tensors"], recorded["metadata"]  # noqa: B018  (both present)
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"{where}: the checksums metadata is missing or unreadable: the file is damaged") from None
    actual = _checksums(tensors, metadata)
    if set(recorded["tensors"]) != set(actual["tensors"]):
        raise ValueError(f"{where}: damaged: it holds tensors {sorted(actual['tensors'])}, its checksums name "
                         f"{sorted(recorded['tensors'])}")
    for name in sorted(actual["tensors"]):
        if actual["tensors"][name] != recorded["tensors"][name]:
            raise ValueError(f"{where}: damaged: tensor {name!r} does not match its checksum (its bytes changed "
                             "since it was saved)")
    if actual["metadata"] != recorded["metadata"]:
        raise ValueError(f"{where}: damaged: the metadata (settings {sorted(k for k in metadata if k != 'checksums')}) "
                         "does not match its checksum (edited since it was saved)")
