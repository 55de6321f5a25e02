"""``RolloutTrajectory``: what a rollout records, for training to recompute log-probs from."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any, Dict, List, Optional

import torch

from . import _validate as V
from .step_spec import ddim_options

# identifies the wire dict and the safetensors file; bump the version when the layout changes
FORMAT = "flowrl.RolloutTrajectory/1"
_TENSOR_FIELDS = ("latents", "log_probs", "timesteps", "sigmas", "latent_step_indices")
_SETTING_FIELDS = ("mode", "noise_level", "log_prob", "reduction")
_DDIM_FIELDS = ("prediction_type", "clip_sample_range")  # mode='ddim' settings (optional keys elsewhere)


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
    mode, noise_level, log_prob, reduction: the rollout settings, to recompute with the same ones.
    sde_steps: int64 [S] loop steps that were stochastic (the others ran as ``ode``), or None for all.
    prev_x0_preds: [B, T, ...] float32, the previous data prediction each step's mean read (mode
        'dpm_sde' at solver order 2: row i is ``x_{i-1} - sigma_{i-1} v_{i-1}`` of the rollout, zeros at
        step 0, which reads none), to recompute with ``step_log_prob(..., prev_x0_pred=)``; else None.
    prediction_type, clip_sample_range: mode 'ddim''s model output type and x0 clip (None otherwise);
        for ddim ``sigmas`` is the alpha-bar table [2T] of (alpha_bar_t, alpha_bar_prev) pairs
        (flowrl.ddim.alpha_bar_table). ``step_options()`` gives every setting a recompute passes.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    latent_step_indices: Optional[torch.Tensor] = None  # a tensor after __init__
    mode: str = "sde"
    noise_level: float = 0.7
    log_prob: str = "gaussian"
    reduction: str = "mean"
    sde_steps: Optional[torch.Tensor] = None
    prev_x0_preds: Optional[torch.Tensor] = None
    prediction_type: Optional[str] = None
    clip_sample_range: Optional[float] = None

    def __post_init__(self) -> None:
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
        return int(self.sigmas.numel() // 2 if self.mode == "ddim" else self.sigmas.numel() - 1)

    def step_options(self) -> Dict[str, Any]:
        """The keyword options that recompute this rollout's steps (``flowrl.step_log_prob(x, v, x',
        traj.sigmas, i, **traj.step_options())``): mode, noise_level, log_prob, reduction, and ddim's
        prediction_type / clip_sample_range."""
        options = {name: getattr(self, name) for name in _SETTING_FIELDS}
        if self.mode == "ddim":
            options.update({name: getattr(self, name) for name in _DDIM_FIELDS})
        return options

    # ----------------------------------------------------------------------------------------------
    # per-sample split, wire format, files

    def split(self) -> List["RolloutTrajectory"]:
        """One trajectory per sample (batch size 1 each; views, no copies). Per-sample fields
        (``latents``, ``log_probs``) are sliced on dim 0; the schedule (``sigmas``, ``timesteps``),
        ``latent_step_indices`` and ``sde_steps`` are shared by all samples and never sliced, even
        when their length happens to equal the batch size."""
        return [
            replace(self, latents=self.latents[i:i + 1], log_probs=self.log_probs[i:i + 1],
                    prev_x0_preds=None if self.prev_x0_preds is None else self.prev_x0_preds[i:i + 1])
            for i in range(self.batch_size)
        ]

    def _tensors(self) -> Dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        if self.sde_steps is not None:
            out["sde_steps"] = self.sde_steps
        if self.prev_x0_preds is not None:  # optional key: payloads without it stay valid
            out["prev_x0_preds"] = self.prev_x0_preds
        return out

    def to_wire(self) -> Dict[str, Any]:
        """A JSON-safe dict: tensors as SGLang tensor envelopes, settings as plain values."""
        from .serialization import to_wire

        wire = to_wire(self._tensors())
        wire["sde_steps"] = wire.get("sde_steps")
        wire.update({name: getattr(self, name) for name in _SETTING_FIELDS})
        wire["noise_level"] = float(self.noise_level)
        if self.mode == "ddim":
            wire.update({name: getattr(self, name) for name in _DDIM_FIELDS})
        wire["format"] = FORMAT
        return wire

    @classmethod
    def from_wire(cls, wire: Any, *, max_bytes: Optional[int] = None, device=None) -> "RolloutTrajectory":
        """Decode ``to_wire``'s dict strictly (it may come from the network): exact key set, tensors
        checked by ``flowrl.serialization.from_wire``, then shapes, dtypes and settings checked;
        anything malformed raises ``ValueError``."""
        from .serialization import DEFAULT_MAX_BYTES, from_wire

        if not isinstance(wire, dict):
            raise ValueError(f"a RolloutTrajectory wire payload must be an object; got {type(wire).__name__}")
        expected = set(_TENSOR_FIELDS) | set(_SETTING_FIELDS) | {"sde_steps", "format"}
        expected |= {"prev_x0_preds"} & set(wire)  # optional (dpm_sde order 2)
        expected |= set(_DDIM_FIELDS) if wire.get("mode") == "ddim" else set()
        if set(wire) != expected:
            raise ValueError(
                f"RolloutTrajectory wire payload: missing keys {sorted(expected - set(wire))}, "
                f"unexpected keys {sorted(set(wire) - expected)}"
            )
        if wire["format"] != FORMAT:
            raise ValueError(f"RolloutTrajectory wire payload: format must be {FORMAT!r}; got {wire['format']!r}")
        tensor_names = list(_TENSOR_FIELDS) + (["sde_steps"] if wire["sde_steps"] is not None else [])
        tensor_names += ["prev_x0_preds"] if "prev_x0_preds" in wire else []
        for name in tensor_names:
            if not isinstance(wire[name], dict) or wire[name].get("__tensor__") is not True:
                raise ValueError(f"RolloutTrajectory wire payload: {name} must be a tensor envelope")
        tensors = from_wire(
            {name: wire[name] for name in tensor_names},
            max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
        )
        settings = {name: wire[name] for name in _SETTING_FIELDS + _DDIM_FIELDS if name in wire}
        return cls._checked(tensors, settings, "RolloutTrajectory wire payload", device)

    def save(self, path) -> None:
        """Write a safetensors file: the tensors under their field names, the settings (and the
        format tag) as string metadata. Readable by any safetensors reader."""
        from .serialization import save_safetensors

        metadata = {name: str(getattr(self, name)) for name in ("mode", "log_prob", "reduction")}
        metadata["noise_level"] = repr(float(self.noise_level))  # repr round-trips a float exactly
        if self.mode == "ddim":  # JSON: None and a float round-trip exactly
            metadata.update({name: json.dumps(getattr(self, name)) for name in _DDIM_FIELDS})
        metadata["format"] = FORMAT
        save_safetensors(path, self._tensors(), metadata)

    @classmethod
    def load(cls, path, *, max_bytes: Optional[int] = None, device=None) -> "RolloutTrajectory":
        """Read a file written by ``save``, validated as strictly as ``from_wire``."""
        from .serialization import DEFAULT_MAX_BYTES, load_safetensors

        where = f"RolloutTrajectory file {str(path)!r}"
        tensors, metadata = load_safetensors(path, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{where}: metadata format must be {FORMAT!r}; got {metadata.get('format')!r}")
        expected = set(_SETTING_FIELDS) | {"format"} | (set(_DDIM_FIELDS) if metadata.get("mode") == "ddim" else set())
        if set(metadata) != expected:
            raise ValueError(f"{where}: metadata keys must be {sorted(expected)}; got {sorted(metadata)}")
        allowed = set(_TENSOR_FIELDS) | {"sde_steps", "prev_x0_preds"}
        if not set(_TENSOR_FIELDS) <= set(tensors) <= allowed:
            raise ValueError(
                f"{where}: tensors must be {sorted(_TENSOR_FIELDS)} plus optional 'sde_steps', 'prev_x0_preds'; "
                f"got {sorted(tensors)}"
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
        return cls._checked(tensors, settings, where, device)

    @classmethod
    def _checked(cls, tensors: Dict[str, torch.Tensor], settings: Dict[str, Any], where: str, device):
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

        def fail(msg: str):
            raise ValueError(f"{where}: {msg}")

        try:
            if mode == "ddim":
                sigmas = V.check_alpha_bar_table(sigmas, sigmas.device, allow_zero_alpha=ddim["prediction"].label != "epsilon")
            else:
                sigmas = V.check_sigmas(sigmas, sigmas.device)
        except (ValueError, TypeError) as exc:
            fail(str(exc))
        num_steps = sigmas.numel() // 2 if mode == "ddim" else sigmas.numel() - 1
        if not latents.dtype.is_floating_point or latents.dim() < 2:
            fail(f"latents must be a float tensor [B, K, ...]; got {latents.dtype} {tuple(latents.shape)}")
        batch, kept = latents.shape[0], latents.shape[1]
        if log_probs.dtype != torch.float32 or tuple(log_probs.shape) != (batch, num_steps):
            fail(f"log_probs must be float32 [B, T] = [{batch}, {num_steps}]; got {log_probs.dtype} {tuple(log_probs.shape)}")
        if timesteps.dim() != 1 or timesteps.numel() != num_steps or timesteps.dtype == torch.bool:
            fail(f"timesteps must be 1-D numeric of length T = {num_steps}; got {timesteps.dtype} {tuple(timesteps.shape)}")

        def check_index(name: str, t: torch.Tensor, length: Optional[int], upper: int):
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
                fail(f"{name} must be a 1-D integer tensor; got {t.dtype} {tuple(t.shape)}")
            if length is not None and t.numel() != length:
                fail(f"{name} must have length {length}; got {t.numel()}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) > upper):
                fail(f"{name} values must lie in [0, {upper}]")
            return t.to(torch.int64)

        steps = check_index("latent_step_indices", steps, kept, num_steps)
        prev_x0_preds = tensors.get("prev_x0_preds")
        if prev_x0_preds is not None and (
                prev_x0_preds.dtype not in (torch.float32, torch.float64)
                or tuple(prev_x0_preds.shape) != (batch, num_steps) + tuple(latents.shape[2:])):
            fail(f"prev_x0_preds must be float32 (float64) [B, T, ...] = {[batch, num_steps, *latents.shape[2:]]}; got "
                 f"{prev_x0_preds.dtype} {tuple(prev_x0_preds.shape)}")
        if prev_x0_preds is not None and mode != "dpm_sde":
            fail(f"prev_x0_preds is mode 'dpm_sde''s; got mode {mode!r}")
        if sde_steps is not None:
            sde_steps = check_index("sde_steps", sde_steps, None, num_steps - 1)
        fields = dict(
            latents=latents, log_probs=log_probs, timesteps=timesteps, sigmas=sigmas, latent_step_indices=steps,
            sde_steps=sde_steps, prev_x0_preds=prev_x0_preds,
        )
        if device is not None:
            fields = {k: (v.to(device) if v is not None else None) for k, v in fields.items()}
        if ddim:
            fields.update(prediction_type=ddim["prediction"].label, clip_sample_range=ddim["clip_sample_range"])
        return cls(**fields, mode=mode, noise_level=noise_level, log_prob=settings["log_prob"],
                   reduction=settings["reduction"])
